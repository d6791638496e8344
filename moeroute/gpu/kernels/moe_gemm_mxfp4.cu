// MXFP4 (w4a16) expert GEMMs over expert-sorted, block-padded rows: the numerics of docs/quant.md.
//
// Weights of one projection: blocks uint8 [E, rows, k / 32, 16] and scales uint8 [E, rows, k / 32];
// byte j of a block holds element 2j in its low nibble and 2j + 1 in its high nibble, and
//
//   w[row, col] = e2m1[nibble] * 2 ** (scale[row, col / 32] - 127)
//
// (e2m1 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; scale 255 is NaN, refused at load).
// Activations are not quantized: A is float32 / float16 / bfloat16 as the float kernels take it.
//
// Two kernels, launched by moeroute/gpu/gemm_mxfp4.py (the same plans drive the host emulation):
//
//   moe_gemm_mxfp4_simt  every GPU (and the host emulation, and HIP): each weight decoded to its
//                        float32 value in registers (exact: two significant bits times 2^(s-127),
//                        s = 0 being a float32 subnormal; values of 2^128 and more, from s = 254
//                        only, are inf as in moeroute.quant.dequantize_mxfp4), float32 tiles.
//   moe_gemm_mxfp4_mma   float16 / bfloat16 on sm_80+: a cp.async pipeline of STAGES k slices
//                        (activations and packed bytes; the tile's scale bytes staged once), the
//                        nibbles decoded in registers to the 16-bit e2m1 values (exact in both
//                        types, no scale), mma.sync m16n8k16 over each 32-column k block into
//                        float32 partial sums, and the block's scale 2^(s-127) applied in float32
//                        when the block is promoted into the accumulator (as the FP8 block-scaled
//                        kernel applies its scales). So every scale byte 0..254 is exact,
//                        including those outside float16's range (only a float32 overflow of
//                        the block's scaled sum gives inf).
//
//   gate_up (GATED = 1): A rows j / top_k of hidden_states; B rows: gate rows, then up rows
//     (2n rows); C = intermediate [numel, n] = act(gate + bias) * (up + bias), swigluoai too.
//   down    (GATED = 0): A rows j of the intermediate (top_k = 1); C = expert_out [numel, n] =
//     (A B^T + bias) times topk_weights[j] when apply_router_weight.
// Biases are float32 ([E, 2n] gate entries first, or [E, n]); without has_bias never read.
// Rows, padding and slots of other ranks are handled as in moe_gemm.cu (included below for its
// activations, its SIMT tiling constants, mma_m16n8k16 and moe_sum_topk).
#include "moe_gemm.cu"

namespace moeroute {

constexpr int kMxfp4BlockValues = 32;  // values per scale byte (the format's block)
constexpr int kMxfp4BlockBytes = 16;   // packed bytes per block
constexpr unsigned int kMxfp4ScaleNan = 255u;

// |e2m1| of the low three bits of a nibble as float32 bits: 0 and 0.5 (the e2m1 subnormal), else
// exponent 2^(e - 1) with one mantissa bit.
MOEROUTE_DEVICE unsigned int e2m1_magnitude_bits(unsigned int magnitude) {
  return magnitude < 2u ? magnitude * 0x3f000000u : ((((magnitude >> 1) + 126u) << 23) | ((magnitude & 1u) << 22));
}

MOEROUTE_DEVICE float e2m1_to_float(unsigned int nibble) {
  return bits_to_float(e2m1_magnitude_bits(nibble & 7u) | ((nibble & 8u) << 28));
}

// 2^(scale - 127) in float32, exact for every byte: 0 is the subnormal 2^-127; 255 is NaN.
MOEROUTE_DEVICE float mxfp4_scale(unsigned int scale) {
  if (scale == kMxfp4ScaleNan) return bits_to_float(0x7fc00000u);
  return bits_to_float(scale ? scale << 23 : 0x00400000u);
}

// The 16-bit pattern of an e2m1 nibble in T (exact: at most two significant bits, |v| <= 6).
template <typename T>
MOEROUTE_DEVICE unsigned int e2m1_bits16(unsigned int nibble);

template <>
MOEROUTE_DEVICE unsigned int e2m1_bits16<bfloat16>(unsigned int nibble) {
  return (e2m1_magnitude_bits(nibble & 7u) >> 16) | ((nibble & 8u) << 12);
}

template <>
MOEROUTE_DEVICE unsigned int e2m1_bits16<float16>(unsigned int nibble) {
  const unsigned int magnitude = nibble & 7u;
  const unsigned int bits =
      magnitude < 2u ? magnitude * 0x3800u : ((((magnitude >> 1) + 14u) << 10) | ((magnitude & 1u) << 9));
  return bits | ((nibble & 8u) << 12);
}

// One packed byte -> the register of two 16-bit values (k = 2j in the low half, 2j + 1 high),
// the order of an mma.sync B fragment register.
template <typename T>
MOEROUTE_DEVICE unsigned int e2m1_pair(unsigned int byte) {
  return e2m1_bits16<T>(byte & 0xfu) | (e2m1_bits16<T>(byte >> 4) << 16);
}

}  // namespace moeroute

// Grid: (row tiles, ceil(n / kSimtBlockN)); block: kSimtThreads. Tiling as moe_gemm_simt; k is a
// multiple of 32, so a k slice of kSimtBlockK never straddles two scale blocks.
template <typename T, int TILE_M, int GATED>
__global__ void MOEROUTE_LAUNCH_BOUNDS(moeroute::kSimtThreads, moeroute::kSimtMinBlocksPerMultiprocessor)
    moe_gemm_mxfp4_simt(const T* __restrict__ a, const unsigned char* __restrict__ b_blocks,
                        const unsigned char* __restrict__ b_scales, T* __restrict__ c,
                        const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                        const float* __restrict__ topk_weights, const float* __restrict__ bias, int numel,
                        int top_k, int n, int k, int block_size, int activation, int apply_router_weight,
                        int has_bias) {
  using namespace moeroute;
  constexpr int GATES = GATED ? 2 : 1;
  constexpr int ROWS_PER_THREAD = TILE_M / kSimtThreadsY;
  constexpr int COLS_PER_THREAD = kSimtBlockN / kSimtThreadsX;
  static_assert(TILE_M % kSimtThreadsY == 0, "TILE_M must be a multiple of the thread grid height");
  static_assert(kMxfp4BlockValues % kSimtBlockK == 0, "a k slice lies inside one scale block");

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

  const int k_blocks = k / kMxfp4BlockValues;
  const long long expert_rows = static_cast<long long>(expert) * GATES * n;
  const unsigned char* blocks_expert = b_blocks + expert_rows * k_blocks * kMxfp4BlockBytes;
  const unsigned char* scales_expert = b_scales + expert_rows * k_blocks;
  float accumulator[GATES][ROWS_PER_THREAD][COLS_PER_THREAD] = {};

  for (int k0 = 0; k0 < k; k0 += kSimtBlockK) {
    for (int e = tid; e < TILE_M * kSimtBlockK; e += kSimtThreads) {
      const int m = e / kSimtBlockK, kk = e % kSimtBlockK;
      const int token = token_row[m];
      a_tile[kk][m] = token < numel ? to_float(a[static_cast<long long>(token / top_k) * k + k0 + kk]) : 0.0f;
    }
    // Each thread decodes one byte: two neighbouring values of k.
    for (int e = tid; e < GATES * kSimtBlockN * (kSimtBlockK / 2); e += kSimtThreads) {
      const int row = e / (kSimtBlockK / 2), pair = e % (kSimtBlockK / 2);
      const int gate = row / kSimtBlockN, col = row % kSimtBlockN;
      float low = 0.0f, high = 0.0f;
      if (n0 + col < n) {
        const long long weight_row = static_cast<long long>(gate) * n + n0 + col;
        const unsigned int byte = blocks_expert[weight_row * (k / 2) + k0 / 2 + pair];
        const float scale = mxfp4_scale(scales_expert[weight_row * k_blocks + k0 / kMxfp4BlockValues]);
        low = e2m1_to_float(byte & 0xfu) * scale;
        high = e2m1_to_float(byte >> 4) * scale;
      }
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
      for (int g = 0; g < GATES; ++g) {
        MOEROUTE_UNROLL
        for (int j = 0; j < COLS_PER_THREAD; ++j) {
          const float b_value = b_tile[g][kk][tx + kSimtThreadsX * j];
          MOEROUTE_UNROLL
          for (int i = 0; i < ROWS_PER_THREAD; ++i) accumulator[g][i][j] += a_value[i] * b_value;
        }
      }
    }
    __syncthreads();
  }

  MOEROUTE_UNROLL
  for (int i = 0; i < ROWS_PER_THREAD; ++i) {
    const int token = token_row[ty + kSimtThreadsY * i];
    if (token >= numel) continue;
    const float scale = (!GATED && apply_router_weight) ? topk_weights[token] : 1.0f;
    T* c_row = c + static_cast<long long>(token) * n;
    const float* bias_row = bias + expert_rows;
    MOEROUTE_UNROLL
    for (int j = 0; j < COLS_PER_THREAD; ++j) {
      const int col = n0 + tx + kSimtThreadsX * j;
      if (col >= n) continue;
      float first = accumulator[0][i][j], second = accumulator[GATES - 1][i][j];
      if (has_bias) {
        first += bias_row[col];
        if (GATED) second += bias_row[n + col];
      }
      c_row[col] = from_float<T>(GATED ? gated_activate(first, second, activation) : first * scale);
    }
  }
}

#if MOEROUTE_HAS_MMA

namespace moeroute {

constexpr int kMxfp4SliceK = 64;  // values of k per pipeline stage: two scale blocks
constexpr int kMxfp4SliceBlocks = kMxfp4SliceK / kMxfp4BlockValues;
// A stage rows: 16-bit values, +8 (16 bytes) a row: the fragment loads of a warp hit distinct
// banks and rows stay 16-byte aligned for cp.async.
constexpr int kMxfp4APitch = kMxfp4SliceK + 8;
// B stage rows: packed bytes (two values each), +16 a row for the same two reasons.
constexpr int kMxfp4BPitch = kMxfp4SliceK / 2 + 16;
constexpr int kMxfp4AChunks = kMxfp4SliceK / 8;   // 16-byte copies per A row and stage
constexpr int kMxfp4BChunks = kMxfp4SliceK / 32;  // 16-byte copies per B row and stage

// Issues the cp.async of one stage: TILE_M rows of A (through token_row), then GATES * BLOCK_N
// rows of packed B (gate rows n0.., then up rows n + n0..), from k value k0. Rows and columns
// out of range are zero-filled (zero bytes decode to e2m1 zeros).
template <int TILE_M, int BLOCK_N, int GATES, int THREADS>
MOEROUTE_DEVICE void mxfp4_load_stage(unsigned char* stage, const unsigned char* a_bytes,
                                      const unsigned char* blocks_expert, const int* token_row, int numel,
                                      int top_k, int n, int k, int n0, int k0, int tid) {
  unsigned char* b_stage = stage + TILE_M * kMxfp4APitch * 2;
  for (int chunk = tid; chunk < TILE_M * kMxfp4AChunks; chunk += THREADS) {
    const int row = chunk / kMxfp4AChunks, offset = (chunk % kMxfp4AChunks) * 8;
    const int token = token_row[row];
    const bool valid = token < numel && k0 + offset < k;
    const unsigned char* source =
        valid ? a_bytes + (static_cast<long long>(token / top_k) * k + k0 + offset) * 2 : a_bytes;
    cp_async_16(stage + (row * kMxfp4APitch + offset) * 2, source, valid);
  }
  for (int chunk = tid; chunk < GATES * BLOCK_N * kMxfp4BChunks; chunk += THREADS) {
    const int row = chunk / kMxfp4BChunks, offset = (chunk % kMxfp4BChunks) * 16;
    const int gate = row / BLOCK_N, col = n0 + row % BLOCK_N;
    const bool valid = col < n && k0 / 2 + offset < k / 2;
    const unsigned char* source =
        valid ? blocks_expert + (static_cast<long long>(gate) * n + col) * (k / 2) + k0 / 2 + offset : blocks_expert;
    cp_async_16(b_stage + row * kMxfp4BPitch + offset, source, valid);
  }
}

}  // namespace moeroute

// Grid: (row tiles, ceil(n / BLOCK_N)); block: WARPS_M * WARPS_N warps. Each warp owns
// (TILE_M / WARPS_M) x (BLOCK_N / WARPS_N) outputs per gate as 16x8 mma tiles. Dynamic shared
// memory: STAGES stages of (TILE_M * kMxfp4APitch * 2 + GATES * BLOCK_N * kMxfp4BPitch) bytes,
// then the tile's scale bytes, GATES * BLOCK_N rows of k / 32. Needs A and the blocks 16-byte
// aligned (the launcher checks; k % 32 == 0 by the format keeps every row aligned).
template <typename T, int TILE_M, int BLOCK_N, int WARPS_M, int WARPS_N, int STAGES, int MIN_BLOCKS, int GATED>
__global__ void MOEROUTE_LAUNCH_BOUNDS(WARPS_M* WARPS_N* MOEROUTE_WARP_SIZE, MIN_BLOCKS)
    moe_gemm_mxfp4_mma(const T* __restrict__ a, const unsigned char* __restrict__ b_blocks,
                       const unsigned char* __restrict__ b_scales, T* __restrict__ c,
                       const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                       const float* __restrict__ topk_weights, const float* __restrict__ bias, int numel,
                       int top_k, int n, int k, int block_size, int activation, int apply_router_weight,
                       int has_bias) {
  using namespace moeroute;
  static_assert(MOEROUTE_WARP_SIZE == 32, "mma.sync fragments are laid out over 32 lanes");
  static_assert(STAGES >= 2, "one stage loading while one computes");
  constexpr int THREADS = WARPS_M * WARPS_N * MOEROUTE_WARP_SIZE;
  constexpr int GATES = GATED ? 2 : 1;
  constexpr int WARP_M = TILE_M / WARPS_M, WARP_N = BLOCK_N / WARPS_N;
  constexpr int M_TILES = WARP_M / 16, N_TILES = WARP_N / 8;
  static_assert(WARP_M % 16 == 0 && WARP_N % 8 == 0, "warp tiles are whole 16x8 mma tiles");
  constexpr int STAGE_BYTES = TILE_M * kMxfp4APitch * 2 + GATES * BLOCK_N * kMxfp4BPitch;

  MOEROUTE_DYNAMIC_SHARED(shared_bytes);
  unsigned char* scale_bytes = shared_bytes + STAGES * STAGE_BYTES;
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

  const int k_blocks = k / kMxfp4BlockValues;
  const int k_steps = (k + kMxfp4SliceK - 1) / kMxfp4SliceK;
  const long long expert_rows = static_cast<long long>(expert) * GATES * n;
  const unsigned char* blocks_expert = b_blocks + expert_rows * k_blocks * kMxfp4BlockBytes;
  const unsigned char* a_bytes = reinterpret_cast<const unsigned char*>(a);

  // Every step commits one group (possibly empty) so that wait_group counts stay in step.
  MOEROUTE_UNROLL
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_steps)
      mxfp4_load_stage<TILE_M, BLOCK_N, GATES, THREADS>(shared_bytes + s * STAGE_BYTES, a_bytes, blocks_expert,
                                                        token_row, numel, top_k, n, k, n0, s * kMxfp4SliceK, tid);
    cp_async_commit();
  }
  // The tile's scale bytes, all of k, while the first stages are in flight (the first barrier of
  // the loop publishes them). Rows out of range read as 0; they multiply zero sums.
  const unsigned char* scales_expert = b_scales + expert_rows * k_blocks;
  for (int e = tid; e < GATES * BLOCK_N * k_blocks; e += THREADS) {
    const int row = e / k_blocks, k_block = e % k_blocks;
    const int gate = row / BLOCK_N, col = n0 + row % BLOCK_N;
    scale_bytes[e] = col < n ? scales_expert[(static_cast<long long>(gate) * n + col) * k_blocks + k_block] : 0;
  }

  float accumulator[GATES][M_TILES][N_TILES][4] = {};
  for (int kt = 0; kt < k_steps; ++kt) {
    cp_async_wait<STAGES - 2>();
    // Stage kt is visible to all threads, and every warp is done with the stage refilled below.
    __syncthreads();
    const int next = kt + STAGES - 1;
    if (next < k_steps)
      mxfp4_load_stage<TILE_M, BLOCK_N, GATES, THREADS>(shared_bytes + (next % STAGES) * STAGE_BYTES, a_bytes,
                                                        blocks_expert, token_row, numel, top_k, n, k, n0,
                                                        next * kMxfp4SliceK, tid);
    cp_async_commit();

    const unsigned short* a_stage = reinterpret_cast<const unsigned short*>(shared_bytes + (kt % STAGES) * STAGE_BYTES);
    const unsigned char* b_stage = shared_bytes + (kt % STAGES) * STAGE_BYTES + TILE_M * kMxfp4APitch * 2;
    MOEROUTE_UNROLL
    for (int slice_block = 0; slice_block < kMxfp4SliceBlocks; ++slice_block) {
      const int k_block = kt * kMxfp4SliceBlocks + slice_block;
      if (k_block >= k_blocks) break;  // the last step of a k that is an odd number of blocks
      float partial[GATES][M_TILES][N_TILES][4] = {};
      MOEROUTE_UNROLL
      for (int step = 0; step < kMxfp4BlockValues; step += 16) {
        const int kk = slice_block * kMxfp4BlockValues + step;
        // A regs (g, 2t) (g+8, 2t) (g, 2t+8) (g+8, 2t+8), two 16-bit values each.
        unsigned int a_fragment[M_TILES][4];
        MOEROUTE_UNROLL
        for (int mt = 0; mt < M_TILES; ++mt) {
          const unsigned short* base = a_stage + (warp_m * WARP_M + mt * 16 + group) * kMxfp4APitch + kk +
                                       2 * thread_in_group;
          a_fragment[mt][0] = *reinterpret_cast<const unsigned int*>(base);
          a_fragment[mt][1] = *reinterpret_cast<const unsigned int*>(base + 8 * kMxfp4APitch);
          a_fragment[mt][2] = *reinterpret_cast<const unsigned int*>(base + 8);
          a_fragment[mt][3] = *reinterpret_cast<const unsigned int*>(base + 8 * kMxfp4APitch + 8);
        }
        MOEROUTE_UNROLL
        for (int gate = 0; gate < GATES; ++gate) {
          MOEROUTE_UNROLL
          for (int nt = 0; nt < N_TILES; ++nt) {
            // B regs (k = 2t..2t+1, n = g) and (k = 2t+8..2t+9, n = g): bytes t and 4 + t of the
            // k16 step in row g, decoded in registers.
            const unsigned char* row =
                b_stage + (gate * BLOCK_N + warp_n * WARP_N + nt * 8 + group) * kMxfp4BPitch + kk / 2;
            const unsigned int b0 = e2m1_pair<T>(row[thread_in_group]);
            const unsigned int b1 = e2m1_pair<T>(row[4 + thread_in_group]);
            MOEROUTE_UNROLL
            for (int mt = 0; mt < M_TILES; ++mt) mma_m16n8k16<T>(partial[gate][mt][nt], a_fragment[mt], b0, b1);
          }
        }
      }
      // Promote the block's sums with its scale 2^(s - 127), per output column, in float32.
      MOEROUTE_UNROLL
      for (int gate = 0; gate < GATES; ++gate) {
        MOEROUTE_UNROLL
        for (int nt = 0; nt < N_TILES; ++nt) {
          const int row = gate * BLOCK_N + warp_n * WARP_N + nt * 8 + 2 * thread_in_group;
          const float scale[2] = {mxfp4_scale(scale_bytes[row * k_blocks + k_block]),
                                  mxfp4_scale(scale_bytes[(row + 1) * k_blocks + k_block])};
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
      const float* bias_row = bias + expert_rows;
      MOEROUTE_UNROLL
      for (int nt = 0; nt < N_TILES; ++nt) {
        const int col = n0 + warp_n * WARP_N + nt * 8 + 2 * thread_in_group;
        if (col >= n) continue;
        float value[2];
        MOEROUTE_UNROLL
        for (int j = 0; j < 2; ++j) {
          float first = accumulator[0][mt][nt][2 * half + j], second = accumulator[GATES - 1][mt][nt][2 * half + j];
          if (has_bias && col + j < n) {
            first += bias_row[col + j];
            if (GATED) second += bias_row[n + col + j];
          }
          value[j] = GATED ? gated_activate(first, second, activation) : first * scale;
        }
        store_pair(c_row + col, value[0], value[1], col + 1 < n);
      }
    }
  }
}

#endif  // MOEROUTE_HAS_MMA
