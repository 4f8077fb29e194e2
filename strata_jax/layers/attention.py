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

Sliding windows (`window`, a layer's `ModelConfig.window_of`): a query at position q sees the
keys q - window < k <= q. A window at least the keys' count (the chunk's for a first chunk, the
cache's capacity otherwise) can hide nothing and is dropped (`effective_window`), so such a layer
runs the full-attention program. Otherwise every path honours it exactly:

    "cudnn"    a first chunk: cuDNN's causal sliding window (left window w - 1, right 0). A later
               chunk: its own keys (causal, windowed) plus the last m = w - 1 cache positions
               before it, gathered in reverse order with the first min(T, m) queries reversed, so
               the window's band becomes a top-left causal mask with a padding length (positions
               before 0), which cuDNN runs fused; when T < m the keys every query sees are a
               third, padding-only part. Older cache positions are never read.
    "split"    the same parts and merge with XLA parts (the cuDNN parts' own check).
    "xla", "einsum"   the band in the [T, S] mask.
    "blocked"  the band in each block's mask; blocks wholly before every query's window are
               skipped.

Attention sinks (`sinks`, gpt-oss: `ModelConfig.attention_sinks`): one learned logit per query
head that joins every softmax row as one more term with no value, so a row's weights sum to
less than one. Every path takes it as one more log-sum-exp part with lse = sink and output 0
(`merge_parts(parts, dtype, sinks)`): a single part's output is scaled by sigmoid(lse - sink).
"cudnn" takes its float32 lse from `cudnn_part` (a first chunk too), "xla" and "einsum" from
`xla_part`'s math, "split" merges it with its parts, and "blocked" starts its online softmax
at it (running max = sink, running sum 1). Without sinks (None) no path adds an op for them.

Every path computes the same function within the dtype's rounding; a given path and shape is
one fixed op sequence, so the streamed and resident arms of the engine (which differ only in
where expert weights come from) get the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from strata_jax.kernels import ATTENTION_PATHS

# The one private JAX API here: cuDNN's fused attention with its float32 log-sum-exp (the
# public `jax.nn.dot_product_attention` returns it rounded to the inputs' dtype). Where a JAX
# release moves it, `cudnn_part` falls back to the public wrapper.
try:
    from jax._src.cudnn import fused_attention_stablehlo as _fa
except ImportError:  # pragma: no cover - depends on the installed jax
    _fa = None

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
                    head_dim: int, window: int | None = None, sinks: bool = False) -> int:
    """Working memory of one chunk's attention on `path` beyond q, k, v and the output.

    Fused ("cudnn"): each part's output and float32 statistics, the merge in float32. XLA paths
    ("xla", "einsum", "split"): [N, T, S] scores and probabilities in float32 plus the
    probabilities in the input dtype, and the mask. "blocked": the same for one key block, plus
    the running output, maxima and sums.

    window: a later chunk's sliding window (None for a first chunk: it changes no path's
    memory there). "cudnn" then has three parts and reversed copies of the first min(T, w - 1)
    queries and of the w - 1 keys and values read (counted with N heads, an upper bound);
    "split" forms scores over its own keys and the w - 1 before them only.

    sinks: the layer has attention sinks. Every path but "blocked" (which starts its running
    max and sum at the sink: no more memory) then merges a float32 output [T, N, D] with its
    log-sum-exp, the sinks broadcast and the weights ([T, N] float32 each) once more."""
    n, t, s, d = n_heads, n_queries, n_keys, head_dim
    extra = n * t * (d * 4 + 4 * 4) if sinks and path != "blocked" else 0
    return extra + _attention_bytes(path, itemsize, n, t, s, d, window)


def _attention_bytes(path: str, itemsize: int, n: int, t: int, s: int, d: int,
                     window: int | None) -> int:
    """`attention_bytes` without sinks."""
    window = effective_window(window, s)
    if window is not None and path in ("cudnn", "split"):
        m = window - 1
        qn = min(t, m)
        if path == "cudnn":
            return n * t * (3 * d * itemsize + 4 * d * 4 + 4 * 4) + n * d * itemsize * (qn + 2 * m)
        scores = t * t + qn * m
        return n * scores * (8 + itemsize) + scores + n * t * (3 * d * 4 + 4 * 4)
    if path == "cudnn":
        return n * t * (2 * d * itemsize + 3 * d * 4 + 3 * 4)
    if path == "blocked":
        b = attention_key_block(n, t, s)
        return n * t * (b * (8 + itemsize) + d * 4 + 8) + t * b
    return n * t * s * (8 + itemsize) + t * s


def effective_window(window: int | None, n_keys: int) -> int | None:
    """`window` where it can hide a key among `n_keys` positions 0..n_keys-1 (a query sees at
    most n_keys keys), else None: full attention is then the same function."""
    if window is None or window >= n_keys:
        return None
    if window < 1:
        raise ValueError(f"sliding window {window} must be a positive number of keys")
    return int(window)


def band_mask(q_pos, k_pos, window: int | None):
    """bool [T, S]: key position k_pos[s] visible to the query at q_pos[t]: k <= q and, with
    a window, q - k < window."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


# ---- the exact XLA paths ------------------------------------------------------------------------


def _grouped(q, kvh: int):
    t, n, d = q.shape
    return q.reshape(t, kvh, n // kvh, d)  # [T, KVH, G, D]


def einsum_attention(q, k, v, mask):
    """Explicit GQA attention. q [T, N, D], k/v [S, KVH, D], mask bool [T, S] -> [T, N, D]."""
    t, n, d = q.shape
    acc_t = jnp.promote_types(jnp.float32, q.dtype)  # float64 inputs: float64 throughout
    scores = jnp.einsum("tkgd,skd->kgts", _grouped(q, k.shape[1]), k,
                        preferred_element_type=acc_t) / np.sqrt(d)
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [KVH, G, T, S]
    out = jnp.einsum("kgts,skd->tkgd", probs, v, preferred_element_type=acc_t)
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


def blocked_attention(q, k, v, positions, block: int, window: int | None = None, sinks=None):
    """Grouped-query attention of queries at `positions` over keys 0..positions[t], one key block
    at a time with an online softmax: memory [N, T, block] instead of [N, T, S].

    Args:
        q: [T, N, D] queries; positions: int32 [T], each query's position (keys up to it count).
        k, v: [S, KVH, D] the cache; positions past the last query are never read.
        block: key block size, 1..S. When it does not divide S, the last block is read from
            S - block (overlapping the block before it) and counts only the keys past it.
        window: a sliding window (keys positions[t] - window < k only); the blocks before the
            first key any query sees are skipped.
        sinks: [N] each query head's sink logit (or None): the online softmax starts from it,
            running max = sink and running sum 1 (its term, which has no value).

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
    # Blocks holding any key a query may see: 0 (or the window's first) .. max(position) // block.
    n_blocks = jnp.minimum(jnp.max(positions) // block + 1, -(-s // block))
    first_block = 0
    if window is not None:
        first_block = jnp.maximum(jnp.min(positions) - (window - 1), 0) // block

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
        if window is not None:
            visible &= key_pos[None, :] > positions[:, None] - window
        scores = jnp.where(visible[None, None], scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        # Without a window block 0 holds key 0, which every query sees, so m is finite from
        # the first block on (with sinks, from the start). With one a query may have seen
        # nothing yet (m_new -inf): its terms are taken against 0 and come out 0.
        m_ref = m_new if window is None else jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(scores - m_ref[..., None])
        corr = jnp.exp(m - m_ref)
        l = l * corr + p.sum(axis=-1)
        pv = jnp.einsum("kgts,skd->kgtd", p.astype(q.dtype), vb, preferred_element_type=acc_t)
        return m_new, l, acc * corr[..., None] + pv

    g = n // kvh
    if sinks is None:
        init = (jnp.full((kvh, g, t), -jnp.inf, acc_t), jnp.zeros((kvh, g, t), acc_t),
                jnp.zeros((kvh, g, t, d), acc_t))
    else:  # the sink as the first term seen: max = sink, sum = exp(sink - sink)
        m0 = jnp.broadcast_to(jnp.asarray(sinks, acc_t).reshape(kvh, g, 1), (kvh, g, t))
        init = (m0, jnp.ones((kvh, g, t), acc_t), jnp.zeros((kvh, g, t, d), acc_t))
    _, l, acc = lax.fori_loop(first_block, n_blocks, body, init)
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


def cudnn_part(q, k, v, *, kv_len=None, causal: bool = False, window: int | None = None):
    """cuDNN flash attention of q [T, N, D] over k/v [S, KVH, D] with its log-sum-exp.

    kv_len: int32 scalar, only keys 0..kv_len-1 count (a padding mask; cuDNN skips the rest).
    causal: query i sees keys 0..i (top-left: also with kv_len).
    window: with `causal`, query i sees keys i - window < j <= i only (cuDNN's sliding window
        length, jax.nn's local_window_size (window - 1, 0)).

    Returns (out [T, N, D] in q.dtype, lse [T, N] float32). Raises what cuDNN raises for inputs
    it does not take (the caller falls back to an exact path)."""
    t, _, d = q.shape
    seq = None if kv_len is None else (jnp.full((1,), t, jnp.int32),
                                       jnp.reshape(kv_len, (1,)).astype(jnp.int32))
    try:  # float32 statistics; the public wrapper below rounds them to q's dtype
        if _fa is None:
            raise ImportError("jax._src.cudnn.fused_attention_stablehlo")
        fa = _fa
        mask_type = (fa.MaskType.PADDING_CAUSAL if seq and causal else
                     fa.MaskType.PADDING if seq else
                     fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK)
        sliding = {} if window is None else {"sliding_window_length": int(window)}
        out, lse = fa.dot_product_attention(
            q[None], k[None], v[None], None, None, *(seq or (None, None)),
            scale=1.0 / np.sqrt(d), mask_type=mask_type, return_residual=True, **sliding)
        lse = lse[0].astype(jnp.float32).T  # [N, T] -> [T, N]
    except (ImportError, AttributeError, TypeError):
        out, lse = jax.nn.dot_product_attention(
            q[None], k[None], v[None], is_causal=causal, implementation="cudnn",
            query_seq_lengths=None if seq is None else seq[0],
            key_value_seq_lengths=None if seq is None else seq[1], return_residual=True,
            local_window_size=None if window is None else (int(window) - 1, 0))
        lse = lse[0].astype(jnp.float32)  # [T, N]
    return out[0], lse


def attention_part(path: str, q, k, v, *, kv_len=None, causal: bool = False,
                   window: int | None = None):
    """One part on `path`: `cudnn_part` ("cudnn") or `xla_part` with the mask of the same
    arguments (every other path): key j of k/v visible to query i where j < kv_len, and with
    `causal` j <= i and, with `window`, i - j < window. Returns (out [T, N, D], lse [T, N])."""
    if window is not None and not causal:
        raise ValueError("a sliding window is defined with the causal mask only")
    if path == "cudnn":
        return cudnn_part(q, k, v, kv_len=kv_len, causal=causal, window=window)
    qi = jnp.arange(q.shape[0], dtype=jnp.int32)
    kj = jnp.arange(k.shape[0], dtype=jnp.int32)
    mask = (band_mask(qi, kj, window) if causal
            else jnp.ones((q.shape[0], k.shape[0]), bool))
    if kv_len is not None:
        mask &= kj[None, :] < jnp.asarray(kv_len, jnp.int32)
    return xla_part(q, k, v, mask)


def merge_parts(parts, dtype, sinks=None):
    """Combines attention over disjoint key sets: sum_i out_i * exp(lse_i - lse), with lse the
    log-sum-exp of all parts, in float32 (float64 for float64 inputs). A part with lse = -inf
    (no key seen) contributes nothing; every query must see a key in some part, or have a sink.

    sinks: [N] each query head's sink logit, or None. The sink joins as one more part with
    lse = sink and no value: it adds exp(sink - m) to the denominator only, so one part's
    output is scaled by sigmoid(lse - sink)."""
    acc_t = jnp.promote_types(jnp.float32, dtype)
    lses = [l.astype(acc_t) for _, l in parts]
    if sinks is not None:  # a part with lse = sink [T, N] and no output (zip below skips it)
        lses.append(jnp.broadcast_to(jnp.asarray(sinks, acc_t), lses[0].shape))
    m = lses[0]
    for l in lses[1:]:
        m = jnp.maximum(m, l)
    weights = [jnp.exp(l - m) for l in lses]  # [T, N]
    total = sum(weights[1:], weights[0])
    out = sum((o.astype(acc_t) * w[..., None] for (o, _), w in zip(parts[1:], weights[1:])),
              parts[0][0].astype(acc_t) * weights[0][..., None])
    return (out / total[..., None]).astype(dtype)


def chunk_over_cache(q, k_chunk, v_chunk, cache_k, cache_v, start, *, path: str,
                     window: int | None = None, sinks=None):
    """A later chunk's attention as two parts merged: its queries over the cache positions
    0..start-1 and over its own keys (causal). Never forms [T, S] scores on "cudnn".

    Args:
        q: [T, N, D] the chunk's queries at positions start..start+T-1.
        k_chunk, v_chunk: [T, KVH, D] the chunk's own keys and values (q's dtype).
        cache_k, cache_v: [S, KVH, D] the cache; only positions < start are read.
        start: int32 scalar (or int), the chunk's first position; 0 is allowed (no prefix).
        path: "cudnn" or "split" (XLA parts).
        window: a sliding window (`windowed_over_cache`); None or one of at least S: full.
        sinks: [N] float32 sink logits (one more part with no value, `merge_parts`) or None.
    """
    t = q.shape[0]
    s = cache_k.shape[0]
    window = effective_window(window, s)
    if window is not None:
        return windowed_over_cache(q, k_chunk, v_chunk, cache_k, cache_v, start, window,
                                   path=path, sinks=sinks)
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
    return merge_parts([(o1, l1), (o2, l2)], q.dtype, sinks)


def _seen_only_if(has, out, lse):
    """A part whose keys may all be padding: where `has` is False its weight is zero and its
    output is replaced (whatever the kernel left there; 0 * NaN is NaN)."""
    return jnp.where(has, out, jnp.zeros_like(out)), jnp.where(has, lse, -jnp.inf)


def windowed_over_cache(q, k_chunk, v_chunk, cache_k, cache_v, start, window: int, *,
                        path: str, sinks=None):
    """A later chunk's attention with a sliding window, as parts merged by log-sum-exp. Only
    the m = window - 1 cache positions before the chunk are read; no part has a band mask.

    Query i (position start + i) sees cache positions start + i - m .. start - 1 and its own
    keys i - m .. i. With the prefix's positions start - m + j (j = 0..m-1), query i sees j >= i:

        own  the chunk's queries over its own keys: causal, windowed.
        A    the first qn = min(T, m) queries over j < qn, both reversed (query qn - 1 - i, key
             qn - 1 - j): causal, with a padding length of the keys at positions >= 0.
        B    (T < m) every query over j >= T, which each of them sees; the keys reversed so
             those at positions >= 0 come first: a padding length only.

    Args:
        q, k_chunk, v_chunk, cache_k, cache_v, start, path, sinks: as in `chunk_over_cache`.
        window: the window, 1 <= window < S.
    """
    t = q.shape[0]
    m = window - 1
    own = attention_part(path, q, k_chunk, v_chunk, causal=True,
                         window=window if window < t else None)
    if m == 0:  # a query sees itself only
        return own[0] if sinks is None else merge_parts([own], q.dtype, sinks)
    start = jnp.asarray(start, jnp.int32)

    def gather(positions):  # keys at `positions` (descending); those below 0 are padding
        at = jnp.maximum(positions, 0)
        return (jnp.take(cache_k, at, axis=0).astype(q.dtype),
                jnp.take(cache_v, at, axis=0).astype(q.dtype))

    qn = min(t, m)
    rev = jnp.arange(qn, dtype=jnp.int32)
    len_a = jnp.clip(start - m + qn, 0, qn)  # keys j < qn at positions >= 0
    ka, va = gather(start - m + qn - 1 - rev)  # key qn - 1 - j at position start - m + j
    oa, la = attention_part(path, q[:qn][::-1], ka, va, kv_len=len_a, causal=True)
    oa, la = _seen_only_if(len_a > 0, oa[::-1], la[::-1])
    if qn < t:  # queries qn.. see no cache position
        oa = jnp.concatenate([oa, jnp.zeros((t - qn,) + oa.shape[1:], oa.dtype)])
        la = jnp.concatenate([la, jnp.full((t - qn,) + la.shape[1:], -jnp.inf, la.dtype)])
    parts = [own, (oa, la)]
    if m > qn:
        nb = m - qn
        len_b = jnp.clip(start, 0, nb)  # key m - 1 - j at position start - m + j
        kb, vb = gather(start - 1 - jnp.arange(nb, dtype=jnp.int32))
        parts.append(_seen_only_if(len_b > 0, *attention_part(path, q, kb, vb, kv_len=len_b)))
    return merge_parts(parts, q.dtype, sinks)


# ---- one chunk ----------------------------------------------------------------------------------


def _masked(q, k, v, mask, path: str, sinks=None):
    """The exact paths over keys k/v [S, KVH, D] where mask [T, S] allows: explicit einsums
    ("einsum") or XLA's dot_product_attention (every other path that lands here). With sinks
    both are `xla_part` (float64 inputs: float64 throughout) merged with the sink."""
    if sinks is not None:
        return merge_parts([xla_part(q, k, v, mask)], q.dtype, sinks)
    if path == "einsum":
        return einsum_attention(q, k, v, mask)
    return jax.nn.dot_product_attention(
        q[None], k[None], v[None], mask=mask[None, None], implementation="xla")[0]


def attend_first(q, k, v, path: str, window: int | None = None, sinks=None):
    """A first chunk: q [T, N, D] over its own keys k/v [T, KVH, D], causally (within
    `window`, a sliding window, when it is smaller than T). sinks: [N] float32 sink logits
    (float64 for float64 inputs) or None; on "cudnn" the fused part's float32 lse merges them."""
    t = q.shape[0]
    window = effective_window(window, t)
    if path == "cudnn":
        try:
            if sinks is not None:
                return merge_parts([cudnn_part(q, k, v, causal=True, window=window)], q.dtype,
                                   sinks)
            return jax.nn.dot_product_attention(
                q[None], k[None], v[None], is_causal=True, implementation="cudnn",
                local_window_size=None if window is None else (window - 1, 0))[0]
        except (NotImplementedError, ValueError, RuntimeError):
            pass  # this cuDNN build rejects the shape: the XLA path below is exact too.
    if window is None:
        return _masked(q, k, v, jnp.tril(jnp.ones((t, t), bool)), path, sinks)
    pos = jnp.arange(t, dtype=jnp.int32)
    return _masked(q, k, v, band_mask(pos, pos, window), path, sinks)


def attend_cached(q, k_chunk, v_chunk, cache_k, cache_v, start, positions, path: str,
                  window: int | None = None, sinks=None):
    """A later chunk: q [T, N, D] at `positions` (start..start+T-1) over the cache (which
    already holds the chunk's own keys at start..start+T-1) on `path`, within `window` (a
    sliding window) when it is smaller than the cache; sinks as in `attend_first`."""
    window = effective_window(window, cache_k.shape[0])
    if path in ("cudnn", "split"):
        kc, vc = k_chunk.astype(q.dtype), v_chunk.astype(q.dtype)
        try:
            return chunk_over_cache(q, kc, vc, cache_k, cache_v, start, path=path, window=window,
                                    sinks=sinks)
        except (NotImplementedError, ValueError, RuntimeError):
            if path == "split":
                raise
            path = "xla"  # this cuDNN build rejects the shape: the exact XLA path below
    if path == "blocked":
        block = attention_key_block(q.shape[1], q.shape[0], cache_k.shape[0])
        return blocked_attention(q, cache_k, cache_v, positions, block, window, sinks)
    key_pos = jnp.arange(cache_k.shape[0], dtype=jnp.int32)  # [S]
    mask = band_mask(positions, key_pos, window)  # [T, S]
    return _masked(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype), mask, path, sinks)
