"""Qwen3-MoE (`Qwen3MoeForCausalLM`): grouped-query attention with per-head q/k RMSNorm, every
layer an MoE of SwiGLU experts with a softmax top-k router.

The family's checkpoints keep the MoE block at `mlp` (router `mlp.gate`, experts
`mlp.experts.E.{gate,up,down}_proj`); its blocks compose as the shared decoder stack
(`models.decoder`).
"""

from __future__ import annotations

from strata_jax.config import ModelConfig
from strata_jax.models.decoder import layer_tensors
from strata_jax.models.hf_config import (COMMON_FIELDS, HONOURED, Family, HFFields, Quant,
                                         TensorNames, decoder_config, refuse)

ARCHITECTURE = "Qwen3MoeForCausalLM"
TENSORS = TensorNames("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))

FIELDS = {
    **COMMON_FIELDS,
    "moe_intermediate_size": HONOURED,
    "intermediate_size": "no effect (dense MLP width; every layer is MoE)",
    "norm_topk_prob": HONOURED,
    "decoder_sparse_step": "refused unless 1 (dense layers)",
    "mlp_only_layers": "refused unless empty (dense layers)",
    "attention_bias": HONOURED,
    "use_sliding_window": "honoured: sliding_window in every layer",
    "sliding_window": "honoured when use_sliding_window",
    "max_window_layers": ("no effect unless use_sliding_window; then refused unless 0 "
                          "(transformers versions disagree)"),
}


def _sliding_window(f: HFFields) -> int | None:
    if not f.get("use_sliding_window", False):
        return None  # transformers drops sliding_window and max_window_layers then
    if f.get("max_window_layers", 0) != 0:
        raise refuse("max_window_layers", f.hf["max_window_layers"],
                     "with use_sliding_window, transformers 4.51 windowed only the layers "
                     "from max_window_layers on and later versions every layer; only 0 "
                     "(every layer) is unambiguous")
    # transformers' default window when the key is absent; an explicit null is no window.
    return f.hf["sliding_window"] if "sliding_window" in f.hf else 4096


def config_from_hf(f: HFFields, quant: Quant | None, param_dtype: str | None) -> ModelConfig:
    """A Qwen3-MoE config.json (checked by `f`) as a `ModelConfig`; defaults are transformers'."""
    f.only("mlp_only_layers", ([], None), "dense MLP layers in a Qwen3-MoE checkpoint are "
                                          "not implemented")
    f.only("decoder_sparse_step", (1,), "dense MLP layers in a Qwen3-MoE checkpoint are "
                                        "not implemented")
    return decoder_config(
        f, quant, param_dtype, intermediate=f.need("moe_intermediate_size"),
        norm_topk_prob=f.get("norm_topk_prob", False), qk_norm="per_head",
        sliding_window=_sliding_window(f), rope_theta=10_000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32_768)


def qwen3_30b_a3b() -> ModelConfig:
    """Qwen3-30B-A3B: an MoE model with 128 experts per layer, top-8, 48 layers."""
    return ModelConfig(
        name="qwen3-30b-a3b", vocab_size=151_936, hidden_size=2048, n_layers=48, n_heads=32,
        n_kv_heads=4, head_dim=128, n_experts=128, top_k=8, expert_intermediate=768,
        norm_topk_prob=True, qk_norm="per_head", rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        max_seq_len=40_960)


def qwen3_235b_a22b() -> ModelConfig:
    """Qwen3-235B-A22B: an MoE model with 128 experts per layer, top-8, 94 layers, hidden 4096."""
    return ModelConfig(
        name="qwen3-235b-a22b", vocab_size=151_936, hidden_size=4096, n_layers=94, n_heads=64,
        n_kv_heads=4, head_dim=128, n_experts=128, top_k=8, expert_intermediate=1536,
        norm_topk_prob=True, qk_norm="per_head", rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        max_seq_len=40_960)


FAMILY = Family(
    architecture=ARCHITECTURE, label="Qwen3-MoE", model_type="qwen3_moe", fields=FIELDS,
    tensors=TENSORS, config_from_hf=config_from_hf,
    presets={"qwen3-30b-a3b": qwen3_30b_a3b, "qwen3-235b-a22b": qwen3_235b_a22b},
    layer_tensors=lambda config, layer: layer_tensors(config, layer, TENSORS))
