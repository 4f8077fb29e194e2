"""Test helpers: one tolerance table and a finite-first closeness check; Hugging Face
checkpoints written from a model's params (plain, FP8 and GPTQ layouts); a chunked read of a
model against its one-shot logits; an expert source that poisons unrouted experts; random
inputs of the gated delta rule.

Guards against tolerances drifting test by test and against NaN passing a loose comparison
(`assert_allclose` with NaN on both sides, or an infinite error hidden by a large atol).
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import struct
import time

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from strata_jax.formats import act_order_g_idx, mxfp4_to_blocks_np
from strata_jax.models import forward

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


class PoisonUnrouted:
    """An expert source (`ExpertSource`) that replaces every unrouted expert's rows with NaN,
    as a worst-case streamed buffer: a forward pass through it equals the resident one only if
    no unrouted expert is read. `calls` records (layer, counts shape, counts dtype)."""

    def __init__(self):
        self.calls = []

    def expert_weights(self, layer, counts, resident):
        assert isinstance(layer, int)
        self.calls.append((layer, counts.shape, counts.dtype))
        keep = counts > 0  # every plane's rows of an unrouted expert (biases too) poisoned
        return resident._replace(**{
            name: jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a, jnp.nan)
            for name, a in resident._asdict().items()})


def delta_rule_inputs(t: int, hv: int, dk: int, dv: int, seed: int, *, decay_shift: float = 0.0,
                      state_scale: float = 1.0):
    """Random float64 inputs of the gated delta rule: q, k [T, Hv, dk] unit rows (q scaled by
    dk^-1/2), v [T, Hv, dv], log-decays g = -softplus(N(0, 1) + decay_shift) and beta =
    sigmoid(N(0, 1)) [T, Hv], and a state [Hv, dk, dv] of N(0, state_scale^2)."""
    rng = np.random.default_rng(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
    q = unit(rng.standard_normal((t, hv, dk))) * dk ** -0.5
    k = unit(rng.standard_normal((t, hv, dk)))
    v = rng.standard_normal((t, hv, dv))
    g = -np.log1p(np.exp(rng.standard_normal((t, hv)) + decay_shift))
    beta = 1 / (1 + np.exp(-rng.standard_normal((t, hv))))
    return q, k, v, g, beta, state_scale * rng.standard_normal((hv, dk, dv))


# Preset -> (architecture, the MoE block's module name, its gate/up/down projection names).
HF_ARCH = {
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral-8x7b": ("MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2")),
    "olmoe-1b-7b": ("OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "gpt-oss-20b": ("GptOssForCausalLM", "mlp", ("gate_up_proj", "gate_up_proj", "down_proj")),
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
    elif arch == "GptOssForCausalLM":
        r = c.rope_scaling
        cfg.update(num_local_experts=c.n_experts, intermediate_size=c.expert_intermediate,
                   attention_bias=c.attention_bias, sliding_window=c.sliding_window,
                   layer_types=list(c.layer_types), swiglu_limit=c.swiglu_limit,
                   swiglu_alpha=c.swiglu_alpha, model_type="gpt_oss",
                   rope_scaling=None if r is None else {
                       "rope_type": r.rope_type, "factor": r.factor, "beta_fast": r.beta_fast,
                       "beta_slow": r.beta_slow, "truncate": r.truncate,
                       "original_max_position_embeddings": r.original_max_position_embeddings})
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
            for b in c.attention_biases:
                t[q + f"self_attn.{b}_proj.bias"] = params[p + f"attn.{b}_bias"]
        if c.qk_norm != "none":
            t[q + "self_attn.q_norm.weight"] = params[p + "attn.q_norm.weight"]
            t[q + "self_attn.k_norm.weight"] = params[p + "attn.k_norm.weight"]
        if c.attention_sinks:
            t[q + "self_attn.sinks"] = params[p + "attn.sinks"]
        if preset.startswith("gpt-oss"):
            t.update(_gpt_oss_layer(c, params, p, q))
            continue
        t[q + f"{moe}.gate.weight"] = params[p + "mlp.router"].T
        for ours, hf in zip(("gate", "up", "down"), (g, u, d)):
            w = params[p + f"mlp.{ours}"]  # once a layer: a lazy mapping makes it on each access
            for e in range(c.n_experts):
                t[q + f"{moe}.experts.{e}.{hf}.weight"] = w[e].T
    return {k: np.ascontiguousarray(v) for k, v in t.items()}


def _interleave(even, odd, axis: int):
    """even and odd stacked alternately along `axis` (gpt-oss's gate and up)."""
    both = np.stack([even, odd], axis=axis + 1)
    shape = list(even.shape)
    shape[axis] *= 2
    return both.reshape(shape)


def _gpt_oss_layer(c, params, p: str, q: str) -> dict:
    """One gpt-oss layer's router and fused experts in Hugging Face names: `mlp.router`
    (weight [E, H], bias), `mlp.experts.gate_up_proj` [E, H, 2I] (gate the even outputs) and
    its bias, `down_proj` [E, I, H] and its bias."""
    m, x = p + "mlp.", q + "mlp.experts."
    t = {q + "mlp.router.weight": params[m + "router"].T,
         q + "mlp.router.bias": params[m + "router_bias"],
         x + "gate_up_proj": _interleave(params[m + "gate"], params[m + "up"], 2),
         x + "down_proj": params[m + "down"]}
    if c.expert_bias:
        t[x + "gate_up_proj_bias"] = _interleave(params[m + "gate_bias"], params[m + "up_bias"], 1)
        t[x + "down_proj_bias"] = params[m + "down_bias"]
    return t


def gpt_oss_mxfp4(c, tensors, planes_of) -> dict:
    """`tensors` (a gpt-oss checkpoint's, `hf_tensors`) with each MoE layer's gate_up_proj and
    down_proj replaced by MXFP4 `_blocks` and `_scales` in the published layout, from that
    layer's mxfp4 planes (`planes_of(layer)`: gate, gate_scale, ... as
    `ExpertFormat.quantize_np` makes them)."""
    out = dict(tensors)
    for l in c.moe_layers:
        x = f"model.layers.{l}.mlp.experts."
        planes = planes_of(l)
        conv = {m: mxfp4_to_blocks_np(planes[m], planes[m + "_scale"])
                for m in ("gate", "up", "down")}
        del out[x + "gate_up_proj"], out[x + "down_proj"]
        out[x + "gate_up_proj_blocks"] = _interleave(conv["gate"][0], conv["up"][0], 1)
        out[x + "gate_up_proj_scales"] = _interleave(conv["gate"][1], conv["up"][1], 1)
        out[x + "down_proj_blocks"], out[x + "down_proj_scales"] = conv["down"]
    return out


# ---- quantized Hugging Face checkpoints, written by hand in the published layouts ---------------

# NumPy dtype -> safetensors dtype name, for `save_safetensors`.
_ST_NAMES = {np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(np.float16): "F16", np.dtype(np.float32): "F32",
             np.dtype(np.float64): "F64", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64",
             np.dtype(np.uint8): "U8"}


def save_safetensors(tensors, path) -> None:
    """Writes `tensors` (name -> NumPy array) as safetensors file `path` (the argument order of
    `safetensors.numpy.save_file`), byte by byte: an 8-byte
    little-endian header length, the JSON header (dtype, shape, data offsets per tensor), the
    data. safetensors.numpy has no float8 or bfloat16 writer."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        raw = a.tobytes()
        header[name] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    head = json.dumps(header).encode()
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def _quantized_linears(tensors, keep) -> list[str]:
    """The modules `hf_quantize` quantizes: attention q/k/v/o and routed experts, less `keep`."""
    out = []
    for name in sorted(tensors):
        module = name[:-len(".weight")]
        if name.endswith(".weight") and module not in keep and (
                ".self_attn." in name and name.endswith("_proj.weight") or ".experts." in name):
            out.append(module)
    return out


def fp8_block_quantize(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """A [out, in] weight as an FP8 checkpoint stores it: (`weight` float8_e4m3fn [out, in],
    `weight_scale_inv` float32 [ceil(out/b), ceil(in/b)]), per b x b block scale = amax / 448
    (1 for a zero block) in float32, weight = e4m3(w / scale) rounded to nearest; w is about
    weight * scale."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = np.zeros((nb * block, kb * block), np.float32)
    padded[:n, :k] = np.abs(w)
    amax = padded.reshape(nb, block, kb, block).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    full = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)[:n, :k]
    q = np.clip(w.astype(np.float32) / full, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def gptq_quantize(w: np.ndarray, group: int, *, v2: bool = False, sym: bool = True,
                  act_order: bool = False) -> dict[str, np.ndarray]:
    """A [out, in] weight as a 4-bit GPTQ checkpoint stores it (round to nearest, no
    calibration): per group of `group` inputs and output column, symmetric: scale = 2 amax / 15
    (1 for a zero group) in float16 and the zero z = 8; asymmetric (`sym` False): scale =
    (max(hi, 0) - min(lo, 0)) / 15 in float16 and z = clamp(round(-min(lo, 0) / scale), 1, 15)
    (from 1: GPTQ v1 stores z - 1 in four bits); q = clamp(round(w / scale) + z, 0, 15) with
    that float16 scale; `qweight` int32 [in/8, out] (input row 8r + j in bits 4j..4j+3 of word
    r), `scales` float16 [in/group, out], `qzeros` int32 [in/group, out/8] (z in each nibble,
    stored minus one in checkpoint_format gptq, as is in gptq_v2), `g_idx` int32 [in] =
    k // group, or with `act_order` (desc_act) each row's group when the inputs are taken in
    descending order of their rows' largest magnitude, `group` at a time (the rows keep their
    place in `qweight`)."""

    wt = w.T.astype(np.float32)  # [in, out]
    k, n = wt.shape
    g_idx = (act_order_g_idx(wt[None], group)[0] if act_order
             else (np.arange(k) // group).astype(np.int32))
    by_group = np.argsort(g_idx, kind="stable")  # rows of group 0, then 1, ...
    g = wt[by_group].reshape(k // group, group, n)
    if sym:
        amax = np.abs(g).max(axis=1)
        scale = np.where(amax > 0, 2 * amax / 15, 1).astype(np.float16)
        z = np.full((k // group, n), 8, np.int64)
    else:
        lo, hi = np.minimum(g.min(axis=1), 0), np.maximum(g.max(axis=1), 0)
        scale = np.where(hi > lo, (hi - lo) / 15, 1).astype(np.float16)
        z = np.clip(np.round(-lo / scale.astype(np.float32)), 1, 15).astype(np.int64)
    full = scale.astype(np.float32)[g_idx]  # GPTQ packs with the fp16 scale
    q = np.clip(np.round(wt / full) + z[g_idx], 0, 15).astype(np.uint32)
    shifts = np.arange(8, dtype=np.uint32) * 4
    qweight = np.bitwise_or.reduce(q.reshape(k // 8, 8, n) << shifts[:, None], axis=1)
    zero = (z - (0 if v2 else 1)).astype(np.uint32).reshape(k // group, n // 8, 8)
    qzeros = np.bitwise_or.reduce(zero << shifts, axis=2)
    out = {"qweight": qweight.view(np.int32), "scales": scale,
           "qzeros": qzeros.view(np.int32), "g_idx": g_idx}
    return {name: np.ascontiguousarray(a) for name, a in out.items()}


def hf_quantize(tensors, method: str, block: int, *, keep=(), v2: bool = False,
                sym: bool = True, act_order: bool = False):
    """`hf_tensors`' checkpoint as an FP8 ("fp8", as Qwen/Qwen3-30B-A3B-FP8) or 4-bit GPTQ
    ("gptq", as Qwen/Qwen3-30B-A3B-GPTQ-Int4; `sym` False: with zero-points; `act_order`:
    desc_act's g_idx) one: every
    attention projection and routed expert quantized (but the modules in `keep`), with `block`
    the FP8 block side or the GPTQ group; the routers, norms, embedding and lm_head as they
    were."""
    out = dict(tensors)
    for module in _quantized_linears(tensors, keep):
        w = out.pop(f"{module}.weight")
        if method == "fp8":
            q, scale = fp8_block_quantize(w, block)
            out[f"{module}.weight"], out[f"{module}.weight_scale_inv"] = q, scale
        else:
            out.update({f"{module}.{k}": v
                        for k, v in gptq_quantize(w, block, v2=v2, sym=sym,
                                                  act_order=act_order).items()})
    return out


def hf_quantization_config(c, preset, method: str, block: int, *, keep=(), **fields) -> dict:
    """The quantization_config of `hf_quantize(..., method, block, keep=keep)`'s checkpoint, as
    those checkpoints write it (FP8: modules_to_not_convert lists lm_head and each layer's
    norms and router), with `fields` over it (None removes)."""
    if method == "fp8":
        moe = HF_ARCH[preset][1]
        skip = ["lm_head", *keep]
        for l in range(c.n_layers):
            skip += [f"model.layers.{l}.{n}" for n in ("input_layernorm", f"{moe}.gate",
                                                       "post_attention_layernorm")]
        q = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
             "weight_block_size": [block, block], "modules_to_not_convert": skip}
    else:
        q = {"bits": 4, "checkpoint_format": "gptq", "damp_percent": 0.01, "desc_act": False,
             "group_size": block, "lm_head": False, "quant_method": "gptq",
             "static_groups": False, "sym": True, "true_sequential": True}
    q.update(fields)
    return {k: v for k, v in q.items() if v is not None}


def write_hf_checkpoint(path, c, preset, tensors, *, shards=2, **fields):
    """Writes tensors in `shards` files and config.json (hf_config with `fields` over it; a
    field given as None is removed)."""

    path = pathlib.Path(path)
    names = sorted(tensors)
    weight_map = {}
    # safetensors.numpy writes no float8 or bfloat16: those checkpoints are written by hand.
    raw = any(np.dtype(t.dtype) in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.bfloat16))
              for t in tensors.values())
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        # save_file writes an array's memory as it lies: C order first.
        (save_safetensors if raw else save_file)(
            {n: np.ascontiguousarray(tensors[n]) for n in part}, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = hf_config(c, HF_ARCH[preset][0])
    cfg.update(fields)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (path / "config.json").write_text(json.dumps(cfg))


def read_in_chunks(model, tokens, bounds, cache):
    """Yields (lo, hi, logits) of `model` reading `tokens` in the chunks [lo, hi) of consecutive
    `bounds` (`models.forward`: the first from position 0, the others over the cache the ones
    before filled)."""

    for lo, hi in itertools.pairwise(bounds):
        logits, cache, _ = forward(model, tokens[lo:hi], cache, lo)
        yield lo, hi, logits


def arm_reads(engine_cls, cfg, params, arms, *, check=None, seed: int = 2, **engine_kw) -> dict:
    """Each arm's reads for identity tests: a 200-token prompt in chunks, a 37-token follow-up
    turn on its session, the prompt again layer-major (each read's logits finite). `arms`:
    (name, StreamConfig or None) pairs; `engine_cls(cfg, params, stream, **engine_kw)` makes
    each engine; `check(engine, stream, reads)`, if given, runs on each arm's engine and
    reads. Returns {name: the six logits and KV hashes}, for the tests to compare."""
    rng = np.random.default_rng(seed)
    tokens, follow = rng.integers(0, cfg.vocab_size, 200), rng.integers(0, cfg.vocab_size, 37)
    out = {}
    for name, stream in arms:
        with engine_cls(cfg, params, stream, **engine_kw) as eng:
            first = eng.prefill(tokens)
            second = eng.prefill(follow, first.session)
            lm = eng.prefill(tokens, order="layer-major")
            assert np.isfinite(first.logits).all() and np.isfinite(lm.logits).all()
            if check is not None:
                check(eng, stream, (first, second, lm))
            out[name] = (first.logits_sha256(), first.kv_sha256(), second.logits_sha256(),
                         second.kv_sha256(), lm.logits_sha256(), lm.kv_sha256())
    return out


# config.json of Qwen3-30B-A3B as published (its keys and values), for loader tests.
QWEN3_30B_A3B_HF_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "vocab_size": 151936, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": []}


def thread_names() -> dict[str, str]:
    """This process's threads, id -> name (Linux: /proc/self/task/*/comm). The library names
    its own strata-issuer, strata-stager and strata-simlink."""
    names = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[tid] = f.read().strip()
        except OSError:  # the thread ended while we looked
            pass
    return names


def library_threads() -> int:
    """How many of this process's threads are the library's (named strata-*)."""
    return sum(n.startswith("strata-") for n in thread_names().values())


def settled(read, expected, timeout: float = 2.0):
    """`read()` once it equals `expected`, else its value after `timeout` seconds. For thread
    counts taken right after a close or an abort: a thread the library has joined can stay
    listed in /proc/self/task for a moment (the kernel wakes the joiner before it removes the
    exiting task), so one read may include it; a thread left running stays counted past the
    timeout."""

    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if value == expected or time.monotonic() >= deadline:
            return value
        time.sleep(0.01)


def library_threads_settled(expected: int, timeout: float = 2.0) -> int:
    """`library_threads()` once it equals `expected`, else its count after `timeout` seconds
    (see `settled`)."""
    return settled(library_threads, expected, timeout)
