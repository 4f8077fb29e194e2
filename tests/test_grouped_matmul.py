"""Grouped matmul against a float64 NumPy loop, zero-size groups included."""

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from strata_jax.kernels.grouped import (
    _mosaic_jit, grouped_matmul, is_hopper, piece_group_sizes, row_pieces, resolve_implementation
)
from strata_jax.kernels.mosaic import (
    MANY_GROUPS, MOSAIC_BF16_DEEP_TILES, MOSAIC_BF16_WIDE_TILES, MOSAIC_SMALL_TILES, MosaicTiles,
    bf16_tiles_for, mosaic_bf16_grouped_matmul
)
from strata_jax.testing import assert_close

CPU_IMPLS = ("lax", "tiled")


def grouped_matmul_reference(x, w, group_sizes):
    """NumPy float64 reference: explicit loop over groups; rows past the groups are zeros."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]), np.float64)
    start = 0
    for gi, size in enumerate(np.asarray(group_sizes)):
        size = int(size)
        if size:
            out[start:start + size] = x[start:start + size] @ w[gi]
        start += size
    return out


def _case(m, k, n, sizes, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32).astype(dtype)
    w = (rng.standard_normal((len(sizes), k, n), dtype=np.float32) / np.sqrt(k)).astype(dtype)
    return x, w, np.asarray(sizes, np.int32)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_constant_inputs(impl):
    x = np.ones((6, 4), np.float32)
    w = np.stack([np.full((4, 3), v, np.float32) for v in (1.0, 2.0, 3.0)])
    out = grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray([2, 0, 4], jnp.int32), impl=impl)
    expected = np.array([[4.0] * 3] * 2 + [[12.0] * 3] * 4)
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("sizes", [
    [5, 0, 7, 0, 0, 20],          # zero-size groups between and after
    [0, 0, 32],                   # leading empty groups
    pytest.param([1] * 9, marks=pytest.mark.slow),  # one row each
    pytest.param([0, 300, 0, 3], marks=pytest.mark.slow),  # several row tiles of the tiled path
])
def test_random_matches_reference(impl, sizes):
    x, w, g = _case(sum(sizes), 32, 24, sizes)
    out = grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), impl=impl)
    assert_close(out, grouped_matmul_reference(x, w, g), np.float32)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_zero_size_group_weights_never_reach_output(impl):
    # A streamed source may leave unrouted experts' rows as garbage: NaN must not leak.
    sizes = [4, 0, 3, 0]
    x, w, g = _case(7, 16, 8, sizes)
    poisoned = w.copy()
    poisoned[[1, 3]] = np.nan
    clean = grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), impl=impl)
    dirty = grouped_matmul(jnp.asarray(x), jnp.asarray(poisoned), jnp.asarray(g), impl=impl)
    np.testing.assert_array_equal(np.asarray(clean), np.asarray(dirty))  # exact, not a tolerance


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_rows_past_groups_are_zero(impl):
    # Padding rows (the engine's compile buckets) sort past every group: whatever they hold, even
    # NaN, the groups' rows are right and the padding rows come back as zeros.
    x, w, g = _case(10, 8, 4, [3, 2])
    x[5:] = np.nan
    out = np.asarray(grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), impl=impl))
    assert_close(out[:5], grouped_matmul_reference(x, w, g)[:5], np.float32)
    np.testing.assert_array_equal(out[5:], 0.0)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_bfloat16(impl):
    x, w, g = _case(40, 64, 32, [10, 0, 30], dtype=ml_dtypes.bfloat16)
    out = jax.jit(lambda a, b, c: grouped_matmul(a, b, c, impl=impl))(
        jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))
    assert out.dtype == jnp.bfloat16
    assert_close(out, grouped_matmul_reference(x, w, g), ml_dtypes.bfloat16)


def test_choice_is_an_argument_not_the_environment(monkeypatch):
    # The choice is static config (Kernels.grouped_matmul): the environment is not read.
    monkeypatch.setenv("STRATA_GROUPED_MATMUL", "tiled")
    assert resolve_implementation() == resolve_implementation("auto")
    assert resolve_implementation("TILED") == "tiled"
    with pytest.raises(ValueError, match="grouped matmul 'bogus': expected one of"):
        resolve_implementation("bogus")


def test_auto_picks_lax_on_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("CPU dispatch only")
    assert resolve_implementation("auto") == "lax"
    with pytest.raises(ValueError, match="Hopper"):
        resolve_implementation("mosaic")


def test_bad_shapes():
    x, w, g = _case(6, 8, 4, [3, 3])
    with pytest.raises(ValueError, match="x is"):
        grouped_matmul(jnp.asarray(x[:, :4]), jnp.asarray(w), jnp.asarray(g))
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray([6], jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [
    [128, 0, 256, 0],                     # tile-aligned
    [5, 0, 130, 61, 0, 1, 300],           # ragged, M not a multiple of 128
    [0] * 60 + [700] + [0] * 67,          # one hot expert among 128
])
def test_mosaic_matches_reference(sizes):
    if not is_hopper():
        pytest.skip("Mosaic GPU ragged_dot needs a Hopper GPU")
    x, w, g = _case(sum(sizes), 256, 384, sizes, dtype=ml_dtypes.bfloat16)
    poisoned = w.copy()
    poisoned[np.asarray(sizes) == 0] = np.nan
    f = jax.jit(lambda a, b, c: grouped_matmul(a, b, c, impl="mosaic"))
    out = f(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))
    assert_close(out, grouped_matmul_reference(x, w, g), ml_dtypes.bfloat16)
    dirty = f(jnp.asarray(x), jnp.asarray(poisoned), jnp.asarray(g))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(dirty))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["mosaic", "tiled"])
@pytest.mark.parametrize("sizes, m", [
    ([100, 0, 60], 256),      # padding rows inside the last row tile
    ([5, 0, 3], 300),         # most rows are padding, M not a multiple of 128
    ([0, 0, 0], 128),         # padding only
])
def test_gpu_rows_past_groups_are_zero(impl, sizes, m):
    # The engine pads chunks to compile buckets: padded rows sort after every group. Rows inside
    # the groups must be right and rows past them zeros (the mosaic kernel never stores them).
    if impl == "mosaic" and not is_hopper():
        pytest.skip("Mosaic GPU ragged_dot needs a Hopper GPU")
    x, w, g = _case(m, 256, 384, sizes, dtype=ml_dtypes.bfloat16)
    x[sum(sizes):] = np.nan  # whatever padding rows hold must not matter to the groups' rows
    f = jax.jit(lambda a, b, c: grouped_matmul(a, b, c, impl=impl))
    out = np.asarray(f(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)))
    n = sum(sizes)
    clean = x.copy()
    clean[n:] = 0
    assert_close(out[:n], grouped_matmul_reference(clean, w, g)[:n], ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out[n:], 0.0)


def test_bf16_kernel_choice_follows_groups_and_rows():
    # jax's kernel below MANY_GROUPS groups (Qwen3-30B-A3B's 128 keep it); from them this
    # package's: 64-row tiles where groups hold few rows, else two warpgroups on 128 rows,
    # through four stages from 256 rows a group.
    bf16 = jnp.bfloat16
    assert bf16_tiles_for(8192, 128, 2048, 768, bf16) is None
    assert bf16_tiles_for(1024 * 10, 512, 2048, 512, bf16) == MOSAIC_SMALL_TILES
    assert bf16_tiles_for(4096 * 10, 512, 512, 2048, bf16) == MOSAIC_BF16_WIDE_TILES
    assert bf16_tiles_for(256 * 512 - 1, 512, 2048, 512, bf16) == MOSAIC_BF16_WIDE_TILES
    assert bf16_tiles_for(256 * 512, 512, 2048, 512, bf16) == MOSAIC_BF16_DEEP_TILES
    assert MOSAIC_BF16_DEEP_TILES.stages == 4
    assert bf16_tiles_for(64 * MANY_GROUPS - 1, MANY_GROUPS, 256, 256, bf16) == MOSAIC_SMALL_TILES
    assert bf16_tiles_for(64 * MANY_GROUPS, MANY_GROUPS, 256, 384, bf16) == MosaicTiles(
        128, 128, 64, 4, 8, 1, 2)  # 384 columns: 128-column tiles
    assert bf16_tiles_for(99999, 512, 256, 200, bf16) is None  # columns it cannot tile
    assert bf16_tiles_for(99999, 512, 256, 256, jnp.float32) is None


@pytest.mark.parametrize("tiles", [MOSAIC_SMALL_TILES, MOSAIC_BF16_WIDE_TILES,
                                   MOSAIC_BF16_DEEP_TILES, MosaicTiles(128, 128, 64, 2, 1)])
def test_interpreted_bf16_kernel_matches_reference(tiles):
    # Pallas' Mosaic GPU interpreter: groups with no rows hold NaN, a group's rows cross row
    # tiles, rows past the groups come back as zeros.
    sizes = [50, 0, 130, 20, 0]
    m = sum(sizes) + 7
    x, w, g = _case(m, 128, 256, sizes, dtype=ml_dtypes.bfloat16)
    w[[1, 4]] = np.nan
    out = np.asarray(mosaic_bf16_grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g),
                                                tiles=tiles, interpret=True))
    assert_close(out[:200], grouped_matmul_reference(x, w, g)[:200], ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out[200:], 0.0)


def test_bf16_kernel_lowers_for_cuda():
    # Mosaic's lowering (layouts, shared memory) runs on the CPU: the tilings bf16_tiles_for
    # picks at 512 experts of width 512, gate's and down's shapes.
    sizes = jnp.full((16,), 64, jnp.int32)
    for tiles in (MOSAIC_SMALL_TILES, MOSAIC_BF16_WIDE_TILES, MOSAIC_BF16_DEEP_TILES):
        for k, n in ((2048, 512), (512, 2048)):
            f = jax.jit(lambda x, w, s, tiles=tiles: mosaic_bf16_grouped_matmul(
                x, w, s, tiles=tiles, interpret=False, num_sms=132))
            jax.export.export(f, platforms=["cuda"], disabled_checks=[
                jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu")])(
                    jnp.zeros((1024, k), jnp.bfloat16), jnp.zeros((16, k, n), jnp.bfloat16),
                    sizes).mlir_module()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [20, 150, 300])  # the SMALL, WIDE and DEEP tilings
def test_many_groups_give_jax_kernels_bits(rows):
    # From MANY_GROUPS groups grouped_matmul takes this package's bf16 kernel: the bits of
    # jax's kernel (the one fewer groups take), groups with no rows (NaN weights) unread,
    # rows past the groups zeros, and row pieces the whole's bits.
    if not is_hopper():
        pytest.skip("the Mosaic kernels need a Hopper GPU")
    e, k, n = 2 * MANY_GROUPS, 512, 256
    rng = np.random.default_rng(7)
    sizes = rng.integers(0, 2 * rows, e).astype(np.int32)
    sizes[[0, 5, e - 1]] = 0
    m = int(sizes.sum()) + 40
    x, w, g = _case(m, k, n, sizes, dtype=ml_dtypes.bfloat16)
    x[m - 40:] = np.nan
    w[sizes == 0] = np.nan
    x, w, g = jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)
    assert bf16_tiles_for(m, e, k, n, x.dtype) == (
        MOSAIC_SMALL_TILES if rows < 64 else MOSAIC_BF16_WIDE_TILES if rows < 256
        else MOSAIC_BF16_DEEP_TILES)
    got = np.asarray(jax.jit(grouped_matmul)(x, w, g))
    want = np.asarray(jax.jit(_mosaic_jit)(x, w, g))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[m - 40:], 0.0)
    for tiles in (MOSAIC_SMALL_TILES, MOSAIC_BF16_WIDE_TILES, MOSAIC_BF16_DEEP_TILES):
        other = np.asarray(mosaic_bf16_grouped_matmul(x, w, g, tiles=tiles))
        np.testing.assert_array_equal(other.view(np.uint16), want.view(np.uint16), str(tiles))
    bounds = row_pieces(m, 3)
    pieces = jax.jit(lambda a, b, c: _by_pieces(a, b, c, bounds, "mosaic"))(x, w, g)
    np.testing.assert_array_equal(np.asarray(pieces).view(np.uint16), got.view(np.uint16))


@pytest.mark.gpu
def test_tiled_on_gpu_matches_reference():
    x, w, g = _case(1000, 128, 256, [0, 400, 0, 600], dtype=ml_dtypes.bfloat16)
    out = grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), impl="tiled")
    assert_close(out, grouped_matmul_reference(x, w, g), ml_dtypes.bfloat16)


def _pieces_case(m, sizes, k=256, n=384, seed=3):
    x, w, g = _case(m, k, n, sizes, dtype=ml_dtypes.bfloat16, seed=seed)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)


def _by_pieces(x, w, g, bounds, impl):
    outs = [grouped_matmul(x[a:b], w, piece_group_sizes(g, a, b), impl=impl)
            for a, b in itertools.pairwise(bounds)]
    return jnp.concatenate(outs)


# The last MoE layer of a streamed chunk runs its expert math in row pieces (model.experts_swiglu):
# each piece's rows must come out as the same bits as the whole matmul gives them.
_PIECE_CASES = [
    ([300, 0, 41, 700, 0, 0, 183, 56], 1280, 4, "equal"),  # groups straddle every boundary
    ([300, 0, 41, 700, 0, 0, 183, 56], 1280, 4, "halving"),
    ([0] * 60 + [1024] + [0] * 67, 1024, 3, "equal"),  # one hot expert spans all pieces
    ([8] * 128, 1024, 4, "equal"),                     # many groups, boundaries on group edges
    ([0, 0, 0, 0], 512, 2, "equal"),                   # padding only
]


@pytest.mark.parametrize("impl", ["lax", pytest.param("tiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("sizes, m, pieces, shape", _PIECE_CASES)
def test_row_pieces_same_bits(impl, sizes, m, pieces, shape):
    x, w, g = _pieces_case(m, sizes)
    bounds = row_pieces(m, pieces, align=128, shape=shape)
    assert len(bounds) == pieces + 1 and bounds[0] == 0 and bounds[-1] == m
    whole = grouped_matmul(x, w, g, impl=impl)
    np.testing.assert_array_equal(np.asarray(_by_pieces(x, w, g, bounds, impl)).view(np.uint16),
                                  np.asarray(whole).view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["mosaic", "tiled"])
@pytest.mark.parametrize("sizes, m, pieces, shape", _PIECE_CASES)
def test_gpu_row_pieces_same_bits(impl, sizes, m, pieces, shape):
    if impl == "mosaic" and not is_hopper():
        pytest.skip("Mosaic GPU ragged_dot needs a Hopper GPU")
    x, w, g = _pieces_case(m, sizes)
    bounds = row_pieces(m, pieces, shape=shape)
    whole = jax.jit(lambda a, b, c: grouped_matmul(a, b, c, impl=impl))(x, w, g)
    pieces_out = jax.jit(lambda a, b, c: _by_pieces(a, b, c, bounds, impl))(x, w, g)
    np.testing.assert_array_equal(np.asarray(pieces_out).view(np.uint16),
                                  np.asarray(whole).view(np.uint16))


def _by_expert_parts(x, w, g, parts, impl):
    """The whole matmul's rows, computed part by part as a layer in parts does
    (`MoE.experts_part`): each part's groups' rows from their start, its weights alone, the
    whole layer's groups for the tiling (and "lax"'s place of the groups)."""
    m, n_groups = x.shape[0], g.shape[0]
    per = n_groups // parts
    out = jnp.zeros((m, w.shape[2]), x.dtype)
    for p in range(parts):
        lo = p * per
        begin, size = int(g[:lo].sum()), int(g[lo:lo + per].sum())
        rows = jnp.minimum(begin + jnp.arange(m), m - 1)
        y = grouped_matmul(x[rows], w[lo:lo + per], g[lo:lo + per], impl=impl,
                           tile_groups=n_groups, group_offset=lo)
        out = out.at[begin:begin + size].set(y[:size])
    return out


# A layer's experts in parts (StreamTuning.parts): 256 groups (past mosaic.MANY_GROUPS: the
# whole layer's tiling is this package's kernel, a part's own 64 would be jax's), and few.
_PART_CASES = [
    ([0] * 60 + [97, 3, 200] + [0] * 100 + [41] * 20 + [0] * 73, 4),
    ([300, 0, 41, 700, 0, 0, 183, 56], 2),
]


@pytest.mark.parametrize("sizes, parts", _PART_CASES)
def test_expert_parts_same_bits(sizes, parts):
    m = 128 * -(-sum(sizes) // 128) + 128  # and padding rows past the groups
    x, w, g = _case(m, 256, 128, sizes, dtype=ml_dtypes.bfloat16, seed=4)
    x, w, g = jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)
    whole = grouped_matmul(x, w, g, impl="lax")
    np.testing.assert_array_equal(
        np.asarray(_by_expert_parts(x, w, g, parts, "lax")).view(np.uint16),
        np.asarray(whole).view(np.uint16))
    with pytest.raises(ValueError, match="are not among 8"):
        grouped_matmul(x, w[:4], g[:4], impl="lax", tile_groups=8, group_offset=6)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["mosaic", "tiled"])
@pytest.mark.parametrize("sizes, parts", _PART_CASES)
def test_gpu_expert_parts_same_bits(impl, sizes, parts):
    if impl == "mosaic" and not is_hopper():
        pytest.skip("Mosaic GPU ragged_dot needs a Hopper GPU")
    m = 128 * -(-sum(sizes) // 128) + 128
    x, w, g = _case(m, 256, 128, sizes, dtype=ml_dtypes.bfloat16, seed=4)
    x, w, g = jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)
    whole = jax.jit(lambda a, b, c: grouped_matmul(a, b, c, impl=impl))(x, w, g)
    np.testing.assert_array_equal(
        np.asarray(_by_expert_parts(x, w, g, parts, impl)).view(np.uint16),
        np.asarray(whole).view(np.uint16))


def test_row_pieces_bounds():
    assert row_pieces(1024, 4) == (0, 256, 512, 768, 1024)
    assert row_pieces(1000, 4) == (0, 256, 512, 768, 1000)
    assert row_pieces(300, 4) == (0, 75, 150, 225, 300)   # too few rows for aligned pieces
    assert row_pieces(64, 4, align=8) == (0, 16, 32, 48, 64)
    assert row_pieces(3, 4) == (0, 1, 2, 3)
    assert row_pieces(0, 3) == (0, 0)
    assert row_pieces(1000, 1) == (0, 1000)
    with pytest.raises(ValueError, match="pieces"):
        row_pieces(100, 0)
    # halving: 1/2, 1/4, 1/8, 1/8 of the rows, on 128-row tiles where there are 8 of them
    assert row_pieces(65536, 4, shape="halving") == (0, 32768, 49152, 57344, 65536)
    assert row_pieces(1024, 4, shape="halving") == (0, 512, 768, 896, 1024)
    assert row_pieces(1000, 4, shape="halving") == (0, 500, 750, 875, 1000)  # < 8 tiles
    assert row_pieces(1024, 2, shape="halving") == row_pieces(1024, 2) == (0, 512, 1024)
    assert row_pieces(4, 4, shape="halving") == (0, 2, 3, 4)  # no empty piece
    with pytest.raises(ValueError, match="shape='even'"):
        row_pieces(100, 2, shape="even")
    g = jnp.asarray([3, 0, 5, 2], jnp.int32)
    np.testing.assert_array_equal(np.asarray(piece_group_sizes(g, 2, 8)), [1, 0, 5, 0])
    np.testing.assert_array_equal(np.asarray(piece_group_sizes(g, 8, 12)), [0, 0, 0, 2])
