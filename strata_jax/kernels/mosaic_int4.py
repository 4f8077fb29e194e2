"""The Mosaic GPU grouped matmul over int4 expert planes (Hopper): `kernels.mosaic`'s persistent
ragged skeleton, dequantizing each weight tile in registers between its TMA load and the
tensor-core product.

int4 (`mosaic_int4_grouped_matmul`, the same skeleton): a scale group of 128 inputs is the
plane's [64, bn] byte tile whose low nibbles are the group's first 64 rows and high nibbles its
last 64 (the int4 format stores GPTQ's values that way, `formats.int4_halves_np`: a 16-row tile
of GPTQ's words has no layout Mosaic can infer), plus the group's float16 scale row (and
zero-point row). A k step is half a group, one nibble half of the byte tile (loaded for each):
    v = int32(byte);  w = bf16(float32((v & 15) - z) * scale[g, n0:n0+bn])   (even steps)
                      w = bf16(float32((v >> 4) - z) * scale[g, n0:n0+bn])   (odd steps)
    w_smem[slot] = w;  acc += x[rows, k0:k0+64] @ w_smem[slot]                  wgmma, f32
with z the implicit 8 or the column's zero-point, made two ways (`int4_conversion`):
    bf16x2  bf16 inputs over float16 scales: two values an instruction in bf16. Each thread
            reads four adjacent columns' bytes in one register (Mosaic's WGMMA_UPCAST_2X
            layout), a byte permute and a mask put two nibbles under bf16's exponent of 128,
            and with the scale split before the kernel into two bf16 planes, hi + lo == scale
            exactly (`split_scale_bf16`):
                v = (128 + n) - (128 + z);  w = fma(v, hi, v * lo)       bf16x2, inline PTX
            v * lo is exact and the FMA rounds once, so w is the float32 product's cast.
    bits    otherwise: the bytes upcast to int32 in the products' layout (Mosaic does only
            bitwise operations on 8-bit vectors), (n - z) as float32 from 2^23 + n's bit pattern
            less 2^23 + z (`int4_values_f32`: a logical op and an add, no int-to-float
            conversion), times the scale row laid out as a column vector of that layout.
Either way the weights come out as the dequantize path's, so the result has its bits too (GPU
tests).

On the CPU the kernel runs in Pallas' Mosaic GPU interpret mode (tests), where there are no
layouts and both conversions run the float32 arithmetic of "bits" (the same values).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from strata_jax.kernels.common import check_operands
from strata_jax.kernels.mosaic import (
    MANY_GROUPS, MOSAIC_SMALL_TILES, MosaicTiles, _launch, _ragged_kernel
)

# int4: a scale group of 128 inputs is a 64-row byte tile holding the group's first half in its
# low nibbles and its second half in its high nibbles (the int4 plane's layout). A k step is half
# a group (64 inputs, one nibble half; the byte tile is loaded for each) so that a program's
# shared memory (about 104 KB at 3 stages) lets two programs share an SM: one converts its
# weights while the other's products run, which is what the one-warpgroup kernel cannot overlap
# by itself (the sweep's fastest at 4K and 8K tokens of Qwen3-30B-A3B; BENCHMARKS.md, "Fused
# kernels").
INT4_GROUP = 128
MOSAIC_INT4_TILES = MosaicTiles(128, 128, INT4_GROUP // 2, 3, 8, 2)

# From MANY_GROUPS groups of fewer than this many rows a group on average, MOSAIC_SMALL_TILES.
INT4_SMALL_BELOW_ROWS_PER_GROUP = 48


def int4_tiles_for(m: int, groups: int) -> MosaicTiles:
    """The int4 tiling for a grouped matmul of `m` rows over `groups` groups:
    MOSAIC_SMALL_TILES from MANY_GROUPS groups of fewer than INT4_SMALL_BELOW_ROWS_PER_GROUP
    rows on average, else MOSAIC_INT4_TILES (every int4 matrix the kernel reads with one
    it reads with the other: both have k steps of half a group)."""
    if groups >= MANY_GROUPS and m < INT4_SMALL_BELOW_ROWS_PER_GROUP * groups:
        return MOSAIC_SMALL_TILES
    return MOSAIC_INT4_TILES


def mosaic_int4_supports(w, tiles: MosaicTiles) -> bool:
    """Whether the int4 Mosaic kernel reads quantized matrix `w` with `tiles`: int4 in groups
    of 128, symmetric or with a zero-point plane, rows in groups k // 128 (an act-order
    matrix's stored rows, `QuantizedMatrix.stored`), whole column tiles, read as bf16 or
    fp16; a tiling of one compute warpgroup and k steps of half a group (block_k 64)."""
    k, n = w.shape
    return (w.kind == "int4" and w.block == INT4_GROUP and w.perm is None
            and tiles.compute_wgs == 1 and tiles.block_k == INT4_GROUP // 2
            and k % INT4_GROUP == 0 and n % tiles.block_n == 0
            and jnp.dtype(w.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def int4_conversion(dtype, scale_dtype=jnp.float16) -> str:
    """How the int4 kernel makes (nibble - z) times the scale for inputs of `dtype` over group
    scales of `scale_dtype`: "bf16x2" for bf16 inputs over float16 scales (the format's; the
    scale's split into two bf16 planes is exact only for them), else "bits"."""
    if (jnp.dtype(dtype) == jnp.bfloat16 and jnp.dtype(scale_dtype) == jnp.float16):
        return "bf16x2"
    return "bits"


def int4_values_f32(n: jax.Array) -> jax.Array:
    """Nibbles `n` (int32, 0..15) as float32 (n - 8), exactly ("bits"): 2^23 + n from its bit
    pattern, less 2^23 + 8 (a logical op and a float add, not an int-to-float conversion,
    which runs at a fraction of their rate)."""
    return lax.bitcast_convert_type(n | 0x4B000000, jnp.float32) - 8388616.0


def split_scale_bf16(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 scales `s` (float16 values: 11 significant bits) as (hi, lo) in bfloat16 with
    hi + lo == s exactly: hi is s cut to bf16's 8 bits toward zero, lo the rest (at most 3
    significant bits, a multiple of s's last bit below 8 of them) with s's sign also where
    it is zero. (n - z) * lo is then exact in bf16 for a nibble n and zero-point z, so
    fma(n - z, hi, (n - z) * lo) in bf16 rounds (n - z) * s once: the float32 product's cast,
    the dequantize path's bits, zero's sign included ("bf16x2"; the tests check every finite
    float16 scale)."""
    bits = lax.bitcast_convert_type(s, jnp.int32)
    hi = lax.bitcast_convert_type(bits & jnp.int32(-65536), jnp.float32)
    lo = lax.bitcast_convert_type(
        lax.bitcast_convert_type(s - hi, jnp.int32) | (bits & jnp.int32(-2147483648)),
        jnp.float32)
    return hi.astype(jnp.bfloat16), lo.astype(jnp.bfloat16)


def _bf16x2_nibbles(q, s_hi, s_lo, zmag, high: bool, layout):
    """The nibble half `high` of bytes q (uint8 [rows, cols] in `layout`, Mosaic's
    WGMMA_UPCAST_2X: four adjacent columns' bytes in one 32-bit register) times its columns'
    scales, as bf16 [rows, cols] in the same layout, two values an instruction (inline PTX,
    sm_90): a byte permute puts two nibbles in the low bits of a register's halves, a mask
    sets bf16's exponent of 128 over them (128 + n), less 128 + z (exact), then
    t = v * s_lo (exact) and fma(v, s_hi, t), rounded once. s_hi, s_lo: the columns'
    `split_scale_bf16`; zmag: 128 + z per column (bf16), or None for the symmetric format's
    8; all three broadcast over the rows in `layout`."""
    def asm(part: int) -> str:  # the register's column pair `part` (0: columns 0, 1)
        sel = ("0x4140", "0x4342")[part]  # bytes 2p, 2p + 1 to the halves' low bytes
        return f"""{{
        .reg .b32 z, w, t, m, v, p, c;
        mov.b32 z, 0;
        {"shr.b32 w, $1, 4;" if high else "mov.b32 w, $1;"}
        prmt.b32 t, w, z, {sel};
        lop3.b32 m, t, 0x000F000F, 0x43004300, 0xea;
        {"sub.bf16x2 v, m, $4;" if zmag is not None else
         "mov.b32 c, 0x43084308; sub.bf16x2 v, m, c;"}
        mul.rn.bf16x2 p, v, $3;
        fma.rn.bf16x2 $0, v, $2, p;
        }}"""

    args = (q, s_hi, s_lo) if zmag is None else (q, s_hi, s_lo, zmag)

    @plgpu.inline_mgpu(arg_types=(layout,) * len(args),
                       return_type=plgpu.ShapeDtypeStruct(q.shape, jnp.bfloat16, layout=layout))
    def convert(ctx, qa, *cols):
        del ctx
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        out = np.empty(qa.registers.shape, dtype=object)
        for idx, reg in np.ndenumerate(qa.registers):
            word = utils.bitcast(reg, i32)  # four bytes
            halves = []
            for part in (0, 1):
                ins = [word, *(utils.bitcast(utils.vector_slice(c.registers[idx],
                                                                slice(2 * part, 2 * part + 2)),
                                             i32) for c in cols)]
                r = llvm.inline_asm(i32, ins, asm(part), "=r" + ",r" * len(ins))
                halves.append(utils.bitcast(r, pair))
            out[idx] = utils.vector_concat(halves)
        return mgpu.FragmentedArray(_registers=out, _layout=qa.layout, _is_signed=None)

    return convert(*args)


def mosaic_int4_grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, *,
                               tiles: MosaicTiles | None = None, interpret: bool | None = None,
                               num_sms: int | None = None) -> jax.Array:
    """`mosaic_grouped_matmul` for an int4 matrix `w` (group halves, float16 group scales,
    symmetric or with a zero-point plane): each k step TMA-loads one group's [64, N-tile] byte
    tile and its scale row (and zero-point row), unpacks the step's nibble half in registers,
    (nibble - z) times the scale as the float32 product's cast to x.dtype (z the implicit 8
    or the column's zero-point), into the bf16 slot the step's wgmma reads: by bf16 steps or
    by float32 bits (`int4_conversion`), the same values either way. What `grouped_matmul`
    reads int4 experts with on Hopper (`mosaic_int4_supports`; tiles default
    `MOSAIC_INT4_TILES`)."""
    tiles = tiles or MOSAIC_INT4_TILES
    m, k, n = check_operands("mosaic_int4_grouped_matmul", x, w, group_sizes)
    if not mosaic_int4_supports(w, tiles):
        raise ValueError(f"mosaic_int4_grouped_matmul: {w.kind} matrix {w.shape} with block "
                         f"{w.block} in {jnp.dtype(w.dtype).name} cannot be read by {tiles} "
                         f"(int4 in groups of {INT4_GROUP}, block_k {INT4_GROUP // 2}, one "
                         "compute warpgroup)")
    if m == 0:
        return jnp.zeros((0, n), x.dtype)
    interpret, num_sms = _launch(interpret, num_sms)
    conversion = int4_conversion(x.dtype, w.scale.dtype)
    half = INT4_GROUP // 2
    bn = tiles.block_n
    dtype = x.dtype
    zeros = w.zero is not None
    # bf16x2 reads four bytes a thread (WGMMA_UPCAST_2X) and computes in that layout; bits
    # reads the bytes in the products' layout. The interpreter has no layouts.
    layout = (plgpu.Layout.WGMMA_UPCAST_2X if conversion == "bf16x2" else
              plgpu.Layout.WGMMA)
    packed = conversion == "bf16x2" and not interpret  # the interpreter: "bits"' values

    def column(row, shape):  # a [cols] row of the step, broadcast over its rows
        if not interpret:
            row = plgpu.layout_cast(row, layout.reduce(0))
        return lax.broadcast_in_dim(row, shape, (1,))

    def packed_operands(q_ref, hi_ref, lo_ref, z_ref=None):
        """(bytes, (scale hi, scale lo), 128 + zero-point or None) of a step for "bf16x2"
        from its rows of the planes made before the kernel: the bytes four a thread, the
        rest bf16 per column, broadcast over the rows."""
        q = plgpu.layout_cast(q_ref[...], layout)
        s = (column(hi_ref[0], q.shape), column(lo_ref[0], q.shape))
        return q, s, None if z_ref is None else column(z_ref[0], q.shape)

    def float_operands(q_ref, s_ref, z_ref=None):
        """(values, scale, zero) of a step for "bits": the bytes upcast before the logical
        ops [64, cols]; the group's scale per column in float32; with zero-points 2^23 + z
        per column (what the nibbles' float32 are less by; exact), else None."""
        q = q_ref[...].astype(jnp.int32)
        s = column(s_ref[0].astype(jnp.float32), q.shape)
        if z_ref is None:
            return q, s, None
        z = z_ref[0].astype(jnp.int32).astype(jnp.float32)
        return q, s, column(z + 8388608.0, q.shape)

    operands = packed_operands if packed else float_operands

    def nibbles(q, s, z, high: bool):
        if packed:
            return _bf16x2_nibbles(q, *s, z, high, layout)
        n = (q >> 4) if high else (q & 15)
        if z is None:
            v = int4_values_f32(n)
        else:
            v = lax.bitcast_convert_type(n | 0x4B000000, jnp.float32) - z
        return (v * s).astype(dtype)

    def convert(kk, gid, ni, *refs):  # a step of 64 inputs: the group's half kk % 2
        del gid, ni
        *planes, w_slot = refs
        q, s, z = operands(*planes)

        @pl.when(lax.rem(kk, 2) == 0)
        def _():
            w_slot[...] = nibbles(q, s, z, False)

        @pl.when(lax.rem(kk, 2) == 1)
        def _():
            w_slot[...] = nibbles(q, s, z, True)

    row_spec = plgpu.BlockSpec((1, bn), lambda kk, ni: (kk // 2, ni))
    specs = [plgpu.BlockSpec((half, bn), lambda kk, ni: (kk // 2, ni)), row_spec]
    if packed:  # the scales split (and 128 + z) once, in bf16, for every step's rows
        hi, lo = split_scale_bf16(w.scale.astype(jnp.float32))
        pipelined = [w.q, hi, lo]
        specs.append(row_spec)
        if zeros:
            specs.append(row_spec)
            pipelined.append((w.zero.astype(jnp.float32) + 128.0).astype(jnp.bfloat16))
    else:
        pipelined = [w.q, w.scale]
        if zeros:  # the zero-point row of the step's group, as its scale row
            specs.append(row_spec)
            pipelined.append(w.zero)
    with jax.named_scope("grouped_matmul_int4_mosaic"):
        return _ragged_kernel(
            x, group_sizes, n, k, tiles, interpret, num_sms, plane_specs=specs,
            pipelined=pipelined, resident=[], convert=convert)


@functools.partial(jax.jit, static_argnames=("tiles",))
def mosaic_int4(x: jax.Array, w, group_sizes: jax.Array,
                tiles: MosaicTiles = MOSAIC_INT4_TILES) -> jax.Array:
    """`mosaic_int4_grouped_matmul` at `tiles` (default `MOSAIC_INT4_TILES`) on the device's
    SMs."""
    return mosaic_int4_grouped_matmul(x, w, group_sizes, tiles=tiles, interpret=False)
