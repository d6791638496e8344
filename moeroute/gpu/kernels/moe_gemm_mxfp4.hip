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
// moe_sum_topk); both GEMMs are the shared tile loops of moe_tile.cuh with Mxfp4Decoder.
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

namespace moeroute {

// MXFP4 weights: blocks (byte j: values 2j low nibble, 2j + 1 high) and one scale byte per 32
// values; biases float32. SIMT: each value e2m1 * 2^(s - 127) in float32. mma: the tile's scale
// bytes staged once, nibbles decoded to exact 16-bit e2m1 values, 2^(s - 127) at promotion.
template <typename T, int GATES>
struct Mxfp4Decoder {
  static constexpr bool kGrouped = false;
  static constexpr int kValuesPerByte = 2;
  const T* a;
  const unsigned char* blocks;
  const unsigned char* scales;
  const float* bias_values;
  int n, k;

  MOEROUTE_DEVICE int group_k() const { return k; }
  MOEROUTE_DEVICE int k_blocks() const { return k / kMxfp4BlockValues; }
  MOEROUTE_DEVICE float a_value(long long a_row, int col) const { return to_float(a[a_row * k + col]); }
  MOEROUTE_DEVICE long long weight_row(int expert, int gate, int col) const {
    return (static_cast<long long>(expert) * GATES + gate) * n + col;
  }
  MOEROUTE_DEVICE void b_pair(int expert, int gate, int col, int kcol, bool, float& lo, float& hi) const {
    const long long row = weight_row(expert, gate, col);
    const unsigned int byte = blocks[row * k_blocks() * kMxfp4BlockBytes + kcol / 2];
    const float scale = mxfp4_scale(scales[row * k_blocks() + kcol / kMxfp4BlockValues]);
    lo = e2m1_to_float(byte & 0xfu) * scale;
    hi = e2m1_to_float(byte >> 4) * scale;
  }
  MOEROUTE_DEVICE float bias(int expert, int gate, int col) const { return bias_values[weight_row(expert, gate, col)]; }
  MOEROUTE_DEVICE float row_scale(long long, int) const { return 1.0f; }
  MOEROUTE_DEVICE float col_scale(int, int, int, int) const { return 1.0f; }

  // mma: the tile's scale bytes, GATES * BLOCK_N rows of k / 32; rows out of range read as 0
  // (they multiply zero sums).
  template <int BLOCK_N, int TILE_GATES, int THREADS>
  MOEROUTE_DEVICE void stage_metadata(unsigned char* metadata, int expert, int n0, int tid) const {
    for (int e = tid; e < TILE_GATES * BLOCK_N * k_blocks(); e += THREADS) {
      const int row = e / k_blocks(), k_block = e % k_blocks();
      const int gate = row / BLOCK_N, col = n0 + row % BLOCK_N;
      metadata[e] = col < n ? scales[weight_row(expert, gate, col) * k_blocks() + k_block] : 0;
    }
  }
#if MOEROUTE_HAS_MMA
  // Byte first / 2 of the staged row holds columns first (low nibble) and first + 1.
  template <typename U>
  MOEROUTE_DEVICE unsigned int pair16(const unsigned char*, int, int, const unsigned char* row, int first) const {
    return e2m1_pair<U>(row[first / 2]);
  }
#endif
  MOEROUTE_DEVICE float block_scale(const unsigned char* metadata, int tile_row, int, int, int, int k_block) const {
    return mxfp4_scale(metadata[tile_row * k_blocks() + k_block]);
  }
};

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
  static_assert(kMxfp4BlockValues % kSimtBlockK == 0, "a k slice lies inside one scale block");
  using Decoder = Mxfp4Decoder<T, GATED ? 2 : 1>;
  const Decoder decoder{a, b_blocks, b_scales, bias, n, k};
  moe_tile_simt<Decoder, T, TILE_M, GATED>(decoder, c, sorted_token_ids, expert_ids, topk_weights, numel, top_k, n,
                                           k, block_size, activation, apply_router_weight, has_bias);
}

#if MOEROUTE_HAS_MMA

// Grid: (row tiles, ceil(n / BLOCK_N)); block: WARPS_M * WARPS_N warps (moe_tile_narrow_mma).
// Dynamic shared memory: STAGES stages of (TILE_M * kNarrowAPitch * 2 + GATES * BLOCK_N *
// NarrowBPitch<2>::value) bytes, then the tile's scale bytes, GATES * BLOCK_N rows of k / 32. Needs A and
// the blocks 16-byte aligned (the launcher checks; k % 32 == 0 by the format keeps every row aligned).
template <typename T, int TILE_M, int BLOCK_N, int WARPS_M, int WARPS_N, int STAGES, int MIN_BLOCKS, int GATED>
__global__ void MOEROUTE_LAUNCH_BOUNDS(WARPS_M* WARPS_N* MOEROUTE_WARP_SIZE, MIN_BLOCKS)
    moe_gemm_mxfp4_mma(const T* __restrict__ a, const unsigned char* __restrict__ b_blocks,
                       const unsigned char* __restrict__ b_scales, T* __restrict__ c,
                       const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                       const float* __restrict__ topk_weights, const float* __restrict__ bias, int numel,
                       int top_k, int n, int k, int block_size, int activation, int apply_router_weight,
                       int has_bias) {
  using namespace moeroute;
  static_assert(kNarrowBlockValues == kMxfp4BlockValues, "one promotion per scale block");
  using Decoder = Mxfp4Decoder<T, GATED ? 2 : 1>;
  const Decoder decoder{a, b_blocks, b_scales, bias, n, k};
  moe_tile_narrow_mma<Decoder, T, TILE_M, BLOCK_N, WARPS_M, WARPS_N, STAGES, GATED>(
      decoder, a, b_blocks, c, sorted_token_ids, expert_ids, topk_weights, numel, top_k, n, k, block_size, activation,
      apply_router_weight, has_bias);
}

#endif  // MOEROUTE_HAS_MMA
