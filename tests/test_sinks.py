"""Attention sinks (gpt-oss: a learned logit per query head that joins every softmax row as one
more term with no value) on every attention path against the float64 reference.

Guards the sink as one more log-sum-exp part (`merge_parts`): a first chunk and a later chunk
over a cache (static and traced starts, a traced start of 0), sliding windows smaller and larger
than the chunk and the three-part case (T < w - 1), on "einsum" (float64), "xla", "split",
"blocked" (several key blocks, skipped ones) and "cudnn" (its fallback on the CPU; its fused
parts on the GPU); rows with no key; the layer's parameter; the working-memory estimate; and a
whole model with sinks and windowed layers, chunked and in one chunk, against reference.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from strata_jax.engine.memory import attention_working_bytes
from strata_jax.kernels import Kernels
from strata_jax.layers import attention as A
from strata_jax.models import decoder as M
from strata_jax.models import get_preset, param_shapes
from strata_jax.reference import reference_attention, reference_forward
from strata_jax.synthetic import init_synthetic
from strata_jax.testing import assert_close, read_in_chunks

N, KVH, D, S = 8, 2, 16, 128


def _sinks(n=N, seed=0):
    """float32 [n]: N(0, 2^2) draws with two large positive ones (a head whose rows the sink
    mostly takes) and one large negative one (a sink that takes almost nothing)."""
    s = np.random.default_rng(seed).normal(0.0, 2.0, n)
    s[0], s[1], s[-1] = 6.0, 10.0, -8.0
    return s.astype(np.float32)


def _inputs(dtype, start, t, *, n=N, kvh=KVH, d=D, s=S, seed=0):
    rng = np.random.default_rng(seed + 1000 * start + t)
    q = rng.standard_normal((t, n, d)).astype(dtype)
    k = rng.standard_normal((s, kvh, d)).astype(dtype)
    v = rng.standard_normal((s, kvh, d)).astype(dtype)
    k[start + t:] = 1e4  # garbage past the chunk: would dominate any softmax it entered
    v[start + t:] = -1e4
    return q, k, v, np.arange(start, start + t, dtype=np.int32)


def _attend(path, q, k, v, start, window, sinks, *, traced=True, resolve=True):
    """The model's call for a chunk at `start` (static 0: a first chunk over its own keys; a
    later one with `start` traced or a Python int), on `path` as `attention_path` resolves it
    (`resolve`) or as given (a "cudnn" that must fall back by itself)."""
    t = q.shape[0]
    first = start == 0 and not traced
    if resolve:
        path = A.attention_path(q.dtype, q.shape[2], q.shape[1], t, k.shape[0], first=first,
                                impl=path)
    sinks = jnp.asarray(sinks, jnp.promote_types(jnp.float32, q.dtype))
    if first:
        return jax.jit(lambda q, k, v, s: A.attend_first(q, k, v, path, window, s))(
            q, k[:t], v[:t], sinks)

    def f(q, k, v, st, s):
        st = start if not traced else st
        kc = jax.lax.dynamic_slice_in_dim(k, st, t, 0)
        vc = jax.lax.dynamic_slice_in_dim(v, st, t, 0)
        positions = st + jnp.arange(t, dtype=jnp.int32)
        return A.attend_cached(q, kc, vc, k, v, st, positions, path, window, s)
    return jax.jit(f)(q, k, v, jnp.int32(start), sinks)


# (T, start, window, traced): first chunks (full, a window smaller and one larger than the
# chunk); later chunks over a static and a traced start, a traced start of 0 (no prefix);
# windows smaller than the chunk, of 1 (own keys only), larger than the chunk with T >= w - 1,
# and T < w - 1 (the three-part case) over prefixes longer and shorter than the window.
CASES = ((40, 0, None, False), (40, 0, 7, False), (40, 0, 60, False),
         (30, 50, None, False), (30, 50, None, True), (30, 0, None, True), (30, 0, 7, True),
         (30, 50, 7, True), (30, 50, 7, False), (30, 50, 1, True), (30, 50, 31, True),
         (5, 100, 20, True), (5, 10, 20, True), (5, 16, 20, False))
# The default run: every case of "split" (the merge), the first chunk, the three-part case,
# a static and a traced start on the others; the slow run every pair.
FEW = ((40, 0, 7, False), (30, 50, None, True), (30, 50, 7, False), (5, 100, 20, True))
FAST = {"split": CASES, "xla": FEW, "blocked": FEW[1:], "cudnn": FEW}
FAST_FLOAT64 = ((40, 0, 7, False), (30, 0, None, True), (30, 50, 1, True), (5, 10, 20, True))


def _case_id(case):
    t, start, window, traced = case
    return f"T{t}-start{start}{'t' if traced else ''}-w{window}"


def _path_cases():
    return [pytest.param(path, case, id=f"{path}-{_case_id(case)}",
                         marks=() if case in FAST[path] else (pytest.mark.slow,))
            for path in FAST for case in CASES]


@pytest.mark.parametrize("path, case", _path_cases())
def test_paths_with_sinks_match_reference(path, case):
    t, start, window, traced = case
    q, k, v, positions = _inputs(np.float32, start, t)
    sinks = _sinks()
    want = reference_attention(q, k, v, positions, window, sinks)
    # The sinks matter: a sizable share of the rows goes to them.
    assert np.abs(want - reference_attention(q, k, v, positions, window)).max() > 0.1
    got = _attend(path, q, k, v, start, window, sinks, traced=traced)
    assert got.dtype == np.float32
    assert_close(got, want, np.float32, err_msg=f"{path}: {_case_id(case)}")
    if path == "cudnn" and jax.default_backend() == "cpu":
        # The path as given: cuDNN's parts raise on the CPU, and the call falls back to XLA.
        got = _attend(path, q, k, v, start, window, sinks, traced=traced, resolve=False)
        assert_close(got, want, np.float32, err_msg=f"cudnn as given: {_case_id(case)}")


@pytest.mark.parametrize("case", [
    pytest.param(case, id=_case_id(case),
                 marks=() if case in FAST_FLOAT64 else (pytest.mark.slow,)) for case in CASES])
def test_float64_paths_with_sinks(case):
    # float64 "auto" is "einsum"; a later chunk's split and blocked parts keep float64 too, so
    # the merge with the sink is checked at float64's tolerance.
    t, start, window, traced = case
    later = traced or start > 0
    with jax.enable_x64(True):
        q, k, v, positions = _inputs(np.float64, start, t)
        sinks = _sinks()
        want = reference_attention(q, k, v, positions, window, sinks)
        for path in ("auto", "split", "blocked") if later else ("auto",):
            got = _attend(path, q, k, v, start, window, sinks, traced=traced)
            assert got.dtype == np.float64
            assert_close(got, want, np.float64, err_msg=f"{path}: {_case_id(case)}")


@pytest.mark.parametrize("start, window", [(50, None), (100, 7), (100, 40), (3, 40)])
def test_blocked_with_sinks_over_several_blocks(start, window):
    # Blocks of 16 over 128 keys: the online softmax starts at the sink and runs over several
    # blocks (with a window, blocks before it skipped, NaN there harmless).
    q, k, v, positions = _inputs(np.float32, start, 30)
    sinks = _sinks()
    want = reference_attention(q, k, v, positions, window, sinks)
    if window is not None and start - window + 1 >= 16:
        k[:16], v[:16] = np.nan, np.nan  # a block wholly before every query's window
    f = jax.jit(A.blocked_attention, static_argnums=(4, 5))
    assert_close(f(q, k, v, positions, 16, window, jnp.asarray(sinks)), want, np.float32)


@pytest.mark.parametrize("path", ["split", "blocked", "xla"])
def test_sinks_at_minus_infinity_are_no_sinks(path):
    # A sink of -inf takes nothing: the same function as no sinks.
    q, k, v, positions = _inputs(np.float32, 50, 30)
    for window in (None, 7, 45):
        got = _attend(path, q, k, v, 50, window, np.full(N, -np.inf, np.float32))
        assert_close(got, reference_attention(q, k, v, positions, window), np.float32)


def test_merge_parts_sink_is_a_part_with_no_value():
    rng = np.random.default_rng(3)
    o1, o2 = (jnp.asarray(rng.standard_normal((4, N, D)), jnp.float32) for _ in range(2))
    l1, l2 = (jnp.asarray(rng.normal(0, 3, (4, N)), jnp.float32) for _ in range(2))
    sinks = jnp.asarray(_sinks())
    # One part: its output scaled by sigmoid(lse - sink).
    got = A.merge_parts([(o1, l1)], jnp.float32, sinks)
    want = np.asarray(o1) / (1 + np.exp(np.asarray(sinks) - np.asarray(l1)))[..., None]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    # Two parts: the plain merge, scaled by sigmoid(lse_all - sink).
    plain = np.asarray(A.merge_parts([(o1, l1), (o2, l2)], jnp.float32))
    lse = np.logaddexp(np.asarray(l1), np.asarray(l2))
    want = plain / (1 + np.exp(np.asarray(sinks) - lse))[..., None]
    got = A.merge_parts([(o1, l1), (o2, l2)], jnp.float32, sinks)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_rows_that_see_nothing_stay_zero_with_sinks():
    # A part with lse -inf (and a NaN left in its output) beside the sink: output 0, finite;
    # an XLA part whose row sees no key likewise.
    o = jnp.full((3, N, D), jnp.nan, jnp.float32)
    part = A._seen_only_if(jnp.bool_(False), o, jnp.zeros((3, N), jnp.float32))
    got = np.asarray(A.merge_parts([part], jnp.float32, jnp.asarray(_sinks())))
    np.testing.assert_array_equal(got, np.zeros((3, N, D)))
    q, k, v, _ = _inputs(np.float32, 0, 3)
    mask = jnp.asarray(np.tril(np.ones((3, S), bool)) & (np.arange(3) > 0)[:, None])
    got = np.asarray(A.merge_parts([A.xla_part(q, k, v, mask)], jnp.float32,
                                   jnp.asarray(_sinks())))
    assert np.isfinite(got).all() and not got[0].any() and got[1:].any()


def test_sinks_working_memory():
    # The sink merge adds a [T, N, D] output and [T, N] statistics in float32, small against
    # any path's own; blocked starts its running max and sum at the sink: nothing more.
    c = get_preset("qwen3-30b-a3b")
    s = c.replace(attention_sinks=True)
    for path, first in (("cudnn", True), ("cudnn", False), ("split", False), ("xla", True)):
        with_sinks = attention_working_bytes(s, 4096, 32768, first=first, platform="gpu",
                                             attention=path)
        plain = attention_working_bytes(c, 4096, 32768, first=first, platform="gpu",
                                        attention=path)
        assert with_sinks - plain == c.n_heads * 4096 * (c.head_dim * 4 + 16), path
    assert (A.attention_bytes("blocked", 2, 32, 4096, 32768, 128, sinks=True)
            == A.attention_bytes("blocked", 2, 32, 4096, 32768, 128))


# ---- the layer and the model ---------------------------------------------------------------


WINDOW = 12
BOUNDS = (0, 20, 25, 60)  # a first chunk past the window, a chunk of 5 (< w - 1), then 35


def _sinks_config(**kw):
    c = get_preset("qwen3-30b-a3b").scaled(n_layers=3, n_experts=8, param_dtype="float32",
                                           max_seq_len=1024, **kw)
    return c.replace(attention_sinks=True, sliding_window=WINDOW,
                     layer_types=("sliding_attention", "full_attention", "sliding_attention"))


def test_the_layer_has_one_sink_per_query_head():
    c = _sinks_config()
    shapes = param_shapes(c)
    for i in range(c.n_layers):
        assert tuple(shapes[f"layers.{i}.attn.sinks"].shape) == (c.n_heads,)
        assert shapes[f"layers.{i}.attn.sinks"].dtype == c.dtype
    plain = param_shapes(c.replace(attention_sinks=False))
    assert set(shapes) - set(plain) == {f"layers.{i}.attn.sinks" for i in range(c.n_layers)}


@pytest.fixture(scope="module")
def sinks_model():
    c = _sinks_config()
    params = init_synthetic(c, 7)
    toks = np.random.default_rng(9).integers(0, c.vocab_size, BOUNDS[-1]).astype(np.int32)
    ref, _ = reference_forward(c, params, toks)
    plain = {n: a for n, a in params.items() if not n.endswith(".sinks")}
    without, _ = reference_forward(c.replace(attention_sinks=False), plain, toks)
    assert np.abs(without - ref).max() > 0.1  # the sinks change the logits
    return c, params, toks, ref


@pytest.mark.slow
@pytest.mark.parametrize("path", ["auto", "split", "blocked"])
def test_model_with_sinks_matches_reference(sinks_model, path):
    c, params, toks, ref = sinks_model
    model = M.build_model(c, params, kernels=Kernels(attention=path))
    assert [layer.attn.window for layer in model.layers] == [WINDOW, None, WINDOW]
    one, _, _ = M.forward(model, toks, M.init_cache(c, 128), 0)
    assert_close(one, ref, np.float32, err_msg=f"{path}: one chunk")
    for lo, hi, logits in read_in_chunks(model, toks, BOUNDS, M.init_cache(c, 128)):
        assert_close(logits, ref[lo:hi], np.float32, err_msg=f"{path}: positions {lo}..{hi - 1}")
        assert_close(logits, np.asarray(one)[lo:hi], np.float32,
                     err_msg=f"{path}: chunked against one chunk at {lo}..{hi - 1}")


# ---- cuDNN on the GPU -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [(32, 4, 128), (16, 2, 64)])
@pytest.mark.parametrize("start, window", [(0, None), (0, 64), (700, None), (0, 300),
                                           (40, 64), (700, 64), (250, 300), (1500, 300)])
def test_cudnn_with_sinks_matches_split(layout, start, window):
    # bf16, 256 queries: a first chunk (static 0; full and windowed), later chunks over a
    # traced start (full, a window shorter than the chunk, and 300: the three-part case):
    # cuDNN's parts with the sink merged against the exact XLA parts and the reference.
    n, kvh, d = layout
    dtype = ml_dtypes.bfloat16
    q, k, v, positions = _inputs(dtype, start, 256, n=n, kvh=kvh, d=d, s=2048)
    sinks = _sinks(n)
    traced = start > 0
    assert A.attention_path(q.dtype, d, n, 256, 2048, first=not traced) == "cudnn"
    got = _attend("cudnn", q, k, v, start, window, sinks, traced=traced)
    split = _attend("split", q, k, v, start, window, sinks, traced=traced)
    assert got.dtype == np.dtype(dtype)
    assert_close(got, np.asarray(split, np.float64), dtype, err_msg=f"{start} {window}")
    assert_close(got, reference_attention(q, k, v, positions, window, sinks), dtype)
