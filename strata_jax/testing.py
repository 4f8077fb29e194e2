"""Test helpers: one tolerance table and a finite-first closeness check; Hugging Face
checkpoints written from a model's params; a chunked read of a model against its one-shot logits.

Guards against tolerances drifting test by test and against NaN passing a loose comparison
(`assert_allclose` with NaN on both sides, or an infinite error hidden by a large atol).
"""

from __future__ import annotations

import itertools
import json
import pathlib

import ml_dtypes
import numpy as np

# dtype of the computation -> (rtol, atol) against the float64 reference. bfloat16 keeps 8 bits of
# mantissa, so logits of magnitude ~5 after a few layers land within a few 1e-2.
TOLERANCES: dict[np.dtype, tuple[float, float]] = {
    np.dtype(np.float64): (1e-10, 1e-10),
    np.dtype(np.float32): (1e-4, 1e-4),
    np.dtype(np.float16): (1e-2, 1e-2),
    np.dtype(ml_dtypes.bfloat16): (5e-2, 1e-1),
}


def tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol) for computations in `dtype`."""
    dtype = np.dtype(dtype)
    if dtype not in TOLERANCES:
        raise KeyError(f"no tolerance for dtype {dtype}; known: {[str(d) for d in TOLERANCES]}")
    return TOLERANCES[dtype]


def assert_close(actual, expected, dtype, *, err_msg: str = "") -> None:
    """Asserts `actual` is finite and within the tolerance of `dtype` of `expected`.

    Args:
        actual: array from the computation under test.
        expected: reference array (usually float64).
        dtype: dtype the computation ran in; picks the row of `TOLERANCES`.
        err_msg: extra context for the failure message.
    """
    actual = np.asarray(actual).astype(np.float64)
    expected = np.asarray(expected).astype(np.float64)
    bad = ~np.isfinite(actual)
    if bad.any():
        raise AssertionError(
            f"{err_msg} output has {int(bad.sum())} non-finite values of {actual.size} "
            f"(first at {np.argwhere(bad)[0].tolist()})")
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=err_msg)


# Preset -> (architecture, the MoE block's module name, its gate/up/down projection names).
HF_ARCH = {
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral-8x7b": ("MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2")),
    "olmoe-1b-7b": ("OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
}


def hf_config(c, arch: str) -> dict:
    """The config.json fields of `c` for architecture `arch` (transformers 4 spellings)."""
    cfg = dict(architectures=[arch], vocab_size=c.vocab_size, hidden_size=c.hidden_size,
               num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
               num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
               num_experts_per_tok=c.top_k, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
               tie_word_embeddings=c.tie_embeddings, max_position_embeddings=c.max_seq_len,
               torch_dtype=c.param_dtype)
    if arch == "MixtralForCausalLM":
        cfg.update(num_local_experts=c.n_experts, intermediate_size=c.expert_intermediate)
    elif arch == "Qwen3MoeForCausalLM":
        cfg.update(num_experts=c.n_experts, moe_intermediate_size=c.expert_intermediate,
                   norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        cfg.update(num_experts=c.n_experts, intermediate_size=c.expert_intermediate,
                   norm_topk_prob=c.norm_topk_prob, clip_qkv=None)
    return cfg


def hf_tensors(c, params, preset):
    """Our flat params in Hugging Face names and [out, in] layout, written out by hand."""
    _, moe, (g, u, d) = HF_ARCH[preset]
    t = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm.weight"],
         "lm_head.weight": params["lm_head"].T}
    for l in range(c.n_layers):
        p, q = f"layers.{l}.", f"model.layers.{l}."
        t[q + "input_layernorm.weight"] = params[p + "input_norm.weight"]
        t[q + "post_attention_layernorm.weight"] = params[p + "post_attn_norm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[q + f"self_attn.{proj}.weight"] = params[p + f"attn.{proj}"].T
        if c.attention_bias:
            for b in "qkvo":
                t[q + f"self_attn.{b}_proj.bias"] = params[p + f"attn.{b}_bias"]
        if c.qk_norm != "none":
            t[q + "self_attn.q_norm.weight"] = params[p + "attn.q_norm.weight"]
            t[q + "self_attn.k_norm.weight"] = params[p + "attn.k_norm.weight"]
        t[q + f"{moe}.gate.weight"] = params[p + "mlp.router"].T
        for ours, hf in zip(("gate", "up", "down"), (g, u, d)):
            w = params[p + f"mlp.{ours}"]  # once a layer: a lazy mapping makes it on each access
            for e in range(c.n_experts):
                t[q + f"{moe}.experts.{e}.{hf}.weight"] = w[e].T
    return {k: np.ascontiguousarray(v) for k, v in t.items()}


def write_hf_checkpoint(path, c, preset, tensors, *, shards=2, **fields):
    """Writes tensors in `shards` files and config.json (hf_config with `fields` over it; a
    field given as None is removed)."""
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = hf_config(c, HF_ARCH[preset][0])
    cfg.update(fields)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (path / "config.json").write_text(json.dumps(cfg))


def read_in_chunks(model, tokens, bounds, cache):
    """Yields (lo, hi, logits) of `model` reading `tokens` in the chunks [lo, hi) of consecutive
    `bounds` (`model.forward`: the first from position 0, the others over the cache the ones
    before filled)."""
    from .model import forward

    for lo, hi in itertools.pairwise(bounds):
        logits, cache, _ = forward(model, tokens[lo:hi], cache, lo)
        yield lo, hi, logits
