// FP8 (e4m3) expert GEMMs over expert-sorted, block-padded rows: the w8a8 numerics of docs/quant.md.
//
// Five kernels, launched by moeroute/gpu/gemm_fp8.py (the same plans drive the host emulation):
//
//   fp8_quantize_groups   x [rows, cols] (float32 / float16 / bfloat16) -> q [rows, cols] e4m3 bytes and
//                         scales [rows, ceil(cols / group_size)] float32, per row and group of columns:
//                         s = max(amax(|x_group|), 1e-10) / 448 (ue8m0: the smallest power of two >= s),
//                         q = e4m3(clamp(x / s, -448, 448)), rounded to nearest even, as torch's cast.
//   moe_gemm_fp8_simt     every GPU (and the host emulation, and HIP): e4m3 decoded to float in registers.
//   moe_gemm_fp8_mma      sm_89+: mma.sync m16n8k32 e4m3 x e4m3 -> float32.
//   moe_gemm_fp8w16_simt  w8a16 (activation="none"), every GPU: activations as they are, each weight
//                         e4m3 * s decoded to float32 in the tile, y = x @ w^T summed in float32.
//   moe_gemm_fp8w16_mma   w8a16, float16 / bfloat16 on sm_80+: e4m3 decoded in registers to exact
//                         16-bit values, mma.sync m16n8k16 per 32 columns, the block scale applied
//                         to the float32 sums (moe_tile_narrow_mma).
//
// Both GEMMs compute, for a row m (one (token, slot) of the sorted layout) and an output column n,
//
//   y[m, n] = sum_g s_a[m, g] * s_w[n // bn, g] * dot(q_a[m, group g], q_w[n, group g])
//
// with groups of bk columns of k (the last one may be partial): the dot of a group is summed in
// float32 on its own and promoted into the float32 accumulator with the two scales. The weight
// scales of one expert are [GATES * ceil(n / bn), ceil(k / bk)] (gate_up: the gate's block rows,
// then the up's). Per-tensor FP8 is the same kernel with bn = n and bk = k: one weight scale per
// expert and projection ([E, GATES]) and one activation scale per row ([rows, 1]).
//
//   gate_up (GATED = 1): A rows j / top_k of the quantized hidden states; C = intermediate
//     [numel, n] = act(gate) * up in the output type T.
//   down    (GATED = 0): A rows j of the quantized intermediate (top_k = 1); C = expert_out
//     [numel, n], times topk_weights[j] when apply_router_weight.
// Rows, padding and slots of other ranks are handled as in moe_gemm.cu (included below for its
// activations and moe_sum_topk).
#include "moe_gemm.cu"

// FP8 matrix instructions: sm_89 (Ada) and newer. The host emulation emulates them from the PTX
// fragment tables; HIP builds (and older NVIDIA GPUs) keep the SIMT kernel.
#if defined(MOEROUTE_PLATFORM_HOST)
#define MOEROUTE_HAS_FP8_MMA 1
#elif defined(MOEROUTE_PLATFORM_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define MOEROUTE_HAS_FP8_MMA 1
#else
#define MOEROUTE_HAS_FP8_MMA 0
#endif

namespace moeroute {

constexpr float kFp8Max = 448.0f;     // largest finite e4m3 magnitude
constexpr float kFp8MinAmax = 1e-10f; // floor of amax: an all-zero group gets a finite scale
constexpr float kFp8MinNormal = 0.015625f;  // 2^-6: below it e4m3 values are multiples of 2^-9
constexpr float kFp8SubnormalStep = 0.001953125f;  // 2^-9
constexpr unsigned int kFp8Nan = 0x7fu;
constexpr int kQuantThreads = 128;  // threads per row of fp8_quantize_groups

// e4m3 byte -> float (exact). 0x7f / 0xff (NaN) are never produced by the quantizer.
MOEROUTE_DEVICE float e4m3_to_float(unsigned int byte) {
  const unsigned int exponent = (byte >> 3) & 0xfu, mantissa = byte & 0x7u;
  const float magnitude = exponent ? bits_to_float(((exponent + 120u) << 23) | (mantissa << 20))
                                   : static_cast<float>(mantissa) * kFp8SubnormalStep;
  return (byte & 0x80u) ? -magnitude : magnitude;
}

// float -> e4m3 byte: clamp to [-448, 448], round to nearest even (torch's float8_e4m3fn cast).
MOEROUTE_DEVICE unsigned char float_to_e4m3(float value) {
  const unsigned int sign = (float_to_bits(value) >> 24) & 0x80u;
  float magnitude = fabsf(value);
  if (!(magnitude == magnitude)) return static_cast<unsigned char>(sign | kFp8Nan);
  magnitude = fminf(magnitude, kFp8Max);
  unsigned int code;
  if (magnitude < kFp8MinNormal) {
    code = static_cast<unsigned int>(rintf(magnitude / kFp8SubnormalStep));  // 8 rounds up to 2^-6
  } else {
    unsigned int bits = float_to_bits(magnitude);
    bits += 0x7ffffu + ((bits >> 20) & 1u);  // round the 23-bit mantissa to 3 bits, ties to even
    code = (bits >> 20) - (120u << 3);        // rebias the exponent: 127 -> 7
  }
  return static_cast<unsigned char>(sign | code);
}

// The scale of a group from its amax; ue8m0: the smallest power of two >= the float scale.
MOEROUTE_DEVICE float fp8_group_scale(float amax, int ue8m0) {
  const float scale = fmaxf(amax, kFp8MinAmax) / kFp8Max;
  if (!ue8m0) return scale;
  const unsigned int bits = float_to_bits(scale);
  return (bits & 0x7fffffu) ? bits_to_float((bits & 0x7f800000u) + 0x800000u) : scale;
}

}  // namespace moeroute

// Grid: rows; block: kQuantThreads. scales is [rows, ceil(cols / group_size)].
template <typename T>
__global__ void __launch_bounds__(moeroute::kQuantThreads)
    fp8_quantize_groups(const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scales,
                        int cols, int group_size, int ue8m0) {
  using namespace moeroute;
  __shared__ float partial_amax[kQuantThreads];
  const long long row = blockIdx.x;
  const int tid = threadIdx.x;
  const int groups = (cols + group_size - 1) / group_size;
  const T* x_row = x + row * cols;
  unsigned char* q_row = q + row * cols;
  for (int g = 0; g < groups; ++g) {
    const int begin = g * group_size;
    const int end = begin + group_size < cols ? begin + group_size : cols;
    float amax = 0.0f;
    for (int col = begin + tid; col < end; col += kQuantThreads) amax = fmaxf(amax, fabsf(to_float(x_row[col])));
    partial_amax[tid] = amax;
    __syncthreads();
    for (int width = kQuantThreads / 2; width > 0; width /= 2) {
      if (tid < width) partial_amax[tid] = fmaxf(partial_amax[tid], partial_amax[tid + width]);
      __syncthreads();
    }
    const float scale = fp8_group_scale(partial_amax[0], ue8m0);
    if (tid == 0) scales[row * groups + g] = scale;
    for (int col = begin + tid; col < end; col += kQuantThreads) q_row[col] = float_to_e4m3(to_float(x_row[col]) / scale);
    __syncthreads();  // partial_amax is refilled by the next group
  }
}

// Static activation scales (fp8_tensor with given input scales): row j of q is row j / row_divisor
// of x divided by the scale of slot j's expert, input_scale[expert * scale_stride + scale_offset];
// scales[j] receives that scale. Slots whose id is outside [0, num_experts) are left alone.
// Grid: rows of q; block: kQuantThreads.
template <typename T>
__global__ void __launch_bounds__(moeroute::kQuantThreads)
    fp8_quantize_static(const T* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scales,
                        const int* __restrict__ topk_ids, const float* __restrict__ input_scale, int cols,
                        int row_divisor, int scale_stride, int scale_offset, int num_experts) {
  using namespace moeroute;
  const long long row = blockIdx.x;
  const int expert = topk_ids[row];
  if (expert < 0 || expert >= num_experts) return;
  const float scale = input_scale[static_cast<long long>(expert) * scale_stride + scale_offset];
  if (threadIdx.x == 0) scales[row] = scale;
  const T* x_row = x + (row / row_divisor) * cols;
  for (int col = threadIdx.x; col < cols; col += kQuantThreads)
    q[row * cols + col] = float_to_e4m3(to_float(x_row[col]) / scale);
}

namespace moeroute {

// w8a8: A e4m3 rows with float32 scales [rows of A, ceil(k / bk)], B e4m3 with block scales
// [E, GATES * ceil(n / bn), ceil(k / bk)]; products of e4m3 values summed per group of bk
// columns, promoted with s_a * s_w.
template <int GATES>
struct Fp8Decoder {
  static constexpr bool kGrouped = true;
  const unsigned char* a;
  const float* a_scale;
  const unsigned char* b;
  const float* b_scale;
  int n, k, bn, bk;

  MOEROUTE_DEVICE int group_k() const { return bk; }
  MOEROUTE_DEVICE int groups() const { return (k + bk - 1) / bk; }
  MOEROUTE_DEVICE float a_value(long long a_row, int col) const { return e4m3_to_float(a[a_row * k + col]); }
  MOEROUTE_DEVICE void b_pair(int expert, int gate, int col, int kcol, bool hi_valid, float& lo, float& hi) const {
    const unsigned char* row = b + ((static_cast<long long>(expert) * GATES + gate) * n + col) * k + kcol;
    lo = e4m3_to_float(row[0]);
    if (hi_valid) hi = e4m3_to_float(row[1]);
  }
  MOEROUTE_DEVICE float row_scale(long long a_row, int g) const { return a_scale[a_row * groups() + g]; }
  MOEROUTE_DEVICE float col_scale(int expert, int gate, int col, int g) const {
    const int n_blocks = (n + bn - 1) / bn;
    return b_scale[((static_cast<long long>(expert) * GATES + gate) * n_blocks + col / bn) * groups() + g];
  }
  MOEROUTE_DEVICE float bias(int, int, int) const { return 0.0f; }
};

// w8a16: A of T as it is; B e4m3 times its block's float32 scale, decoded to float32 in the
// tile (w = e4m3 * s, the dequantized weight of docs/quant.md), then one float32 sum over k.
template <typename T, int GATES>
struct Fp8W16Decoder {
  static constexpr bool kGrouped = false;
  static constexpr int kValuesPerByte = 1;
  const T* a;
  const unsigned char* b;
  const float* b_scale;
  int n, k, bn, bk;

  MOEROUTE_DEVICE int group_k() const { return k; }
  MOEROUTE_DEVICE float a_value(long long a_row, int col) const { return to_float(a[a_row * k + col]); }
  MOEROUTE_DEVICE float scale(long long block_row, int kcol) const {
    return b_scale[block_row * ((k + bk - 1) / bk) + kcol / bk];
  }
  MOEROUTE_DEVICE void b_pair(int expert, int gate, int col, int kcol, bool hi_valid, float& lo, float& hi) const {
    const long long weight_row = (static_cast<long long>(expert) * GATES + gate) * n + col;
    const long long block_row = (static_cast<long long>(expert) * GATES + gate) * ((n + bn - 1) / bn) + col / bn;
    const unsigned char* row = b + weight_row * k + kcol;
    lo = e4m3_to_float(row[0]) * scale(block_row, kcol);
    if (hi_valid) hi = e4m3_to_float(row[1]) * scale(block_row, kcol + 1);
  }
  MOEROUTE_DEVICE float row_scale(long long, int) const { return 1.0f; }
  MOEROUTE_DEVICE float col_scale(int, int, int, int) const { return 1.0f; }
  MOEROUTE_DEVICE float bias(int, int, int) const { return 0.0f; }

  // mma (moe_tile_narrow_mma): the e4m3 bytes staged as they are, each decoded in registers to
  // its exact 16-bit value (at most 4 significant bits, exponents 2^-9 .. 2^8: exact in float16
  // and bfloat16), the (bn, bk) block's scale applied to each 32-column block's float32 sums;
  // needs bk % 32 == 0 (the launcher checks). No per-tile metadata.
  template <int BLOCK_N, int TILE_GATES, int THREADS>
  MOEROUTE_DEVICE void stage_metadata(unsigned char*, int, int, int) const {}
#if MOEROUTE_HAS_MMA
  template <typename U>
  MOEROUTE_DEVICE unsigned int pair16(const unsigned char*, int, int, const unsigned char* row, int first) const {
    return static_cast<unsigned int>(from_float<U>(e4m3_to_float(row[first])).bits) |
           (static_cast<unsigned int>(from_float<U>(e4m3_to_float(row[first + 1])).bits) << 16);
  }
  MOEROUTE_DEVICE float block_scale(const unsigned char*, int, int expert, int gate, int col, int k_block) const {
    if (col >= n) return 0.0f;
    const long long block_row = (static_cast<long long>(expert) * GATES + gate) * ((n + bn - 1) / bn) + col / bn;
    return scale(block_row, k_block * kNarrowBlockValues);
  }
#endif
};

}  // namespace moeroute

// Grid: (row tiles, ceil(n / kSimtBlockN)); block: kSimtThreads. Tiling as moe_gemm_simt.
template <typename T, int TILE_M, int GATED>
__global__ void MOEROUTE_LAUNCH_BOUNDS(moeroute::kSimtThreads, moeroute::kSimtMinBlocksPerMultiprocessor)
    moe_gemm_fp8_simt(const unsigned char* __restrict__ a, const float* __restrict__ a_scale,
                      const unsigned char* __restrict__ b, const float* __restrict__ b_scale, T* __restrict__ c,
                      const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                      const float* __restrict__ topk_weights, int numel, int top_k, int n, int k, int bn, int bk,
                      int block_size, int activation, int apply_router_weight) {
  using namespace moeroute;
  using Decoder = Fp8Decoder<GATED ? 2 : 1>;
  const Decoder decoder{a, a_scale, b, b_scale, n, k, bn, bk};
  moe_tile_simt<Decoder, T, TILE_M, GATED>(decoder, c, sorted_token_ids, expert_ids, topk_weights, numel, top_k, n,
                                           k, block_size, activation, apply_router_weight, 0);
}

// w8a16 (QuantConfig("fp8_block", activation="none")): A of T, not quantized; weights and
// scales as moe_gemm_fp8_simt's. Grid and block as moe_gemm_simt.
template <typename T, int TILE_M, int GATED>
__global__ void MOEROUTE_LAUNCH_BOUNDS(moeroute::kSimtThreads, moeroute::kSimtMinBlocksPerMultiprocessor)
    moe_gemm_fp8w16_simt(const T* __restrict__ a, const unsigned char* __restrict__ b,
                         const float* __restrict__ b_scale, T* __restrict__ c,
                         const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                         const float* __restrict__ topk_weights, int numel, int top_k, int n, int k, int bn, int bk,
                         int block_size, int activation, int apply_router_weight) {
  using namespace moeroute;
  using Decoder = Fp8W16Decoder<T, GATED ? 2 : 1>;
  const Decoder decoder{a, b, b_scale, n, k, bn, bk};
  moe_tile_simt<Decoder, T, TILE_M, GATED>(decoder, c, sorted_token_ids, expert_ids, topk_weights, numel, top_k, n,
                                           k, block_size, activation, apply_router_weight, 0);
}

#if MOEROUTE_HAS_MMA

// w8a16 on sm_80+ for float16 / bfloat16 activations (moe_tile_narrow_mma with Fp8W16Decoder):
// grid (row tiles, ceil(n / BLOCK_N)), block WARPS_M * WARPS_N warps, dynamic shared memory
// STAGES * (TILE_M * kNarrowAPitch * 2 + GATES * BLOCK_N * NarrowBPitch<1>::value) bytes. Needs
// k % 32 == 0, bk % 32 == 0 and A and B 16-byte aligned (the launcher checks).
template <typename T, int TILE_M, int BLOCK_N, int WARPS_M, int WARPS_N, int STAGES, int MIN_BLOCKS, int GATED>
__global__ void MOEROUTE_LAUNCH_BOUNDS(WARPS_M* WARPS_N* MOEROUTE_WARP_SIZE, MIN_BLOCKS)
    moe_gemm_fp8w16_mma(const T* __restrict__ a, const unsigned char* __restrict__ b,
                        const float* __restrict__ b_scale, T* __restrict__ c,
                        const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                        const float* __restrict__ topk_weights, int numel, int top_k, int n, int k, int bn, int bk,
                        int block_size, int activation, int apply_router_weight) {
  using namespace moeroute;
  using Decoder = Fp8W16Decoder<T, GATED ? 2 : 1>;
  const Decoder decoder{a, b, b_scale, n, k, bn, bk};
  moe_tile_narrow_mma<Decoder, T, TILE_M, BLOCK_N, WARPS_M, WARPS_N, STAGES, GATED>(
      decoder, a, b, c, sorted_token_ids, expert_ids, topk_weights, numel, top_k, n, k, block_size, activation,
      apply_router_weight, 0);
}

#endif  // MOEROUTE_HAS_MMA

#if MOEROUTE_HAS_FP8_MMA

namespace moeroute {

constexpr int kFp8MmaK = 32;          // k of one mma.sync m16n8k32
constexpr int kFp8SliceK = 64;        // e4m3 bytes of k staged in shared memory per step
constexpr int kFp8RowPadding = 16;    // bytes after each shared row: fragment loads hit distinct banks
constexpr int kFp8RowPitch = kFp8SliceK + kFp8RowPadding;

// accumulator[16x8] += A[16x32] * B[32x8], e4m3 inputs, float32 accumulation. PTX fragment
// layouts (groupID g = lane/4, t = lane%4), four e4m3 per register, lowest k in the low byte:
// A regs (g, 4t..4t+3) (g+8, 4t..) (g, 16+4t..) (g+8, 16+4t..); B regs (k=4t.., n=g) (k=16+4t.., n=g);
// accumulator (g, 2t..2t+1) (g+8, 2t..2t+1).
MOEROUTE_DEVICE void mma_m16n8k32_e4m3(float (&accumulator)[4], const unsigned int (&a)[4], unsigned int b0,
                                       unsigned int b1) {
#if defined(MOEROUTE_PLATFORM_HOST)
  ::moeroute_emu::LaneSlot mine{};
  for (int i = 0; i < 4; ++i) mine.words[i] = a[i];
  mine.words[4] = b0;
  mine.words[5] = b1;
  const ::moeroute_emu::LaneSlot* slots = ::moeroute_emu::exchange(mine);
  const unsigned int lane = ::moeroute_emu::current_lane();
  const unsigned int group = lane / 4, thread_in_group = lane % 4;
  auto byte_of = [&](unsigned int source_lane, unsigned int word, unsigned int index) {
    return (slots[source_lane].words[word] >> (8 * index)) & 0xffu;
  };
  float result[4];
  for (unsigned int i = 0; i < 4; ++i) {
    const unsigned int row = group + 8 * (i / 2), col = 2 * thread_in_group + (i % 2);
    float sum = 0.0f;
    for (unsigned int kk = 0; kk < 32; ++kk) {
      // A (row-major 16x32): register (row/8) + 2*(k/16) of lane (row%8)*4 + (k%16)/4, byte k%4.
      const float a_value = e4m3_to_float(byte_of((row % 8) * 4 + (kk % 16) / 4, row / 8 + 2 * (kk / 16), kk % 4));
      // B (32x8, column-major): register k/16 (words 4, 5) of lane col*4 + (k%16)/4, byte k%4.
      const float b_value = e4m3_to_float(byte_of(col * 4 + (kk % 16) / 4, 4 + kk / 16, kk % 4));
      sum += a_value * b_value;
    }
    result[i] = accumulator[i] + sum;
  }
  for (int i = 0; i < 4; ++i) accumulator[i] = result[i];
#else
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(accumulator[0]), "+f"(accumulator[1]), "+f"(accumulator[2]), "+f"(accumulator[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Stages rows [0, ROWS) of a slice: k columns [k0, k0 + kFp8SliceK) clipped to k_end, zero
// outside. Row r reads source_row(r) (a byte pointer to the row's column 0, or null: zeros).
// Four bytes at a time when `words` (k, the group start and the rows all 4-byte aligned).
template <int ROWS, int THREADS, typename RowOf>
MOEROUTE_DEVICE void fp8_stage_rows(unsigned char* stage, RowOf source_row, int k0, int k_end, bool words, int tid) {
  constexpr int kWordsPerRow = kFp8SliceK / 4;
  for (int e = tid; e < ROWS * kWordsPerRow; e += THREADS) {
    const int row = e / kWordsPerRow, col = (e % kWordsPerRow) * 4;
    const unsigned char* source = source_row(row);
    unsigned int packed = 0;
    if (source != nullptr) {
      if (words && k0 + col + 4 <= k_end) {
        packed = *reinterpret_cast<const unsigned int*>(source + k0 + col);
      } else {
        for (int byte = 0; byte < 4; ++byte)
          if (k0 + col + byte < k_end) packed |= static_cast<unsigned int>(source[k0 + col + byte]) << (8 * byte);
      }
    }
    *reinterpret_cast<unsigned int*>(stage + row * kFp8RowPitch + col) = packed;
  }
}

}  // namespace moeroute

// Grid: (row tiles, ceil(n / BLOCK_N)); block: WARPS_M * WARPS_N warps. Each warp owns
// (TILE_M / WARPS_M) x (BLOCK_N / WARPS_N) outputs per gate as 16x8 mma tiles.
template <typename T, int TILE_M, int BLOCK_N, int WARPS_M, int WARPS_N, int MIN_BLOCKS, int GATED>
__global__ void MOEROUTE_LAUNCH_BOUNDS(WARPS_M* WARPS_N* MOEROUTE_WARP_SIZE, MIN_BLOCKS)
    moe_gemm_fp8_mma(const unsigned char* __restrict__ a, const float* __restrict__ a_scale,
                     const unsigned char* __restrict__ b, const float* __restrict__ b_scale, T* __restrict__ c,
                     const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                     const float* __restrict__ topk_weights, int numel, int top_k, int n, int k, int bn, int bk,
                     int block_size, int activation, int apply_router_weight) {
  using namespace moeroute;
  static_assert(MOEROUTE_WARP_SIZE == 32, "mma.sync fragments are laid out over 32 lanes");
  constexpr int THREADS = WARPS_M * WARPS_N * MOEROUTE_WARP_SIZE;
  constexpr int GATES = GATED ? 2 : 1;
  constexpr int WARP_M = TILE_M / WARPS_M, WARP_N = BLOCK_N / WARPS_N;
  constexpr int M_TILES = WARP_M / 16, N_TILES = WARP_N / 8;
  static_assert(WARP_M % 16 == 0 && WARP_N % 8 == 0, "warp tiles are whole 16x8 mma tiles");

  // Words: the stages are read and written 4 bytes at a time.
  __shared__ unsigned int a_words[TILE_M * kFp8RowPitch / 4];
  __shared__ unsigned int b_words[GATES * BLOCK_N * kFp8RowPitch / 4];
  unsigned char* a_stage = reinterpret_cast<unsigned char*>(a_words);
  unsigned char* b_stage = reinterpret_cast<unsigned char*>(b_words);
  __shared__ int token_row[TILE_M];
  __shared__ float row_scale[TILE_M];
  __shared__ float col_scale[GATES * BLOCK_N];

  const int row0 = blockIdx.x * TILE_M;
  const int n0 = blockIdx.y * BLOCK_N;
  const int expert = expert_ids[row0 / block_size];
  if (expert < 0) return;  // the whole block: no thread reaches a barrier

  const int tid = threadIdx.x;
  const int lane = tid % MOEROUTE_WARP_SIZE, warp = tid / MOEROUTE_WARP_SIZE;
  const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
  const int group = lane / 4, thread_in_group = lane % 4;
  for (int r = tid; r < TILE_M; r += THREADS) token_row[r] = sorted_token_ids[row0 + r];

  const int groups = (k + bk - 1) / bk, n_blocks = (n + bn - 1) / bn;
  const unsigned char* b_expert = b + static_cast<long long>(expert) * GATES * n * k;
  const float* scale_expert = b_scale + static_cast<long long>(expert) * GATES * n_blocks * groups;
  const bool words = k % 4 == 0 && bk % 4 == 0 && (reinterpret_cast<unsigned long long>(a) & 3ull) == 0 &&
                     (reinterpret_cast<unsigned long long>(b) & 3ull) == 0;
  auto a_row = [&](int row) -> const unsigned char* {
    const int token = token_row[row];
    return token < numel ? a + static_cast<long long>(token / top_k) * k : nullptr;
  };
  auto b_row = [&](int row) -> const unsigned char* {
    const int gate = row / BLOCK_N, col = n0 + row % BLOCK_N;
    return col < n ? b_expert + (static_cast<long long>(gate) * n + col) * k : nullptr;
  };

  float accumulator[GATES][M_TILES][N_TILES][4] = {};
  for (int g = 0; g < groups; ++g) {
    const int k_begin = g * bk, k_end = k_begin + bk < k ? k_begin + bk : k;
    // Every thread is done with the previous group's scales (and token_row is written).
    __syncthreads();
    for (int r = tid; r < TILE_M; r += THREADS) {
      const int token = token_row[r];
      row_scale[r] = token < numel ? a_scale[static_cast<long long>(token / top_k) * groups + g] : 0.0f;
    }
    for (int r = tid; r < GATES * BLOCK_N; r += THREADS) {
      const int gate = r / BLOCK_N, col = n0 + r % BLOCK_N;
      col_scale[r] = col < n ? scale_expert[(gate * n_blocks + col / bn) * groups + g] : 0.0f;
    }
    float partial[GATES][M_TILES][N_TILES][4] = {};
    for (int k0 = k_begin; k0 < k_end; k0 += kFp8SliceK) {
      fp8_stage_rows<TILE_M, THREADS>(a_stage, a_row, k0, k_end, words, tid);
      fp8_stage_rows<GATES * BLOCK_N, THREADS>(b_stage, b_row, k0, k_end, words, tid);
      __syncthreads();
      MOEROUTE_UNROLL
      for (int kk = 0; kk < kFp8SliceK; kk += kFp8MmaK) {
        unsigned int a_fragment[M_TILES][4];
        MOEROUTE_UNROLL
        for (int mt = 0; mt < M_TILES; ++mt) {
          const unsigned char* base = a_stage + (warp_m * WARP_M + mt * 16 + group) * kFp8RowPitch + kk + 4 * thread_in_group;
          a_fragment[mt][0] = *reinterpret_cast<const unsigned int*>(base);
          a_fragment[mt][1] = *reinterpret_cast<const unsigned int*>(base + 8 * kFp8RowPitch);
          a_fragment[mt][2] = *reinterpret_cast<const unsigned int*>(base + 16);
          a_fragment[mt][3] = *reinterpret_cast<const unsigned int*>(base + 8 * kFp8RowPitch + 16);
        }
        MOEROUTE_UNROLL
        for (int gate = 0; gate < GATES; ++gate) {
          MOEROUTE_UNROLL
          for (int nt = 0; nt < N_TILES; ++nt) {
            const unsigned char* base =
                b_stage + (gate * BLOCK_N + warp_n * WARP_N + nt * 8 + group) * kFp8RowPitch + kk + 4 * thread_in_group;
            const unsigned int b0 = *reinterpret_cast<const unsigned int*>(base);
            const unsigned int b1 = *reinterpret_cast<const unsigned int*>(base + 16);
            MOEROUTE_UNROLL
            for (int mt = 0; mt < M_TILES; ++mt) mma_m16n8k32_e4m3(partial[gate][mt][nt], a_fragment[mt], b0, b1);
          }
        }
      }
      __syncthreads();  // the stages are refilled next step
    }
    // Promote: accumulator += partial * s_a[row, g] * s_w[col // bn, g].
    MOEROUTE_UNROLL
    for (int gate = 0; gate < GATES; ++gate) {
      MOEROUTE_UNROLL
      for (int mt = 0; mt < M_TILES; ++mt) {
        MOEROUTE_UNROLL
        for (int nt = 0; nt < N_TILES; ++nt) {
          MOEROUTE_UNROLL
          for (int i = 0; i < 4; ++i) {
            const int row = warp_m * WARP_M + mt * 16 + group + 8 * (i / 2);
            const int col = gate * BLOCK_N + warp_n * WARP_N + nt * 8 + 2 * thread_in_group + i % 2;
            accumulator[gate][mt][nt][i] += partial[gate][mt][nt][i] * (row_scale[row] * col_scale[col]);
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
      MOEROUTE_UNROLL
      for (int nt = 0; nt < N_TILES; ++nt) {
        MOEROUTE_UNROLL
        for (int j = 0; j < 2; ++j) {
          const int col = n0 + warp_n * WARP_N + nt * 8 + 2 * thread_in_group + j;
          if (col >= n) continue;
          const float first = accumulator[0][mt][nt][2 * half + j];
          const float second = accumulator[GATES - 1][mt][nt][2 * half + j];
          c_row[col] = from_float<T>(GATED ? gated_activate(first, second, activation) : first * scale);
        }
      }
    }
  }
}

#endif  // MOEROUTE_HAS_FP8_MMA
