"""``fused_experts``, the front door of the GPU expert GEMMs: float experts run the kernels of
`moeroute.gpu.gemm` (kernels/moe_gemm.cu), FP8 experts (``quant=``) those of
`moeroute.gpu.gemm_fp8` (kernels/moe_gemm_fp8.cu), MXFP4 experts those of
`moeroute.gpu.gemm_mxfp4` (kernels/moe_gemm_mxfp4.cu), INT4 experts those of
`moeroute.gpu.gemm_int4` (kernels/moe_gemm_int4.cu). All sit below this module, so none
imports another's front door."""

from __future__ import annotations

from moeroute._validate import weights_then_ids
from moeroute.gpu import launch as L
from moeroute.gpu.driver import CupyBackend, torch_as_cupy, torch_stream
from moeroute.gpu.gemm import _require_device_arrays, check_fused_experts_args, run_fused_experts
from moeroute.gpu.gemm_fp8 import fused_experts_fp8
from moeroute.gpu.gemm_int4 import fused_experts_int4
from moeroute.gpu.gemm_mxfp4 import fused_experts_mxfp4

__all__ = ["fused_experts"]


def fused_experts(
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
    quant=None,
    gate_up_scale=None,
    down_scale=None,
    input_scale=None,
):
    """Routed-expert MLPs of one MoE layer: ``out[t] = sum_k w[t,k] * down_e(act(gate_e x_t) * up_e x_t)``
    over the slots k whose expert e = topk_ids[t, k] is in [0, num_experts).

    Parameters
    ----------
    hidden_states : [T, H] float32, float16 or bfloat16 (bfloat16 through torch only: CuPy has none)
    w_gate_up : [E, 2I, H], dtype of hidden_states; Hugging Face stacked layout, gate rows first
    w_down : [E, H, I], dtype of hidden_states
    topk_weights : [T, K] float32
    topk_ids : [T, K] int32, local expert ids; -1 (or any id outside [0, E)) is a slot computed
        elsewhere (another expert-parallel rank): it contributes nothing here.
    activation : "silu" (default), "gelu" (exact, erf), "gelu_tanh" (tanh approximation) or
        "swigluoai" (gpt-oss: ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)``, g = min(gate, 7))
    apply_router_weight : multiply each slot's output by its topk_weights entry (True) or not
    block_size : rows per align_block_size block, one of 16, 32, 64, 128; None picks one from
        T * K / E.
    gate_up_bias : [E, 2I], dtype of hidden_states, optional; gate entries first, added before
        the activation
    down_bias : [E, H], dtype of hidden_states, optional; added before the router weight

    quant : moeroute.quant.QuantConfig, optional
        FP8 experts (torch CUDA tensors only): w_gate_up / w_down are float8_e4m3fn with
        ``gate_up_scale`` / ``down_scale`` float32 of ``quant.scale_shapes``, and the w8a8
        kernels of moe_gemm_fp8.cu run them (moeroute.gpu.gemm_fp8.fused_experts_fp8), or its
        w8a16 kernels with ``QuantConfig("fp8_block", activation="none")``;
        ``input_scale`` [E, 2] float32 with fp8_tensor and activation="static".
        MXFP4 experts (``QuantConfig(format="mxfp4")``, torch CUDA tensors only): w_gate_up and
        w_down are ``(blocks, scales)`` pairs of uint8 tensors ([E, 2I, H/32, 16] and
        [E, 2I, H/32]; [E, H, I/32, 16] and [E, H, I/32]), decoded in registers by the w4a16
        kernels of moe_gemm_mxfp4.cu (moeroute.gpu.gemm_mxfp4.fused_experts_mxfp4); the biases
        may be of any float dtype (added in float32); no scale arguments.
        INT4 experts (``QuantConfig("int4", group_size=g, symmetric=...)``, torch CUDA tensors
        only): w_gate_up and w_down are ``(packed, scales)`` (symmetric) or ``(packed, scales,
        zeros)`` tuples (`moeroute.quant.int4`: uint8 [E, 2I, H/2], scales float32 / bfloat16 /
        float16 [E, 2I, H/g], zeros uint8 [E, 2I, H/g]; [E, H, I/2] ... for w_down), decoded in
        registers by the w4a16 kernels of moe_gemm_int4.cu
        (moeroute.gpu.gemm_int4.fused_experts_int4); no biases, no scale arguments.

    All arrays are CuPy arrays or all are torch CUDA tensors, on one device, C-contiguous.
    Accumulation is float32; intermediate and output are in the input dtype.

    Returns
    -------
    out : [T, H], dtype of hidden_states, in the caller's framework, on the same device; the work
        is enqueued on the caller's current stream (torch.cuda.current_stream() / CuPy's).

    Raises
    ------
    TypeError
        an argument is not a CuPy array / torch CUDA tensor, frameworks are mixed,
        apply_router_weight is not a bool, or topk_weights is not floating / topk_ids not
        integer (the pair passed ids first).
    ValueError
        a shape, dtype, layout or option is wrong (the message names the argument), or the
        arguments are on different devices.
    """
    weights_then_ids(topk_weights, topk_ids)
    if quant is not None and getattr(quant, "format", None) == "int4":
        unsupported = {
            "block_size": block_size,
            "gate_up_bias": gate_up_bias,
            "down_bias": down_bias,
            "gate_up_scale": gate_up_scale,
            "down_scale": down_scale,
            "input_scale": input_scale,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise ValueError(
                    f"{name} is not supported with quant=int4 (the scales and zero points travel in the "
                    f"(packed, scales[, zeros]) tuples; the format has no biases): pass None"
                )
        return fused_experts_int4(
            hidden_states,
            w_gate_up,
            w_down,
            topk_weights,
            topk_ids,
            group_size=quant.group_size,
            symmetric=quant.symmetric,
            activation=activation,
            apply_router_weight=apply_router_weight,
        )
    if quant is not None and getattr(quant, "format", None) == "mxfp4":
        unsupported = {
            "block_size": block_size,
            "gate_up_scale": gate_up_scale,
            "down_scale": down_scale,
            "input_scale": input_scale,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise ValueError(
                    f"{name} is not supported with quant=mxfp4 (the scales travel in the "
                    f"(blocks, scales) pairs): pass None"
                )
        return fused_experts_mxfp4(
            hidden_states,
            w_gate_up,
            w_down,
            topk_weights,
            topk_ids,
            gate_up_bias=gate_up_bias,
            down_bias=down_bias,
            activation=activation,
            apply_router_weight=apply_router_weight,
        )
    if quant is not None:
        unsupported = {"block_size": block_size, "gate_up_bias": gate_up_bias, "down_bias": down_bias}
        for name, value in unsupported.items():
            if value is not None:
                raise ValueError(f"{name} is not supported with quant= (FP8 experts): pass None")
        return fused_experts_fp8(
            hidden_states,
            w_gate_up,
            gate_up_scale,
            w_down,
            down_scale,
            topk_weights,
            topk_ids,
            quant=quant,
            activation=activation,
            apply_router_weight=apply_router_weight,
            input_scale=input_scale,
        )
    if gate_up_scale is not None or down_scale is not None or input_scale is not None:
        raise ValueError(
            "gate_up_scale / down_scale / input_scale are FP8 scales: pass quant=QuantConfig(...) with them"
        )
    problem = check_fused_experts_args(
        hidden_states,
        w_gate_up,
        w_down,
        topk_weights,
        topk_ids,
        activation=activation,
        apply_router_weight=apply_router_weight,
        block_size=block_size,
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
    )
    named = dict(
        hidden_states=hidden_states, w_gate_up=w_gate_up, w_down=w_down, topk_weights=topk_weights, topk_ids=topk_ids
    )
    biases = dict(gate_up_bias=gate_up_bias, down_bias=down_bias)
    named.update({name: bias for name, bias in biases.items() if bias is not None})
    framework, device = _require_device_arrays(named)
    import cupy

    shape = (problem.num_tokens, problem.hidden_size)
    if framework == "torch":
        import torch

        out = torch.empty(shape, dtype=hidden_states.dtype, device=hidden_states.device)
        with torch_stream(hidden_states.device) as allocate:
            arrays = [
                torch_as_cupy(named[name])
                for name in ("hidden_states", "w_gate_up", "w_down", "topk_weights", "topk_ids")
            ]
            bias_arrays = {name: None if bias is None else torch_as_cupy(bias) for name, bias in biases.items()}
            backend = CupyBackend(allocate, align_template=topk_ids)
            run_fused_experts(
                backend,
                problem,
                *arrays,
                torch_as_cupy(out),
                activation=activation,
                apply_router_weight=apply_router_weight,
                block_size=block_size,
                **bias_arrays,
            )
        return out

    def allocate(shape, dtype):
        return cupy.empty(shape, dtype=L.STORAGE_DTYPES[dtype])

    with cupy.cuda.Device(device):
        out = cupy.empty(shape, dtype=hidden_states.dtype)
        return run_fused_experts(
            CupyBackend(allocate),
            problem,
            hidden_states,
            w_gate_up,
            w_down,
            topk_weights,
            topk_ids,
            out,
            activation=activation,
            apply_router_weight=apply_router_weight,
            block_size=block_size,
            **biases,
        )
