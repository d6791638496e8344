"""``moeroute demo``: every check passes on a healthy build, and a wrong answer fails it."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from moeroute import demo

SMALL = ["--tokens", "6", "--hidden-size", "32", "--intermediate-size", "16", "--repeats", "1"]
FLOAT_STEPS = len(demo.DEMO_PRESETS) * len(demo.DEMO_SHARED_MODES)
STEPS = FLOAT_STEPS + 1  # + the FP8 check against moeroute.quant.reference


def test_demo_passes_every_mode(capsys):
    assert demo.main(SMALL) == 0
    out = capsys.readouterr().out
    assert out.count(": PASS") == STEPS and "FAIL" not in out
    assert f"{STEPS}/{STEPS} checks passed" in out
    for step in range(1, STEPS + 1):  # progress for every step
        assert f"[{step}/{STEPS}]" in out
    # the plan of every mode, with the resolved owner
    assert out.count("ExpertLayout: 256 routed + 1 shared") == len(demo.DEMO_SHARED_MODES)
    assert out.count("ExpertLayout: 512 routed + 1 shared") == len(demo.DEMO_SHARED_MODES)
    for mode in ("runner", "overlap", "fused"):
        assert f"shared expert: {mode}." in out
    errors = [float(e) for e in re.findall(r"max relative error ([0-9.e+-]+)", out)]
    assert len(errors) == FLOAT_STEPS and max(errors) < demo.FP32_RTOL
    fp8 = re.findall(r"w8a8 reference \(moeroute.quant.reference\) ([0-9.e+-]+) \(< [0-9.e+-]+\): PASS", out)
    assert len(fp8) == 1 and float(fp8[0]) < demo.FP8_RTOL
    assert out.count("per-expert load (token slots)") == len(demo.DEMO_PRESETS)


def test_demo_load_summary_counts_slots():
    ids = torch.tensor([[0, 1], [1, 3], [1, 0]]).numpy()
    summary = demo._load_summary(ids, 5)
    assert "min 0, mean 1.2, max 3" in summary
    assert "idle experts 2/5" in summary
    assert "#1: 3, #0: 2, #3: 1" in summary


def test_demo_fails_on_a_wrong_answer(capsys, monkeypatch):
    true_reference = demo._reference

    def off_by_a_bit(preset, weights, x, inter):
        expected, ids = true_reference(preset, weights, x, inter)
        return expected * (1 + 1e-3), ids

    monkeypatch.setattr(demo, "_reference", off_by_a_bit)
    assert demo.main(SMALL) == 1
    out = capsys.readouterr().out
    assert out.count(": FAIL") == FLOAT_STEPS
    assert f"1/{STEPS} checks passed" in out


def test_demo_fp8_check_fails_on_a_wrong_answer(capsys, monkeypatch):
    from moeroute.bindings import ep_run

    true_reference = ep_run.quant_reference

    def off(*args):
        return true_reference(*args) * (1 + 5e-2)  # beyond FP8_RTOL

    monkeypatch.setattr(ep_run, "quant_reference", off)
    args = argparse.Namespace(tokens=6, hidden_size=32, intermediate_size=16, seed=0)
    assert not demo._fp8_check(args, torch.device("cpu"), 1, 1)
    assert ": FAIL" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tokens", "0"], "--tokens=0 must be >= 1"),
        (["--device", "tpu"], "invalid choice"),
    ],
)
def test_demo_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        demo.main(argv)
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_demo_cuda_without_gpu_says_so():
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        demo.main(["--device", "cuda"])
