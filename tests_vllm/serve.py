"""Serve tiny checkpoints with vLLM in this process and write what happened as JSON.

    python tests_vllm/serve.py [--compiled] [--capture] OUT.json MODEL_DIR [MODEL_DIR ...]

Run by the tests in a fresh process per plugin setting (vLLM's MoE method registry is
per process); the environment says whether the moeroute plugin acts. For each model:
greedy tokens and vLLM's top-2 logprobs per step for one batch of 1 prompt and one of 4,
how often each MoE runner ran and how often (and on how many token rows) its shared MLP
ran, and moeroute's plugin counters. ``--compiled`` serves with vLLM's torch.compile
(``enforce_eager=False``); the call counts then only cover what ran outside the graph.
``--capture`` also saves, for each MoE layer moeroute serves, every call's input rows,
router logits, correction bias, routed_scaling_factor and output (torch.save into OUT.json.<i>.pt for the i-th model).
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # counters live in this process

import numpy as np  # noqa: E402

#: Prompt lengths of the batch of 4 (the batch of 1 is its first prompt).
PROMPT_LENGTHS = (7, 12, 5, 9)
MAX_TOKENS = 12
SEED = 1234


def prompts(vocab_size):
    rng = np.random.default_rng(SEED)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]


#: Per MoE runner (by module name): its calls and token rows, its shared MLP's calls and rows.
COUNTS = {}


def _rows(args, kwargs):
    """Token rows of a module's first tensor argument."""
    first = args[0] if args else next(v for v in kwargs.values() if hasattr(v, "shape"))
    return int(first.shape[0])


def count_calls(model):
    """Forward hooks filling `COUNTS` for each MoE runner and its shared MLP."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    counts = COUNTS
    counts.clear()
    for name, module in model.named_modules():
        if not isinstance(module, MoERunner):
            continue
        entry = counts.setdefault(
            name,
            {
                "runner_calls": 0,
                "runner_rows": 0,
                "shared_calls": 0,
                "shared_rows": 0,
                "has_shared": module.shared_experts is not None,
                "method": type(module._quant_method).__name__,
                "monolithic": bool(module._quant_method.is_monolithic),
            },
        )

        def runner_hook(mod, args, kwargs, output, entry=entry):
            entry["runner_calls"] += 1
            entry["runner_rows"] += _rows(args, kwargs)

        module.register_forward_hook(runner_hook, with_kwargs=True)
        if module.shared_experts is not None:

            def shared_hook(mod, args, kwargs, output, entry=entry):
                entry["shared_calls"] += 1
                entry["shared_rows"] += _rows(args, kwargs)

            module.shared_experts._layer.register_forward_hook(shared_hook, with_kwargs=True)


#: Per served MoE layer (by layer name): one dict of tensors per call.
CAPTURED = {}


def capture_calls(model):
    """Record every call of the moeroute-served MoE methods into `CAPTURED`."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    for module in model.modules():
        if not isinstance(module, MoERunner) or getattr(module._quant_method, "plan", None) is None:
            continue
        method, calls = module._quant_method, []
        CAPTURED[module.routed_experts.layer_name] = calls
        original = method.apply_monolithic

        def apply_monolithic(layer, x, router_logits, input_ids=None, original=original, calls=calls):
            out = original(layer, x, router_logits, input_ids)
            bias = layer.e_score_correction_bias
            calls.append(
                {
                    "x": x.clone(),
                    "router_logits": router_logits.clone(),
                    "out": out.clone(),
                    "bias": None if bias is None else bias.clone(),
                    "routed_scaling_factor": float(layer.routed_scaling_factor),
                }
            )
            return out

        method.apply_monolithic = apply_monolithic


def serve(model_dir, eager=True, capture=False):
    from vllm import LLM, SamplingParams

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=eager,
        max_model_len=128,
        seed=0,
        kv_cache_memory_bytes=32 << 20,
    )
    llm.apply_model(count_calls)
    if capture:
        llm.apply_model(capture_calls)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, detokenize=False, ignore_eos=True)
    batches = {}
    for size in (1, 4):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts(vocab_size)[:size]], params, use_tqdm=False)
        batches[str(size)] = [
            {
                "tokens": list(o.outputs[0].token_ids),
                "top2": [
                    sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in o.outputs[0].logprobs
                ],
            }
            for o in outs
        ]
    del llm
    return {"batches": batches, "counts": json.loads(json.dumps(COUNTS))}


def main():
    arguments = sys.argv[1:]
    eager = "--compiled" not in arguments
    capture = "--capture" in arguments
    out_path, *model_dirs = [a for a in arguments if a not in ("--compiled", "--capture")]
    results = {}
    for model_dir in model_dirs:
        CAPTURED.clear()
        results[model_dir] = serve(model_dir, eager, capture)
        if capture:
            import torch

            torch.save(dict(CAPTURED), out_path + f".{len(results) - 1}.pt")
    from moeroute.compat import vllm_plugin

    results["stats"] = dict(vllm_plugin.STATS)
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
