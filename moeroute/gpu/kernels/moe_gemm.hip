// Generated from moe_gemm.cu by tools/hipify_kernels.py (torch.utils.hipify name mapping);
// do not edit: change moe_gemm.cu and rerun the script.
// Grouped expert GEMMs over expert-sorted, block-padded rows (docs/semantics.md section 5) and the sum over
// each token's top-k outputs.
//
// Rows come from align_block_size (docs/semantics.md section 4): block b of block_size consecutive entries of
// sorted_token_ids belongs to expert expert_ids[b] (-1: nothing to do); entry j holds the flat
// index t*top_k + k of a (token, slot), or numel for padding. Token rows are read through that
// index (no gathered copy) and results are written to row `flat index` of the output, so padding
// rows and slots of other ranks are never read or written. A thread block computes TILE_M rows;
// TILE_M divides block_size, so a tile never straddles two experts.
//
//   gate_up (GATED = 1): A = hidden_states [T, H], row flat/top_k; B = w_gate_up[e] [2I, H]
//     (gate rows first, then up); C = intermediate [numel, I] = act(A gate^T) * (A up^T), or
//     for swigluoai (gpt-oss) (clamp(A up^T) + 1) * g * sigmoid(1.702 g), g = min(A gate^T, 7).
//   down    (GATED = 0): A = intermediate [numel, I], row flat (top_k = 1); B = w_down[e] [H, I];
//     C = expert_out [numel, H] = A B^T, times topk_weights[flat] when apply_router_weight.
// With has_bias, bias[e] ([2I]: gate entries then up entries; [H] for down) is added to the
// products before the activation / the router weight; without it `bias` is never read.
// Accumulation is float32 on every path; C is written in the input type.
//
// Two implementations of the same contract:
//   moe_gemm_simt  every type, every GPU (and the host emulation): shared-memory tiles in float32.
//   moe_gemm_mma   float16 / bfloat16 on sm_80+: cp.async pipeline, ldmatrix, mma.sync m16n8k16,
//                  packed 4-byte epilogue stores. Needs k % 8 == 0 and 16-byte aligned A / B (the
//                  launcher checks). Tile shape, k slice, pipeline depth and occupancy are template
//                  arguments: launch.py holds one configuration for sm_80 and one for sm_90.
#include "moe_tile.cuh"

namespace moeroute {

// Float weights: A and B of T (float32, float16, bfloat16) read as they are, bias of T.
template <typename T, int GATES>
struct FloatDecoder {
  static constexpr bool kGrouped = false;
  const T* a;
  const T* b;
  const T* bias_values;
  int n, k;

  MOEROUTE_DEVICE int group_k() const { return k; }
  MOEROUTE_DEVICE float a_value(long long a_row, int col) const { return to_float(a[a_row * k + col]); }
  MOEROUTE_DEVICE void b_pair(int expert, int gate, int col, int kcol, bool hi_valid, float& lo, float& hi) const {
    const T* row = b + ((static_cast<long long>(expert) * GATES + gate) * n + col) * k + kcol;
    lo = to_float(row[0]);
    if (hi_valid) hi = to_float(row[1]);
  }
  MOEROUTE_DEVICE float bias(int expert, int gate, int col) const {
    return to_float(bias_values[(static_cast<long long>(expert) * GATES + gate) * n + col]);
  }
  MOEROUTE_DEVICE float row_scale(long long, int) const { return 1.0f; }
  MOEROUTE_DEVICE float col_scale(int, int, int, int) const { return 1.0f; }
};

}  // namespace moeroute

// Grid: (row tiles, ceil(n / kSimtBlockN)); block: kSimtThreads.
template <typename T, int TILE_M, int GATED>
__global__ void MOEROUTE_LAUNCH_BOUNDS(moeroute::kSimtThreads, moeroute::kSimtMinBlocksPerMultiprocessor)
    moe_gemm_simt(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c,
                  const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                  const float* __restrict__ topk_weights, const T* __restrict__ bias, int numel, int top_k,
                  int n, int k, int block_size, int activation, int apply_router_weight, int has_bias) {
  using namespace moeroute;
  const FloatDecoder<T, GATED ? 2 : 1> decoder{a, b, bias, n, k};
  moe_tile_simt<FloatDecoder<T, GATED ? 2 : 1>, T, TILE_M, GATED>(decoder, c, sorted_token_ids, expert_ids,
                                                                  topk_weights, numel, top_k, n, k, block_size,
                                                                  activation, apply_router_weight, has_bias);
}

#if MOEROUTE_HAS_MMA

namespace moeroute {

// The tile configurations (launch.py MMA_TILES, MMA_TILES_SM90) choose the k slice per stage
// (BLOCK_K), the pipeline depth (STAGES) and the resident blocks ptxas must allow (MIN_BLOCKS).
constexpr int kMmaRowPadding = 8;  // +16 bytes a row: ldmatrix's 8 row reads hit distinct banks
constexpr int kMmaChunk = 8;       // 16-bit values per 16-byte cp.async
constexpr int kMmaGroupM = 8;      // row tiles walked together: their A rows stay in L2

// Issues the cp.async of one stage: TILE_M rows of A (through token_row), then GATES * BLOCK_N
// rows of B (gate rows n0.., then up rows n + n0..), BLOCK_K values each from column k0.
// Rows and columns out of range are zero-filled.
template <int TILE_M, int BLOCK_N, int BLOCK_K, int GATES, int THREADS>
MOEROUTE_DEVICE void mma_load_stage(unsigned short* a_stage, unsigned short* b_stage,
                                    const unsigned short* a_values, const unsigned short* b_values,
                                    const int* token_row, int numel, int top_k, int n, int k, int n0, int k0,
                                    int tid) {
  constexpr int kRowPitch = BLOCK_K + kMmaRowPadding;
  constexpr int kChunksPerRow = BLOCK_K / kMmaChunk;
  MOEROUTE_UNROLL
  for (int i = 0; i < (TILE_M * kChunksPerRow + THREADS - 1) / THREADS; ++i) {
    const int chunk = tid + i * THREADS;
    if (chunk < TILE_M * kChunksPerRow) {
      const int row = chunk / kChunksPerRow, offset = (chunk % kChunksPerRow) * kMmaChunk;
      const int token = token_row[row];
      const bool valid = token < numel && k0 + offset < k;
      const unsigned short* source =
          valid ? a_values + static_cast<long long>(token / top_k) * k + k0 + offset : a_values;
      cp_async_16(a_stage + row * kRowPitch + offset, source, valid);
    }
  }
  constexpr int B_CHUNKS = GATES * BLOCK_N * kChunksPerRow;
  static_assert(B_CHUNKS % THREADS == 0, "every thread issues the same number of B copies");
  MOEROUTE_UNROLL
  for (int i = 0; i < B_CHUNKS / THREADS; ++i) {
    const int chunk = tid + i * THREADS;
    const int row = chunk / kChunksPerRow, offset = (chunk % kChunksPerRow) * kMmaChunk;
    const int gate = row / BLOCK_N, col = n0 + row % BLOCK_N;
    const bool valid = col < n && k0 + offset < k;
    const unsigned short* source =
        valid ? b_values + (static_cast<long long>(gate) * n + col) * k + k0 + offset : b_values;
    cp_async_16(b_stage + row * kRowPitch + offset, source, valid);
  }
}

}  // namespace moeroute

// Grid: (row tiles * ceil(n / BLOCK_N)), walked in groups of kMmaGroupM row tiles;
// block: WARPS_M * WARPS_N warps; dynamic shared memory:
// STAGES * (TILE_M + GATES * BLOCK_N) * (BLOCK_K + kMmaRowPadding) 16-bit values.
// MIN_BLOCKS resident blocks per multiprocessor cap ptxas at 65536 / (MIN_BLOCKS * threads)
// registers per thread.
template <typename T, int TILE_M, int BLOCK_N, int WARPS_M, int WARPS_N, int BLOCK_K, int STAGES, int MIN_BLOCKS,
          int GATED>
__global__ void MOEROUTE_LAUNCH_BOUNDS(WARPS_M* WARPS_N* MOEROUTE_WARP_SIZE, MIN_BLOCKS)
    moe_gemm_mma(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c,
                 const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                 const float* __restrict__ topk_weights, const T* __restrict__ bias, int numel, int top_k,
                 int n, int k, int block_size, int activation, int apply_router_weight, int has_bias,
                 int num_m_tiles) {
  using namespace moeroute;
  static_assert(MOEROUTE_WARP_SIZE == 32, "mma.sync fragments are laid out over 32 lanes");
  constexpr int THREADS = WARPS_M * WARPS_N * MOEROUTE_WARP_SIZE;
  constexpr int GATES = GATED ? 2 : 1;
  constexpr int WARP_M = TILE_M / WARPS_M, WARP_N = BLOCK_N / WARPS_N;
  constexpr int M_TILES = WARP_M / 16, N_TILES = WARP_N / 8;
  static_assert(WARP_M % 16 == 0 && WARP_N % 16 == 0, "warp tiles are whole 16x16 pairs of fragments");
  static_assert(BLOCK_K % 16 == 0 && STAGES >= 2, "whole k16 steps per stage, one stage loading while one computes");
  constexpr int kRowPitch = BLOCK_K + kMmaRowPadding;
  constexpr int STAGE_VALUES = (TILE_M + GATES * BLOCK_N) * kRowPitch;

  MOEROUTE_DYNAMIC_SHARED(shared_bytes);
  unsigned short* stages = reinterpret_cast<unsigned short*>(shared_bytes);
  __shared__ int token_row[TILE_M];
  // The block's expert, for the bias in the epilogue: kept in shared memory rather than a
  // register live across the main loop (which made ptxas spill the bf16 64x64 gated tile).
  __shared__ int block_expert;

  const int num_n_tiles = (n + BLOCK_N - 1) / BLOCK_N;
  const int tiles_per_group = kMmaGroupM * num_n_tiles;
  const int first_m_tile = (static_cast<int>(blockIdx.x) / tiles_per_group) * kMmaGroupM;
  const int rows_in_group = num_m_tiles - first_m_tile < kMmaGroupM ? num_m_tiles - first_m_tile : kMmaGroupM;
  const int in_group = static_cast<int>(blockIdx.x) % tiles_per_group;
  const int row0 = (first_m_tile + in_group % rows_in_group) * TILE_M;
  const int n0 = (in_group / rows_in_group) * BLOCK_N;

  const int expert = expert_ids[row0 / block_size];
  if (expert < 0) return;  // the whole block: no thread reaches a barrier

  const int tid = threadIdx.x;
  const int lane = tid % MOEROUTE_WARP_SIZE, warp = tid / MOEROUTE_WARP_SIZE;
  const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
  for (int r = tid; r < TILE_M; r += THREADS) token_row[r] = sorted_token_ids[row0 + r];
  if (tid == 0) block_expert = expert;
  __syncthreads();

  const unsigned short* a_values = reinterpret_cast<const unsigned short*>(a);
  const unsigned short* b_values =
      reinterpret_cast<const unsigned short*>(b) + static_cast<long long>(expert) * GATES * n * k;

  float accumulator[GATES][M_TILES][N_TILES][4] = {};
  const int k_tiles = (k + BLOCK_K - 1) / BLOCK_K;

  // Every step commits one group (possibly empty) so that wait_group counts stay in step.
  MOEROUTE_UNROLL
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) {
      unsigned short* a_stage = stages + s * STAGE_VALUES;
      mma_load_stage<TILE_M, BLOCK_N, BLOCK_K, GATES, THREADS>(a_stage, a_stage + TILE_M * kRowPitch, a_values,
                                                       b_values, token_row, numel, top_k, n, k, n0,
                                                       s * BLOCK_K, tid);
    }
    cp_async_commit();
  }

  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    // Tile kt is visible to all threads, and every warp is done with the stage refilled below.
    __syncthreads();
    const int next = kt + STAGES - 1;
    if (next < k_tiles) {
      unsigned short* a_stage = stages + (next % STAGES) * STAGE_VALUES;
      mma_load_stage<TILE_M, BLOCK_N, BLOCK_K, GATES, THREADS>(a_stage, a_stage + TILE_M * kRowPitch, a_values,
                                                       b_values, token_row, numel, top_k, n, k, n0,
                                                       next * BLOCK_K, tid);
    }
    cp_async_commit();

    const unsigned short* a_stage = stages + (kt % STAGES) * STAGE_VALUES;
    const unsigned short* b_stage = a_stage + TILE_M * kRowPitch;
    MOEROUTE_UNROLL
    for (int kk = 0; kk < BLOCK_K; kk += 16) {
      unsigned int a_fragment[M_TILES][4];
      MOEROUTE_UNROLL
      for (int mt = 0; mt < M_TILES; ++mt) {
        // Lanes 0-15 address rows 0-15 at column kk, lanes 16-31 the same rows at kk + 8.
        const int row = warp_m * WARP_M + mt * 16 + lane % 16;
        ldmatrix_x4(a_fragment[mt], a_stage + row * kRowPitch + kk + (lane / 16) * 8);
      }
      MOEROUTE_UNROLL
      for (int g = 0; g < GATES; ++g) {
        MOEROUTE_UNROLL
        for (int nt = 0; nt < N_TILES; nt += 2) {
          // Matrices: (n 0-7, k 0-7) (n 0-7, k 8-15) (n 8-15, k 0-7) (n 8-15, k 8-15).
          const int row = g * BLOCK_N + warp_n * WARP_N + nt * 8 + (lane / 16) * 8 + lane % 8;
          unsigned int b_fragment[4];
          ldmatrix_x4(b_fragment, b_stage + row * kRowPitch + kk + ((lane / 8) % 2) * 8);
          MOEROUTE_UNROLL
          for (int mt = 0; mt < M_TILES; ++mt) {
            mma_m16n8k16<T>(accumulator[g][mt][nt], a_fragment[mt], b_fragment[0], b_fragment[1]);
            mma_m16n8k16<T>(accumulator[g][mt][nt + 1], a_fragment[mt], b_fragment[2], b_fragment[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  const int group = lane / 4, thread_in_group = lane % 4;
  MOEROUTE_UNROLL
  for (int mt = 0; mt < M_TILES; ++mt) {
    MOEROUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int token = token_row[warp_m * WARP_M + mt * 16 + group + 8 * half];
      if (token >= numel) continue;
      const float scale = (!GATED && apply_router_weight) ? topk_weights[token] : 1.0f;
      T* c_row = c + static_cast<long long>(token) * n;
      const T* bias_row = bias + static_cast<long long>(block_expert) * GATES * n;
      MOEROUTE_UNROLL
      for (int nt = 0; nt < N_TILES; ++nt) {
        // The fragment holds two adjacent columns of this row: one packed store.
        const int col = n0 + warp_n * WARP_N + nt * 8 + 2 * thread_in_group;
        if (col >= n) continue;
        float value[2];
        MOEROUTE_UNROLL
        for (int j = 0; j < 2; ++j) {
          float first = accumulator[0][mt][nt][2 * half + j], second = accumulator[GATES - 1][mt][nt][2 * half + j];
          if (has_bias && col + j < n) {
            first += to_float(bias_row[col + j]);
            if (GATED) second += to_float(bias_row[n + col + j]);
          }
          value[j] = GATED ? gated_activate(first, second, activation) : first * scale;
        }
        store_pair(c_row + col, value[0], value[1], col + 1 < n);
      }
    }
  }
}

#endif  // MOEROUTE_HAS_MMA

namespace moeroute {
constexpr int kSumThreads = 256;  // columns of one token per pass
}

// out[t, :] = sum over slots k with 0 <= topk_ids[t, k] < num_experts of expert_out[t*top_k + k, :],
// in slot order, float32 accumulation. Tokens with no such slot get zeros.
template <typename T>
__global__ void __launch_bounds__(moeroute::kSumThreads)
    moe_sum_topk(const T* __restrict__ expert_out, const int* __restrict__ topk_ids, T* __restrict__ out, int top_k,
                 int h, int num_experts) {
  using namespace moeroute;
  const long long token = blockIdx.x;
  const int* ids = topk_ids + token * top_k;
  for (int col = threadIdx.x; col < h; col += kSumThreads) {
    float sum = 0.0f;
    for (int slot = 0; slot < top_k; ++slot) {
      const int expert = ids[slot];
      if (expert >= 0 && expert < num_experts) sum += to_float(expert_out[(token * top_k + slot) * h + col]);
    }
    out[token * h + col] = from_float<T>(sum);
  }
}
