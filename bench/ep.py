"""Expert parallelism on gloo: bytes per forward, dispatch + combine time, overlap.

Four spawned CPU ranks (gloo, one torch and one Numba thread each) route random tokens
with real presets and measure:

* bytes: what `moeroute.bindings.ep` sends per forward against (a) the minimum, the
  unique (token, other rank) pairs x H x element size (the ids and weights that travel with
  the rows are reported separately), and (b) a naive exchange of one row per
  (token, expert slot) held on another rank;
* time of dispatch + combine: the all2all dispatcher against that naive per-slot
  exchange (also on gloo, written here), and allgather against all2all; and the
  allgather combine (one exact all_to_all_single) against an all-reduce of the padded
  partials;
* overlap: the MoE layer with shared="runner" against shared="overlap" (same weights),
  and the shared MLP alone; the hidden fraction is (runner - overlap) / shared MLP;
* FP8 dispatch: the same tokens dispatched as bfloat16 rows and as e4m3 rows with their
  float32 scales per group of 128 (``MoE(dispatch_dtype="fp8")``'s payload), both modes:
  the token bytes (and dispatch bytes with the metadata) from TransferStats, their ratio,
  and the time of dispatch + combine, each up to the FP8 experts' first GEMM input (the
  receiver quantizes bfloat16 rows; the sender quantizes FP8 rows, the receiver decodes).

Timing pairs run interleaved in one process per rank (bench/_common.interleaved: the
order alternates, the figure is the median of per-pair ratios); the JSON holds every
rank's figures. Run: ``python bench/ep.py [--quick] [--only fp8]``; writes
bench/results/ep.json (``--only fp8``: bench/results/ep_fp8.json).
"""

from __future__ import annotations

import os

# Four ranks share this machine's cores: one compute thread per rank. Set before Numba
# and torch are imported, here and in every spawned rank (which re-imports this file).
os.environ.setdefault("NUMBA_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import interleaved, median_time, print_table, write_results  # noqa: E402

from moeroute.bindings.ep import METADATA_BYTES_PER_SLOT, make_dispatcher  # noqa: E402
from moeroute.bindings.torch import arrays  # noqa: E402
from moeroute.experts.formats.fp8 import fake_quantize, quantize_for_dispatch  # noqa: E402
from moeroute.bindings.torch.mlp import GatedMLP  # noqa: E402
from moeroute.config import get_preset  # noqa: E402
from moeroute.layout import ExpertLayout  # noqa: E402
from moeroute.quant import QuantConfig  # noqa: E402

WORLD_SIZE = 4
#: Tokens per rank and hidden size of the byte and communication runs: a decode/prefill
#: mix of a real layer's row size (bf16 rows of 2 KiB).
TOKENS, HIDDEN, DTYPE = 256, 1024, torch.bfloat16
#: Presets of the byte figures: grouped routing (DeepSeek-V3) and plain top-8 (Qwen3).
BYTE_PRESETS = ("deepseek-v3", "qwen3-30b-a3b", "qwen3.5-moe")
#: The overlap layer: Qwen3.5-like (gated shared expert) at a CPU-friendly size.
OVERLAP = dict(experts=64, top_k=8, hidden=1024, intermediate=256, tokens=256)
REPEATS, QUICK_REPEATS = 21, 5
#: Scale of the random correction bias (selection only), small next to sigmoid scores.
CORRECTION_BIAS_SCALE = 0.01
PROCESS_GROUP_TIMEOUT_S = 300


# --------------------------------------------------------------------------- routing


def route(preset_name, layout, rank, tokens, seed):
    """This rank's weights and physical ids [T, K'] int32, routed by moeroute."""
    preset = get_preset(preset_name)
    gen = torch.Generator().manual_seed(seed + rank)
    logits = torch.randn(tokens, preset.router.num_experts, generator=gen)
    bias = None
    if preset.has_correction_bias:
        bias = torch.randn(preset.router.num_experts, generator=gen) * CORRECTION_BIAS_SCALE
    weights, ids = arrays.select_experts(logits, preset.router, bias)
    weights, ids = arrays.append_shared_slots(weights, ids, layout, rank, None)
    return weights, ids


def layout_for(preset_name, dispatch):
    preset = get_preset(preset_name)
    return ExpertLayout(preset.router.num_experts, preset.num_shared_experts, ep_size=WORLD_SIZE, dispatch=dispatch)


def unique_pairs_and_slots(ids, layout, rank):
    """(unique (token, other rank) pairs, (token, slot) entries held on another rank)."""
    owner = layout.owner_rank[ids.numpy()]  # ids here are all valid physical ids
    other = owner != rank
    pairs = sum(len(set(row[mask].tolist())) for row, mask in zip(owner, other))
    return pairs, int(other.sum())


# --------------------------------------------------------------------------- naive baseline


class NaiveSlotExchange:
    """One row per (token, slot) to the slot's rank, the per-expert exchange a naive EP
    layer does; combine sends each weighted row back and sums it at home."""

    def __init__(self, layout, rank):
        self.layout, self.rank = layout, rank
        self.owner = torch.from_numpy(layout.owner_rank.astype(np.int64))
        self.local = torch.from_numpy(layout.expert_map(rank).astype(np.int64))

    def dispatch_combine(self, x, weights, ids):
        num_tokens, top_k = ids.shape
        flat = ids.reshape(-1).long()
        dest = self.owner[flat]
        order = torch.argsort(dest, stable=True)
        token = order // top_k
        send_counts = torch.bincount(dest, minlength=WORLD_SIZE)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = x.index_select(0, token)
        meta = torch.stack([flat[order].to(torch.int32), weights.reshape(-1)[order].view(torch.int32)], dim=1)
        recv_rows = x.new_empty((sum(recv), x.shape[1]))
        recv_meta = meta.new_empty((sum(recv), 2))
        dist.all_to_all_single(recv_rows, rows, recv, send)
        dist.all_to_all_single(recv_meta, meta, recv, send)
        _ = self.local[recv_meta[:, 0].long()]  # the receiver's local ids
        partial = recv_rows  # an identity expert: the figure is the communication
        back = partial.new_empty(rows.shape)
        dist.all_to_all_single(back, partial, send, recv)
        out = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32)
        out.index_add_(0, token, back.float())
        return out.to(x.dtype)


def library_dispatch_combine(dispatcher, x, weights, ids):
    handle = dispatcher.dispatch(x, weights, ids)
    recv_hidden = handle.wait()[0]
    return dispatcher.combine(recv_hidden, handle)  # identity expert, as the baseline


# --------------------------------------------------------------------------- one rank


def byte_figures(rank):
    figures = {}
    for preset_name in BYTE_PRESETS:
        per_dispatch = {}
        for dispatch in ("all2all", "allgather"):
            layout = layout_for(preset_name, dispatch)
            weights, ids = route(preset_name, layout, rank, TOKENS, seed=1)
            x = torch.randn(TOKENS, HIDDEN).to(DTYPE)
            dispatcher = make_dispatcher(layout, None, dispatch, debug=True)
            library_dispatch_combine(dispatcher, x, weights, ids)
            stats = dispatcher.last_stats
            pairs, slots = unique_pairs_and_slots(ids, layout, rank)
            element = x.element_size()
            minimum = pairs * HIDDEN * element
            naive = slots * HIDDEN * element
            per_dispatch[dispatch] = dict(
                top_k_with_shared=ids.shape[1],
                unique_token_rank_pairs=pairs,
                slots_on_other_ranks=slots,
                hidden_bytes=stats.hidden_bytes,
                metadata_bytes=stats.metadata_bytes,
                count_bytes=stats.count_bytes,
                combine_bytes=stats.combine_bytes,
                minimum_hidden_bytes=minimum,
                ratio_to_minimum=stats.hidden_bytes / minimum,
                naive_hidden_bytes=naive,
                naive_metadata_bytes=slots * METADATA_BYTES_PER_SLOT,
                naive_over_ours=(naive + slots * METADATA_BYTES_PER_SLOT) / stats.dispatch_bytes,
            )
        figures[preset_name] = per_dispatch
    return figures


def time_figures(rank, repeats):
    preset_name = "deepseek-v3"
    out = {}
    a2a_layout = layout_for(preset_name, "all2all")
    ag_layout = layout_for(preset_name, "allgather")
    weights, ids = route(preset_name, a2a_layout, rank, TOKENS, seed=2)
    ag_weights, ag_ids = route(preset_name, ag_layout, rank, TOKENS, seed=2)
    x = torch.randn(TOKENS, HIDDEN).to(DTYPE)
    naive = NaiveSlotExchange(a2a_layout, rank)
    a2a = make_dispatcher(a2a_layout, None, "all2all")
    ag = make_dispatcher(ag_layout, None, "allgather")
    out["all2all_vs_naive_per_slot"] = interleaved(
        lambda: naive.dispatch_combine(x, weights, ids), lambda: library_dispatch_combine(a2a, x, weights, ids), repeats
    )
    out["allgather_vs_all2all"] = interleaved(
        lambda: library_dispatch_combine(a2a, x, weights, ids),
        lambda: library_dispatch_combine(ag, x, ag_weights, ag_ids),
        repeats,
    )

    # The allgather combine: exact all_to_all_single (ours) against an all-reduce of the
    # padded [E * T_max, H] partials (every rank then slices its own rows).
    handle = ag.dispatch(x, ag_weights, ag_ids)
    partial = handle.wait()[0]
    padded = partial.new_zeros((WORLD_SIZE * TOKENS, HIDDEN))

    def all_reduce_combine():
        buffer = padded.float()
        buffer[: partial.shape[0]] = partial
        dist.all_reduce(buffer)
        return buffer[rank * TOKENS : (rank + 1) * TOKENS].to(partial.dtype)

    out["allgather_combine_a2a_vs_allreduce"] = interleaved(
        all_reduce_combine, lambda: ag._reduce_home(partial, [TOKENS] * WORLD_SIZE, TOKENS), repeats
    )
    element = partial.element_size()
    out["allgather_combine_bytes"] = dict(
        all_to_all=(WORLD_SIZE - 1) * TOKENS * HIDDEN * element,
        # Ring all-reduce sends 2 (E-1)/E of the buffer per rank; float32 for an exact sum.
        all_reduce_float32=2 * (WORLD_SIZE - 1) * TOKENS * HIDDEN * 4,
    )
    ag.combine(partial, handle)
    return out


def overlap_figures(rank, repeats):
    from moeroute.bindings.torch.moe import MoE
    from moeroute.config import RouterConfig

    c = OVERLAP
    torch.manual_seed(0)  # the same weights on every rank
    router = RouterConfig(c["experts"], c["top_k"])
    shared_mlp = GatedMLP(c["hidden"], c["intermediate"]).requires_grad_(False)
    gate = torch.nn.Linear(c["hidden"], 1, bias=False).requires_grad_(False)
    w_gate_up = torch.randn(c["experts"], 2 * c["intermediate"], c["hidden"]) * 0.02
    w_down = torch.randn(c["experts"], c["hidden"], c["intermediate"]) * 0.02
    router_weight = torch.randn(c["experts"], c["hidden"]) * 0.02
    modules = {}
    for shared in ("runner", "overlap"):
        module = MoE(
            router,
            c["hidden"],
            c["intermediate"],
            shared_mlp,
            gate,
            shared=shared,
            ep_group=dist.group.WORLD,
            dispatch="all2all",
        )
        with torch.no_grad():
            module.router_weight.copy_(router_weight)
        module.load_routed_weights(w_gate_up, w_down)
        modules[shared] = module
    x = torch.randn(c["tokens"], c["hidden"], generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        same = torch.allclose(modules["runner"](x), modules["overlap"](x), rtol=1e-5, atol=1e-6)
        pair = interleaved(lambda: modules["runner"](x), lambda: modules["overlap"](x), repeats)
        shared_us = median_time(lambda: torch.sigmoid(gate(x)) * shared_mlp(x), repeats, warmup=0) * 1e6
    return dict(
        runner_us=pair["baseline_us"],
        overlap_us=pair["candidate_us"],
        speedup=pair["speedup"],
        shared_mlp_us=shared_us,
        hidden_fraction=(pair["baseline_us"] - pair["candidate_us"]) / shared_us,
        outputs_equal=same,
        repeats=repeats,
        **c,
    )


def fp8_dispatch_figures(rank, repeats):
    """bfloat16 rows against FP8 rows (e4m3 + float32 scales per 128 columns), same tokens."""
    quant = QuantConfig("fp8_block")
    out = {}
    for dispatch in ("all2all", "allgather"):
        layout = layout_for("deepseek-v3", dispatch)
        weights, ids = route("deepseek-v3", layout, rank, TOKENS, seed=3)
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(DTYPE)
        dispatcher = make_dispatcher(layout, None, dispatch)

        # Both end with the first GEMM's input of an FP8 expert (an identity expert otherwise):
        # bfloat16 rows are quantized by the receiver, FP8 rows by the sender.
        def bf16_dispatch_combine():
            handle = dispatcher.dispatch(x, weights, ids)
            return dispatcher.combine(fake_quantize(handle.wait()[0], quant).to(DTYPE), handle)

        def fp8_dispatch_combine():
            handle = dispatcher.dispatch(quantize_for_dispatch(x, quant), weights, ids)
            return dispatcher.combine(handle.wait()[0].dequantize().to(DTYPE), handle)

        bf16_dispatch_combine()
        bf16 = dispatcher.last_stats
        fp8_dispatch_combine()
        fp8 = dispatcher.last_stats
        out[dispatch] = dict(
            rows_sent=fp8.rows_sent,
            bf16_token_bytes=bf16.token_bytes,
            fp8_value_bytes=fp8.hidden_bytes,
            fp8_scale_bytes=fp8.scale_bytes,
            fp8_token_bytes=fp8.token_bytes,
            token_bytes_ratio=fp8.token_bytes / bf16.token_bytes,
            bf16_dispatch_bytes=bf16.dispatch_bytes,
            fp8_dispatch_bytes=fp8.dispatch_bytes,
            dispatch_bytes_ratio=fp8.dispatch_bytes / bf16.dispatch_bytes,
            time=interleaved(bf16_dispatch_combine, fp8_dispatch_combine, repeats),
        )
    return out


#: Sections of the report; ``--only`` picks one.
SECTIONS = ("bytes", "time", "overlap", "fp8")


def rank_main(rank, init_file, repeats, result_path, sections=SECTIONS):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )
    runners = dict(
        bytes=lambda: byte_figures(rank),
        time=lambda: time_figures(rank, repeats),
        overlap=lambda: overlap_figures(rank, repeats),
        fp8=lambda: fp8_dispatch_figures(rank, repeats),
    )
    report = dict(rank=rank, **{name: runners[name]() for name in sections})
    reports = [None] * WORLD_SIZE
    dist.all_gather_object(reports, report)
    if rank == 0:
        import json

        with open(result_path, "w") as handle:
            json.dump(reports, handle)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- summary


def summarize(reports):
    def across(get):
        values = [get(r) for r in reports]
        return dict(median=statistics.median(values), min=min(values), max=max(values), per_rank=values)

    summary = {}
    if "fp8" in reports[0]:
        summary["fp8"] = {
            dispatch: {
                field: across(lambda r: r["fp8"][dispatch][field])
                for field in (
                    "bf16_token_bytes",
                    "fp8_token_bytes",
                    "token_bytes_ratio",
                    "bf16_dispatch_bytes",
                    "fp8_dispatch_bytes",
                    "dispatch_bytes_ratio",
                )
            }
            | {
                f"time_{field}": across(lambda r: r["fp8"][dispatch]["time"][field])
                for field in ("baseline_us", "candidate_us", "speedup")
            }
            for dispatch in ("all2all", "allgather")
        }
    if "bytes" not in reports[0]:
        return summary
    summary.update({"bytes": {}, "time": {}, "overlap": {}})
    for preset_name in BYTE_PRESETS:
        for dispatch in ("all2all", "allgather"):
            key = f"{preset_name}/{dispatch}"
            summary["bytes"][key] = {
                field: across(lambda r: r["bytes"][preset_name][dispatch][field])
                for field in (
                    "ratio_to_minimum",
                    "naive_over_ours",
                    "hidden_bytes",
                    "metadata_bytes",
                    "minimum_hidden_bytes",
                    "naive_hidden_bytes",
                )
            }
    for name in ("all2all_vs_naive_per_slot", "allgather_vs_all2all", "allgather_combine_a2a_vs_allreduce"):
        summary["time"][name] = {
            field: across(lambda r: r["time"][name][field]) for field in ("baseline_us", "candidate_us", "speedup")
        }
    summary["time"]["allgather_combine_bytes"] = reports[0]["time"]["allgather_combine_bytes"]
    for field in ("runner_us", "overlap_us", "shared_mlp_us", "speedup", "hidden_fraction"):
        summary["overlap"][field] = across(lambda r: r["overlap"][field])
    summary["overlap"]["outputs_equal"] = all(r["overlap"]["outputs_equal"] for r in reports)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REPEATS} repetitions")
    parser.add_argument("--only", choices=("fp8",), default=None, help="run only the FP8 dispatch figures")
    args = parser.parse_args(argv)
    sections = ("fp8",) if args.only == "fp8" else SECTIONS
    repeats = QUICK_REPEATS if args.quick else REPEATS
    import json

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="moeroute-bench-ep-") as tmp:
        result_path = os.path.join(tmp, "reports.json")
        mp.start_processes(
            rank_main,
            args=(os.path.join(tmp, "store"), repeats, result_path, sections),
            nprocs=WORLD_SIZE,
            start_method="spawn",
        )
        with open(result_path) as handle:
            reports = json.load(handle)
    summary = summarize(reports)
    config = dict(
        world_size=WORLD_SIZE,
        backend="gloo",
        tokens_per_rank=TOKENS,
        hidden=HIDDEN,
        dtype=str(DTYPE),
        repeats=repeats,
        threads_per_rank=1,
        load_average_after=os.getloadavg(),
    )
    path = write_results(
        "ep" if args.only is None else "ep_fp8", dict(config=config, summary=summary, per_rank=reports)
    )

    if "fp8" in summary:
        print(
            f"FP8 dispatch on {WORLD_SIZE} ranks, deepseek-v3 routing, T={TOKENS}/rank, H={HIDDEN}: "
            "bfloat16 rows against e4m3 rows + float32 scales per 128 columns (medians over ranks)"
        )
        rows = [
            (
                dispatch,
                round(v["bf16_token_bytes"]["median"]),
                round(v["fp8_token_bytes"]["median"]),
                v["token_bytes_ratio"]["median"],
                v["dispatch_bytes_ratio"]["median"],
                v["time_baseline_us"]["median"],
                v["time_candidate_us"]["median"],
                v["time_speedup"]["median"],
            )
            for dispatch, v in summary["fp8"].items()
        ]
        print_table(
            ("dispatch", "bf16_rows_B", "fp8_rows_B", "rows_ratio", "with_meta_ratio", "bf16_us", "fp8_us", "bf16/fp8"),
            rows,
        )
        if "bytes" not in summary:
            print(f"\nwrote {path}")
            return 0
        print()
    print(f"bytes per forward on {WORLD_SIZE} ranks, T={TOKENS}/rank, H={HIDDEN}, {DTYPE} (medians over ranks)")
    rows = []
    for key, value in summary["bytes"].items():
        rows.append(
            (
                key,
                round(value["hidden_bytes"]["median"]),
                round(value["metadata_bytes"]["median"]),
                round(value["minimum_hidden_bytes"]["median"]),
                value["ratio_to_minimum"]["median"],
                round(value["naive_hidden_bytes"]["median"]),
                value["naive_over_ours"]["median"],
            )
        )
    print_table(("preset/dispatch", "hidden", "metadata", "minimum", "ratio", "naive", "naive/ours"), rows)
    print("\ndispatch + combine on gloo (median over ranks of the median per-pair ratio)")
    rows = [
        (name, v["baseline_us"]["median"], v["candidate_us"]["median"], v["speedup"]["median"])
        for name, v in summary["time"].items()
        if "speedup" in v
    ]
    print_table(("pair (baseline_vs_candidate)", "baseline_us", "candidate_us", "baseline/candidate"), rows)
    o = summary["overlap"]
    print(
        f"\noverlap: runner {o['runner_us']['median']:.0f} us, overlap "
        f"{o['overlap_us']['median']:.0f} us, shared MLP alone "
        f"{o['shared_mlp_us']['median']:.0f} us, hidden fraction "
        f"{o['hidden_fraction']['median']:.2f}, outputs equal: {o['outputs_equal']}"
    )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
