"""DeepSeek-V3 (`DeepseekV3ForCausalLM`: DeepSeek-V3, R1, V3.1, and Kimi-K2, the same class
with other counts): multi-head latent attention (`models.mla`), the first
`first_k_dense_replace` layers a dense SwiGLU MLP, the others an MoE of `n_routed_experts`
SwiGLU experts with a sigmoid router (selection bias `e_score_correction_bias`, group-limited
choice, `routed_scaling_factor`) plus `n_shared_experts` shared experts as one MLP.

Checkpoints: the MoE block at `mlp` (router `mlp.gate`, experts
`mlp.experts.E.{gate,up,down}_proj`, shared experts `mlp.shared_experts.*`); the attention as
`self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj`. The released weights are FP8 with 128 x 128 block scales
(`weight_scale_inv`) for every linear but the router: the routed experts keep FP8, the others
are dequantized on load. Multi-token-prediction layers (`num_nextn_predict_layers`) are
stored as decoder layers numbered after the last (`model.layers.61.` in DeepSeek-V3): skipped
by name, and the loader says so. A config of this class with another `model_type` (Kimi-K2's
`kimi_k2`) is read with the same fields; any field outside them is refused by name.
"""

from __future__ import annotations

from typing import Iterator, Mapping

from strata_jax.config import RopeScaling
from strata_jax.models.decoder import sigmoid_moe_tensors
from strata_jax.models.hf_config import (COMMON_FIELDS, HONOURED, NO_EFFECT, Family, HFFields,
                                         Quant, TensorNames, decoder_config, deepseek_style_skips,
                                         read_rope, refuse)
from strata_jax.models.mla import MLAConfig

ARCHITECTURE = "DeepseekV3ForCausalLM"
TENSORS = TensorNames("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))

_NOT_HERE = ("num_experts", "num_local_experts", "partial_rotary_factor")
FIELDS = {
    **{k: v for k, v in COMMON_FIELDS.items() if k not in _NOT_HERE},
    "model_type": ("honoured: any value on this architecture (Kimi-K2 writes kimi_k2); the "
                   "fields are read as DeepSeek-V3's and any other is refused"),
    "num_key_value_heads": "refused unless num_attention_heads (MLA expands every head)",
    "head_dim": (f"{NO_EFFECT}: transformers writes qk_rope_head_dim there; refused if "
                 "different"),
    "qk_head_dim": "refused unless qk_nope_head_dim + qk_rope_head_dim",
    "n_routed_experts": HONOURED,
    "n_shared_experts": "honoured: one shared MLP of n x moe_intermediate_size (0: none)",
    "moe_intermediate_size": HONOURED,
    "intermediate_size": "honoured: the dense layers' width",
    "first_k_dense_replace": HONOURED,
    "moe_layer_freq": "refused unless 1 (every layer after the dense ones is MoE)",
    "routed_scaling_factor": HONOURED,
    "n_group": HONOURED,
    "topk_group": HONOURED,
    "norm_topk_prob": HONOURED,
    "topk_method": "refused unless noaux_tc (the biased sigmoid choice)",
    "scoring_func": "refused unless sigmoid",
    "q_lora_rank": "honoured (null: one q_proj)",
    "kv_lora_rank": HONOURED,
    "qk_nope_head_dim": HONOURED,
    "qk_rope_head_dim": HONOURED,
    "v_head_dim": HONOURED,
    "rope_interleave": "honoured (absent: true, DeepSeek's interleaved rotary pairs)",
    "rope_scaling": ("honoured: default, linear, dynamic, yarn (with mscale_all_dim the "
                     "softmax scale is multiplied by mscale^2, as DeepSeek's); others refused"),
    "attention_bias": "refused unless false",
    "num_nextn_predict_layers": (f"{NO_EFFECT}: the multi-token-prediction layers after the "
                                 "last decoder layer are skipped"),
    "num_mtp_layers": f"{NO_EFFECT}: as num_nextn_predict_layers (transformers' spelling)",
    "ep_size": f"{NO_EFFECT} (expert-parallel degree of the original code)",
    "aux_loss_alpha": f"{NO_EFFECT} (a training loss)",
    "seq_aux": f"{NO_EFFECT} (a training loss)",
    "auto_map": f"{NO_EFFECT} (where remote code lives; not run)",
    "pretraining_tp": "refused unless 1",
}


def config_from_hf(f: HFFields, quant: Quant | None, param_dtype: str | None) -> MLAConfig:
    """A DeepSeek-V3 config.json (checked by `f`) as an `MLAConfig`; defaults are
    transformers'."""
    f.only("moe_layer_freq", (1,), "MoE layers other than every layer after the dense ones "
                                   "are not implemented")
    f.only("topk_method", ("noaux_tc",), "only the biased sigmoid choice (noaux_tc) is "
                                         "implemented")
    f.only("scoring_func", ("sigmoid",), "only sigmoid router scores are implemented")
    f.only("attention_bias", (False,), "latent attention with biases is not implemented")
    f.only("pretraining_tp", (1,), "split linears are not implemented")
    heads = f.need("num_attention_heads")
    f.only("num_key_value_heads", (heads,), "latent attention expands a key and a value for "
                                            "every query head")
    nope, rot = f.get("qk_nope_head_dim", 128), f.get("qk_rope_head_dim", 64)
    f.only("head_dim", (rot,), "transformers writes qk_rope_head_dim there; another value "
                               "describes another model")
    f.only("qk_head_dim", (nope + rot,), "the query/key head is qk_nope_head_dim + "
                                         "qk_rope_head_dim")
    theta, scaling, longest = read_rope(f, int(f.get("max_position_embeddings", 4096)),
                                        10_000.0)
    shared = f.get("n_shared_experts", 1)
    return decoder_config(
        f, quant, param_dtype, intermediate=f.need("moe_intermediate_size"),
        norm_topk_prob=f.get("norm_topk_prob", True), qk_norm="none", sliding_window=None,
        rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope=(theta, scaling, longest), config_class=MLAConfig,
        expert_keys=("n_routed_experts",), any_model_type=True, head_dim=nope + rot,
        n_kv_heads=heads,
        n_dense_layers=min(f.get("first_k_dense_replace", 3), f.need("num_hidden_layers")),
        dense_intermediate=f.get("intermediate_size", 18_432),
        shared_expert_intermediate=shared * f.need("moe_intermediate_size"),
        router_scores="sigmoid", selection_bias=True,
        routed_scaling=float(f.get("routed_scaling_factor", 2.5)),
        n_groups=f.get("n_group", 8), topk_groups=f.get("topk_group", 4),
        q_lora_rank=f.get("q_lora_rank", 0), kv_lora_rank=f.get("kv_lora_rank", 512),
        qk_rope_dim=rot, v_head_dim=f.get("v_head_dim", 128),
        rope_interleave=bool(f.get("rope_interleave", True)))


def layer_tensors(config: MLAConfig, layer: int) -> Iterator[tuple]:
    """The loader's entries (`Family.layer_tensors`) of one layer's non-expert tensors."""
    c, hf, ours = config, TENSORS.layer(layer), f"layers.{layer}."
    h, n = c.hidden_size, c.n_heads
    yield ours + "input_norm.weight", hf + "input_layernorm.weight", (h,), False
    yield ours + "post_attn_norm.weight", hf + "post_attention_layernorm.weight", (h,), False
    at, mine = hf + "self_attn.", ours + "attn."
    if c.q_lora_rank:
        yield mine + "q_a_proj", at + "q_a_proj.weight", (c.q_lora_rank, h), True
        yield mine + "q_norm.weight", at + "q_a_layernorm.weight", (c.q_lora_rank,), False
        yield (mine + "q_b_proj", at + "q_b_proj.weight", (n * c.head_dim, c.q_lora_rank),
               True)
    else:
        yield mine + "q_proj", at + "q_proj.weight", (n * c.head_dim, h), True
    yield (mine + "kv_a_proj", at + "kv_a_proj_with_mqa.weight",
           (c.kv_lora_rank + c.qk_rope_dim, h), True)
    yield mine + "kv_norm.weight", at + "kv_a_layernorm.weight", (c.kv_lora_rank,), False
    yield (mine + "kv_b_proj", at + "kv_b_proj.weight",
           (n * (c.qk_nope_dim + c.v_head_dim), c.kv_lora_rank), True)
    yield mine + "o_proj", at + "o_proj.weight", (h, n * c.v_head_dim), True
    yield from sigmoid_moe_tensors(c, layer, TENSORS)


def deepseek_v3() -> MLAConfig:
    """DeepSeek-V3 (and R1, V3.1): 61 layers, MLA with 128 heads (queries through rank 1536,
    latent 512, heads of 128 + 64, values 128), the first 3 layers dense (width 18432), then
    256 routed experts of width 2048, top-8 (8 groups, 4 kept, scaling 2.5) and one shared
    expert; YaRN x40 over 4096 positions."""
    return MLAConfig(
        name="deepseek-v3", vocab_size=129_280, hidden_size=7168, n_layers=61, n_heads=128,
        n_kv_heads=128, head_dim=192, n_experts=256, top_k=8, expert_intermediate=2048,
        n_dense_layers=3, dense_intermediate=18_432, shared_expert_intermediate=2048,
        router_scores="sigmoid", norm_topk_prob=True, routed_scaling=2.5, selection_bias=True,
        n_groups=8, topk_groups=4, rope_theta=10_000.0, rms_norm_eps=1e-6,
        rope_scaling=RopeScaling("yarn", 40.0, 4096, None, 32.0, 1.0, 1.0, 1.0),
        max_seq_len=163_840, q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64,
        v_head_dim=128, rope_interleave=True)


FAMILY = Family(
    architecture=ARCHITECTURE, label="DeepSeek-V3", model_type="deepseek_v3", fields=FIELDS,
    tensors=TENSORS, config_from_hf=config_from_hf, presets={"deepseek-v3": deepseek_v3},
    layer_tensors=layer_tensors,
    skipped=lambda config, hf: deepseek_style_skips(TENSORS, config, hf))
