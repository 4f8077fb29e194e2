"""Mixtral (`MixtralForCausalLM`): grouped-query attention without q/k norms or biases, every
layer an MoE of SwiGLU experts whose top-k weights are always renormalised.

The family's checkpoints keep the MoE block at `block_sparse_moe` (router
`block_sparse_moe.gate`, experts `block_sparse_moe.experts.E.{w1,w3,w2}` for gate, up, down);
its blocks compose as the shared decoder stack (`models.decoder`).
"""

from __future__ import annotations

from strata_jax.config import ModelConfig
from strata_jax.models.decoder import layer_tensors
from strata_jax.models.hf_config import (COMMON_FIELDS, HONOURED, Family, HFFields, Quant,
                                         TensorNames, decoder_config)

ARCHITECTURE = "MixtralForCausalLM"
TENSORS = TensorNames("block_sparse_moe", "gate", ("w1", "w3", "w2"))

FIELDS = {
    **COMMON_FIELDS,
    "intermediate_size": HONOURED,
    "norm_topk_prob": "refused unless true (Mixtral always renormalises)",
    "attention_bias": "refused unless false (Mixtral has no attention biases)",
    "sliding_window": HONOURED,
    "router_jitter_noise": "no effect (training only)",
}


def config_from_hf(f: HFFields, quant: Quant | None, param_dtype: str | None) -> ModelConfig:
    """A Mixtral config.json (checked by `f`) as a `ModelConfig`; defaults are transformers'.
    Mixtral renormalises its top-k weights always (it has no norm_topk_prob field of its own)."""
    f.only("attention_bias", (False,), "Mixtral has no attention biases")
    f.only("norm_topk_prob", (True,), "Mixtral always renormalises its top-k weights")
    return decoder_config(
        f, quant, param_dtype, intermediate=f.need("intermediate_size"), norm_topk_prob=True,
        qk_norm="none", sliding_window=f.get("sliding_window"), rope_theta=1_000_000.0,
        rms_norm_eps=1e-5, max_position_embeddings=131_072)


def mixtral_8x7b() -> ModelConfig:
    """Mixtral-8x7B: an MoE model with 8 experts per layer, top-2, 32 layers.

    Mixtral takes a softmax over all 8 logits, keeps the top 2 and renormalises them, which equals
    a softmax over the top-2 logits: norm_topk_prob=True.
    """
    return ModelConfig(
        name="mixtral-8x7b", vocab_size=32_000, hidden_size=4096, n_layers=32, n_heads=32,
        n_kv_heads=8, head_dim=128, n_experts=8, top_k=2, expert_intermediate=14_336,
        norm_topk_prob=True, qk_norm="none", rope_theta=1_000_000.0, rms_norm_eps=1e-5,
        max_seq_len=32_768)


FAMILY = Family(
    architecture=ARCHITECTURE, label="Mixtral", model_type="mixtral", fields=FIELDS,
    tensors=TENSORS, config_from_hf=config_from_hf, presets={"mixtral-8x7b": mixtral_8x7b},
    layer_tensors=lambda config, layer: layer_tensors(config, layer, TENSORS))
