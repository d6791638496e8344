"""combine and accumulate_rows on the CPU (Numba ``njit``): 16-bit activations decoded
through a 65536-entry float32 table, bfloat16 results rounded by `_common`'s rule."""

import numpy as np
from numba import njit, prange

from moeroute.routing._float16 import decode_table as _decode_table  # noqa: F401 (the package's)
from moeroute.routing.combine._common import _bf16_from_float_bits


@njit(cache=True, inline="always")
def _combine_row(expert_out, inverse_index, weights, has_weights, t, out):
    out[t, :] = 0
    rows = expert_out.shape[0]
    for k in range(inverse_index.shape[1]):
        r = inverse_index[t, k]
        if r >= 0 and r < rows:
            w = weights[t, k] if has_weights else np.float32(1)
            for h in range(out.shape[1]):
                out[t, h] += w * expert_out[r, h]


@njit(cache=True, inline="always")
def _combine_row_decoded(expert_bits, table, inverse_index, weights, has_weights, t, out):
    out[t, :] = 0
    rows = expert_bits.shape[0]
    for k in range(inverse_index.shape[1]):
        r = inverse_index[t, k]
        if r >= 0 and r < rows:
            w = weights[t, k] if has_weights else np.float32(1)
            for h in range(out.shape[1]):
                out[t, h] += w * table[expert_bits[r, h]]


@njit(cache=True)
def _combine_cpu(expert_out, inverse_index, weights, has_weights, out):
    for t in range(out.shape[0]):
        _combine_row(expert_out, inverse_index, weights, has_weights, t, out)


@njit(cache=True, parallel=True)
def _combine_cpu_parallel(expert_out, inverse_index, weights, has_weights, out):
    for t in prange(out.shape[0]):
        _combine_row(expert_out, inverse_index, weights, has_weights, t, out)


@njit(cache=True)
def _combine_decoded_cpu(expert_bits, table, inverse_index, weights, has_weights, out):
    for t in range(out.shape[0]):
        _combine_row_decoded(expert_bits, table, inverse_index, weights, has_weights, t, out)


@njit(cache=True, parallel=True)
def _combine_decoded_cpu_parallel(expert_bits, table, inverse_index, weights, has_weights, out):
    for t in prange(out.shape[0]):
        _combine_row_decoded(expert_bits, table, inverse_index, weights, has_weights, t, out)


_bf16_from_float_bits_cpu = njit(cache=True, inline="always")(_bf16_from_float_bits)


@njit(cache=True)
def _encode_bf16_cpu(value_bits, out_bits):
    """out_bits [T, H] uint16 = bfloat16 of the float32 patterns value_bits [T, H] uint32."""
    flat_in = value_bits.reshape(-1)
    flat_out = out_bits.reshape(-1)
    for i in range(flat_in.shape[0]):
        flat_out[i] = _bf16_from_float_bits_cpu(flat_in[i])


@njit(cache=True, inline="always")
def _accumulate_row(rows, tokens, weights, r, out):
    t = tokens[r]
    w = weights[r]
    for h in range(out.shape[1]):
        out[t, h] += w * rows[r, h]


@njit(cache=True)
def _accumulate_cpu(rows, tokens, weights, out):
    for r in range(rows.shape[0]):
        _accumulate_row(rows, tokens, weights, r, out)


@njit(cache=True, parallel=True)
def _accumulate_cpu_parallel(rows, tokens, weights, out):
    for r in prange(rows.shape[0]):  # distinct tokens: no two rows write the same sums
        _accumulate_row(rows, tokens, weights, r, out)


@njit(cache=True)
def _accumulate_decoded_cpu(row_bits, table, tokens, weights, out):
    for r in range(row_bits.shape[0]):
        t = tokens[r]
        w = weights[r]
        for h in range(out.shape[1]):
            out[t, h] += w * table[row_bits[r, h]]
