"""The Mosaic GPU grouped matmuls over fp8 and int4 planes (`strata_jax.kernels.mosaic`): their
numerics against the float64 reference (Pallas' Mosaic GPU interpret mode on the CPU), what
they refuse, their lowering for CUDA, and on a Hopper GPU the bits of dequantize-then-matmul,
from the kernels and from the model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.kernels.grouped import grouped_matmul, is_hopper, piece_group_sizes, row_pieces
from strata_jax.kernels.mosaic import (
    FP8_MANY_WIDE_FROM_ROWS_PER_GROUP, MANY_GROUPS, MOSAIC_FP8_MANY_TILES, MOSAIC_SMALL_TILES,
    MOSAIC_TILES, MOSAIC_WIDE_TILES, WIDE_FROM_ROWS_PER_GROUP, MosaicTiles, fp8_tiles_for,
    mosaic_grouped_matmul, mosaic_supports
)
from strata_jax.kernels.mosaic_int4 import (
    MOSAIC_INT4_TILES, int4_conversion, int4_tiles_for, int4_values_f32,
    mosaic_int4_grouped_matmul, mosaic_int4_supports, split_scale_bf16
)
from strata_jax.kernels.quantized import resolve_quantized
from strata_jax.testing import assert_close
from test_quant_matmul import _matrix, _x, _zero_matrix, quantized_reference

# An empty expert between two, one expert's rows crossing a 64-row tile, an empty one last;
# expert 1's and 4's scales are NaN: an expert with no rows must not reach any output.
SIZES = [50, 0, 130, 20, 0]


def _f32_scales(w):
    """`w` with its float16 scales as float32 (the same values): the int4 kernel reads them by
    "bits", where the format's float16 ones with bf16 inputs take "bf16x2"."""
    return dataclasses.replace(w, scale=w.scale.astype(jnp.float32))


def _fp16(w):
    """`w` read as float16 (the int4 kernel's "bits")."""
    return dataclasses.replace(w, dtype=np.dtype(np.float16))


def test_interpreted_kernel_matches_the_float64_reference():
    w = _matrix("fp8", nan_experts=(1, 4))
    m = sum(SIZES) + 7  # rows past the groups come back as zeros
    x = _x(m, 256)
    got = np.asarray(mosaic_grouped_matmul(x, w, jnp.asarray(SIZES, jnp.int32),
                                           tiles=MosaicTiles(64, 128, 64, 2, 1),
                                           interpret=True), np.float64)
    want = quantized_reference(x, w, SIZES)
    assert_close(got[:200], want[:200], jnp.bfloat16)
    assert (got[200:] == 0).all()


@pytest.mark.slow  # uneven bands; the GPU tests read the model's own bands
def test_column_bands_that_do_not_divide_the_columns_give_the_same_bits():
    # Three column tiles swept in bands of two (the last band one tile): every (visit, column
    # tile) pair once, the bits of a one-tile band (the order of the work, not of the sums).
    w = _matrix("fp8", k=128, n=384, nan_experts=(1, 4))
    x = _x(sum(SIZES) + 7, 128)
    sizes = jnp.asarray(SIZES, jnp.int32)
    got = [np.asarray(mosaic_grouped_matmul(x, w, sizes, tiles=MosaicTiles(64, 128, 64, 2, g),
                                            interpret=True)) for g in (2, 1, 8)]
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[2], got[1])
    assert_close(got[0][:200].astype(np.float64), quantized_reference(x, w, SIZES)[:200],
                 jnp.bfloat16)


def test_interpreted_int4_kernel_matches_the_float64_reference():
    # As the fp8 kernel's: experts 1 and 4 have NaN scales and no rows, rows past the groups
    # are zeros; the nibble halves times each column's group scale, half a group a step.
    w = _matrix("int4", nan_experts=(1, 4))
    m = sum(SIZES) + 7
    x = _x(m, 256)
    sizes = jnp.asarray(SIZES, jnp.int32)
    tiles = MosaicTiles(64, 128, 64, 2, 1)
    got = np.asarray(mosaic_int4_grouped_matmul(x, w, sizes, tiles=tiles, interpret=True),
                     np.float64)
    assert np.isfinite(got).all()
    assert_close(got[:200], quantized_reference(x, w, SIZES)[:200], jnp.bfloat16)
    assert (got[200:] == 0).all()
    # The conversion: bf16x2 for bf16 inputs over the format's float16 scales, else bits
    # (float16 inputs; scales of another dtype, whose bf16 split is not exact).
    assert int4_conversion(jnp.bfloat16) == int4_conversion(jnp.bfloat16, jnp.float16) == "bf16x2"
    assert int4_conversion(jnp.float16) == "bits"
    assert int4_conversion(jnp.bfloat16, jnp.float32) == "bits"
    # float32 scales of the same values ("bits"): the same bits
    np.testing.assert_array_equal(
        np.asarray(mosaic_int4_grouped_matmul(x, _f32_scales(w), sizes, tiles=tiles,
                                              interpret=True), np.float64), got)


def test_bf16x2_steps_round_each_product_once():
    # "bf16x2": (nibble - z) * scale as fma(v, hi, v * lo) in bf16 over the scale split by
    # split_scale_bf16. For every finite float16 scale of either sign, every nibble and every
    # zero-point: hi + lo is the scale, v * lo is exact in bf16, and the one rounding gives
    # the float32 product's cast, bit for bit (zeros' signs included).
    import ml_dtypes
    s16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    s16 = s16[np.isfinite(s16)]
    hi, lo = (np.asarray(a, np.float64) for a in
              split_scale_bf16(jnp.asarray(s16.astype(np.float32))))
    np.testing.assert_array_equal(hi + lo, s16.astype(np.float64))
    bf16 = ml_dtypes.bfloat16
    for z in range(16):
        for n in range(16):
            t = (n - z) * lo  # exact in bf16
            np.testing.assert_array_equal(t.astype(np.float32).astype(bf16).astype(np.float64), t)
            # the FMA: the exact (n - z) * hi + t (exact in float64 and float32), rounded once
            got = ((n - z) * hi + t).astype(np.float32).astype(bf16)
            want = (np.float32(n - z) * s16.astype(np.float32)).astype(bf16)
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16),
                                          err_msg=f"n={n} z={z}")


def test_int4_nibbles_by_their_bits_are_exactly_the_converted_values():
    # The int4 kernel's (nibble - 8) from 2^23 + nibble's bit pattern ("bits"), over every
    # byte, is (nibble - 8) exactly; times float16 scales from subnormal to the largest, NaN
    # and inf, cast to bf16 and fp16, the bits of the converted value's product.
    q = jnp.arange(256, dtype=jnp.int32)[:, None]
    rng = np.random.default_rng(0)
    s = np.concatenate([rng.standard_normal(500), [6e-8, -6e-8, 65504, -65504, 0.0, -0.0,
                                                   np.nan, np.inf, -np.inf]])
    s = jnp.asarray(s.astype(np.float16)).astype(jnp.float32)[None]
    for n in (q & 15, q >> 4):
        by_bits = int4_values_f32(n)
        converted = (n - 8).astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(by_bits), np.asarray(n - 8, np.float32))
        for dtype in (jnp.bfloat16, jnp.float16):
            a = (converted * s).astype(dtype)
            b = (by_bits * s).astype(dtype)
            np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                          np.asarray(b).view(np.uint16))


# The zero-point kernel is what quantized_matmul="fused" reads int4-zp with ("auto"
# dequantizes it first).
@pytest.mark.slow
def test_interpreted_int4_kernel_reads_zero_points():
    # Zero-points (a uint8 row a group, pipelined as the scale row): (nibble - z) * scale, the
    # float64 reference's values, the same bits with two programs an SM and over float32
    # scales ("bits"); zero-points all 8 give the symmetric kernel's bits (the same
    # arithmetic, so the dequantize path's on a GPU).
    w = _zero_matrix(seed=3, nan_experts=(1, 4))
    m = sum(SIZES) + 7
    x = _x(m, 256)
    sizes = jnp.asarray(SIZES, jnp.int32)
    one = MosaicTiles(64, 128, 64, 2, 1)
    got = {}
    for name, wi, tiles in (("one", w, one), ("two an SM", w, MosaicTiles(64, 128, 64, 3, 2, 2)),
                            ("float32 scales", _f32_scales(w), one)):
        got[name] = out = np.asarray(mosaic_int4_grouped_matmul(x, wi, sizes, tiles=tiles,
                                                                interpret=True))
        assert np.isfinite(out).all()
        assert (out[200:] == 0).all()
    ref = quantized_reference(x, w, SIZES)[:200]
    assert_close(got["one"][:200].astype(np.float64), ref, jnp.bfloat16)
    for key, out in got.items():
        np.testing.assert_array_equal(out, got["one"], err_msg=key)
    eight = dataclasses.replace(w, zero=jnp.full_like(w.zero, 8))
    sym = dataclasses.replace(w, zero=None)
    np.testing.assert_array_equal(
        np.asarray(mosaic_int4_grouped_matmul(x, eight, sizes, tiles=one, interpret=True)),
        np.asarray(mosaic_int4_grouped_matmul(x, sym, sizes, tiles=one, interpret=True)))


def test_two_compute_warpgroups_match_the_float64_reference():
    # fp8's two-warpgroup kernel (MOSAIC_WIDE_TILES' k step of 64): a 128-row tile split
    # between two compute warpgroups that share each converted weight tile, each converting
    # half its columns: the reference's values, zeros past the groups, NaN-scaled unrouted
    # experts reaching no row; each warpgroup's rows are the 64-row one-warpgroup kernel's.
    w = _matrix("fp8", nan_experts=(1, 4))
    m = sum(SIZES) + 7
    x = _x(m, 256)
    sizes = jnp.asarray(SIZES, jnp.int32)
    one = np.asarray(mosaic_grouped_matmul(x, w, sizes, tiles=MosaicTiles(64, 128, 64, 2, 1),
                                           interpret=True))
    got = np.asarray(mosaic_grouped_matmul(x, w, sizes, tiles=MosaicTiles(128, 128, 64, 2, 1, 1, 2),
                                           interpret=True))
    assert np.isfinite(got).all()
    assert_close(got[:200].astype(np.float64), quantized_reference(x, w, SIZES)[:200],
                 jnp.bfloat16)
    assert (got[200:] == 0).all()
    np.testing.assert_array_equal(got, one)


_LOWERED = {  # kernel, matrix, tiling
    # what the model reads fp8 and int4 with (fp8_tiles_for, MOSAIC_INT4_TILES; bf16x2)
    "model": (("fp8", mosaic_grouped_matmul, MOSAIC_TILES),
              ("fp8", mosaic_grouped_matmul, MOSAIC_WIDE_TILES),
              ("fp8", mosaic_grouped_matmul, MOSAIC_SMALL_TILES),
              ("fp8", mosaic_grouped_matmul, MOSAIC_FP8_MANY_TILES),
              ("int4", mosaic_int4_grouped_matmul, MOSAIC_INT4_TILES),
              ("int4", mosaic_int4_grouped_matmul, MOSAIC_SMALL_TILES)),
    # the kernel with zero-points ("fused"), and int4's "bits" (fp16 inputs, float32 scales)
    "others": (("int4-zp", mosaic_int4_grouped_matmul, MOSAIC_INT4_TILES),
               ("int4-fp16", mosaic_int4_grouped_matmul, MOSAIC_INT4_TILES),
               ("int4-f32-scales", mosaic_int4_grouped_matmul, MOSAIC_INT4_TILES)),
}


def _lowering_case(kind, k, n):
    w = {"int4-zp": lambda: _zero_matrix(e=8, k=k, n=n),
         "int4-fp16": lambda: _fp16(_matrix("int4", e=8, k=k, n=n)),
         "int4-f32-scales": lambda: _f32_scales(_matrix("int4", e=8, k=k, n=n))}.get(
             kind, lambda: _matrix(kind, e=8, k=k, n=n))()
    return _x(1024, k).astype(w.dtype), w


@pytest.mark.slow
@pytest.mark.parametrize("which", ["model", "others"])
def test_kernels_lower_for_cuda(which):
    # Mosaic's lowering for a GPU (layout inference included) runs on the CPU: the kernels at
    # their tilings and Qwen3-30B-A3B's expert shapes. The int4 kernel's nibbles reach its
    # dtype by bits and bf16 steps: no int-to-float op in its module (the kernel's own module,
    # embedded in the program).
    sizes = jnp.full((8,), 128, jnp.int32)
    for kind, fn, tiles in _LOWERED[which]:
        for k, n in ((2048, 768), (768, 2048))[:1 if which == "others" else 2]:
            x, w = _lowering_case(kind, k, n)
            f = jax.jit(lambda x, w, s, fn=fn, tiles=tiles: fn(x, w, s, tiles=tiles,
                                                              interpret=False, num_sms=132))
            text = jax.export.export(f, platforms=["cuda"], disabled_checks=[
                jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu")])(
                    x, w, sizes).mlir_module()
            if kind.startswith("int4"):
                assert "sitofp" not in text, kind


def test_what_the_kernel_reads_and_refuses():
    w8, w4 = _matrix("fp8"), _matrix("int4")
    assert mosaic_supports(w8, MOSAIC_TILES)
    assert not mosaic_supports(w4, MOSAIC_TILES)  # int4 has its own kernel
    assert mosaic_int4_supports(w4, MOSAIC_INT4_TILES)
    # int4: half a group a step, one compute warpgroup
    for tiles in (MosaicTiles(block_k=128), MosaicTiles(block_k=32),
                  MosaicTiles(128, 128, 64, 2, 1, 1, 2)):
        assert not mosaic_int4_supports(w4, tiles), tiles
    assert not mosaic_int4_supports(w8, MOSAIC_INT4_TILES)
    assert not mosaic_int4_supports(_matrix("int4", block=64), MOSAIC_INT4_TILES)
    with pytest.raises(ValueError, match="int4 in groups of 128, block_k 64"):
        mosaic_int4_grouped_matmul(_x(8, 256), w8, jnp.asarray([8, 0, 0, 0, 0], jnp.int32))
    assert not mosaic_supports(dataclasses.replace(w8, shape=(256, 120)), MOSAIC_TILES)
    assert not mosaic_supports(_matrix("fp8", block=32), MOSAIC_TILES)  # k step > scale block
    assert not mosaic_supports(dataclasses.replace(w8, dtype=np.dtype(np.float32)),
                               MOSAIC_TILES)
    with pytest.raises(ValueError, match="cannot be read by"):
        mosaic_grouped_matmul(_x(8, 256), w4, jnp.asarray([8, 0, 0, 0, 0], jnp.int32))
    with pytest.raises(ValueError, match="group_sizes has shape"):
        mosaic_grouped_matmul(_x(8, 256), w8, jnp.asarray([8], jnp.int32))
    for bad in (dict(block_m=96), dict(block_k=48), dict(stages=0), dict(per_sm=0),
                dict(compute_wgs=3), dict(block_m=64, compute_wgs=2),
                dict(stages=1, compute_wgs=2), dict(per_sm=2, compute_wgs=2),
                dict(block_k=128, compute_wgs=2)):
        with pytest.raises(ValueError, match="MosaicTiles"):
            MosaicTiles(**bad)
    # fp8's tiling follows the rows an expert: two warpgroups on 256-row tiles from
    # WIDE_FROM_ROWS_PER_GROUP on average (Qwen3-30B-A3B, top 8 of 128: 4K tokens).
    assert MOSAIC_WIDE_TILES.compute_wgs == 2 and mosaic_supports(w8, MOSAIC_WIDE_TILES)
    assert fp8_tiles_for(1024 * 8, 128) == MOSAIC_TILES
    assert fp8_tiles_for(WIDE_FROM_ROWS_PER_GROUP * 128 - 1, 128) == MOSAIC_TILES
    assert fp8_tiles_for(4096 * 8, 128) == MOSAIC_WIDE_TILES
    assert fp8_tiles_for(4096 * 8, 128, w8) == MOSAIC_WIDE_TILES
    assert fp8_tiles_for(4096 * 8, 128, _matrix("fp8", block=32)) == MOSAIC_TILES
    # From MANY_GROUPS groups (512 experts, top-10): 64-row tiles two an SM below
    # FP8_MANY_WIDE_FROM_ROWS_PER_GROUP rows a group, else 256-row tiles through four stages.
    many = FP8_MANY_WIDE_FROM_ROWS_PER_GROUP * 512
    assert fp8_tiles_for(many - 1, 512) == MOSAIC_SMALL_TILES
    assert fp8_tiles_for(many, 512, w8) == MOSAIC_FP8_MANY_TILES
    assert fp8_tiles_for(32768 * 10, 512) == MOSAIC_FP8_MANY_TILES
    assert fp8_tiles_for(many, 512, _matrix("fp8", block=32)) == MOSAIC_TILES
    # Many experts of few rows (512, top-10 at 1K tokens): 64-row tiles, two programs an SM,
    # for both formats; int4 only below INT4_SMALL_BELOW_ROWS_PER_GROUP rows an expert.
    assert fp8_tiles_for(1024 * 10, 512) == fp8_tiles_for(1024 * 10, 512, w8) == (
        MOSAIC_SMALL_TILES)
    assert fp8_tiles_for(16384 * 10, 512) == MOSAIC_FP8_MANY_TILES
    assert fp8_tiles_for(1024 * 10, MANY_GROUPS - 1) == MOSAIC_TILES
    assert mosaic_supports(w8, MOSAIC_SMALL_TILES)
    assert mosaic_int4_supports(w4, MOSAIC_SMALL_TILES)
    assert int4_tiles_for(1024 * 10, 512) == MOSAIC_SMALL_TILES
    assert int4_tiles_for(4096 * 10, 512) == MOSAIC_INT4_TILES
    assert int4_tiles_for(1024 * 8, 128) == MOSAIC_INT4_TILES
    if not is_hopper():
        # Off Hopper every choice dequantizes first.
        for w in (w8, w4):
            assert resolve_quantized(None, w) == resolve_quantized("fused", w) == "dequantize"


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(2048, 768), (768, 2048)])
@pytest.mark.parametrize("kind", ["fp8", "int4", "int4-zp"])
def test_kernel_gives_dequantize_then_matmul_bits_on_hopper(k, n, kind):
    # At Qwen3-30B-A3B expert shapes: the bits of the dequantized matrix through the bf16
    # Mosaic kernel, the float64 reference's values, and a layer in pieces the whole's bits.
    if not is_hopper():
        pytest.skip("the Mosaic kernel needs a Hopper GPU")
    e = 8
    w = (_zero_matrix(e=e, k=k, n=n, nan_experts=(1, 3)) if kind == "int4-zp"
         else _matrix(kind, e=e, k=k, n=n, nan_experts=(1, 3)))
    sizes = jnp.asarray([300, 0, 1000, 0, 77, 129, 2, 500], jnp.int32)
    m = int(sizes.sum()) + 5
    x = _x(m, k)
    fused = "fused" if kind == "int4-zp" else None  # auto dequantizes zero-points
    assert resolve_quantized(fused, w) == "mosaic"
    got = grouped_matmul(x, w, sizes, quantized=fused)
    deq = grouped_matmul(x, w.dequantize(), sizes, impl="mosaic")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(deq))
    assert_close(np.asarray(got, np.float64), quantized_reference(x, w, sizes), jnp.bfloat16)
    bounds = row_pieces(m, 4)
    parts = [grouped_matmul(x[a:b], w, piece_group_sizes(sizes, a, b), quantized=fused)
             for a, b in zip(bounds, bounds[1:])]
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(parts)), np.asarray(got))
    fn = mosaic_grouped_matmul if kind == "fp8" else mosaic_int4_grouped_matmul
    others = ((MosaicTiles(128, 128, 64, 2, 1, 2), MosaicTiles(128, 128, 128, 3, 4))
              if kind == "fp8" else (MosaicTiles(128, 128, 64, 2, 1, 1),
                                     MosaicTiles(128, 128, 64, 4, 8)))
    for tiles in others:
        other = fn(x, w, sizes, tiles=tiles)
        assert_close(np.asarray(other, np.float64), quantized_reference(x, w, sizes),
                     jnp.bfloat16, err_msg=str(tiles))
    if kind == "fp8":
        # Two compute warpgroups sharing each converted tile (MOSAIC_WIDE_TILES and a 128-row
        # one): per 64-row product the same sums in the same order, the dequantize path's bits.
        for tiles in (MOSAIC_WIDE_TILES, MosaicTiles(128, 128, 64, 2, 8, 1, 2)):
            np.testing.assert_array_equal(np.asarray(fn(x, w, sizes, tiles=tiles)),
                                          np.asarray(deq), err_msg=str(tiles))
        return
    # int4's "bits" (float32 scales of the same values with bf16 inputs; fp16 inputs) gives
    # the dequantize path's bits as "bf16x2" does; negative scales too.
    np.testing.assert_array_equal(np.asarray(fn(x, _f32_scales(w), sizes)), np.asarray(deq))
    x16, w16 = x.astype(jnp.float16), _fp16(w)
    np.testing.assert_array_equal(
        np.asarray(fn(x16, w16, sizes)),
        np.asarray(grouped_matmul(x16, w16.dequantize(), sizes, impl="mosaic")))
    neg = dataclasses.replace(w, scale=-w.scale)
    np.testing.assert_array_equal(
        np.asarray(fn(x, neg, sizes)),
        np.asarray(grouped_matmul(x, neg.dequantize(), sizes, impl="mosaic")))


@pytest.mark.gpu
@pytest.mark.parametrize("kind,rows", [("fp8", 20), ("int4", 20), ("fp8", 100)])
def test_many_experts_give_dequantize_then_matmul_bits_on_hopper(kind, rows):
    # 512 experts of few rows (MOSAIC_SMALL_TILES for both formats; fp8 from 64 rows an
    # expert MOSAIC_FP8_MANY_TILES): the bits of the dequantized matrix through the bf16
    # kernels (this package's, which grouped_matmul takes at this many groups, and jax's),
    # experts with no rows (NaN scales) unread, rows past the groups zeros.
    if not is_hopper():
        pytest.skip("the Mosaic kernel needs a Hopper GPU")
    e, k, n = 2 * MANY_GROUPS, 256, 256
    sizes = np.random.default_rng(3).integers(0, 2 * rows, e).astype(np.int32)
    sizes[[0, 7, e - 1]] = 0
    w = _matrix(kind, e=e, k=k, n=n, nan_experts=(0, 7, e - 1))
    m = int(sizes.sum()) + 9
    x, sizes = _x(m, k), jnp.asarray(sizes)
    tiles = fp8_tiles_for(m, e, w) if kind == "fp8" else int4_tiles_for(m, e)
    assert tiles == (MOSAIC_SMALL_TILES if rows < 64 else MOSAIC_FP8_MANY_TILES)
    got = np.asarray(grouped_matmul(x, w, sizes))
    deq = w.dequantize()
    from strata_jax.kernels.grouped import _mosaic_jit
    for want in (grouped_matmul(x, deq, sizes, impl="mosaic"), _mosaic_jit(x, deq, sizes)):
        np.testing.assert_array_equal(got, np.asarray(want))
    assert np.isfinite(got).all() and (got[m - 9:] == 0).all()


@pytest.mark.gpu
def test_two_warpgroups_over_an_odd_number_of_steps_on_hopper():
    # Visits whose last step leaves the slot the next visit's first step writes (5 k steps):
    # the dequantize path's bits, visit after visit.
    if not is_hopper():
        pytest.skip("the Mosaic kernel needs a Hopper GPU")
    k = 320
    w = _matrix("fp8", e=8, k=k, n=256, nan_experts=(1, 3))
    sizes = jnp.asarray([300, 0, 1000, 0, 77, 129, 2, 500], jnp.int32)
    x = _x(int(sizes.sum()) + 5, k)
    got = mosaic_grouped_matmul(x, w, sizes, tiles=MOSAIC_WIDE_TILES)
    deq = grouped_matmul(x, w.dequantize(), sizes, impl="mosaic")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(deq))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [200, 2048])
@pytest.mark.parametrize("kind", ["fp8", "int4", "int4-zp", "int4-act"])
def test_model_reads_quantized_experts_through_the_kernel_with_dequantize_bits(kind, tokens):
    # A model whose expert matrices the kernel reads: every arm with "auto" (the Mosaic
    # kernel on Hopper) gives the bits of the resident model with "dequantize". At 2,048
    # tokens (512 rows an expert) whole fp8 layers take MOSAIC_WIDE_TILES and the routed
    # arm's tail pieces MOSAIC_TILES. int4-act: rows stored in group order (gate and up have
    # two groups, so a real permutation), each matmul's inputs gathered into that order.
    from strata_jax.models import get_preset
    from strata_jax.engine import Engine
    from strata_jax.formats import ExpertFormat
    from strata_jax.kernels import Kernels
    from strata_jax.stream import StreamConfig, StreamTuning
    from strata_jax.synthetic import SyntheticParams
    from strata_jax.weights import QuantizedParams

    if not is_hopper():
        pytest.skip("the Mosaic kernel needs a Hopper GPU")
    plain = get_preset("qwen3-30b-a3b").scaled(
        n_experts=8, top_k=2, hidden_size=256 if kind == "int4-act" else 128,
        expert_intermediate=128)
    cfg = plain.replace(expert_format=kind.split("-")[0], expert_block=128,
                        expert_zero_points=kind.endswith("-zp"),
                        expert_act_order=kind.endswith("-act"))
    fmt = ExpertFormat.of(cfg)
    planes = {p.name: jnp.zeros((cfg.n_experts, *p.shape), p.dtype) for p in fmt.planes}
    fused = "fused" if kind == "int4-zp" else "auto"  # auto dequantizes zero-points
    assert all(resolve_quantized(fused, w) == "mosaic" for w in fmt.expert_matrices(planes))
    params = QuantizedParams(SyntheticParams(plain, 3, 1.0), cfg)
    toks = np.random.default_rng(5).integers(0, cfg.vocab_size, tokens)
    got = {}
    for name, kernels, stream in (
            ("dequantize", Kernels(quantized_matmul="dequantize"), None),
            ("resident", Kernels(quantized_matmul=fused), None),
            ("routed", Kernels(quantized_matmul=fused), StreamConfig(
                routed=True, tuning=StreamTuning(layout="frames", tail_pieces=2, tail_from=16,
                                                 stream_floor=1))),
            ("stream-all", Kernels(quantized_matmul=fused), StreamConfig(
                routed=False, tuning=StreamTuning(layout="packed")))):
        with Engine(cfg, params, stream, max_context=max(tokens, 256),
                    chunk_size=max(tokens, 256), kernels=kernels) as eng:
            r = eng.prefill(toks)
            got[name] = (r.logits_sha256(), r.kv_sha256())
    assert len(set(got.values())) == 1, got


def test_quant_matmul_bench_times_the_models_tiling_without_mosaic_flags():
    # No --mosaic: the tiling the model reads the layer with (int4's; fp8's by its rows an
    # expert: the two-warpgroup tiling from 256).
    from strata_jax.models import get_preset
    from strata_jax.benchmarks.quant_matmul_bench import model_mosaic_tiles

    cfg = get_preset("qwen3-30b-a3b")  # top-8 of 128 experts: 1K tokens 64 rows an expert
    assert model_mosaic_tiles("int4", 8192, cfg) == MOSAIC_INT4_TILES
    assert model_mosaic_tiles("int4-zp", 1024, cfg) == MOSAIC_INT4_TILES
    assert model_mosaic_tiles("fp8", 1024, cfg) == MOSAIC_TILES
    assert model_mosaic_tiles("fp8", 8192, cfg) == MOSAIC_WIDE_TILES
    assert model_mosaic_tiles("mxfp4", 1024, cfg) is None  # each matrix's mxfp4_tiles_for


@pytest.mark.slow
def test_quant_matmul_bench_rows_on_a_small_layer():
    # The benchmark's rows on a small layer: bf16, dequantize and the Mosaic kernel
    # (interpreted on the CPU), each finite and near the dequantize path's output.
    from strata_jax.models import get_preset
    from strata_jax.benchmarks.quant_matmul_bench import bench_one, main, parse_mosaic

    cfg = get_preset("qwen3-30b-a3b").scaled(n_experts=8, top_k=2, hidden_size=256,
                                              expert_intermediate=128)
    rows = bench_one(64, cfg, "fp8", warmup=0, repeats=1,
                     mosaic=[parse_mosaic("64,128,64,2,1")])
    assert [r["path"] for r in rows] == ["bf16", "dequantize", "mosaic"]
    assert "error" not in rows[2] and rows[2]["finite"], rows[2]
    assert rows[2]["max_diff_over_max"] < 0.02, rows[2]
    # int4: the kernel's conversion named in its row; a tiling it does not read (a whole
    # group a step) is reported unsupported; per_matrix: gate's and down's matmul alone
    rows = bench_one(64, cfg, "int4", warmup=0, repeats=1, per_matrix=True,
                     mosaic=[parse_mosaic("64,128,64,2,1"), parse_mosaic("64,128,128,2,1")])
    assert [(r["path"], r.get("matrix")) for r in rows] == [
        ("bf16", None), ("dequantize", None), ("bf16", "gate"), ("bf16", "down"),
        ("mosaic", None), ("mosaic", "gate"), ("mosaic", "down"), ("mosaic", None)]
    for r in rows[:7]:
        assert "error" not in r and r["ms"] > 0 and r["over_bf16"] > 0, r
    assert rows[4]["int_to_float"] == "bf16x2" and rows[4]["finite"], rows[4]
    assert rows[4]["max_diff_over_max"] < 0.02, rows[4]
    assert "unsupported" in rows[7]["error"]
    # int4 with zero-points: the kernel reads the zero plane
    rows = bench_one(64, cfg, "int4-zp", warmup=0, repeats=1,
                     mosaic=[parse_mosaic("64,128,64,2,1")])
    assert [(r["kind"], r["path"]) for r in rows] == [
        ("int4-zp", "bf16"), ("int4-zp", "dequantize"), ("int4-zp", "mosaic")]
    assert "error" not in rows[2] and rows[2]["finite"], rows[2]
    assert rows[2]["max_diff_over_max"] < 0.02, rows[2]
    # mxfp4: the kernel at each matrix's tiling (the model's: one name, both widths whole
    # 128-column tiles) and at a given one; a whole pack of 128 a step is unsupported
    rows = bench_one(64, cfg, "mxfp4", warmup=0, repeats=1)
    assert [(r["kind"], r["path"], r.get("tiles")) for r in rows] == [
        ("mxfp4", "bf16", None), ("mxfp4", "dequantize", None),
        ("mxfp4", "mosaic", "128,128,64,3,8,2,1")]
    assert "error" not in rows[2] and rows[2]["finite"], rows[2]
    assert rows[2]["max_diff_over_max"] < 0.02, rows[2]
    rows = bench_one(64, cfg, "mxfp4", warmup=0, repeats=1,
                     mosaic=[parse_mosaic("64,128,64,2,1"), parse_mosaic("64,128,128,2,1")])
    assert "error" not in rows[2] and rows[2]["finite"], rows[2]
    assert "unsupported" in rows[3]["error"]
    for bad in ("128,128,64", "128,128,64,3,8,1,2,0"):
        with pytest.raises(ValueError, match="bm,bn,bk,stages,grid_block_n"):
            parse_mosaic(bad)
    for gone in ("--tiles", "--no-triton", "--int-to-float", "--load-layout"):
        with pytest.raises(SystemExit):
            main([gone, "x"] if gone != "--no-triton" else [gone])
