"""fused_experts: the routed experts of one MoE layer on a GPU, with CuPy RawKernels.

    align_block_size(topk_ids)      expert-sorted, block-padded (token, slot) indices
    gate_up GEMM + act(gate) * up   intermediate [T*K, I]
    down GEMM (x router weight)     expert_out [T*K, H]
    sum over each token's slots     out [T, H]

Inputs are CuPy arrays or torch CUDA tensors (taken through DLPack without a copy); the output
comes back in the caller's framework, computed on its current stream. Validation happens once,
here, before anything is launched.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeroute.gpu import launch as L
from moeroute.gpu.driver import CupyBackend, check_activation, check_kernel_limits, run_expert_mlp, torch_as_cupy
from moeroute.routing._arrays import framework_of

__all__ = ["CupyBackend", "ExpertProblem", "check_fused_experts_args", "run_fused_experts"]

_torch_as_cupy = torch_as_cupy  # the name the benchmarks and device tests import

_TORCH_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ExpertProblem:
    """Sizes of one fused_experts call: T tokens, hidden size H, intermediate size I, E local
    experts, K slots per token, element type name."""

    num_tokens: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    dtype: str


def _dtype_name(x) -> str:
    return str(x.dtype).removeprefix("torch.")


def _is_c_contiguous(x) -> bool:
    if framework_of(x) == "torch":
        return bool(x.is_contiguous())
    flags = getattr(x, "flags", None)
    return bool(flags is None or flags.c_contiguous)


def _check_array(name: str, x, ndim: int, dtypes) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array (CuPy array or torch CUDA tensor), got {type(x).__name__}")
    if len(x.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if _dtype_name(x) not in dtypes:
        raise ValueError(f"{name} has dtype {_dtype_name(x)}; expected {' or '.join(dtypes)}")
    if not _is_c_contiguous(x):
        raise ValueError(f"{name} must be C-contiguous (call .contiguous() / cupy.ascontiguousarray)")


def check_fused_experts_args(
    hidden_states,
    w_gate_up,
    w_down,
    topk_weights,
    topk_ids,
    *,
    activation="silu",
    apply_router_weight=True,
    block_size=None,
    gate_up_bias=None,
    down_bias=None,
) -> ExpertProblem:
    """Validate the arguments of :func:`fused_experts` (shapes, dtypes, contiguity, options).

    Works on any array with ``shape`` and ``dtype`` (the device is checked by fused_experts).

    Raises
    ------
    ValueError
        naming the argument, the value found and what is allowed.
    TypeError
        when an argument is not an array or ``apply_router_weight`` is not a bool.
    """
    _check_array("hidden_states", hidden_states, 2, L.DTYPES)
    dtype = _dtype_name(hidden_states)
    _check_array("w_gate_up", w_gate_up, 3, (dtype,))
    _check_array("w_down", w_down, 3, (dtype,))
    _check_array("topk_weights", topk_weights, 2, ("float32",))
    _check_array("topk_ids", topk_ids, 2, ("int32",))

    T, H = (int(v) for v in hidden_states.shape)
    E, two_I, H_gate_up = (int(v) for v in w_gate_up.shape)
    if H_gate_up != H:
        raise ValueError(
            f"w_gate_up has shape {tuple(w_gate_up.shape)}: last dim {H_gate_up} != hidden size {H} "
            f"of hidden_states; expected [num_experts, 2 * intermediate_size, {H}]"
        )
    if two_I == 0 or two_I % 2:
        raise ValueError(
            f"w_gate_up has shape {tuple(w_gate_up.shape)}: dim 1 must be 2 * intermediate_size "
            f"(gate rows, then up rows), a positive even number, got {two_I}"
        )
    I = two_I // 2
    if E < 1 or H < 1:
        raise ValueError(f"w_gate_up has shape {tuple(w_gate_up.shape)}: need at least one expert and hidden size >= 1")
    if tuple(int(v) for v in w_down.shape) != (E, H, I):
        raise ValueError(
            f"w_down has shape {tuple(w_down.shape)}; expected [num_experts, hidden_size, "
            f"intermediate_size] = {[E, H, I]}"
        )
    K = int(topk_ids.shape[1])
    if int(topk_ids.shape[0]) != T or K < 1:
        raise ValueError(
            f"topk_ids has shape {tuple(topk_ids.shape)}; expected [{T}, top_k >= 1] "
            f"(one row per token of hidden_states)"
        )
    if tuple(int(v) for v in topk_weights.shape) != (T, K):
        raise ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}; expected {[T, K]} like topk_ids")
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (E, two_I)), ("down_bias", down_bias, (E, H))):
        if bias is not None:
            _check_array(name, bias, 2, (dtype,))
            if tuple(int(v) for v in bias.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(bias.shape)}; expected {list(shape)}")
    check_activation(activation)
    if not isinstance(apply_router_weight, bool):
        raise TypeError(f"apply_router_weight must be a bool, got {apply_router_weight!r}")
    if block_size is not None and block_size not in L.BLOCK_SIZES:
        raise ValueError(
            f"block_size={block_size!r}; expected None (chosen from the shapes) or one of {list(L.BLOCK_SIZES)}"
        )
    check_kernel_limits(T, K, E, H, I, largest_block=block_size or L.LARGEST_BLOCK_SIZE)
    return ExpertProblem(T, H, I, E, K, dtype)


def run_fused_experts(
    backend,
    problem: ExpertProblem,
    hidden_states,
    w_gate_up,
    w_down,
    topk_weights,
    topk_ids,
    out,
    *,
    activation: str = "silu",
    apply_router_weight: bool = True,
    block_size=None,
    path=None,
    gate_up_bias=None,
    down_bias=None,
):
    """Enqueue the whole computation on ``backend`` (arrays already in its framework and storage
    dtypes, arguments already checked) and return ``out``.

    ``backend`` provides ``align_block_size(topk_ids, num_experts, block_size)``,
    ``empty(shape, dtype_name)``, ``launch(KernelLaunch)``, ``pointer(array)``,
    ``compute_capability`` and ``is_hip``. ``path`` is "mma", "simt" or None (the fastest
    eligible).
    """
    T, H, I, E, K = (
        problem.num_tokens,
        problem.hidden_size,
        problem.intermediate_size,
        problem.num_experts,
        problem.top_k,
    )

    def choose_path(intermediate):
        pointers = [backend.pointer(x) for x in (hidden_states, w_gate_up, w_down, intermediate)]
        eligible = L.mma_eligible(problem.dtype, backend.compute_capability, backend.is_hip, H, I, pointers)
        return "mma" if eligible else "simt"

    return run_expert_mlp(
        backend,
        L.plan_expert_gemm,
        problem.dtype,
        (T, H, I, E, K),
        hidden_states,
        topk_weights,
        topk_ids,
        out,
        gate_up=dict(b=w_gate_up, bias=gate_up_bias),
        down=dict(b=w_down, bias=down_bias),
        activation=activation,
        apply_router_weight=apply_router_weight,
        align_block=block_size,
        path=path,
        choose_path=choose_path,
        plan_args=dict(compute_capability=backend.compute_capability),
    )


def _require_device_arrays(named: dict):
    """The common framework ("torch" or "cupy") and device index of the arrays in ``named``."""
    frameworks, devices = {}, {}
    for name, x in named.items():
        kind = framework_of(x)
        if kind == "torch":
            if x.device.type != "cuda":
                raise TypeError(
                    f"{name} is a torch tensor on {x.device}; fused_experts needs CUDA (or ROCm) "
                    f"tensors: move the inputs with .cuda()"
                )
            devices[name] = x.device.index
        elif kind == "cupy":
            devices[name] = x.device.id
        else:
            raise TypeError(
                f"{name} must be a CuPy array or a torch CUDA tensor, got {type(x).__module__}.{type(x).__name__}"
            )
        frameworks[name] = kind
    if len(set(frameworks.values())) > 1:
        raise TypeError(f"mixed array frameworks {frameworks}: pass all CuPy arrays or all torch tensors")
    if len(set(devices.values())) > 1:
        raise ValueError(f"arguments are on different devices {devices}: put them on one device")
    return next(iter(frameworks.values())), next(iter(devices.values()))
