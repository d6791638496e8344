"""Tiny quantized MoE checkpoints for vLLM: DeepSeek-V3 with FP8 block-scaled or INT4 routed
experts and gpt-oss with MXFP4 experts.

The checkpoint is a tiny random DeepSeek-V3 (as in `checkpoints`, with moe_intermediate_size
128 so that every expert weight is whole 128 x 128 blocks) saved with transformers, whose
routed expert weights ``mlp.experts.{e}.{gate,up,down}_proj.weight`` are then replaced by
their float8_e4m3fn quantization with moeroute.quant's block quantizer and a
``.weight_scale_inv`` beside each (DeepSeek-V3's published names), and whose config.json
gets DeepSeek-V3's ``quantization_config``. Every other module stays bfloat16 and is named
in ``modules_to_not_convert`` (only the routed experts are FP8).

`save_mxfp4_gpt_oss` saves a tiny random gpt-oss (2 layers, 8 experts, top-2, hidden and
intermediate size 128) and replaces its bfloat16 experts by gpt-oss's published MXFP4 layout,
quantized with moeroute.quant's ``quantize_mxfp4``: ``mlp.experts.gate_up_proj_blocks``
uint8 [E, 2I, H/32, 16] and ``_scales`` [E, 2I, H/32] (rows interleaved as gpt-oss keeps them:
even rows gate, odd rows up), ``down_proj_blocks`` [E, H, I/32, 16] and ``_scales``, the
biases in bfloat16, and ``quantization_config`` ``{"quant_method": "mxfp4",
"modules_to_not_convert": [...]}``.

`save_int4_deepseek` saves the tiny DeepSeek-V3 (Kimi-K2's architecture) with its routed
experts as compressed-tensors W4A16 as Kimi-K2-Thinking publishes them (``pack-quantized``,
symmetric, groups of 32), packed by `pack_quantized_int4`, written here from the published
layout.

All three also write the same model with those experts dequantized back to
bfloat16 (the exact values q * scale_inv), for vLLM to serve without quantization.
"""

import copy
import json
import os

import torch

import checkpoints

BLOCK = (128, 128)
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
}
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _is_routed_expert(key):
    return ".mlp.experts." in key and key.endswith(tuple(f"{p}.weight" for p in PROJECTIONS))


def _not_converted(keys):
    """vLLM's names of the linear modules that stay bfloat16: everything but the routed
    experts (vLLM matches ``ignored_layers`` exactly, fused modules by their parts)."""
    names = set()
    for key in keys:
        if not key.endswith(".weight") or _is_routed_expert(key) or "layernorm" in key or "embed" in key:
            continue
        names.add(key[: -len(".weight")])
    # vLLM fuses q_a_proj and kv_a_proj_with_mqa (fused_qkv_a_proj) and gate_proj/up_proj
    # (gate_up_proj); it checks that all parts of a fused module are skipped alike.
    extra = set()
    for name in names:
        if name.endswith(".self_attn.q_a_proj"):
            extra.add(name.replace(".q_a_proj", ".fused_qkv_a_proj"))
        if name.endswith(".gate_proj"):
            extra.add(name.replace(".gate_proj", ".gate_up_proj"))
    return sorted(names | extra)


def save_fp8_deepseek(directory, dequantized_directory=None, seed=0):
    """Save the FP8 DeepSeek-V3 checkpoint into ``directory`` (and, when given, the same model
    with the routed experts dequantized to bfloat16 into ``dequantized_directory``)."""
    from safetensors.torch import load_file, save_file

    from moeroute.quant import dequantize_fp8_block, quantize_fp8_block

    model_cls, config = checkpoints._config("deepseek_v3")
    config.moe_intermediate_size = 128
    checkpoints.save_model(model_cls, config, directory, seed)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    quantized, dequantized = {}, {}
    for key, value in tensors.items():
        if not _is_routed_expert(key):
            quantized[key] = dequantized[key] = value
            continue
        q, scale_inv = quantize_fp8_block(value, BLOCK)
        quantized[key] = q
        quantized[key + "_scale_inv"] = scale_inv
        dequantized[key] = dequantize_fp8_block(q, scale_inv, BLOCK).to(torch.bfloat16)
    if dequantized_directory is not None:
        checkpoints.save_model(model_cls, config, dequantized_directory, seed)
        save_file(dequantized, os.path.join(dequantized_directory, "model.safetensors"), metadata={"format": "pt"})
    save_file(quantized, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        config_json = json.load(f)
    config_json["quantization_config"] = dict(QUANTIZATION_CONFIG, modules_to_not_convert=_not_converted(tensors))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2)
    return directory


MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def gpt_oss_config():
    import transformers as tf

    return tf.GptOssForCausalLM, tf.GptOssConfig(
        num_hidden_layers=2,
        head_dim=32,
        intermediate_size=128,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        **checkpoints.COMMON,
    )


def save_mxfp4_gpt_oss(directory, dequantized_directory=None, seed=0):
    """Save the MXFP4 gpt-oss checkpoint into ``directory`` (and, when given, the same model
    with the experts dequantized to bfloat16 into ``dequantized_directory``)."""
    from safetensors.torch import load_file, save_file

    from moeroute.quant import dequantize_mxfp4, quantize_mxfp4

    model_cls, config = gpt_oss_config()
    checkpoints.save_model(model_cls, config, directory, seed)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    quantized, dequantized = {}, {}
    for key, value in tensors.items():
        if not key.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            quantized[key] = dequantized[key] = value
            continue
        # transformers keeps [E, in, out]; the MXFP4 checkpoint stores [E, out, in/32, 16].
        blocks, scales = quantize_mxfp4(value.float().transpose(1, 2).contiguous())
        quantized[key + "_blocks"], quantized[key + "_scales"] = blocks, scales
        dequantized[key] = dequantize_mxfp4(blocks, scales).transpose(1, 2).to(torch.bfloat16).contiguous()
    if dequantized_directory is not None:
        checkpoints.save_model(model_cls, config, dequantized_directory, seed)
        save_file(dequantized, os.path.join(dequantized_directory, "model.safetensors"), metadata={"format": "pt"})
    save_file(quantized, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        config_json = json.load(f)
    config_json["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_NOT_CONVERTED}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2)
    return directory


#: compressed-tensors W4A16 as Kimi-K2-Thinking publishes it: int4 weights, symmetric,
#: groups of 32 input columns, bfloat16 scales, 16-bit activations, ``pack-quantized``.
INT4_GROUP = 32
INT4_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": INT4_GROUP,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    # Everything but the routed experts stays bfloat16: attention, the shared expert, the
    # dense first layer's MLP, the routers (not Linear targets in vLLM) and the head.
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
}


def pack_quantized_int4(weight, group=INT4_GROUP, symmetric=True):
    """compressed-tensors ``pack-quantized`` tensors of a float weight [N, K], INT4 in groups
    of ``group`` input columns, written from the published layout (not with moeroute).

    ``weight_scale`` [N, K/group] bfloat16: the group's max |w| / 7.5 (the min-max observer's
    symmetric range [-8, 7]) rounded to 5 significant bits, so that every ``q * scale`` is
    a bfloat16 value; ``q = clamp(round(w / scale), -8, 7)``; ``weight_packed`` int32
    [N, K/8], column k's ``q + 8`` in bits ``4 * (k % 8)`` of word ``k // 8``;
    ``weight_shape`` int64 [2] = (N, K). Returns those three and the dequantized weight
    ``q * scale`` (float32, exact).

    ``symmetric=False``: the min-max range widened to hold 0, ``scale = (hi - lo) / 15``
    rounded to 4 significant bits (so that every ``(q - zp) * scale`` is a bfloat16 value),
    a signed zero point ``zp = clamp(round(-lo / scale), 0, 15) - 8`` per group,
    ``q = clamp(round(w / scale) + zp, -8, 7)`` stored as ``q + 8`` as above, and
    ``weight_zero_point`` int32 [N/8, K/group]: row n's ``zp + 8`` in bits ``4 * (n % 8)`` of
    word ``n // 8`` (packed along the rows), returned after the dequantized weight."""
    rows, cols = weight.shape
    w = weight.float().reshape(rows, cols // group, group)
    if not symmetric:
        lo = w.amin(dim=2).clamp(max=0)
        hi = w.amax(dim=2).clamp(min=0)
        mantissa, exponent = torch.frexp(((hi - lo) / 15).clamp(min=1e-8))
        scale = torch.ldexp(torch.round(mantissa * 16) / 16, exponent).to(torch.bfloat16)
        zp = torch.clamp(torch.round(-lo / scale.float()), 0, 15) - 8
        q = torch.clamp(torch.round(w / scale.float()[:, :, None]) + zp[:, :, None], -8, 7)
        dequantized = ((q - zp[:, :, None]) * scale.float()[:, :, None]).reshape(rows, cols)
        nibbles = (q.reshape(rows, cols // 8, 8).to(torch.int64) + 8) << (4 * torch.arange(8))
        words = nibbles.sum(dim=2)
        packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        zp_words = ((zp.to(torch.int64) + 8).reshape(rows // 8, 8, -1) << (4 * torch.arange(8))[:, None]).sum(dim=1)
        zero_point = torch.where(zp_words >= 2**31, zp_words - 2**32, zp_words).to(torch.int32)
        shape = torch.tensor([rows, cols], dtype=torch.int64)
        return packed, scale, shape, dequantized, zero_point
    amax = w.abs().amax(dim=2).clamp(min=1e-8)
    mantissa, exponent = torch.frexp(amax / 7.5)
    scale = torch.ldexp(torch.round(mantissa * 32) / 32, exponent).to(torch.bfloat16)
    q = torch.clamp(torch.round(w / scale.float()[:, :, None]), -8, 7)
    dequantized = (q * scale.float()[:, :, None]).reshape(rows, cols)
    nibbles = (q.reshape(rows, cols // 8, 8).to(torch.int64) + 8) << (4 * torch.arange(8))
    words = nibbles.sum(dim=2)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    shape = torch.tensor([rows, cols], dtype=torch.int64)
    return packed, scale, shape, dequantized


def save_int4_deepseek(directory, dequantized_directory=None, seed=0, symmetric=True):
    """Save the tiny DeepSeek-V3 (Kimi-K2's architecture) with its routed experts as
    compressed-tensors W4A16 into ``directory``: ``mlp.experts.{e}.{gate,up,down}_proj``
    ``.weight_packed``, ``.weight_scale`` and ``.weight_shape`` (`pack_quantized_int4`), and
    Kimi-K2's ``quantization_config``; when given, the same model with those experts
    dequantized to bfloat16 (exact) into ``dequantized_directory``. ``symmetric=False``: the
    asymmetric form, with each weight's ``.weight_zero_point`` and ``"symmetric": false``."""
    from safetensors.torch import load_file, save_file

    model_cls, config = checkpoints._config("deepseek_v3")
    checkpoints.save_model(model_cls, config, directory, seed)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    quantized, dequantized = {}, {}
    for key, value in tensors.items():
        if not _is_routed_expert(key):
            quantized[key] = dequantized[key] = value
            continue
        packed, scale, shape, exact, *zero_point = pack_quantized_int4(value, symmetric=symmetric)
        module = key[: -len(".weight")]
        if zero_point:
            quantized[module + ".weight_zero_point"] = zero_point[0]
        quantized[module + ".weight_packed"] = packed
        quantized[module + ".weight_scale"] = scale
        quantized[module + ".weight_shape"] = shape
        dequantized[key] = exact.to(torch.bfloat16)
        assert torch.equal(dequantized[key].float(), exact)
    if dequantized_directory is not None:
        checkpoints.save_model(model_cls, config, dequantized_directory, seed)
        save_file(dequantized, os.path.join(dequantized_directory, "model.safetensors"), metadata={"format": "pt"})
    save_file(quantized, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        config_json = json.load(f)
    config_json["quantization_config"] = copy.deepcopy(INT4_QUANTIZATION_CONFIG)
    config_json["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = symmetric
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2)
    return directory
