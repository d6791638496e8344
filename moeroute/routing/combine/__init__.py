"""combine: the weighted sum of each token's expert outputs, accumulated in float32.

``out[t] = sum_k w[t, k] * expert_out[inverse_index[t, k]]`` over the entries with
``inverse_index >= 0``, summed in k order in float32 and written in the activation dtype.

bfloat16 has no NumPy dtype, and Numba's CPU target has no float16, so 16-bit activations
are read as their raw bits: the CPU kernels decode them through a 65536-entry float32
table, the CUDA kernels natively (float16) or by a shift (bfloat16). bfloat16 results are
rounded to nearest-even from the float32 sum, as torch's ``.to(torch.bfloat16)`` does.
"""

from __future__ import annotations

import numpy as np

from moeroute.routing import _launcher, _parallel, _sort
from moeroute.routing._arrays import check_no_overlap, enter
from moeroute.routing.combine._cuda import _combine_bf16_kernel, _combine_kernel, _kernel  # noqa: F401
from moeroute.routing.combine._host import (
    _accumulate_cpu,
    _accumulate_cpu_parallel,
    _accumulate_decoded_cpu,
    _combine_cpu,
    _combine_cpu_parallel,
    _combine_decoded_cpu,
    _combine_decoded_cpu_parallel,
    _decode_table,
    _encode_bf16_cpu,
)

__all__ = ["combine", "accumulate_rows"]

#: Output size (T*H elements) from which the CPU kernel runs on all cores: waking the thread
#: pool costs more than a smaller sum takes on one thread.
PARALLEL_COMBINE_MIN_ELEMENTS = 4 << 20
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
_BITS_DTYPES = (np.dtype(np.uint16), np.dtype(np.int16))


def _check_activation_dtype(name, dtype, raw_bf16) -> None:
    """float32/float16 activations, or bfloat16 bit patterns with ``raw_bf16``."""
    if raw_bf16:
        if np.dtype(dtype) not in _BITS_DTYPES:
            raise TypeError(f"raw_bf16=True needs {name} as uint16 or int16 bfloat16 bits, got dtype {dtype}")
    elif np.dtype(dtype) not in _FLOAT_DTYPES:
        hint = " (bfloat16 bits? pass raw_bf16=True)" if np.dtype(dtype) in _BITS_DTYPES else ""
        raise TypeError(f"{name} must be float32 or float16, got dtype {dtype}{hint}")


def _check_combine_args(out_shape, out_dtype, index_shape, index_dtype, weights_shape, weights_dtype, raw_bf16) -> None:
    if len(out_shape) != 2:
        raise ValueError(f"expert_out must be 2-D [M, H], got shape {tuple(out_shape)}")
    if len(index_shape) != 2:
        raise ValueError(f"inverse_index must be 2-D [T, K], got shape {tuple(index_shape)}")
    if np.dtype(index_dtype) not in (np.int32, np.int64):
        raise TypeError(f"inverse_index must be int32 or int64, got dtype {index_dtype}")
    _check_activation_dtype("expert_out", out_dtype, raw_bf16)
    if weights_shape is not None:
        if tuple(weights_shape) != tuple(index_shape):
            raise ValueError(
                f"topk_weights has shape {tuple(weights_shape)} but inverse_index has shape "
                f"{tuple(index_shape)}; they must match"
            )
        if np.dtype(weights_dtype).kind != "f":
            raise TypeError(f"topk_weights must be floating point, got dtype {weights_dtype}")
    _sort.check_index_limit("inverse_index.shape[0] * expert_out.shape[1]", int(index_shape[0]) * int(out_shape[1]))


# --------------------------------------------------------------------------- API


def combine(expert_out, inverse_index, topk_weights=None, *, raw_bf16=False, stream=None):
    """Weighted sum of each token's expert outputs: ``out[t] = sum_k w[t,k] * y[inv[t,k]]``.

    Parameters
    ----------
    expert_out : array [M, H]
        float32, float16 or (torch) bfloat16, NumPy, CPU torch or device; with
        ``raw_bf16=True``, bfloat16 activations as their raw bit patterns (uint16 or int16,
        e.g. ``tensor.view(torch.int16)``). The result has the framework, device and dtype
        of ``expert_out``.
    inverse_index : int32 or int64 [T, K]
        Row of ``expert_out`` for each (token, slot); entries < 0 are skipped (the
        `sort_by_expert` / `permute` inverse index). On the host an entry >= M raises;
        on the device it is skipped (checking would need a sync).
    topk_weights : float [T, K], optional
        Slot weights; None means 1 (outputs already weighted). float32 on the device;
        host floats are converted to float32.
    raw_bf16 : bool
        Read ``expert_out`` as bfloat16 bits and write the result as bfloat16 bits of
        the same dtype, rounded to nearest even from the float32 sum. Never goes through
        a NumPy float conversion of the activations.
    stream : optional
        Device inputs only; default: the current stream of the input's framework.

    Returns
    -------
    out : [T, H], dtype of ``expert_out``
        float32 accumulation in k order; rows with no valid entry are 0.

    Raises
    ------
    TypeError
        ``expert_out`` not float32/float16 (or not uint16/int16 with ``raw_bf16``; a
        16-bit integer ``expert_out`` without it); non-integer ``inverse_index``;
        non-float ``topk_weights`` (not float32 on the device); host and device arrays
        mixed.
    ValueError
        Arrays not 2-D; ``topk_weights`` shape != ``inverse_index`` shape; a host
        ``inverse_index`` entry >= M; T*H above 2**31 - 1.
    """
    raw_bf16 = bool(raw_bf16)
    expert = enter(expert_out, "expert_out")
    index = enter(inverse_index, "inverse_index")
    weights = None if topk_weights is None else enter(topk_weights, "topk_weights")
    # A bfloat16 array (torch) is read as its raw bits and answered in bfloat16.
    raw_bf16 = raw_bf16 or expert.bfloat16
    if any(e.on_device != expert.on_device for e in (index, weights) if e is not None):
        raise TypeError(
            "expert_out, inverse_index and topk_weights must all be host (NumPy) arrays or all be device arrays"
        )
    if expert.on_device:
        return expert.from_bits16(_combine_device(expert, index, weights, raw_bf16, stream))
    return expert.wrap(
        _combine_host(expert.host(), index.host(), None if weights is None else weights.host_floats(), raw_bf16),
        bfloat16=expert.bfloat16,
    )


def _combine_host(expert, index, weights, raw_bf16):
    """`combine` on NumPy arrays (bfloat16 as uint16 bits with ``raw_bf16``)."""
    _check_combine_args(
        expert.shape,
        expert.dtype,
        index.shape,
        index.dtype,
        None if weights is None else weights.shape,
        None if weights is None else weights.dtype,
        raw_bf16,
    )
    if index.size and int(index.max()) >= expert.shape[0]:
        raise ValueError(f"inverse_index holds row {int(index.max())} but expert_out has only {expert.shape[0]} rows")
    index = np.ascontiguousarray(index)
    expert = np.ascontiguousarray(expert)
    has_weights = weights is not None
    weights = np.ascontiguousarray(weights, dtype=np.float32) if has_weights else np.empty((1, 1), np.float32)
    tokens, width = index.shape[0], expert.shape[1]
    parallel = tokens * width >= PARALLEL_COMBINE_MIN_ELEMENTS and _parallel.cpu_threads() > 1
    if expert.dtype == np.float32:
        out = np.empty((tokens, width), np.float32)
        kernel = _combine_cpu_parallel if parallel else _combine_cpu
        kernel(expert, index, weights, has_weights, out)
        return out
    accumulated = np.empty((tokens, width), np.float32)
    kernel = _combine_decoded_cpu_parallel if parallel else _combine_decoded_cpu
    kernel(expert.view(np.uint16), _decode_table(raw_bf16), index, weights, has_weights, accumulated)
    if not raw_bf16:
        return accumulated.astype(np.float16)
    out = np.empty((tokens, width), expert.dtype)
    _encode_bf16_cpu(accumulated.view(np.uint32), out.view(np.uint16))
    return out


def _combine_device(expert_entry, index_entry, weights_entry, raw_bf16, stream):
    """`combine` on device arrays, from their boundaries (``weights_entry``: None when
    ``topk_weights`` is absent); a bfloat16 result comes back as its int16 bits."""
    _sort.check_cuda_available()
    expert = expert_entry.kernel(bits16=True)
    index = index_entry.kernel()
    weights = None if weights_entry is None else weights_entry.kernel()
    _check_combine_args(
        expert.shape,
        expert.dtype,
        index.shape,
        index.dtype,
        None if weights is None else weights.shape,
        None if weights is None else weights.dtype,
        raw_bf16,
    )
    if weights is not None and weights.dtype != np.float32:
        raise TypeError(f"topk_weights on the device must be float32, got dtype {weights.dtype}")
    launch_stream = expert_entry.stream(stream)
    tokens, width = int(index.shape[0]), int(expert.shape[1])
    out, out_view = expert_entry.empty((tokens, width), expert.dtype, launch_stream)
    if tokens * width:
        has_weights = weights is not None
        if not has_weights:  # never read; allocated like every other buffer (graph capture)
            weights = expert_entry.empty((1, 1), np.float32, launch_stream)[1]
        if raw_bf16:  # the kernel reads and writes the patterns as uint16
            expert, out_view = expert.view(np.uint16), out_view.view(np.uint16)
        grid, threads = _sort.row_launch_config(tokens, width)
        _launcher.launch(
            _kernel(raw_bf16), None, grid, threads, launch_stream, (expert, index, weights, has_weights, out_view)
        )
    return out


#: Rows x width from which accumulate_rows splits float32 rows over the cores (when the
#: tokens are strictly increasing, hence distinct: no two rows then add into one sum).
#: From about one expert's rows in a prefill-sized layer (256 x 1024) the parallel sums win
#: (bench/layer.py at T = 2048).
PARALLEL_ACCUMULATE_MIN_ELEMENTS = 1 << 16


def _distinct(tokens: np.ndarray) -> bool:
    """True when ``tokens`` is strictly increasing (as a sorted expert's tokens are)."""
    return tokens.shape[0] < 2 or bool((tokens[1:] > tokens[:-1]).all())


def accumulate_rows(out, rows, tokens, weights, *, raw_bf16=False):
    """``out[tokens[r]] += weights[r] * rows[r]`` for every row r, in row order (CPU).

    The streamed form of `combine`: one expert's outputs at a time go straight into the
    float32 sums while they are still in cache, instead of through an [M, H] buffer.

    Parameters
    ----------
    out : float32 array [T, H], C-contiguous; updated in place
    rows : array [R, H]
        float32 or float16; with ``raw_bf16=True`` bfloat16 bit patterns (uint16/int16).
    tokens : integer array [R], each in [0, T)
    weights : float32 array [R]

    Raises
    ------
    TypeError
        ``out`` not a float32 NumPy array; ``rows`` of another dtype (see `combine`);
        ``tokens`` not integer; ``weights`` not float32.
    ValueError
        Shapes that do not match; a token outside [0, T); ``out`` not C-contiguous,
        read-only, or sharing memory with ``rows``, ``tokens`` or ``weights``.
    """
    if not isinstance(out, np.ndarray):
        # np.asarray would copy a list (or similar), and the sums would be lost with it.
        raise TypeError(f"out must be a NumPy array (it is updated in place), got {type(out).__name__}")
    out_array = out
    rows = np.asarray(rows)
    tokens = np.asarray(tokens)
    weights = np.asarray(weights)
    if out_array.dtype != np.float32 or out_array.ndim != 2:
        raise TypeError(f"out must be a 2-D float32 array, got {out_array.dtype} with shape {out_array.shape}")
    if not out_array.flags.c_contiguous:
        raise ValueError("out must be C-contiguous (it is updated in place)")
    if not out_array.flags.writeable:
        raise ValueError(
            "out is read-only (flags.writeable is False); pass a writable float32 array, it is updated in place"
        )
    if rows.ndim != 2 or rows.shape[1] != out_array.shape[1]:
        raise ValueError(f"rows must be [R, {out_array.shape[1]}], got shape {rows.shape}")
    if tokens.shape != (rows.shape[0],) or weights.shape != (rows.shape[0],):
        raise ValueError(f"tokens and weights must be [{rows.shape[0]}], got shapes {tokens.shape} and {weights.shape}")
    if tokens.dtype.kind not in "iu":
        raise TypeError(f"tokens must be integers, got dtype {tokens.dtype}")
    if weights.dtype != np.float32:
        raise TypeError(f"weights must be float32, got dtype {weights.dtype}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= out_array.shape[0]):
        raise ValueError(
            f"tokens must lie in [0, {out_array.shape[0]}), got [{int(tokens.min())}, {int(tokens.max())}]"
        )
    _check_activation_dtype("rows", rows.dtype, raw_bf16)
    check_no_overlap({"out": out_array}, {"rows": rows, "tokens": tokens, "weights": weights})
    accumulate_checked(out_array, np.ascontiguousarray(rows), tokens, weights, bool(raw_bf16), _distinct(tokens))


def accumulate_checked(out, rows, tokens, weights, raw_bf16, distinct):
    """`accumulate_rows` without its checks, for callers whose arguments hold by
    construction (C-contiguous rows, valid tokens; ``distinct``: no token repeats)."""
    if rows.dtype == np.float32:
        parallel = distinct and rows.size >= PARALLEL_ACCUMULATE_MIN_ELEMENTS and _parallel.cpu_threads() > 1
        (_accumulate_cpu_parallel if parallel else _accumulate_cpu)(rows, tokens, weights, out)
    else:
        _accumulate_decoded_cpu(rows.view(np.uint16), _decode_table(raw_bf16), tokens, weights, out)
