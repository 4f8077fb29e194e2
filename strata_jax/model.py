"""Flax NNX mixture-of-experts transformer (batch 1, prefill with a KV cache).

Guards against two failures the streaming engine cannot tolerate: expert math that depends on the
weights of experts no token routes to (a streamed source leaves those rows zero), and an op sequence
that changes with the expert source (the streamed arm must match the resident arm bit for bit). The
only difference between arms is where `ExpertSource.expert_weights` gets its bytes.

Layers are a Python loop over an `nnx.List` with static layer indices (not `lax.scan`), so a
streaming source can issue a per-layer FFI call with the layer index as a static attribute.
"""

from __future__ import annotations

import functools
import itertools
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from strata_jax.attention import (  # noqa: F401 - re-exported: the model's attention API
    BLOCKED_ATTENTION_BYTES, attend_cached, attend_first, attention_key_block,
    attention_path, blocked_attention, einsum_attention)
from strata_jax.config import ModelConfig
from strata_jax.experts import ExpertSource, ExpertWeights, ResidentExperts
from strata_jax.grouped_matmul import grouped_matmul, piece_group_sizes
from strata_jax.kernels import Kernels
from strata_jax.quant_matmul import QuantizedMatrix, in_stored_order
from strata_jax.rope import RopeScaling, rope_frequencies

_INIT_STD = 0.02
# Scoring (`MoETransformer.score_rows`): the float32 [rows, V] logits of one block of rows
# stay within this, rows a power of two from 16 to SCORE_MAX_ROWS.
SCORE_BLOCK_BYTES = 512 * 2**20
SCORE_MAX_ROWS = 2048


class KVCache(NamedTuple):
    """Per-layer key/value cache.

    Attributes:
        keys: one [S, KVH, D] array per layer (S = capacity), RoPE already applied.
        values: one [S, KVH, D] array per layer.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]

    @property
    def capacity(self) -> int:
        """Positions the cache can hold."""
        return self.keys[0].shape[0]


def init_cache(config: ModelConfig, capacity: int, dtype=None) -> KVCache:
    """Returns a zero KV cache of `capacity` positions in the parameter dtype (or `dtype`).

    Raises:
        ValueError: capacity is not positive or exceeds `config.max_seq_len`.
    """
    if not 0 < capacity <= config.max_seq_len:
        raise ValueError(
            f"cache capacity {capacity} must be within 1..max_seq_len={config.max_seq_len}")
    dtype = dtype or config.dtype
    shape = (capacity, config.n_kv_heads, config.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers))
    return KVCache(zeros, tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)))


def cache_shapes(config: ModelConfig, capacity: int) -> KVCache:
    """`KVCache` of `jax.ShapeDtypeStruct`s, for `jax.eval_shape` (allocates nothing)."""
    spec = jax.ShapeDtypeStruct((capacity, config.n_kv_heads, config.head_dim), config.dtype)
    return KVCache((spec,) * config.n_layers, (spec,) * config.n_layers)


def score_block_rows(vocab_size: int, rows: int) -> int:
    """Rows per block of the scoring head: the most, a power of two from 16 up to
    SCORE_MAX_ROWS, whose float32 [rows, vocab_size] logits fit SCORE_BLOCK_BYTES; at most
    `rows` (the rows to score)."""
    block = 16
    while block * 2 <= SCORE_MAX_ROWS and block * 2 * vocab_size * 4 <= SCORE_BLOCK_BYTES:
        block *= 2
    return max(1, min(block, int(rows)))


def _normal(rngs: nnx.Rngs | None, shape, dtype, std=_INIT_STD):
    # rngs=None builds an abstract model (ShapeDtypeStruct leaves) without tracing any RNG: full-size
    # presets then take milliseconds instead of tracing hundreds of random initialisers.
    if rngs is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def _filled(rngs: nnx.Rngs | None, shape, dtype, value: float):
    if rngs is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jnp.full(shape, value, dtype)


# ---- building blocks ----------------------------------------------------------------------------


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, computed in float32."""

    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs | None = None):
        self.weight = nnx.Param(_filled(rngs, (dim,), dtype, 1.0))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float,
         scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary embedding, half-split (Hugging Face `rotate_half`) convention.

    Args:
        x: [T, heads, D].
        positions: int32 [T].
        theta: RoPE base.
        scaling: the config's RoPE scaling (`strata_jax.rope`), None for plain RoPE.

    Returns:
        [T, heads, D] in x.dtype.
    """
    d = x.shape[-1]
    inv, factor = rope_frequencies(d, theta, scaling)  # host float64, static
    inv_freq = jnp.asarray(inv, jnp.float32)  # [D/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.cos(angles)[:, None, :]  # [T, 1, D/2]
    sin = jnp.sin(angles)[:, None, :]
    if factor != 1.0:  # YaRN's attention factor: q.k scales by its square
        cos, sin = cos * factor, sin * factor
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _dot(x, w, bias=None):
    """x @ w (+ bias) accumulated in float32, result in x.dtype."""
    y = jnp.dot(x, w, preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def _value(param):
    """A parameter's array, or None for an absent one."""
    return None if param is None else param[...]


class Attention(nnx.Module):
    """Grouped-query attention with RoPE, optional q/k RMSNorm and a KV cache; within a
    sliding window where the config gives this layer one (`ModelConfig.window_of`)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, layer: int,
                 kernels: Kernels = Kernels()):
        c, dt = config, config.dtype
        self.config = config
        self.kernels = kernels  # static: part of the graph jit keys on
        self.window = c.window_of(layer)  # static: None (full causal) or the window
        self.q_proj = nnx.Param(_normal(rngs, (c.hidden_size, c.q_dim), dt))  # [H, N*D]
        self.k_proj = nnx.Param(_normal(rngs, (c.hidden_size, c.kv_dim), dt))  # [H, KVH*D]
        self.v_proj = nnx.Param(_normal(rngs, (c.hidden_size, c.kv_dim), dt))  # [H, KVH*D]
        self.o_proj = nnx.Param(_normal(rngs, (c.q_dim, c.hidden_size), dt))  # [N*D, H]
        if c.attention_bias:
            self.q_bias = nnx.Param(_filled(rngs, (c.q_dim,), dt, 0.0))  # [N*D]
            self.k_bias = nnx.Param(_filled(rngs, (c.kv_dim,), dt, 0.0))  # [KVH*D]
            self.v_bias = nnx.Param(_filled(rngs, (c.kv_dim,), dt, 0.0))  # [KVH*D]
            self.o_bias = nnx.Param(_filled(rngs, (c.hidden_size,), dt, 0.0))  # [H]
        else:
            self.q_bias = self.k_bias = self.v_bias = self.o_bias = None
        if c.qk_norm == "per_head":
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dt, rngs)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dt, rngs)
        elif c.qk_norm == "full":
            self.q_norm = RMSNorm(c.q_dim, c.rms_norm_eps, dt, rngs)
            self.k_norm = RMSNorm(c.kv_dim, c.rms_norm_eps, dt, rngs)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, cache_k, cache_v, start, positions):
        """x [T, H]; cache_k/v [S, KVH, D]; start int (static 0 = first chunk) or int32 scalar."""
        c = self.config
        t = x.shape[0]
        q = _dot(x, self.q_proj[...], _value(self.q_bias))  # [T, N*D]
        k = _dot(x, self.k_proj[...], _value(self.k_bias))  # [T, KVH*D]
        v = _dot(x, self.v_proj[...], _value(self.v_bias))  # [T, KVH*D]
        if c.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(t, c.n_heads, c.head_dim)  # [T, N, D]
        k = k.reshape(t, c.n_kv_heads, c.head_dim)  # [T, KVH, D]
        v = v.reshape(t, c.n_kv_heads, c.head_dim)  # [T, KVH, D]
        if c.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope(q, positions, c.rope_theta, c.rope_scaling)
        k = rope(k, positions, c.rope_theta, c.rope_scaling)
        k = k.astype(cache_k.dtype)
        v = v.astype(cache_v.dtype)
        cache_k = lax.dynamic_update_slice(cache_k, k, (start, 0, 0))  # [S, KVH, D]
        cache_v = lax.dynamic_update_slice(cache_v, v, (start, 0, 0))
        first = isinstance(start, int) and start == 0
        path = attention_path(q.dtype, c.head_dim, c.n_heads, t, cache_k.shape[0], first=first,
                              impl=self.kernels.attention)
        if first:
            # First chunk: the cache holds nothing before it, so attending to the chunk's own keys
            # causally is the same math and lets cuDNN run it fused.
            out = attend_first(q, k.astype(q.dtype), v.astype(q.dtype), path, self.window)
        else:
            out = attend_cached(q, k, v, cache_k, cache_v, start, positions, path, self.window)
        out = _dot(out.reshape(t, c.q_dim), self.o_proj[...], _value(self.o_bias))  # [T, H]
        return out, cache_k, cache_v


class MLP(nnx.Module):
    """SwiGLU MLP: down(silu(x @ gate) * (x @ up)). Used for dense layers and shared experts."""

    def __init__(self, hidden: int, intermediate: int, dtype, *, rngs: nnx.Rngs):
        self.gate = nnx.Param(_normal(rngs, (hidden, intermediate), dtype))  # [H, I]
        self.up = nnx.Param(_normal(rngs, (hidden, intermediate), dtype))  # [H, I]
        self.down = nnx.Param(_normal(rngs, (intermediate, hidden), dtype))  # [I, H]

    def __call__(self, x):
        g = jnp.dot(x, self.gate[...], preferred_element_type=jnp.float32)
        u = jnp.dot(x, self.up[...], preferred_element_type=jnp.float32)
        h = (jax.nn.silu(g) * u).astype(x.dtype)  # [T, I]
        return _dot(h, self.down[...])  # [T, H]


# ---- MoE: routing, permute, experts, unpermute as small functions ----------------------------------


class Routing(NamedTuple):
    """Router output for one chunk.

    Attributes:
        expert_ids: int32 [T, k] chosen experts per token.
        weights: float32 [T, k] combination weights.
        counts: int32 [E] tokens routed to each expert.
    """

    expert_ids: jax.Array
    weights: jax.Array
    counts: jax.Array


def route(x: jax.Array, router: jax.Array, bias: jax.Array | None, config: ModelConfig,
          valid: jax.Array | None = None) -> Routing:
    """Chooses top-k experts per token and their weights.

    Softmax routers take softmax(logits) in float32, keep the top k and optionally renormalise.
    Sigmoid routers (DeepSeek-V3) choose by sigmoid(logits) + selection bias (group-limited when
    n_groups > 1), weight by the unbiased sigmoid scores, renormalise and scale by routed_scaling.

    Padding: where `valid` (bool [T]) is False the token is padding. Its k choices become the
    sentinel expert id E (sorted after every real expert by `sort_order`) with weight 0, and the
    counts drop them, so padding never shows in the counts, the streamed fetch or the group sizes.
    """
    with jax.named_scope("routing"):
        c = config
        t = x.shape[0]
        logits = jnp.dot(x, router, preferred_element_type=jnp.float32)  # [T, E]
        if c.router_scores == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
        choice = scores + bias.astype(jnp.float32)[None, :] if bias is not None else scores
        if c.n_groups > 1:
            grouped = choice.reshape(t, c.n_groups, c.n_experts // c.n_groups)  # [T, G, E/G]
            group_scores = lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
            _, keep = lax.top_k(group_scores, c.topk_groups)  # [T, topk_groups]
            group_mask = jnp.zeros((t, c.n_groups), bool).at[jnp.arange(t)[:, None], keep].set(True)
            # Hugging Face fills dropped groups with 0.0 (not -inf); kept for identical choices.
            choice = jnp.where(group_mask[:, :, None], grouped, 0.0).reshape(t, c.n_experts)
        _, expert_ids = lax.top_k(choice, c.top_k)  # [T, k]
        weights = jnp.take_along_axis(scores, expert_ids, axis=-1)  # [T, k]
        if c.norm_topk_prob:
            denom = weights.sum(-1, keepdims=True)
            if c.router_scores == "sigmoid":
                denom = denom + 1e-20
            weights = weights / denom
        weights = weights * c.routed_scaling
        expert_ids = expert_ids.astype(jnp.int32)
        if valid is not None:
            expert_ids = jnp.where(valid[:, None], expert_ids, jnp.int32(c.n_experts))
            weights = jnp.where(valid[:, None], weights, 0.0)
        # mode="drop": the padding sentinel E is out of range and is not counted.
        counts = jnp.zeros((c.n_experts,), jnp.int32).at[expert_ids.reshape(-1)].add(
            1, mode="drop")  # [E]
        return Routing(expert_ids, weights, counts)


def release_experts(expert_source, layer: int, outs):
    """After a layer's expert math: tells a source that has a `release` (the stream, whose
    fetched weights are a ring frame it reuses) that the layer's weights are done with, once
    every one of `outs` is computed; returns `outs`."""
    release = getattr(expert_source, "release", None)
    return outs if release is None else release(layer, outs)


def _layer_boundary(x, k, v):
    """Ends a layer, in both read orders: its output and its cache writes are done before the
    next layer starts. Left to itself XLA put every layer's cache write after the last layer,
    where a streamed chunk's tail waits for them. The
    same boundary in both orders keeps their fusions, so their bits, alike."""
    return jax.lax.optimization_barrier((x, k, v))


def permute(x: jax.Array, expert_ids: jax.Array):
    """Sorts token copies by expert (the rows standalone: the model takes `sort_order` and
    gathers the rows inside `experts_swiglu`).

    Args:
        x: [T, H] tokens.
        expert_ids: int32 [T, k].

    Returns:
        (x_sorted [T*k, H], order int32 [T*k]) where x_sorted[j] = x[order[j] // k].
    """
    order = sort_order(expert_ids)
    with jax.named_scope("permute"):
        return x[order // expert_ids.shape[1]], order


def sort_order(expert_ids: jax.Array) -> jax.Array:
    """The token copies' order sorted by expert (stable): int32 [T*k] for expert_ids [T, k];
    copy j of the sorted order is token order[j] // k."""
    with jax.named_scope("permute"):
        return jnp.argsort(expert_ids.reshape(-1), stable=True).astype(jnp.int32)


def experts_swiglu(x: jax.Array, rows: jax.Array, w: ExpertWeights, counts: jax.Array,
                   impl: str | None = None, quantized: str | None = None) -> jax.Array:
    """SwiGLU of each token copy with its expert: grouped matmuls over rows sorted by expert.

    Args:
        x: [T, H] tokens.
        rows: int32 [M], the token of each sorted row (`sort_order`'s order // k, or a range
            of it): the matmuls' rows are x[rows].
        w: gate/up [E, H, I], down [E, I, H] (arrays, or `QuantizedMatrix`es of a quantized
            format); rows of experts with count 0 are never read.
        counts: int32 [E] group sizes.
        impl: the grouped matmul (`Kernels.grouped_matmul`); None: auto.
        quantized: how quantized matrices are read (`Kernels.quantized_matmul`); None: auto.

    Returns:
        [M, H] in x.dtype.

    Gate's and up's inputs are gathered from x: x[rows] once, or for an act-order matrix
    (int4 with `perm`) its own rows with their columns in its stored order, in the same
    gather (`quant_matmul.in_stored_order` with `rows`), so that no [M, H] copy is read
    again to reorder it.
    """
    mm = functools.partial(grouped_matmul, impl=impl, quantized=quantized)

    def act_order(m):
        return isinstance(m, QuantizedMatrix) and m.perm is not None

    with jax.named_scope("experts"):
        x_sorted = None
        if not (act_order(w.gate) and act_order(w.up)):
            with jax.named_scope("permute"):
                x_sorted = x[rows]  # [M, H], shared by gate and up

        def inputs(m):
            return in_stored_order(x, m, counts, rows) if act_order(m) else (x_sorted, m)

        g = mm(*inputs(w.gate), counts)  # [M, I]
        u = mm(*inputs(w.up), counts)  # [M, I]
        h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
        return mm(h, w.down, counts)  # [M, H]


def experts_swiglu_pieces(x: jax.Array, order: jax.Array, k: int, counts: jax.Array,
                          bounds: tuple[int, ...], weights_for_piece,
                          impl: str | None = None, quantized: str | None = None) -> jax.Array:
    """`experts_swiglu` over the sorted rows in pieces [bounds[p], bounds[p+1]), each with the
    weights `weights_for_piece(p, after)` gives (`after`: the piece before's output, None for
    piece 0), so a piece's math can start once its own experts are there. Each row keeps its
    expert (piece_group_sizes), so the rows come out as the whole layer's matmuls give them.

    Args:
        x: [T, H] tokens; order: int32 [T*k] from `sort_order`; counts: int32 [E].

    Returns:
        [T*k, H] in x.dtype, rows in sorted order.
    """
    ys = []
    after = None
    for p, (a, b) in enumerate(itertools.pairwise(bounds)):
        with jax.named_scope(f"experts_piece_{p}"):
            w = _in_dtype(weights_for_piece(p, after), x.dtype)
            # this piece's rows of the sorted copies: tokens order[a:b] // k
            after = experts_swiglu(x, order[a:b] // k, w, piece_group_sizes(counts, a, b),
                                   impl, quantized)
            ys.append(after)
    return jnp.concatenate(ys)


def _in_dtype(w: ExpertWeights, dtype) -> ExpertWeights:
    """The arrays of `w` in `dtype` (a QuantizedMatrix already reads as the model's dtype)."""
    return ExpertWeights(*(a if isinstance(a, QuantizedMatrix) else a.astype(dtype) for a in w))


def unpermute(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Puts expert outputs back in token order and combines them with the routing weights.

    Args:
        y_sorted: [T*k, H] expert outputs in sorted order.
        order: int32 [T*k] from `sort_order`.
        weights: float32 [T, k].

    Returns:
        [T, H] in y_sorted.dtype, summed in float32.
    """
    with jax.named_scope("unpermute"):
        t, k = weights.shape
        n = order.shape[0]
        # Rows come back by a gather through the inverse permutation (a scatter of T*k int32s).
        # Scattering the [T*k, H] rows themselves would move H times the bytes (the layer's
        # slowest step after its grouped matmuls); the values are the same.
        inv = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32),
                                                      unique_indices=True)
        y = y_sorted[inv]  # [T*k, H], token-major: y[i] = y_sorted[j] where order[j] == i
        y = y.reshape(t, k, -1).astype(jnp.float32)  # [T, k, H]
        return jnp.einsum("tkh,tk->th", y, weights).astype(y_sorted.dtype)


class MoE(nnx.Module):
    """Routed SwiGLU experts with an optional shared expert.

    Steps for one chunk of T tokens:
      1. Router: logits = x @ router [T, E] in float32 -> scores -> top-k experts and weights.
      2. Counts: tokens per expert, int32 [E], known before any expert runs.
      3. Source: weights = expert_source.expert_weights(layer, counts, resident) - the streaming
         seam; the returned rows of experts with count 0 are never read.
      4. Permute: copy each token k times and sort the copies by expert id (stable): order
         [T*k]; gate's and up's input rows are gathered from x by it (x[order // k], [T*k, H];
         an act-order matrix's with its columns in stored order, in the same gather).
      5. Experts: grouped matmuls gate and up [T*k, I], silu(gate) * up, grouped matmul down
         [T*k, H]; zero-size groups compute nothing.
      6. Unpermute: gather back to token order [T, k, H], weighted sum over k in float32 -> [T, H].
      7. Shared expert (if any): dense SwiGLU of x, times sigmoid(x @ shared_gate) when gated,
         added to the routed output.
    The op sequence never depends on the source, so resident and streamed arms give the same bits.
    """

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs,
                 resident_experts: bool = True, kernels: Kernels = Kernels()):
        c, dt = config, config.dtype
        self.config = config
        self.kernels = kernels  # static: part of the graph jit keys on
        self.layer = layer
        self.router = nnx.Param(_normal(rngs, (c.hidden_size, c.n_experts), dt))  # [H, E]
        self.selection_bias = (nnx.Param(_filled(rngs, (c.n_experts,), jnp.float32, 0.0))
                               if c.selection_bias else None)  # [E]
        if not resident_experts:
            self.gate = self.up = self.down = None
        elif c.expert_format == "plain":
            e, h, i = c.n_experts, c.hidden_size, c.expert_intermediate
            self.gate = nnx.Param(_normal(rngs, (e, h, i), dt))  # [E, H, I]
            self.up = nnx.Param(_normal(rngs, (e, h, i), dt))  # [E, H, I]
            self.down = nnx.Param(_normal(rngs, (e, i, h), dt))  # [E, I, H]
        else:
            # A quantized format's planes (gate, gate_scale, up, ...: [E, *plane shape] each
            # in its storage dtype), read by the expert math as one QuantizedMatrix per matrix.
            if rngs is not None:
                raise ValueError(
                    f"random initialisation of {c.expert_format} experts is not implemented: "
                    "build the model from weights (build_model, Engine) or quantize drawn "
                    "ones (strata_jax.weights.QuantizedParams)")
            for plane in expert_format(c).planes:
                setattr(self, plane.name, nnx.Param(
                    jax.ShapeDtypeStruct((c.n_experts, *plane.shape), plane.dtype)))
        self.shared = (MLP(c.hidden_size, c.shared_expert_intermediate, dt, rngs=rngs)
                       if c.shared_expert_intermediate else None)
        self.shared_gate = (nnx.Param(_normal(rngs, (c.hidden_size, 1), dt))
                            if c.shared_expert_gate else None)  # [H, 1]
        # Static: None (one device), or a `strata_jax.parallel.ExpertParallel` that splits the
        # routed experts over a mesh (steps 4-6 on each device's own experts, then a psum).
        self.parallel = None

    def resident_weights(self) -> ExpertWeights | None:
        """The layer's own expert parameters, or None when built without them (a quantized
        format's as `QuantizedMatrix`es: `ExpertFormat.expert_matrices`)."""
        if self.gate is None:
            return None
        fmt = expert_format(self.config)  # plain: the params as they are, no op
        return fmt.expert_matrices({p.name: getattr(self, p.name)[...] for p in fmt.planes},
                                   self.config.dtype)

    def route_tokens(self, x: jax.Array, valid: jax.Array | None = None) -> Routing:
        """Steps 1-2: the router's choices for x [T, H] (padding, where `valid` is False, routes
        to the sentinel E and is not counted)."""
        bias = self.selection_bias[...] if self.selection_bias is not None else None
        return route(x, self.router[...], bias, self.config, valid)

    def fetch_weights(self, counts: jax.Array,
                      expert_source: ExpertSource | None = None) -> ExpertWeights:
        """Step 3: the layer's expert weights from the source, for routing counts int32 [E]."""
        source = expert_source if expert_source is not None else ResidentExperts()
        return source.expert_weights(self.layer, counts, self.resident_weights())

    def apply_experts(self, x: jax.Array, routing: Routing, w: ExpertWeights | None,
                      valid: jax.Array | None = None, *, pieces=None) -> jax.Array:
        """Steps 4-7 for x [T, H] with its own `routing` and the fetched weights -> [T, H].

        `routing.counts` are the group sizes; they may sum to less than T*k (padding sorts last,
        as the sentinel E). Padded rows (where `valid` is False) come back as exact zeros, whatever
        a grouped-matmul implementation leaves in rows past its groups.

        pieces: None, or (bounds, weights_for_piece) to run step 5 in row pieces as the source
            supplies each piece's weights (`experts_swiglu_pieces`; `w` is then unused).
        """
        if self.parallel is not None:
            out = self.parallel.routed_experts(self, x, routing, w, pieces)
        elif pieces is None:
            order = sort_order(routing.expert_ids)
            y_sorted = experts_swiglu(x, order // routing.expert_ids.shape[1],
                                      _in_dtype(w, x.dtype), routing.counts,
                                      self.kernels.grouped_matmul,
                                      self.kernels.quantized_matmul)
        else:
            order = sort_order(routing.expert_ids)
            with jax.named_scope("experts"):
                y_sorted = experts_swiglu_pieces(x, order, routing.expert_ids.shape[1],
                                                 routing.counts, *pieces,
                                                 impl=self.kernels.grouped_matmul,
                                                 quantized=self.kernels.quantized_matmul)
        if self.parallel is None:
            out = unpermute(y_sorted, order, routing.weights)
        if self.shared is not None:
            with jax.named_scope("shared_expert"):
                shared = self.shared(x)
                if self.shared_gate is not None:
                    gate = jax.nn.sigmoid(
                        jnp.dot(x, self.shared_gate[...], preferred_element_type=jnp.float32))
                    shared = (gate * shared.astype(jnp.float32)).astype(x.dtype)
                out = out + shared
        if valid is not None:
            out = jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))
        return out

    def __call__(self, x: jax.Array, expert_source: ExpertSource | None = None,
                 valid: jax.Array | None = None):
        """x [T, H] -> ([T, H], counts int32 [E])."""
        routing = self.route_tokens(x, valid)
        row_pieces = getattr(expert_source, "row_pieces", None)
        bounds = (row_pieces(self.layer, routing.expert_ids.size)
                  if row_pieces is not None else None)
        if bounds is None:
            w = self.fetch_weights(routing.counts, expert_source)
            out = self.apply_experts(x, routing, w, valid)
        else:
            def weights_for_piece(p, after):
                return expert_source.expert_weights_piece(self.layer, routing.counts, bounds, p,
                                                          after)

            out = self.apply_experts(x, routing, None, valid,
                                     pieces=(bounds, weights_for_piece))
        return release_experts(expert_source, self.layer, out), routing.counts


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)) with an MoE or dense MLP."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs,
                 resident_experts: bool = True, kernels: Kernels = Kernels()):
        c, dt = config, config.dtype
        self.layer = layer
        self.is_moe = layer in c.moe_layers
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dt, rngs)
        self.attn = Attention(c, rngs=rngs, kernels=kernels, layer=layer)
        self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dt, rngs)
        if self.is_moe:
            self.mlp = MoE(c, layer, rngs=rngs, resident_experts=resident_experts,
                           kernels=kernels)
        else:
            self.mlp = MLP(c.hidden_size, c.dense_intermediate, dt, rngs=rngs)

    def attention_block(self, x, cache_k, cache_v, start, positions):
        """x + attn(norm(x)), writing the block's keys/values into the cache at `start`."""
        h, cache_k, cache_v = self.attn(self.input_norm(x), cache_k, cache_v, start, positions)
        return x + h, cache_k, cache_v

    def __call__(self, x, cache_k, cache_v, start, positions, expert_source, valid=None):
        with jax.named_scope(f"layer_{self.layer}"):
            x, cache_k, cache_v = self.attention_block(x, cache_k, cache_v, start, positions)
            counts = None
            if self.is_moe:
                h, counts = self.mlp(self.post_attn_norm(x), expert_source, valid)
            else:
                h = self.mlp(self.post_attn_norm(x))
            return x + h, cache_k, cache_v, counts


class MoETransformer(nnx.Module):
    """Decoder-only MoE transformer, batch size 1.

    Call it as `model(tokens, cache, start, expert_source=None)` inside your own jit, or use
    `forward` for validated inputs and a cached jit.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None,
                 resident_experts: bool = True, kernels: Kernels = Kernels()):
        """Random-initialised model; `rngs=None` gives ShapeDtypeStruct leaves (see abstract_model).

        Real weights come from `build_model` (synthetic or checkpoint arrays) instead.
        kernels: the grouped matmul and attention its programs use (static).
        """
        c, dt = config, config.dtype
        self.config = config
        self.kernels = kernels
        self.embed = nnx.Param(_normal(rngs, (c.vocab_size, c.hidden_size), dt, std=1.0))  # [V, H]
        self.layers = nnx.List([DecoderLayer(c, i, rngs=rngs, resident_experts=resident_experts,
                                             kernels=kernels)
                                for i in range(c.n_layers)])
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dt, rngs)
        self.lm_head = (None if c.tie_embeddings
                        else nnx.Param(_normal(rngs, (c.hidden_size, c.vocab_size), dt)))  # [H, V]

    def __call__(self, tokens: jax.Array, cache: KVCache, start,
                 expert_source: ExpertSource | None = None, n_valid=None,
                 last_logits: bool = False, targets=None):
        """Runs one chunk.

        Args:
            tokens: int32 [T], ids within the vocabulary (not checked here: see `forward`).
            cache: KVCache with capacity >= start + T (padding included: a write past the end
                would be clamped by `lax.dynamic_update_slice` onto earlier positions).
            start: position of tokens[0]; a Python int 0 marks the first chunk (no cache read),
                anything else (int or int32 scalar) attends to cached positions 0..start-1.
            expert_source: supplies each MoE layer's expert weights; None = resident params.
            n_valid: None, or an int32 scalar: only tokens[:n_valid] are real and the rest is
                padding (see `route`). Padding is not counted, routes to no expert, and no real
                token attends to it (it sits after them); its keys/values are written at
                positions start+n_valid.. of the cache, which a later chunk overwrites.
            last_logits: return only the logits of the last real position, float32 [V].
            targets: None, or int32 [T] token ids: the first output is then (logits,
                (log-probabilities float32 [T] of each row's target, each row's most likely
                token int32 [T])), `score_rows`.

        Returns:
            (logits float32 [T, V] or [V], updated KVCache, counts int32 [n_moe_layers, E]).
        """
        t = tokens.shape[0]
        x = jnp.take(self.embed[...], tokens, axis=0)  # [T, H]
        positions, start, valid = self._positions(t, start, n_valid)
        keys, values, counts = [], [], []
        for i, layer in enumerate(self.layers):
            x, k, v, layer_counts = layer(x, cache.keys[i], cache.values[i], start, positions,
                                          expert_source, valid)
            if i + 1 < len(self.layers):
                x, k, v = _layer_boundary(x, k, v)
            keys.append(k)
            values.append(v)
            if layer_counts is not None:
                counts.append(layer_counts)
        return self._finish(x, n_valid, last_logits, targets), \
            KVCache(tuple(keys), tuple(values)), \
            self._stack_counts(counts)

    def layer_major(self, tokens: jax.Array, cache: KVCache, start,
                    expert_source: ExpertSource | None, sub_chunk: int, n_valid=None,
                    last_logits: bool = False, expert_rows: int | None = None, targets=None):
        """Runs a whole prompt layer by layer: every layer reads all of it before the next layer.

        The prompt is cut into sub-chunks of `sub_chunk` tokens. In each layer every sub-chunk in
        turn runs the attention block (writing its keys/values, so later sub-chunks attend to
        them) and the router; then the layer's expert weights are fetched once, for the counts
        summed over the sub-chunks; then each sub-chunk's experts run with its own routing. So
        an expert source sees one publish/fetch per layer per prompt, as if the prompt were one
        chunk, and each streamed expert crosses the link at most once per prompt.

        The router and the experts run on `expert_rows` rows at a time (consecutive sub-chunks
        joined): a grouped matmul over more rows keeps its tiles fuller, at the memory of that
        many rows' expert activations. Routing is row by row, so the choices and counts are the
        same for any grouping.

        The per-sub-chunk math is `__call__`'s (the same attention, router, grouped matmuls and
        combine); only the order differs, so with `sub_chunk` equal to the chunk size it matches
        chunk-major within the model's numerics (tests/test_engine.py states the measured gap).

        Args:
            tokens: int32 [P] with P a multiple of `sub_chunk` (pad with any valid id).
            cache, start, expert_source, n_valid, last_logits, targets: as in `__call__`.
            sub_chunk: tokens per compute sub-chunk (static).
            expert_rows: rows per router/expert call, a multiple of `sub_chunk` (static);
                None: `sub_chunk`.

        Returns:
            (logits float32 [P, V] or [V], updated KVCache, counts int32 [n_moe_layers, E]
            summed over the sub-chunks).
        """
        p = tokens.shape[0]
        if sub_chunk < 1 or p % sub_chunk:
            raise ValueError(f"layer_major: {p} tokens are not a whole number of sub-chunks of "
                             f"{sub_chunk}; pad the prompt to a multiple of sub_chunk")
        n_sub = p // sub_chunk
        rows = sub_chunk if expert_rows is None else expert_rows
        if rows < sub_chunk or rows % sub_chunk:
            raise ValueError(f"layer_major: expert_rows={expert_rows} is not a multiple of "
                             f"sub_chunk={sub_chunk}")
        per = rows // sub_chunk  # sub-chunks per router/expert call
        groups = [(a, min(a + per, n_sub)) for a in range(0, n_sub, per)]

        def join(parts):
            if parts[0] is None:
                return None
            return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)

        x = jnp.take(self.embed[...], tokens, axis=0)  # [P, H]
        positions, start, valid = self._positions(p, start, n_valid)
        def cut(a, j):
            return None if a is None else a[j * sub_chunk:(j + 1) * sub_chunk]

        xs = [cut(x, j) for j in range(n_sub)]  # n_sub x [S, H]
        pos = [cut(positions, j) for j in range(n_sub)]
        val = [cut(valid, j) for j in range(n_sub)]
        # Sub-chunk j starts at start + j*S; the very first one of a fresh cache keeps the static
        # 0 (causal self-attention, as chunk-major's first chunk).
        starts = [start if j == 0 else start + j * sub_chunk for j in range(n_sub)]
        keys, values, counts = [], [], []
        for i, layer in enumerate(self.layers):
            k, v = cache.keys[i], cache.values[i]
            with jax.named_scope(f"layer_{layer.layer}"):
                for j in range(n_sub):
                    xs[j], k, v = layer.attention_block(xs[j], k, v, starts[j], pos[j])
                if layer.is_moe:
                    normed = [layer.post_attn_norm(join(xs[a:b])) for a, b in groups]
                    gval = [join(val[a:b]) for a, b in groups]
                    routings = [layer.mlp.route_tokens(h, v) for h, v in zip(normed, gval)]
                    total = routings[0].counts
                    for r in routings[1:]:
                        total = total + r.counts
                    w = layer.mlp.fetch_weights(total, expert_source)
                    ys = [layer.mlp.apply_experts(h, r, w, v)
                          for h, r, v in zip(normed, routings, gval)]
                    ys = release_experts(expert_source, layer.layer, ys)
                    ys = [y[(j - a) * sub_chunk:(j - a + 1) * sub_chunk]
                          for (a, b), y in zip(groups, ys) for j in range(a, b)]
                    xs = [xj + y for xj, y in zip(xs, ys)]
                    counts.append(total)
                else:
                    xs = [xj + layer.mlp(layer.post_attn_norm(xj)) for xj in xs]
            if i + 1 < len(self.layers):
                xs, k, v = _layer_boundary(xs, k, v)
            keys.append(k)
            values.append(v)
        x = xs[0] if n_sub == 1 else jnp.concatenate(xs, axis=0)
        return self._finish(x, n_valid, last_logits, targets), \
            KVCache(tuple(keys), tuple(values)), \
            self._stack_counts(counts)

    # -- shared pieces of both orders --

    @staticmethod
    def _positions(t: int, start, n_valid):
        positions = jnp.arange(t, dtype=jnp.int32) + jnp.asarray(start, jnp.int32)  # [T]
        if not isinstance(start, int):
            start = jnp.asarray(start, jnp.int32)
        valid = None
        if n_valid is not None:
            valid = jnp.arange(t, dtype=jnp.int32) < jnp.asarray(n_valid, jnp.int32)  # [T]
        return positions, start, valid

    def _finish(self, x, n_valid, last_logits: bool, targets=None):
        """Final norm and LM head: all positions [T, V], or the last real one [V]; with
        `targets`, (that, `score_rows(x, targets)`)."""
        scores = None if targets is None else self.score_rows(x, targets)
        if last_logits:
            last = x.shape[0] - 1 if n_valid is None else jnp.asarray(n_valid, jnp.int32) - 1
            x = lax.dynamic_slice_in_dim(x, last, 1, axis=0)  # [1, H]
        x = self.final_norm(x)
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]  # [H, V]
        logits = jnp.dot(x, head, preferred_element_type=jnp.float32)  # [T, V]
        logits = logits[0] if last_logits else logits
        return logits if scores is None else (logits, scores)

    def score_rows(self, x: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        """For final hidden states x [T, H] (before the final norm): (log p(targets[t]) under
        row t's logits, float32 [T]; row t's most likely token, int32 [T], the lowest id among
        equal largest logits), never a [T, V] array.

        The rows go through the final norm and the LM head in blocks of `score_block_rows`
        rows (a `lax.map`): the head's matmul takes the parameter dtype and accumulates in
        float32, as the last position's logits do, and each block's [rows, V] float32 logits
        give logit[target] - logsumexp(logits) and their argmax. x is padded with zero rows to
        whole blocks (finite through the norm; their values are dropped).
        """
        t, h = x.shape
        block = score_block_rows(self.config.vocab_size, t)
        n = -(-t // block)
        if n * block != t:
            x = jnp.pad(x, ((0, n * block - t), (0, 0)))
            targets = jnp.pad(targets, (0, n * block - t))
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]  # [H, V]

        def one(args):
            xb, tb = args  # [block, H], [block]
            logits = jnp.dot(self.final_norm(xb), head,
                             preferred_element_type=jnp.float32)  # [block, V]
            picked = jnp.take_along_axis(logits, tb[:, None], axis=1)[:, 0]
            top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return picked - jax.nn.logsumexp(logits, axis=-1), top

        blocks = (x.reshape(n, block, h), targets.astype(jnp.int32).reshape(n, block))
        with jax.named_scope("score"):
            lp, top = lax.map(one, blocks)
            return lp.reshape(-1)[:t], top.reshape(-1)[:t]

    def _stack_counts(self, counts):
        if counts:
            return jnp.stack(counts)
        return jnp.zeros((0, self.config.n_experts), jnp.int32)


# ---- construction from arrays ---------------------------------------------------------------------


def abstract_model(config: ModelConfig, *, resident_experts: bool = True,
                   kernels: Kernels = Kernels()) -> MoETransformer:
    """The model with `jax.ShapeDtypeStruct` leaves: allocates nothing."""
    return MoETransformer(config, rngs=None, resident_experts=resident_experts, kernels=kernels)


def _get(variable):
    return variable.get_value() if hasattr(variable, "get_value") else variable.value


def param_shapes(config: ModelConfig, *, resident_experts: bool = True
                 ) -> dict[str, jax.ShapeDtypeStruct]:
    """Flat parameter names ("layers.3.mlp.gate", ...) to shape/dtype, in model order."""
    _, state = nnx.split(abstract_model(config, resident_experts=resident_experts))
    return {".".join(map(str, path)): _get(v) for path, v in nnx.to_flat_state(state)}


@functools.lru_cache(maxsize=64)
def expert_format(config: ModelConfig):
    """The config's `strata_jax.formats.ExpertFormat` (cached per config)."""
    from strata_jax.formats import ExpertFormat

    return ExpertFormat.of(config)


def expert_plane_names(config: ModelConfig, layer: int) -> dict[str, str]:
    """Plane name -> flat name of layer `layer`'s routed expert parameters, in blob order:
    gate, up, down in the plain format; each matrix and its `<matrix>_scale` in a quantized
    one (`strata_jax.formats.ExpertFormat.of(config)`)."""
    return {p.name: f"layers.{layer}.mlp.{p.name}" for p in expert_format(config).planes}


def expert_param_names(config: ModelConfig, layer: int) -> ExpertWeights:
    """Flat names of layer `layer`'s routed expert parameters (gate, up, down) in the plain
    format; a quantized format's are `expert_plane_names`."""
    if config.expert_format != "plain":
        raise ValueError(f"expert_param_names: {config.name}'s experts are "
                         f"{config.expert_format}; their names are expert_plane_names'")
    return ExpertWeights(*(f"layers.{layer}.mlp.{n}" for n in ExpertWeights._fields))


def build_model(config: ModelConfig, params: Mapping[str, np.ndarray | jax.Array], *,
                experts: Mapping[int, ExpertWeights] | None = None,
                resident_experts: bool = True, kernels: Kernels = Kernels()) -> MoETransformer:
    """Builds the model from flat arrays without initialising random weights first.

    Args:
        config: model config.
        params: flat name -> array (names as in `param_shapes`); cast to the parameter dtype.
        experts: optional layer -> ExpertWeights (plain format) or a mapping plane name ->
            [E, ...] array (any format, e.g. `weights.LazyExperts`) for routed experts not
            present in `params` (e.g. a host expert store); used only when `resident_experts`.
        resident_experts: put routed experts on the device; False leaves them out (a streaming
            source then supplies them).
        kernels: the grouped matmul and attention the model's programs use (`Kernels`).

    Raises:
        KeyError: a parameter is missing (named).
        ValueError: a parameter has the wrong shape (name and both shapes).
    """
    graphdef, state = nnx.split(abstract_model(config, resident_experts=resident_experts,
                                               kernels=kernels))
    planes = {p.name for p in expert_format(config).planes}
    filled = []
    for path, variable in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        spec = _get(variable)
        value = params.get(name)
        # Only a routed expert's own leaf (layers.N.mlp.gate/up/down and a quantized format's
        # scales), never the shared expert's leaves of the same names (layers.N.mlp.shared.gate).
        if (value is None and experts is not None and len(path) == 4 and path[2] == "mlp"
                and path[-1] in planes):
            layer = int(path[1])
            if layer in experts:
                w = experts[layer]
                value = getattr(w, path[-1]) if isinstance(w, ExpertWeights) else w[path[-1]]
        if value is None:
            raise KeyError(f"missing parameter {name!r} (expected shape {tuple(spec.shape)})")
        if tuple(value.shape) != tuple(spec.shape):
            raise ValueError(
                f"parameter {name!r} has shape {tuple(value.shape)}, expected {tuple(spec.shape)}")
        filled.append((path, variable.replace(jnp.asarray(value, dtype=spec.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


# ---- validated, jitted entry point ------------------------------------------------------------------


@nnx.jit(static_argnames=("expert_source", "first_chunk"))
def _forward_jit(model, tokens, cache, start, expert_source, first_chunk):
    return model(tokens, cache, 0 if first_chunk else start, expert_source)


def validate_inputs(config: ModelConfig, tokens, cache_capacity: int, start: int) -> np.ndarray:
    """Checks a chunk on the host before any device work.

    Returns:
        tokens as int32 numpy [T].

    Raises:
        ValueError: empty prompt, wrong rank, non-integer ids, ids outside [0, vocab), negative
            start, or start + T past the cache capacity or max_seq_len.
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D array [T], got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("empty prompt: tokens has length 0")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integer ids, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= config.vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} outside the vocabulary [0, {config.vocab_size})")
    start = int(start)
    if start < 0:
        raise ValueError(f"start position must be >= 0, got {start}")
    end = start + arr.size
    if end > config.max_seq_len:
        raise ValueError(
            f"prompt past max context: positions {start}..{end - 1} exceed "
            f"max_seq_len={config.max_seq_len}")
    if end > cache_capacity:
        raise ValueError(
            f"prompt past the KV cache: positions {start}..{end - 1} exceed capacity {cache_capacity}")
    return arr.astype(np.int32)


def forward(model: MoETransformer, tokens, cache: KVCache, start: int = 0,
            expert_source: ExpertSource | None = None):
    """Validated, jitted forward of one chunk.

    Args:
        model: the model.
        tokens: int [T] token ids (host or device array with concrete values).
        cache: KV cache.
        start: position of tokens[0].
        expert_source: hashable ExpertSource (a static jit argument) or None for resident experts.

    Returns:
        (logits float32 [T, V], updated KVCache, counts int32 [n_moe_layers, E]).
    """
    arr = validate_inputs(model.config, tokens, cache.capacity, start)
    return _forward_jit(model, jnp.asarray(arr), cache, jnp.int32(start), expert_source,
                        int(start) == 0)
