"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) as a layer.

Each token's keys and values come from one compressed latent: kv_a_proj gives the latent
[R] (RMS-normalised) and one rotary key [Dr] shared by every head; kv_b_proj expands the
latent into each head's key part without position [Dn] and its value [Dv]. A head's key is
[its Dn | the shared rotary Dr], its query [Dn | Dr] (from q_proj, or through a low-rank
q_a_proj, an RMSNorm and q_b_proj). The cache holds only the latent and the rotated shared
key (R + Dr values a position: 576 for DeepSeek-V3), never per-head keys and values.

A chunk expands what it attends to: its own latents, then the cached prefix block by block
(`prefix_block` positions at a time, so a long prefix never exists expanded at once). Every
block is one fused attention part with its log-sum-exp (`layers.attention.attention_part`:
cuDNN on a GPU, XLA's parts elsewhere), merged into a running float32 result: the same
two-part merge as grouped-query attention, with the prefix in several parts. Values are
padded with zeros to the query/key head size (cuDNN takes one head size) and the padding is
dropped from the output.

The softmax scale is Dq^-1/2 (Dq = Dn + Dr) times YaRN's mscale(factor, mscale_all_dim)^2
where the config's RoPE scaling has one (`MLAConfig.softmax_multiplier`): the queries are
multiplied by it. With `rope_interleave` the rotary dims are stored as interleaved pairs
(DeepSeek's layout): they are de-interleaved before the half-split rotation, the same
rotation.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from strata_jax.kernels import Kernels
from strata_jax.layers.attention import attend_first, attention_part, attention_path
from strata_jax.layers.norms import RMSNorm
from strata_jax.layers.params import dot, normal
from strata_jax.layers.rope import rope

# The latent norms' epsilon: transformers' and DeepSeek's MLA build them with RMSNorm's
# default, whatever the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6
# Bytes of one expanded prefix block (its keys and padded values).
PREFIX_BLOCK_BYTES = 1 << 29
# Float32 score bytes of one prefix block on the XLA parts.
PREFIX_SCORE_BYTES = 1 << 28
# The fewest positions a prefix block holds where the cache has them.
PREFIX_MIN_BLOCK = 256


def prefix_block(n_heads: int, head_dim: int, itemsize: int, n_queries: int, capacity: int,
                 fused: bool) -> int:
    """Cache positions expanded at a time for a later chunk: the largest power of two from
    PREFIX_MIN_BLOCK whose keys and values [B, N, D] fit PREFIX_BLOCK_BYTES (and, on the XLA
    parts, whose float32 scores [N, T, B] fit PREFIX_SCORE_BYTES); at most `capacity`."""
    block = 1 << 16
    while block > PREFIX_MIN_BLOCK and (block * n_heads * 2 * head_dim * itemsize > PREFIX_BLOCK_BYTES or (
            not fused and n_heads * n_queries * block * 4 > PREFIX_SCORE_BYTES)):
        block //= 2
    return max(1, min(block, capacity))


def merge_into(acc, part):
    """Two attention results over disjoint keys merged: (out [T, N, D], lse [T, N]) each,
    `acc` in the accumulation dtype; a part with lse -inf adds nothing."""
    out_a, lse_a = acc
    out_b, lse_b = part
    lse_b = lse_b.astype(lse_a.dtype)
    m = jnp.maximum(lse_a, lse_b)
    w_a, w_b = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    total = w_a + w_b
    out = (out_a * w_a[..., None] + out_b.astype(out_a.dtype) * w_b[..., None]) / total[..., None]
    return out, m + jnp.log(total)


class LatentAttention(nnx.Module):
    """MLA with its latent cache (`models.mla.MLAConfig` gives the sizes).

    Parameters: q_proj [H, N*Dq], or q_a_proj [H, Rq], q_norm, q_b_proj [Rq, N*Dq]; kv_a_proj
    [H, R + Dr]; kv_norm [R]; kv_b_proj [R, N*(Dn + Dv)] (each head's Dn then its Dv);
    o_proj [N*Dv, H]. Each head's query columns are its Dn then its Dr.
    """

    def __init__(self, config, *, rngs: nnx.Rngs, layer: int, kernels: Kernels = Kernels()):
        c, dt = config, config.dtype
        self.config = config
        self.kernels = kernels  # static: part of the graph jit keys on
        n, h = c.n_heads, c.hidden_size
        if c.q_lora_rank:
            self.q_proj = None
            self.q_a_proj = nnx.Param(normal(rngs, (h, c.q_lora_rank), dt))
            self.q_norm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, dt, rngs)
            self.q_b_proj = nnx.Param(normal(rngs, (c.q_lora_rank, n * c.head_dim), dt))
        else:
            self.q_proj = nnx.Param(normal(rngs, (h, n * c.head_dim), dt))
            self.q_a_proj = self.q_norm = self.q_b_proj = None
        self.kv_a_proj = nnx.Param(normal(rngs, (h, c.kv_lora_rank + c.qk_rope_dim), dt))
        self.kv_norm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS, dt, rngs)
        self.kv_b_proj = nnx.Param(normal(
            rngs, (c.kv_lora_rank, n * (c.qk_nope_dim + c.v_head_dim)), dt))
        self.o_proj = nnx.Param(normal(rngs, (n * c.v_head_dim, h), dt))

    def __call__(self, x, cache_latent, cache_rope, start, positions):
        """x [T, H]; cache_latent [S, R] and cache_rope [S, Dr] (the rotated shared keys);
        start int (static 0 = first chunk) or int32 scalar. Returns (out [T, H], the caches
        with the chunk written at `start`)."""
        c = self.config
        t = x.shape[0]
        q = self._queries(x, positions)  # [T, N, Dq]
        kv = dot(x, self.kv_a_proj[...])  # [T, R + Dr]
        latent = self.kv_norm(kv[:, :c.kv_lora_rank]).astype(cache_latent.dtype)
        k_rope = self._rotate(kv[:, None, c.kv_lora_rank:], positions)[:, 0]
        k_rope = k_rope.astype(cache_rope.dtype)
        cache_latent = lax.dynamic_update_slice(cache_latent, latent, (start, 0))
        cache_rope = lax.dynamic_update_slice(cache_rope, k_rope, (start, 0))
        k, v = self.expand(latent, k_rope, q.dtype)
        first = isinstance(start, int) and start == 0
        path = attention_path(q.dtype, c.head_dim, c.n_heads, t, cache_latent.shape[0],
                              first=first, impl=self.kernels.attention)
        if first:
            out = attend_first(q, k, v, path)[..., :c.v_head_dim]
        else:
            out = self._over_cache(q, k, v, cache_latent, cache_rope, start, path)
        out = dot(out.reshape(t, c.n_heads * c.v_head_dim), self.o_proj[...])  # [T, H]
        return out, cache_latent, cache_rope

    def _queries(self, x, positions):
        c = self.config
        if self.q_proj is not None:
            q = dot(x, self.q_proj[...])
        else:
            q = dot(self.q_norm(dot(x, self.q_a_proj[...])), self.q_b_proj[...])
        q = q.reshape(x.shape[0], c.n_heads, c.head_dim)  # [T, N, Dq]
        q = jnp.concatenate([q[..., :c.qk_nope_dim],
                             self._rotate(q[..., c.qk_nope_dim:], positions)], axis=-1)
        mult = c.softmax_multiplier
        if mult != 1.0:
            q = (q.astype(jnp.float32) * mult).astype(q.dtype)
        return q

    def _rotate(self, x, positions):
        """RoPE of the rotary dims x [T, heads, Dr] (de-interleaved first with
        rope_interleave)."""
        c = self.config
        if c.rope_interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return rope(x, positions, c.rope_theta, c.rope_scaling)

    def expand(self, latent, k_rope, dtype):
        """Keys [S, N, Dq] and values [S, N, Dq] (Dv real, the rest zeros) of S positions from
        their latents [S, R] and rotated shared keys [S, Dr]."""
        c = self.config
        s, n = latent.shape[0], c.n_heads
        kv = dot(latent.astype(dtype), self.kv_b_proj[...].astype(dtype))
        kv = kv.reshape(s, n, c.qk_nope_dim + c.v_head_dim)
        shared = jnp.broadcast_to(k_rope.astype(dtype)[:, None, :], (s, n, c.qk_rope_dim))
        k = jnp.concatenate([kv[..., :c.qk_nope_dim], shared], axis=-1)
        v = kv[..., c.qk_nope_dim:]
        if c.v_head_dim < c.head_dim:
            v = jnp.pad(v, ((0, 0), (0, 0), (0, c.head_dim - c.v_head_dim)))
        return k, v

    def _over_cache(self, q, k, v, cache_latent, cache_rope, start, path):
        """A later chunk over its own keys (causal) and the cached prefix 0..start-1, each
        prefix block expanded and attended as one part, merged as they come. A static start
        reads exactly the prefix's blocks; a traced one every block of the cache, each run
        only where it holds a prefix position."""
        c = self.config
        t, dv = q.shape[0], c.v_head_dim
        part_path = "cudnn" if path == "cudnn" else "split"
        acc_t = jnp.promote_types(jnp.float32, q.dtype)
        out, lse = attention_part(part_path, q, k, v, causal=True)
        acc = (out[..., :dv].astype(acc_t), lse.astype(acc_t))
        capacity = cache_latent.shape[0]
        block = prefix_block(c.n_heads, c.head_dim, np.dtype(q.dtype).itemsize, t, capacity,
                             part_path == "cudnn")
        static = isinstance(start, int)
        end = start if static else capacity
        for b0 in range(0, end, block):
            size = min(block, end - b0)

            def part(b0=b0, size=size):
                kb, vb = self.expand(lax.slice_in_dim(cache_latent, b0, b0 + size),
                                     lax.slice_in_dim(cache_rope, b0, b0 + size), q.dtype)
                kv_len = None if static else jnp.clip(start - b0, 0, size)
                o, l = attention_part(part_path, q, kb, vb, kv_len=kv_len)
                return o[..., :dv].astype(acc_t), l.astype(acc_t)

            if static:
                acc = merge_into(acc, part())
            else:  # merged inside the cond: each block waits for the last (one part alive)
                acc = lax.cond(start > b0, lambda a, part=part: merge_into(a, part()),
                               lambda a: a, acc)  # a block wholly past the prefix adds nothing
        return acc[0].astype(q.dtype)
