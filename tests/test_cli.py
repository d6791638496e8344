"""Tests for moeroute.cli: plan, route, --list-presets, help, extensibility."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from moeroute import _args, cli
from moeroute.config import PRESETS
from moeroute.layout import ExpertLayout


def run(capsys, *argv):
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def histogram(out, prefix):
    """{label: count} of the histogram rows starting with ``prefix``."""
    rows = {}
    for line in out.splitlines():
        match = re.match(rf"^  ({prefix}.*?)\s*\|[# ]*\| (\d+)$", line)
        if match:
            rows[match.group(1)] = int(match.group(2))
    return rows


# ----------------------------------------------------------------------------
# --list-presets, help, errors


def test_list_presets(capsys):
    status, out, _ = run(capsys, "--list-presets")
    assert status == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["name", "model_type", "N", "K"]
    for name, preset in PRESETS.items():
        row = next(line.split() for line in lines if line.startswith(name + " "))
        assert row[1:4] == [preset.model_type, str(preset.router.num_experts), str(preset.router.top_k)]
        assert row[-2:] == [str(preset.hidden_size), str(preset.moe_intermediate_size)]


def test_top_level_help_lists_commands(capsys):
    status, out, _ = run(capsys, "--help")
    assert status == 0
    assert "plan" in out and "route" in out and "--list-presets" in out


@pytest.mark.parametrize(
    "command, options",
    [
        (
            "plan",
            [
                "--preset",
                "--config",
                "--ep",
                "--dispatch",
                "--shared",
                "--slots",
                "--redundant",
                "--regime",
                "--placement",
                "--quant",
                "--json",
            ],
        ),
        (
            "route",
            ["--preset", "--config", "--tokens", "--seed", "--ep", "--repeat", "--scoring", "--placement", "--json"],
        ),
        ("run", ["--preset", "--ep", "--dispatch", "--tokens", "--quant", "--eplb", "--json"]),
    ],
)
def test_command_help_is_complete(capsys, command, options):
    status, out, _ = run(capsys, command, "--help")
    assert status == 0
    for option in options:
        assert option in out
    assert "deepseek-v3" in out


def test_missing_command(capsys):
    status, _, err = run(capsys)
    assert status == 2 and "a command is required" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["plan"],  # no model
        ["plan", "--preset", "mixtral-8x7b", "--ep", "0"],
        ["plan", "--preset", "mixtral-8x7b", "--dispatch", "deepep"],
        ["plan", "--preset", "a", "--config", "b"],  # mutually exclusive
        ["route", "--preset", "mixtral-8x7b"],  # --tokens required
        ["route", "--preset", "mixtral-8x7b", "--tokens", "-1"],
        ["bogus"],
        ["plan", "--preset", "mixtral-8x7b", "--ep", "two"],
        ["route", "--preset", "mixtral-8x7b", "--tokens", "4", "--scoring", "relu"],
        [],  # no command
    ],
)
def test_usage_errors_exit_2_with_one_line(capsys, argv):
    """argparse's errors too: one line, no usage block (``--help`` shows the usage)."""
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeroute") and ": error: " in lines[0], err
    assert "usage" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["warmup", "--cuda-arch", "sm9"], "argument --cuda-arch: arch 'sm9' is not of the form 'sm_XY'"),
        (["warmup", "--cuda-arch", "90"], "argument --cuda-arch: arch '90' is not of the form 'sm_XY'"),
        (["warmup", "--cuda-arch", "sm_90", "sm90"], "arch 'sm90' is not of the form 'sm_XY'"),
        (["warmup", "--presets", "nope"], "argument --presets: invalid choice: 'nope'"),
        (["warmup", "--dtypes", "float64"], "argument --dtypes: invalid choice: 'float64'"),
    ],
)
def test_warmup_checks_every_argument_before_any_work(capsys, monkeypatch, argv, message):
    """`warmup --cuda-arch sm9` used to run the whole CPU warm-up, then exit 1 with a
    traceback: now nothing runs, and one line says why."""
    from moeroute import runtime

    calls = []
    monkeypatch.setattr(runtime, "warmup", lambda *a, **k: calls.append("warmup"))
    monkeypatch.setattr(runtime, "warmup_cuda", lambda *a, **k: calls.append("warmup_cuda"))
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == "" and calls == []
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeroute warmup: error: ") and message in lines[0], err


def test_warmup_without_the_cuda_toolchain_stops_before_the_cpu_warmup(capsys, monkeypatch):
    from moeroute import runtime

    def missing():
        raise RuntimeError("compiling the device kernels needs numba-cuda and cuda.core")

    calls = []
    monkeypatch.setattr(runtime, "check_cuda_toolchain", missing)
    monkeypatch.setattr(runtime, "warmup", lambda *a, **k: calls.append("warmup"))
    status, out, err = run(capsys, "warmup", "--cuda-arch", "sm_90")
    assert status == 2 and out == "" and calls == []
    assert err.strip().splitlines() == [
        "moeroute warmup: error: compiling the device kernels needs numba-cuda and cuda.core"
    ]


# ----------------------------------------------------------------------------
# plan


@pytest.mark.parametrize(
    "name, ep", [("qwen3.5-moe", 8), ("deepseek-v3", 8), ("mixtral-8x7b", 1), ("qwen1.5-moe-a2.7b", 7)]
)
def test_plan_matches_layout(capsys, name, ep):
    status, out, err = run(capsys, "plan", "--preset", name, "--ep", str(ep))
    assert status == 0 and err == ""
    preset = PRESETS[name]
    layout = ExpertLayout(preset.router.num_experts, preset.num_shared_experts, ep, "none" if ep == 1 else "all2all")
    assert f"dispatch={'none' if ep == 1 else 'all2all'}" in out
    assert f"physical experts: {layout.num_physical_experts} " in out
    assert layout.shared_reason in out
    assert f"{preset.router.num_experts} experts, top_k {preset.router.top_k}" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"^  \d+ ", line)]
    assert len(rows) == ep
    for rank, row in enumerate(rows):
        emap = layout.expert_map(rank)
        held = np.flatnonzero(emap >= 0)
        assert row[0] == str(rank)
        assert int(row[3]) == layout.num_local_experts(rank) == held.size
        if layout.shared_slots == "per_rank":
            assert f"[{held[0]}, {held[-1] + 1})" == f"{row[1]} {row[2]}"


def test_plan_512_plus_1_on_8_ranks(capsys):
    status, out, _ = run(capsys, "plan", "--preset", "qwen3.5-moe", "--ep", "8")
    assert status == 0
    assert "physical experts: 520" in out
    for rank in range(8):
        assert re.search(rf"^  {rank}\s+\[{65 * rank}, {65 * rank + 65}\)\s+65\s", out, re.M)
    assert "shared slot weight: gate" in out
    assert "compatible" in out


def test_plan_global_slots_under_all2all_exit_2(capsys):
    status, out, err = run(capsys, "plan", "--preset", "deepseek-v3", "--ep", "8", "--slots", "global")
    assert status == 2 and out == ""
    assert "shared_slots='global' cannot be served by dispatch='all2all'" in err
    assert "per_rank" in err and "runner" in err


def test_plan_allgather_global_and_output_regime(capsys):
    status, out, _ = run(
        capsys,
        "plan",
        "--preset",
        "glm-4.5",
        "--ep",
        "4",
        "--dispatch",
        "allgather",
        "--slots",
        "global",
        "--regime",
        "output",
    )
    assert status == 0
    assert "physical experts: 161" in out and "home rank" in out
    assert "shared slot weight: 1 / 2.5" in out


def test_plan_explicit_runner_and_redundant(capsys):
    status, out, _ = run(
        capsys, "plan", "--preset", "deepseek-v3", "--ep", "8", "--shared", "runner", "--redundant", "1"
    )
    assert status == 0
    assert "physical experts: 257" in out
    assert "shared expert: runner" in out
    assert "P % E != 0: 257 routed physical experts over 8 ranks" in out


def test_plan_config_path_and_unfusable_shared(capsys, tmp_path):
    config = {
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5000,
        "num_experts": 60,
        "num_experts_per_tok": 4,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    status, out, _ = run(capsys, "plan", "--config", str(path), "--ep", "2")
    assert status == 0
    assert "shared expert: overlap" in out and "not a multiple" in out
    status, _, err = run(capsys, "plan", "--config", str(path), "--shared", "fused")
    assert status == 2
    assert "shared='fused' is impossible" in err and "5000 is not a multiple" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--preset", "gpt-4"], "unknown preset 'gpt-4'"),
        (["plan", "--preset", "mixtral-8x7b", "--ep", "9"], "leave a rank with no routed expert"),
        (["plan", "--preset", "mixtral-8x7b", "--ep", "2", "--dispatch", "none"], "dispatch='none'"),
        (["route", "--preset", "mixtral-8x7b", "--tokens", "4", "--ep", "9"], "no routed expert"),
    ],
)
def test_plan_and_route_value_errors_exit_2(capsys, argv, message):
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == ""
    assert message in err


def test_plan_missing_config_file(capsys, tmp_path):
    status, _, err = run(capsys, "plan", "--config", str(tmp_path / "nope.json"))
    assert status == 2 and "cannot read Hugging Face config" in err


# ----------------------------------------------------------------------------
# route


class RecordingRouter:
    """Plain top-k of (logits + bias), recording every call's ids."""

    def __init__(self):
        self.calls = 0
        self.ids = None

    def __call__(self, logits, config, correction_bias=None):
        self.calls += 1
        choice = logits if correction_bias is None else logits + correction_bias
        ids = np.argsort(-choice, axis=1, kind="stable")[:, : config.top_k].astype(np.int32)
        self.ids = ids
        return np.full(ids.shape, 1.0 / config.top_k, np.float32), ids


@pytest.mark.parametrize(
    "name, tokens, ep", [("deepseek-v3", 64, 8), ("mixtral-8x7b", 33, 3), ("qwen1.5-moe-a2.7b", 10, 1)]
)
def test_route_histograms_sum_to_t_times_k(capsys, monkeypatch, name, tokens, ep):
    router = RecordingRouter()
    monkeypatch.setattr(cli, "_load_select_experts", lambda: router)
    status, out, _ = run(
        capsys, "route", "--preset", name, "--tokens", str(tokens), "--ep", str(ep), "--repeat", "3", "--seed", "5"
    )
    assert status == 0
    top_k = PRESETS[name].router.top_k
    n = PRESETS[name].router.num_experts
    experts = histogram(out, "expert ")
    ranks = histogram(out, "rank ")
    assert len(experts) == n and len(ranks) == ep
    assert sum(experts.values()) == sum(ranks.values()) == tokens * top_k
    expected = np.bincount(router.ids.ravel(), minlength=n)
    assert [experts[f"expert {e}"] for e in range(n)] == expected.tolist()
    layout = ExpertLayout(n, ep_size=ep, dispatch="none" if ep == 1 else "all2all")
    for rank in range(ep):
        start, count = layout.routed_range(rank)
        assert ranks[f"rank {rank} experts [{start}, {start + count})"] == expected[start : start + count].sum()
    assert router.calls == 1 + 3
    assert re.search(r"median time per call: [\d.]+ ms over 3 calls", out)
    assert f"{tokens * top_k} assignments" in out


def test_route_is_seeded(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load_select_experts", RecordingRouter)
    outputs = []
    for seed in ("1", "1", "2"):
        _, out, _ = run(capsys, "route", "--preset", "mixtral-8x7b", "--tokens", "50", "--seed", seed, "--repeat", "1")
        outputs.append(histogram(out, "expert "))
    assert outputs[0] == outputs[1] != outputs[2]


def test_route_with_library_select_experts(capsys):
    status, out, _ = run(capsys, "route", "--preset", "deepseek-v3", "--tokens", "32", "--ep", "4", "--repeat", "1")
    assert status == 0
    assert sum(histogram(out, "expert ").values()) == 32 * 8
    assert sum(histogram(out, "rank ").values()) == 32 * 8
    assert "select_experts" in out


def test_route_zero_tokens(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load_select_experts", RecordingRouter)
    status, out, _ = run(capsys, "route", "--preset", "mixtral-8x7b", "--tokens", "0", "--repeat", "1")
    assert status == 0
    assert set(histogram(out, "expert ").values()) == {0}


# ----------------------------------------------------------------------------
# Extensibility and entry points

DEMO_MODULE = """
def add_arguments(parser):
    parser.add_argument("--answer", type=int, required=True, help="what to return")

def run(args):
    print("demo ran")
    return args.answer
"""


def test_new_command_is_loaded_lazily(capsys, monkeypatch, tmp_path):
    (tmp_path / "moeroute_cli_demo_ext.py").write_text(DEMO_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    commands = cli.COMMANDS + [cli.Command("extension", "an extension", "moeroute_cli_demo_ext")]
    monkeypatch.setattr(cli, "COMMANDS", commands)
    monkeypatch.delitem(sys.modules, "moeroute_cli_demo_ext", raising=False)

    status, out, _ = run(capsys, "--help")
    assert status == 0 and "extension" in out
    assert run(capsys, "plan", "--preset", "mixtral-8x7b")[0] == 0
    assert "moeroute_cli_demo_ext" not in sys.modules

    status, out, _ = run(capsys, "extension", "--answer", "7")
    assert (status, out) == (7, "demo ran\n")
    status, out, _ = run(capsys, "extension", "--help")
    assert status == 0 and "--answer" in out


def test_python_dash_m():
    result = subprocess.run(
        [sys.executable, "-m", "moeroute", "--list-presets"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert "deepseek-v3" in result.stdout
    result = subprocess.run(
        [sys.executable, "-m", "moeroute", "plan", "--preset", "kimi-k2", "--ep", "8", "--slots", "global"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "per_rank" in result.stderr


def test_demo_and_run_are_registered(capsys):
    status, out, _ = run(capsys, "demo", "--help")
    assert status == 0 and "--tokens" in out and "--device" in out
    status, out, _ = run(capsys, "run", "--help")
    assert status == 0 and "--ep" in out and "--dispatch" in out


# ----------------------------------------------------------------------------
# placement, scoring, gpt-oss


def test_plan_round_robin_placement(capsys):
    status, out, _ = run(capsys, "plan", "--preset", "gpt-oss-20b", "--ep", "4", "--placement", "round_robin")
    assert status == 0
    layout = ExpertLayout(32, ep_size=4, dispatch="all2all", placement="round_robin")
    assert layout.describe() in out
    assert "rank 1: 1, 5, 9, 13, 17, 21, 25, 29" in out


def test_route_round_robin_rank_load_and_scoring(capsys, monkeypatch):
    router = RecordingRouter()
    seen = []

    def recording(logits, config, correction_bias=None):
        seen.append(config.scoring)
        return router(logits, config, correction_bias)

    monkeypatch.setattr(cli, "_load_select_experts", lambda: recording)
    status, out, _ = run(
        capsys,
        "route",
        "--preset",
        "gpt-oss-20b",
        "--tokens",
        "40",
        "--ep",
        "4",
        "--placement",
        "round_robin",
        "--scoring",
        "none",
        "--repeat",
        "1",
    )
    assert status == 0 and set(seen) == {"none"}
    expected = np.bincount(router.ids.ravel(), minlength=32)
    ranks = histogram(out, "rank ")
    for rank in range(4):
        assert ranks[f"rank {rank} experts {rank}, {rank + 4}, ..."] == expected[rank::4].sum()
    assert "round_robin placement" in out


def test_route_with_library_sqrtsoftplus(capsys):
    status, out, _ = run(
        capsys, "route", "--preset", "deepseek-v3", "--tokens", "16", "--scoring", "sqrtsoftplus", "--repeat", "1"
    )
    assert status == 0 and "sqrtsoftplus" in out


def test_list_presets_names_activation(capsys):
    status, out, _ = run(capsys, "--list-presets")
    line = next(line for line in out.splitlines() if line.startswith("gpt-oss-120b"))
    assert "swigluoai+biases" in line.split() and " 128 " in line


# bad input: exit 2, one clear line, no traceback, nothing allocated


def _zero_intermediate_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({"model_type": "qwen2_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 0})
    )
    return str(path)


BAD_INPUT = {
    # name: (argv, text of the error line)
    "route-negative-seed": (
        ["route", "--preset", "mixtral-8x7b", "--tokens", "4", "--seed", "-1"],
        "argument --seed: -1 must be an integer >= 0",
    ),
    "route-huge-tokens": (
        ["route", "--preset", "mixtral-8x7b", "--tokens", "1000000000000"],
        "routing --tokens 1000000000000 over 8 experts needs about",
    ),
    "plan-zero-intermediate": (["plan", "--config", "{zero}"], "moe_intermediate_size=0 must be an integer >= 1"),
    "route-zero-intermediate": (
        ["route", "--config", "{zero}", "--tokens", "4"],
        "moe_intermediate_size=0 must be an integer >= 1",
    ),
    "plan-huge-layout": (
        ["plan", "--preset", "mixtral-8x7b", "--redundant", "100000000000000"],
        "physical experts on --ep 1 ranks needs about",
    ),
    "run-negative-seed": (
        ["run", "--preset", "mixtral-8x7b", "--tokens", "4", "--seed", "-3"],
        "argument --seed: -3 must be an integer >= 0",
    ),
    "run-huge-tokens": (
        ["run", "--preset", "mixtral-8x7b", "--tokens", "1000000000000"],
        "--ep 2 ranks of --tokens 1000000000000",
    ),
    "plan-zero-ep": (["plan", "--preset", "mixtral-8x7b", "--ep", "0"], "argument --ep: 0 must be an integer >= 1"),
    "warmup-bad-arch": (["warmup", "--cuda-arch", "sm9"], "arch 'sm9' is not of the form 'sm_XY'"),
    "warmup-bad-preset": (["warmup", "--presets", "nope"], "invalid choice: 'nope'"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUT))
def test_bad_input_exits_2_with_one_clear_line(tmp_path, name):
    argv, message = BAD_INPUT[name]
    argv = [arg.replace("{zero}", _zero_intermediate_config(tmp_path)) for arg in argv]
    result = subprocess.run([sys.executable, "-m", "moeroute", *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_sizes_beyond_memory_are_refused_before_allocating(capsys, monkeypatch):
    """The estimate is compared with the machine's memory before any array exists."""
    monkeypatch.setattr(_args, "physical_memory_bytes", lambda: 10_000)  # where the check reads it
    allocations = []
    monkeypatch.setattr(np.random, "default_rng", lambda *a: allocations.append(a))
    assert cli.check_fits_in_memory("x", 10_000) is None  # the bound is inclusive
    # 209 tokens x (8 logits x 4 bytes + 2 picks x 8 bytes) = 10032 bytes > 10000.
    status, out, err = run(capsys, "route", "--preset", "mixtral-8x7b", "--tokens", "209")
    assert status == 2 and out == "" and allocations == []
    assert "needs about 1e+04 bytes, more than this machine's 1e+04 bytes" in err


# ----------------------------------------------------------------------------
# --json: one object on stdout, the same values as the text and the API


def run_json(capsys, *argv):
    status, out, err = run(capsys, *argv, "--json")
    assert status == 0 and err == ""
    assert len(out.strip().splitlines()) == 1  # one object, one line
    return json.loads(out)


@pytest.mark.parametrize(
    "argv",
    [
        ["--preset", "deepseek-v3", "--ep", "4", "--quant", "fp8_block"],
        ["--preset", "qwen3-30b-a3b", "--ep", "2", "--quant", "int4"],
        ["--preset", "glm-4.5", "--ep", "4", "--dispatch", "allgather", "--slots", "global", "--regime", "output"],
        ["--preset", "gpt-oss-20b", "--ep", "4", "--placement", "round_robin"],
        ["--preset", "deepseek-v3", "--ep", "8", "--shared", "runner", "--redundant", "8"],
        ["--preset", "mixtral-8x7b"],
    ],
)
def test_plan_json_matches_the_layout_and_the_text(capsys, argv):
    plan = run_json(capsys, "plan", *argv)
    options = dict(zip(argv[::2], argv[1::2]))
    preset = PRESETS[options["--preset"]]
    ep = int(options.get("--ep", 1))
    layout = ExpertLayout(
        preset.router.num_experts,
        preset.num_shared_experts,
        ep,
        options.get("--dispatch", "none" if ep == 1 else "all2all"),
        options.get("--shared", "auto"),
        options.get("--slots"),
        int(options.get("--redundant", 0)),
        scaling_regime=options.get("--regime", "router"),
        placement=options.get("--placement", "linear"),
    )
    router = preset.router
    assert plan["model"]["name"] == preset.name
    assert (plan["model"]["num_experts"], plan["model"]["top_k"], plan["model"]["scoring"]) == (
        router.num_experts,
        router.top_k,
        router.scoring,
    )
    assert plan["model"]["routed_scaling_factor"] == router.routed_scaling_factor
    assert plan["model"]["correction_bias"] == preset.has_correction_bias
    assert plan["layout"] == {
        "num_routed_experts": router.num_experts,
        "num_shared_experts": preset.num_shared_experts,
        "num_redundant_experts": int(options.get("--redundant", 0)),
        "ep_size": ep,
        "dispatch": layout.dispatch,
        "placement": layout.placement,
        "num_physical_experts": layout.num_physical_experts,
        "shared": layout.shared,
        "shared_reason": layout.shared_reason,
        "shared_slots": layout.shared_slots,
        "scaling_regime": layout.scaling_regime,
        "equal_block_problems": list(layout.check_backend("equal_blocks")),
    }
    assert [r["rank"] for r in plan["ranks"]] == list(range(ep))
    for rank, row in enumerate(plan["ranks"]):
        expert_map = layout.expert_map(rank)
        local_to_physical = np.full(layout.num_local_experts(rank), -1)
        for physical, local in enumerate(expert_map):  # invert the map by hand
            if local >= 0:
                local_to_physical[local] = physical
        assert row["local_to_physical"] == local_to_physical.tolist()
        assert row["num_local_experts"] == layout.num_local_experts(rank) == len(row["local_to_physical"])
        assert row["logical_experts"] == layout.logical_experts(rank).tolist()
        assert row["shared_slot_ids"] == layout.shared_slot_ids(rank).tolist()
    # The text path prints the same facts.
    status, text, _ = run(capsys, "plan", *argv)
    assert status == 0
    assert f"physical experts: {plan['layout']['num_physical_experts']} " in text
    assert layout.describe() in text
    if plan["shared_slot_weight"] is None:
        assert "shared slot weight" not in text
    else:
        assert f"shared slot weight: {plan['shared_slot_weight']}\n" in text
    if "--quant" not in options:
        assert plan["expert_bytes"] is None
        return
    assert plan["expert_bytes"]["format"] == options["--quant"]
    hidden, inter = preset.hidden_size, preset.moe_intermediate_size
    for rank, row in enumerate(plan["expert_bytes"]["ranks"]):
        local = layout.num_local_experts(rank)
        assert (row["rank"], row["num_local_experts"]) == (rank, local)
        assert row["bfloat16_bytes"] == local * 3 * hidden * inter * 2  # gate, up, down; 2 bytes each
        assert row["bytes"] < row["bfloat16_bytes"]
        if options["--quant"] == "int4":  # half a byte a weight, a bfloat16 scale per 128 (symmetric)
            assert row["bytes"] == local * (3 * hidden * inter // 2 + 3 * hidden * inter // 128 * 2)
        assert (
            f"rank {rank}: {local} experts, {row['bytes'] / 2**30:.2f} GiB {options['--quant']} "
            f"({row['bfloat16_bytes'] / 2**30:.2f} GiB bfloat16)"
        ) in text


def test_plan_json_shared_slot_weight_and_errors(capsys):
    assert run_json(capsys, "plan", "--preset", "qwen3.5-moe", "--ep", "8")["shared_slot_weight"] == "gate"
    glm = run_json(capsys, "plan", "--preset", "glm-4.5", "--ep", "4", "--regime", "output")
    assert glm["shared_slot_weight"] == "1 / 2.5"
    status, out, err = run(capsys, "plan", "--preset", "deepseek-v3", "--ep", "8", "--slots", "global", "--json")
    assert status == 2 and out == "" and "per_rank" in err  # errors stay one line on stderr
    status, out, err = run(capsys, "plan", "--preset", "gpt-oss-20b", "--quant", "int4")
    assert (status, out) == (2, "")
    assert err.splitlines() == [
        "moeroute: error: hidden_size=2880 is not a multiple of group_size=128, which format='int4' needs "
        "(one scale per 128 input columns)"
    ]


@pytest.mark.parametrize(
    "name, tokens, ep, placement",
    [("deepseek-v3", 64, 8, "linear"), ("gpt-oss-20b", 40, 4, "round_robin"), ("mixtral-8x7b", 0, 1, "linear")],
)
def test_route_json_loads_match_the_router_and_the_text(capsys, monkeypatch, name, tokens, ep, placement):
    router = RecordingRouter()
    monkeypatch.setattr(cli, "_load_select_experts", lambda: router)
    argv = [
        "route",
        "--preset",
        name,
        "--tokens",
        str(tokens),
        "--ep",
        str(ep),
        "--repeat",
        "2",
        "--seed",
        "3",
        "--placement",
        placement,
    ]
    result = run_json(capsys, *argv)
    config = PRESETS[name].router
    expected = np.bincount(router.ids.ravel(), minlength=config.num_experts)
    assert result["expert_load"] == expected.tolist()
    assert result["assignments"] == tokens * config.top_k
    layout = ExpertLayout(
        config.num_experts, ep_size=ep, dispatch="none" if ep == 1 else "all2all", placement=placement
    )
    logical = [layout.logical_experts(rank).tolist() for rank in range(ep)]
    assert result["rank_logical_experts"] == logical
    assert result["rank_load"] == [int(expected[experts].sum()) for experts in logical]
    mean = tokens * config.top_k / config.num_experts
    if tokens:
        assert result["expert_load_max_over_mean"] == pytest.approx(expected.max() / mean)
        rank_mean = tokens * config.top_k / ep
        assert result["rank_load_max_over_mean"] == pytest.approx(max(result["rank_load"]) / rank_mean)
    else:
        assert result["expert_load_max_over_mean"] is None and result["rank_load_max_over_mean"] is None
    assert (result["tokens"], result["seed"], result["ep_size"], result["placement"], result["repeat"]) == (
        tokens,
        3,
        ep,
        placement,
        2,
    )
    assert result["model"]["name"] == name and router.calls == 1 + 2
    assert result["first_call_ms"] >= 0 and result["median_call_ms"] >= 0
    # The text path routes the same logits to the same load.
    status, text, _ = run(capsys, *argv)
    assert status == 0
    experts = histogram(text, "expert ")
    assert [experts[f"expert {e}"] for e in range(config.num_experts)] == result["expert_load"]
    assert list(histogram(text, "rank ").values()) == result["rank_load"]


def test_route_json_with_the_library_equals_select_experts(capsys):
    from moeroute.routing import select_experts

    result = run_json(
        capsys, "route", "--preset", "deepseek-v3", "--tokens", "32", "--ep", "4", "--repeat", "1", "--seed", "7"
    )
    assert result["select_experts"].endswith(".select_experts")
    # The CLI's logits and bias, drawn from the seed as it draws them.
    preset = PRESETS["deepseek-v3"]
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((32, 256), dtype=np.float32)
    bias = cli.CORRECTION_BIAS_SCALE * rng.standard_normal(256, dtype=np.float32)
    _, ids = select_experts(logits, preset.router, bias)
    assert result["expert_load"] == np.bincount(np.asarray(ids).ravel(), minlength=256).tolist()
    load = np.bincount(np.asarray(ids).ravel(), minlength=256)
    assert result["rank_load"] == [int(load[64 * r : 64 * r + 64].sum()) for r in range(4)]  # 64 experts a rank
