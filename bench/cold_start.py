"""Cold start: what compiling the CPU kernels costs, per kernel family, with an empty cache.

Each measurement runs in a fresh process with its own ``NUMBA_CACHE_DIR`` (a temporary
directory), so nothing comes from an earlier run:

* ``warmup`` cold: `moeroute.warmup` with the given arguments into an empty cache; each
  family's seconds (wall and this process's CPU) and the functions it compiled. Families run
  in warmup's order in one process, so a family's figure is what it adds to those before it
  (the float experts reuse the routing kernels compiled just before).
* ``warmup`` warm: the same call in a second process on that cache (loads only).
* each quantized format (``--formats``): `warmup(formats=(fmt,))` in a fresh process on a
  fresh copy of the warm float cache, so its own families are the only cold ones.
* first forward: a patched tiny Qwen3-MoE and DeepSeek-V3 causal LM (float32, 9 tokens) in a
  fresh process on the warm cache (what a user's first forward costs after `moeroute warmup`),
  and with ``--cold-forward`` on an empty cache as well (what it costs without).

CPU seconds are reported beside wall seconds because compiling is single-threaded: on a
machine shared with other work, CPU seconds stay near what the same compile takes alone
while wall seconds grow with the load; the load average at the start and end is recorded.

Usage: python bench/cold_start.py [--presets P ...] [--dtypes D ...] [--formats F ...]
                                  [--cold-forward] [--out NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

#: The child: warmup with the JSON arguments, one JSON line with its families and CPU seconds.
WARMUP_CHILD = """
import json, sys, time
wall, cpu = time.perf_counter(), time.process_time()
import torch
import moeroute
from moeroute import runtime
imported = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
cpu_marks = []
def progress(line):
    cpu_marks.append(time.process_time())
    print(line, file=sys.stderr, flush=True)
kwargs = json.loads(sys.argv[1])
start_cpu = time.process_time()
result = runtime.warmup(**kwargs, progress=progress)
previous = start_cpu
for family, mark in zip(result["families"], cpu_marks):
    family["cpu_seconds"], previous = mark - previous, mark
result["cpu_seconds"] = time.process_time() - start_cpu
result["import"] = imported
print(json.dumps(result))
"""

#: The child: patched tiny models' first (and second) forward, and what they compiled.
FORWARD_CHILD = """
import json, sys, time
import torch
from numba.core import event
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
import moeroute
from moeroute.bindings.torch import replace_moe_blocks

compiled = []

class Record(event.Listener):
    def on_start(self, ev):
        pass

    def on_end(self, ev):
        func = ev.data["dispatcher"].py_func
        if func.__module__.startswith("moeroute"):
            compiled.append(func.__module__ + "." + func.__qualname__)

models = {
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64)),
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        max_position_embeddings=64)),
}
report = {}
with event.install_listener("numba:compile", Record()):
    for name in sys.argv[1].split(","):
        torch.manual_seed(0)
        model = models[name]().eval()
        replace_moe_blocks(model)
        ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
        before = len(compiled)
        times = []
        for _ in range(2):
            wall, cpu = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                model(ids)
            times.append({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu})
        report[name] = {"first_forward": times[0], "second_forward": times[1],
                        "compiled": compiled[before:]}
print(json.dumps(report))
"""


def _child(code: str, argument: str, cache: Path, timeout: float) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    wall = time.perf_counter()
    # stderr passes through: warmup's progress lines appear as each family finishes.
    done = subprocess.run(
        [sys.executable, "-c", code, argument], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"child failed ({done.returncode}); its stderr is above")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_wall_seconds"] = time.perf_counter() - wall
    return result


def cpu_info() -> dict:
    """CPU model and the ISA flags the kernels care about (Linux /proc/cpuinfo; else platform)."""
    info = {"model": platform.processor() or platform.machine(), "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            info["model"] = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            info["flags"] = sorted(f for f in flags if f.startswith(("avx", "fma", "amx", "sse4")))
            break
    return info


def load() -> list:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=None)
    parser.add_argument("--dtypes", nargs="+", default=None, help="default: warmup's")
    parser.add_argument(
        "--formats",
        nargs="*",
        default=["fp8_block", "fp8_tensor", "mxfp4"],
        help="quantized formats measured one at a time on top of the float cache",
    )
    parser.add_argument("--models", default="qwen3_moe,deepseek_v3")
    parser.add_argument(
        "--cold-forward",
        action="store_true",
        help="also time the first forward on an empty cache (compiles what it uses)",
    )
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default="cold_start")
    args = parser.parse_args(argv)

    kwargs = {"presets": args.presets}
    if args.dtypes:
        kwargs["dtypes"] = args.dtypes
    sys.path.insert(0, str(ROOT))
    from moeroute.cpu_features import cpu_isa

    payload = {"cpu": dict(cpu_info(), isa_path=cpu_isa()), "load_average_start": load(), "warmup_arguments": kwargs}
    work = Path(tempfile.mkdtemp(prefix="moeroute-cold-"))
    try:
        cache = work / "float"
        payload["warmup_cold"] = _child(WARMUP_CHILD, json.dumps(kwargs), cache, args.timeout)
        payload["warmup_warm"] = _child(WARMUP_CHILD, json.dumps(kwargs), cache, args.timeout)
        payload["first_forward_after_warmup"] = _child(FORWARD_CHILD, args.models, cache, args.timeout)
        for quant_format in args.formats:
            copy = work / quant_format
            shutil.copytree(cache, copy)
            quant_kwargs = dict(kwargs, formats=[quant_format])
            payload[f"warmup_{quant_format}_cold"] = _child(WARMUP_CHILD, json.dumps(quant_kwargs), copy, args.timeout)
        if args.cold_forward:
            payload["first_forward_cold"] = _child(FORWARD_CHILD, args.models, work / "empty", args.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    payload["load_average_end"] = load()
    path = write_results(args.out, payload)
    rows = []
    for key in [k for k in payload if k.startswith("warmup_") and k != "warmup_arguments"]:
        for family in payload[key]["families"]:
            rows.append(
                (key, family["name"], round(family["seconds"], 1), round(family["cpu_seconds"], 1), family["compiled"])
            )
    for row in rows:
        print("  ".join(str(v) for v in row))
    for key in ("first_forward_after_warmup", "first_forward_cold"):
        for name in args.models.split(",") if key in payload else ():
            report = payload[key][name]
            print(
                f"{key}, {name}: {report['first_forward']['wall']:.2f} s wall, "
                f"{report['first_forward']['cpu']:.2f} s CPU, {len(report['compiled'])} functions compiled"
            )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
