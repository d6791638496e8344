// INT4 (w4a16) expert GEMMs over expert-sorted, block-padded rows: the numerics of docs/quant.md.
//
// Weights of one projection (moeroute.quant.int4): packed uint8 [E, rows, k / 2] (byte j of a row
// holds value 2j in its low nibble, 2j + 1 in its high nibble), scales S [E, rows, k / g] (S =
// float32, bfloat16 or float16, as the layer holds them) and, when asymmetric (has_zeros), zero
// points uint8 [E, rows, k / g]; symmetric weights have z = 8. With g the group size (32, 64 or
// 128, so k % 32 == 0),
//
//   w[row, col] = (q[row, col] - z[row, col / g]) * s[row, col / g]
//
// Activations are not quantized: A is float32 / float16 / bfloat16 as the float kernels take it.
// Two kernels, launched by moeroute/gpu/gemm_int4.py (the same plans drive the host emulation),
// both the shared tile loops of moe_tile.cuh with Int4Decoder:
//
//   moe_gemm_int4_simt  every GPU (and the host emulation, and HIP): each weight decoded to its
//                       float32 value (q - z) * s in the tile (one float32 rounding for float32
//                       scales, exact for 16-bit ones), float32 sums.
//   moe_gemm_int4_mma   float16 / bfloat16 on sm_80+: the cp.async pipeline of the packed bytes,
//                       each nibble decoded in registers to the 16-bit integer q - z (exact: at
//                       most 5 bits), mma.sync m16n8k16 over each 32-column block into float32
//                       partial sums, promoted with the block's group scale in float32. The tile's
//                       zero points (asymmetric weights) are staged once in shared memory.
//
//   gate_up (GATED = 1): A rows j / top_k of hidden_states; B rows: gate rows, then up rows
//     (2n rows); C = intermediate [numel, n] = act(gate) * up.
//   down    (GATED = 0): A rows j of the intermediate (top_k = 1); C = expert_out [numel, n],
//     times topk_weights[j] when apply_router_weight.
// Rows, padding and slots of other ranks are handled as in moe_gemm.cu (included below for its
// moe_sum_topk).
#include "moe_gemm.cu"

namespace moeroute {

constexpr int kInt4SymmetricZero = 8;

// The 16-bit pattern in T of a small integer (|v| <= 15: exact in float16 and bfloat16).
template <typename T>
MOEROUTE_DEVICE unsigned int small_int_bits16(int value);

template <>
MOEROUTE_DEVICE unsigned int small_int_bits16<bfloat16>(int value) {
  return float_to_bits(static_cast<float>(value)) >> 16;  // at most 4 significant bits: no rounding
}

template <>
MOEROUTE_DEVICE unsigned int small_int_bits16<float16>(int value) {
  return from_float<float16>(static_cast<float>(value)).bits;
}

template <typename T, typename S, int GATES>
struct Int4Decoder {
  static constexpr bool kGrouped = false;
  static constexpr int kValuesPerByte = 2;
  const T* a;
  const unsigned char* packed;
  const S* scales;
  const unsigned char* zeros;  // read only when has_zeros
  int n, k, group_size, has_zeros;

  MOEROUTE_DEVICE int group_k() const { return k; }
  MOEROUTE_DEVICE int groups() const { return k / group_size; }
  MOEROUTE_DEVICE long long weight_row(int expert, int gate, int col) const {
    return (static_cast<long long>(expert) * GATES + gate) * n + col;
  }
  MOEROUTE_DEVICE float a_value(long long a_row, int col) const { return to_float(a[a_row * k + col]); }
  // kcol is even and a group holds an even number of columns: both values share one group.
  MOEROUTE_DEVICE void b_pair(int expert, int gate, int col, int kcol, bool, float& lo, float& hi) const {
    const long long row = weight_row(expert, gate, col);
    const unsigned int byte = packed[row * (k / 2) + kcol / 2];
    const long long group = row * groups() + kcol / group_size;
    const float scale = to_float(scales[group]);
    const int zero = has_zeros ? static_cast<int>(zeros[group]) : kInt4SymmetricZero;
    lo = static_cast<float>(static_cast<int>(byte & 0xfu) - zero) * scale;
    hi = static_cast<float>(static_cast<int>(byte >> 4) - zero) * scale;
  }
  MOEROUTE_DEVICE float bias(int, int, int) const { return 0.0f; }
  MOEROUTE_DEVICE float row_scale(long long, int) const { return 1.0f; }
  MOEROUTE_DEVICE float col_scale(int, int, int, int) const { return 1.0f; }

  // mma: the tile's zero points (asymmetric only), GATES * BLOCK_N rows of k / g bytes; rows out
  // of range read as 8 (their sums are multiplied by a zero scale).
  template <int BLOCK_N, int TILE_GATES, int THREADS>
  MOEROUTE_DEVICE void stage_metadata(unsigned char* metadata, int expert, int n0, int tid) const {
    if (!has_zeros) return;
    for (int e = tid; e < TILE_GATES * BLOCK_N * groups(); e += THREADS) {
      const int row = e / groups(), group = e % groups();
      const int gate = row / BLOCK_N, col = n0 + row % BLOCK_N;
      metadata[e] = col < n ? zeros[weight_row(expert, gate, col) * groups() + group] : kInt4SymmetricZero;
    }
  }
#if MOEROUTE_HAS_MMA
  // Byte first / 2 of the staged row holds columns first (low nibble) and first + 1.
  template <typename U>
  MOEROUTE_DEVICE unsigned int pair16(const unsigned char* metadata, int tile_row, int k_block,
                                      const unsigned char* row, int first) const {
    const unsigned int byte = row[first / 2];
    const int zero = has_zeros ? static_cast<int>(metadata[tile_row * groups() + k_block * kNarrowBlockValues / group_size])
                               : kInt4SymmetricZero;
    return small_int_bits16<U>(static_cast<int>(byte & 0xfu) - zero) |
           (small_int_bits16<U>(static_cast<int>(byte >> 4) - zero) << 16);
  }
  MOEROUTE_DEVICE float block_scale(const unsigned char*, int, int expert, int gate, int col, int k_block) const {
    if (col >= n) return 0.0f;
    return to_float(scales[weight_row(expert, gate, col) * groups() + k_block * kNarrowBlockValues / group_size]);
  }
#endif
};

}  // namespace moeroute

// Grid: (row tiles, ceil(n / kSimtBlockN)); block: kSimtThreads. Tiling as moe_gemm_simt.
template <typename T, typename S, int TILE_M, int GATED>
__global__ void MOEROUTE_LAUNCH_BOUNDS(moeroute::kSimtThreads, moeroute::kSimtMinBlocksPerMultiprocessor)
    moe_gemm_int4_simt(const T* __restrict__ a, const unsigned char* __restrict__ packed,
                       const S* __restrict__ scales, const unsigned char* __restrict__ zeros, T* __restrict__ c,
                       const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                       const float* __restrict__ topk_weights, int numel, int top_k, int n, int k, int group_size,
                       int has_zeros, int block_size, int activation, int apply_router_weight) {
  using namespace moeroute;
  static_assert(kSimtBlockK % 2 == 0, "k slices hold whole packed bytes");
  using Decoder = Int4Decoder<T, S, GATED ? 2 : 1>;
  const Decoder decoder{a, packed, scales, zeros, n, k, group_size, has_zeros};
  moe_tile_simt<Decoder, T, TILE_M, GATED>(decoder, c, sorted_token_ids, expert_ids, topk_weights, numel, top_k, n,
                                           k, block_size, activation, apply_router_weight, 0);
}

#if MOEROUTE_HAS_MMA

// Grid: (row tiles, ceil(n / BLOCK_N)); block: WARPS_M * WARPS_N warps (moe_tile_narrow_mma).
// Dynamic shared memory: STAGES stages of (TILE_M * kNarrowAPitch * 2 + GATES * BLOCK_N *
// NarrowBPitch<2>::value) bytes, then (asymmetric only) the tile's zero points, GATES * BLOCK_N rows of
// k / g bytes. Needs A and the packed bytes 16-byte aligned (the launcher checks).
template <typename T, typename S, int TILE_M, int BLOCK_N, int WARPS_M, int WARPS_N, int STAGES, int MIN_BLOCKS,
          int GATED>
__global__ void MOEROUTE_LAUNCH_BOUNDS(WARPS_M* WARPS_N* MOEROUTE_WARP_SIZE, MIN_BLOCKS)
    moe_gemm_int4_mma(const T* __restrict__ a, const unsigned char* __restrict__ packed,
                      const S* __restrict__ scales, const unsigned char* __restrict__ zeros, T* __restrict__ c,
                      const int* __restrict__ sorted_token_ids, const int* __restrict__ expert_ids,
                      const float* __restrict__ topk_weights, int numel, int top_k, int n, int k, int group_size,
                      int has_zeros, int block_size, int activation, int apply_router_weight) {
  using namespace moeroute;
  using Decoder = Int4Decoder<T, S, GATED ? 2 : 1>;
  const Decoder decoder{a, packed, scales, zeros, n, k, group_size, has_zeros};
  moe_tile_narrow_mma<Decoder, T, TILE_M, BLOCK_N, WARPS_M, WARPS_N, STAGES, GATED>(
      decoder, a, packed, c, sorted_token_ids, expert_ids, topk_weights, numel, top_k, n, k, block_size, activation,
      apply_router_weight, 0);
}

#endif  // MOEROUTE_HAS_MMA
