"""The one driver of the GPU expert GEMMs, whatever the weights' format:

    align_block_size(topk_ids)             expert-sorted, block-padded (token, slot) indices
    gate_up GEMM (+ bias), act(gate) * up  intermediate [T*K, I]
    down GEMM (+ bias, x router weight)    expert_out [T*K, H]
    sum over each token's slots            out [T, H]

A format (float, FP8, MXFP4, INT4) plugs in as the plan function of its grouped GEMM, the
arguments of that plan for each projection and, where it quantizes activations, two hooks that
produce the GEMMs' A operands. The checks every launcher shares, the CuPy backend and the torch
call set-up live here too, so a new format adds a decoder and a plan, not a copy of a launcher.
"""

from __future__ import annotations

import contextlib
import functools

from moeroute.gpu import launch as L
from moeroute.gpu import loader
from moeroute.gpu.align_fallback import align_block_size_array_api

PATHS = ("mma", "simt")
# The w4a16 / w8a16 mma kernels (MXFP4, INT4, FP8 w8a16): mma.sync m16n8k16 takes 16-bit
# activations, and A and the weights arrive in 16-byte cp.async chunks.
NARROW_MMA_DTYPES = ("float16", "bfloat16")
NARROW_MMA_POINTER_ALIGNMENT = 16


def shape(x) -> tuple:
    return tuple(int(v) for v in x.shape)


def check_activation(activation) -> None:
    if activation not in L.ACTIVATIONS:
        raise ValueError(f"activation={activation!r}; expected one of {sorted(L.ACTIVATIONS)}")


def check_path(path) -> None:
    if path not in PATHS:
        raise ValueError(f"path={path!r}; expected 'mma', 'simt' or None")


def check_routing(topk_weights, topk_ids, num_tokens: int) -> int:
    """top_k of ``topk_ids`` / ``topk_weights``, both [num_tokens, K]; ValueError otherwise."""
    ids, weights = shape(topk_ids), shape(topk_weights)
    if ids != weights or len(ids) != 2 or ids[0] != num_tokens:
        raise ValueError(f"topk_ids {ids} and topk_weights {weights} must both be [{num_tokens}, K]")
    return ids[1]


def check_kernel_limits(T: int, K: int, E: int, H: int, I: int, largest_block: int = L.LARGEST_BLOCK_SIZE) -> None:
    """The kernels index rows with int32 and tile columns over gridDim.y: refuse sizes past either."""
    if T * K + E * largest_block > L.INT32_MAX:
        raise ValueError(
            f"num_tokens * top_k = {T * K} with {E} experts exceeds the int32 row index of the kernels; split the batch"
        )
    if max(H, I) > L.MAX_OUTPUT_COLUMNS:
        raise ValueError(
            f"hidden size {H} / intermediate size {I} exceeds {L.MAX_OUTPUT_COLUMNS} columns (the kernels' grid limit)"
        )


def narrow_path_chooser(backend, dtype: str, *arrays, eligible: bool = True):
    """``choose_path`` of the w4a16 / w8a16 formats: "mma" for 16-bit activations on sm_80+ CUDA
    with ``arrays`` and the intermediate 16-byte aligned (and ``eligible``: the format's own
    conditions), else "simt"."""

    def choose_path(intermediate) -> str:
        pointers = [backend.pointer(x) for x in (*arrays, intermediate)]
        mma = (
            eligible
            and dtype in NARROW_MMA_DTYPES
            and not backend.is_hip
            and backend.compute_capability >= L.MMA_MIN_COMPUTE_CAPABILITY
            and all(p % NARROW_MMA_POINTER_ALIGNMENT == 0 for p in pointers)
        )
        return "mma" if mma else "simt"

    return choose_path


def run_expert_mlp(
    backend,
    plan_gemm,
    dtype: str,
    sizes,
    hidden_states,
    topk_weights,
    topk_ids,
    out,
    *,
    gate_up: dict,
    down: dict,
    activation: str,
    apply_router_weight: bool,
    align_block,
    path,
    choose_path,
    plan_args=None,
    gate_up_input=None,
    down_input=None,
):
    """Enqueue align, the two grouped GEMMs and the sum on ``backend``; return ``out``.

    sizes: (T, H, I, E, K), already checked. ``plan_gemm(**kwargs)`` plans one GEMM of the format;
    it receives path, dtype, gated, block_size, sorted_token_ids, expert_ids, topk_weights (flat),
    numel, a, c, top_k, n, k, activation or apply_router_weight, the projection's ``gate_up`` /
    ``down`` arguments (its weights) and ``plan_args`` (the format's settings common to both).
    ``choose_path(intermediate)`` names the path when ``path`` is None. ``gate_up_input()`` and
    ``down_input(intermediate)`` return the A operand's arguments (a, its scales, top_k) of a format
    that quantizes activations; by default A is hidden_states (top_k = K), then the intermediate.
    """
    T, H, I, E, K = sizes
    if T == 0:
        return out
    numel = T * K
    align_block = align_block or L.choose_block_size(numel, E)
    sorted_token_ids, expert_ids = backend.align_block_size(topk_ids, E, align_block)
    intermediate = backend.empty((numel, I), dtype)
    if path is None:
        path = choose_path(intermediate)
    check_path(path)
    common = dict(
        path=path,
        dtype=dtype,
        block_size=align_block,
        sorted_token_ids=sorted_token_ids,
        expert_ids=expert_ids,
        topk_weights=topk_weights.reshape(-1),
        numel=numel,
        **(plan_args or {}),
    )
    a_gate_up = gate_up_input() if gate_up_input else dict(a=hidden_states, top_k=K)
    backend.launch(
        plan_gemm(gated=True, c=intermediate, n=I, k=H, activation=activation, **a_gate_up, **gate_up, **common)
    )
    a_down = down_input(intermediate) if down_input else dict(a=intermediate)
    expert_out = backend.empty((numel, H), dtype)
    backend.launch(
        plan_gemm(
            gated=False,
            c=expert_out,
            top_k=1,
            n=H,
            k=I,
            apply_router_weight=apply_router_weight,
            **a_down,
            **down,
            **common,
        )
    )
    backend.launch(
        L.plan_sum_topk(
            dtype=dtype,
            expert_out=expert_out,
            topk_ids=topk_ids,
            out=out,
            num_tokens=T,
            top_k=K,
            hidden_size=H,
            num_experts=E,
        )
    )
    return out


@functools.lru_cache(maxsize=1)
def _routing_align():
    """moeroute.routing.align.align_block_size (Numba CUDA) when it exists, else None."""
    try:
        from moeroute.routing.align import align_block_size
    except ImportError:
        return None
    return align_block_size


class CupyBackend:
    """Runs the plans with CuPy on the current device and stream, from ``kernel_file``'s module;
    ``allocate(shape, dtype_name)`` makes the scratch arrays (CuPy's pool, or torch's caching
    allocator for torch callers)."""

    kernel_file = L.KERNEL_FILE

    def __init__(self, allocate, align_template=None):
        import cupy

        self._cupy = cupy
        self._allocate = allocate
        # The caller's topk_ids (a torch tensor): the Numba align then allocates through
        # torch's caching allocator too, not CuPy's pool (CUDA graph capture needs one).
        self._align_template = align_template
        self.is_hip = loader.is_hip()
        self.compute_capability = loader.compute_capability()

    def empty(self, shape, dtype):
        return self._allocate(shape, dtype)

    def pointer(self, array) -> int:
        return int(array.data.ptr)

    def align_block_size(self, topk_ids, num_experts, block_size):
        routing_align = None if self.is_hip else _routing_align()
        if routing_align is None:
            sorted_token_ids, expert_ids, _ = align_block_size_array_api(
                topk_ids, num_experts, block_size, xp=self._cupy
            )
        elif self._align_template is not None:
            stream = self._cupy.cuda.get_current_stream().ptr
            sorted_token_ids, expert_ids, _ = routing_align(
                self._align_template, num_experts, block_size, stream=stream
            )
            return torch_as_cupy(sorted_token_ids), torch_as_cupy(expert_ids)
        else:
            sorted_token_ids, expert_ids, _ = routing_align(topk_ids, num_experts, block_size)
        return self._cupy.asarray(sorted_token_ids), self._cupy.asarray(expert_ids)

    def launch(self, plan: L.KernelLaunch) -> None:
        kernel = loader.get_kernel(self.kernel_file, plan.name, plan.shared_memory)
        kernel(plan.grid, plan.block, plan.args, shared_mem=plan.shared_memory)


def torch_as_cupy(tensor):
    import cupy
    import torch

    # CuPy has no bfloat16: the kernels read the same 16 bits through an int16 view.
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return cupy.from_dlpack(tensor)


def check_torch_dtypes(named, quant: str) -> None:
    """``named``: (name, tensor, allowed torch dtypes) of a quantized call with ``quant`` (its repr
    in messages); TypeError for a non-tensor, ValueError for a missing one or a wrong dtype."""
    import torch

    for name, tensor, dtypes in named:
        if tensor is None:
            raise ValueError(f"{name} is required with quant={quant}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor, got {type(tensor).__name__}")
        if tensor.dtype not in dtypes:
            raise ValueError(
                f"{name} has dtype {tensor.dtype}; expected {' or '.join(map(str, dtypes))} with quant={quant}"
            )


def check_torch_placement(named, device) -> None:
    """Every tensor of ``named`` (name, tensor, ...) contiguous on the CUDA ``device``."""
    for name, tensor, *_ in named:
        if tensor.device.type != "cuda" or tensor.device != device:
            raise TypeError(f"{name} is on {tensor.device}; all arguments must be torch CUDA tensors on one device")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


@contextlib.contextmanager
def torch_stream(device):
    """CuPy on torch's current stream of ``device``; yields ``allocate(shape, dtype_name)`` on
    torch's caching allocator. DLPack hands a tensor over with a stream-ordered sync against
    CuPy's current stream: inside the block that is torch's own stream, so nothing waits."""
    import cupy
    import torch

    def allocate(shape, name):
        return torch_as_cupy(torch.empty(shape, dtype=getattr(torch, name), device=device))

    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, device.index)
    with cupy.cuda.Device(device.index), stream:
        yield allocate
