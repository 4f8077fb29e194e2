"""Float64 NumPy reference of the whole forward pass, independent of the JAX model.

Guards against a model bug hiding behind a shared helper: nothing here imports the model. It
runs one whole sequence (positions 0..T-1, no cache), per-token expert loops instead of sorting and
grouped matmuls, and Hugging Face's conventions written out directly.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from strata_jax.config import ModelConfig
from strata_jax.formats import expert_format


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f64(weight)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _norm(x, p, name, eps):
    """RMSNorm `name` (".weight" or the zero-centred ".centred_weight", scale 1 + w)."""
    if name + ".centred_weight" in p:
        return _rms_norm(x, 1.0 + _f64(p[name + ".centred_weight"]), eps)
    return _rms_norm(x, p[name + ".weight"], eps)


def _rope_inv_freq(c: ModelConfig, d: int | None = None):
    """(inv_freq [d/2], cos/sin multiplier) of `d` rotated dims (default the config's), one
    frequency at a time from the formulas (Hugging Face transformers' modeling_rope_utils
    semantics for linear, dynamic and yarn)."""
    d, theta, s = d or c.rotated_dims, c.rope_theta, c.rope_scaling
    plain = [theta ** (-2.0 * i / d) for i in range(d // 2)]
    if s is None or s.rope_type == "dynamic":  # dynamic: plain up to its original length
        return np.array(plain), 1.0
    if s.rope_type == "linear":
        return np.array([f / s.factor for f in plain]), 1.0
    # yarn: ramp over the index between the dims that turn beta_fast and beta_slow times over the
    # original context (d_r = D ln(L / (2 pi r)) / (2 ln theta)), rounded outwards if truncate.
    length = s.original_max_position_embeddings
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1
    lo = d * np.log(length / (2 * np.pi * beta_fast)) / (2 * np.log(theta))
    hi = d * np.log(length / (2 * np.pi * beta_slow)) / (2 * np.log(theta))
    if s.truncate:
        lo, hi = np.floor(lo), np.ceil(hi)
    lo, hi = max(lo, 0.0), min(hi, d - 1.0)
    hi = hi + 0.001 if hi == lo else hi
    out = []
    for i, f in enumerate(plain):
        gamma = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: keep f; 1: f / factor
        out.append((1 - gamma) * f + gamma * f / s.factor)
    if s.attention_factor is not None:
        mult = s.attention_factor
    else:
        def m(scale, w):
            return 1.0 if scale <= 1 else 0.1 * w * np.log(scale) + 1.0
        mult = (m(s.factor, s.mscale) / m(s.factor, s.mscale_all_dim)
                if s.mscale and s.mscale_all_dim else m(s.factor, 1.0))
    return np.array(out), float(mult)


def _rope(x, positions, c: ModelConfig):
    d = c.rotated_dims
    if d < x.shape[-1]:  # partial rotary: the first d dims rotate, the rest pass
        return np.concatenate([_rope(x[..., :d], positions, c), x[..., d:]], axis=-1)
    inv_freq, mult = _rope_inv_freq(c)
    ang = positions[:, None].astype(np.float64) * inv_freq[None]  # [T, D/2]
    cos, sin = mult * np.cos(ang)[:, None, :], mult * np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _pairs_rope(x, positions, c: ModelConfig):
    """RoPE of x [T, heads, d] with the dims as interleaved pairs (x[2i], x[2i+1]) each
    rotated by frequency i (DeepSeek's layout), or half-split without rope_interleave."""
    d = x.shape[-1]
    inv_freq, mult = _rope_inv_freq(c, d)
    ang = positions[:, None].astype(np.float64) * inv_freq[None]  # [T, d/2]
    cos, sin = mult * np.cos(ang)[:, None, :], mult * np.sin(ang)[:, None, :]
    if not c.rope_interleave:
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 1::2] * cos + x[..., 0::2] * sin
    return out


def _mla_attention(c: ModelConfig, p, prefix, x):
    """Float64 multi-head latent attention from the published formulas (DeepSeek-V2/V3):
    queries from q_proj (or q_a_proj, RMSNorm, q_b_proj); the latent c = RMSNorm(x W_a[:R])
    and one rotary key from x W_a[R:] shared by every head; head h's key [c W_k,h | rotary
    key] and value c W_v,h; scores scaled by Dq^-1/2 and, with YaRN's mscale_all_dim, by
    (0.1 mscale_all_dim ln(factor) + 1)^2. The latent norms use eps 1e-6."""
    t, n = x.shape[0], c.n_heads
    dr, dv, r = c.qk_rope_dim, c.v_head_dim, c.kv_lora_rank
    dn = c.head_dim - dr
    if c.q_lora_rank:
        q = _rms_norm(x @ _f64(p[prefix + "q_a_proj"]), p[prefix + "q_norm.weight"], 1e-6)
        q = q @ _f64(p[prefix + "q_b_proj"])
    else:
        q = x @ _f64(p[prefix + "q_proj"])
    q = q.reshape(t, n, dn + dr)
    kv = x @ _f64(p[prefix + "kv_a_proj"])  # [T, R + Dr]
    latent = _rms_norm(kv[:, :r], p[prefix + "kv_norm.weight"], 1e-6)
    up = (latent @ _f64(p[prefix + "kv_b_proj"])).reshape(t, n, dn + dv)
    pos = np.arange(t)
    q_rot = _pairs_rope(q[..., dn:], pos, c)
    k_rot = _pairs_rope(kv[:, None, r:], pos, c)[:, 0]  # [T, Dr]
    scale = 1.0 / np.sqrt(dn + dr)
    s = c.rope_scaling
    if s is not None and s.rope_type == "yarn" and s.mscale_all_dim and s.factor > 1:
        scale *= (0.1 * s.mscale_all_dim * np.log(s.factor) + 1.0) ** 2
    seen = visible(pos, pos, None)
    out = np.zeros((t, n, dv))
    for h in range(n):
        scores = (q[:, h, :dn] @ up[:, h, :dn].T + q_rot[:, h] @ k_rot.T) * scale
        scores = np.where(seen, scores, -np.inf)
        e = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, h] = (e / e.sum(-1, keepdims=True)) @ up[:, h, dn:]
    return out.reshape(t, n * dv) @ _f64(p[prefix + "o_proj"])


def visible(q_pos, k_pos, window: int | None) -> np.ndarray:
    """bool [T, S]: the key at k_pos[s] counts for the query at q_pos[t]: k <= q, and with a
    sliding window q - window < k (Hugging Face masking_utils' sliding_window_overlay)."""
    q_pos, k_pos = np.asarray(q_pos)[:, None], np.asarray(k_pos)[None, :]
    seen = k_pos <= q_pos
    if window is not None:
        seen &= k_pos > q_pos - window
    return seen


def _softmax_rows(scores, sink=None):
    """Row softmax of scores [T, S] (-inf: not seen); with `sink` (a scalar logit), as
    transformers' gpt-oss eager attention: the sink joins each row as one more column, the
    row's max is subtracted, the softmax taken and the sink's column dropped."""
    if sink is not None:
        scores = np.concatenate([scores, np.full((scores.shape[0], 1), float(sink))], axis=1)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    probs = e / e.sum(-1, keepdims=True)
    return probs if sink is None else probs[:, :-1]


def _attention(c: ModelConfig, p, prefix, x, window: int | None):
    t = x.shape[0]
    q = x @ _f64(p[prefix + "q_proj"])
    gate = None
    if q.shape[1] == 2 * c.q_dim:  # gated attention: each head's queries, then its gate
        both = q.reshape(t, c.n_heads, 2, c.head_dim)
        q, gate = both[:, :, 0].reshape(t, c.q_dim), both[:, :, 1]
    k = x @ _f64(p[prefix + "k_proj"])
    v = x @ _f64(p[prefix + "v_proj"])
    if c.attention_bias:  # added before any q/k norm, as Hugging Face's nn.Linear(bias=True)
        q, k, v = (a + _f64(p[prefix + n]) for a, n in ((q, "q_bias"), (k, "k_bias"),
                                                         (v, "v_bias")))
    if c.qk_norm == "full":
        q = _rms_norm(q, p[prefix + "q_norm.weight"], c.rms_norm_eps)
        k = _rms_norm(k, p[prefix + "k_norm.weight"], c.rms_norm_eps)
    q = q.reshape(t, c.n_heads, c.head_dim)
    k = k.reshape(t, c.n_kv_heads, c.head_dim)
    v = v.reshape(t, c.n_kv_heads, c.head_dim)
    if c.qk_norm == "per_head":
        q = _norm(q, p, prefix + "q_norm", c.rms_norm_eps)
        k = _norm(k, p, prefix + "k_norm", c.rms_norm_eps)
    pos = np.arange(t)
    q, k = _rope(q, pos, c), _rope(k, pos, c)
    out = np.zeros_like(q)
    group = c.n_heads // c.n_kv_heads
    seen = visible(pos, pos, window)
    sinks = _f64(p[prefix + "sinks"]) if c.attention_sinks else None  # [N]
    for h in range(c.n_heads):
        kh = h // group  # query head h reads kv head h // group
        s = q[:, h] @ k[:, kh].T / np.sqrt(c.head_dim)  # [T, T]
        s = np.where(seen, s, -np.inf)
        out[:, h] = _softmax_rows(s, None if sinks is None else sinks[h]) @ v[:, kh]
    if gate is not None:
        out = out / (1.0 + np.exp(-gate))
    out = out.reshape(t, c.q_dim) @ _f64(p[prefix + "o_proj"])
    return out + _f64(p[prefix + "o_bias"]) if "o" in c.attention_biases else out


def reference_deltanet(c: ModelConfig, p, prefix: str, x, window=None, state=None):
    """Float64 Gated DeltaNet layer of a hybrid config, token by token from the published
    recurrence (the model computes it chunkwise): depthwise causal conv with SiLU over q, k, v
    continuing from `window` [K-1, C] (zeros: a prompt's start); q, k L2-normalised, q scaled
    by dk^-1/2; per value head S <- exp(g) S, then S <- S + k (beta (v - S^T k))^T, o = S^T q;
    the gated RMSNorm by z and out_proj.

    Returns (out [T, H], the next window, the next state [Hv, dk, dv])."""
    t = x.shape[0]
    hk, hv, dk, dv = c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim
    kd, vd, kk = hk * dk, hv * dv, c.conv_kernel
    proj = x @ _f64(p[prefix + "in_proj"])
    gates = x @ _f64(p[prefix + "in_gates"])
    mixed, z = proj[:, :2 * kd + vd], proj[:, 2 * kd + vd:]
    window = np.zeros((kk - 1, mixed.shape[1])) if window is None else _f64(window)
    full = np.concatenate([window, mixed])
    taps = _f64(p[prefix + "conv"])  # [K, C]
    conv = np.stack([sum(taps[j] * full[i + j] for j in range(kk)) for i in range(t)])
    conv = _silu(conv)
    q = conv[:, :kd].reshape(t, hk, dk)
    k = conv[:, kd:2 * kd].reshape(t, hk, dk)
    v = conv[:, 2 * kd:].reshape(t, hv, dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    beta = 1.0 / (1.0 + np.exp(-gates[:, :hv]))
    a = gates[:, hv:] + _f64(p[prefix + "dt_bias"])
    g = -np.exp(_f64(p[prefix + "A_log"])) * np.log1p(np.exp(a))
    s = np.zeros((hv, dk, dv)) if state is None else state
    rep = hv // hk
    out, s = reference_delta_rule(np.repeat(q, rep, 1), np.repeat(k, rep, 1), v, g, beta, s)
    normed = out / np.sqrt(np.mean(out * out, -1, keepdims=True) + c.rms_norm_eps)
    normed = normed * _f64(p[prefix + "norm.weight"]) * _silu(z.reshape(t, hv, dv))
    return normed.reshape(t, vd) @ _f64(p[prefix + "out_proj"]), full[t:], s


def reference_delta_rule(q, k, v, g, beta, state):
    """Float64 gated delta rule, token by token: per value head S <- exp(g) S, then
    S <- S + k (beta (v - S^T k))^T, o = S^T q. q, k [T, Hv, dk] (normalised, q scaled), v
    [T, Hv, dv], g and beta [T, Hv], state [Hv, dk, dv]. Returns (o [T, Hv, dv], the state)."""
    q, k, v, g, beta = (_f64(a) for a in (q, k, v, g, beta))
    s = _f64(state).copy()
    out = np.zeros(v.shape)
    for i in range(q.shape[0]):
        s *= np.exp(g[i])[:, None, None]
        err = v[i] - np.einsum("hkv,hk->hv", s, k[i])
        s += np.einsum("hk,hv->hkv", k[i], beta[i][:, None] * err)
        out[i] = np.einsum("hkv,hk->hv", s, q[i])
    return out, s


def reference_attention(q, k, v, positions, window: int | None = None,
                        sinks=None) -> np.ndarray:
    """float64 GQA attention of queries q [T, N, D] at `positions` over keys k/v [S, KVH, D]
    0..position, or position - window + 1..position with a sliding window (keys past the last
    query are never read, whatever they hold); `sinks` [N] (or None): each query head's sink
    logit, one more softmax column with no value (`_softmax_rows`)."""
    seen = int(np.max(positions)) + 1
    q, k, v = (_f64(a) for a in (q, k[:seen], v[:seen]))
    t, n, d = q.shape
    g = n // k.shape[1]
    out = np.zeros((t, n, d))
    for h in range(n):
        scores = q[:, h] @ k[:, h // g].T / np.sqrt(d)  # [T, S]
        scores[~visible(positions, np.arange(k.shape[0]), window)] = -np.inf
        out[:, h] = _softmax_rows(scores, None if sinks is None else _f64(sinks)[h]) @ v[:, h // g]
    return out


def _swiglu(x, gate, up, down):
    return (_silu(x @ gate) * (x @ up)) @ down


def _expert(c: ModelConfig, x, gate, up, down, biases=None):
    """One routed expert of x: silu(x @ gate) * (x @ up) @ down, or gpt-oss's clamped SwiGLU
    (g = min(g, limit), u = clip(u, -limit, limit), (u + 1) * g * sigmoid(alpha * g)); with
    `biases` (gate's, up's, down's) each product adds its own."""
    bg, bu, bd = biases if biases is not None else (0.0, 0.0, 0.0)
    g, u = x @ gate + bg, x @ up + bu
    if c.expert_act == "silu":
        return (_silu(g) * u) @ down + bd
    g = np.minimum(g, c.swiglu_limit)
    u = np.clip(u, -c.swiglu_limit, c.swiglu_limit)
    return ((u + 1.0) * g / (1.0 + np.exp(-c.swiglu_alpha * g))) @ down + bd


def reference_route(c: ModelConfig, logits: np.ndarray, bias: np.ndarray | None):
    """Top-k choice and weights for one token's router logits [E] -> (ids [k], weights [k])."""
    if c.router_scores == "softmax":
        e = np.exp(logits - logits.max())
        scores = e / e.sum()
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + _f64(bias) if bias is not None else scores.copy()
    if c.n_groups > 1:
        per = c.n_experts // c.n_groups
        grouped = choice.reshape(c.n_groups, per)
        group_score = np.sort(grouped, axis=-1)[:, -2:].sum(-1)
        keep = np.argsort(-group_score, kind="stable")[: c.topk_groups]
        mask = np.zeros(c.n_groups, bool)
        mask[keep] = True
        choice = np.where(mask[:, None], grouped, -np.inf).reshape(-1)
    ids = np.argsort(-choice, kind="stable")[: c.top_k]
    w = scores[ids]
    if c.norm_topk_prob:
        w = w / w.sum()
    return ids, w * c.routed_scaling


def _dequantized(c: ModelConfig, params, prefix: str, matrix: str) -> np.ndarray:
    """Float64 [E, in, out] of a quantized expert matrix from its planes (the published
    formulas: fp8 w = q * scale[k // b, n // b]; GPTQ int4 w = (q - z) * scale[k // g, n],
    q the 4-bit values, each group's first half of rows in the low nibbles of its byte rows
    and its second half in the high nibbles, z 8 (symmetric) or the zero-point plane's
    z[k // g, n]; with act-order the rows stored in group order, stored row k being input row
    perm[k]; MXFP4 w = e2m1(code) * 2^(s[k // 32, n] - 127), the codes in halves of packs of
    64 rows as int4's of groups of 64)."""

    fmt = expert_format(c)
    return dequantized64(fmt.kind, fmt.block, fmt.matrix_shape(matrix),
                         params[prefix + matrix], params[prefix + matrix + "_scale"],
                         params[prefix + matrix + "_zero"] if fmt.zero_points else None,
                         params[prefix + matrix + "_perm"] if fmt.act_order else None)


def dequantized64(kind: str, block: int, shape: tuple[int, int], q, scale,
                  zero=None, perm=None) -> np.ndarray:
    """Float64 [E, K, N] of one quantized matrix's planes q and scale (and int4's zero-points
    `zero`, [E, K/g, N]; None: 8; and act-order's row order `perm`, [E, K]: stored row k is
    input row perm[k]; None: itself) by the published formulas (`_dequantized`), `block` the
    fp8 block side, the int4 group or mxfp4's 32."""
    q = np.asarray(q)
    s = np.asarray(scale).astype(np.float64)
    k, n = shape
    if kind == "fp8":
        rows, cols = np.arange(k) // block, np.arange(n) // block
        return q.astype(np.float64) * s[:, rows][:, :, cols]
    pack = 2 * block if kind == "mxfp4" else block  # rows a byte tile's two halves hold
    vals = np.empty((q.shape[0], k, n), np.float64)  # byte row r of tile g: rows g*p + r
    half = pack // 2                                  # (low nibble) and g*p + p/2 + r (high)
    for g in range(k // pack):
        rows = q[:, g * half:(g + 1) * half].astype(np.int64)
        vals[:, g * pack:g * pack + half] = rows % 16
        vals[:, g * pack + half:(g + 1) * pack] = rows // 16
    groups = np.arange(k) // block
    if kind == "mxfp4":  # e2m1: sign bit 3, value (1 + m/2) * 2^(e - 1), e = 0: m / 2
        sign = np.where(vals >= 8, -1.0, 1.0)
        e, m = (vals % 8) // 2, vals % 2
        e2m1 = sign * np.where(e == 0, m / 2, (1 + m / 2) * 2.0 ** (e - 1))
        return e2m1 * 2.0 ** (s[:, groups, :] - 127)
    z = 8.0 if zero is None else np.asarray(zero).astype(np.float64)[:, groups, :]
    w = (vals - z) * s[:, groups, :]
    if perm is None:
        return w
    out = np.empty_like(w)
    out[np.arange(q.shape[0])[:, None], np.asarray(perm)] = w
    return out


def reference_forward(config: ModelConfig, params: Mapping[str, np.ndarray], tokens,
                      experts: Mapping[int, tuple] | None = None):
    """Float64 forward of a whole sequence starting at position 0.

    Args:
        config: model config.
        params: flat name -> array, names as in `strata_jax.models.param_shapes`.
        tokens: int [T].
        experts: optional layer -> (gate, up, down) used when the expert params are not in `params`.

    Returns:
        (logits float64 [T, V], counts int64 [n_moe_layers, E]).
    """
    c = config
    tokens = np.asarray(tokens)
    x = _f64(params["embed"])[tokens]  # [T, H]
    all_counts = []
    for layer in range(c.n_layers):
        pre = f"layers.{layer}."
        h = _norm(x, params, pre + "input_norm", c.rms_norm_eps)
        if getattr(c, "mixers", None) and c.is_linear(layer):
            x = x + reference_deltanet(c, params, pre + "linear_attn.", h)[0]
        elif getattr(c, "kv_lora_rank", 0):
            x = x + _mla_attention(c, params, pre + "attn.", h)
        else:
            x = x + _attention(c, params, pre + "attn.", h, c.window_of(layer))
        h = _norm(x, params, pre + "post_attn_norm", c.rms_norm_eps)
        m = pre + "mlp."
        if layer not in c.moe_layers:
            x = x + _swiglu(h, _f64(params[m + "gate"]), _f64(params[m + "up"]),
                            _f64(params[m + "down"]))
            continue
        if m + "gate" in params and c.expert_format != "plain":
            gate, up, down = (_dequantized(c, params, m, n) for n in ("gate", "up", "down"))
        elif m + "gate" in params:
            gate, up, down = (_f64(params[m + n]) for n in ("gate", "up", "down"))
        else:
            gate, up, down = (_f64(a) for a in tuple(experts[layer])[:3])
        biases = None
        if c.expert_bias:
            source = params if m + "gate_bias" in params else experts[layer]._asdict()
            biases = [_f64(source[(m if source is params else "") + b])
                      for b in ("gate_bias", "up_bias", "down_bias")]
        logits = h @ _f64(params[m + "router"])  # [T, E]
        if c.router_bias:
            logits = logits + _f64(params[m + "router_bias"])
        bias = params.get(m + "selection_bias")
        counts = np.zeros(c.n_experts, np.int64)
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            ids, w = reference_route(c, logits[t], bias)
            for e, we in zip(ids, w):
                counts[e] += 1
                out[t] += we * _expert(c, h[t], gate[e], up[e], down[e],
                                       None if biases is None else [b[e] for b in biases])
        if c.shared_expert_intermediate:
            shared = _swiglu(h, _f64(params[m + "shared.gate"]), _f64(params[m + "shared.up"]),
                             _f64(params[m + "shared.down"]))
            if c.shared_expert_gate:
                shared = shared / (1.0 + np.exp(-(h @ _f64(params[m + "shared_gate"]))))
            out = out + shared
        x = x + out
        all_counts.append(counts)
    x = _norm(x, params, "final_norm", c.rms_norm_eps)
    head = _f64(params["embed"]).T if c.tie_embeddings else _f64(params["lm_head"])
    counts = np.stack(all_counts) if all_counts else np.zeros((0, c.n_experts), np.int64)
    return x @ head, counts


def reference_log_probs(config: ModelConfig, params: Mapping[str, np.ndarray], tokens,
                        experts: Mapping[int, tuple] | None = None) -> np.ndarray:
    """Float64 log-probability of each token after the first given the ones before it:
    [T - 1], entry i = log softmax(logits[i])[tokens[i + 1]] of `reference_forward`'s logits."""
    tokens = np.asarray(tokens)
    logits, _ = reference_forward(config, params, tokens, experts)
    logits = logits[:-1]
    top = logits.max(axis=-1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return logits[np.arange(logits.shape[0]), tokens[1:]] - lse


def reference_perplexity(config: ModelConfig, params: Mapping[str, np.ndarray], tokens,
                         experts: Mapping[int, tuple] | None = None) -> float:
    """Float64 perplexity of `tokens`: exp of the mean of -`reference_log_probs`."""
    return float(np.exp(-np.mean(reference_log_probs(config, params, tokens, experts))))
