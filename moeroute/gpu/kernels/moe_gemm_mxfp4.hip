// Generated from moe_gemm_mxfp4.cu by tools/hipify_kernels.py (torch.utils.hipify name mapping);
// do not edit: change moe_gemm_mxfp4.cu and rerun the script.
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
//                        s = 0 being a float32 subnormal), float32 shared-memory tiles.
//   moe_gemm_mxfp4_mma   float16 / bfloat16 on sm_80+: the nibbles decoded in registers to the
//                        16-bit e2m1 values (exact in both types, no scale), mma.sync m16n8k16
//                        over each 32-column k block into float32 partial sums, and the block's
//                        scale 2^(s-127) applied in float32 when the block is promoted into the
//                        accumulator (as the FP8 block-scaled kernel applies its scales). So every
//                        scale byte 0..254 is exact, including those outside float16's range.
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

constexpr int kMxfp4SliceK = 64;  // values of k staged in shared memory per step: two scale blocks
constexpr int kMxfp4SliceBlocks = kMxfp4SliceK / kMxfp4BlockValues;
// A stage: 16-bit values, +8 a row so the fragment loads of a warp hit distinct banks.
constexpr int kMxfp4APitch = kMxfp4SliceK + 8;
// B stage: packed bytes (two values each), +4 a row for the same reason.
constexpr int kMxfp4BPitch = kMxfp4SliceK / 2 + 4;

}  // namespace moeroute

// Grid: (row tiles, ceil(n / BLOCK_N)); block: WARPS_M * WARPS_N warps. Each warp owns
// (TILE_M / WARPS_M) x (BLOCK_N / WARPS_N) outputs per gate as 16x8 mma tiles. Needs A rows and
// the blocks 4-byte aligned (the launcher checks; k % 32 == 0 by the format).
template <typename T, int TILE_M, int BLOCK_N, int WARPS_M, int WARPS_N, int MIN_BLOCKS, int GATED>
__global__ void MOEROUTE_LAUNCH_BOUNDS(WARPS_M* WARPS_N* MOEROUTE_WARP_SIZE, MIN_BLOCKS)
    moe_gemm_mxfp4_mma(const T* __restrict__ a, const unsigned char* __restrict__ b_blocks,
                       const unsigned char* __restrict__ b_scales, T* __restrict__ c,
                       const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                       const float* __restrict__ topk_weights, const float* __restrict__ bias, int numel,
                       int top_k, int n, int k, int block_size, int activation, int apply_router_weight,
                       int has_bias) {
  using namespace moeroute;
  static_assert(MOEROUTE_WARP_SIZE == 32, "mma.sync fragments are laid out over 32 lanes");
  constexpr int THREADS = WARPS_M * WARPS_N * MOEROUTE_WARP_SIZE;
  constexpr int GATES = GATED ? 2 : 1;
  constexpr int WARP_M = TILE_M / WARPS_M, WARP_N = BLOCK_N / WARPS_N;
  constexpr int M_TILES = WARP_M / 16, N_TILES = WARP_N / 8;
  static_assert(WARP_M % 16 == 0 && WARP_N % 8 == 0, "warp tiles are whole 16x8 mma tiles");
  constexpr int A_WORDS_PER_ROW = kMxfp4SliceK / 2;  // two 16-bit values a word
  constexpr int B_WORDS_PER_ROW = kMxfp4SliceK / 8;  // eight values a word

  __shared__ unsigned int a_words[TILE_M * kMxfp4APitch / 2];
  __shared__ unsigned int b_words[GATES * BLOCK_N * kMxfp4BPitch / 4];
  __shared__ float block_scale[GATES * BLOCK_N][kMxfp4SliceBlocks];
  __shared__ int token_row[TILE_M];
  const unsigned short* a_stage = reinterpret_cast<const unsigned short*>(a_words);
  const unsigned char* b_stage = reinterpret_cast<const unsigned char*>(b_words);

  const int row0 = blockIdx.x * TILE_M;
  const int n0 = blockIdx.y * BLOCK_N;
  const int expert = expert_ids[row0 / block_size];
  if (expert < 0) return;  // the whole block: no thread reaches a barrier

  const int tid = threadIdx.x;
  const int lane = tid % MOEROUTE_WARP_SIZE, warp = tid / MOEROUTE_WARP_SIZE;
  const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
  const int group = lane / 4, thread_in_group = lane % 4;
  for (int r = tid; r < TILE_M; r += THREADS) token_row[r] = sorted_token_ids[row0 + r];

  const int k_blocks = k / kMxfp4BlockValues;
  const long long expert_rows = static_cast<long long>(expert) * GATES * n;
  const unsigned char* blocks_expert = b_blocks + expert_rows * k_blocks * kMxfp4BlockBytes;
  const unsigned char* scales_expert = b_scales + expert_rows * k_blocks;
  const unsigned int* a_source = reinterpret_cast<const unsigned int*>(a);

  float accumulator[GATES][M_TILES][N_TILES][4] = {};
  for (int k0 = 0; k0 < k; k0 += kMxfp4SliceK) {
    // Every thread is done with the previous slice (and token_row is written).
    __syncthreads();
    for (int e = tid; e < TILE_M * A_WORDS_PER_ROW; e += THREADS) {
      const int row = e / A_WORDS_PER_ROW, word = e % A_WORDS_PER_ROW;
      const int token = token_row[row];
      unsigned int value = 0u;
      if (token < numel && k0 + 2 * word < k)
        value = a_source[(static_cast<long long>(token / top_k) * k + k0) / 2 + word];
      a_words[row * (kMxfp4APitch / 2) + word] = value;
    }
    for (int e = tid; e < GATES * BLOCK_N * B_WORDS_PER_ROW; e += THREADS) {
      const int row = e / B_WORDS_PER_ROW, word = e % B_WORDS_PER_ROW;
      const int gate = row / BLOCK_N, col = n0 + row % BLOCK_N;
      unsigned int value = 0u;  // zero bytes: e2m1 zeros
      if (col < n && k0 + 8 * word < k) {
        const long long weight_row = static_cast<long long>(gate) * n + col;
        value = reinterpret_cast<const unsigned int*>(blocks_expert + weight_row * (k / 2) + k0 / 2)[word];
      }
      b_words[row * (kMxfp4BPitch / 4) + word] = value;
    }
    for (int e = tid; e < GATES * BLOCK_N * kMxfp4SliceBlocks; e += THREADS) {
      const int row = e / kMxfp4SliceBlocks, slice_block = e % kMxfp4SliceBlocks;
      const int gate = row / BLOCK_N, col = n0 + row % BLOCK_N;
      const int k_block = k0 / kMxfp4BlockValues + slice_block;
      float scale = 0.0f;
      if (col < n && k_block < k_blocks)
        scale = mxfp4_scale(scales_expert[(static_cast<long long>(gate) * n + col) * k_blocks + k_block]);
      block_scale[row][slice_block] = scale;
    }
    __syncthreads();
    MOEROUTE_UNROLL
    for (int slice_block = 0; slice_block < kMxfp4SliceBlocks; ++slice_block) {
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
          const int col = gate * BLOCK_N + warp_n * WARP_N + nt * 8 + 2 * thread_in_group;
          const float scale[2] = {block_scale[col][slice_block], block_scale[col + 1][slice_block]};
          MOEROUTE_UNROLL
          for (int mt = 0; mt < M_TILES; ++mt) {
            MOEROUTE_UNROLL
            for (int i = 0; i < 4; ++i) accumulator[gate][mt][nt][i] += partial[gate][mt][nt][i] * scale[i % 2];
          }
        }
      }
    }
  }

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
