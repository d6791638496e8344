"""Tiny random MoE checkpoints saved with transformers, one per architecture the tests serve.

Each is a two- or three-layer model with hidden size 128 in bfloat16. The router weights
are drawn wider than the usual initialisation so that routing decisions are far from ties,
and DeepSeek-V3's correction bias is random (transformers initialises it to zeros).
"""

import torch

#: Standard deviation of the router (gate) weights: logits of a few units.
ROUTER_STD = 0.3
COMMON = dict(
    vocab_size=512,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def _config(name):
    import transformers as tf

    if name == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            num_hidden_layers=2,
            head_dim=32,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **COMMON,
        )
    if name == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
            num_hidden_layers=2,
            intermediate_size=256,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **COMMON,
        )
    if name == "mixtral":
        return tf.MixtralForCausalLM, tf.MixtralConfig(
            num_hidden_layers=2, head_dim=32, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, **COMMON
        )
    if name == "deepseek_v3":
        # vLLM's CPU MLA decode kernel serves only kv_lora_rank 512 + rope 64 (576).
        return tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            num_hidden_layers=3,
            first_k_dense_replace=1,
            intermediate_size=256,
            moe_intermediate_size=64,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            q_lora_rank=64,
            kv_lora_rank=512,
            qk_nope_head_dim=32,
            qk_rope_head_dim=64,
            v_head_dim=32,
            **COMMON,
        )
    raise ValueError(f"unknown model {name!r}")


MODELS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")


def save(name, directory, seed=0):
    """Save the tiny random ``name`` checkpoint (one of `MODELS`) into ``directory``."""
    model_cls, config = _config(name)
    return save_model(model_cls, config, directory, seed)


def save_model(model_cls, config, directory, seed=0):
    """Save a random ``model_cls(config)`` with the routers drawn as `save` draws them."""
    torch.manual_seed(seed)
    model = model_cls(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if module_name.endswith(("mlp.gate", "block_sparse_moe.gate", "mlp.router")):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * ROUTER_STD)
                bias = getattr(module, "e_score_correction_bias", None)
                if bias is not None:
                    bias.copy_(torch.rand(bias.shape, generator=generator) * 0.1)
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory
