"""The Mosaic GPU grouped matmul over mxfp4 expert planes (Hopper): `kernels.mosaic`'s persistent
ragged kernel with each k step's e2m1 codes and e8m0 scales made into the step's weights (bf16 or
fp16) in registers, between their TMA load and the tensor-core product.

A k step is one pack of 64 inputs (`mxfp4.MXFP4_PACK`): the plane's [32, bn] byte tile, whose
low nibbles are the pack's first 32 inputs and high nibbles its last 32 (`formats`, mxfp4), and
the pack's two rows of the scale plane (one e8m0 exponent per 32 inputs and column):
    c = low nibble of byte row r (step row r < 32), high nibble of byte row r - 32 (r >= 32)
    w = dtype(FP4_VALUES[c] * 2**(s[r // 32, n0:n0+bn] - 127))                    registers
    w_smem[slot] = w;  acc += x[rows, k0:k0+64] @ w_smem[slot]                     wgmma, f32
FP4_VALUES[c] is made from the code's bits (`mxfp4_values_f32`: selects, shifts and a bitcast,
no int-to-float conversion), 2**(s - 127) from the exponent's (`e8m0_f32`: s << 23, with the
format's 0 and 255), and the float32 product is cast once: the weights are exactly
`QuantizedMatrix.dequantize`'s, and with the bf16 kernel's k step and rows the products
accumulate in its order, so the result has dequantize-then-matmul's bits (GPU tests).

The byte tile has 32 rows, the step's weights 64. In the products' layout (Mosaic's WGMMA: warp
w of the warpgroup holds rows 16w .. 16w + 15 of a 64-row tile) warps 0-1 hold the low-nibble
rows and warps 2-3 the high ones, of the same byte rows. So the bytes are loaded in a layout that
gives warps w and w + 2 the same registers (`BYTES_LAYOUT`: rows 16 (w % 2) ..), and those
registers, read as the step's [64, bn] in WGMMA, are the codes once each thread takes its
warp's nibble (`_pack_codes`); each thread's scales are likewise its warp's row of the two
(`_pack_scales`). In Pallas' Mosaic GPU interpret mode (the CPU tests) there are no layouts:
the two halves are concatenated instead, and the rest of the arithmetic is the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from strata_jax.formats import MXFP4_GROUP, MXFP4_PACK
from strata_jax.kernels.common import check_operands
from strata_jax.kernels.mosaic import MosaicTiles, _launch, _ragged_kernel

__all__ = ["MOSAIC_MXFP4_TILES", "MOSAIC_MXFP4_NARROW_TILES", "BYTES_LAYOUT", "e8m0_f32",
           "mosaic_mxfp4", "mosaic_mxfp4_grouped_matmul", "mosaic_mxfp4_supports",
           "mxfp4_tiles_for", "mxfp4_values_f32"]

# A k step of one pack (64 inputs, a [32, bn] byte tile and two scale rows): a program's shared
# memory at 3 stages (about 93 KB at 128 columns, 70 KB at 64) lets two programs share an SM, as
# int4's MOSAIC_INT4_TILES. Widths that are not whole 128-column tiles (gpt-oss's 2880 = 45 x 64)
# take 64-column tiles, their bands as many columns wide.
MOSAIC_MXFP4_TILES = MosaicTiles(128, 128, MXFP4_PACK, 3, 8, 2)
MOSAIC_MXFP4_NARROW_TILES = MosaicTiles(128, 64, MXFP4_PACK, 3, 16, 2)

_HALF = MXFP4_PACK // 2  # byte rows a step: a nibble half, one scale group
# [32, N] bytes with warps w and w + 2 holding the same registers: those of rows 16w .. 16w + 15
# of a [64, N] array in WGMMA, less 32 for w >= 2 (the test checks it against jax's layouts).
BYTES_LAYOUT = plgpu.Layout.TILED(
    fa.Tiling(((_HALF, 8), (16, 8), (8, 8), (2,))), warp_dims=(fa.Replicated(2), -7),
    lane_dims=(-3, -2), vector_dim=-1)


def mosaic_mxfp4_supports(w, tiles: MosaicTiles) -> bool:
    """Whether the mxfp4 Mosaic kernel reads quantized matrix `w` with `tiles`: mxfp4 (scale
    groups of 32, whole packs of 64 inputs), whole column tiles, read as bf16 or fp16; a tiling
    of one compute warpgroup and k steps of one pack (block_k 64)."""
    k, n = w.shape
    return (w.kind == "mxfp4" and w.block == MXFP4_GROUP and w.perm is None
            and tiles.compute_wgs == 1 and tiles.block_k == MXFP4_PACK
            and k % MXFP4_PACK == 0 and n % tiles.block_n == 0
            and jnp.dtype(w.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def mxfp4_tiles_for(n: int) -> MosaicTiles:
    """The mxfp4 tiling for matrices of `n` columns: MOSAIC_MXFP4_TILES where 128-column tiles
    cover them, else MOSAIC_MXFP4_NARROW_TILES."""
    return (MOSAIC_MXFP4_TILES if n % MOSAIC_MXFP4_TILES.block_n == 0
            else MOSAIC_MXFP4_NARROW_TILES)


def mxfp4_values_f32(c: jax.Array) -> jax.Array:
    """e2m1 codes `c` (int32, 0..15) as float32 `mxfp4.FP4_VALUES[c]`, from their bits: the
    magnitude m = c & 7 is 0 (+0), 1 (0.5: 0x3F000000) or from 2 on 2**(e - 1) (1 + f / 2)
    with e = m >> 1 and f = m & 1, whose bits are ((e + 126) << 23) | (f << 22) =
    (m << 22) + 0x3F000000; bit 3 is the sign (bit 31). No int-to-float conversion."""
    m = c & 7
    bits = jnp.where(m >= 2, (m << 22) + 0x3F000000, jnp.where(m == 1, 0x3F000000, 0))
    return lax.bitcast_convert_type(bits | ((c & 8) << 28), jnp.float32)


def e8m0_f32(s: jax.Array) -> jax.Array:
    """e8m0 exponents `s` (int32, 0..255) as float32 2**(s - 127) from their bits, as
    `mxfp4.e8m0_np`: s << 23, the subnormal 2**-127 (0x00400000) for 0, NaN (0x7FC00000) for
    255."""
    bits = jnp.where(s == 0, 0x00400000, jnp.where(s == 255, 0x7FC00000, s << 23))
    return lax.bitcast_convert_type(bits, jnp.float32)


def _high_warps() -> ir.Value:
    """i1: whether this thread's warp is the warpgroup's third or fourth (rows 32..63 of a
    64-row tile in WGMMA)."""
    i32 = ir.IntegerType.get_signless(32)
    warp = arith.remui(arith.divui(mgpu.utils.thread_idx(), mgpu.c(32, i32)), mgpu.c(4, i32))
    return arith.cmpi(arith.CmpIPredicate.uge, warp, mgpu.c(2, i32))


def _pack_codes(q: jax.Array, interpret: bool) -> jax.Array:
    """A pack's [32, bn] bytes -> its [64, bn] codes (uint8): rows 0..31 the low nibbles, rows
    32..63 the high ones. On the GPU the bytes arrive in BYTES_LAYOUT and come back in WGMMA,
    the same registers, each thread shifting by its warp's 0 or 4."""
    if interpret:
        return jnp.concatenate([q & 15, q >> 4], axis=0)
    rows, cols = q.shape

    @plgpu.inline_mgpu(arg_types=(BYTES_LAYOUT,), return_type=plgpu.ShapeDtypeStruct(
        (2 * rows, cols), jnp.uint8, layout=plgpu.Layout.WGMMA))
    def codes(ctx, qa):
        del ctx
        i8 = ir.IntegerType.get_signless(8)
        vec = ir.VectorType.get((BYTES_LAYOUT.to_mgpu().vector_length,), i8)
        shift = arith.select(_high_warps(), mgpu.c(4, i8), mgpu.c(0, i8))
        shift = vector.broadcast(vec, shift)
        mask = vector.broadcast(vec, mgpu.c(15, i8))
        out = np.empty(qa.registers.shape, dtype=object)
        for idx, reg in np.ndenumerate(qa.registers):
            out[idx] = arith.andi(arith.shrui(reg, shift), mask)
        return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=False)

    return codes(plgpu.layout_cast(q, BYTES_LAYOUT))


def _pack_scales(s0: jax.Array, s1: jax.Array, cols: int, interpret: bool) -> jax.Array:
    """A pack's two scale rows (float32 [bn] each) -> [64, bn]: rows 0..31 s0, rows 32..63 s1.
    On the GPU the rows arrive in WGMMA's column layout and come back in WGMMA, each thread
    taking its warp's row for its columns."""
    shape = (2 * _HALF, cols)
    if interpret:
        half = (_HALF, cols)
        return jnp.concatenate([lax.broadcast_in_dim(s0, half, (1,)),
                                lax.broadcast_in_dim(s1, half, (1,))], axis=0)
    column = plgpu.Layout.WGMMA.reduce(0)

    @plgpu.inline_mgpu(arg_types=(column, column), return_type=plgpu.ShapeDtypeStruct(
        shape, jnp.float32, layout=plgpu.Layout.WGMMA))
    def scales(ctx, a, b):
        del ctx
        high = _high_warps()
        layout = mgpu.WGMMA_LAYOUT
        out = np.empty(layout.registers_shape(shape), dtype=object)
        for idx in np.ndindex(out.shape):  # (row tile, column tile, .., row 8-block, ..)
            col = (idx[1], 0, 0)
            out[idx] = arith.select(high, b.registers[col], a.registers[col])
        return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)

    return scales(plgpu.layout_cast(s0, column), plgpu.layout_cast(s1, column))


def mosaic_mxfp4_grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, *,
                                tiles: MosaicTiles | None = None,
                                interpret: bool | None = None,
                                num_sms: int | None = None) -> jax.Array:
    """`kernels.mosaic.mosaic_grouped_matmul` for an mxfp4 matrix `w` (codes in pack halves,
    e8m0 exponents per 32 inputs): each k step TMA-loads one pack's [32, N-tile] byte tile and
    its two scale rows, makes the step's 64 rows of codes (low nibbles, then high) and their
    scales in registers, FP4_VALUES[code] * 2**(s - 127) in float32 cast to x.dtype, into the
    bf16 slot the step's wgmma reads. What `grouped_matmul` reads mxfp4 experts with on Hopper
    when asked to (`mosaic_mxfp4_supports`; tiles default `mxfp4_tiles_for` its width).

    Args:
        x: [M, K] in the matrix's dtype (bf16 or fp16), rows sorted by expert.
        w: the experts' matrix, uint8 [E, K/2, N] codes and uint8 [E, K/32, N] exponents.
        group_sizes: int32 [E], summing to at most M; rows past them come back as zeros.
        tiles: the tiling; it must satisfy `mosaic_mxfp4_supports`.
        interpret: run in Pallas' Mosaic GPU interpret mode (default: on a non-GPU backend).
        num_sms: the SMs to spread programs over (default: the device's).
    """
    m, k, n = check_operands("mosaic_mxfp4_grouped_matmul", x, w, group_sizes)
    tiles = tiles or mxfp4_tiles_for(n)
    if not mosaic_mxfp4_supports(w, tiles):
        raise ValueError(f"mosaic_mxfp4_grouped_matmul: {w.kind} matrix {w.shape} with block "
                         f"{w.block} in {jnp.dtype(w.dtype).name} cannot be read by {tiles} "
                         f"(mxfp4 in packs of {MXFP4_PACK}, block_k {MXFP4_PACK}, columns a "
                         "multiple of block_n, one compute warpgroup)")
    scale_shape = (w.q.shape[0], k // MXFP4_GROUP, n)
    if w.scale.dtype != jnp.uint8 or tuple(w.scale.shape) != scale_shape:
        raise ValueError(f"mosaic_mxfp4_grouped_matmul: scale plane {w.scale.dtype} "
                         f"{tuple(w.scale.shape)}, expected uint8 {scale_shape} (e8m0)")
    if m == 0:
        return jnp.zeros((0, n), x.dtype)
    interpret, num_sms = _launch(interpret, num_sms)
    bn = tiles.block_n
    dtype = x.dtype

    def convert(kk, gid, ni, q_ref, s_ref, w_slot):  # a step of one pack
        del kk, gid, ni
        codes = _pack_codes(q_ref[...], interpret).astype(jnp.int32)
        s0, s1 = (e8m0_f32(s_ref[i].astype(jnp.int32)) for i in range(2))
        w_slot[...] = (mxfp4_values_f32(codes) * _pack_scales(s0, s1, bn, interpret)
                       ).astype(dtype)

    specs = [plgpu.BlockSpec((_HALF, bn), lambda kk, ni: (kk, ni)),
             plgpu.BlockSpec((MXFP4_PACK // MXFP4_GROUP, bn), lambda kk, ni: (kk, ni))]
    with jax.named_scope("grouped_matmul_mxfp4_mosaic"):
        return _ragged_kernel(x, group_sizes, n, k, tiles, interpret, num_sms,
                              plane_specs=specs, pipelined=[w.q, w.scale], resident=[],
                              convert=convert)


# Through a jit of its own, a program lowers the kernel once per shape rather than once per
# call site, as `kernels.mosaic_int4.mosaic_int4` does.
@functools.partial(jax.jit, static_argnames=("tiles",))
def mosaic_mxfp4(x: jax.Array, w, group_sizes: jax.Array,
                 tiles: MosaicTiles | None = None) -> jax.Array:
    """`mosaic_mxfp4_grouped_matmul` at `tiles` (default `mxfp4_tiles_for` the matrix's
    width) on the device's SMs."""
    return mosaic_mxfp4_grouped_matmul(x, w, group_sizes, tiles=tiles, interpret=False)
