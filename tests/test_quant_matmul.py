"""How a grouped matmul reads quantized planes (`strata_jax.kernels.quantized`): the path each
choice takes on each device, the visits a ragged kernel walks, dequantize-then-matmul's bits and
values against the float64 reference, zero-points and act-order. The Mosaic GPU kernels
themselves have tests/test_quant_mosaic.py; the helpers here (`_matrix`, `_x`,
`quantized_reference`) serve both."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.formats import ExpertFormat, QuantizedMatrix
from strata_jax.kernels import Kernels
from strata_jax.kernels.common import group_metadata
from strata_jax.kernels.grouped import grouped_matmul
from strata_jax.kernels.mosaic import MOSAIC_TILES, mosaic_supports
from strata_jax.kernels.mosaic_int4 import MOSAIC_INT4_TILES, mosaic_int4_supports
from strata_jax.kernels.quantized import in_stored_order, resolve_format, resolve_quantized
from strata_jax.reference import dequantized64
from strata_jax.testing import assert_close
from test_grouped_matmul import grouped_matmul_reference

SIZES = [50, 0, 130, 20, 0]  # an empty expert between two, one at the end
HOPPER = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200",
                               compute_capability="9.0")
OTHER_GPU = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB",
                                  compute_capability="8.0")


def _matrix(kind, e=5, k=256, n=128, block=128, seed=0, nan_experts=()):
    rng = np.random.default_rng(seed)
    fmt = ExpertFormat.make(kind, k, n, jnp.bfloat16, block=block)
    w = rng.standard_normal((e, k, n)).astype(np.float32) * 0.05
    planes = fmt.quantize_matrix_np("gate", w)
    q, s = planes["gate"], planes["gate_scale"].copy()
    for i in nan_experts:  # garbage in an unrouted expert's planes must not reach any row
        s[i] = np.nan
    return QuantizedMatrix(jnp.asarray(q), jnp.asarray(s), kind, block, (k, n),
                           np.dtype(jnp.bfloat16))


def _zero_matrix(e=5, k=256, n=128, block=128, seed=0, nan_experts=()):
    """An int4 matrix with a zero-point plane (asymmetric GPTQ's layout)."""
    rng = np.random.default_rng(seed)
    fmt = ExpertFormat.make("int4", k, n, jnp.bfloat16, block=block, zero_points=True)
    w = rng.standard_normal((e, k, n)).astype(np.float32) * 0.05 + 0.02
    p = fmt.quantize_matrix_np("gate", w)
    s = p["gate_scale"].copy()
    for i in nan_experts:  # garbage in an unrouted expert's planes must not reach any row
        s[i] = np.nan
    return QuantizedMatrix(jnp.asarray(p["gate"]), jnp.asarray(s), "int4", block,
                           (k, n), np.dtype(jnp.bfloat16), jnp.asarray(p["gate_zero"]))


def _x(m, k, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), jnp.bfloat16)


def quantized_reference(x, w: QuantizedMatrix, group_sizes) -> np.ndarray:
    """NumPy float64: x times each group's matrix dequantized in float64 from its planes by the
    reference's published formulas (rows past the groups zero)."""
    deq = dequantized64(w.kind, w.block, w.shape, w.q, w.scale, w.zero, w.perm)
    return grouped_matmul_reference(np.asarray(x, np.float64), deq, group_sizes)


def _tile_visits(sizes, bm: int) -> int:
    """The visits of fixed row tiles: each tile a group's rows touch."""
    ends = np.cumsum(sizes)
    starts = ends - sizes
    return int(sum((e - 1) // bm - s // bm + 1 for s, e in zip(starts, ends) if e > s))


def test_visits_cover_every_row_of_every_group_once():
    # Each row of each group is stored by one visit, inside the visit's window of bm rows,
    # which starts on a multiple of 8 rows within the padded rows; a group takes
    # ceil((r + start % 8) / bm) visits, never more than the fixed row tiles its rows touch.
    rng = np.random.default_rng(0)
    cases = [([50, 0, 130, 20, 0], 64), ([0, 0, 0], 16), ([7], 16), ([64, 64, 1, 0, 63], 64),
             ([3, 200, 5], 32), ([300, 3, 77, 0, 129], 128), ([125] * 9, 64)]
    cases += [(list(rng.integers(0, 300, 40) * (rng.random(40) < 0.8)), 128) for _ in range(3)]
    fn = jax.jit(group_metadata, static_argnums=(1, 2))
    for sizes, bm in cases:
        m = sum(sizes) + 9  # rows past the groups
        meta = np.asarray(fn(jnp.asarray(sizes, jnp.int32), m, bm))
        assert meta.shape == (4, -(-(m + 7 * (len(sizes) + 1)) // bm) + len(sizes))
        # group len(sizes): the rows past the groups (visits that store zeros)
        owner, visits = np.full(m, -1), np.zeros(len(sizes) + 1, int)
        for g, row0, lo, hi in meta.T:
            if hi > lo:
                assert row0 % 8 == 0 and row0 <= lo < hi <= row0 + bm <= -(-m // bm) * bm
                assert (g == len(sizes) or sizes[g] > 0) and (owner[lo:hi] == -1).all()
                owner[lo:hi] = g
                visits[g] += 1
        want = np.concatenate([np.full(s, g) for g, s in enumerate(sizes)]
                              + [np.full(9, len(sizes))])
        np.testing.assert_array_equal(owner, want, err_msg=f"{sizes} {bm}")
        sizes = np.asarray(sizes + [9])
        starts = np.cumsum(sizes) - sizes
        np.testing.assert_array_equal(visits, -(-(sizes + starts % 8) // bm) * (sizes > 0))
        assert visits[:-1].sum() <= _tile_visits(sizes[:-1], bm)
    # 512 experts of 20 rows at 64-row tiles: one visit each, where fixed tiles take 1.25;
    # every row in a group: no visit of zeros
    sizes = np.full(512, 20)
    assert (np.asarray(fn(jnp.asarray(sizes, jnp.int32), 10240, 64))[3] > 0).sum() == 512
    assert _tile_visits(sizes, 64) == 640


def test_the_path_each_choice_takes():
    # auto and fused: the Mosaic kernel on Hopper where it reads the matrix, else dequantize
    # first (the CPU, another GPU, int4 in groups of 64); dequantize always dequantizes.
    w8, w4, w64 = _matrix("fp8"), _matrix("int4"), _matrix("int4", block=64)
    for impl in (None, "auto", "fused"):
        assert resolve_quantized(impl, w8, HOPPER) == "mosaic"
        assert resolve_quantized(impl, w4, HOPPER) == "mosaic"
        assert resolve_quantized(impl, w64, HOPPER) == "dequantize"
        for w in (w8, w4):
            assert resolve_quantized(impl, w, OTHER_GPU) == "dequantize"
            if jax.devices()[0].platform == "cpu":
                assert resolve_quantized(impl, w) == "dequantize"
    for w in (w8, w4):
        assert resolve_quantized("dequantize", w, HOPPER) == "dequantize"
    # A matrix the kernel cannot tile (N not a multiple of its column tile) is dequantized.
    odd = dataclasses.replace(w8, shape=(256, 120))
    assert not mosaic_supports(odd, MOSAIC_TILES)
    assert resolve_quantized("fused", odd, HOPPER) == "dequantize"
    with pytest.raises(ValueError, match="quantized matmul 'triton'.*auto\\|fused\\|dequantize"):
        resolve_quantized("triton", w8)
    with pytest.raises(ValueError, match="Kernels\\(quantized_matmul='x'\\)"):
        Kernels(quantized_matmul="x")
    # A format's matrices: mosaic where the kernel reads them all, None for plain planes.
    fmt = ExpertFormat.make("fp8", 256, 128, jnp.bfloat16, block=128)
    assert resolve_format("fused", fmt, HOPPER) == "mosaic"
    assert resolve_format("fused", fmt, OTHER_GPU) == "dequantize"
    # An int4 plane in GPTQ's int32 words (not the format's group halves) is refused by name.
    words = dataclasses.replace(w4, q=jnp.zeros((5, 32, 128), jnp.int32))
    with pytest.raises(ValueError, match="int4 plane int32 .*gptq_halves_np"):
        words.dequantize()


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_grouped_matmul_reads_a_quantized_matrix_either_way(kind):
    # Off Hopper every choice dequantizes first: the bits of the dequantized matrix through
    # the plain grouped matmul, within bf16 rounding of the float64 reference; an unrouted
    # expert's NaN scales reach no row, and rows past the groups are zeros.
    w = _matrix(kind, nan_experts=(1, 4))
    x = _x(sum(SIZES) + 7, 256)
    sizes = jnp.asarray(SIZES, jnp.int32)
    deq = np.asarray(grouped_matmul(x, w.dequantize(), sizes))
    want = quantized_reference(x, w, SIZES)
    for impl in ("dequantize", None, "fused"):
        if resolve_quantized(impl, w) != "dequantize":
            continue  # Hopper: tests/test_quant_mosaic.py checks the kernel's bits
        got = np.asarray(grouped_matmul(x, w, sizes, quantized=impl))
        np.testing.assert_array_equal(got, deq, err_msg=str(impl))
        assert_close(got[:200].astype(np.float64), want[:200], jnp.bfloat16)
        assert (got[200:] == 0).all()


def test_zero_points_take_the_mosaic_kernel_only_when_asked_for():
    # An int4 matrix with zero-points: on Hopper the Mosaic kernel reads it when asked for
    # (fused; auto dequantizes it first, the faster there), and grouped_matmul's rows equal
    # the float64 reference of (q - z) * scale.
    wz, w4 = _zero_matrix(), _matrix("int4")
    zeros = np.asarray(wz.zero)
    assert zeros.shape == (5, 2, 128) and len(np.unique(zeros)) > 1 and (zeros != 8).any()
    for w in (w4, wz):
        assert resolve_quantized("fused", w, HOPPER) == "mosaic"
        assert resolve_quantized("dequantize", w, HOPPER) == "dequantize"
    assert resolve_quantized(None, w4, HOPPER) == "mosaic"
    assert resolve_quantized(None, wz, HOPPER) == "dequantize"
    fmt = ExpertFormat.make("int4", 256, 128, jnp.bfloat16, block=128, zero_points=True)
    assert resolve_format(None, fmt, HOPPER) == "dequantize"
    assert resolve_format("fused", fmt, HOPPER) == "mosaic"
    assert mosaic_int4_supports(wz, MOSAIC_INT4_TILES)
    # the same planes read as symmetric would be another matrix: the zero plane is used
    _dequantized_rows_are_the_reference(wz, zero=None)


def _dequantized_rows_are_the_reference(w, **without):
    """grouped_matmul's rows of `w` (dequantized first off Hopper) are the float64
    reference's, the rows past the groups zero; and `w` with its `without` fields replaced
    dequantizes to another matrix (those planes are read)."""
    sizes = jnp.asarray([40, 0, 17, 3, 0], jnp.int32)
    x = _x(64, w.shape[0])
    got = np.asarray(grouped_matmul(x, w, sizes)).astype(np.float64)
    want = quantized_reference(x, w, np.asarray(sizes))
    assert np.isfinite(got).all()
    assert_close(got[:60], want[:60], jnp.bfloat16)
    assert (got[60:] == 0).all()
    other = dataclasses.replace(w, **without)
    assert not np.array_equal(np.asarray(other.dequantize()), np.asarray(w.dequantize()))


@pytest.mark.parametrize("zero_points", [False, True])
def test_act_order_matrices_are_read_in_stored_order(zero_points):
    # An int4 matrix with act-order (GPTQ desc_act) holds its rows in group order and a row
    # permutation: grouped_matmul reorders each row's inputs by its expert's permutation and
    # reads the stored rows as a plain int4 matrix, so the kernel reads it as it reads int4
    # (zero-points as zero-points are); every path's rows are the float64 reference's of the
    # matrix in input order, (q - z) * scale put back at perm's rows.
    from strata_jax.kernels.mosaic import MosaicTiles
    from strata_jax.kernels.mosaic_int4 import mosaic_int4_grouped_matmul

    e, k, n = 5, 256, 128
    fmt = ExpertFormat.make("int4", k, n, jnp.bfloat16, block=128, zero_points=zero_points,
                            act_order=True)
    w = np.random.default_rng(0).standard_normal((e, k, n)).astype(np.float32) * 0.05 + 0.02
    p = {name: jnp.asarray(v) for name, v in fmt.quantize_matrix_np("gate", w).items()}
    wa = fmt.matrix(p, "gate")
    perm = np.asarray(wa.perm)
    assert perm.shape == (e, k) and (perm != np.arange(k)).mean() > 0.3
    auto = "dequantize" if zero_points else "mosaic"
    assert resolve_quantized(None, wa, HOPPER) == resolve_format(None, fmt, HOPPER) == auto
    assert resolve_quantized("fused", wa, HOPPER) == "mosaic"
    assert resolve_quantized(None, wa, OTHER_GPU) == "dequantize"
    assert not mosaic_int4_supports(wa, MOSAIC_INT4_TILES)
    assert mosaic_int4_supports(wa.stored(), MOSAIC_INT4_TILES)
    # the stored rows read in input order would be another matrix: the permutation is used
    _dequantized_rows_are_the_reference(wa, perm=None)
    # the kernel on the reordered inputs (interpreted): the same rows of the reference
    sizes = jnp.asarray([40, 0, 17, 3, 0], jnp.int32)
    x = _x(64, k)
    want = quantized_reference(x, wa, np.asarray(sizes))[:60]
    xs, stored = in_stored_order(x, wa, sizes)
    assert stored.perm is None and stored.q is wa.q
    again = in_stored_order(x, stored, sizes)  # a matrix without perm: as given
    assert again[0] is x and again[1] is stored
    np.testing.assert_array_equal(np.asarray(xs)[:40], np.asarray(x)[:40][:, perm[0]])
    np.testing.assert_array_equal(np.asarray(xs)[40:57], np.asarray(x)[40:57][:, perm[2]])
    # from the tokens (the model's form): row j is token rows[j], in the same gather
    tokens = _x(23, k)
    rows = jnp.asarray(np.random.default_rng(1).integers(0, 23, 64), jnp.int32)
    from_tokens, stored2 = in_stored_order(tokens, wa, sizes, rows)
    np.testing.assert_array_equal(np.asarray(from_tokens),
                                  np.asarray(in_stored_order(tokens[rows], wa, sizes)[0]))
    assert stored2.perm is None and stored2.q is wa.q
    np.testing.assert_array_equal(np.asarray(in_stored_order(tokens, stored, sizes, rows)[0]),
                                  np.asarray(tokens)[np.asarray(rows)])
    out = mosaic_int4_grouped_matmul(xs, stored, sizes, interpret=True,
                                     tiles=MosaicTiles(64, 128, 64, 2, 1))
    out = np.asarray(out).astype(np.float64)
    assert_close(out[:60], want, jnp.bfloat16)
    assert (out[60:] == 0).all()
