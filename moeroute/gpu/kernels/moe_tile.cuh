// The grouped-GEMM tile loops of every expert kernel, written once over a weight decoder.
//
// A thread block owns one tile of TILE_M rows of the expert-sorted, block-padded layout
// (docs/semantics.md sections 4 and 5) and a slice of output columns of one expert; it walks k,
// stages A (through the rows' token index) and B (decoded by the format) in shared memory,
// multiplies in float32, promotes block-scaled sums, and runs one epilogue (bias, gated
// activation or router weight, store in the output type). The formats differ only in their
// decoder, a small struct of inline device functions:
//
//   SIMT loop (moe_tile_simt, every GPU, HIP and the host emulation): values as float32.
//     a_value(a_row, col)                 activation at (row of A, column of k), float32
//     b_pair(expert, gate, col, kcol, hi_valid, lo, hi)
//                                         weights at k columns kcol, kcol + 1 of output column
//                                         `col` of projection `gate` (hi read only if hi_valid)
//     bias(expert, gate, col)             the bias entry (read only when has_bias)
//     kGrouped                            sums promoted per group of group_k() columns with
//       row_scale(a_row, g) * col_scale(expert, gate, col, g); else one group, no scales
//   Decoders: FloatDecoder (moe_gemm.cu), Fp8Decoder (w8a8) and Fp8W16Decoder (w8a16,
//   moe_gemm_fp8.cu), Mxfp4Decoder (moe_gemm_mxfp4.cu), Int4Decoder (moe_gemm_int4.cu).
//
//   Narrow-weight mma loop (moe_tile_narrow_mma, sm_80+): 16-bit activations and weights of 8
//   or 4 bits, decoded in registers to exact 16-bit values and multiplied with mma.sync
//   m16n8k16 in blocks of 32 k columns whose float32 sums are promoted with the block's scale.
//     kValuesPerByte (1: bytes, 2: nibbles)
//                                         a weight row is k / kValuesPerByte bytes
//     stage_metadata(shared, expert, n0, tid)
//                                         per-tile bytes staged once after the stages (MXFP4
//                                         scale bytes, INT4 zero points; the launcher sizes them)
//     pair16<T>(shared, tile_row, k_block, row, first)
//                                         the B fragment register of the two 16-bit values at
//                                         k columns first, first + 1 of a staged row
//     block_scale(shared, tile_row, expert, gate, col, k_block)
//                                         the float32 scale of a 32-column block
//   Decoders: Fp8W16Decoder (e4m3 bytes), Mxfp4Decoder, Int4Decoder. The float (moe_gemm_mma)
//   and the FP8 e4m3 x e4m3 (moe_gemm_fp8_mma) matrix kernels keep their own loops: their B
//   operand is not decoded.
#pragma once

#include "compat.cuh"

namespace moeroute {

// Activation codes, shared with moeroute/gpu/launch.py (ACTIVATIONS).
constexpr int kActivationSilu = 0;
constexpr int kActivationGelu = 1;      // exact: 0.5 x (1 + erf(x / sqrt(2)))
constexpr int kActivationGeluTanh = 2;  // tanh approximation, as torch's approximate="tanh"
constexpr int kActivationSwigluOai = 3; // gpt-oss: clamped gate and up, (up + 1) * gate * sigmoid(1.702 gate)

constexpr float kInverseSqrt2 = 0.70710678118654752f;
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kGeluTanhCubic = 0.044715f;
constexpr float kSwigluOaiAlpha = 1.702f;  // gpt-oss swiglu_alpha
constexpr float kSwigluOaiLimit = 7.0f;    // gpt-oss swiglu_limit

MOEROUTE_DEVICE float activate(float x, int activation) {
  switch (activation) {
    case kActivationGelu:
      return 0.5f * x * (1.0f + erff(x * kInverseSqrt2));
    case kActivationGeluTanh:
      return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + kGeluTanhCubic * x * x * x)));
    case kActivationSilu:
    default:
      return x / (1.0f + expf(-x));
  }
}

// The gated MLP's intermediate value from the gate and up products.
MOEROUTE_DEVICE float gated_activate(float gate, float up, int activation) {
  if (activation == kActivationSwigluOai) {
    const float g = fminf(gate, kSwigluOaiLimit);
    const float u = fminf(fmaxf(up, -kSwigluOaiLimit), kSwigluOaiLimit);
    return (u + 1.0f) * (g / (1.0f + expf(-kSwigluOaiAlpha * g)));
  }
  return activate(gate, activation) * up;
}

// SIMT tiling: 256 threads as a 16 x 16 grid, each owning TILE_M/16 rows x 4 columns.
constexpr int kSimtThreadsX = 16;
constexpr int kSimtThreadsY = 16;
constexpr int kSimtThreads = kSimtThreadsX * kSimtThreadsY;
constexpr int kSimtBlockN = 64;  // output columns per block
constexpr int kSimtBlockK = 16;  // reduction slice staged in shared memory per step
// Two resident blocks per multiprocessor: one loads its tiles while the other computes. (With
// the thread count alone, ptxas squeezes the small tiles into 40 registers and spills.)
constexpr int kSimtMinBlocksPerMultiprocessor = 2;
static_assert(kSimtBlockK % 2 == 0, "B is staged two k columns at a time");

// Grid: (row tiles, ceil(n / kSimtBlockN)); block: kSimtThreads. Rows of A: j / top_k for
// entry j of the sorted layout; C [numel, n] in T.
template <typename Decoder, typename T, int TILE_M, int GATED>
MOEROUTE_DEVICE void moe_tile_simt(const Decoder& decoder, T* __restrict__ c, const int* __restrict__ sorted_token_ids,
                                   const int* __restrict__ expert_ids, const float* __restrict__ topk_weights,
                                   int numel, int top_k, int n, int k, int block_size, int activation,
                                   int apply_router_weight, int has_bias) {
  constexpr int GATES = GATED ? 2 : 1;
  constexpr int ROWS_PER_THREAD = TILE_M / kSimtThreadsY;
  constexpr int COLS_PER_THREAD = kSimtBlockN / kSimtThreadsX;
  constexpr int PAIRS = kSimtBlockK / 2;
  static_assert(TILE_M % kSimtThreadsY == 0, "TILE_M must be a multiple of the thread grid height");

  // +1 column: the transposed stores of a warp hit 32 different banks.
  __shared__ float a_tile[kSimtBlockK][TILE_M + 1];
  __shared__ float b_tile[GATES][kSimtBlockK][kSimtBlockN + 1];
  __shared__ int token_row[TILE_M];

  const int row0 = blockIdx.x * TILE_M;
  const int n0 = blockIdx.y * kSimtBlockN;
  const int expert = expert_ids[row0 / block_size];
  if (expert < 0) return;  // the whole block: no thread reaches a barrier

  const int tid = threadIdx.x;
  const int tx = tid % kSimtThreadsX, ty = tid / kSimtThreadsX;
  for (int r = tid; r < TILE_M; r += kSimtThreads) token_row[r] = sorted_token_ids[row0 + r];
  __syncthreads();

  float accumulator[GATES][ROWS_PER_THREAD][COLS_PER_THREAD] = {};
  const int group_k = Decoder::kGrouped ? decoder.group_k() : k;
  const int groups = (k + group_k - 1) / group_k;

  for (int g = 0; g < groups; ++g) {
    const int k_begin = g * group_k, k_end = k_begin + group_k < k ? k_begin + group_k : k;
    // The group's sums; ungrouped decoders sum straight into the accumulator (one group, no scales).
    [[maybe_unused]] float partial[Decoder::kGrouped ? GATES : 1][ROWS_PER_THREAD][COLS_PER_THREAD] = {};
    for (int k0 = k_begin; k0 < k_end; k0 += kSimtBlockK) {
      for (int e = tid; e < TILE_M * kSimtBlockK; e += kSimtThreads) {
        const int m = e / kSimtBlockK, kk = e % kSimtBlockK;
        const int token = token_row[m];
        float value = 0.0f;
        if (token < numel && k0 + kk < k_end) value = decoder.a_value(static_cast<long long>(token / top_k), k0 + kk);
        a_tile[kk][m] = value;
      }
      // Each thread decodes two neighbouring values of k (one packed byte of a 4-bit format).
      for (int e = tid; e < GATES * kSimtBlockN * PAIRS; e += kSimtThreads) {
        const int row = e / PAIRS, pair = e % PAIRS;
        const int gate = row / kSimtBlockN, col = row % kSimtBlockN;
        const int kcol = k0 + 2 * pair;
        float low = 0.0f, high = 0.0f;
        if (n0 + col < n && kcol < k_end) decoder.b_pair(expert, gate, n0 + col, kcol, kcol + 1 < k_end, low, high);
        b_tile[gate][2 * pair][col] = low;
        b_tile[gate][2 * pair + 1][col] = high;
      }
      __syncthreads();
      MOEROUTE_UNROLL
      for (int kk = 0; kk < kSimtBlockK; ++kk) {
        float a_value[ROWS_PER_THREAD];
        MOEROUTE_UNROLL
        for (int i = 0; i < ROWS_PER_THREAD; ++i) a_value[i] = a_tile[kk][ty + kSimtThreadsY * i];
        MOEROUTE_UNROLL
        for (int gate = 0; gate < GATES; ++gate) {
          MOEROUTE_UNROLL
          for (int j = 0; j < COLS_PER_THREAD; ++j) {
            const float b_value = b_tile[gate][kk][tx + kSimtThreadsX * j];
            MOEROUTE_UNROLL
            for (int i = 0; i < ROWS_PER_THREAD; ++i) {
              if constexpr (Decoder::kGrouped) {
                partial[gate][i][j] += a_value[i] * b_value;
              } else {
                accumulator[gate][i][j] += a_value[i] * b_value;
              }
            }
          }
        }
      }
      __syncthreads();
    }
    if constexpr (Decoder::kGrouped) {
      // Promote the group's sums with row_scale(row, g) * col_scale(col, g).
      float row_scale[ROWS_PER_THREAD];
      MOEROUTE_UNROLL
      for (int i = 0; i < ROWS_PER_THREAD; ++i) {
        const int token = token_row[ty + kSimtThreadsY * i];
        row_scale[i] = token < numel ? decoder.row_scale(static_cast<long long>(token / top_k), g) : 0.0f;
      }
      MOEROUTE_UNROLL
      for (int gate = 0; gate < GATES; ++gate) {
        MOEROUTE_UNROLL
        for (int j = 0; j < COLS_PER_THREAD; ++j) {
          const int col = n0 + tx + kSimtThreadsX * j;
          const float col_scale = col < n ? decoder.col_scale(expert, gate, col, g) : 0.0f;
          MOEROUTE_UNROLL
          for (int i = 0; i < ROWS_PER_THREAD; ++i)
            accumulator[gate][i][j] += partial[gate][i][j] * (row_scale[i] * col_scale);
        }
      }
    }
  }

  MOEROUTE_UNROLL
  for (int i = 0; i < ROWS_PER_THREAD; ++i) {
    const int token = token_row[ty + kSimtThreadsY * i];
    if (token >= numel) continue;
    const float scale = (!GATED && apply_router_weight) ? topk_weights[token] : 1.0f;
    T* c_row = c + static_cast<long long>(token) * n;
    MOEROUTE_UNROLL
    for (int j = 0; j < COLS_PER_THREAD; ++j) {
      const int col = n0 + tx + kSimtThreadsX * j;
      if (col >= n) continue;
      float first = accumulator[0][i][j], second = accumulator[GATES - 1][i][j];
      if (has_bias) {
        first += decoder.bias(expert, 0, col);
        if (GATED) second += decoder.bias(expert, 1, col);
      }
      const float value = GATED ? gated_activate(first, second, activation) : first * scale;
      c_row[col] = from_float<T>(value);
    }
  }
}

#if MOEROUTE_HAS_MMA

// Writes the pair (lo, hi) to dst[0], dst[1]: one 4-byte store when dst is 4-byte aligned and
// both columns are in range, else one 2-byte store per column in range (the scalar tail).
template <typename T>
MOEROUTE_DEVICE void store_pair(T* dst, float lo, float hi, bool hi_in_range) {
  const T lo_value = from_float<T>(lo);
  if (hi_in_range) {
    const T hi_value = from_float<T>(hi);
    if ((reinterpret_cast<unsigned long long>(dst) & 3ull) == 0) {
      *reinterpret_cast<unsigned int*>(dst) =
          static_cast<unsigned int>(lo_value.bits) | (static_cast<unsigned int>(hi_value.bits) << 16);
      return;
    }
    dst[1] = hi_value;
  }
  dst[0] = lo_value;
}

constexpr int kNarrowBlockValues = 32;  // k columns per promoted block (one scale)
constexpr int kNarrowSliceK = 64;       // values of k per pipeline stage: two blocks
constexpr int kNarrowSliceBlocks = kNarrowSliceK / kNarrowBlockValues;
// A stage rows: 16-bit values, +8 (16 bytes) a row: the fragment loads of a warp hit distinct
// banks and rows stay 16-byte aligned for cp.async.
constexpr int kNarrowAPitch = kNarrowSliceK + 8;
// B stage rows: packed bytes (VALUES_PER_BYTE values each), +16 a row for the same two reasons.
template <int VALUES_PER_BYTE>
struct NarrowBPitch {
  static constexpr int value = kNarrowSliceK / VALUES_PER_BYTE + 16;
};
constexpr int kNarrowAChunks = kNarrowSliceK / 8;  // 16-byte copies per A row and stage

// Issues the cp.async of one stage: TILE_M rows of A (through token_row), then GATES * BLOCK_N
// rows of packed B (gate rows n0.., then up rows n + n0..), from k value k0. Rows and columns
// out of range are zero-filled (their sums are never stored, or are multiplied by zero).
template <int TILE_M, int BLOCK_N, int GATES, int THREADS, int VALUES_PER_BYTE>
MOEROUTE_DEVICE void narrow_load_stage(unsigned char* stage, const unsigned char* a_bytes,
                                       const unsigned char* packed_expert, const int* token_row, int numel,
                                       int top_k, int n, int k, int n0, int k0, int tid) {
  constexpr int B_PITCH = NarrowBPitch<VALUES_PER_BYTE>::value;
  constexpr int B_CHUNKS = kNarrowSliceK / VALUES_PER_BYTE / 16;  // 16-byte copies per B row and stage
  const int row_bytes = k / VALUES_PER_BYTE, k0_bytes = k0 / VALUES_PER_BYTE;
  unsigned char* b_stage = stage + TILE_M * kNarrowAPitch * 2;
  for (int chunk = tid; chunk < TILE_M * kNarrowAChunks; chunk += THREADS) {
    const int row = chunk / kNarrowAChunks, offset = (chunk % kNarrowAChunks) * 8;
    const int token = token_row[row];
    const bool valid = token < numel && k0 + offset < k;
    const unsigned char* source =
        valid ? a_bytes + (static_cast<long long>(token / top_k) * k + k0 + offset) * 2 : a_bytes;
    cp_async_16(stage + (row * kNarrowAPitch + offset) * 2, source, valid);
  }
  for (int chunk = tid; chunk < GATES * BLOCK_N * B_CHUNKS; chunk += THREADS) {
    const int row = chunk / B_CHUNKS, offset = (chunk % B_CHUNKS) * 16;
    const int gate = row / BLOCK_N, col = n0 + row % BLOCK_N;
    const bool valid = col < n && k0_bytes + offset < row_bytes;
    const unsigned char* source =
        valid ? packed_expert + (static_cast<long long>(gate) * n + col) * row_bytes + k0_bytes + offset : packed_expert;
    cp_async_16(b_stage + row * B_PITCH + offset, source, valid);
  }
}

// Grid: (row tiles, ceil(n / BLOCK_N)); block: WARPS_M * WARPS_N warps. Each warp owns
// (TILE_M / WARPS_M) x (BLOCK_N / WARPS_N) outputs per gate as 16x8 mma tiles. Dynamic shared
// memory: STAGES stages of (TILE_M * kNarrowAPitch * 2 + GATES * BLOCK_N * NarrowBPitch) bytes,
// then the decoder's metadata bytes. B: packed rows of k / kValuesPerByte bytes, [experts *
// GATES * n]; needs A and B 16-byte aligned and k % 32 == 0 (the launchers check).
template <typename Decoder, typename T, int TILE_M, int BLOCK_N, int WARPS_M, int WARPS_N, int STAGES, int GATED>
MOEROUTE_DEVICE void moe_tile_narrow_mma(const Decoder& decoder, const T* __restrict__ a,
                                         const unsigned char* __restrict__ packed, T* __restrict__ c,
                                         const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                                         const float* __restrict__ topk_weights, int numel, int top_k, int n, int k,
                                         int block_size, int activation, int apply_router_weight, int has_bias) {
  static_assert(MOEROUTE_WARP_SIZE == 32, "mma.sync fragments are laid out over 32 lanes");
  static_assert(STAGES >= 2, "one stage loading while one computes");
  constexpr int THREADS = WARPS_M * WARPS_N * MOEROUTE_WARP_SIZE;
  constexpr int GATES = GATED ? 2 : 1;
  constexpr int WARP_M = TILE_M / WARPS_M, WARP_N = BLOCK_N / WARPS_N;
  constexpr int M_TILES = WARP_M / 16, N_TILES = WARP_N / 8;
  static_assert(WARP_M % 16 == 0 && WARP_N % 8 == 0, "warp tiles are whole 16x8 mma tiles");
  constexpr int VALUES_PER_BYTE = Decoder::kValuesPerByte;
  constexpr int B_PITCH = NarrowBPitch<VALUES_PER_BYTE>::value;
  constexpr int STAGE_BYTES = TILE_M * kNarrowAPitch * 2 + GATES * BLOCK_N * B_PITCH;

  MOEROUTE_DYNAMIC_SHARED(shared_bytes);
  unsigned char* metadata = shared_bytes + STAGES * STAGE_BYTES;
  __shared__ int token_row[TILE_M];

  const int row0 = blockIdx.x * TILE_M;
  const int n0 = blockIdx.y * BLOCK_N;
  const int expert = expert_ids[row0 / block_size];
  if (expert < 0) return;  // the whole block: no thread reaches a barrier

  const int tid = threadIdx.x;
  const int lane = tid % MOEROUTE_WARP_SIZE, warp = tid / MOEROUTE_WARP_SIZE;
  const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
  const int group = lane / 4, thread_in_group = lane % 4;
  for (int r = tid; r < TILE_M; r += THREADS) token_row[r] = sorted_token_ids[row0 + r];
  __syncthreads();

  const int k_blocks = k / kNarrowBlockValues;
  const int k_steps = (k + kNarrowSliceK - 1) / kNarrowSliceK;
  const long long expert_rows = static_cast<long long>(expert) * GATES * n;
  const unsigned char* packed_expert = packed + expert_rows * (k / VALUES_PER_BYTE);
  const unsigned char* a_bytes = reinterpret_cast<const unsigned char*>(a);

  // Every step commits one group (possibly empty) so that wait_group counts stay in step.
  MOEROUTE_UNROLL
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_steps)
      narrow_load_stage<TILE_M, BLOCK_N, GATES, THREADS, VALUES_PER_BYTE>(shared_bytes + s * STAGE_BYTES, a_bytes, packed_expert,
                                                         token_row, numel, top_k, n, k, n0, s * kNarrowSliceK, tid);
    cp_async_commit();
  }
  // The tile's metadata, all of k, while the first stages are in flight (the first barrier of
  // the loop publishes it).
  decoder.template stage_metadata<BLOCK_N, GATES, THREADS>(metadata, expert, n0, tid);

  float accumulator[GATES][M_TILES][N_TILES][4] = {};
  for (int kt = 0; kt < k_steps; ++kt) {
    cp_async_wait<STAGES - 2>();
    // Stage kt is visible to all threads, and every warp is done with the stage refilled below.
    __syncthreads();
    const int next = kt + STAGES - 1;
    if (next < k_steps)
      narrow_load_stage<TILE_M, BLOCK_N, GATES, THREADS, VALUES_PER_BYTE>(shared_bytes + (next % STAGES) * STAGE_BYTES, a_bytes,
                                                         packed_expert, token_row, numel, top_k, n, k, n0,
                                                         next * kNarrowSliceK, tid);
    cp_async_commit();

    const unsigned short* a_stage = reinterpret_cast<const unsigned short*>(shared_bytes + (kt % STAGES) * STAGE_BYTES);
    const unsigned char* b_stage = shared_bytes + (kt % STAGES) * STAGE_BYTES + TILE_M * kNarrowAPitch * 2;
    MOEROUTE_UNROLL
    for (int slice_block = 0; slice_block < kNarrowSliceBlocks; ++slice_block) {
      const int k_block = kt * kNarrowSliceBlocks + slice_block;
      if (k_block >= k_blocks) break;  // the last step of a k that is an odd number of blocks
      float partial[GATES][M_TILES][N_TILES][4] = {};
      MOEROUTE_UNROLL
      for (int step = 0; step < kNarrowBlockValues; step += 16) {
        const int kk = slice_block * kNarrowBlockValues + step;
        // A regs (g, 2t) (g+8, 2t) (g, 2t+8) (g+8, 2t+8), two 16-bit values each.
        unsigned int a_fragment[M_TILES][4];
        MOEROUTE_UNROLL
        for (int mt = 0; mt < M_TILES; ++mt) {
          const unsigned short* base = a_stage + (warp_m * WARP_M + mt * 16 + group) * kNarrowAPitch + kk +
                                       2 * thread_in_group;
          a_fragment[mt][0] = *reinterpret_cast<const unsigned int*>(base);
          a_fragment[mt][1] = *reinterpret_cast<const unsigned int*>(base + 8 * kNarrowAPitch);
          a_fragment[mt][2] = *reinterpret_cast<const unsigned int*>(base + 8);
          a_fragment[mt][3] = *reinterpret_cast<const unsigned int*>(base + 8 * kNarrowAPitch + 8);
        }
        MOEROUTE_UNROLL
        for (int gate = 0; gate < GATES; ++gate) {
          MOEROUTE_UNROLL
          for (int nt = 0; nt < N_TILES; ++nt) {
            // B regs (k = 2t..2t+1, n = g) and (k = 2t+8..2t+9, n = g) of the k16 step in
            // row g, decoded in registers.
            const int tile_row = gate * BLOCK_N + warp_n * WARP_N + nt * 8 + group;
            const unsigned char* row = b_stage + tile_row * B_PITCH;
            const int first = kk + 2 * thread_in_group;
            const unsigned int b0 = decoder.template pair16<T>(metadata, tile_row, k_block, row, first);
            const unsigned int b1 = decoder.template pair16<T>(metadata, tile_row, k_block, row, first + 8);
            MOEROUTE_UNROLL
            for (int mt = 0; mt < M_TILES; ++mt) mma_m16n8k16<T>(partial[gate][mt][nt], a_fragment[mt], b0, b1);
          }
        }
      }
      // Promote the block's sums with its scale, per output column, in float32.
      MOEROUTE_UNROLL
      for (int gate = 0; gate < GATES; ++gate) {
        MOEROUTE_UNROLL
        for (int nt = 0; nt < N_TILES; ++nt) {
          const int tile_row = gate * BLOCK_N + warp_n * WARP_N + nt * 8 + 2 * thread_in_group;
          const int col = n0 + warp_n * WARP_N + nt * 8 + 2 * thread_in_group;
          const float scale[2] = {decoder.block_scale(metadata, tile_row, expert, gate, col, k_block),
                                  decoder.block_scale(metadata, tile_row + 1, expert, gate, col + 1, k_block)};
          MOEROUTE_UNROLL
          for (int mt = 0; mt < M_TILES; ++mt) {
            MOEROUTE_UNROLL
            for (int i = 0; i < 4; ++i) accumulator[gate][mt][nt][i] += partial[gate][mt][nt][i] * scale[i % 2];
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  MOEROUTE_UNROLL
  for (int mt = 0; mt < M_TILES; ++mt) {
    MOEROUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int token = token_row[warp_m * WARP_M + mt * 16 + group + 8 * half];
      if (token >= numel) continue;
      const float scale = (!GATED && apply_router_weight) ? topk_weights[token] : 1.0f;
      T* c_row = c + static_cast<long long>(token) * n;
      MOEROUTE_UNROLL
      for (int nt = 0; nt < N_TILES; ++nt) {
        const int col = n0 + warp_n * WARP_N + nt * 8 + 2 * thread_in_group;
        if (col >= n) continue;
        float value[2];
        MOEROUTE_UNROLL
        for (int j = 0; j < 2; ++j) {
          float first = accumulator[0][mt][nt][2 * half + j], second = accumulator[GATES - 1][mt][nt][2 * half + j];
          if (has_bias && col + j < n) {
            first += decoder.bias(expert, 0, col + j);
            if (GATED) second += decoder.bias(expert, 1, col + j);
          }
          value[j] = GATED ? gated_activate(first, second, activation) : first * scale;
        }
        store_pair(c_row + col, value[0], value[1], col + 1 < n);
      }
    }
  }
}

#endif  // MOEROUTE_HAS_MMA

}  // namespace moeroute
