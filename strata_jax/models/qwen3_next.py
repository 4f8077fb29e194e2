"""Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, and the text
model of `Qwen3_5MoeForConditionalGeneration`): hybrid models of Gated DeltaNet and gated
attention layers, each followed by an MoE with a gated shared expert (`models.hybrid`).

Their checkpoints differ in how the DeltaNet's input projections are stored: Qwen3-Next fuses
q, k, v and z into `in_proj_qkvz` and b, a into `in_proj_ba`, grouped by key head (each key
head's q, k, then its value heads' v and z); Qwen3.5 stores `in_proj_qkv`, `in_proj_z`,
`in_proj_b` and `in_proj_a` apart. Both load into the model's one `in_proj` and `in_gates`
(columns reordered, an exact permutation). Qwen3.5's M-RoPE gives text three equal position
ids (time, height, width), which makes it plain RoPE over the rotated dims: prompts here are
text, so `mrope_section` and `mrope_interleaved` are read and have no effect. The multimodal
checkpoint's vision tower (`model.visual.`) and both families' multi-token-prediction layers
(`mtp.`) are skipped by name, and the loader says so.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from strata_jax.models.hf_config import (COMMON_FIELDS, HONOURED, NO_EFFECT, CheckpointError,
                                         Family, HFFields, Quant, TensorNames, decoder_config,
                                         read_rope, refuse, rotary_dim)
from strata_jax.models.hybrid import FULL, LINEAR, HybridConfig

TENSORS = TensorNames("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))
VL_TENSORS = dataclasses.replace(TENSORS, model_prefix="model.language_model.")
MTP_SKIP = {"mtp.": "multi-token-prediction layers (speculative decoding; a prefill does not "
                    "use them)"}

_SHARED = {
    **COMMON_FIELDS,
    "partial_rotary_factor": "honoured: the rotated part of each attention head",
    "attention_bias": HONOURED,
    "linear_conv_kernel_dim": HONOURED,
    "linear_key_head_dim": HONOURED,
    "linear_value_head_dim": HONOURED,
    "linear_num_key_heads": HONOURED,
    "linear_num_value_heads": HONOURED,
    "layer_types": "honoured: linear_attention (Gated DeltaNet) or full_attention per layer",
    "full_attention_interval": ("honoured without layer_types: every n-th layer is full "
                                "attention"),
    "moe_intermediate_size": HONOURED,
    "shared_expert_intermediate_size": HONOURED,
    "attn_output_gate": "refused unless true (the gated attention)",
    "mtp_num_hidden_layers": f"{NO_EFFECT}: the mtp.* tensors are skipped",
    "mtp_use_dedicated_embeddings": f"{NO_EFFECT}: the mtp.* tensors are skipped",
}

NEXT_FIELDS = {
    **_SHARED,
    "norm_topk_prob": HONOURED,
    "decoder_sparse_step": "refused unless 1 (dense layers)",
    "mlp_only_layers": "refused unless empty (dense layers)",
    "intermediate_size": f"{NO_EFFECT} (dense MLP width; every layer is MoE)",
    "use_sliding_window": "refused unless false",
    "sliding_window": f"{NO_EFFECT} unless use_sliding_window",
    "max_window_layers": f"{NO_EFFECT} unless use_sliding_window",
}

TEXT35_FIELDS = {
    **_SHARED,
    "norm_topk_prob": "refused unless true (Qwen3.5 always renormalises the top k)",
    "rope_parameters": ("honoured (5.x spelling): as rope_theta and rope_scaling; M-RoPE's "
                        "mrope_section / mrope_interleaved have no effect on text"),
}

VL35_FIELDS = {
    "architectures": "honoured: picks the architecture",
    "model_type": "refused unless it names the architecture",
    "text_config": "honoured: the text model, read as Qwen3_5MoeForCausalLM's fields",
    "vision_config": f"{NO_EFFECT}: the vision tower (model.visual.*) is skipped; text in only",
    "image_token_id": f"{NO_EFFECT} (text in only)",
    "video_token_id": f"{NO_EFFECT} (text in only)",
    "vision_start_token_id": f"{NO_EFFECT} (text in only)",
    "vision_end_token_id": f"{NO_EFFECT} (text in only)",
    "tie_word_embeddings": "honoured (refused if text_config's differs)",
    "dtype": COMMON_FIELDS["dtype"],
    "torch_dtype": COMMON_FIELDS["torch_dtype"],
    "quantization_config": COMMON_FIELDS["quantization_config"],
}


def _mixers(f: HFFields) -> tuple[str, ...]:
    n = f.need("num_hidden_layers")
    types = f.get("layer_types")
    if types is None:
        every = f.get("full_attention_interval", 4)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise refuse("full_attention_interval", every, "expected a positive integer")
        return tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(n))
    if not isinstance(types, list) or len(types) != n:
        raise refuse("layer_types", types, f"expected a list of {n} layer kinds")
    unknown = sorted({t for t in types if t not in (LINEAR, FULL)})
    if unknown:
        raise refuse("layer_types", unknown, f"implemented layer kinds: {LINEAR}, {FULL}")
    return tuple(types)


def config_from_hf(f: HFFields, quant: Quant | None, param_dtype: str | None) -> HybridConfig:
    """A Qwen3-Next or Qwen3.5-MoE text config.json (checked by `f`) as a `HybridConfig`;
    defaults are transformers'."""
    next_ = f.family.model_type == "qwen3_next"
    if next_:
        f.only("mlp_only_layers", ([], None), "dense MLP layers are not implemented")
        f.only("decoder_sparse_step", (1,), "dense MLP layers are not implemented")
        f.only("use_sliding_window", (False, None), "Qwen3-Next's attention has no window")
    else:
        f.only("norm_topk_prob", (True, None), "Qwen3.5's router renormalises the top k")
    f.only("attn_output_gate", (True, None), "attention without its output gate is not "
                                             "implemented")
    max_position = int(f.get("max_position_embeddings", 32_768))
    theta, scaling, longest, partial = read_rope(
        f, max_position, 10_000.0, partial=True,
        no_effect=("mrope_section", "mrope_interleaved"))  # text ids: plain RoPE
    return decoder_config(
        f, quant, param_dtype, intermediate=f.need("moe_intermediate_size"),
        norm_topk_prob=f.get("norm_topk_prob", True), qk_norm="per_head", sliding_window=None,
        rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=32_768,
        rope=(theta, scaling, longest), config_class=HybridConfig,
        shared_expert_intermediate=f.need("shared_expert_intermediate_size"),
        shared_expert_gate=True, mixers=_mixers(f),
        linear_k_heads=f.get("linear_num_key_heads", 16),
        linear_v_heads=f.get("linear_num_value_heads", 32),
        linear_k_dim=f.get("linear_key_head_dim", 128),
        linear_v_dim=f.get("linear_value_head_dim", 128),
        conv_kernel=f.get("linear_conv_kernel_dim", 4),
        rotary_dim=rotary_dim(f.get("head_dim", 256), partial))


def config_from_vl(f: HFFields, quant: Quant | None, param_dtype: str | None) -> HybridConfig:
    """A `Qwen3_5MoeForConditionalGeneration` config.json: its text_config (with the top
    level's dtype and tie_word_embeddings) read as the text model's."""
    f.only("model_type", (f.family.model_type,),
           f"{f.arch} checkpoints have model_type {f.family.model_type!r}")
    text = f.need("text_config")
    if not isinstance(text, dict):
        raise refuse("text_config", text, "expected an object of the text model's fields")
    text = dict(text)
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if key in f.hf and text.get(key, f.hf[key]) != f.hf[key]:
            raise CheckpointError(f"config.json {key}={f.hf[key]!r} and text_config's "
                                  f"{text[key]!r} disagree")
        if key in f.hf:
            text[key] = f.hf[key]
    return config_from_hf(HFFields(text, TEXT_VIEW), quant, param_dtype)


def _in_proj_order(c: HybridConfig) -> np.ndarray:
    """Columns of Qwen3-Next's in_proj_qkvz (grouped by key head: q, k, then the group's v and
    z) in the model's order (every q, every k, every v, every z)."""
    hk, dk, dv = c.linear_k_heads, c.linear_k_dim, c.linear_v_dim
    r = c.linear_v_heads // hk
    width = 2 * dk + 2 * r * dv
    g = np.arange(hk)[:, None] * width
    parts = [g + np.arange(dk), g + dk + np.arange(dk), g + 2 * dk + np.arange(r * dv),
             g + 2 * dk + r * dv + np.arange(r * dv)]
    return np.concatenate([p.reshape(-1) for p in parts])


def _gates_order(c: HybridConfig) -> np.ndarray:
    """Columns of Qwen3-Next's in_proj_ba (per key head: its value heads' b, then their a) in
    the model's order (every b, every a)."""
    r = c.linear_v_heads // c.linear_k_heads
    g = np.arange(c.linear_k_heads)[:, None] * 2 * r
    return np.concatenate([(g + np.arange(r)).reshape(-1), (g + r + np.arange(r)).reshape(-1)])


def layer_tensors(config: HybridConfig, layer: int, names: TensorNames, fused: bool
                  ) -> Iterator[tuple]:
    """The loader's entries (`Family.layer_tensors`) of one layer's non-expert tensors; `fused`:
    Qwen3-Next's fused DeltaNet projections."""
    c, hf, ours = config, names.layer(layer), f"layers.{layer}."
    h = c.hidden_size
    yield ours + "input_norm.centred_weight", hf + "input_layernorm.weight", (h,), False
    yield (ours + "post_attn_norm.centred_weight", hf + "post_attention_layernorm.weight", (h,),
           False)
    if c.is_linear(layer):
        la, mine = hf + "linear_attn.", ours + "linear_attn."
        kd, vd, hv = c.linear_k_heads * c.linear_k_dim, c.linear_v_heads * c.linear_v_dim, \
            c.linear_v_heads
        if fused:
            cols, gcols = _in_proj_order(c), _gates_order(c)
            yield (mine + "in_proj", (la + "in_proj_qkvz.weight",), ((2 * kd + 2 * vd, h),),
                   True, lambda a: a[0][:, cols])
            yield (mine + "in_gates", (la + "in_proj_ba.weight",), ((2 * hv, h),), True,
                   lambda a: a[0][:, gcols])
        else:
            yield (mine + "in_proj", (la + "in_proj_qkv.weight", la + "in_proj_z.weight"),
                   ((2 * kd + vd, h), (vd, h)), True, lambda a: np.concatenate(a, axis=1))
            yield (mine + "in_gates", (la + "in_proj_b.weight", la + "in_proj_a.weight"),
                   ((hv, h), (hv, h)), True, lambda a: np.concatenate(a, axis=1))
        conv = c.linear_conv_dim
        yield (mine + "conv", (la + "conv1d.weight",), ((conv, 1, c.conv_kernel),), False,
               lambda a: a[0][:, 0, :].T)
        yield mine + "dt_bias", la + "dt_bias", (hv,), False
        yield mine + "A_log", la + "A_log", (hv,), False
        yield mine + "norm.weight", la + "norm.weight", (c.linear_v_dim,), False
        yield mine + "out_proj", la + "out_proj.weight", (h, vd), True
    else:
        at, mine = hf + "self_attn.", ours + "attn."
        for proj, out in (("q_proj", 2 * c.q_dim), ("k_proj", c.kv_dim), ("v_proj", c.kv_dim)):
            yield mine + proj, at + f"{proj}.weight", (out, h), True
        yield mine + "o_proj", at + "o_proj.weight", (h, c.q_dim), True
        for proj, out in (("q", 2 * c.q_dim), ("k", c.kv_dim), ("v", c.kv_dim), ("o", h)):
            if proj in c.attention_biases:
                yield mine + f"{proj}_bias", at + f"{proj}_proj.bias", (out,), False
        for norm in ("q_norm", "k_norm"):
            yield mine + f"{norm}.centred_weight", at + f"{norm}.weight", (c.head_dim,), False
    moe, mine = hf + f"{names.moe_prefix}.", ours + "mlp."
    yield mine + "router", moe + f"{names.router}.weight", (c.n_experts, h), True
    si = c.shared_expert_intermediate
    for ours_name, proj, shape in (("gate", "gate_proj", (si, h)), ("up", "up_proj", (si, h)),
                                   ("down", "down_proj", (h, si))):
        yield mine + f"shared.{ours_name}", moe + f"shared_expert.{proj}.weight", shape, True
    yield mine + "shared_gate", moe + "shared_expert_gate.weight", (1, h), True


def _published(name: str, vocab: int, layers: int, experts: int, top_k: int) -> HybridConfig:
    """The shape both families publish: hidden 2048, every fourth layer gated attention (16
    query / 2 KV heads of 256, a quarter rotated), the others Gated DeltaNet (16 key / 32 value
    heads of 128, 4 conv taps), experts and shared expert of width 512."""
    return HybridConfig(
        name=name, vocab_size=vocab, hidden_size=2048, n_layers=layers, n_heads=16,
        n_kv_heads=2, head_dim=256, n_experts=experts, top_k=top_k, expert_intermediate=512,
        shared_expert_intermediate=512, shared_expert_gate=True, norm_topk_prob=True,
        qk_norm="per_head", rope_theta=10_000_000.0, rms_norm_eps=1e-6, max_seq_len=262_144,
        mixers=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)),
        linear_k_heads=16, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128,
        conv_kernel=4, rotary_dim=64)


def qwen3_next_80b_a3b() -> HybridConfig:
    """Qwen3-Next-80B-A3B: 48 layers (Gated DeltaNet, every fourth gated attention), 512
    experts of width 512 per layer, top-10, and a gated shared expert."""
    return _published("qwen3-next-80b-a3b", 151_936, 48, 512, 10)


def qwen3_5_35b_a3b() -> HybridConfig:
    """Qwen3.5-35B-A3B (its text model): 40 layers (Gated DeltaNet, every fourth gated
    attention), 256 experts of width 512 per layer, top-8, and a gated shared expert."""
    return _published("qwen3.5-35b-a3b", 248_320, 40, 256, 8)


FAMILY = Family(
    architecture="Qwen3NextForCausalLM", label="Qwen3-Next", model_type="qwen3_next",
    fields=NEXT_FIELDS, tensors=TENSORS, config_from_hf=config_from_hf,
    presets={"qwen3-next-80b-a3b": qwen3_next_80b_a3b},
    layer_tensors=lambda config, layer: layer_tensors(config, layer, TENSORS, True),
    skipped=MTP_SKIP, final_norm="final_norm.centred_weight")

TEXT35 = Family(
    architecture="Qwen3_5MoeForCausalLM", label="Qwen3.5-MoE", model_type="qwen3_5_moe_text",
    fields=TEXT35_FIELDS, tensors=TENSORS, config_from_hf=config_from_hf,
    presets={"qwen3.5-35b-a3b": qwen3_5_35b_a3b},
    layer_tensors=lambda config, layer: layer_tensors(config, layer, TENSORS, False),
    skipped=MTP_SKIP, final_norm="final_norm.centred_weight")

# The text model as the multimodal checkpoint holds it (its tensors under language_model).
TEXT_VIEW = dataclasses.replace(TEXT35, tensors=VL_TENSORS)

VL35 = Family(
    architecture="Qwen3_5MoeForConditionalGeneration", label="Qwen3.5-MoE (multimodal)",
    model_type="qwen3_5_moe", fields=VL35_FIELDS, tensors=VL_TENSORS,
    config_from_hf=config_from_vl, presets={},
    layer_tensors=lambda config, layer: layer_tensors(config, layer, VL_TENSORS, False),
    skipped={"model.visual.": "the vision tower (text in only)", **MTP_SKIP},
    final_norm="final_norm.centred_weight")

FAMILIES = (FAMILY, TEXT35, VL35)
