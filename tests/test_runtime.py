"""moeroute.warmup and ``moeroute warmup``: the CPU kernels compiled into Numba's cache.

The cache test runs the command line in a fresh process with an empty ``NUMBA_CACHE_DIR``,
then a second fresh process that runs a patched tiny model: every moeroute kernel that
forward needs must come from the cache (Numba's own hit and compile counters, not
seconds), and the patched model must still match the unpatched one.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import moeroute
from moeroute import runtime

ROOT = Path(__file__).resolve().parents[1]

FORWARD_AFTER_WARMUP = textwrap.dedent("""
    import json
    import numpy as np
    import torch
    from numba.core import event
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import moeroute
    from moeroute.bindings.torch import replace_moe_blocks
    from moeroute.runtime import cpu_dispatchers

    compiled = []

    class Record(event.Listener):
        def on_start(self, ev):
            compiled.append(ev.data["dispatcher"].py_func.__module__ + "." +
                            ev.data["dispatcher"].py_func.__qualname__)

        def on_end(self, ev):
            pass

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=True, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = model(ids).logits
    replace_moe_blocks(model)
    with event.install_listener("numba:compile", Record()):
        with torch.inference_mode():
            actual = model(ids).logits
        warm = [c for c in compiled if c.startswith("moeroute.")]
        # A dtype the warm-up was not asked for compiles: the counter works.
        from moeroute.routing.combine import accumulate_rows
        accumulate_rows(np.zeros((2, 4), np.float32), np.ones((2, 4), np.float16),
                        np.arange(2), np.ones(2, np.float32))
    cold = [c for c in compiled if c.startswith("moeroute.")][len(warm):]
    hits = sum(sum(d.stats.cache_hits.values()) for d in cpu_dispatchers())
    error = float((actual - expected).abs().max() / expected.abs().max())
    print(json.dumps({"compiled_in_forward": warm, "compiled_after": cold, "cache_hits": hits,
                      "relative_error": error, "cache_dir": moeroute.runtime.cache_dir()}))
""")


def _run(args, cache_dir, timeout=1800):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_warmup_cache_serves_a_fresh_process(tmp_path):
    pytest.importorskip("transformers")
    cache = tmp_path / "numba-cache"
    warm = _run(["-m", "moeroute", "warmup", "--presets", "qwen3-30b-a3b", "--dtypes", "float32"], cache)
    assert "warmup [1/" in warm.stderr  # progress lines
    assert str(cache) in warm.stdout
    index_files = list(cache.rglob("*.nbi"))
    assert index_files, "warm-up wrote no cache index"
    assert all(str(path).startswith(str(cache)) for path in index_files)

    report = json.loads(_run(["-c", FORWARD_AFTER_WARMUP], cache).stdout.strip().splitlines()[-1])
    assert report["compiled_in_forward"] == []
    assert report["cache_hits"] > 0
    assert report["compiled_after"], "the compile counter saw nothing: it cannot tell"
    assert report["cache_dir"].startswith(str(cache))
    assert report["relative_error"] < 1e-5


def test_warmup_is_public():
    assert "warmup" in moeroute.__all__
    assert moeroute.warmup is runtime.warmup


@pytest.mark.parametrize(
    "presets, dtypes, error, match",
    [
        (["no-such-model"], ("float32",), ValueError, "presets=.*no-such-model"),
        ([], ("float32",), ValueError, "at least one"),
        ("deepseek-v3", ("float32",), TypeError, "sequence of preset names"),
        (None, ("float64",), ValueError, "dtypes=.*float64.*bfloat16"),
        (None, "float32", TypeError, "sequence of dtype names"),
    ],
)
def test_warmup_rejects_bad_arguments(presets, dtypes, error, match):
    with pytest.raises(error, match=match):
        runtime.warmup(presets, dtypes=dtypes, progress=False)


def test_cache_dir_is_where_numba_writes():
    from moeroute.routing import select

    assert runtime.cache_dir() == str(select._select_rows._cache._cache_path)
    assert os.path.isabs(runtime.cache_dir())


def test_cpu_dispatchers_cover_the_kernels():
    import importlib

    select, combine, permute = (
        importlib.import_module(f"moeroute.routing.{name}") for name in ("select", "combine", "permute")
    )
    names = {d.py_func.__module__ + "." + d.py_func.__name__ for d in runtime.cpu_dispatchers()}
    for function in (select._select_rows, select._select_parallel, combine._accumulate_cpu, permute._gather_rows):
        assert function.py_func.__module__ + "." + function.py_func.__name__ in names


def test_warmup_families_default_to_the_float_path():
    """The quantized experts compile on first use, or when asked for; float16 likewise."""
    assert runtime.warmup_families() == [
        "routing kernels, float32 logits",
        "dispatch kernels, float32",
        "float experts, float32",
    ]
    assert runtime.warmup_families(dtypes=["float32", "bfloat16"]) == [
        "routing kernels, float32 logits",
        "routing kernels, float16/bfloat16 logits",
        "dispatch kernels, float32",
        "dispatch kernels, bfloat16",
        "float experts, float32",
        "float experts, bfloat16",
    ]
    assert runtime.warmup_families(["qwen3-30b-a3b"], dtypes=["bfloat16"], formats=("fp8_block", "mxfp4", "int4")) == [
        "routing kernels, float16/bfloat16 logits",
        "dispatch kernels, bfloat16",
        "fp8_block experts, bfloat16",
        "mxfp4 experts, bfloat16",
        "int4 experts, bfloat16",
    ]
    assert runtime.warmup_families(dtypes=["float16"], torch_module=False) == [
        "routing kernels, float16/bfloat16 logits",
        "dispatch kernels, float16",
    ]


@pytest.mark.parametrize(
    "formats, error, match",
    [
        (
            ("fp8",),
            ValueError,
            r"formats=\('fp8',\): 'fp8' is not a format; each must be one of "
            r"\('float', 'fp8_block', 'fp8_tensor', 'mxfp4', 'int4'\)",
        ),
        (("float", "int8"), ValueError, "'int8' is not a format"),
        ("mxfp4", TypeError, "formats must be a sequence of format names"),
        (None, TypeError, "formats must be a sequence of format names"),
    ],
)
def test_warmup_rejects_bad_formats(formats, error, match):
    with pytest.raises(error, match=match):
        runtime.warmup_families(formats=formats)
    with pytest.raises(error, match=match):
        runtime.warmup(formats=formats, progress=False)


def test_warmup_refuses_quantized_formats_without_the_torch_module():
    with pytest.raises(ValueError, match="formats=.*mxfp4.*needs the torch module"):
        runtime.warmup(formats=("mxfp4",), torch_module=False, progress=False)
    with pytest.raises(ValueError, match="formats=.*fp8_block.*needs the torch module"):
        runtime.warmup_families(formats=("float", "fp8_block"), torch_module=False)
    with pytest.raises(ValueError, match="formats=.*int4.*needs the torch module"):
        runtime.warmup(formats=("int4",), torch_module=False, progress=False)


def test_warmup_runs_the_int4_family(monkeypatch):
    """The INT4 experts' forward is a family of its own, run with its progress line."""
    from moeroute.experts import modules

    calls = []
    forward = modules.int4_experts_forward
    monkeypatch.setattr(modules, "int4_experts_forward", lambda *a, **k: calls.append(a[0].shape) or forward(*a, **k))
    monkeypatch.setattr(runtime, "_routing_steps", lambda presets, dtypes: [])
    lines = []
    result = runtime.warmup(["qwen3-30b-a3b"], formats=("int4",), progress=lines.append)
    assert [family["name"] for family in result["families"]] == ["int4 experts, float32"]
    assert lines[0].startswith("warmup [1/1] int4 experts, float32: ") and lines[0].endswith(" functions compiled")
    assert calls, "the int4 family ran no INT4 expert forward"


def test_warmup_prints_one_progress_line_per_family(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(
        runtime, "_steps", lambda *args: [(name, lambda n=name: ran.append(n)) for name in ("family one", "family two")]
    )
    result = runtime.warmup(["qwen3-30b-a3b"])
    err = capsys.readouterr().err.splitlines()
    assert ran == ["family one", "family two"]
    assert [line.split(":")[0] for line in err] == [
        "warmup [1/2] family one",
        "warmup [2/2] family two",
        "warmup done in 0.0 s",
    ]
    assert all("0 functions compiled" in line for line in err)
    assert [family["name"] for family in result["families"]] == ["family one", "family two"]
    assert result["steps"] == 2 and result["compiled"] == 0

    lines = []
    runtime.warmup(["qwen3-30b-a3b"], progress=lines.append)  # a callable gets the lines instead
    assert capsys.readouterr().err == ""
    assert [line.split(":")[0] for line in lines] == [
        "warmup [1/2] family one",
        "warmup [2/2] family two",
        "warmup done in 0.0 s",
    ]
    runtime.warmup(["qwen3-30b-a3b"], progress=False)
    assert capsys.readouterr().err == ""
    with pytest.raises(TypeError, match="progress must be True, False or a callable"):
        runtime.warmup(["qwen3-30b-a3b"], progress="yes")


def test_warmup_command_passes_formats_and_checks_them_first(monkeypatch, capsys):
    from moeroute import cli

    calls = []
    monkeypatch.setattr(
        runtime,
        "warmup",
        lambda *a, **k: calls.append(k) or {"compiled": 0, "loaded": 0, "seconds": 0.0, "cache_dir": "x"},
    )
    assert cli.main(["warmup", "--presets", "deepseek-v3", "--formats", "float", "mxfp4", "--quiet"]) == 0
    assert calls[-1]["formats"] == ["float", "mxfp4"] and calls[-1]["dtypes"] == ["float32"]
    assert cli.main(["warmup", "--formats", "int4", "--quiet"]) == 0
    assert calls[-1]["formats"] == ["int4"]
    calls.clear()
    assert cli.main(["warmup", "--formats", "mxfp4", "--no-torch"]) == 2
    assert calls == []
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "moeroute warmup: error: --formats with a quantized format needs the torch module's forward; drop --no-torch"
    ]
    assert cli.main(["warmup", "--formats", "fp8"]) == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
