"""A chunk's attention over its cached prefix against a float64 NumPy reference.

Guards the two-part attention of a later chunk (its queries over cache positions 0..start-1, then
over its own keys causally, merged by log-sum-exp): the merge itself ("split", XLA parts, on every
platform), cuDNN's fused parts on the GPU, and the model's chunked prompts and follow-up turns on
every path, at offsets that are 0, not a multiple of any block, and just below and above a block
of 128, with GQA and a cache larger than the positions used (its tail holds garbage that must
never count).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from strata_jax.layers import attention as A
from strata_jax.models import decoder as M
from strata_jax.models import get_preset
from strata_jax.kernels import Kernels
from strata_jax.reference import reference_attention, reference_forward
from strata_jax.synthetic import init_synthetic
from strata_jax.testing import assert_close, read_in_chunks

OFFSETS = (0, 13, 127, 128, 129, 300)
LAYOUTS = ((8, 2, 16), (4, 4, 32), (16, 1, 64))  # (query heads, KV heads, head_dim)


def _inputs(dtype, start, n, kvh, d, t=50, s=512, seed=0):
    rng = np.random.default_rng(seed + start)
    q = rng.standard_normal((t, n, d)).astype(dtype)
    k = rng.standard_normal((s, kvh, d)).astype(dtype)
    v = rng.standard_normal((s, kvh, d)).astype(dtype)
    k[start + t:] = 1e4  # garbage past the chunk: would dominate any softmax it entered
    v[start + t:] = -1e4  # (finite: a cache past its positions holds zeros or stale keys)
    return q, k, v, np.arange(start, start + t, dtype=np.int32)


def _chunk_over_cache(path, t):
    def f(q, k, v, start):
        kc = jax.lax.dynamic_slice_in_dim(k, start, t, 0)
        vc = jax.lax.dynamic_slice_in_dim(v, start, t, 0)
        return A.chunk_over_cache(q, kc, vc, k, v, start, path=path)
    return jax.jit(f)


def _split_cases():
    """Every dtype, offset and layout: the default run takes one layout per dtype (float16 at
    two offsets), the slow run the rest."""
    cases = []
    for dtype, default_layout in ((np.float32, LAYOUTS[0]), (ml_dtypes.bfloat16, LAYOUTS[2]),
                                  (np.float16, LAYOUTS[1])):
        for layout in LAYOUTS:
            for start in OFFSETS:
                slow = layout != default_layout or (dtype is np.float16
                                                    and start not in (0, 129))
                cases.append(pytest.param(dtype, start, layout,
                                          marks=(pytest.mark.slow,) if slow else ()))
    return cases


@pytest.mark.parametrize("dtype, start, layout", _split_cases())
def test_split_parts_match_reference(dtype, start, layout):
    n, kvh, d = layout
    q, k, v, positions = _inputs(dtype, start, n, kvh, d)
    got = _chunk_over_cache("split", q.shape[0])(q, k, v, jnp.int32(start))
    assert got.dtype == np.dtype(dtype)
    assert_close(got, reference_attention(q, k, v, positions), dtype,
                 err_msg=f"start {start} layout {layout}")


@pytest.mark.parametrize("start", (0, 129))
def test_split_parts_float64(start):
    with jax.enable_x64(True):
        q, k, v, positions = _inputs(np.float64, start, 8, 2, 16)
        got = _chunk_over_cache("split", q.shape[0])(q, k, v, jnp.int32(start))
        assert got.dtype == np.float64
        assert_close(got, reference_attention(q, k, v, positions), np.float64)


def test_merge_ignores_a_part_that_saw_nothing():
    # A part with lse -inf (no key) and a NaN output adds nothing; two equal parts average.
    o = jnp.ones((3, 2, 4), jnp.float32)
    nan = jnp.full_like(o, jnp.nan)
    lse = jnp.zeros((3, 2), jnp.float32)
    got = A.merge_parts([(o, lse), (jnp.where(True, 0.0, nan), jnp.full_like(lse, -jnp.inf))],
                        jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.ones((3, 2, 4)))
    got = A.merge_parts([(o, lse), (3 * o, lse)], jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.full((3, 2, 4), 2.0))


def test_attention_bytes_fused_has_no_score_term():
    # 8K queries over a 40K cache, 32 heads: fused holds outputs and statistics only, XLA the
    # [N, T, S] scores, blocked one key block of them.
    fused = A.attention_bytes("cudnn", 2, 32, 8192, 40960, 128)
    xla = A.attention_bytes("xla", 2, 32, 8192, 40960, 128)
    blocked = A.attention_bytes("blocked", 2, 32, 8192, 40960, 128)
    assert fused < blocked < 2**30 < xla
    assert xla > 32 * 8192 * 40960 * 8


# ---- the model: chunked prompts and follow-up turns on every path ------------------------------


def _small(**kw):
    kw = {"n_experts": 16, "param_dtype": "float32", "max_seq_len": 1024, **kw}
    return get_preset("qwen3-30b-a3b").scaled(**kw)


@pytest.fixture(scope="module")
def qwen_small():
    c = _small()
    params = init_synthetic(c, 0)
    return c, M.build_model(c, params), params


# Chunk boundaries: 13 (no block multiple), 127 / 128 / 129 around a block of 128, then a
# follow-up turn of 71 from 129 to 200 over a 512-position cache.
BOUNDS = (0, 13, 127, 128, 129, 200)


@pytest.mark.parametrize("path", [pytest.param("xla", marks=pytest.mark.slow), "split",
                                  pytest.param("blocked", marks=pytest.mark.slow)])
def test_chunked_prompt_and_follow_up_match_reference(qwen_small, path):
    c, _, params = qwen_small
    model = M.build_model(c, params, kernels=Kernels(attention=path))
    toks = np.random.default_rng(4).integers(0, c.vocab_size, BOUNDS[-1]).astype(np.int32)
    ref, _ = reference_forward(c, params, toks)
    for lo, hi, logits in read_in_chunks(model, toks, BOUNDS, M.init_cache(c, 512)):
        assert_close(logits, ref[lo:hi], np.float32, err_msg=f"{path}: positions {lo}..{hi - 1}")


@pytest.mark.parametrize("rows", [pytest.param(48, marks=pytest.mark.slow), 96,
                                  pytest.param(144, marks=pytest.mark.slow)])
def test_layer_major_sub_chunks_match_reference(qwen_small, rows):
    # Sub-chunks of 48 over a 200-token prompt (the last padded): starts 48, 96, 144 attend to
    # the sub-chunks before them through the split parts; the router and experts run on 1, 2
    # or 3 sub-chunks' rows at a time (the last group shorter).
    c, _, params = qwen_small
    model = M.build_model(c, params, kernels=Kernels(attention="split"))
    toks = np.random.default_rng(5).integers(0, c.vocab_size, 200).astype(np.int32)
    padded = np.zeros(240, np.int32)
    padded[:200] = toks
    ref, _ = reference_forward(c, params, toks)
    f = jax.jit(lambda t, k, n: model.layer_major(t, k, 0, None, 48, n_valid=n,
                                                  last_logits=True, expert_rows=rows))
    logits, _, _ = f(jnp.asarray(padded), M.init_cache(c, 512), jnp.int32(200))
    assert_close(logits, ref[-1], np.float32, err_msg=f"expert_rows={rows}")
    with pytest.raises(ValueError, match="expert_rows=72 is not a multiple of sub_chunk=48"):
        model.layer_major(jnp.asarray(padded), M.init_cache(c, 512), 0, None, 48,
                          expert_rows=72)


# ---- cuDNN on the GPU -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,layout", [(ml_dtypes.bfloat16, (32, 4, 128)),
                                          (ml_dtypes.bfloat16, (16, 16, 64)),
                                          (ml_dtypes.bfloat16, (16, 2, 256)),
                                          (np.float16, (32, 4, 64))])
@pytest.mark.parametrize("start", (0, 1, 127, 129, 1791))
def test_cudnn_parts_match_reference(dtype, start, layout):
    n, kvh, d = layout
    q, k, v, positions = _inputs(dtype, start, n, kvh, d, t=256, s=2048)
    f = _chunk_over_cache("cudnn", 256)
    got = f(q, k, v, jnp.int32(start))
    assert got.dtype == np.dtype(dtype)
    ref = reference_attention(q, k, v, positions)
    assert_close(got, ref, dtype, err_msg=f"start {start} layout {layout}")
    # Never worse than the exact XLA parts by more than the dtype's rounding.
    split = _chunk_over_cache("split", 256)(q, k, v, jnp.int32(start))
    err_fused = np.abs(np.asarray(got, np.float64) - ref).max()
    err_split = np.abs(np.asarray(split, np.float64) - ref).max()
    eps = float(ml_dtypes.finfo(dtype).eps)
    assert err_fused <= 2 * err_split + 4 * eps, (err_fused, err_split)


@pytest.mark.gpu
def test_cudnn_parts_are_fused_calls():
    # The compiled program runs cuDNN's fused attention (two calls) and no [T, S] score tensor.
    q, k, v, _ = _inputs(ml_dtypes.bfloat16, 300, 32, 4, 128, t=256, s=4096)
    hlo = _chunk_over_cache("cudnn", 256).lower(q, k, v, jnp.int32(300)).compile().as_text()
    assert hlo.count("__cudnn$fmha") >= 2, hlo[:2000]
    assert "256,4096]" not in hlo and "256,4096}" not in hlo


@pytest.mark.gpu
def test_cudnn_chunked_model_matches_reference():
    # bf16 model with head_dim 64, every token routed to all 4 experts (top-k = E: no routing
    # choice that bf16 rounding could flip), chunked at the BOUNDS offsets on the default
    # (cuDNN) path, against the float64 reference on the same bf16-rounded weights.
    c = _small(n_experts=4, top_k=4, param_dtype="bfloat16", hidden_size=256)
    c = c.replace(head_dim=64, n_heads=8, n_kv_heads=2)
    params = init_synthetic(c, 3)
    model = M.build_model(c, params)
    assert A.attention_path(c.dtype, c.head_dim, c.n_heads, 64, 512, first=False) == "cudnn"
    toks = np.random.default_rng(6).integers(0, c.vocab_size, BOUNDS[-1]).astype(np.int32)
    ref, _ = reference_forward(c, params, toks)
    for lo, hi, logits in read_in_chunks(model, toks, BOUNDS, M.init_cache(c, 512)):
        assert_close(logits, ref[lo:hi], ml_dtypes.bfloat16, err_msg=f"positions {lo}..{hi - 1}")
