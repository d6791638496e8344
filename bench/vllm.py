"""moeroute inside vLLM (CPU build): the MoE layer alone, and LLM.generate end to end.

Run in the vLLM venv (``make test-vllm`` builds it): ``.venv-vllm/bin/python bench/vllm.py``.

Layer: a Qwen3-MoE-like layer (H=1024, I=384, N=64, K=8, bfloat16) at T = 1, 8, 64, 512.
Baseline: vLLM's own CPU experts op (``cpu_fused_moe`` on the weights prepacked by
``cpu_prepack_moe_weight``, the ISA vLLM picks on this machine), what vLLM's
``UnquantizedFusedMoEMethod`` runs on a CPU. Candidate: the body of
``torch.ops.moeroute.experts`` (``ops.experts``) on the same weights in the loaded (Hugging
Face) layout, what the plugin runs in vLLM's eager layer call. Both get the
same routing (topk_weights, topk_ids) and input, and their outputs are compared. A second
pair adds each side's routing from the same logits (vLLM's CPU softmax top-k; moeroute's
select_experts), i.e. the whole method call. moeroute's weights are on 2 MB pages, as the
plugin puts them after loading (`moeroute.bindings.torch.memory`); a third pair gives vLLM's
packed weights 2 MB pages too.

End to end: a tiny random Qwen3-MoE checkpoint (4 layers, the layer shape above) served by
two in-process ``LLM`` instances in this one process, built before and after the plugin
registers; ``LLM.generate`` of a batch of 4 prompts x 32 greedy tokens alternates between
them; tokens per second and the median per-pair ratio.

Both sides run on one thread (``OMP_NUM_THREADS=1`` unless set), as vLLM's CPU worker
serves a model on this 2-core machine. Every figure is a median of per-pair time ratios from calls interleaved in one process
(bench/_common.py). JSON goes to bench/results/vllm.json. ``--quick`` for fewer repeats.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # both engines in this process
# One thread, as vLLM's CPU worker runs a model on this 2-core machine (it reduces torch to
# one thread for serving); set before torch starts its OpenMP pool.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

BENCH = Path(__file__).resolve().parent
# Run as a script, this folder leads sys.path, where "vllm" would name this very file: it
# goes last, after the installed vllm package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH] + [str(BENCH)]
sys.path.insert(0, str(BENCH.parent))

from _common import interleaved, print_table, write_results  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 1024, 384, 64, 8
TOKENS = (1, 8, 64, 512)
REPEATS = {1: 101, 8: 61, 64: 21, 512: 7}
QUICK_REPEATS = {1: 21, 8: 15, 64: 7, 512: 3}
WEIGHT_SCALE = 0.02
DTYPE = torch.bfloat16
#: End to end: layers of the checkpoint, prompts per batch, tokens generated per prompt.
E2E_LAYERS, E2E_PROMPTS, E2E_TOKENS = 4, 4, 32
E2E_REPEATS, QUICK_E2E_REPEATS = 7, 3


def vllm_isa() -> str:
    """The ISA of the CPU experts class vLLM's oracle picks on this machine."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend, backend_to_kernel_cls

    for cls in backend_to_kernel_cls(UnquantizedMoeBackend.CPU):
        if cls._supports_current_device():
            return cls.isa
    raise RuntimeError("vLLM has no CPU experts class for this machine")


def layer_bench(repeats: dict) -> list[dict]:
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk

    from moeroute.bindings.torch import arrays, ops
    from moeroute.bindings.torch.memory import back_with_huge_pages
    from moeroute.config import RouterConfig

    isa = vllm_isa()
    generator = torch.Generator().manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator) * WEIGHT_SCALE).to(DTYPE)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=generator) * WEIGHT_SCALE).to(DTYPE)
    w13_packed, w2_packed = cpu_prepack_moe_weight(w13, isa), cpu_prepack_moe_weight(w2, isa)
    # As the plugin does after loading: moeroute's weights on 2 MB pages. vLLM leaves its
    # packed weights where torch allocated them (4 KB pages under "madvise"); a copy of them
    # on 2 MB pages gives vLLM the same memory for a second comparison.
    huge_bytes = back_with_huge_pages(w13, w2)
    w13_packed_huge, w2_packed_huge = w13_packed.clone(), w2_packed.clone()
    vllm_huge_bytes = back_with_huge_pages(w13_packed_huge, w2_packed_huge)
    router = RouterConfig(EXPERTS, TOP_K, "softmax", renormalize=True)
    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, generator=generator).to(DTYPE)
        logits = torch.randn(tokens, EXPERTS, generator=generator).to(DTYPE)
        topk_weights, topk_ids = ops.select_experts(logits, router)

        def vllm_experts(x=x, topk_weights=topk_weights, topk_ids=topk_ids):
            out = torch.empty_like(x)
            cpu_fused_moe(out, x, w13_packed, w2_packed, None, None, topk_weights, topk_ids, "silu", isa)
            return out

        # What the plugin runs inside vLLM's eager layer call: the ops' bodies, no op dispatch
        # (moeroute.bindings.torch.ops.runs_eagerly).
        def vllm_experts_huge(x=x, topk_weights=topk_weights, topk_ids=topk_ids):
            out = torch.empty_like(x)
            cpu_fused_moe(out, x, w13_packed_huge, w2_packed_huge, None, None, topk_weights, topk_ids, "silu", isa)
            return out

        def moeroute_experts(x=x, topk_weights=topk_weights, topk_ids=topk_ids):
            return ops.experts(x, w13, w2, topk_weights, topk_ids, "silu", "auto")

        def vllm_method(x=x, logits=logits):
            weights, ids = _softmax_topk(logits, TOP_K, True)
            out = torch.empty_like(x)
            cpu_fused_moe(out, x, w13_packed, w2_packed, None, None, weights, ids, "silu", isa)
            return out

        def moeroute_method(x=x, logits=logits):
            weights, ids = arrays.select_experts(logits, router)
            return ops.experts(x, w13, w2, weights, ids, "silu", "auto")

        expected, got = vllm_experts().float(), moeroute_experts().float()
        difference = float((expected - got).abs().max() / expected.abs().max())
        experts = interleaved(vllm_experts, moeroute_experts, repeats[tokens])
        method = interleaved(vllm_method, moeroute_method, repeats[tokens])
        both_huge = interleaved(vllm_experts_huge, moeroute_experts, repeats[tokens])
        rows.append(
            {
                "tokens": tokens,
                "experts": experts,
                "routing_and_experts": method,
                "experts_vllm_on_huge_pages": both_huge,
                "max_difference_relative": difference,
            }
        )
        print(
            f"T={tokens}: experts {experts['speedup']:.2f}x, with routing {method['speedup']:.2f}x, "
            f"against vLLM on 2 MB pages too {both_huge['speedup']:.2f}x, outputs differ by "
            f"{difference:.2e} of the largest",
            flush=True,
        )
    import numba

    threads = {"torch_threads": torch.get_num_threads(), "numba_threads": numba.get_num_threads()}
    return [
        {
            "isa": isa,
            **threads,
            "huge_page_bytes": huge_bytes,
            "vllm_huge_page_bytes": vllm_huge_bytes,
            "hidden": HIDDEN,
            "intermediate": INTER,
            "experts": EXPERTS,
            "top_k": TOP_K,
            "dtype": str(DTYPE).removeprefix("torch."),
            **row,
        }
        for row in rows
    ]


def save_checkpoint(directory: str) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=HIDDEN,
        intermediate_size=4 * INTER,
        moe_intermediate_size=INTER,
        num_hidden_layers=E2E_LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(DTYPE).save_pretrained(directory)


def e2e_bench(repeats: int) -> dict:
    from vllm import LLM, SamplingParams

    from moeroute.compat import vllm_plugin

    directory = tempfile.mkdtemp(prefix="moeroute-vllm-bench-")
    save_checkpoint(directory)
    arguments = dict(
        model=directory,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=128,
        seed=0,
        kv_cache_memory_bytes=64 << 20,
    )
    os.environ.pop("MOEROUTE_VLLM", None)
    os.environ.pop("VLLM_PLUGINS", None)
    plain = LLM(**arguments)
    os.environ["MOEROUTE_VLLM"] = "1"
    vllm_plugin.register()
    served = LLM(**arguments)
    assert vllm_plugin.STATS["layers"] == E2E_LAYERS, vllm_plugin.STATS
    generator = torch.Generator().manual_seed(1)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 512, (16,), generator=generator).tolist()} for _ in range(E2E_PROMPTS)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=E2E_TOKENS, ignore_eos=True, detokenize=False)
    outputs = {}

    def run(llm, name):
        def generate():
            outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

        return generate

    timing = interleaved(run(plain, "vllm"), run(served, "moeroute"), repeats, warmup=1)
    generated = E2E_PROMPTS * E2E_TOKENS
    same = sum(a == b for a, b in zip(outputs["vllm"], outputs["moeroute"]))
    result = {
        "layers": E2E_LAYERS,
        "prompts": E2E_PROMPTS,
        "tokens_per_prompt": E2E_TOKENS,
        "vllm_tokens_per_s": generated / (timing["baseline_us"] / 1e6),
        "moeroute_tokens_per_s": generated / (timing["candidate_us"] / 1e6),
        "speedup": timing["speedup"],
        "speedup_range": timing["speedup_range"],
        "repeats": repeats,
        "prompts_with_identical_tokens": same,
    }
    print(
        f"end to end: vLLM {result['vllm_tokens_per_s']:.1f} tok/s, with moeroute "
        f"{result['moeroute_tokens_per_s']:.1f} tok/s ({timing['speedup']:.2f}x)",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    started = time.time()
    layer = layer_bench(QUICK_REPEATS if args.quick else REPEATS)
    e2e = e2e_bench(QUICK_E2E_REPEATS if args.quick else E2E_REPEATS)
    print_table(
        ["T", "vLLM experts us", "moeroute us", "experts x", "with routing x"],
        [
            [
                r["tokens"],
                r["experts"]["baseline_us"],
                r["experts"]["candidate_us"],
                r["experts"]["speedup"],
                r["routing_and_experts"]["speedup"],
            ]
            for r in layer
        ],
    )
    import vllm

    path = write_results(
        "vllm",
        {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "layer": layer,
            "end_to_end": e2e,
            "seconds": round(time.time() - started, 1),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
