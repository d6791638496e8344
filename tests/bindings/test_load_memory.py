"""Building and loading quantized layers holds a bounded amount beyond the input and the output.

`from_hf(block, quant=...)` quantized a float block's experts eight at a time and
concatenated the pieces (the layer's quantized weights two or three times over); an MXFP4
gpt-oss block's bytes were permuted as a whole before being copied; ``load_state_dict`` of
DeepSeek-V3's per-expert FP8 keys stacked per-expert copies and then the stack. Each now
writes one expert at a time into the layer (or into the one tensor a state dict hands
torch). The peak is measured in a fresh process: the kernel's peak resident size
(``VmHWM``), reset through /proc/self/clear_refs just before the call, minus the resident
size at that moment. The input is resident before the call; the output is the layer's new
quantized tensors; ``load_state_dict`` of per-expert keys writes into the layer's parameters,
resident before the call, so its bound has no output term.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from moeroute.bindings.torch import MoE  # noqa: E402
from moeroute.bindings.torch.hf_keys import from_gpt_oss_layout  # noqa: E402
from moeroute.quant import QuantConfig, quantize_experts  # noqa: E402
from test_hf import BLOCKS, _gpt_oss_block, _randomize  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
#: Extra memory allowed beyond the input and the output, in experts of the input: one
#: expert's temporaries (a converted or permuted copy, step buffers, a check's byte masks)
#: plus the allocator's slack, which differs from run to run by up to three experts here
#: (the state-dict case grew 2 to 5 experts beyond its output; the old code 15 to 45).
BOUND_EXPERTS = 8

PEAK_CODE = textwrap.dedent("""
    import json, resource, sys
    import torch
    from moeroute.bindings.torch import MoE
    from moeroute.config import RouterConfig
    from moeroute.quant import QuantConfig, quantize_experts

    case, n, hidden, inter = sys.argv[1], *map(int, sys.argv[2:5])
    generator = torch.Generator().manual_seed(0)

    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def peak_resident():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    def quantized_bytes(module):
        return sum(t.nbytes for t in module.experts.quantized_tensors().values())

    def setup(n, hidden, inter):
        # (the call measured, returning its output's bytes; one expert's bytes in the input's format)
        if case in ("from_hf_fp8_block", "from_hf_mxfp4"):
            from transformers import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

            config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=n,
                                    num_experts_per_tok=2, norm_topk_prob=True)
            block = Qwen3MoeSparseMoeBlock(config).eval().requires_grad_(False)
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
            quant = QuantConfig(case[len("from_hf_"):])
            return lambda: quantized_bytes(MoE.from_hf(block, quant=quant)), 3 * hidden * inter * 4
        if case == "gpt_oss_mxfp4":
            from transformers import GptOssConfig
            from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

            config = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=n,
                                  num_experts_per_tok=2)
            block = GptOssMLP(config).eval().requires_grad_(False)
            experts = block.experts
            del experts.gate_up_proj, experts.down_proj
            for name, shape in (("gate_up_proj", (n, 2 * inter, hidden // 32)), ("down_proj", (n, hidden, inter // 32))):
                experts.register_buffer(name + "_blocks", torch.randint(0, 256, (*shape, 16), dtype=torch.uint8,
                                                                       generator=generator))
                experts.register_buffer(name + "_scales", torch.randint(100, 140, shape, dtype=torch.uint8,
                                                                       generator=generator))
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
            return lambda: quantized_bytes(MoE.from_hf(block)), 3 * hidden * inter // 2 + 3 * hidden * inter // 32
        if case == "state_dict_fp8_per_expert":
            module = MoE(RouterConfig(n, 2), hidden, inter, quant=QuantConfig("fp8_block"))
            for t in module.experts.quantized_tensors().values():
                t.view(torch.uint8).fill_(1)  # resident before the call, as a layer's loaded weights are
            state = {}
            nb = module.experts.gate_up_scale.shape[1] // 2
            for e in range(n):  # e4m3 bytes that are not NaN, positive scales
                for name, rows, cols, scale in (("gate_proj", inter, hidden, module.experts.gate_up_scale[0, :nb]),
                                                ("up_proj", inter, hidden, module.experts.gate_up_scale[0, nb:]),
                                                ("down_proj", hidden, inter, module.experts.down_scale[0])):
                    weight = torch.randint(0, 0x7F, (rows, cols), dtype=torch.uint8, generator=generator)
                    state[f"experts.{e}.{name}.weight"] = weight.view(torch.float8_e4m3fn)
                    state[f"experts.{e}.{name}.weight_scale_inv"] = torch.rand(scale.shape, generator=generator) + 0.5

            def call():
                module.load_state_dict(state, strict=False)
                return quantized_bytes(module)

            scales = sum(t[0].numel() for t in (module.experts.gate_up_scale, module.experts.down_scale))
            return call, 3 * hidden * inter + 4 * scales
        raise SystemExit(f"unknown case {case}")

    with torch.no_grad():
        setup(4, 256, 128)[0]()  # one-time set-up (lazy imports, torch's first calls) is not the call's
        call, expert = setup(n, hidden, inter)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = resident()
        output = call()
        peak = peak_resident()
        print(json.dumps({"extra": peak - before, "output": output, "expert": expert, "before": before}))
""")


def _peak(case: str, n: int, hidden: int, inter: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", PEAK_CODE, case, str(n), str(hidden), str(inter)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads and resets the peak resident size in /proc/self"
)
@pytest.mark.parametrize(
    "case, n, hidden, inter",
    [
        # 24 float32 experts of 6 MiB: the old code grew by about three times the 36 MiB of FP8 output.
        ("from_hf_fp8_block", 24, 1024, 512),
        ("from_hf_mxfp4", 24, 1024, 512),
        # 64 packed experts of 0.8 MiB: the old code also held a permuted copy of gate_up (35 MiB).
        ("gpt_oss_mxfp4", 64, 1024, 512),
        # 16 FP8 experts of 6 MiB: the old code held the per-expert gate_up copies and then the stack.
        ("state_dict_fp8_per_expert", 16, 2048, 1024),
    ],
)
def test_peak_is_input_output_and_a_few_experts(case, n, hidden, inter):
    report = _peak(case, n, hidden, inter)
    # A state dict of per-expert FP8 keys is written into the layer's own (resident) tensors:
    # no output beyond them.
    output = 0 if case == "state_dict_fp8_per_expert" else report["output"]
    allowed = output + BOUND_EXPERTS * report["expert"]
    assert report["extra"] <= allowed, (
        f"{case} ({n} experts, H={hidden}, I={inter}): grew {report['extra'] / 2**20:.1f} MiB, allowed "
        f"{allowed / 2**20:.1f} MiB (output {output / 2**20:.1f} MiB + {BOUND_EXPERTS} experts of "
        f"{report['expert'] / 2**20:.2f} MiB)"
    )


# ------------------------------------------------------------------ the same values


def _same(a, b):
    if a.dtype == torch.float8_e4m3fn:
        return b.dtype == a.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a.dtype == b.dtype and torch.equal(a, b)


def _expected_rows(module, stacked):
    """Rows ``module.routed_expert_ids()`` of whole-stack tensors: what the layer must hold."""
    index = torch.tensor(module.routed_expert_ids())
    return [t[index] for t in stacked]


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_tensor", "mxfp4"])
@pytest.mark.parametrize("redundant", [0, 3])
def test_from_hf_quantizes_each_expert_as_the_whole_stack(fmt, redundant):
    """One expert at a time into the layer, its replicas included: the whole stack's values."""
    block = _randomize(BLOCKS["qwen3_moe"][0](), seed=7)
    quant = QuantConfig(fmt) if fmt != "fp8_block" else QuantConfig(fmt, block_size=(16, 32))
    moe = MoE.from_hf(block, quant=quant, num_redundant_experts=redundant)
    expected = _expected_rows(moe, quantize_experts(block.experts.gate_up_proj, block.experts.down_proj, quant))
    held = moe.experts.quantized_tensors()
    for name, tensor in zip(("w_gate_up", "gate_up_scale", "w_down", "down_scale"), expected):
        assert _same(held[name], tensor), name


def test_from_hf_gpt_oss_float_block_to_mxfp4():
    """gpt-oss's interleaved float experts, converted and quantized one expert at a time."""
    block = _gpt_oss_block(seed=31, expert_scale=1.0)
    experts = block.experts
    quant = QuantConfig("mxfp4")
    moe = MoE.from_hf(block, quant=quant, num_redundant_experts=2)
    w_gate_up, w_down, b_gate_up, b_down = from_gpt_oss_layout(
        experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_bias, experts.down_proj_bias
    )
    expected = _expected_rows(moe, (*quantize_experts(w_gate_up, w_down, quant), b_gate_up, b_down))
    held = moe.experts.quantized_tensors()
    for name, tensor in zip(("w_gate_up", "gate_up_scale", "w_down", "down_scale"), expected):
        assert _same(held[name], tensor), name
    assert torch.equal(moe.experts.b_gate_up, expected[4]) and torch.equal(moe.experts.b_down, expected[5])


def test_gpt_oss_state_dict_with_replicas_converts_each_expert():
    """A gpt-oss float layer holding replicas loads the block's state dict one expert at a time."""
    block = _gpt_oss_block(seed=33)
    moe = MoE.from_hf(block, num_redundant_experts=3)
    other = _gpt_oss_block(seed=34)
    moe.load_state_dict(other.state_dict())
    experts = other.experts
    converted = from_gpt_oss_layout(
        experts.gate_up_proj, experts.down_proj, experts.gate_up_proj_bias, experts.down_proj_bias
    )
    expected = _expected_rows(moe, converted)
    for name, tensor in zip(("w_gate_up", "w_down", "b_gate_up", "b_down"), expected):
        assert torch.equal(getattr(moe.experts, name), tensor), name


def test_stacked_state_dict_with_replicas_takes_each_logical_expert():
    block = _randomize(BLOCKS["qwen3_moe"][0](), seed=8)
    moe = MoE.from_hf(block, num_redundant_experts=3)
    other = _randomize(BLOCKS["qwen3_moe"][0](), seed=9)
    moe.load_state_dict(other.state_dict())
    expected = _expected_rows(moe, (other.experts.gate_up_proj, other.experts.down_proj))
    assert torch.equal(moe.experts.w_gate_up, expected[0]) and torch.equal(moe.experts.w_down, expected[1])
