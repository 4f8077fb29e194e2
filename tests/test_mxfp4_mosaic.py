"""The Mosaic GPU grouped matmul over mxfp4 planes (`strata_jax.kernels.mosaic_mxfp4`): its
conversion's bits, the layouts its registers rely on, its numerics in Pallas' Mosaic GPU
interpret mode (the float64 reference's values, the interpreted bf16 kernel's bits over the
dequantized matrix), what it refuses, the path each choice takes, its lowering for CUDA at
gpt-oss's and Qwen3-30B-A3B's expert shapes; on a Hopper GPU the bits of dequantize-then-matmul,
from the kernel and from the model."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa

from strata_jax.formats import FP4_VALUES, MXFP4_GROUP, ExpertFormat, QuantizedMatrix
from strata_jax.kernels.grouped import grouped_matmul, is_hopper, piece_group_sizes, row_pieces
from strata_jax.kernels.mosaic import MANY_GROUPS, MosaicTiles, mosaic_bf16_grouped_matmul
from strata_jax.kernels.mosaic_mxfp4 import (
    BYTES_LAYOUT, MOSAIC_MXFP4_NARROW_TILES, MOSAIC_MXFP4_TILES, e8m0_f32,
    mosaic_mxfp4_grouped_matmul, mosaic_mxfp4_supports, mxfp4_tiles_for, mxfp4_values_f32
)
from strata_jax.kernels.quantized import resolve_format, resolve_quantized
from strata_jax.models import get_preset
from strata_jax.mxfp4 import e8m0_np, mxfp4_dequantize
from strata_jax.testing import assert_close
from test_mxfp4 import _matrix
from test_quant_matmul import HOPPER, OTHER_GPU, _x, quantized_reference
from test_quant_matmul import _matrix as _other_matrix

# An empty expert between two, one expert's rows crossing a 64-row tile, an empty one last;
# experts 1 and 4 have NaN scales (255): an expert with no rows must not reach any output.
SIZES = [50, 0, 130, 20, 0]
SMALL = MosaicTiles(64, 128, 64, 2, 1)  # one 64-row tile, one column tile a band


def _u16(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


def _random_matrix(e, k, n, lo=118, hi=123, seed=0, dtype=jnp.bfloat16):
    """An mxfp4 QuantizedMatrix of random codes (every byte) and exponents in [lo, hi]."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, (e, k // 2, n), dtype=np.uint8)
    s = rng.integers(lo, hi + 1, (e, k // MXFP4_GROUP, n)).astype(np.uint8)
    return QuantizedMatrix(jnp.asarray(q), jnp.asarray(s), "mxfp4", MXFP4_GROUP, (k, n),
                           np.dtype(dtype))


def _every_code(n: int) -> np.ndarray:
    """A pack's [32, n] bytes, each column's holding every code in both nibble halves (9r is
    every value mod 16 over 16 rows; 9r + 7c steps through every high nibble in 32)."""
    r, c = np.arange(32)[:, None], np.arange(n)[None, :]
    return ((9 * r + 7 * c) % 256).astype(np.uint8)


def test_codes_and_exponents_by_their_bits_are_the_formats_values():
    # Every code (FP4_VALUES, zeros' signs included) and every exponent (0: the subnormal
    # 2**-127, 255: NaN) from bits alone; their products cast to bf16 and fp16 are the JAX
    # dequantization's bits for every code at every exponent.
    codes = jnp.arange(16, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(mxfp4_values_f32(codes)).view(np.uint32),
                                  FP4_VALUES.view(np.uint32))
    s = jnp.arange(256, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(e8m0_f32(s)).view(np.uint32),
                                  e8m0_np(np.arange(256)).view(np.uint32))
    # one pack, 256 columns: each column's 32 bytes hold every code in both nibble halves,
    # column c's halves exponents c and 255 - c
    q = _every_code(256)
    for col in q.T:
        assert len(set(col & 15)) == len(set(col >> 4)) == 16
    q = jnp.asarray(q)
    sc = jnp.asarray(np.stack([np.arange(256), 255 - np.arange(256)]).astype(np.uint8))
    for dtype in (jnp.bfloat16, jnp.float16):
        want = mxfp4_dequantize(q, sc, (64, 256), dtype)
        c = jnp.concatenate([q & 15, q >> 4]).astype(jnp.int32)
        scale = jnp.repeat(e8m0_f32(sc.astype(jnp.int32)), 32, axis=0)
        got = (mxfp4_values_f32(c) * scale).astype(dtype)
        np.testing.assert_array_equal(_u16(got), _u16(want), err_msg=str(dtype))


def _threads(layout, shape):
    """{(warp, lane): {register index: the logical index of its first element}}, as
    `TiledLayout.thread_idxs` computes them (in NumPy, from jax's own layout)."""
    contig = tuple(mgpu.utils.get_contiguous_strides(shape))
    strides = layout.tiling.tile_strides(contig)
    tiled = layout.tiled_tiling_shape
    dyn = strides[-layout.tiled_tiling_rank:]

    def delinearize(i, dims):
        sizes = [d.times if isinstance(d, fa.Replicated) else tiled[d] for d in dims]
        full = [0] * len(tiled)
        for d, st, size in zip(dims, mgpu.utils.get_contiguous_strides(sizes), sizes):
            if not isinstance(d, fa.Replicated):
                full[d] = (i // st) % size
        return full

    out = {}
    for w in range(4):
        for lane in range(32):
            off = (np.dot(delinearize(w, layout.warp_dims), dyn)
                   + np.dot(delinearize(lane, layout.lane_dims), dyn))
            out[w, lane] = {idx: np.unravel_index(int(off + np.dot(idx, strides)), shape)
                            for idx in np.ndindex(layout.registers_shape(shape))}
    return out


@pytest.mark.parametrize("cols", [64, 128])
def test_bytes_layout_gives_each_warp_its_rows_of_the_step(cols):
    # The registers _pack_codes and _pack_scales reinterpret (jax's layouts): a [32, cols]
    # byte tile in BYTES_LAYOUT and the step's [64, cols] in WGMMA hold, register for
    # register, the same column, and byte row r as step row r (warps 0-1) or r + 32 (warps
    # 2-3); WGMMA's column layout holds each register's column at its column tile.
    bytes_layout = BYTES_LAYOUT.to_mgpu()
    assert bytes_layout.vector_length == mgpu.WGMMA_LAYOUT.vector_length == 2
    assert bytes_layout.registers_shape((32, cols)) == mgpu.WGMMA_LAYOUT.registers_shape(
        (64, cols))
    b = _threads(bytes_layout, (32, cols))
    w = _threads(mgpu.WGMMA_LAYOUT, (64, cols))
    col = _threads(mgpu.WGMMA_LAYOUT.reduce([0]), (cols,))
    seen = set()
    for (warp, lane), regs in w.items():
        for idx, (row, c) in regs.items():
            brow, bc = b[warp, lane][idx]
            assert (row, c) == (brow + 32 * (warp >= 2), bc), (warp, lane, idx)
            assert col[warp, lane][(idx[1], 0, 0)] == (c,)
            seen.add((row, c))
    assert len(seen) == 64 * cols // 2  # each register a pair of columns, every element once


def test_interpreted_kernel_reads_what_dequantize_makes():
    # Interpret mode: the float64 reference's values, zeros past the groups, the NaN-scaled
    # experts without rows reaching no row, and the bits of the bf16 Mosaic kernel (the same
    # skeleton and sums, interpreted) over the dequantized matrix; lax.ragged_dot over it sums
    # the inputs in another order on the CPU: its values.
    w = _matrix(nan_experts=(1, 4))
    x = _x(sum(SIZES) + 7, 256)
    sizes = jnp.asarray(SIZES, jnp.int32)
    got = np.asarray(mosaic_mxfp4_grouped_matmul(x, w, sizes, tiles=SMALL, interpret=True))
    assert np.isfinite(got).all() and (got[200:] == 0).all()
    assert_close(got[:200].astype(np.float64), quantized_reference(x, w, SIZES)[:200],
                 jnp.bfloat16)
    deq = w.dequantize()
    assert np.isnan(np.asarray(deq[1], np.float32)).all()
    bf16 = mosaic_bf16_grouped_matmul(x, deq, sizes, tiles=SMALL, interpret=True)
    np.testing.assert_array_equal(_u16(got), _u16(bf16))
    lax_path = grouped_matmul(x, deq, sizes, impl="lax")
    assert_close(got.astype(np.float64), np.asarray(lax_path, np.float64), jnp.bfloat16)


def _one_hot_case(dtype, lo, hi):
    """(x, w, sizes): expert 0 holds every byte (both nibbles: every code in each half) at
    exponents lo..hi, read back by 64 one-hot rows (x = identity), so the output is its
    weights; expert 1 has NaN scales and no rows."""
    k, n = 64, 128
    q = _every_code(n)
    s = np.linspace(lo, hi, 2 * n).round().astype(np.uint8).reshape(2, n)
    qs = np.stack([q, np.random.default_rng(1).integers(0, 256, (32, n), dtype=np.uint8)])
    ss = np.stack([s, np.full_like(s, 255)])
    w = QuantizedMatrix(jnp.asarray(qs), jnp.asarray(ss), "mxfp4", MXFP4_GROUP, (k, n),
                        np.dtype(dtype))
    return jnp.eye(k, dtype=dtype), w, jnp.asarray([k, 0], jnp.int32)


@pytest.mark.parametrize("dtype,lo,hi", [(jnp.bfloat16, 2, 252), (jnp.float16, 110, 140)])
def test_every_code_at_a_range_of_exponents_reads_as_dequantize_makes_it(dtype, lo, hi):
    # One-hot rows read the weights back exactly (each output one product by 1 and zeros):
    # every code in both nibble halves, exponents lo..hi (products finite and exact in the
    # dtype), the dequantize path's values (bits, but for zeros' signs: a sum from +0 is +0).
    x, w, sizes = _one_hot_case(dtype, lo, hi)
    got = mosaic_mxfp4_grouped_matmul(x, w, sizes, tiles=SMALL, interpret=True)
    _assert_weights(got, w)


def _assert_weights(got, w):
    """`got` [K, N] read back from expert 0 of `w` is its dequantized weights, value for
    value (NaN nowhere, -0 as +0)."""
    want = np.asarray(w.dequantize()[0], np.float32)
    got = np.asarray(got, np.float32)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_interpreted_kernel_at_narrow_tiles_and_two_programs_an_sm(dtype):
    # 192 columns: three 64-column tiles in bands of two (the last one tile), two programs an
    # SM, a 128-row tile; float16 too: the bf16 kernel's bits at the same tiling.
    tiles = MosaicTiles(128, 64, 64, 3, 2, 2)
    w = _random_matrix(5, 256, 192, seed=2, dtype=dtype)
    w = dataclasses.replace(w, scale=w.scale.at[jnp.asarray([1, 4])].set(255))
    x = _x(sum(SIZES) + 7, 256).astype(dtype)
    sizes = jnp.asarray(SIZES, jnp.int32)
    got = np.asarray(mosaic_mxfp4_grouped_matmul(x, w, sizes, tiles=tiles, interpret=True))
    assert np.isfinite(got).all() and (got[200:] == 0).all()
    want = mosaic_bf16_grouped_matmul(x, w.dequantize(), sizes, tiles=tiles, interpret=True)
    np.testing.assert_array_equal(_u16(got), _u16(want))
    assert_close(got[:200].astype(np.float64), quantized_reference(x, w, SIZES)[:200], dtype)


def test_what_the_kernel_reads_and_refuses():
    w = _matrix()
    assert mosaic_mxfp4_supports(w, MOSAIC_MXFP4_TILES)
    assert mosaic_mxfp4_supports(w, MOSAIC_MXFP4_NARROW_TILES)
    # a pack a step, one compute warpgroup, whole column tiles, bf16 or fp16, mxfp4 only
    for tiles in (MosaicTiles(block_k=128), MosaicTiles(block_k=32),
                  MosaicTiles(128, 128, 64, 2, 1, 1, 2), MosaicTiles(block_n=256)):
        assert not mosaic_mxfp4_supports(w, tiles), tiles
    assert not mosaic_mxfp4_supports(dataclasses.replace(w, dtype=np.dtype(np.float32)),
                                     MOSAIC_MXFP4_TILES)
    for kind in ("int4", "fp8"):
        assert not mosaic_mxfp4_supports(_other_matrix(kind), MOSAIC_MXFP4_TILES)
    # gpt-oss's 2880 columns (45 x 64): the narrow tiling; 128-column multiples the wide
    wide = _random_matrix(1, 2880, 2880)
    assert mxfp4_tiles_for(2880) == MOSAIC_MXFP4_NARROW_TILES
    assert mxfp4_tiles_for(768) == mxfp4_tiles_for(2048) == MOSAIC_MXFP4_TILES
    assert not mosaic_mxfp4_supports(wide, MOSAIC_MXFP4_TILES)
    assert mosaic_mxfp4_supports(wide, mxfp4_tiles_for(2880))
    assert not mosaic_mxfp4_supports(_random_matrix(1, 256, 96), mxfp4_tiles_for(96))
    sizes = jnp.asarray([8, 0, 0, 0, 0], jnp.int32)
    with pytest.raises(ValueError, match="mxfp4 in packs of 64, block_k 64"):
        mosaic_mxfp4_grouped_matmul(_x(8, 256), w, sizes, tiles=MosaicTiles(block_k=128))
    with pytest.raises(ValueError, match="int4 matrix .* cannot be read"):
        mosaic_mxfp4_grouped_matmul(_x(8, 256), _other_matrix("int4"), sizes)
    with pytest.raises(ValueError, match="x dtype float16 != the matrix's bfloat16"):
        mosaic_mxfp4_grouped_matmul(_x(8, 256).astype(jnp.float16), w, sizes)
    with pytest.raises(ValueError, match="group_sizes has shape"):
        mosaic_mxfp4_grouped_matmul(_x(8, 256), w, jnp.asarray([8], jnp.int32))
    with pytest.raises(ValueError, match=r"scale plane float32 \(5, 8, 128\), expected uint8"):
        mosaic_mxfp4_grouped_matmul(_x(8, 256), dataclasses.replace(
            w, scale=w.scale.astype(jnp.float32)), sizes)
    assert mosaic_mxfp4_grouped_matmul(_x(0, 256), w, sizes).shape == (0, 128)


def test_auto_and_fused_take_the_kernel_for_mxfp4_on_hopper():
    # On Hopper "auto" and "fused" read mxfp4 with the kernel where it tiles the matrix
    # (columns a multiple of 64; 0.54-0.63x dequantize-first's time at gpt-oss-120b's layer,
    # BENCHMARKS.md), "dequantize" dequantizes first; elsewhere every choice does.
    w = _matrix()
    for impl in (None, "auto", "fused"):
        assert resolve_quantized(impl, w, HOPPER) == "mosaic"
    assert resolve_quantized("dequantize", w, HOPPER) == "dequantize"
    assert resolve_quantized("fused", w, OTHER_GPU) == "dequantize"
    if jax.devices()[0].platform == "cpu":
        assert resolve_quantized("fused", w) == "dequantize"
    assert resolve_quantized("fused", _random_matrix(1, 256, 96), HOPPER) == "dequantize"
    # gpt-oss-120b's experts (2880 x 2880) and Qwen3-30B-A3B's shape, as formats
    for preset in ("gpt-oss-120b", "qwen3-30b-a3b"):
        c = get_preset(preset)
        fmt = ExpertFormat.make("mxfp4", c.hidden_size, c.expert_intermediate, jnp.bfloat16)
        assert resolve_format("fused", fmt, HOPPER) == "mosaic", preset
        assert resolve_format("auto", fmt, HOPPER) == "mosaic", preset
        assert resolve_format("fused", fmt, OTHER_GPU) == "dequantize", preset


def _lowered(k, n, tiles, dtype=jnp.bfloat16):
    w = _random_matrix(8, k, n, dtype=dtype)
    x = _x(1024, k).astype(dtype)
    f = jax.jit(lambda x, w, s: mosaic_mxfp4_grouped_matmul(x, w, s, tiles=tiles,
                                                            interpret=False, num_sms=132))
    return jax.export.export(f, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu")])(
            x, w, jnp.full((8,), 128, jnp.int32)).mlir_module()


@pytest.mark.parametrize("k,n,dtype", [
    (2880, 2880, jnp.bfloat16), (2048, 768, jnp.bfloat16), (768, 2048, jnp.bfloat16),
    pytest.param(2880, 2880, jnp.float16, marks=pytest.mark.slow)])
def test_kernel_lowers_for_cuda(k, n, dtype):
    # Mosaic's lowering for a GPU (layout inference, the byte layout's loads and the
    # relabelled registers included) runs on the CPU: gpt-oss's experts (2880 wide both ways,
    # the narrow tiling) and Qwen3-30B-A3B's. The codes reach float32 by bits: no
    # int-to-float op in the kernel's module (embedded in the program).
    text = _lowered(k, n, mxfp4_tiles_for(n), dtype)
    assert "mosaic_gpu" in text and "arith.shrui" in text
    assert "sitofp" not in text and "uitofp" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(2048, 768), (768, 2048), (2880, 2880)])
def test_kernel_gives_dequantize_then_matmul_bits_on_hopper(k, n):
    # "fused" reads the matrix with the kernel: the bits of the dequantized matrix through the
    # bf16 Mosaic kernel at the same tiling (this package's; jax's, which grouped_matmul takes
    # where 128-column tiles cover the matrix), the float64 reference's values, a layer in
    # pieces the whole's bits, float16 too; experts without rows hold NaN and are never read.
    if not is_hopper():
        pytest.skip("the Mosaic kernel needs a Hopper GPU")
    e = 8
    w = _matrix(e=e, k=k, n=n, nan_experts=(1, 3))
    sizes = jnp.asarray([300, 0, 1000, 0, 77, 129, 2, 500], jnp.int32)
    m = int(sizes.sum()) + 5
    x = _x(m, k)
    assert resolve_quantized("fused", w) == "mosaic"
    assert resolve_quantized(None, w) == "mosaic"  # auto reads mxfp4 with the kernel too
    tiles = mxfp4_tiles_for(n)
    got = grouped_matmul(x, w, sizes, quantized="fused")
    deq = w.dequantize()
    np.testing.assert_array_equal(_u16(got), _u16(mosaic_bf16_grouped_matmul(
        x, deq, sizes, tiles=tiles)))
    deq_path = grouped_matmul(x, w, sizes, quantized="dequantize")
    if n % 128 == 0:  # jax's kernel; 2880 columns are "tiled" (row tiles, XLA's dot)
        np.testing.assert_array_equal(_u16(got), _u16(deq_path))
    assert_close(np.asarray(got, np.float64), np.asarray(deq_path, np.float64), jnp.bfloat16)
    assert_close(np.asarray(got, np.float64), quantized_reference(x, w, sizes), jnp.bfloat16)
    assert (np.asarray(got)[m - 5:] == 0).all()
    bounds = row_pieces(m, 4)
    parts = [grouped_matmul(x[a:b], w, piece_group_sizes(sizes, a, b), quantized="fused")
             for a, b in itertools.pairwise(bounds)]
    np.testing.assert_array_equal(_u16(jnp.concatenate(parts)), _u16(got))
    w16, x16 = dataclasses.replace(w, dtype=np.dtype(np.float16)), x.astype(jnp.float16)
    np.testing.assert_array_equal(
        _u16(mosaic_mxfp4_grouped_matmul(x16, w16, sizes)),
        _u16(mosaic_bf16_grouped_matmul(x16, w16.dequantize(), sizes, tiles=tiles)))
    for other in (MOSAIC_MXFP4_NARROW_TILES, MosaicTiles(128, 128, 64, 4, 8, 1),
                  MosaicTiles(64, 64, 64, 2, 1, 1)):
        if mosaic_mxfp4_supports(w, other):
            np.testing.assert_array_equal(
                _u16(mosaic_mxfp4_grouped_matmul(x, w, sizes, tiles=other)),
                _u16(mosaic_bf16_grouped_matmul(x, deq, sizes, tiles=other)), str(other))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,lo,hi", [(jnp.bfloat16, 2, 252), (jnp.float16, 110, 140)])
def test_every_code_reads_as_dequantize_makes_it_on_hopper(dtype, lo, hi):
    # The one-hot read-back on the GPU, where the nibbles and scales come from each warp's
    # registers: every code in both halves, each weight the dequantize path's bits.
    if not is_hopper():
        pytest.skip("the Mosaic kernel needs a Hopper GPU")
    x, w, sizes = _one_hot_case(dtype, lo, hi)
    for tiles in (MOSAIC_MXFP4_TILES, MOSAIC_MXFP4_NARROW_TILES):
        _assert_weights(mosaic_mxfp4_grouped_matmul(x, w, sizes, tiles=tiles), w)


@pytest.mark.gpu
@pytest.mark.parametrize("e,k,n,tokens,top_k", [(128, 2880, 2880, 4096, 4),
                                                (2 * MANY_GROUPS, 256, 256, 1024, 10)])
def test_many_experts_give_dequantize_then_matmul_bits_on_hopper(e, k, n, tokens, top_k):
    # gpt-oss-120b's layer (128 experts of 2880 x 2880, top-4 of 4K tokens) and 512 small
    # experts: the bits of the bf16 Mosaic kernel at the same tiling over the dequantized
    # matrix, experts without rows (NaN scales) unread, rows past the groups zeros.
    if not is_hopper():
        pytest.skip("the Mosaic kernel needs a Hopper GPU")
    from strata_jax.benchmarks.grouped_matmul_bench import uniform_group_sizes

    sizes = uniform_group_sizes(tokens, e, top_k)
    sizes[[0, 7, e - 1]] = 0
    w = _random_matrix(e, k, n, seed=4)
    w = dataclasses.replace(w, scale=w.scale.at[jnp.asarray([0, 7, e - 1])].set(255))
    m = int(sizes.sum()) + 9
    x, sizes = _x(m, k), jnp.asarray(sizes)
    got = np.asarray(grouped_matmul(x, w, sizes, quantized="fused"))
    # Dequantized in one fused program: op by op, its float32 [E, K, N] temporary (4.2 GB at
    # gpt-oss's layer) outgrows a test worker's share of the card.
    dense = jax.jit(type(w).dequantize)(w)
    want = mosaic_bf16_grouped_matmul(x, dense, sizes, tiles=mxfp4_tiles_for(n))
    np.testing.assert_array_equal(got.view(np.uint16), _u16(want))
    assert np.isfinite(got).all() and (got[m - 9:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["gpt-oss-20b", "qwen3-30b-a3b"])
def test_model_reads_mxfp4_experts_through_the_kernel_with_dequantize_bits(preset):
    # A model with mxfp4 experts (128 wide, so the dequantize path's bf16 matmul is jax's
    # Mosaic kernel at the same tiles): quantized_matmul="fused" gives the bits of
    # "dequantize", resident and through the streamed arms; gpt-oss with its expert biases.
    from strata_jax.engine import Engine
    from strata_jax.kernels import Kernels
    from strata_jax.stream import StreamConfig, StreamTuning
    from strata_jax.synthetic import SyntheticParams
    from strata_jax.weights import QuantizedParams

    if not is_hopper():
        pytest.skip("the Mosaic kernel needs a Hopper GPU")
    plain = get_preset(preset).scaled(n_experts=8, top_k=2, hidden_size=128,
                                      expert_intermediate=128)
    cfg = plain.replace(expert_format="mxfp4", expert_block=32)
    fmt = ExpertFormat.of(cfg)
    planes = {p.name: jnp.zeros((cfg.n_experts, *p.shape), p.dtype) for p in fmt.planes}
    assert all(resolve_quantized("fused", w) == "mosaic" for w in fmt.expert_matrices(planes)[:3])
    params = QuantizedParams(SyntheticParams(plain, 3, 1.0), cfg)
    toks = np.random.default_rng(5).integers(0, cfg.vocab_size, 2048)
    got = {}
    for name, kernels, stream in (
            ("dequantize", Kernels(quantized_matmul="dequantize"), None),
            ("resident", Kernels(quantized_matmul="fused"), None),
            ("routed", Kernels(quantized_matmul="fused"), StreamConfig(
                routed=True, tuning=StreamTuning(layout="frames", tail_pieces=2, tail_from=16,
                                                 stream_floor=1))),
            ("stream-all", Kernels(quantized_matmul="fused"), StreamConfig(
                routed=False, tuning=StreamTuning(layout="packed")))):
        with Engine(cfg, params, stream, max_context=2048, chunk_size=2048,
                    kernels=kernels) as eng:
            r = eng.prefill(toks)
            got[name] = (r.logits_sha256(), r.kv_sha256())
    assert len(set(got.values())) == 1, got
