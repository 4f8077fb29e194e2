"""Grouped-query attention of one chunk: over its own keys (a first chunk) or over a KV cache.

Paths, chosen per call by `attention_path` (static: dtype, shapes, platform and the requested
path, `Kernels.attention`):

    "cudnn"    fused cuDNN flash attention, never materialising scores. A first chunk is one
               causal call. A later chunk (start > 0) is two calls merged by their log-sum-exp:
               its queries over the cache's positions 0..start-1 (a padding mask of length
               `start` over the whole cache) and over the chunk's own keys (causal). GPU,
               bfloat16/float16, head_dim <= 256 and a multiple of 8.
    "split"    the same two parts and merge with each part computed by XLA (exact on any
               platform and dtype; it materialises each part's scores). The merge's own check.
    "xla"      one XLA attention with a [T, S] mask over the whole cache.
    "blocked"  an online softmax over key blocks (memory of one block's scores), for a later
               chunk whose [N, T, S] float32 scores would pass BLOCKED_ATTENTION_BYTES.
    "einsum"   explicit float math (float64 inputs: jax.nn.dot_product_attention has no
               float64 kernel).

Every path computes the same function within the dtype's rounding; a given path and shape is
one fixed op sequence, so the streamed and resident arms of the engine (which differ only in
where expert weights come from) get the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .kernels import ATTENTION_PATHS

# A later chunk's attention against the cache builds [heads, T, S] float32 scores on the XLA
# path: 32 GiB for 8K queries against a 32K cache with 32 heads. Past this many score bytes,
# "auto" attends block by block over the keys instead (online softmax), holding one block.
BLOCKED_ATTENTION_BYTES = 1 << 31
_BLOCK_SCORE_BYTES = 1 << 28  # score bytes of one key block in the blocked path


def fused_available(dtype, head_dim: int, platform: str | None = None) -> bool:
    """Whether cuDNN's fused attention takes these inputs: a GPU, bfloat16/float16, head_dim at
    most 256 (qwen3-next's) and a multiple of 8. `platform` defaults to JAX's default backend.
    A cuDNN build that still rejects a shape raises at trace time, and the caller takes the
    exact XLA path."""
    platform = platform or jax.default_backend()
    return (platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and head_dim <= 256 and head_dim % 8 == 0)


def attention_path(dtype, head_dim: int, n_heads: int, n_queries: int, n_keys: int, *,
                   first: bool, platform: str | None = None, impl: str = "auto") -> str:
    """The path a chunk's attention runs: "cudnn", "split", "xla", "blocked" or "einsum".

    Args:
        dtype: the queries' dtype.
        head_dim, n_heads: the model's head size and query heads.
        n_queries: the chunk's (padded) tokens.
        n_keys: a later chunk's cache capacity (ignored for a first chunk).
        first: a first chunk (attends to its own keys only).
        platform: "gpu" or "cpu"; default JAX's default backend.
        impl: the requested path (`Kernels.attention`); "auto" chooses.
    """
    impl = (impl or "auto").lower()
    if impl not in ATTENTION_PATHS:
        raise ValueError(f"attention path {impl!r}: expected one of {'|'.join(ATTENTION_PATHS)}")
    fused = fused_available(dtype, head_dim, platform)
    if impl == "auto":
        if jnp.dtype(dtype) == jnp.float64:
            return "einsum"
        if fused:
            return "cudnn"
        if not first and n_heads * n_queries * n_keys * 4 > BLOCKED_ATTENTION_BYTES:
            return "blocked"
        return "xla"
    if impl == "cudnn" and not fused:
        return "xla"  # forced where cuDNN cannot run: the exact XLA path
    if first and impl in ("blocked", "split"):
        return "xla"  # a first chunk has no cache to split off or walk in blocks
    return impl


def attention_bytes(path: str, itemsize: int, n_heads: int, n_queries: int, n_keys: int,
                    head_dim: int) -> int:
    """Working memory of one chunk's attention on `path` beyond q, k, v and the output.

    Fused ("cudnn"): each part's output and float32 statistics, the merge in float32. XLA paths
    ("xla", "einsum", "split"): [N, T, S] scores and probabilities in float32 plus the
    probabilities in the input dtype, and the mask. "blocked": the same for one key block, plus
    the running output, maxima and sums."""
    n, t, s, d = n_heads, n_queries, n_keys, head_dim
    if path == "cudnn":
        return n * t * (2 * d * itemsize + 3 * d * 4 + 3 * 4)
    if path == "blocked":
        b = attention_key_block(n, t, s)
        return n * t * (b * (8 + itemsize) + d * 4 + 8) + t * b
    return n * t * s * (8 + itemsize) + t * s


# ---- the exact XLA paths ------------------------------------------------------------------------


def _grouped(q, kvh: int):
    t, n, d = q.shape
    return q.reshape(t, kvh, n // kvh, d)  # [T, KVH, G, D]


def einsum_attention(q, k, v, mask):
    """Explicit GQA attention. q [T, N, D], k/v [S, KVH, D], mask bool [T, S] -> [T, N, D]."""
    t, n, d = q.shape
    scores = jnp.einsum("tkgd,skd->kgts", _grouped(q, k.shape[1]), k,
                        preferred_element_type=jnp.float32) / np.sqrt(d)
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [KVH, G, T, S]
    out = jnp.einsum("kgts,skd->tkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(t, n, d).astype(q.dtype)


def attention_key_block(n_heads: int, n_queries: int, n_keys: int) -> int:
    """Key block of the blocked path: the largest power of two in 128..4096 whose float32
    scores for `n_queries` queries fit `_BLOCK_SCORE_BYTES`, at most `n_keys`. It need not
    divide `n_keys`: the last block is read overlapping the one before (blocked_attention), so
    a cache that no large power of two divides keeps large blocks."""
    block = 4096
    while block > 128 and n_heads * n_queries * block * 4 > _BLOCK_SCORE_BYTES:
        block //= 2
    return max(1, min(block, n_keys))


def blocked_attention(q, k, v, positions, block: int):
    """Grouped-query attention of queries at `positions` over keys 0..positions[t], one key block
    at a time with an online softmax: memory [N, T, block] instead of [N, T, S].

    Args:
        q: [T, N, D] queries; positions: int32 [T], each query's position (keys up to it count).
        k, v: [S, KVH, D] the cache; positions past the last query are never read.
        block: key block size, 1..S. When it does not divide S, the last block is read from
            S - block (overlapping the block before it) and counts only the keys past it.

    Returns:
        [T, N, D] in q.dtype. Scores, running maxima and sums are float32 (float64 inputs: 64).
    """
    t, n, d = q.shape
    s, kvh = k.shape[0], k.shape[1]
    acc_t = jnp.promote_types(jnp.float32, q.dtype)
    qg = _grouped(q, kvh)
    scale = 1.0 / np.sqrt(d)
    if not 1 <= block <= s:
        raise ValueError(f"key block {block} outside 1..{s} (the cache's positions)")
    # Blocks holding any key a query may see: 0 .. max(position) // block.
    n_blocks = jnp.minimum(jnp.max(positions) // block + 1, -(-s // block))

    def body(i, carry):
        m, l, acc = carry  # [KVH, G, T], [KVH, G, T], [KVH, G, T, D]
        first = i * block  # the block's first key; a last partial block is read from s - block
        start = jnp.minimum(first, s - block)
        kb = lax.dynamic_slice_in_dim(k, start, block, 0).astype(q.dtype)  # [B, KVH, D]
        vb = lax.dynamic_slice_in_dim(v, start, block, 0).astype(q.dtype)
        scores = jnp.einsum("tkgd,skd->kgts", qg, kb, preferred_element_type=acc_t) * scale
        key_pos = start + jnp.arange(block, dtype=jnp.int32)  # [B]
        # Keys before `first` were counted by the block before.
        visible = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] >= first)
        scores = jnp.where(visible[None, None], scores, -jnp.inf)
        # Block 0 holds key 0, which every query sees, so m is finite from the first block on.
        m_new = jnp.maximum(m, scores.max(axis=-1))
        p = jnp.exp(scores - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(axis=-1)
        pv = jnp.einsum("kgts,skd->kgtd", p.astype(q.dtype), vb, preferred_element_type=acc_t)
        return m_new, l, acc * corr[..., None] + pv

    g = n // kvh
    init = (jnp.full((kvh, g, t), -jnp.inf, acc_t), jnp.zeros((kvh, g, t), acc_t),
            jnp.zeros((kvh, g, t, d), acc_t))
    _, l, acc = lax.fori_loop(0, n_blocks, body, init)
    out = acc / l[..., None]  # [KVH, G, T, D]
    return out.transpose(2, 0, 1, 3).reshape(t, n, d).astype(q.dtype)


# ---- parts with their log-sum-exp, and the merge ------------------------------------------------


def xla_part(q, k, v, mask):
    """Attention of q [T, N, D] over k/v [S, KVH, D] where mask [T, S] allows, with its
    log-sum-exp: (out [T, N, D] in q.dtype, lse [T, N] float32, or float64 for float64 inputs).
    A query that sees no key gets lse = -inf and out = 0."""
    t, n, d = q.shape
    acc_t = jnp.promote_types(jnp.float32, q.dtype)
    scores = jnp.einsum("tkgd,skd->kgts", _grouped(q, k.shape[1]), k,
                        preferred_element_type=acc_t) / np.sqrt(d)
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    m = scores.max(axis=-1)  # [KVH, G, T]
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m_safe[..., None])
    l = p.sum(axis=-1)
    out = jnp.einsum("kgts,skd->tkgd", p.astype(q.dtype), v, preferred_element_type=acc_t)
    out = out / jnp.where(l > 0, l, 1.0).transpose(2, 0, 1)[..., None]
    lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return out.reshape(t, n, d).astype(q.dtype), lse.transpose(2, 0, 1).reshape(t, n)


def cudnn_part(q, k, v, *, kv_len=None, causal: bool = False):
    """cuDNN flash attention of q [T, N, D] over k/v [S, KVH, D] with its log-sum-exp.

    kv_len: int32 scalar, only keys 0..kv_len-1 count (a padding mask; cuDNN skips the rest).
    causal: query i sees keys 0..i (S == T).

    Returns (out [T, N, D] in q.dtype, lse [T, N] float32). Raises what cuDNN raises for inputs
    it does not take (the caller falls back to an exact path)."""
    t, _, d = q.shape
    seq = None if kv_len is None else (jnp.full((1,), t, jnp.int32),
                                       jnp.reshape(kv_len, (1,)).astype(jnp.int32))
    try:  # float32 statistics; the public wrapper below rounds them to q's dtype
        from jax._src.cudnn import fused_attention_stablehlo as fa
        mask_type = (fa.MaskType.PADDING_CAUSAL if seq and causal else
                     fa.MaskType.PADDING if seq else
                     fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK)
        out, lse = fa.dot_product_attention(
            q[None], k[None], v[None], None, None, *(seq or (None, None)),
            scale=1.0 / np.sqrt(d), mask_type=mask_type, return_residual=True)
        lse = lse[0].astype(jnp.float32).T  # [N, T] -> [T, N]
    except (ImportError, AttributeError, TypeError):
        out, lse = jax.nn.dot_product_attention(
            q[None], k[None], v[None], is_causal=causal, implementation="cudnn",
            query_seq_lengths=None if seq is None else seq[0],
            key_value_seq_lengths=None if seq is None else seq[1], return_residual=True)
        lse = lse[0].astype(jnp.float32)  # [T, N]
    return out[0], lse


def merge_parts(parts, dtype):
    """Combines attention over disjoint key sets: sum_i out_i * exp(lse_i - lse), with lse the
    log-sum-exp of all parts, in float32 (float64 for float64 inputs). A part with lse = -inf
    (no key seen) contributes nothing; every query must see a key in some part."""
    acc_t = jnp.promote_types(jnp.float32, dtype)
    lses = [l.astype(acc_t) for _, l in parts]
    m = lses[0]
    for l in lses[1:]:
        m = jnp.maximum(m, l)
    weights = [jnp.exp(l - m) for l in lses]  # [T, N]
    total = sum(weights[1:], weights[0])
    out = sum((o.astype(acc_t) * w[..., None] for (o, _), w in zip(parts[1:], weights[1:])),
              parts[0][0].astype(acc_t) * weights[0][..., None])
    return (out / total[..., None]).astype(dtype)


def chunk_over_cache(q, k_chunk, v_chunk, cache_k, cache_v, start, *, path: str):
    """A later chunk's attention as two parts merged: its queries over the cache positions
    0..start-1 and over its own keys (causal). Never forms [T, S] scores on "cudnn".

    Args:
        q: [T, N, D] the chunk's queries at positions start..start+T-1.
        k_chunk, v_chunk: [T, KVH, D] the chunk's own keys and values (q's dtype).
        cache_k, cache_v: [S, KVH, D] the cache; only positions < start are read.
        start: int32 scalar (or int), the chunk's first position; 0 is allowed (no prefix).
        path: "cudnn" or "split" (XLA parts).
    """
    t = q.shape[0]
    s = cache_k.shape[0]
    start = jnp.asarray(start, jnp.int32)
    kc, vc = cache_k.astype(q.dtype), cache_v.astype(q.dtype)
    if path == "cudnn":
        o1, l1 = cudnn_part(q, kc, vc, kv_len=start)
        o2, l2 = cudnn_part(q, k_chunk, v_chunk, causal=True)
    else:
        o1, l1 = xla_part(q, kc, vc, jnp.broadcast_to(jnp.arange(s) < start, (t, s)))
        o2, l2 = xla_part(q, k_chunk, v_chunk, jnp.tril(jnp.ones((t, t), bool)))
    # With no prefix (start 0) the first part saw no key: whatever the kernel left there
    # must not count, so its weight is zero and its output is replaced (0 * NaN is NaN).
    has_prefix = start > 0
    l1 = jnp.where(has_prefix, l1, -jnp.inf)
    o1 = jnp.where(has_prefix, o1, jnp.zeros_like(o1))
    return merge_parts([(o1, l1), (o2, l2)], q.dtype)


# ---- one chunk ----------------------------------------------------------------------------------


def _masked(q, k, v, mask, path: str):
    """The exact paths over keys k/v [S, KVH, D] where mask [T, S] allows: explicit einsums
    ("einsum") or XLA's dot_product_attention (every other path that lands here)."""
    if path == "einsum":
        return einsum_attention(q, k, v, mask)
    return jax.nn.dot_product_attention(
        q[None], k[None], v[None], mask=mask[None, None], implementation="xla")[0]


def attend_first(q, k, v, path: str):
    """A first chunk: q [T, N, D] over its own keys k/v [T, KVH, D], causally."""
    t = q.shape[0]
    if path == "cudnn":
        try:
            return jax.nn.dot_product_attention(
                q[None], k[None], v[None], is_causal=True, implementation="cudnn")[0]
        except (NotImplementedError, ValueError, RuntimeError):
            pass  # this cuDNN build rejects the shape: the XLA path below is exact too.
    return _masked(q, k, v, jnp.tril(jnp.ones((t, t), bool)), path)


def attend_cached(q, k_chunk, v_chunk, cache_k, cache_v, start, positions, path: str):
    """A later chunk: q [T, N, D] at `positions` (start..start+T-1) over the cache (which
    already holds the chunk's own keys at start..start+T-1) on `path`."""
    if path in ("cudnn", "split"):
        kc, vc = k_chunk.astype(q.dtype), v_chunk.astype(q.dtype)
        try:
            return chunk_over_cache(q, kc, vc, cache_k, cache_v, start, path=path)
        except (NotImplementedError, ValueError, RuntimeError):
            if path == "split":
                raise
            path = "xla"  # this cuDNN build rejects the shape: the exact XLA path below
    if path == "blocked":
        block = attention_key_block(q.shape[1], q.shape[0], cache_k.shape[0])
        return blocked_attention(q, cache_k, cache_v, positions, block)
    key_pos = jnp.arange(cache_k.shape[0], dtype=jnp.int32)  # [S]
    mask = key_pos[None, :] <= positions[:, None]  # [T, S]
    return _masked(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype), mask, path)
