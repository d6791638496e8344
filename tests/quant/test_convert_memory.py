"""Converting float experts to FP8 or MXFP4 holds a bounded amount beyond its input and output.

`quantize_mxfp4` of one gpt-oss-20b layer's float32 experts (3.2 GB) grew past 12 GB of resident
memory: the whole stack went through float64 copies and int64 codes at once. Each conversion
now works through the stack a bounded step at a time. The peak is measured in a fresh process
(the kernel's peak resident size, ``VmHWM``, reset just before the call, minus the resident
size at that moment), and the chunked results must equal the one-step ones bit for bit.
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

from moeroute.quant import QuantConfig, fp8, mxfp4, quantize_experts, quantize_fp8_block, quantize_mxfp4

ROOT = Path(__file__).resolve().parents[2]
EXPERTS, ROWS, COLS = 16, 1024, 1024
#: One expert's float32 weights: the unit of the bound.
EXPERT_BYTES = ROWS * COLS * 4
#: Extra memory allowed beyond the input and the output, in experts' float32 weights: the
#: step's temporaries (at most about 2.5 experts here) plus the allocator's slack.
BOUND_EXPERTS = 4
#: `quantize_experts` of [N, 2I, H] and [N, H, I] float32 weights with H = COLS, I = ROWS / 2:
#: one expert is 3 * H * I float32 values (6 MiB), and the bound is two of them. The
#: whole-stack code also held the gate's and the up's outputs beside their concatenation
#: (FP8 block), or |w| of each whole projection (FP8 per tensor).
EXPERTS_EXPERT_BYTES = 3 * COLS * (ROWS // 2) * 4
EXPERTS_BOUND_EXPERTS = 2

PEAK_CODE = textwrap.dedent("""
    import json, resource, sys
    import torch
    from moeroute.quant import QuantConfig, quantize_experts, quantize_fp8_block, quantize_mxfp4

    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    name, dtype, experts, rows, cols = sys.argv[1], getattr(torch, sys.argv[2]), *map(int, sys.argv[3:6])
    generator = torch.Generator().manual_seed(0)
    if name.startswith("experts_"):
        config = QuantConfig(name[len("experts_"):])
        w = (torch.randn(experts, rows, cols, generator=generator, dtype=dtype),
             torch.randn(experts, cols, rows // 2, generator=generator, dtype=dtype))
        convert = lambda w: quantize_experts(*w, config)
        convert((w[0][:1, :64, :64], w[1][:1, :64, :32]))  # torch's one-time set-up is not the conversion's
    else:
        convert = {"mxfp4": quantize_mxfp4, "fp8_block": quantize_fp8_block}[name]
        w = torch.randn(experts, rows, cols, generator=generator, dtype=dtype)
        convert(w[:1, :32, :64])  # torch's one-time set-up (and any kernel compile) is not the conversion's

    def peak_resident():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    # Reset the peak to the current size: a compile above may have peaked higher than the call.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = resident()
    out = convert(w)
    peak = peak_resident()
    print(json.dumps({"extra": peak - before, "output": sum(t.nbytes for t in out), "before": before}))
""")


def _peak(name: str, dtype: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", PEAK_CODE, name, dtype, str(EXPERTS), str(ROWS), str(COLS)],
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
@pytest.mark.parametrize("name, dtype", [("mxfp4", "float32"), ("fp8_block", "float32"), ("fp8_block", "bfloat16")])
def test_conversion_peak_is_bounded_by_one_expert(name, dtype):
    """The whole-stack code held about 10 float32 copies of the stack (600+ MB here)."""
    report = _peak(name, dtype)
    allowed = report["output"] + BOUND_EXPERTS * EXPERT_BYTES
    assert report["extra"] <= allowed, (
        f"{name} of {EXPERTS} x {ROWS} x {COLS} {dtype}: grew "
        f"{report['extra'] / 2**20:.0f} MiB, allowed {allowed / 2**20:.0f} MiB"
    )


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads and resets the peak resident size in /proc/self"
)
@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_tensor", "mxfp4"])
def test_quantize_experts_peak_is_bounded_by_two_experts(fmt):
    report = _peak("experts_" + fmt, "float32")
    allowed = report["output"] + EXPERTS_BOUND_EXPERTS * EXPERTS_EXPERT_BYTES
    assert report["extra"] <= allowed, (
        f"quantize_experts {fmt} of {EXPERTS} experts, H={COLS}, I={ROWS // 2}: grew "
        f"{report['extra'] / 2**20:.0f} MiB, allowed {allowed / 2**20:.0f} MiB"
    )


def _weights(dtype, contiguous=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(5, 40, 96, generator=generator) * torch.logspace(-3, 3, 40)[:, None]
    w[1, 3] = 0.0  # an all-zero row
    w[2, 5, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # ties
    if not contiguous:
        w = w.transpose(-1, -2).contiguous().transpose(-1, -2)
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("contiguous", [True, False])
def test_mxfp4_steps_give_the_one_step_result(monkeypatch, dtype, contiguous):
    w = _weights(dtype, contiguous)
    whole = quantize_mxfp4(w.contiguous())  # one step: 19200 elements, less than a step
    monkeypatch.setattr(mxfp4, "_STEP_ELEMENTS", 7 * 96)  # 7 rows a step: steps straddle experts
    stepped = quantize_mxfp4(w)
    assert all(torch.equal(a, b) for a, b in zip(whole, stepped))
    monkeypatch.setattr(mxfp4, "_STEP_ELEMENTS", 1)  # one row a step
    assert all(torch.equal(a, b) for a, b in zip(whole, quantize_mxfp4(w)))


@pytest.mark.parametrize("block", [(16, 32), (7, 40), (128, 128)])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp8_block_steps_give_the_one_step_result(monkeypatch, block, contiguous, scale_fmt):
    w = _weights(torch.bfloat16, contiguous, seed=1)
    whole = quantize_fp8_block(w.contiguous(), block, scale_fmt)
    monkeypatch.setattr(fp8, "_STEP_ELEMENTS", 1)  # one block row a step
    stepped = quantize_fp8_block(w, block, scale_fmt)
    assert stepped[0].view(torch.uint8).equal(whole[0].view(torch.uint8))
    assert torch.equal(stepped[1], whole[1])
    # The definition, block by block: the stepped result is the formula's.
    bn, bk = block
    q, scale = stepped
    for e in range(w.shape[0]):
        for i in range(0, w.shape[1], bn):
            for j in range(0, w.shape[2], bk):
                tile = w[e, i : i + bn, j : j + bk].float()
                s = max(float(tile.abs().max()), 1e-10) / 448
                if scale_fmt == "ue8m0":
                    s = 2.0 ** torch.ceil(torch.log2(torch.tensor(s))).item()
                assert float(scale[e, i // bn, j // bk]) == pytest.approx(s, rel=1e-6)
                expected = (tile / scale[e, i // bn, j // bk]).clamp(-448, 448).to(torch.float8_e4m3fn)
                assert q[e, i : i + bn, j : j + bk].view(torch.uint8).equal(expected.view(torch.uint8))


def test_mxfp4_names_the_expert_holding_a_nan():
    w = torch.ones(3, 4, 32)
    w[2, 1, 5] = float("nan")
    with pytest.raises(ValueError, match=r"w\[2\] holds inf or NaN"):
        quantize_mxfp4(w)


def _old_quantize_experts(w_gate_up, w_down, config):
    """The whole-stack computation `quantize_experts` replaced: each projection at once, then
    the gate's and the up's outputs concatenated."""
    inter = w_gate_up.shape[1] // 2
    gate, up = w_gate_up[:, :inter], w_gate_up[:, inter:]
    if config.format == "mxfp4":
        return (*quantize_mxfp4(w_gate_up), *quantize_mxfp4(w_down))
    if config.format == "fp8_block":
        (qg, sg), (qu, su) = (quantize_fp8_block(w, config.block_size, config.scale_fmt) for w in (gate, up))
        q_down, down_scale = quantize_fp8_block(w_down, config.block_size, config.scale_fmt)
        return torch.cat([qg, qu], 1), torch.cat([sg, su], 1), q_down, down_scale
    ue8m0 = config.scale_fmt == "ue8m0"

    def per_tensor(w):  # the formula: one scale per matrix from its amax
        scale = w.float().abs().amax(dim=(-2, -1)).clamp(min=fp8.MIN_AMAX) / fp8.FP8_MAX
        if ue8m0:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        return (w.float() / scale[..., None, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale

    (qg, sg), (qu, su), (qd, sd) = per_tensor(gate), per_tensor(up), per_tensor(w_down)
    return torch.cat([qg, qu], 1), torch.stack([sg, su], -1), qd, sd


def _same(a, b):
    if a.dtype == torch.float8_e4m3fn:
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize(
    "config",
    [
        QuantConfig("fp8_block", block_size=(16, 32)),
        QuantConfig("fp8_block", block_size=(7, 40), scale_fmt="ue8m0"),
        QuantConfig("fp8_tensor"),
        QuantConfig("fp8_tensor", scale_fmt="ue8m0"),
        QuantConfig("mxfp4"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_experts_gives_the_whole_stack_result(monkeypatch, config, dtype):
    generator = torch.Generator().manual_seed(3)
    inter = 32 if config.format == "mxfp4" else 40  # MXFP4 rows hold multiples of 32
    scales = torch.logspace(-3, 3, 3)[:, None, None]  # experts of very different magnitudes
    w_gate_up = (torch.randn(3, 2 * inter, 96, generator=generator) * scales).to(dtype)
    w_down = (torch.randn(3, 96, inter, generator=generator) * scales).to(dtype)
    expected = _old_quantize_experts(w_gate_up, w_down, config)
    monkeypatch.setattr(fp8, "_STEP_ELEMENTS", 96 * 3)  # steps of a few rows: steps straddle gate and up
    monkeypatch.setattr(mxfp4, "_STEP_ELEMENTS", 96 * 3)
    actual = quantize_experts(w_gate_up, w_down, config)
    assert all(_same(a, b) for a, b in zip(actual, expected))
    # Into given tensors (rows of a larger stack): the same values, the tensors returned.
    big = [torch.zeros((5, *t.shape[1:]), dtype=t.dtype) for t in expected]
    out = tuple(t[1:4] for t in big)
    returned = quantize_experts(w_gate_up, w_down, config, out=out)
    assert all(a is b for a, b in zip(returned, out))
    assert all(_same(a, b) for a, b in zip(out, expected))
    assert all(not t[0].to(torch.float32).any() and not t[4].to(torch.float32).any() for t in big)  # untouched


def test_quantize_experts_refuses_a_bad_out():
    config = QuantConfig("fp8_block", block_size=(16, 32))
    w_gate_up, w_down = torch.randn(2, 32, 64), torch.randn(2, 64, 16)
    good = quantize_experts(w_gate_up, w_down, config)
    with pytest.raises(TypeError, match="out must be a tuple of 4 tensors"):
        quantize_experts(w_gate_up, w_down, config, out=good[:3])
    with pytest.raises(ValueError, match=r"out gate_up_scale is torch.float32 \(2, 1, 2\)"):
        quantize_experts(w_gate_up, w_down, config, out=(good[0], good[1][:, :1], good[2], good[3]))
    with pytest.raises(ValueError, match=r"w_down has shape \(2, 64, 17\), expected \[N, H, I\] = \[2, 64, 16\]"):
        quantize_experts(w_gate_up, torch.randn(2, 64, 17), config)


def test_check_fp8_weight_names_the_expert_of_a_nan_byte():
    q = torch.zeros(3, 4, 8, dtype=torch.uint8)
    q[2, 1, 5] = 0xFF
    with pytest.raises(ValueError, match=r"w\[2, 1, 5\] \(expert 2\) is the byte 0xFF"):
        fp8.check_fp8_weight("w", q.view(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"w\[1, 5\] \(expert 7\) is the byte 0xFF"):
        fp8.check_fp8_weight("w", q[2].view(torch.float8_e4m3fn), expert=7)
