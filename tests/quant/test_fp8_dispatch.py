"""FP8 dispatch (``MoE(..., dispatch_dtype="fp8")``): rows quantized once on the sender.

On 2 gloo ranks (all2all and allgather, runner/overlap/fused shared, I = 200 and H = 320,
neither a multiple of the 128 block, float32 and bfloat16 activations, fp8_block and
fp8_tensor): the output equals the single-rank FP8 layer's within float32 summation order,
and bit for bit the same expert-parallel layer dispatching float rows; the rows travel as
e4m3 values plus float32 scales, at most 0.53x the bytes of bfloat16 rows, as TransferStats
reports and as counted here from the routing definition. Argument errors without a group.
"""

from __future__ import annotations

import pytest
import torch

from _fp8_dispatch_workers import CASES, JOIN_TIMEOUT_S, H, fp8_dispatch_worker
from helpers.gloo import spawn_group
from moeroute.bindings.torch import MoE
from moeroute.config import RouterConfig
from moeroute.quant import QuantConfig, quantize_experts

#: Float32 activations: EP and single rank differ only in the order of the float32 sums.
FP32_RTOL = 1e-5
#: bfloat16 activations: each rank's partial sum is rounded to bfloat16 before the combine.
BF16_RTOL = 2e-2
#: The w8a8 definition against the layer (docs/quant.md's acceptance bound).
REFERENCE_RTOL = 2e-2
#: FP8 rows (1 byte per value + 4 bytes per group of 128) against bfloat16 rows.
MAX_BYTES_RATIO = 0.53


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_group(fp8_dispatch_worker, 2, tmp_path_factory.mktemp("fp8_dispatch"), join_timeout_s=JOIN_TIMEOUT_S)


def _records(results):
    return [record for rank in results for record in rank["cases"]]


def test_output_equals_the_single_rank_fp8_layer(results):
    records = _records(results)
    assert len(records) == 2 * len(CASES)
    for record in records:
        tolerance = FP32_RTOL if record["element_size"] == 4 else BF16_RTOL
        assert record["error_vs_single"] < tolerance, record
        # The experts would have quantized the float rows exactly as the sender did.
        assert record["equal_to_float_dispatch"], record
        assert record["shared_calls"] == (0 if record["case"][-1] == "fused" else 1), record
    checked = [r for r in records if "error_vs_reference" in r]
    assert checked
    for record in checked:
        assert record["error_vs_reference"] < REFERENCE_RTOL, record


def test_bytes_sent_are_fp8_values_and_scales(results):
    for record in _records(results):
        rows = record["expected_rows"]
        assert record["rows_sent"] == record["float_rows_sent"] == rows, record
        assert record["hidden_bytes"] == rows * H, record  # one byte per e4m3 value
        assert record["scale_bytes"] == rows * 4 * record["groups"], record
        assert record["float_hidden_bytes"] == rows * H * record["element_size"], record
        bf16_bytes = rows * H * 2
        assert record["token_bytes"] <= MAX_BYTES_RATIO * bf16_bytes, record
    assert any(r["expected_rows"] for r in _records(results))  # something travelled


def test_ranks_disagreeing_on_dispatch_dtype_are_refused(results):
    for rank in results:
        assert rank["mismatch"] is not None and "dispatch_dtype" in rank["mismatch"]


def test_a_dispatcher_that_cannot_carry_fp8_rows_is_refused(results):
    for rank in results:
        assert rank["float_only"] is not None and "carries_fp8" in rank["float_only"], rank["float_only"]


def _router():
    return RouterConfig(4, 2, "softmax", renormalize=True)


@pytest.mark.parametrize("value", ["bf16", "fp4", 8])
def test_unknown_dispatch_dtype_is_refused(value):
    with pytest.raises(ValueError, match="dispatch_dtype"):
        MoE(_router(), 64, 32, quant=QuantConfig("fp8_block"), dispatch_dtype=value)


def test_fp8_dispatch_needs_fp8_experts_with_dynamic_scales():
    with pytest.raises(ValueError, match="dispatch_dtype='fp8' needs FP8 experts"):
        MoE(_router(), 64, 32, dispatch_dtype="fp8")
    with pytest.raises(ValueError, match="dispatch_dtype='fp8' needs dynamic activation scales"):
        MoE(_router(), 64, 32, quant=QuantConfig("fp8_tensor", activation="static"), dispatch_dtype="fp8")
    with pytest.raises(ValueError, match="dispatch_dtype='fp8' needs FP8 experts; mxfp4 experts"):
        MoE(_router(), 64, 32, quant=QuantConfig("mxfp4"), dispatch_dtype="fp8")


def test_without_a_group_fp8_dispatch_changes_nothing():
    quant = QuantConfig("fp8_block", block_size=(32, 32))
    gen = torch.Generator().manual_seed(0)
    q = quantize_experts(
        torch.randn(4, 2 * 24, 40, generator=gen) * 0.1, torch.randn(4, 40, 24, generator=gen) * 0.1, quant
    )
    outs = []
    for dispatch_dtype in (None, "auto", "fp8"):
        module = MoE(_router(), 40, 24, quant=quant, dispatch_dtype=dispatch_dtype)
        with torch.no_grad():
            module.router_weight.copy_(torch.randn(4, 40, generator=torch.Generator().manual_seed(1)))
        module.load_routed_weights(q[0], q[2], gate_up_scale=q[1], down_scale=q[3])
        with torch.no_grad():
            outs.append(module(torch.randn(5, 40, generator=torch.Generator().manual_seed(2))))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert outs[0].abs().max() > 0


def test_run_command_checks_an_fp8_layer_against_the_reference(capsys):
    import re

    from moeroute.bindings import ep_run

    status = ep_run.main(
        [
            "--preset",
            "qwen1.5-moe-a2.7b",
            "--ep",
            "2",
            "--tokens",
            "6",
            "--hidden",
            "160",
            "--intermediate",
            "40",
            "--repeat",
            "1",
            "--quant",
            "fp8_block",
            "--dispatch-dtype",
            "fp8",
            "--debug",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    found = re.findall(
        r"w8a8 reference \(moeroute.quant.reference\): max relative error ([0-9.e+-]+) over "
        r"2 ranks \(< 0.02\): PASS; FP8 rows sent with (\d+) bytes of scales",
        out,
    )
    assert len(found) == 1, out
    assert float(found[0][0]) < ep_run.QUANT_TOLERANCE["float32"] and int(found[0][1]) > 0
    assert "every rank matches" in out


def test_run_command_fails_an_fp8_layer_off_the_reference():
    import argparse

    from moeroute.bindings import ep_run

    args = argparse.Namespace(
        preset="mixtral-8x7b",
        ep=2,
        dispatch="all2all",
        tokens=4,
        hidden=16,
        intermediate=8,
        dtype="float32",
        quant="fp8_block",
        dispatch_dtype="fp8",
    )
    report = dict(
        rank=0,
        tokens=4,
        received_rows=4,
        slots_computed=8,
        max_expert_load=3,
        local_experts=4,
        bytes=None,
        forward_ms=1.0,
        error=0.0,
        shared="none",
        shared_reason="no shared expert",
        reference_error=1e-6,
    )
    assert ep_run._format(args, [report])[1] == 0
    text, status = ep_run._format(args, [report, dict(report, rank=1, reference_error=0.05)])
    assert status == ep_run.EXIT_MISMATCH and "5.00e-02" in text and ": FAIL" in text


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--preset", "deepseek-v3", "--dispatch-dtype", "fp8"], "--dispatch-dtype fp8 needs FP8 experts"),
        (["--preset", "gpt-oss-20b", "--quant", "fp8_block"], "carry biases"),
    ],
)
def test_run_command_refuses_fp8_requests_it_cannot_serve(argv, message, capsys):
    from moeroute.bindings import ep_run

    assert ep_run.main(argv + ["--ep", "2", "--tokens", "4"]) == ep_run.EXIT_USAGE
    assert message in capsys.readouterr().err
