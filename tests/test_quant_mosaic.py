"""The Mosaic GPU grouped matmuls over fp8 and int4 planes (`strata_jax.quant_mosaic`): their
numerics against the float64 reference (Pallas' Mosaic GPU interpret mode on the CPU), what
they refuse, and on a Hopper GPU the bits of dequantize-then-matmul, from the kernels and from
the model."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.grouped_matmul import grouped_matmul, is_hopper, piece_group_sizes, row_pieces
from strata_jax.quant_matmul import fused_reference, resolve_quantized
from strata_jax.quant_mosaic import (MOSAIC_INT4_TILES, MOSAIC_TILES, MOSAIC_WIDE_TILES,
                                     WIDE_FROM_ROWS_PER_GROUP, KernelProfile, MosaicTiles,
                                     fp8_tiles_for, high_nibbles_x16_f32,
                                     int4_conversion, int4_values_f32,
                                     mosaic_grouped_matmul, mosaic_int4_grouped_matmul,
                                     mosaic_int4_supports, mosaic_supports,
                                     split_scale_bf16)
from strata_jax.testing import assert_close
from test_quant_matmul import _matrix, _x, _zero_matrix

# An empty expert between two, one expert's rows crossing a 64-row tile, an empty one last;
# expert 1's and 4's scales are NaN: an expert with no rows must not reach any output.
SIZES = [50, 0, 130, 20, 0]


def test_interpreted_kernel_matches_the_float64_reference():
    w = _matrix("fp8", nan_experts=(1, 4))
    m = sum(SIZES) + 7  # rows past the groups come back as zeros
    x = _x(m, 256)
    got = np.asarray(mosaic_grouped_matmul(x, w, jnp.asarray(SIZES, jnp.int32),
                                           tiles=MosaicTiles(64, 128, 64, 2, 1),
                                           interpret=True), np.float64)
    want = fused_reference(x, w, SIZES)
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
    assert_close(got[0][:200].astype(np.float64), fused_reference(x, w, SIZES)[:200],
                 jnp.bfloat16)


def test_interpreted_int4_kernel_matches_the_float64_reference():
    # As the fp8 kernel's: experts 1 and 4 have NaN scales and no rows, rows past the groups
    # are zeros; the nibble halves times each column's group scale.
    w = _matrix("int4", nan_experts=(1, 4))
    m = sum(SIZES) + 7
    x = _x(m, 256)
    got = np.asarray(mosaic_int4_grouped_matmul(x, w, jnp.asarray(SIZES, jnp.int32),
                                                tiles=MosaicTiles(64, 128, 128, 2, 1),
                                                interpret=True), np.float64)
    assert np.isfinite(got).all()
    assert_close(got[:200], fused_reference(x, w, SIZES)[:200], jnp.bfloat16)
    assert (got[200:] == 0).all()
    # (nibble - 8) as float32 by its bits (the default), with the high nibbles masked in
    # place, or by a conversion: the same bits
    for how in ("masks", "convert", "bf16x2"):
        conv = mosaic_int4_grouped_matmul(x, w, jnp.asarray(SIZES, jnp.int32),
                                          tiles=MosaicTiles(64, 128, 128, 2, 1), interpret=True,
                                          int_to_float=how,
                                          load_layout="wide" if how == "bf16x2" else "wgmma")
        np.testing.assert_array_equal(np.asarray(conv, np.float64), got, err_msg=how)
    with pytest.raises(ValueError, match="int_to_float 'cast'"):
        mosaic_int4_grouped_matmul(x, w, jnp.asarray(SIZES, jnp.int32), int_to_float="cast")
    # "bf16x2" computes in bf16 on four bytes a thread: bf16 inputs, the "wide" layout
    with pytest.raises(ValueError, match="'bf16x2' reads bf16 inputs.*not bfloat16 with 'wgmma'"):
        mosaic_int4_grouped_matmul(x, w, jnp.asarray(SIZES, jnp.int32), int_to_float="bf16x2",
                                   load_layout="wgmma")
    # the defaults: bf16x2 on four bytes a thread for bf16, else bits in the products' layout
    assert int4_conversion(jnp.bfloat16) == ("bf16x2", "wide")
    assert int4_conversion(jnp.float16) == ("bits", "wgmma")
    assert int4_conversion(jnp.bfloat16, load_layout="wgmma") == ("bits", "wgmma")
    assert int4_conversion(jnp.bfloat16, "masks") == ("masks", "wgmma")
    assert int4_conversion(jnp.bfloat16, scale_dtype=jnp.float32) == ("bits", "wgmma")
    w32 = dataclasses.replace(w, scale=w.scale.astype(jnp.float32))  # not the format's
    with pytest.raises(ValueError, match="'bf16x2' splits float16 scales exactly, not float32"):
        mosaic_int4_grouped_matmul(x, w32, jnp.asarray(SIZES, jnp.int32), int_to_float="bf16x2",
                                   load_layout="wide")
    w16 = dataclasses.replace(w, dtype=jnp.float16)
    with pytest.raises(ValueError, match="'bf16x2' reads bf16 inputs.*not float16"):
        mosaic_int4_grouped_matmul(x.astype(jnp.float16), w16, jnp.asarray(SIZES, jnp.int32),
                                   int_to_float="bf16x2", load_layout="wide")


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


@pytest.mark.parametrize("kind", ["fp8", pytest.param("int4", marks=pytest.mark.slow)])
def test_a_step_that_waits_for_its_product_gives_the_same_bits(kind):
    # MosaicTiles(overlap=False): one weight slot, each step's product waited for before the
    # next converts, x released at once: the same sums in the same order, the overlapping
    # kernel's bits (int4: half a group and a whole group a step). The byte layouts exist
    # only on a GPU: interpreted, every load_layout runs the same code.
    w = _matrix(kind, nan_experts=(1, 4))
    x = _x(sum(SIZES) + 7, 256)
    sizes = jnp.asarray(SIZES, jnp.int32)
    fn = mosaic_grouped_matmul if kind == "fp8" else mosaic_int4_grouped_matmul
    base = MosaicTiles(64, 128, 64, 2, 1)
    for bk in (64, 128) if kind == "int4" else (64,):
        base = dataclasses.replace(base, block_k=bk)
        want = np.asarray(fn(x, w, sizes, tiles=base, interpret=True))
        tiles = dataclasses.replace(base, overlap=False)
        np.testing.assert_array_equal(np.asarray(fn(x, w, sizes, tiles=tiles, interpret=True)),
                                      want, err_msg=str(tiles))
    if kind == "int4":
        with pytest.raises(ValueError, match="load_layout 'narrow'"):
            fn(x, w, sizes, load_layout="narrow")
    with pytest.raises(ValueError, match="overlap=False"):
        MosaicTiles(128, 128, 64, 3, 8, 1, 2, overlap=False)


def test_int4_nibbles_by_their_bits_are_exactly_the_converted_values():
    # The int4 kernel's (nibble - 8) from 2^23 + nibble's bit pattern, over every byte, times
    # float16 scales from subnormal to the largest, NaN and inf, cast to bf16 and fp16.
    q = jnp.arange(256, dtype=jnp.int32)[:, None]
    rng = np.random.default_rng(0)
    s = np.concatenate([rng.standard_normal(500), [6e-8, -6e-8, 65504, -65504, 0.0, -0.0,
                                                   np.nan, np.inf, -np.inf]])
    s = jnp.asarray(s.astype(np.float16)).astype(jnp.float32)[None]
    for n in (q & 15, q >> 4):
        by_bits = int4_values_f32(n, "bits")
        converted = int4_values_f32(n, "convert")
        np.testing.assert_array_equal(np.asarray(by_bits), np.asarray(n - 8, np.float32))
        np.testing.assert_array_equal(np.asarray(converted), np.asarray(n - 8, np.float32))
        for dtype in (jnp.bfloat16, jnp.float16):
            a = (converted * s).astype(dtype)
            b = (by_bits * s).astype(dtype)
            np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                          np.asarray(b).view(np.uint16))
    # "masks": a high nibble in place, 16 (n - z) times the scale / 16, gives the same values
    # and the same bits after the cast, for the implicit zero 8 and every zero-point
    x16 = high_nibbles_x16_f32(q)
    np.testing.assert_array_equal(np.asarray(x16), np.asarray(16 * ((q >> 4) - 8), np.float32))
    for z in range(16):
        np.testing.assert_array_equal(np.asarray(high_nibbles_x16_f32(q, float(z))),
                                      np.asarray(16 * ((q >> 4) - z), np.float32))
    for dtype in (jnp.bfloat16, jnp.float16):
        a = (int4_values_f32(q >> 4, "bits") * s).astype(dtype)
        b = (x16 * (s * 0.0625)).astype(dtype)
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                      np.asarray(b).view(np.uint16))


# The zero-point kernel is what quantized_matmul="fused" reads int4-zp with ("auto"
# dequantizes it first): both k steps in the slow run.
@pytest.mark.slow
@pytest.mark.parametrize("bk", [128, 64], ids=["whole-group", "half-group"])
def test_interpreted_int4_kernel_reads_zero_points(bk):
    # Zero-points (a uint8 row a group, pipelined as the scale row): (nibble - z) * scale, the
    # float64 reference's values, the same bits by bits and by conversion and with two
    # programs an SM; zero-points all 8 give the symmetric kernel's bits (the same arithmetic,
    # so the dequantize path's on a GPU). Two compute warpgroups are refused.
    w = _zero_matrix(seed=3, nan_experts=(1, 4))
    m = sum(SIZES) + 7
    x = _x(m, 256)
    sizes = jnp.asarray(SIZES, jnp.int32)
    one = MosaicTiles(64, 128, bk, 2, 1)
    got = {}
    for conv in ("bits", "masks", "convert", "bf16x2"):
        for tiles in (one, MosaicTiles(64, 128, bk, 3, 2, 2)):
            got[conv, tiles] = out = np.asarray(mosaic_int4_grouped_matmul(
                x, w, sizes, tiles=tiles, interpret=True, int_to_float=conv,
                load_layout="wide" if conv == "bf16x2" else "wgmma"))
            assert np.isfinite(out).all()
            assert (out[200:] == 0).all()
    ref = fused_reference(x, w, SIZES)[:200]
    assert_close(got["bits", one][:200].astype(np.float64), ref, jnp.bfloat16)
    for key, out in got.items():
        np.testing.assert_array_equal(out, got["bits", one], err_msg=str(key))
    two = MosaicTiles(128, 128, bk, 2, 1, 1, 2)
    assert not mosaic_int4_supports(w, two)
    assert mosaic_int4_supports(dataclasses.replace(w, zero=None), two)
    with pytest.raises(ValueError, match="cannot be read by"):
        mosaic_int4_grouped_matmul(x, w, sizes, tiles=two, interpret=True)
    eight = dataclasses.replace(w, zero=jnp.full_like(w.zero, 8))
    sym = dataclasses.replace(w, zero=None)
    np.testing.assert_array_equal(
        np.asarray(mosaic_int4_grouped_matmul(x, eight, sizes, tiles=one, interpret=True)),
        np.asarray(mosaic_int4_grouped_matmul(x, sym, sizes, tiles=one, interpret=True)))


# The default run interprets the k step the model's fp8 kernel takes with two warpgroups
# (MOSAIC_WIDE_TILES: 64); the slow run the others, and int4's (which the model does not take).
@pytest.mark.parametrize("kind, bk", [
    ("fp8", 64), pytest.param("fp8", 128, marks=pytest.mark.slow),
    pytest.param("int4", 64, marks=pytest.mark.slow),
    pytest.param("int4", 128, marks=pytest.mark.slow)])
def test_two_compute_warpgroups_match_the_float64_reference(kind, bk):
    # A 128-row tile split between two compute warpgroups that share each converted weight
    # tile (fp8: rows or columns of it; int4: a nibble half or columns), and int4 in k steps
    # of half a group: the reference's values, zeros past the groups, NaN-scaled unrouted
    # experts reaching no row; each warpgroup's rows are the 64-row one-warpgroup kernel's.
    w = _matrix(kind, nan_experts=(1, 4))
    m = sum(SIZES) + 7
    x = _x(m, 256)
    sizes = jnp.asarray(SIZES, jnp.int32)
    fn = mosaic_grouped_matmul if kind == "fp8" else mosaic_int4_grouped_matmul
    one = np.asarray(fn(x, w, sizes, tiles=MosaicTiles(64, 128, bk, 2, 1), interpret=True))
    got = np.asarray(fn(x, w, sizes, tiles=MosaicTiles(128, 128, bk, 2, 1, 1, 2),
                        interpret=True))
    assert np.isfinite(got).all()
    assert_close(got[:200].astype(np.float64), fused_reference(x, w, SIZES)[:200],
                 jnp.bfloat16)
    assert (got[200:] == 0).all()
    np.testing.assert_array_equal(got, one)


_LOWERED = {  # kernel, tiling
    # what the model reads fp8 and int4 with (fp8_tiles_for, MOSAIC_INT4_TILES)
    "model": (("fp8", mosaic_grouped_matmul, MOSAIC_TILES),
              ("fp8", mosaic_grouped_matmul, MOSAIC_WIDE_TILES),
              ("int4", mosaic_int4_grouped_matmul, MOSAIC_INT4_TILES)),
    # what quant_matmul_bench also times, and the kernel with zero-points ("fused")
    "others": (("int4", mosaic_int4_grouped_matmul, MosaicTiles(256, 128, 64, 3, 8, 1, 2)),
               ("int4", mosaic_int4_grouped_matmul, MosaicTiles(128, 128, 64, 4, 8)),
               ("int4-zp", mosaic_int4_grouped_matmul, MOSAIC_INT4_TILES)),
}


@pytest.mark.parametrize("which", ["model", pytest.param("others", marks=pytest.mark.slow)])
def test_kernels_lower_for_cuda(which):
    # Mosaic's lowering for a GPU (layout inference included) runs on the CPU: the kernels at
    # their tilings and Qwen3-30B-A3B's expert shapes.
    sizes = jnp.full((8,), 128, jnp.int32)
    for kind, fn, tiles in _LOWERED[which]:
        for k, n in ((2048, 768), (768, 2048))[:1 if kind == "int4-zp" else 2]:
            w = (_zero_matrix(e=8, k=k, n=n) if kind == "int4-zp"
                 else _matrix(kind, e=8, k=k, n=n))
            f = jax.jit(lambda x, w, s, fn=fn, tiles=tiles: fn(x, w, s, tiles=tiles,
                                                              interpret=False, num_sms=132))
            jax.export.export(f, platforms=["cuda"], disabled_checks=[
                jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu")])(_x(1024, k), w, sizes)
    if which != "others":
        return
    # The int4 kernel's nibbles reach float32 by their bits: no int-to-float op in its module
    # (the kernel's own module, embedded in the program), unlike with int_to_float="convert".
    w = _matrix("int4", e=8, k=768, n=2048)
    for conv, has in (("bits", False), ("masks", False), ("convert", True)):
        f = jax.jit(lambda x, w, s, conv=conv: mosaic_int4_grouped_matmul(
            x, w, s, interpret=False, num_sms=132, int_to_float=conv))
        text = jax.export.export(f, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu")])(
                _x(1024, 768), w, sizes).mlir_module()
        assert ("sitofp" in text) == has, conv


def test_a_profile_reaches_the_kernels_compiler_params(tmp_path, monkeypatch):
    # KernelProfile: the one- and two-warpgroup kernels of both formats are built with Mosaic
    # GPU's profiler on (its space in regions, its directory), and without one with it off.
    # (Lowering a profiled kernel for CUDA needs a CUDA backend: its trace is written by a
    # host callback.) Interpret mode refuses a profile; a profile without a directory or
    # regions is refused by name.
    from jax.experimental.pallas import mosaic_gpu as plgpu

    seen = []

    class Built(Exception):
        pass

    def kernel(body, *, compiler_params, **kwargs):
        seen.append((compiler_params.profile_space, compiler_params.profile_dir))
        raise Built

    monkeypatch.setattr(plgpu, "kernel", kernel)
    sizes = jnp.full((8,), 128, jnp.int32)
    prof = KernelProfile(str(tmp_path), 256)
    for fn, w, tiles in ((mosaic_int4_grouped_matmul, _matrix("int4", e=8), MOSAIC_INT4_TILES),
                         (mosaic_int4_grouped_matmul, _matrix("int4", e=8),
                          MosaicTiles(256, 128, 64, 3, 8, 1, 2)),
                         (mosaic_grouped_matmul, _matrix("fp8", e=8), MOSAIC_TILES),
                         (mosaic_grouped_matmul, _matrix("fp8", e=8), MOSAIC_WIDE_TILES)):
        for profile, want in ((None, (0, "")), (prof, (256, str(tmp_path)))):
            seen.clear()
            with pytest.raises(Built):
                fn(_x(1024, 256), w, sizes, tiles=tiles, interpret=False, num_sms=132,
                   profile=profile)
            assert seen == [want], (tiles, profile)
        with pytest.raises(ValueError, match="interpret mode"):
            fn(_x(64, 256), w, sizes, interpret=True, profile=prof)
    # scopes: only the regions named are recorded (the others are no scope at all)
    from strata_jax.quant_mosaic import PROFILE_REGIONS, _region_scopes
    scoped = _region_scopes(KernelProfile(str(tmp_path), 64, ["convert"]))
    assert not isinstance(scoped("convert"), contextlib.nullcontext)
    assert isinstance(scoped("wgmma"), contextlib.nullcontext)
    assert not any(isinstance(_region_scopes(None)(r), contextlib.nullcontext)
                   for r in PROFILE_REGIONS)
    with pytest.raises(ValueError, match="scopes=\\('loop',\\)"):
        KernelProfile(str(tmp_path), 64, ("loop",))
    with pytest.raises(ValueError, match="dir is empty"):
        KernelProfile("")
    with pytest.raises(ValueError, match="regions=0"):
        KernelProfile(str(tmp_path), 0)


def test_what_the_kernel_reads_and_refuses():
    w8, w4 = _matrix("fp8"), _matrix("int4")
    assert mosaic_supports(w8, MOSAIC_TILES)
    assert not mosaic_supports(w4, MOSAIC_TILES)  # int4 has its own kernel
    assert mosaic_int4_supports(w4, MOSAIC_INT4_TILES)
    assert not mosaic_int4_supports(w4, MosaicTiles(block_k=256))  # a step: one group at most
    assert not mosaic_int4_supports(w8, MOSAIC_INT4_TILES)
    assert not mosaic_int4_supports(_matrix("int4", block=64), MOSAIC_INT4_TILES)
    with pytest.raises(ValueError, match="int4 in groups of 128"):
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
                dict(stages=1, compute_wgs=2), dict(per_sm=2, compute_wgs=2)):
        with pytest.raises(ValueError, match="MosaicTiles"):
            MosaicTiles(**bad)
    assert mosaic_int4_supports(w4, MosaicTiles(block_k=64))  # half a group a step
    # fp8's tiling follows the rows an expert: two warpgroups on 256-row tiles from
    # WIDE_FROM_ROWS_PER_GROUP on average (Qwen3-30B-A3B, top 8 of 128: 4K tokens).
    assert MOSAIC_WIDE_TILES.compute_wgs == 2 and mosaic_supports(w8, MOSAIC_WIDE_TILES)
    assert fp8_tiles_for(1024 * 8, 128) == MOSAIC_TILES
    assert fp8_tiles_for(WIDE_FROM_ROWS_PER_GROUP * 128 - 1, 128) == MOSAIC_TILES
    assert fp8_tiles_for(4096 * 8, 128) == MOSAIC_WIDE_TILES
    assert fp8_tiles_for(4096 * 8, 128, w8) == MOSAIC_WIDE_TILES
    assert fp8_tiles_for(4096 * 8, 128, _matrix("fp8", block=32)) == MOSAIC_TILES
    assert not mosaic_int4_supports(w4, MosaicTiles(block_k=32))
    if not is_hopper():
        # Off Hopper "auto" dequantizes and "fused" takes the Triton kernel.
        for w in (w8, w4):
            assert resolve_quantized(None, w) == "dequantize"
            assert resolve_quantized("fused", w) == "triton"


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
    assert_close(np.asarray(got, np.float64), fused_reference(x, w, sizes), jnp.bfloat16)
    bounds = row_pieces(m, 4)
    parts = [grouped_matmul(x[a:b], w, piece_group_sizes(sizes, a, b), quantized=fused)
             for a, b in zip(bounds, bounds[1:])]
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(parts)), np.asarray(got))
    others = ((MosaicTiles(128, 128, 64, 2, 1, 2), MosaicTiles(128, 128, 128, 3, 4))
              if kind == "fp8" else (MosaicTiles(128, 128, 128, 2, 1, 2),
                                     MosaicTiles(128, 128, 64, 4, 8)))
    fn = mosaic_grouped_matmul if kind == "fp8" else mosaic_int4_grouped_matmul
    for tiles in others:
        other = fn(x, w, sizes, tiles=tiles)
        assert_close(np.asarray(other, np.float64), fused_reference(x, w, sizes),
                     jnp.bfloat16, err_msg=str(tiles))
    # The one-warpgroup kernel's other ways to a step (each product waited for in its own
    # step; int4 a whole group a step; a step's bytes read four a thread, computed on in that
    # layout or moved into the products' one): the same sums in the same order, so the
    # dequantize path's bits.
    if kind == "fp8":
        variants = ((dataclasses.replace(MOSAIC_TILES, overlap=False), {}),)
    else:  # the default (bf16x2) and the float32 conversion ("bits"), at both k steps
        variants = ((dataclasses.replace(MOSAIC_INT4_TILES, overlap=False), {}),
                    (dataclasses.replace(MOSAIC_INT4_TILES, overlap=False),
                     dict(int_to_float="bits")),
                    (MosaicTiles(128, 128, 128, 3, 8, 1), {}),
                    (MosaicTiles(128, 128, 128, 3, 8, 1), dict(int_to_float="bits")),
                    (MOSAIC_INT4_TILES, dict(int_to_float="bits", load_layout="wide")),
                    (MOSAIC_INT4_TILES, dict(load_layout="wide-relayout")),
                    (MOSAIC_INT4_TILES, dict(int_to_float="bf16x2", load_layout="wide")),
                    (MOSAIC_INT4_TILES, dict(int_to_float="bits")))
    for tiles, extra in variants:
        np.testing.assert_array_equal(np.asarray(fn(x, w, sizes, tiles=tiles, **extra)),
                                      np.asarray(deq), err_msg=f"{tiles} {extra}")
    # Two compute warpgroups sharing each converted tile: per 64-row product the same sums
    # in the same order, so the dequantize path's bits (not for zero-points: refused).
    for tiles in ((MosaicTiles(256, 128, 64, 3, 8, 1, 2), MosaicTiles(128, 128, 128, 2, 8, 1, 2))
                  if kind != "int4-zp" else ()):
        # int4 with bf16 inputs: bf16x2 (the default) and the float32 conversion
        for extra in ({}, dict(int_to_float="bits")) if kind == "int4" else ({},):
            np.testing.assert_array_equal(np.asarray(fn(x, w, sizes, tiles=tiles, **extra)),
                                          np.asarray(deq), err_msg=f"{tiles} {extra}")
    if kind != "fp8":  # negative scales: the bf16 steps' bits too
        neg = dataclasses.replace(w, scale=-w.scale)
        np.testing.assert_array_equal(
            np.asarray(fn(x, neg, sizes, int_to_float="bf16x2", load_layout="wide")),
            np.asarray(grouped_matmul(x, neg.dequantize(), sizes, impl="mosaic")))


@pytest.mark.gpu
@pytest.mark.parametrize("kind,k,tiles", [
    ("fp8", 320, MosaicTiles(256, 128, 64, 3, 8, 1, 2)),    # 5 k steps
    ("int4", 384, MosaicTiles(128, 128, 128, 2, 8, 1, 2))])  # 3 k steps
def test_two_warpgroups_over_an_odd_number_of_steps_on_hopper(kind, k, tiles):
    # Visits whose last step leaves the slot the next visit's first step writes: the
    # dequantize path's bits, visit after visit.
    if not is_hopper():
        pytest.skip("the Mosaic kernel needs a Hopper GPU")
    w = _matrix(kind, e=8, k=k, n=256, nan_experts=(1, 3))
    sizes = jnp.asarray([300, 0, 1000, 0, 77, 129, 2, 500], jnp.int32)
    x = _x(int(sizes.sum()) + 5, k)
    fn = mosaic_grouped_matmul if kind == "fp8" else mosaic_int4_grouped_matmul
    got = fn(x, w, sizes, tiles=tiles)
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
    from strata_jax.config import get_preset
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
    from strata_jax.benchmarks.quant_matmul_bench import model_mosaic_tiles
    from strata_jax.config import get_preset

    cfg = get_preset("qwen3-30b-a3b")  # top-8 of 128 experts: 1K tokens 64 rows an expert
    assert model_mosaic_tiles("int4", 8192, cfg) == MOSAIC_INT4_TILES
    assert model_mosaic_tiles("int4-zp", 1024, cfg) == MOSAIC_INT4_TILES
    assert model_mosaic_tiles("fp8", 1024, cfg) == MOSAIC_TILES
    assert model_mosaic_tiles("fp8", 8192, cfg) == MOSAIC_WIDE_TILES


@pytest.mark.slow
def test_quant_matmul_bench_rows_on_a_small_layer():
    # The benchmark's rows on a small layer: bf16, dequantize, a Triton and a Mosaic tiling
    # (both interpreted on the CPU), each finite and near the dequantize path's output.
    from strata_jax.benchmarks.quant_matmul_bench import bench_one, parse_mosaic, parse_tiles
    from strata_jax.config import get_preset

    cfg = get_preset("qwen3-30b-a3b").scaled(n_experts=8, top_k=2, hidden_size=256,
                                              expert_intermediate=128)
    rows = bench_one(64, cfg, "fp8", [parse_tiles("64,128,4,3")], warmup=0, repeats=1,
                     mosaic=[parse_mosaic("64,128,64,2,1")])
    assert [r["path"] for r in rows] == ["bf16", "dequantize", "fused", "mosaic"]
    for r in rows[2:]:
        assert "error" not in r, r
        assert r["finite"] and r["max_diff_over_max"] < 0.02, r
    # int4: the Mosaic kernel at block_k 128 and, with two compute warpgroups, 64; a tiling
    # with another k step is reported unsupported
    # (each int_to_float a row, the same output)
    rows = bench_one(64, cfg, "int4", [], warmup=0, repeats=1,
                     mosaic=[parse_mosaic("64,128,128,2,1"), parse_mosaic("128,128,64,2,1,1,2"),
                             parse_mosaic("64,128,32,2,1")], int_to_float=("bits", "convert"))
    assert [r["path"] for r in rows] == ["bf16", "dequantize"] + ["mosaic"] * 5
    assert [r.get("int_to_float") for r in rows[2:]] == ["bits", "convert"] * 2 + [None]
    for r in rows[2:6]:
        assert "error" not in r, r
        assert r["finite"] and r["max_diff_over_max"] < 0.02, r
    assert rows[2]["max_diff_over_max"] == rows[3]["max_diff_over_max"]
    assert "unsupported" in rows[6]["error"]
    # without int_to_float: the model's conversion (bf16x2 on four bytes a thread), once
    rows = bench_one(64, cfg, "int4", [], warmup=0, repeats=1,
                     mosaic=[parse_mosaic("64,128,128,2,1")], load_layouts=(None, "wide"))
    assert [(r.get("int_to_float"), r.get("load_layout")) for r in rows[2:]] == [
        ("bf16x2", "wide")]
    assert rows[2]["finite"] and rows[2]["max_diff_over_max"] < 0.02, rows[2]
    # per_matrix: gate's and down's matmul alone, bf16's then each Mosaic row's
    rows = bench_one(64, cfg, "int4", [], warmup=0, repeats=1,
                     mosaic=[parse_mosaic("64,128,128,2,1")], int_to_float=("masks",),
                     per_matrix=True)
    assert [(r["path"], r.get("matrix")) for r in rows] == [
        ("bf16", None), ("dequantize", None), ("bf16", "gate"), ("bf16", "down"),
        ("mosaic", None), ("mosaic", "gate"), ("mosaic", "down")]
    for r in rows:
        assert "error" not in r and r["ms"] > 0 and r["over_bf16"] > 0, r
    assert rows[5]["int_to_float"] == "masks" and rows[2]["over_bf16"] == 1.0
    # int4 with zero-points: the kernel reads the zero plane (one warpgroup)
    rows = bench_one(64, cfg, "int4-zp", [], warmup=0, repeats=1,
                     mosaic=[parse_mosaic("64,128,128,2,1")])
    assert [(r["kind"], r["path"]) for r in rows] == [
        ("int4-zp", "bf16"), ("int4-zp", "dequantize"), ("int4-zp", "mosaic")]
    assert "error" not in rows[2] and rows[2]["finite"], rows[2]
    assert rows[2]["max_diff_over_max"] < 0.02, rows[2]
    with pytest.raises(ValueError, match="bm,bn,bk,stages,grid_block_n"):
        parse_mosaic("128,128,64")
