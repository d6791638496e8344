"""The unquantized experts' compute (float32, float16, bfloat16 weights): the received rows
in, ``sum over their local slots of w * expert(x)`` out (the ``partial_out`` that
`moeroute.bindings.torch.dispatch.Dispatcher.combine` expects). The module that holds the
weights is `moeroute.experts.modules.LocalExperts`.

CPU: three strategies, picked per call by `moeroute.experts.choose.choose` from the rows per
expert and the dtype (`GEMM_STRATEGIES`):

* "rows" (`rows_expert_mlp`): one Numba call (`moeroute.experts.cpu.rows`) reads each hit
  expert's weight rows once and dots them with every row it serves, adding into float32
  sums. For decode-sized batches, which are bound by reading the weights.
* "loop" (`streamed_expert_mlp`): per hit expert, its rows gathered, through gate_up, the
  activation and down (two GEMMs, no wasted flops), and the weighted outputs added into
  float32 sums by a Numba kernel while they are still in cache: no [M, H] permuted or
  expert-output buffer is written and read back. For large row counts.
* "padded": the rows permuted by the Numba gather, scattered into an [L, R, H] batch
  (R = the largest count), two torch.bmm for all experts at once, then the Numba combine:
  for few rows per expert (decode-sized batches, many experts), where a GEMM costs about
  the read of its expert's weights whatever its row count, and one batched call replaces
  2L small ones, each a parallel region whose thread hand-off dominates when the cores
  are shared. "auto" picks it only for float32 and where the loop's linears run on
  torch.mm (see `moeroute.experts.choose`).

The "loop" and "padded" strategies first sort the (row, slot) entries by expert (the Numba
counting sort).

Each per-expert GEMM of the "loop" strategy goes to oneDNN (``torch.ops.mkldnn._linear_pointwise``,
the op torch's own compiler emits for CPU linears) where this torch build has it and it
serves the dtype, else to ``torch.mm`` (MKL/OpenBLAS). `moeroute.experts.modules.LocalExperts.pack_cpu_weights`
(opt-in, a second copy of the weights, explicit: re-pack after changing the weights) keeps
them in oneDNN's blocked layout, so that oneDNN does not reorder each expert's weights on
every call. bench/layer.py compares them with the torch.mm loop and the transformers block.
CUDA: `moeroute.gpu.fused_experts` runs the grouped GEMMs on torch's current stream.
"""

from __future__ import annotations

import contextlib
import functools
import time

import numba
import numpy as np
import torch

from moeroute._validate import weights_then_ids
from moeroute.experts.cpu import rows as cpu_rows
from moeroute.experts.activations import (
    ACTIVATIONS,
    SWIGLUOAI_ALPHA,
    SWIGLUOAI_LIMIT,
    apply_activation,
    check_activation,
    gated_activation,
)
from moeroute.experts.choose import ROWS_DTYPES, STRATEGIES, choose, rows_bound
from moeroute import routing
from moeroute.routing.threads import cpu_threads
from moeroute.routing.combine import accumulate_checked

__all__ = [
    "ACTIVATIONS",
    "SUPPORTED_DTYPES",
    "GEMM_STRATEGIES",
    "LINEAR_BACKENDS",
    "check_dtype",
    "cpu_experts",
    "onednn_linear_serves",
    "rows_expert_mlp",
    "expert_mlp",
    "streamed_expert_mlp",
    "padded_expert_mlp",
    "apply_activation",
    "check_activation",
    "gated_activation",
    "SWIGLUOAI_ALPHA",
    "SWIGLUOAI_LIMIT",
]

#: Activation dtypes the expert compute serves (docs/semantics.md section 5).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Standard deviation of the initial expert weights (the usual transformer init); real
#: weights are loaded over them.
INIT_STD = 0.02
#: Backends of one expert's linear on the CPU; "auto": oneDNN where it serves the dtype.
LINEAR_BACKENDS = ("auto", "onednn", "mm")
#: CPU expert-GEMM strategies; "auto" picks one per call (`moeroute.experts.choose`).
GEMM_STRATEGIES = STRATEGIES["float"]


def check_dtype(name: str, dtype: torch.dtype) -> None:
    """ValueError naming ``name``, ``dtype`` and `SUPPORTED_DTYPES` unless it is one of them
    (a module can be moved to float64, float8 or complex dtypes; the kernels serve none)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{name} are {dtype}, which the expert compute does not serve; use one of "
            f"{SUPPORTED_DTYPES} (e.g. module.to(torch.float32))"
        )


def check_same_device(reference_name: str, reference: torch.Tensor, **tensors) -> None:
    """ValueError naming both arguments and devices unless every tensor of ``tensors``
    (None entries skipped) is on the device of ``reference``: a kernel reads its inputs
    where ``reference`` lives, and a weight left on another device (the meta device
    included, which holds no data) would otherwise be read as whatever memory is there."""
    device = reference.device
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != device:
            raise ValueError(
                f"{name} is on {tensor.device}, {reference_name} on {device}; pass every "
                "tensor of the expert compute on one device"
            )


def _onednn_linear_op():
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


@functools.cache
def onednn_linear_serves(dtype: torch.dtype) -> bool:
    """True when oneDNN's linear runs here for ``dtype`` and agrees with a float64 product."""
    op = _onednn_linear_op()
    if op is None:
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=generator)
    w = torch.randn(5, 16, generator=generator)
    try:
        got = op(x.to(dtype), w.to(dtype), None, "none", [], "")
    except (RuntimeError, NotImplementedError):  # dtype or ISA this build's oneDNN lacks
        return False
    expected = x.to(dtype).double() @ w.to(dtype).double().T
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    return got.shape == expected.shape and bool(
        torch.allclose(got.double(), expected, rtol=tolerance, atol=tolerance * 16)
    )


def _linear_backend(linear: str, dtype: torch.dtype) -> str:
    if linear not in LINEAR_BACKENDS:
        raise ValueError(f"linear={linear!r} is not a linear backend; use one of {LINEAR_BACKENDS}")
    if linear == "auto":
        return "onednn" if onednn_linear_serves(dtype) else "mm"
    if linear == "onednn" and not onednn_linear_serves(dtype):
        raise ValueError(f"linear='onednn' cannot serve {dtype} in this torch build; use 'mm' or 'auto'")
    return linear


def expert_mlp(
    hidden_sorted: torch.Tensor,
    expert_offsets: list[int],
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
    linear: str = "auto",
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated MLP of each expert over its contiguous rows (CPU, BLAS).

    Parameters
    ----------
    hidden_sorted : Tensor [M, H]
        Rows in expert order; expert e owns rows ``[expert_offsets[e], expert_offsets[e+1])``.
    expert_offsets : list of int, length L + 1
    w_gate_up : Tensor [L, 2I, H], gate rows first
    w_down : Tensor [L, H, I]
    activation : str, one of `ACTIVATIONS`
    linear : {"auto", "onednn", "mm"}
        Backend of each expert's linear.
    b_gate_up : Tensor [L, 2I], optional
        Bias of the gate_up projection (gate entries first), dtype of the weights.
    b_down : Tensor [L, H], optional
        Bias of the down projection.

    Returns
    -------
    Tensor [M, H], dtype of ``hidden_sorted``: ``down(act(x gate^T + b_gate) * (x up^T + b_up))
    + b_down`` per row (`gated_activation` for "swigluoai").

    Raises
    ------
    ValueError
        An unknown ``linear``, or "onednn" where it cannot serve the dtype.
    """
    rows, hidden = hidden_sorted.shape
    out = hidden_sorted.new_empty((rows, hidden))
    if rows == 0:
        return out
    onednn = _onednn_op_for(linear, hidden_sorted.dtype)
    # One expert at a time, start to finish: its [rows, 2I] intermediate is small enough to
    # stay in cache, and no [M, 2I] buffer is allocated for the whole batch.
    for e in range(len(expert_offsets) - 1):
        start, stop = expert_offsets[e], expert_offsets[e + 1]
        if start != stop:
            _one_expert(
                hidden_sorted[start:stop],
                w_gate_up[e],
                w_down[e],
                activation,
                onednn,
                out=out[start:stop],
                b_gate_up=_row(b_gate_up, e),
                b_down=_row(b_down, e),
            )
    return out


def _row(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    """Expert ``e``'s bias vector, or None without biases."""
    return None if bias is None else bias[e]


def _onednn_op_for(linear: str, dtype: torch.dtype):
    """oneDNN's linear op when ``linear`` resolves to "onednn" for ``dtype``, else None."""
    return _onednn_linear_op() if _linear_backend(linear, dtype) == "onednn" else None


def _one_expert(x, w_gate_up, w_down, activation, onednn, out=None, b_gate_up=None, b_down=None):
    """``down(act(x gate^T + b_gate) * (x up^T + b_up)) + b_down`` for one expert's rows
    (biases optional): oneDNN when ``onednn`` is its op, else torch.mm; into ``out`` when given."""
    inter = w_down.shape[1]
    if onednn is not None:
        gate_up = onednn(x, w_gate_up, b_gate_up, "none", [], "")
    elif b_gate_up is not None:
        gate_up = torch.addmm(b_gate_up, x, w_gate_up.t())
    else:
        gate_up = torch.mm(x, w_gate_up.t())
    act = gated_activation(gate_up[:, :inter], gate_up[:, inter:], activation)
    if onednn is None:
        if b_down is not None:
            return torch.addmm(b_down, act, w_down.t(), out=out)
        return torch.mm(act, w_down.t(), out=out)
    if out is None:
        return onednn(act, w_down, b_down, "none", [], "")
    out.copy_(onednn(act, w_down, b_down, "none", [], ""))
    return out


def streamed_expert_mlp(
    hidden_states: torch.Tensor,
    sorted_slots: torch.Tensor,
    expert_offsets: list[int],
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
    linear: str = "auto",
    stage_seconds: dict | None = None,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """Permute, expert MLPs and combine in one pass over the experts (CPU).

    Per expert: gather its token rows, run its MLP (as `expert_mlp`), add the weighted
    outputs into float32 sums (`moeroute.routing.combine.accumulate_rows`). An expert's
    rows stay in cache from gather to sum, and no [M, H] permuted or expert-output buffer
    is written, read back or page-faulted in.

    Parameters
    ----------
    hidden_states : Tensor [T, H]
    sorted_slots : Tensor [M] int32, flat slots ``t*K' + k`` in expert order (`sort_by_expert`)
    expert_offsets : list of int, length L + 1
    topk_weights : Tensor [T, K'] float32
    w_gate_up, w_down, activation, linear, b_gate_up, b_down : as `expert_mlp`; the weights
        may also be sequences of one expert's weights each (`moeroute.experts.modules.LocalExperts.pack_cpu_weights`)
    stage_seconds : dict, optional
        When given, the seconds spent gathering ("permute"), in the expert MLPs ("gemm")
        and summing ("combine") are added to its entries of those names.

    Returns
    -------
    Tensor [T, H], dtype of ``hidden_states``: ``sum_k w[t, k] * expert_k(x_t)`` over the
    sorted slots, accumulated in float32 in expert order (rows with none are zero).
    """
    # The float32 sums read other dtypes as 16-bit patterns: anything else must not get in.
    check_dtype("hidden_states", hidden_states.dtype)
    num_tokens, hidden = hidden_states.shape
    top_k = topk_weights.shape[1]
    onednn = _onednn_op_for(linear, hidden_states.dtype)
    sums = torch.zeros((num_tokens, hidden), dtype=torch.float32)
    slots = sorted_slots.to(torch.int64)
    tokens = slots // top_k
    slot_weights = topk_weights.reshape(-1).to(torch.float32)[slots]
    tokens_np, weights_np, sums_np = tokens.numpy(), slot_weights.numpy(), sums.numpy()
    raw_bf16 = hidden_states.dtype == torch.bfloat16
    clock = time.perf_counter if stage_seconds is not None else None
    spent = [0.0, 0.0, 0.0]
    for e in range(len(expert_offsets) - 1):
        start, stop = expert_offsets[e], expert_offsets[e + 1]
        if start == stop:
            continue
        t0 = clock() if clock else 0.0
        x = torch.index_select(hidden_states, 0, tokens[start:stop])
        t1 = clock() if clock else 0.0
        y = _one_expert(
            x, w_gate_up[e], w_down[e], activation, onednn, b_gate_up=_row(b_gate_up, e), b_down=_row(b_down, e)
        )
        t2 = clock() if clock else 0.0
        # Valid by construction: the tokens of one expert's sorted slots ascend, each once.
        accumulate_checked(sums_np, _row_view(y), tokens_np[start:stop], weights_np[start:stop], raw_bf16, True)
        if clock:
            t3 = clock()
            spent[0] += t1 - t0
            spent[1] += t2 - t1
            spent[2] += t3 - t2
    if stage_seconds is not None:
        for name, seconds in zip(("permute", "gemm", "combine"), spent):
            stage_seconds[name] = stage_seconds.get(name, 0.0) + seconds
    return sums if hidden_states.dtype == torch.float32 else sums.to(hidden_states.dtype)


def rows_expert_mlp(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    local_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expert MLPs and combine with the row kernels of `moeroute.experts.cpu.rows` (CPU).

    Every hit expert's gate_up rows are read once and dotted with the float32 rows of its
    tokens; the gated activation runs in float32; each down row is read once and its weighted
    dots are added into float32 sums. Threads split the work as torch's thread count allows
    (``torch.get_num_threads()``; one thread runs the serial kernels).

    Parameters
    ----------
    hidden_states : Tensor [T, H], bfloat16 or float32
    topk_weights : Tensor [T, K'] float32
    local_ids : Tensor [T, K'] int32, local expert id per slot (outside [0, L) = skipped)
    w_gate_up, w_down, activation, b_gate_up, b_down : as `expert_mlp`, dtype of ``hidden_states``

    Returns
    -------
    Tensor [T, H], dtype of ``hidden_states``: ``sum_k w[t, k] * expert_k(x_t)`` over the
    slots held here (rows with none are zero).
    """
    weights_then_ids(topk_weights, local_ids, "topk_weights", "local_ids")
    served = _rows_forward(
        hidden_states, topk_weights, local_ids, w_gate_up, w_down, activation, b_gate_up, b_down, float("inf")
    )
    assert served is not None
    return served


def _rows_forward(hidden_states, weights, local_ids, w_gate_up, w_down, activation, b_gate_up, b_down, bound):
    """The row kernels' whole forward (`moeroute.experts.cpu.rows.rows_experts`, one Numba
    call), or None when the mean rows per hit expert exceed ``bound``."""
    if hidden_states.dtype not in ROWS_DTYPES or w_gate_up.dtype != hidden_states.dtype:
        raise ValueError(
            f"the row kernels serve {ROWS_DTYPES} weights and activations of one dtype, got "
            f"{hidden_states.dtype} activations and {w_gate_up.dtype} weights"
        )
    out = torch.empty(hidden_states.shape, dtype=hidden_states.dtype)
    threads = cpu_threads()
    # One thread: the serial kernel, with no parallel region to start. bfloat16 on a CPU with
    # bfloat16 dot-product instructions: the kernel that uses them.
    if hidden_states.dtype == torch.bfloat16 and cpu_rows.BF16_DOT:
        kernel = cpu_rows.rows_experts_bf16_serial if threads == 1 else cpu_rows.rows_experts_bf16
    else:
        kernel = cpu_rows.rows_experts_serial if threads == 1 else cpu_rows.rows_experts
    with numba_threads(threads):
        served = kernel(
            _row_view(hidden_states),
            local_ids.detach().contiguous().numpy(),
            weights.detach().to(torch.float32).contiguous().numpy(),
            _row_view(w_gate_up),
            _row_view(w_down),
            bias_view(b_gate_up),
            bias_view(b_down),
            cpu_rows.ACTIVATION_CODES[activation],
            bound,
            _row_view(out),
        )
    return out if served else None


_NO_BIAS = np.zeros((0, 0), np.float32)


@contextlib.contextmanager
def numba_threads(threads: int):
    """Numba's parallel regions take ``threads`` threads inside the block (untouched for one:
    the serial kernels start none)."""
    previous = numba.get_num_threads() if threads > 1 else threads
    if previous == threads:  # each setting takes Numba's launch locks: a decode step's overhead
        yield
        return
    numba.set_num_threads(threads)
    try:
        yield
    finally:
        numba.set_num_threads(previous)


def _row_view(weight: torch.Tensor) -> np.ndarray:
    """A weight as the row kernels read it: bfloat16 as its uint16 bits, float32 as is."""
    weight = weight.detach()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    return weight.view(torch.uint16).numpy() if weight.dtype == torch.bfloat16 else weight.numpy()


def bias_view(bias: torch.Tensor | None) -> np.ndarray:
    return _NO_BIAS if bias is None else bias.detach().to(torch.float32).contiguous().numpy()


def cpu_experts(
    hidden_states: torch.Tensor,
    weights: torch.Tensor,
    local_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
    gemm: str = "auto",
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    loop_weights: tuple | None = None,
) -> torch.Tensor:
    """The CPU experts body of `LocalExperts` and ``torch.ops.moeroute.experts``.

    Sorts the (row, slot) entries by expert, picks the GEMM strategy (``gemm``, or
    `moeroute.experts.choose.choose` for "auto") and runs it.

    Parameters
    ----------
    hidden_states : Tensor [T, H]; weights : Tensor [T, K'] float32; local_ids : Tensor
        [T, K'] int32 (ids outside [0, L) are skipped)
    w_gate_up, w_down, activation, b_gate_up, b_down : as `expert_mlp`
    gemm : one of `GEMM_STRATEGIES`
    loop_weights : (gate_up, down) the "loop" strategy uses instead of the plain weights
        (oneDNN-packed copies, `LocalExperts.cpu_weights`), optional

    Returns
    -------
    Tensor [T, H], dtype of ``hidden_states``.

    Raises
    ------
    TypeError
        ``weights`` not floating or ``local_ids`` not integer (the pair passed ids first, the
        order before 0.2).
    ValueError
        A tensor on another device than ``hidden_states`` (`check_same_device`).
    """
    weights_then_ids(weights, local_ids, "weights", "local_ids")
    check_same_device(
        "hidden_states",
        hidden_states,
        weights=weights,
        local_ids=local_ids,
        w_gate_up=w_gate_up,
        w_down=w_down,
        b_gate_up=b_gate_up,
        b_down=b_down,
    )
    dtype = w_gate_up.dtype
    num_experts = w_gate_up.shape[0]
    strategy = gemm
    if strategy == "rows" or (strategy == "auto" and dtype in ROWS_DTYPES):
        # One Numba call plans, tests "auto"'s bound (`choose`'s "rows" test, from the
        # plan's totals) and, within it, computes the whole forward.
        bound = float("inf") if strategy == "rows" else rows_bound(dtype)
        out = _rows_forward(hidden_states, weights, local_ids, w_gate_up, w_down, activation, b_gate_up, b_down, bound)
        if out is not None:
            return out
    sorted_slots, expert_offsets, inverse_index = routing.sort_by_expert(local_ids.detach().contiguous(), num_experts)
    offsets = expert_offsets.tolist()
    if strategy == "auto":
        counts = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        strategy = choose("float", "cpu", counts, dtype=dtype, onednn=onednn_linear_serves(dtype))
    if strategy == "loop":
        gate_up, down = loop_weights if loop_weights is not None else (w_gate_up, w_down)
        return streamed_expert_mlp(
            hidden_states.contiguous(),
            sorted_slots,
            offsets,
            weights,
            gate_up,
            down,
            activation,
            b_gate_up=b_gate_up,
            b_down=b_down,
        )
    hidden_sorted, _, _ = routing.permute(
        hidden_states.detach().contiguous(), local_ids.detach().contiguous(), num_experts
    )
    expert_out = padded_expert_mlp(hidden_sorted, offsets, w_gate_up, w_down, activation, b_gate_up, b_down)
    return routing.combine(expert_out.detach().contiguous(), inverse_index, weights.detach().contiguous())


def padded_expert_mlp(
    hidden_sorted: torch.Tensor,
    expert_offsets: list[int],
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "silu",
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """`expert_mlp` as two batched GEMMs over an [L, R, H] zero-padded batch.

    Same parameters and result as `expert_mlp` (R = the largest row count; padding rows
    are computed and dropped).
    """
    rows, hidden = hidden_sorted.shape
    num_experts = len(expert_offsets) - 1
    inter = w_down.shape[2]
    if rows == 0:
        return hidden_sorted.new_empty((0, hidden))
    offsets = torch.tensor(expert_offsets, dtype=torch.int64)
    counts = offsets[1:] - offsets[:-1]
    width = int(counts.max())
    row_expert = torch.repeat_interleave(torch.arange(num_experts), counts)
    # Row i of expert e (sorted position offsets[e] + i) goes to batch slot e*R + i.
    position = row_expert * width + (torch.arange(rows) - offsets[:-1][row_expert])
    batch = hidden_sorted.new_zeros((num_experts * width, hidden))
    batch.index_copy_(0, position, hidden_sorted)
    gate_up = torch.bmm(batch.view(num_experts, width, hidden), w_gate_up.transpose(1, 2))
    if b_gate_up is not None:
        gate_up += b_gate_up[:, None, :]
    act = gated_activation(gate_up[..., :inter], gate_up[..., inter:], activation)
    out = torch.bmm(act, w_down.transpose(1, 2))
    if b_down is not None:
        out += b_down[:, None, :]
    return out.view(num_experts * width, hidden).index_select(0, position)
