"""GLM-4.5 (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air): the shared decoder stack
(`models.decoder`) with grouped-query attention whose RoPE rotates part of each head
(`partial_rotary_factor`, 0.5 when absent), optional per-head q/k RMSNorm (`use_qk_norm`) and
q/k/v biases without an o bias (`attention_bias`); the first `first_k_dense_replace` layers a
dense SwiGLU MLP, the others DeepSeek-V3's MoE: sigmoid scores, a selection bias
(`e_score_correction_bias`) used only for choosing, group-limited choice, renormalised weights
scaled by `routed_scaling_factor`, and an ungated shared expert.

Its checkpoints keep the experts per expert (`mlp.experts.E.{gate,up,down}_proj`), the router
at `mlp.gate` (weight and `e_score_correction_bias`; a parameter, never quantized: FP8
checkpoints store it unquantized whatever modules_to_not_convert says) and the shared experts at
`mlp.shared_experts`. The multi-token-prediction layers are numbered after the decoder's
(`model.layers.<num_hidden_layers + i>.`) and skipped by name.
"""

from __future__ import annotations

from typing import Iterator, Mapping

from strata_jax.config import ModelConfig
from strata_jax.models.decoder import attention_tensors, sigmoid_moe_tensors
from strata_jax.models.hf_config import (COMMON_FIELDS, HONOURED, NO_EFFECT, Family, HFFields,
                                         Quant, TensorNames, decoder_config, read_rope, refuse,
                                         deepseek_style_skips, rotary_dim)

TENSORS = TensorNames("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))
_MTP = (f"{NO_EFFECT}: the multi-token-prediction layers (model.layers.<num_hidden_layers + i>.*) "
        "are skipped")

FIELDS = {
    **{k: v for k, v in COMMON_FIELDS.items() if k != "num_experts"},
    "num_local_experts": "honoured (n_routed_experts' other spelling; refused if they differ)",
    "n_routed_experts": HONOURED,
    "partial_rotary_factor": ("honoured: the rotated part of each attention head (0.5 when "
                              "absent); an odd number of dims refused"),
    "use_qk_norm": "honoured: per-head RMSNorm of q and k",
    "attention_bias": "honoured: q, k and v biases (o_proj has none)",
    "moe_intermediate_size": "honoured: the routed experts' width (and each shared expert's)",
    "intermediate_size": "honoured: the dense layers' MLP width",
    "n_shared_experts": ("honoured: one ungated shared expert of n_shared_experts x "
                         "moe_intermediate_size; 0: none"),
    "first_k_dense_replace": "honoured: the first k layers have a dense MLP",
    "routed_scaling_factor": HONOURED,
    "n_group": "honoured: group-limited routing (groups ranked by their two best scores)",
    "topk_group": HONOURED,
    "norm_topk_prob": HONOURED,
    "num_nextn_predict_layers": _MTP,
    "num_mtp_layers": f"{_MTP} (transformers' other spelling; refused if they differ)",
}


def _count(f: HFFields, key: str, default: int) -> int:
    """Field `key` (an integer, `HFFields` checked), refused if negative."""
    value = f.get(key, default)
    if value < 0:
        raise refuse(key, value, "expected 0 or more")
    return value


def config_from_hf(f: HFFields, quant: Quant | None, param_dtype: str | None) -> ModelConfig:
    """A GLM-4.5 config.json (checked by `f`) as a `ModelConfig`; defaults are transformers'."""
    max_position = int(f.get("max_position_embeddings", 131_072))
    theta, scaling, longest, partial = read_rope(f, max_position, 10_000.0, partial=True,
                                                 partial_default=0.5)
    head_dim = f.get("head_dim", f.need("hidden_size") // f.need("num_attention_heads"))
    moe_width = f.get("moe_intermediate_size", 1408)
    dense = min(_count(f, "first_k_dense_replace", 1), f.need("num_hidden_layers"))
    mtp = f.one_of("num_nextn_predict_layers", "num_mtp_layers", required=False)
    if mtp is not None and mtp < 0:
        raise refuse("num_nextn_predict_layers", mtp, "expected 0 or more")
    biased = bool(f.get("attention_bias", False))
    return decoder_config(
        f, quant, param_dtype, intermediate=moe_width,
        norm_topk_prob=f.get("norm_topk_prob", True),
        qk_norm="per_head" if f.get("use_qk_norm", False) else "none", sliding_window=None,
        rope_theta=10_000.0, rms_norm_eps=1e-5, max_position_embeddings=131_072,
        rope=(theta, scaling, longest), expert_keys=("n_routed_experts", "num_local_experts"),
        rotary_dim=rotary_dim(head_dim, partial), n_dense_layers=dense,
        dense_intermediate=f.get("intermediate_size", 10_944) if dense else 0,
        shared_expert_intermediate=_count(f, "n_shared_experts", 1) * moe_width,
        router_scores="sigmoid", selection_bias=True,
        routed_scaling=float(f.get("routed_scaling_factor", 1.0)),
        n_groups=f.get("n_group", 1), topk_groups=f.get("topk_group", 1),
        **({"attention_out_bias": False} if biased else {}))


def layer_tensors(config: ModelConfig, layer: int) -> Iterator[tuple]:
    """The loader's entries (`Family.layer_tensors`) of one layer's non-expert tensors."""
    yield from attention_tensors(config, layer, TENSORS)
    yield from sigmoid_moe_tensors(config, layer, TENSORS)


def _published(name: str, *, hidden: int, layers: int, experts: int, expert_width: int,
               dense: int, dense_width: int, qk_norm: str, scaling: float) -> ModelConfig:
    """The shape both models publish: 96 query / 8 KV heads of 128 (half of each rotated),
    q/k/v biases, top-8 of sigmoid-scored experts (one group) and one shared expert of the
    experts' width, vocabulary 151,552, RoPE base 1e6, 131,072 positions."""
    return ModelConfig(
        name=name, vocab_size=151_552, hidden_size=hidden, n_layers=layers, n_heads=96,
        n_kv_heads=8, head_dim=128, n_experts=experts, top_k=8, expert_intermediate=expert_width,
        n_dense_layers=dense, dense_intermediate=dense_width,
        shared_expert_intermediate=expert_width, router_scores="sigmoid", norm_topk_prob=True,
        routed_scaling=scaling, selection_bias=True, qk_norm=qk_norm, attention_bias=True,
        attention_out_bias=False, rotary_dim=64, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
        max_seq_len=131_072)


def glm_4_5() -> ModelConfig:
    """GLM-4.5 (355B-A32B): 92 layers (the first 3 dense), 160 experts of width 1536 per layer,
    top-8, routed weights scaled by 2.5, per-head q/k norms."""
    return _published("glm-4.5", hidden=5120, layers=92, experts=160, expert_width=1536,
                      dense=3, dense_width=12_288, qk_norm="per_head", scaling=2.5)


def glm_4_5_air() -> ModelConfig:
    """GLM-4.5-Air (106B-A12B): 46 layers (the first dense), 128 experts of width 1408 per
    layer, top-8, routed weights unscaled, no q/k norms."""
    return _published("glm-4.5-air", hidden=4096, layers=46, experts=128, expert_width=1408,
                      dense=1, dense_width=10_944, qk_norm="none", scaling=1.0)


FAMILY = Family(
    architecture="Glm4MoeForCausalLM", label="GLM-4.5", model_type="glm4_moe", fields=FIELDS,
    tensors=TENSORS, config_from_hf=config_from_hf,
    presets={"glm-4.5": glm_4_5, "glm-4.5-air": glm_4_5_air},
    layer_tensors=layer_tensors,
    skipped=lambda config, hf: deepseek_style_skips(TENSORS, config, hf))
