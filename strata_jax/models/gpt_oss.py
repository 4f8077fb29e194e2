"""gpt-oss (`GptOssForCausalLM`: gpt-oss-120b, gpt-oss-20b): the shared decoder stack
(`models.decoder`) with grouped-query attention whose projections all add a bias, a learned sink
logit per head in every softmax (`ModelConfig.attention_sinks`), sliding-window layers (128)
alternating with full ones (`layer_types`), YaRN RoPE; every layer an MoE whose router adds a
bias to its logits (top-k of the logits, softmax over the chosen: a softmax router with
renormalised weights) and whose experts add biases to their products and apply a clamped SwiGLU
(`swiglu_limit`, `swiglu_alpha`: (up + 1) * gate * sigmoid(alpha * gate)).

Its checkpoints keep each layer's experts fused (`TensorNames.fused`): `mlp.experts.gate_up_proj`
[E, H, 2I] with gate and up interleaved along the output (gate the even columns), its bias [E,
2I], `mlp.experts.down_proj` [E, I, H] and its bias [E, H]; as released, the two matrices in
MXFP4 (`_blocks`, `_scales`: quantization_config quant_method mxfp4), which the routed experts
keep (`strata_jax.formats`, "mxfp4"). The router is `mlp.router` (weight and bias), the sinks
`self_attn.sinks`.
"""

from __future__ import annotations

from typing import Iterator

from strata_jax.config import ModelConfig, RopeScaling
from strata_jax.models.decoder import attention_tensors
from strata_jax.models.hf_config import (COMMON_FIELDS, HONOURED, NO_EFFECT, Family, HFFields,
                                         Quant, TensorNames, decoder_config, read_rope, refuse)

TENSORS = TensorNames("mlp", "router", ("gate_up_proj", "gate_up_proj", "down_proj"),
                      fused=True)

# transformers' GptOssConfig default where config.json gives no RoPE scaling.
_YARN_DEFAULT = RopeScaling("yarn", 32.0, 4096, beta_fast=32.0, beta_slow=1.0, truncate=False)

FIELDS = {
    **{k: v for k, v in COMMON_FIELDS.items() if k != "num_experts"},
    "num_local_experts": HONOURED,
    "num_experts": "honoured (num_local_experts' other spelling; refused if they differ)",
    "experts_per_token": ("honoured (num_experts_per_tok's spelling in the original code; "
                          "refused if they differ)"),
    "intermediate_size": "honoured: the routed experts' width",
    "attention_bias": "honoured: q, k, v and o biases",
    "sliding_window": "honoured in the layers layer_types names sliding_attention",
    "layer_types": ("honoured: sliding_attention or full_attention per layer (absent: "
                    "sliding for even layers, as transformers)"),
    "rope_scaling": ("honoured: yarn (absent: transformers' gpt-oss default, factor 32 over "
                     "4,096 positions, beta 32/1, not truncated), default, linear, dynamic"),
    "swiglu_limit": "honoured: the experts' clamp (gate above, up both sides)",
    "swiglu_alpha": "honoured: the experts' sigmoid gain (absent: 1.702)",
    "initial_context_length": (f"{NO_EFFECT}: the original code's RoPE table length "
                               "(transformers reads rope_scaling's "
                               "original_max_position_embeddings)"),
}


def _layer_types(f: HFFields, n_layers: int) -> tuple[str, ...]:
    types = f.get("layer_types")
    if types is None:  # transformers: sliding for even layers
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(n_layers))
    if not isinstance(types, list):
        raise refuse("layer_types", types, "expected a list, one entry per layer")
    return tuple(types)


def config_from_hf(f: HFFields, quant: Quant | None, param_dtype: str | None) -> ModelConfig:
    """A gpt-oss config.json (checked by `f`) as a `ModelConfig`; defaults are transformers'."""
    max_position = int(f.get("max_position_embeddings", 131_072))
    rope = read_rope(f, max_position, 150_000.0)
    if f.get("rope_scaling") is None and not set(f.get("rope_parameters") or {}) - {
            "rope_theta"}:  # no scaling given: transformers' gpt-oss YaRN
        y = _YARN_DEFAULT
        rope = (rope[0], y, max(max_position, int(y.factor * y.original_max_position_embeddings)))
    n_layers = f.need("num_hidden_layers")
    top_k = f.one_of("num_experts_per_tok", "experts_per_token")
    alpha, limit = f.get("swiglu_alpha", 1.702), f.get("swiglu_limit", 7.0)
    for key, value in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise refuse(key, value, "expected a positive number")
    return decoder_config(
        f, quant, param_dtype, intermediate=f.need("intermediate_size"), norm_topk_prob=True,
        qk_norm="none", sliding_window=f.get("sliding_window", 128), rope_theta=150_000.0,
        rms_norm_eps=1e-5, max_position_embeddings=131_072, rope=rope,
        expert_keys=("num_local_experts", "num_experts"), top_k=top_k,
        layer_types=_layer_types(f, n_layers), router_bias=True, expert_bias=True,
        expert_act="clamped_swiglu", swiglu_alpha=float(alpha), swiglu_limit=float(limit),
        attention_sinks=True)


def layer_tensors(config: ModelConfig, layer: int) -> Iterator[tuple]:
    """The loader's entries (`Family.layer_tensors`) of one layer's non-expert tensors: the
    attention (with its sinks) and the router's weight and bias."""
    c, hf, mine = config, TENSORS.layer(layer) + "mlp.router.", f"layers.{layer}.mlp."
    yield from attention_tensors(c, layer, TENSORS)
    yield mine + "router", hf + "weight", (c.n_experts, c.hidden_size), True
    yield mine + "router_bias", hf + "bias", (c.n_experts,), False


def _published(name: str, layers: int, experts: int) -> ModelConfig:
    """The shape both models publish: hidden 2880, 64 query / 8 KV heads of 64 with biases
    and sinks, sliding windows of 128 in the even layers, top-4 of experts of width 2880 with
    biases and the clamped SwiGLU (limit 7), vocabulary 201,088, YaRN x32 over 4,096
    positions (131,072)."""
    return ModelConfig(
        name=name, vocab_size=201_088, hidden_size=2880, n_layers=layers, n_heads=64,
        n_kv_heads=8, head_dim=64, n_experts=experts, top_k=4, expert_intermediate=2880,
        norm_topk_prob=True, router_bias=True, expert_bias=True, expert_act="clamped_swiglu",
        swiglu_alpha=1.702, swiglu_limit=7.0, attention_sinks=True, attention_bias=True,
        rope_theta=150_000.0,
        rope_scaling=RopeScaling("yarn", 32.0, 4096, beta_fast=32.0, beta_slow=1.0,
                                 truncate=False),
        sliding_window=128,
        layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                          for i in range(layers)),
        rms_norm_eps=1e-5, max_seq_len=131_072)


def gpt_oss_120b() -> ModelConfig:
    """gpt-oss-120b: 36 layers, 128 experts per layer, top-4 (experts plain here; the release
    is MXFP4: `--quantize mxfp4`)."""
    return _published("gpt-oss-120b", 36, 128)


def gpt_oss_20b() -> ModelConfig:
    """gpt-oss-20b: 24 layers, 32 experts per layer, top-4."""
    return _published("gpt-oss-20b", 24, 32)


FAMILY = Family(
    architecture="GptOssForCausalLM", label="gpt-oss", model_type="gpt_oss", fields=FIELDS,
    tensors=TENSORS, config_from_hf=config_from_hf,
    presets={"gpt-oss-120b": gpt_oss_120b, "gpt-oss-20b": gpt_oss_20b},
    layer_tensors=layer_tensors)
