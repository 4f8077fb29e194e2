"""Mosaic GPU grouped matmuls over bf16 and fp8 expert planes (Hopper), fp8 dequantizing each
weight tile in registers between its TMA load and the tensor-core product.

The structure is a persistent ragged matmul: `per_sm` programs per SM walk the (visit, column
tile) pairs, where a visit is one (row tile, expert) pair with rows of that expert in the tile
(`kernels.common.group_metadata`); an expert with no rows owns no visit, so its weights are
never read (a streamed expert no token routes to may be stale). A visit's k steps run through a
TMA pipeline of `stages` buffers, and the rows it owns are stored by a ladder of power-of-two
row copies (a copy's row count must be static). Rows past the last expert are zeros, stored
by visits of their own (no pass over the output).

fp8 (`mosaic_grouped_matmul`), a k step (e4m3 values, one float32 scale per block x block):
    w = bf16(float32(q[k0:k0+bk, n0:n0+bn]) * scale[k0 // block, n0 // block])   registers
    w_smem[slot] = w;  acc += x[rows, k0:k0+bk] @ w_smem[slot]                    wgmma, f32
The weights come out exactly as `QuantizedMatrix.dequantize` makes them (one float32 product and
one cast), and with the rows and columns of the bf16 Mosaic kernel (`kernels.grouped.MOSAIC_*`)
the products accumulate in the same order (a step's wgmma adds its 16-input slices into the
float32 accumulator one after another, whatever the k step: 64 and 128 both give the bits), so
the result has the bits of dequantize-then-matmul (the GPU tests check it); the layer is never
written out in bf16. wgmma's B operand must be in shared memory, hence the two-slot bf16
buffer: step k writes slot k % 2, which step k - 2's product read, and each step waits for the
previous step's product before its buffers are released. Where experts hold many rows each, two
compute warpgroups share each converted tile (`MOSAIC_WIDE_TILES`, `fp8_tiles_for`).

bf16 (`mosaic_bf16_grouped_matmul`, the same skeleton without a conversion): each step's TMA-
loaded weight tile is wgmma's B operand as it lies. `grouped_matmul` takes it from MANY_GROUPS
groups (`bf16_tiles_for`), where jax's bf16 kernel finds each tile's group by a pass over every
group (its time grows with the groups: 7 / 21 / 37 TFLOP/s at 1K / 4K / 16K tokens of 512
experts of width 512, top-10, on the H200, against 60 / 177 / 321 here); the same bits.

int4 (`kernels.mosaic_int4`) and mxfp4 (`kernels.mosaic_mxfp4`): the same skeleton, a k step
half a scale group and one pack of 64 inputs.

On the CPU the kernels run in Pallas' Mosaic GPU interpret mode (tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from strata_jax.kernels.common import check_operands, group_metadata

try:  # Pallas' Mosaic GPU interpreter (interpret mode, the CPU tests): a private module of recent
    # jax, absent from jax 0.4.36, which pyproject accepts and on which the library must import.
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover - such a jax runs no Mosaic kernel at all
    InterpretGPUParams = None


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """The Mosaic kernels' tiling: rows and columns a tile, inputs a k step, pipeline stages,
    column tiles a row tile's sweep covers before moving on (`planar_snake`'s width),
    programs per SM (more than one where their shared memory fits beside each other), and
    compute warpgroups (2: two on the halves of a row tile, sharing each k step's weight
    tile, which fp8 converts once for both)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    grid_block_n: int = 2
    per_sm: int = 1
    compute_wgs: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MosaicTiles({name}={v}): a power of two, at least 16")
        if self.block_m % 64:
            raise ValueError(f"MosaicTiles(block_m={self.block_m}): a multiple of 64 (one "
                             "warpgroup's wgmma rows)")
        if min(self.stages, self.grid_block_n, self.per_sm) < 1:
            raise ValueError(f"MosaicTiles(stages={self.stages}, grid_block_n="
                             f"{self.grid_block_n}, per_sm={self.per_sm}): each at least 1")
        if self.compute_wgs not in (1, 2):
            raise ValueError(f"MosaicTiles(compute_wgs={self.compute_wgs}): 1 or 2")
        if self.compute_wgs == 2 and (self.block_m % 128 or self.block_k != 64
                                      or self.stages < 2 or self.per_sm != 1):
            raise ValueError(f"MosaicTiles(block_m={self.block_m}, block_k={self.block_k}, "
                             f"stages={self.stages}, per_sm={self.per_sm}, compute_wgs=2): two "
                             "compute warpgroups take half of block_m each (a multiple of 64) "
                             "and half the columns of a 64-input step, with a pipeline of at "
                             "least 2 stages, one program an SM")


# The tiling `grouped_matmul` reads fp8 experts with: the fastest of quant_matmul_bench's sweep on
# the H200 (BENCHMARKS.md, "Fused kernels"): rows and columns as the bf16 Mosaic kernel's, a
# k step of one scale block (128; four stages of it do not fit in shared memory).
MOSAIC_TILES = MosaicTiles(128, 128, 128, 3, 8, 1)

# Where experts hold many rows each: two compute warpgroups on the halves of a 256-row tile
# sharing each converted weight tile, which halves the weight conversions a product (the
# sweep's fastest at 256 and 512 rows an expert; at 64 most of a 256-row tile is empty and
# MOSAIC_TILES is faster). Same bits as MOSAIC_TILES: both are the dequantize path's.
MOSAIC_WIDE_TILES = MosaicTiles(256, 128, 64, 3, 8, 1, compute_wgs=2)
WIDE_FROM_ROWS_PER_GROUP = 256


# Many groups (512 experts, top-10: Qwen3-Next's) hold few rows each, so a 128-row tile is
# mostly empty and the kernel streams every expert's weights: 64-row tiles, two programs an SM
# (about 96 KB of shared memory each), so that one program's loads and stores overlap the
# other's steps. The sweep's fastest for every format below its row bounds (BENCHMARKS.md,
# "512 experts of width 512"); from MANY_GROUPS groups, so that the shapes of fewer, larger experts
# (Qwen3-30B-A3B's 128) keep the tilings measured for them.
MANY_GROUPS = 256
MOSAIC_SMALL_TILES = MosaicTiles(64, 128, 64, 3, 8, 2)
# fp8 from MANY_GROUPS groups of FP8_MANY_WIDE_FROM_ROWS_PER_GROUP rows or more: two compute
# warpgroups on 256-row tiles through four stages (the tile stored in 64-column quarters so
# that they fit), 0.89 / 0.83 / 0.93 of the time of MOSAIC_SMALL_TILES at 4K and 8K tokens of
# 512 experts and of MOSAIC_WIDE_TILES at 32K (BENCHMARKS.md).
FP8_MANY_WIDE_FROM_ROWS_PER_GROUP = 64
MOSAIC_FP8_MANY_TILES = MosaicTiles(256, 128, 64, 4, 8, 1, compute_wgs=2)


def fp8_tiles_for(m: int, groups: int, w=None) -> MosaicTiles:
    """The fp8 tiling for a grouped matmul of `m` rows over `groups` groups: the first that
    reads `w` (if given) of, from MANY_GROUPS groups, MOSAIC_FP8_MANY_TILES (from
    FP8_MANY_WIDE_FROM_ROWS_PER_GROUP rows a group on average) and MOSAIC_SMALL_TILES; below
    MANY_GROUPS, MOSAIC_WIDE_TILES (from WIDE_FROM_ROWS_PER_GROUP rows a group); else
    MOSAIC_TILES."""
    if groups >= MANY_GROUPS:
        order = ((MOSAIC_FP8_MANY_TILES, MOSAIC_SMALL_TILES)
                 if m >= FP8_MANY_WIDE_FROM_ROWS_PER_GROUP * groups else (MOSAIC_SMALL_TILES,))
    else:
        order = (MOSAIC_WIDE_TILES,) if m >= WIDE_FROM_ROWS_PER_GROUP * max(groups, 1) else ()
    for tiles in order:
        if w is None or mosaic_supports(w, tiles):
            return tiles
    return MOSAIC_TILES


# bf16 from MANY_GROUPS groups: the kernel of this module without a conversion, where the
# bf16 kernel of jax (`kernels.grouped`) finds each tile's group by a pass over all the groups
# (7.1 / 20.8 / 36.7 TFLOP/s at 1K / 4K / 16K tokens of 512 experts, against 60 / 177 / 321
# here). Below BF16_WIDE_FROM_ROWS_PER_GROUP rows a group, MOSAIC_SMALL_TILES; from it two
# compute warpgroups on the halves of a 128-row tile, 256 columns wide; from
# DEEP_FROM_ROWS_PER_GROUP the same through four stages (MOSAIC_BF16_DEEP_TILES: each step's
# loads issued two steps ahead of its product rather than one, the tile stored in two
# 128-column halves so that the stages fit), 0.91 / 0.94 of three stages' time at 16K / 32K
# tokens of 512 experts and 1.05 / 1.11 at 4K / 8K (BENCHMARKS.md).
BF16_WIDE_FROM_ROWS_PER_GROUP = 64
DEEP_FROM_ROWS_PER_GROUP = 256
MOSAIC_BF16_WIDE_TILES = MosaicTiles(128, 256, 64, 3, 8, 1, compute_wgs=2)
MOSAIC_BF16_DEEP_TILES = dataclasses.replace(MOSAIC_BF16_WIDE_TILES, stages=4)


def bf16_tiles_for(m: int, groups: int, k: int, n: int, dtype) -> MosaicTiles | None:
    """The tiling `mosaic_bf16_grouped_matmul` multiplies [m, k] rows over `groups` groups of
    [k, n] matrices in `dtype` with, or None where jax's bf16 kernel does (fewer than
    MANY_GROUPS groups, or a shape this kernel does not tile)."""
    if groups < MANY_GROUPS:
        return None
    if m < BF16_WIDE_FROM_ROWS_PER_GROUP * groups:
        order = (MOSAIC_SMALL_TILES, MOSAIC_BF16_WIDE_TILES)
    elif m < DEEP_FROM_ROWS_PER_GROUP * groups:
        order = (MOSAIC_BF16_WIDE_TILES,)
    else:
        order = (MOSAIC_BF16_DEEP_TILES,)
    if n % 256:
        order += (dataclasses.replace(MOSAIC_BF16_WIDE_TILES, block_n=128, stages=4),)
    for tiles in order:
        if mosaic_bf16_supports(k, n, dtype, tiles):
            return tiles
    return None


def mosaic_supports(w, tiles: MosaicTiles) -> bool:
    """Whether the fp8 Mosaic kernel reads quantized matrix `w` with `tiles`: fp8 whose k steps
    and column tiles lie inside one scale block (one scale a step), read as bf16 or fp16."""
    k, n = w.shape
    b = w.block
    return (w.kind == "fp8" and n % tiles.block_n == 0 and k % tiles.block_k == 0
            and b % tiles.block_k == 0 and b % tiles.block_n == 0
            and jnp.dtype(w.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def mosaic_grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, *,
                          tiles: MosaicTiles | None = None, interpret: bool | None = None,
                          num_sms: int | None = None) -> jax.Array:
    """Rows of x [M, K] sorted by expert times their expert's fp8 matrix `w` (a
    `QuantizedMatrix`) -> [M, N] in x.dtype, float32 accumulation, rows past the groups zero.

    Args:
        x: [M, K] in the matrix's dtype (bf16 or fp16).
        w: the experts' matrix, [E, K, N] e4m3 values and [E, K/b, N/b] float32 scales.
        group_sizes: int32 [E], summing to at most M.
        tiles: the tiling (default `MOSAIC_TILES`); it must satisfy `mosaic_supports`.
        interpret: run in Pallas' Mosaic GPU interpret mode (default: on a non-GPU backend).
        num_sms: the SMs to spread programs over (default: the device's).
    """
    tiles = tiles or MOSAIC_TILES
    m, k, n = check_operands("mosaic_grouped_matmul", x, w, group_sizes)
    if not mosaic_supports(w, tiles):
        raise ValueError(f"mosaic_grouped_matmul: {w.kind} matrix {w.shape} with block "
                         f"{w.block} in {jnp.dtype(w.dtype).name} cannot be read by {tiles}; "
                         "use grouped_matmul, which dequantizes such a matrix first")
    if m == 0:
        return jnp.zeros((0, n), x.dtype)
    interpret, num_sms = _launch(interpret, num_sms)
    bn, bk = tiles.block_n, tiles.block_k
    block = w.block
    dtype = x.dtype

    def convert(kk, gid, ni, q_smem, s_gmem, w_slot):
        scale = s_gmem[gid, (kk * bk) // block, (ni * bn) // block]
        w_slot[...] = (q_smem[...].astype(jnp.float32) * scale).astype(dtype)

    def convert_part(kk, gid, ni, wg, q_smem, s_gmem, w_slot):  # half the columns a warpgroup
        scale = s_gmem[gid, (kk * bk) // block, (ni * bn) // block]
        part = (slice(None), pl.ds(wg * (bn // 2), bn // 2))
        w_slot.at[part][...] = (q_smem.at[part][...].astype(jnp.float32) * scale).astype(dtype)

    specs = [plgpu.BlockSpec((bk, bn), lambda kk, ni: (kk, ni))]
    with jax.named_scope("grouped_matmul_fp8_mosaic"):
        if tiles.compute_wgs == 2:
            return _ragged_kernel_2wg(
                x, group_sizes, n, k, tiles, interpret, num_sms, plane_specs=specs,
                pipelined=[w.q], resident=[w.scale.astype(jnp.float32)],
                convert_part=convert_part)
        return _ragged_kernel(
            x, group_sizes, n, k, tiles, interpret, num_sms, plane_specs=specs,
            pipelined=[w.q], resident=[w.scale.astype(jnp.float32)], convert=convert)


def mosaic_bf16_supports(k: int, n: int, dtype, tiles: MosaicTiles) -> bool:
    """Whether the bf16 kernel (`mosaic_bf16_grouped_matmul`) multiplies [M, k] rows by
    [E, k, n] matrices of `dtype` with `tiles`: whole k steps and column tiles, bf16 or
    fp16."""
    return (k % tiles.block_k == 0 and n % tiles.block_n == 0
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def mosaic_bf16_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                               tiles: MosaicTiles, interpret: bool | None = None,
                               num_sms: int | None = None) -> jax.Array:
    """Rows of x [M, K] sorted by group times their group's matrix of w [E, K, N] (bf16 or
    fp16, x's dtype) -> [M, N], float32 accumulation, rows past the groups zero: the fp8
    kernel's skeleton (visits from `group_metadata`, so a group with no rows is never read
    and each program finds its visit in one load, however many groups) with each k step's
    TMA-loaded weight tile multiplied as it lies. What `grouped_matmul` reads plain experts
    with where `kernels.grouped.bf16_tiles_for` names a tiling (many small groups)."""
    m, k = x.shape
    e, k2, n = w.shape
    if k2 != k or group_sizes.shape != (e,) or x.dtype != w.dtype:
        raise ValueError(f"mosaic_bf16_grouped_matmul: x {x.shape} {x.dtype}, w {w.shape} "
                         f"{w.dtype}, group_sizes {group_sizes.shape}")
    if not mosaic_bf16_supports(k, n, x.dtype, tiles):
        raise ValueError(f"mosaic_bf16_grouped_matmul: [{k}, {n}] in "
                         f"{jnp.dtype(x.dtype).name} cannot be read by {tiles}")
    if m == 0:
        return jnp.zeros((0, n), x.dtype)
    interpret, num_sms = _launch(interpret, num_sms)
    specs = [plgpu.BlockSpec((tiles.block_k, tiles.block_n), lambda kk, ni: (kk, ni))]
    with jax.named_scope("grouped_matmul_bf16_mosaic"):
        if tiles.compute_wgs == 2:
            return _ragged_kernel_2wg(x, group_sizes, n, k, tiles, interpret, num_sms,
                                      plane_specs=specs, pipelined=[w], resident=[],
                                      convert_part=None)
        return _ragged_kernel(x, group_sizes, n, k, tiles, interpret, num_sms,
                              plane_specs=specs, pipelined=[w], resident=[], convert=None)


def _launch(interpret: bool | None, num_sms: int | None) -> tuple[bool, int]:
    """(interpret, num_sms): defaults interpret off a GPU, the device's SMs (interpreted: 2)."""
    if interpret is None:
        interpret = jax.devices()[0].platform != "gpu"
    if num_sms is None:
        num_sms = 2 if interpret else int(getattr(jax.devices()[0], "core_count", 0) or 132)
    return interpret, num_sms


def _row_tiles(x, group_sizes, bm: int):
    """(x padded to whole tiles of `bm` rows, the visits' `common.group_metadata`)."""
    m = x.shape[0]
    m_pad = -(-m // bm) * bm
    xp = jnp.pad(x, ((0, m_pad - m), (0, 0))) if m_pad != m else x
    return xp, group_metadata(group_sizes, m, bm)


def _each_visit(meta_ref, grid_m: int, grid_n: int, gbn: int, groups: int, visit, zeros):
    """Calls visit(expert, column tile, window's first row, its first row in the window, its
    rows) for the (visit, column tile) pairs this program takes, zeros(column tile, ...) for
    the rows past the groups (`group_metadata`'s group `groups`): each band of `gbn` column
    tiles swept one visit after another, so the programs working at once share a window's x
    (the last band may be narrower: planar_snake)."""
    @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
    def _tiles(info):
        mi, ni = plgpu.planar_snake(info.index[0], (grid_m, grid_n), 1, gbn)
        gid = meta_ref[0, mi]
        row0 = meta_ref[1, mi]
        lo = meta_ref[2, mi]
        rows = meta_ref[3, mi] - lo

        @pl.when((rows > 0) & (gid < groups))  # the visits past the last one hold no rows
        def _():
            visit(gid, ni, row0, lo - row0, rows)

        @pl.when((rows > 0) & (gid == groups))
        def _():
            zeros(ni, row0, lo - row0, rows)


def _rows8(row0):
    """A window's first row, a multiple of 8 (`common.group_metadata`'s windows start so), in
    a form Mosaic's lowering sees is one: an x tile's TMA load into swizzled shared memory
    starts on a whole 8-row swizzle tile."""
    return (row0 // 8) * 8


def _store_rows(o_smem, o_gmem, start, count, size: int, gmem_row0, cols) -> None:
    """Rows [start, start + count) of o_smem ([size, N tile]) to o_gmem's rows gmem_row0 +
    start ... at columns `cols`, as copies of power-of-two row counts (a copy's rows must be
    static), largest first; then waits until the copies have read o_smem."""
    left = size
    while left > 0:
        c = 1 << (left.bit_length() - 1)
        left //= 2

        @pl.when(count & c != 0)
        def _(start=start, c=c):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, c)],
                                    o_gmem.at[pl.ds(gmem_row0 + start, c), cols])

        start = start + (count & c)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _run_kernel(body, meta, xp, pipelined, resident, *, m: int, n: int, interpret: bool,
                **kernel_args):
    """`body` as a Mosaic GPU kernel (interpreted on the CPU) over the planes: [m, n] in x's
    dtype (the rows past the groups are stored as zeros by their own visits)."""
    if interpret:
        if InterpretGPUParams is None:
            raise RuntimeError(f"Mosaic GPU interpret mode: jax {jax.__version__} has no Mosaic "
                               "GPU interpreter; run the kernels on a Hopper GPU")
        kernel_args["interpret"] = InterpretGPUParams()
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((xp.shape[0], n), xp.dtype),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup), **kernel_args)
    out = kernel(meta, xp, *pipelined, *resident)
    return out[:m] if out.shape[0] != m else out


def _ragged_kernel(x, group_sizes, n: int, k: int, tiles: MosaicTiles, interpret: bool,
                   num_sms: int, *, plane_specs, pipelined, resident, convert):
    """The persistent ragged kernel both formats share: rows of x [M, K] sorted by group,
    times their group's matrix, read as `convert` makes it from the planes, [M, N] in
    x.dtype with the rows past the groups zero.

    pipelined: [E, ...] planes a k step reads through the TMA pipeline, each by its entry of
        `plane_specs` (index map (k step, column tile) -> block indices, in the plane's own
        rows); resident: [E, ...] planes the conversion reads straight from global memory.
    convert(kk, gid, ni, *pipelined step refs, *resident refs, w_slot): writes k step kk's
        [bk, bn] weights of group gid, column tile ni, in x.dtype into w_slot (shared memory),
        which the step then multiplies by its x tile with wgmma. A step's product runs on
        while the next step converts into the other of two slots; the x buffer is released a
        step late."""
    m = x.shape[0]
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    dtype = x.dtype
    xp, meta = _row_tiles(x, group_sizes, bm)
    grid_m, grid_n = meta.shape[1], n // bn
    gbn = min(tiles.grid_block_n, grid_n)
    n_pipe = len(pipelined)

    def body(meta_ref, x_gmem, *refs, w_smem=None):
        planes, o_gmem = refs[:-1], refs[-1]
        pipe_gmem, res_gmem = planes[:n_pipe], planes[n_pipe:]

        def visit(gid, ni, row0, first, rows):
            def acc_scope(acc_ref):
                def step(idx, x_smem, *plane_smem):
                    (kk,) = idx
                    if convert is None:  # bf16: the pipelined tile is the weights
                        plgpu.wgmma(acc_ref, x_smem, plane_smem[0])
                    else:
                        slot = lax.rem(kk, 2)
                        convert(kk, gid, ni, *plane_smem, *res_gmem, w_smem.at[slot])
                        plgpu.commit_smem()
                        plgpu.wgmma(acc_ref, x_smem, w_smem.at[slot])
                    # The previous step's product is done, so its x buffer (released after
                    # this step) and its weight slot (written next step) are free.
                    plgpu.wgmma_wait(1)

                # Without a conversion the product reads the plane's buffer itself, a step
                # past its own, as it reads x's.
                specs = [plgpu.BlockSpec(spec.block_shape,
                                         lambda kk, f=spec.index_map: f(kk, ni),
                                         delay_release=int(convert is None))
                         for spec in plane_specs]
                plgpu.emit_pipeline(
                    step, grid=(k // bk,),
                    in_specs=[plgpu.BlockSpec((pl.Element(bm), bk), lambda kk: (_rows8(row0), kk),
                                              delay_release=1), *specs],
                    max_concurrent_steps=tiles.stages)(
                        x_gmem, *(p.at[gid] for p in pipe_gmem))
                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

            store(acc.astype(dtype), ni, row0, first, rows)

        def store(tile, ni, row0, first, rows):
            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=dtype))
            def _store(o_smem):
                o_smem[...] = tile
                plgpu.commit_smem()
                _store_rows(o_smem, o_gmem, first, rows, bm, row0, pl.ds(ni * bn, bn))

        zeros = lambda ni, *rest: store(jnp.zeros((bm, bn), dtype), ni, *rest)  # noqa: E731

        _each_visit(meta_ref, grid_m, grid_n, gbn, pipelined[0].shape[0], visit, zeros)

    scratch = {} if convert is None else dict(w_smem=plgpu.SMEM((2, bk, bn), dtype))
    return _run_kernel(body, meta, xp, pipelined, resident, m=m, n=n, interpret=interpret,
                       grid=(num_sms * tiles.per_sm,), grid_names=("sm",), scratch_types=scratch)


def _ragged_kernel_2wg(x, group_sizes, n: int, k: int, tiles: MosaicTiles, interpret: bool,
                       num_sms: int, *, plane_specs, pipelined, resident, convert_part):
    """`_ragged_kernel` with two compute warpgroups and a memory one (`tiles.compute_wgs` 2):
    a row tile of `block_m` rows, each compute warpgroup multiplying its half of them, and one
    weight tile a k step for both, so each weight tile is loaded once per `block_m` rows and
    (fp8) converted once per `block_m` rows rather than per `block_m / 2`: the conversion's
    shared-memory reads and writes, what a fused step adds to the bf16 kernel's, spread over
    twice the products.

    A k step with a conversion: each compute warpgroup converts its part of the step's
    weights into the shared bf16 slot (`convert_part(kk, gid, ni, wg, *pipelined step refs,
    *resident refs, w_slot)`: half the columns), waits for its own previous product, fences,
    and meets the other at the slot's barrier; then each issues its product. A warpgroup
    passes step kk's barrier only after its product kk - 1 is done, so the slot step kk + 1
    writes (read by products kk - 1) is free: two slots. The x and plane buffers are released
    a step late (the product of step kk reads x until step kk + 1's wait). After its last
    product each warpgroup meets the other again (the next visit's first steps write the
    slots this one's last products read), then stores the visit's rows in its half, in column
    pieces where its whole [block_m / 2, block_n] tile does not fit beside the pipeline's
    buffers (`_store_columns`)."""
    m = x.shape[0]
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    hm = bm // 2
    dtype = x.dtype
    xp, meta = _row_tiles(x, group_sizes, bm)
    grid_m, grid_n = meta.shape[1], n // bn
    gbn = min(tiles.grid_block_n, grid_n)
    n_pipe = len(pipelined)
    step_bytes = sum(int(np.prod(spec.block_shape)) * p.dtype.itemsize
                     for spec, p in zip(plane_specs, pipelined)) + bm * bk * x.dtype.itemsize
    slot_bytes = 0 if convert_part is None else 2 * bk * bn * x.dtype.itemsize
    oc = _store_columns(tiles.stages * step_bytes + slot_bytes, bm, bn, x.dtype.itemsize)

    def pipeline(body, context, row0, ni):
        specs = [plgpu.BlockSpec(spec.block_shape, lambda kk, f=spec.index_map: f(kk, ni),
                                 delay_release=1) for spec in plane_specs]
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // bk,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((pl.Element(bm), bk), lambda kk: (_rows8(row0), kk),
                                      delay_release=1), *specs],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=tiles.stages,
            compute_context=context)

    def body(meta_ref, x_gmem, *refs):
        planes, o_gmem = refs[:-1], refs[-1]
        pipe_gmem, res_gmem = planes[:n_pipe], planes[n_pipe:]
        ignore = lambda *_, **__: None  # noqa: E731 - allocations do not depend on the body
        allocs = pipeline(ignore, ignore, 0, 0).get_allocations(
            x_gmem, *(p.at[0] for p in pipe_gmem))

        # bf16 (no conversion) has no converted slots to share, nor barriers over them
        slots = {} if convert_part is None else dict(
            w_smem=plgpu.SMEM((2, bk, bn), dtype),
            conv=plgpu.Barrier(num_arrivals=2, num_barriers=2),
            done=plgpu.Barrier(num_arrivals=2))

        @functools.partial(pl.run_scoped, allocs=allocs,
                           o_smem=plgpu.SMEM((2, hm, oc), dtype), **slots,
                           collective_axes="wg")
        def _scope(allocs, o_smem, w_smem=None, conv=None, done=None):
            wg = lax.axis_index("wg")

            def visit(gid, ni, row0, first, rows):
                # Whether this warpgroup's half of the tile holds rows of the visit (a tile
                # shared by several experts' rows is visited once per expert): if not, it
                # converts its share of each step but issues no product.
                mine = (first < (wg + 1) * hm) & (first + rows > wg * hm)

                def step(idx, x_smem, *rest):
                    *plane_smem, acc_ref = rest
                    (kk,) = idx
                    if convert_part is None:  # bf16: both halves read the pipelined tile
                        @pl.when(mine)
                        def _():
                            plgpu.wgmma(acc_ref, x_smem.at[pl.ds(wg * hm, hm)], plane_smem[0])

                        # this warpgroup's product kk - 1 is done: the buffers released
                        # after this step are free
                        plgpu.wgmma_wait(1)
                        return acc_ref
                    slot = lax.rem(kk, 2)
                    convert_part(kk, gid, ni, wg, *plane_smem, *res_gmem, w_smem.at[slot])
                    plgpu.wgmma_wait(0)  # this warpgroup's product kk - 1 is done
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(conv.at[slot])
                    plgpu.barrier_wait(conv.at[slot])

                    @pl.when(mine)
                    def _():
                        plgpu.wgmma(acc_ref, x_smem.at[pl.ds(wg * hm, hm)], w_smem.at[slot])

                    return acc_ref

                def context(run):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((hm, bn)))
                    def _acc(acc_ref):
                        run(acc_ref)
                        acc = acc_ref[...]  # this warpgroup's products are done
                        if convert_part is not None:
                            # and the other's: the next visit's first steps may write the
                            # slot this visit's last products read.
                            plgpu.barrier_arrive(done)
                            plgpu.barrier_wait(done)
                        for c in range(0, bn, oc):
                            part = acc if oc == bn else acc[:, c:c + oc]
                            store_part(part.astype(dtype), ni * bn + c, row0, first, rows)

                pipeline(step, context, row0, ni)(
                    x_gmem, *(p.at[gid] for p in pipe_gmem), allocations=allocs)

            def store_part(tile, col0, row0, first, rows):
                # This warpgroup's rows of the visit, [lo, hi) of its half, from `tile` (the
                # columns from col0).
                lo = jnp.clip(first - wg * hm, 0, hm)
                count = jnp.maximum(jnp.clip(first + rows - wg * hm, 0, hm) - lo, 0)
                out = o_smem.at[wg]
                out[...] = tile
                plgpu.commit_smem()
                _store_rows(out, o_gmem, lo, count, hm, row0 + wg * hm, pl.ds(col0, oc))

            def zeros(ni, row0, first, rows):  # each compute warpgroup its half's rows
                @pl.when(wg < 2)
                def _():
                    for c in range(0, bn, oc):
                        store_part(jnp.zeros((hm, oc), dtype), ni * bn + c, row0, first, rows)

            _each_visit(meta_ref, grid_m, grid_n, gbn, pipelined[0].shape[0], visit, zeros)

    return _run_kernel(body, meta, xp, pipelined, resident, m=m, n=n, interpret=interpret,
                       grid=(num_sms,), grid_names=("sm",), num_threads=3, thread_name="wg")


# Shared memory a program may hold (Hopper's opt-in limit per block, less a margin for the
# pipeline's barriers).
SMEM_LIMIT = 232448 - 2048


def _store_columns(pipeline_bytes: int, rows: int, bn: int, itemsize: int) -> int:
    """The columns of each copy the two-warpgroup kernel stores its tiles in: all `bn` where
    the `rows` x bn staging tile fits in shared memory beside the pipeline's buffers, else the
    largest power-of-two part of bn (at least 64) that does."""
    oc = bn
    while oc > 64 and pipeline_bytes + rows * oc * itemsize > SMEM_LIMIT:
        oc //= 2
    return oc


# Through a jit of its own, a program lowers the kernel once per shape rather than once per
# call site (three a MoE layer), as `grouped._mosaic_jit` does for the bf16 kernel.
@functools.partial(jax.jit, static_argnames=("tiles",))
def mosaic_fp8(x: jax.Array, w, group_sizes: jax.Array,
               tiles: MosaicTiles = MOSAIC_TILES) -> jax.Array:
    """`mosaic_grouped_matmul` at `tiles` (default `MOSAIC_TILES`) on the device's SMs."""
    return mosaic_grouped_matmul(x, w, group_sizes, tiles=tiles, interpret=False)


@functools.partial(jax.jit, static_argnames=("tiles",))
def mosaic_bf16(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                tiles: MosaicTiles) -> jax.Array:
    """`mosaic_bf16_grouped_matmul` at `tiles` on the device's SMs."""
    return mosaic_bf16_grouped_matmul(x, w, group_sizes, tiles=tiles, interpret=False)
