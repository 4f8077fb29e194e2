"""OLMoE (`OlmoeForCausalLM`): attention with q and k RMSNorm over the whole projection (not
per head), every layer an MoE of SwiGLU experts with a softmax top-k router.

The family's checkpoints keep the MoE block at `mlp` (router `mlp.gate`, experts
`mlp.experts.E.{gate,up,down}_proj`); its blocks compose as the shared decoder stack
(`models.decoder`).
"""

from __future__ import annotations

from strata_jax.config import ModelConfig
from strata_jax.models.decoder import layer_tensors
from strata_jax.models.hf_config import (COMMON_FIELDS, HONOURED, Family, HFFields, Quant,
                                         TensorNames, decoder_config)

ARCHITECTURE = "OlmoeForCausalLM"
TENSORS = TensorNames("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))

FIELDS = {
    **COMMON_FIELDS,
    "intermediate_size": HONOURED,
    "norm_topk_prob": HONOURED,
    "attention_bias": HONOURED,
    "clip_qkv": "refused unless null",
    "sliding_window": ("refused unless null (transformers applies it only in some attention "
                       "kernels)"),
}


def config_from_hf(f: HFFields, quant: Quant | None, param_dtype: str | None) -> ModelConfig:
    """An OLMoE config.json (checked by `f`) as a `ModelConfig`; defaults are transformers'."""
    f.only("clip_qkv", (None,), "clipping q/k/v is not implemented")
    f.only("sliding_window", (None,), "transformers' OLMoE applies a window only in some "
                                      "attention kernels; not implemented")
    return decoder_config(
        f, quant, param_dtype, intermediate=f.need("intermediate_size"),
        norm_topk_prob=f.get("norm_topk_prob", False), qk_norm="full", sliding_window=None,
        rope_theta=10_000.0, rms_norm_eps=1e-5, max_position_embeddings=4096)


def olmoe_1b_7b() -> ModelConfig:
    """OLMoE-1B-7B: an MoE model with 64 experts per layer, top-8, no top-k renormalisation.

    OLMoE normalises q and k over the whole projection (qk_norm="full"), not per head.
    """
    return ModelConfig(
        name="olmoe-1b-7b", vocab_size=50_304, hidden_size=2048, n_layers=16, n_heads=16,
        n_kv_heads=16, head_dim=128, n_experts=64, top_k=8, expert_intermediate=1024,
        norm_topk_prob=False, qk_norm="full", rope_theta=10_000.0, rms_norm_eps=1e-5,
        max_seq_len=4096)


FAMILY = Family(
    architecture=ARCHITECTURE, label="OLMoE", model_type="olmoe", fields=FIELDS,
    tensors=TENSORS, config_from_hf=config_from_hf, presets={"olmoe-1b-7b": olmoe_1b_7b},
    layer_tensors=lambda config, layer: layer_tensors(config, layer, TENSORS))
