"""Sliding-window attention (a query at q sees keys q - w < k <= q) against the float64 reference.

Guards the window on every attention path: the masks of the XLA paths, the blocked path's
skipped blocks, and the parts of a later chunk over its cache ("split" here, "cudnn" on the
GPU: the chunk's own keys windowed, the w - 1 positions before it gathered in reverse into a
causal part with a padding length and a padding-only part), at windows smaller and larger than
the chunk, prefixes shorter and longer than the window, a window of 1 and one the cache cannot
exceed; then the model with windowed and full layers mixed, chunked, in a follow-up turn and
layer-major, and the config that says which layers have a window.
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
from strata_jax.engine.memory import attention_working_bytes
from strata_jax.reference import reference_attention, reference_forward
from strata_jax.synthetic import init_synthetic
from strata_jax.testing import assert_close, read_in_chunks


def _inputs(dtype, start, t, w, n=8, kvh=2, d=16, s=512):
    rng = np.random.default_rng(1000 * start + 10 * t + w)
    q = rng.standard_normal((t, n, d)).astype(dtype)
    k = rng.standard_normal((s, kvh, d)).astype(dtype)
    v = rng.standard_normal((s, kvh, d)).astype(dtype)
    k[start + t:] = 1e4  # garbage past the chunk: would dominate any softmax it entered
    v[start + t:] = -1e4
    return q, k, v, np.arange(start, start + t, dtype=np.int32)


def _attend(path, q, k, v, start, window):
    """The model's call for a chunk at `start` (static 0: a first chunk over its own keys)."""
    t = q.shape[0]
    resolved = A.attention_path(q.dtype, q.shape[2], q.shape[1], t, k.shape[0],
                                first=start == 0, impl=path)
    if start == 0:
        return jax.jit(lambda q, k, v: A.attend_first(q, k, v, resolved, window))(
            q, k[:t], v[:t])

    def f(q, k, v, start):
        kc = jax.lax.dynamic_slice_in_dim(k, start, t, 0)
        vc = jax.lax.dynamic_slice_in_dim(v, start, t, 0)
        positions = start + jnp.arange(t, dtype=jnp.int32)
        return A.attend_cached(q, kc, vc, k, v, start, positions, resolved, window)
    return jax.jit(f)(q, k, v, jnp.int32(start))


# (T, start, window): a first chunk longer than the window; T >= w - 1 over a prefix longer and
# shorter than the window (the reversed part's padding); T < w - 1 (the padding-only part) with
# no, some and all of the reversed part's keys at positions >= 0; windows of 1 and 2; a window
# past the 512-position cache (full attention); one that reaches back over most of it.
CASES = ((50, 0, 7), (50, 13, 7), (50, 3, 7), (5, 100, 20), (5, 10, 20), (5, 16, 20),
         (50, 129, 1), (50, 129, 2), (50, 300, 600), (50, 400, 420))
# The default run: each of the split parts' cases once, and one case of the mask paths (the
# blocked path's skipped blocks and float64 have their own tests); the slow run every pair.
FAST = {"split": ((50, 0, 7), (50, 3, 7), (5, 10, 20), (5, 16, 20), (50, 129, 1)),
        "xla": ((50, 13, 7),), "blocked": (), "einsum": ()}


def _path_cases():
    return [pytest.param(path, *case, marks=() if case in FAST[path] else (pytest.mark.slow,))
            for path in FAST for case in CASES]


@pytest.mark.parametrize("path, t, start, window", _path_cases())
def test_paths_match_reference(path, t, start, window):
    q, k, v, positions = _inputs(np.float32, start, t, window)
    want = reference_attention(q, k, v, positions, window)
    assert_close(_attend(path, q, k, v, start, window), want, np.float32,
                 err_msg=f"{path}: T={t} start={start} window={window}")
    if window < start + t:  # the window hides keys here: full attention must differ
        full = reference_attention(q, k, v, positions)
        assert np.abs(full - want).max() > 1e-2


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, pytest.param(np.float16,
                                                                     marks=pytest.mark.slow)])
def test_split_parts_in_half_precision(dtype):
    for t, start, window in ((50, 3, 7), (5, 16, 20)):
        q, k, v, positions = _inputs(dtype, start, t, window)
        got = _attend("split", q, k, v, start, window)
        assert got.dtype == np.dtype(dtype)
        assert_close(got, reference_attention(q, k, v, positions, window), dtype)


def test_windowed_float64_paths():
    # float64 "auto" is "einsum"; a later chunk's split and blocked paths keep float64 too (a
    # first chunk's forced ones run jax.nn.dot_product_attention, which has no float64 kernel).
    with jax.enable_x64(True):
        for start, paths in ((0, ("auto",)), (13, ("auto", "split", "blocked"))):
            q, k, v, positions = _inputs(np.float64, start, 50, 7)
            want = reference_attention(q, k, v, positions, 7)
            for path in paths:
                assert_close(_attend(path, q, k, v, start, 7), want, np.float64,
                             err_msg=f"{path} at {start}")


def test_blocked_window_skips_blocks_before_it():
    # Blocks of 16 over 512 keys; queries at 300..349 with a window of 7 see keys from 294 on.
    q, k, v, positions = _inputs(np.float32, 300, 50, 7)
    k[:288] = np.nan  # a block read before the window would poison every output
    v[:288] = np.nan
    got = jax.jit(A.blocked_attention, static_argnums=(4, 5))(q, k, v, positions, 16, 7)
    assert_close(got, reference_attention(np.nan_to_num(q), np.nan_to_num(k),
                                          np.nan_to_num(v), positions, 7), np.float32)


def test_cache_positions_before_the_window_are_never_read():
    # The split parts read only the w - 1 positions before the chunk: NaN before them is harmless.
    q, k, v, positions = _inputs(np.float32, 200, 50, 30)
    k[:171] = np.nan
    v[:171] = np.nan
    want = reference_attention(q, np.nan_to_num(k), np.nan_to_num(v), positions, 30)
    assert_close(_attend("split", q, k, v, 200, 30), want, np.float32)


def test_windows_that_hide_nothing_are_the_full_program():
    assert A.effective_window(None, 10) is None
    assert A.effective_window(10, 10) is None and A.effective_window(11, 10) is None
    assert A.effective_window(9, 10) == 9
    with pytest.raises(ValueError, match="sliding window 0 must be a positive"):
        A.effective_window(0, 10)
    with pytest.raises(ValueError, match="causal mask only"):
        q = jnp.zeros((4, 2, 8))
        A.attention_part("split", q, q, q, window=2)


def test_working_memory_counts_the_windowed_parts():
    # 8K queries over a 32K cache: split's windowed parts form [N, T, T + w] scores at most,
    # cuDNN's three parts hold one more output and the reversed copies; xla masks the whole cache.
    c = get_preset("mixtral-8x7b")
    w = c.replace(sliding_window=4096)
    def est(cfg, path):
        return attention_working_bytes(cfg, 8192, 32768, first=False, platform="gpu",
                                       attention=path)
    assert est(w, "split") < est(c, "split") / 3
    assert est(c, "cudnn") < est(w, "cudnn") < 2 * est(c, "cudnn")
    assert est(w, "xla") == est(c, "xla")
    mixed = w.replace(layer_types=("full_attention",) * 31 + ("sliding_attention",))
    assert est(mixed, "cudnn") == est(w, "cudnn") and est(mixed, "split") == est(c, "split")
    first = attention_working_bytes(w, 8192, 32768, first=True, platform="gpu",
                                    attention="cudnn")
    assert first == attention_working_bytes(c, 8192, 32768, first=True, platform="gpu",
                                            attention="cudnn")


# ---- the config: which layers have a window -----------------------------------------------------


def test_window_of_each_layer():
    c = get_preset("qwen3-30b-a3b")
    assert {c.window_of(i) for i in range(c.n_layers)} == {None}
    every = c.replace(sliding_window=4096)  # Mixtral's and Qwen3-MoE's: every layer
    assert {every.window_of(i) for i in range(c.n_layers)} == {4096}
    # Qwen2/3's layer_types: full for layers below max_window_layers, then sliding.
    types = ["full_attention"] * 28 + ["sliding_attention"] * 20
    mixed = c.replace(sliding_window=4096, layer_types=types)
    assert mixed.layer_types == tuple(types)  # stored as a tuple: the config stays hashable
    assert [mixed.window_of(i) for i in (0, 27, 28, 47)] == [None, None, 4096, 4096]
    assert c.replace(layer_types=["full_attention"] * 48).window_of(5) is None
    # scaled() keeps the window and resamples the kinds to its depth
    assert mixed.scaled(n_layers=4).layer_types == ("full_attention",) * 2 + (
        "sliding_attention",) * 2
    assert mixed.scaled().sliding_window == 4096
    with pytest.raises(ValueError, match="layer 48 outside 0..47"):
        c.window_of(48)


@pytest.mark.parametrize("changes, pattern", [
    (dict(sliding_window=0), "sliding_window must be None or a positive int, got 0"),
    (dict(sliding_window=4096.0), "positive int, got 4096.0"),
    (dict(sliding_window=True), "positive int, got True"),
    (dict(sliding_window=8, layer_types=["chunked_attention"] * 48),
     r"layer_types\[0\]='chunked_attention': only .* are implemented"),
    (dict(layer_types=["sliding_attention"] * 48), "sliding_window is None"),
    (dict(sliding_window=8, layer_types=["sliding_attention"] * 3), "3 entries for n_layers=48"),
    (dict(sliding_window=8, layer_types="sliding_attention"), "got the string"),
])
def test_windows_the_model_cannot_run_are_refused(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        get_preset("qwen3-30b-a3b").replace(**changes)


# ---- the model: windowed and full layers mixed ---------------------------------------------------


WINDOW = 24
# A first chunk longer than the window; a chunk of 5 (< w - 1: the padding-only part) over a
# prefix longer than the window; a chunk of 85 (a follow-up turn is the same call: a later chunk
# over the cache; tests/test_engine.py reads one through a session), over a 512-position cache.
BOUNDS = (0, 40, 45, 130)


@pytest.fixture(scope="module")
def windowed():
    c = get_preset("qwen3-30b-a3b").scaled(n_layers=3, n_experts=16, param_dtype="float32",
                                           max_seq_len=1024)
    c = c.replace(sliding_window=WINDOW,
                  layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    params = init_synthetic(c, 5)
    toks = np.random.default_rng(8).integers(0, c.vocab_size, BOUNDS[-1]).astype(np.int32)
    ref, _ = reference_forward(c, params, toks)
    full, _ = reference_forward(c.replace(sliding_window=None, layer_types=None), params, toks)
    assert np.abs(full[WINDOW:] - ref[WINDOW:]).max() > 1e-2  # the window changes the logits
    np.testing.assert_allclose(full[:WINDOW], ref[:WINDOW], rtol=1e-12, atol=1e-12)
    return c, params, toks, ref


# In the slow run: the engine's windowed tests (test_engine.py) read windowed layers in chunks
# in the default run.
@pytest.mark.slow
@pytest.mark.parametrize("path", ["split", "xla", "blocked"])
def test_chunked_prompt_and_follow_up_match_reference(windowed, path):
    c, params, toks, ref = windowed
    model = M.build_model(c, params, kernels=Kernels(attention=path))
    assert [layer.attn.window for layer in model.layers] == [WINDOW, None, WINDOW]
    for lo, hi, logits in read_in_chunks(model, toks, BOUNDS, M.init_cache(c, 512)):
        assert_close(logits, ref[lo:hi], np.float32, err_msg=f"{path}: positions {lo}..{hi - 1}")


@pytest.mark.slow  # layer-major's sub-chunks are later chunks: the split cases run by default
def test_layer_major_sub_chunks_match_reference(windowed):
    # Sub-chunks of 16 (shorter than the window) over 90 tokens padded to 96: each
    # attends to the sub-chunks before it through the windowed parts, the later ones to a
    # prefix longer than the window; every position's logits checked.
    c, params, toks, ref = windowed
    model = M.build_model(c, params, kernels=Kernels(attention="split"))
    padded = np.zeros(96, np.int32)
    padded[:90] = toks[:90]
    f = jax.jit(lambda t, k, n: model.layer_major(t, k, 0, None, 16, n_valid=n, expert_rows=48))
    logits, _, _ = f(jnp.asarray(padded), M.init_cache(c, 512), jnp.int32(90))
    assert_close(logits[:90], ref[:90], np.float32)


# ---- cuDNN on the GPU -----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,layout", [(ml_dtypes.bfloat16, (32, 4, 128)),
                                          (ml_dtypes.bfloat16, (16, 2, 256)),
                                          (np.float16, (16, 16, 64))])
@pytest.mark.parametrize("start, window", [(0, 64), (1, 64), (40, 64), (700, 64), (1791, 64),
                                           (100, 300), (250, 300), (1500, 300), (700, 1),
                                           (700, 4096)])
def test_cudnn_windowed_parts_match_reference(dtype, layout, start, window):
    # 256 queries: windows shorter (64) and longer (300: the padding-only part) than the chunk,
    # prefixes shorter and longer than the window, a window of 1 and one past the cache.
    n, kvh, d = layout
    q, k, v, positions = _inputs(dtype, start, 256, window, n, kvh, d, s=2048)
    assert A.attention_path(q.dtype, d, n, 256, 2048, first=start == 0) == "cudnn"
    got = _attend("cudnn", q, k, v, start, window)
    assert got.dtype == np.dtype(dtype)
    ref = reference_attention(q, k, v, positions, window)
    assert_close(got, ref, dtype, err_msg=f"start {start} window {window} layout {layout}")
    # Never worse than the exact XLA parts by more than the dtype's rounding.
    split = _attend("split", q, k, v, start, window)
    err_fused = np.abs(np.asarray(got, np.float64) - ref).max()
    err_split = np.abs(np.asarray(split, np.float64) - ref).max()
    eps = float(ml_dtypes.finfo(dtype).eps)
    assert err_fused <= 2 * err_split + 4 * eps, (err_fused, err_split)


@pytest.mark.gpu
@pytest.mark.parametrize("t, window", [(256, 64), (256, 300)])
def test_cudnn_windowed_parts_are_fused_calls(t, window):
    # The compiled program runs cuDNN's fused attention (own keys, the reversed part, and with
    # T < w - 1 the padding-only part) and no [T, S] score tensor.
    q, k, v, positions = _inputs(ml_dtypes.bfloat16, 700, t, window, 32, 4, 128, s=4096)

    def f(q, k, v, start):
        kc = jax.lax.dynamic_slice_in_dim(k, start, t, 0)
        vc = jax.lax.dynamic_slice_in_dim(v, start, t, 0)
        return A.chunk_over_cache(q, kc, vc, k, v, start, path="cudnn", window=window)
    hlo = jax.jit(f).lower(q, k, v, jnp.int32(700)).compile().as_text()
    assert hlo.count("__cudnn$fmha") >= (3 if window - 1 > t else 2), hlo[:2000]
    assert f"{t},4096]" not in hlo and f"{t},4096}}" not in hlo


@pytest.mark.gpu
def test_cudnn_windowed_model_matches_reference():
    # bf16 model with head_dim 64, every token routed to all 4 experts (no routing choice that
    # bf16 rounding could flip), windowed and full layers, chunked on the default (cuDNN) path.
    c = get_preset("qwen3-30b-a3b").scaled(n_layers=3, n_experts=4, top_k=4,
                                           param_dtype="bfloat16", hidden_size=256,
                                           max_seq_len=1024)
    c = c.replace(head_dim=64, n_heads=8, n_kv_heads=2, sliding_window=WINDOW,
                  layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    params = init_synthetic(c, 3)
    model = M.build_model(c, params)
    assert A.attention_path(c.dtype, c.head_dim, c.n_heads, 64, 512, first=False) == "cudnn"
    toks = np.random.default_rng(6).integers(0, c.vocab_size, BOUNDS[-1]).astype(np.int32)
    ref, _ = reference_forward(c, params, toks)
    for lo, hi, logits in read_in_chunks(model, toks, BOUNDS, M.init_cache(c, 512)):
        assert_close(logits, ref[lo:hi], ml_dtypes.bfloat16, err_msg=f"positions {lo}..{hi - 1}")
