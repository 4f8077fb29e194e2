"""Grouped-query attention as a layer: q/k/v/o projections (optional biases), q/k RMSNorm
(per head or over the whole projection), RoPE (over all of a head or its first
`ModelConfig.rotary_dim` dims), an optional sigmoid output gate (Qwen3-Next's gated attention),
optional attention sinks (gpt-oss), the KV cache write, and the attention paths of
`layers.attention` (a first chunk causal and fused; a later chunk over its cached prefix, merged
by log-sum-exp), within a sliding window where the config gives this layer one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from strata_jax.config import ModelConfig
from strata_jax.kernels import Kernels
from strata_jax.layers.attention import attend_cached, attend_first, attention_path
from strata_jax.layers.norms import RMSNorm
from strata_jax.layers.params import dot, filled, normal, value
from strata_jax.layers.rope import rope


class Attention(nnx.Module):
    """Grouped-query attention with RoPE, optional q/k RMSNorm and a KV cache; within a
    sliding window where the config gives this layer one (`ModelConfig.window_of`). RoPE
    rotates the config's `rotated_dims` of each head (partial rotary: the first ones); the
    projections named in its `attention_biases` add a bias. With `attention_sinks` each query
    head has a learned sink logit, `sinks` [N] in the parameter dtype (gpt-oss), that every
    attention path takes as one more softmax term with no value (`layers.attention`), in
    float32 (float64 for a float64 model).

    output_gate: q_proj also gives each head a gate, [H, N*2D] with each head's D query
        columns then its D gate columns; the attention output is multiplied by sigmoid(gate)
        before o_proj.
    centred_norms: the q/k norms' weights are zero-centred (`RMSNorm(centred=True)`).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, layer: int,
                 kernels: Kernels = Kernels(), output_gate: bool = False,
                 centred_norms: bool = False):
        c, dt = config, config.dtype
        self.config = config
        self.kernels = kernels  # static: part of the graph jit keys on
        self.window = c.window_of(layer)  # static: None (full causal) or the window
        self.output_gate = output_gate
        q_width = 2 * c.q_dim if output_gate else c.q_dim
        self.q_proj = nnx.Param(normal(rngs, (c.hidden_size, q_width), dt))  # [H, N*D or N*2D]
        self.k_proj = nnx.Param(normal(rngs, (c.hidden_size, c.kv_dim), dt))  # [H, KVH*D]
        self.v_proj = nnx.Param(normal(rngs, (c.hidden_size, c.kv_dim), dt))  # [H, KVH*D]
        self.o_proj = nnx.Param(normal(rngs, (c.q_dim, c.hidden_size), dt))  # [N*D, H]
        widths = {"q": q_width, "k": c.kv_dim, "v": c.kv_dim, "o": c.hidden_size}
        for proj, width in widths.items():  # q [N*D or N*2D], k/v [KVH*D], o [H]
            setattr(self, f"{proj}_bias", nnx.Param(filled(rngs, (width,), dt, 0.0))
                    if proj in c.attention_biases else None)
        if c.qk_norm == "per_head":
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dt, rngs, centred=centred_norms)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dt, rngs, centred=centred_norms)
        elif c.qk_norm == "full":
            self.q_norm = RMSNorm(c.q_dim, c.rms_norm_eps, dt, rngs)
            self.k_norm = RMSNorm(c.kv_dim, c.rms_norm_eps, dt, rngs)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nnx.Param(normal(rngs, (c.n_heads,), dt)) if c.attention_sinks else None

    def __call__(self, x, cache_k, cache_v, start, positions):
        """x [T, H]; cache_k/v [S, KVH, D]; start int (static 0 = first chunk) or int32 scalar."""
        c = self.config
        t = x.shape[0]
        q = dot(x, self.q_proj[...], value(self.q_bias))  # [T, N*D] (N*2D with a gate)
        gate = None
        if self.output_gate:
            both = q.reshape(t, c.n_heads, 2 * c.head_dim)
            q, gate = both[..., :c.head_dim].reshape(t, c.q_dim), both[..., c.head_dim:]
        k = dot(x, self.k_proj[...], value(self.k_bias))  # [T, KVH*D]
        v = dot(x, self.v_proj[...], value(self.v_bias))  # [T, KVH*D]
        if c.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(t, c.n_heads, c.head_dim)  # [T, N, D]
        k = k.reshape(t, c.n_kv_heads, c.head_dim)  # [T, KVH, D]
        v = v.reshape(t, c.n_kv_heads, c.head_dim)  # [T, KVH, D]
        if c.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, positions), self._rope(k, positions)
        k = k.astype(cache_k.dtype)
        v = v.astype(cache_v.dtype)
        cache_k = lax.dynamic_update_slice(cache_k, k, (start, 0, 0))  # [S, KVH, D]
        cache_v = lax.dynamic_update_slice(cache_v, v, (start, 0, 0))
        first = isinstance(start, int) and start == 0
        sinks = (None if self.sinks is None  # [N]
                 else self.sinks[...].astype(jnp.promote_types(jnp.float32, q.dtype)))
        path = attention_path(q.dtype, c.head_dim, c.n_heads, t, cache_k.shape[0], first=first,
                              impl=self.kernels.attention)
        if first:
            # First chunk: the cache holds nothing before it, so attending to the chunk's own keys
            # causally is the same math and lets cuDNN run it fused.
            out = attend_first(q, k.astype(q.dtype), v.astype(q.dtype), path, self.window,
                               sinks)
        else:
            out = attend_cached(q, k, v, cache_k, cache_v, start, positions, path, self.window,
                                sinks)
        if gate is not None:  # [T, N, D]
            out = (out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))
                   ).astype(out.dtype)
        out = dot(out.reshape(t, c.q_dim), self.o_proj[...], value(self.o_bias))  # [T, H]
        return out, cache_k, cache_v

    def _rope(self, x, positions):
        c, r = self.config, self.config.rotated_dims
        if r == c.head_dim:
            return rope(x, positions, c.rope_theta, c.rope_scaling)
        return jnp.concatenate([rope(x[..., :r], positions, c.rope_theta, c.rope_scaling),
                                x[..., r:]], axis=-1)
