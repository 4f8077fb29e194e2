"""Grouped matmul dispatch: rows sorted by group times one weight matrix per group.

Guards against the default `lax.ragged_dot` lowering on CUDA, which is a dense masked product over
every group (a small fraction of the dense rate, and out of memory at 32K tokens x top-8:
DESIGN.md), and against any path that lets a group with zero rows affect outputs (its weights may
be zeros or garbage when they were streamed).

Implementations, chosen by `Kernels.grouped_matmul` (auto|mosaic|lax|tiled, default auto; the
`impl` argument here):
    mosaic Pallas Mosaic GPU `ragged_dot` (Hopper only): only the tiles of each group are computed,
           a zero-size group owns no rows and stores nothing. Rows past the last group are never
           stored by the kernel and are zeroed afterwards. From `mosaic.MANY_GROUPS` groups
           (512 experts) the bf16 kernel of `kernels.mosaic` (`bf16_tiles_for`), which finds
           each tile's group in one load where jax's passes over every group; the same bits.
    lax    `lax.ragged_dot` (CPU, TPU). On CPU it lowers to a dense masked product that multiplies
           every group's weights by zeros, so NaN/Inf in an unrouted expert would leak (0 * NaN);
           the weights of zero-size groups are therefore replaced by zeros first. The routed rows
           see the same bits whatever the unrouted rows held.
    tiled  Portable fallback for non-Hopper GPUs: rows are laid out in row tiles of one group each
           and each tile is multiplied by its group's matrix in a `lax.map`. Zero-size groups own
           no tile. Slower than a fused kernel but memory-safe at any M.
"auto" picks mosaic on Hopper (device kind H100/H200/H800/GH200 or compute capability 9.x), tiled
on other GPUs and lax elsewhere.

A quantized matrix (`formats.QuantizedMatrix`, fp8, int4 or mxfp4 planes) is read as
`Kernels.quantized_matmul` resolves it (`kernels.quantized.resolve_quantized`): by the Mosaic
GPU kernels of `kernels.mosaic` (fp8), `kernels.mosaic_int4` and `kernels.mosaic_mxfp4` on
Hopper, or dequantized first and then multiplied as above.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import jax
import jax.numpy as jnp
from jax import lax

from strata_jax.formats import QuantizedMatrix
from strata_jax.kernels import GROUPED_MATMULS as IMPLEMENTATIONS
from strata_jax.kernels.common import is_hopper, zero_rows_past_groups
from strata_jax.kernels.mosaic import bf16_tiles_for, fp8_tiles_for, mosaic_bf16, mosaic_fp8
from strata_jax.kernels.mosaic_int4 import int4_tiles_for, mosaic_int4
from strata_jax.kernels.mosaic_mxfp4 import mosaic_mxfp4, mxfp4_tiles_for
from strata_jax.kernels.quantized import in_stored_order, resolve_quantized

__all__ = ["grouped_matmul", "resolve_implementation", "is_hopper", "row_pieces",
           "piece_group_sizes", "PIECE_SHAPES", "MOSAIC_BLOCK_M"]

# The Mosaic kernel's row block for MoE shapes (chosen by grouped_matmul_bench; BENCHMARKS.md).
MOSAIC_BLOCK_M = 128
MOSAIC_BLOCK_N = 128
MOSAIC_BLOCK_K = 64
MOSAIC_STAGES = 4
# Column tiles a row tile's sweep covers (at most; fewer where the matrix has fewer): wider bands
# read each x tile fewer times (grouped_matmul_bench --grid-block-n; BENCHMARKS.md).
MOSAIC_GRID_BLOCK_N = 8


def resolve_implementation(impl: str | None = None) -> str:
    """Returns the concrete implementation for `impl` (default "auto").

    Raises:
        ValueError: unknown name, or "mosaic" requested on a device that is not a Hopper GPU.
    """
    impl = (impl or "auto").lower()
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"grouped matmul {impl!r}: expected one of {'|'.join(IMPLEMENTATIONS)}")
    device = jax.devices()[0]
    if impl == "auto":
        if device.platform == "gpu":
            return "mosaic" if is_hopper(device) else "tiled"
        return "lax"
    if impl == "mosaic" and not is_hopper(device):
        raise ValueError(
            f"grouped matmul 'mosaic' needs a Hopper GPU, but the device is "
            f"{getattr(device, 'device_kind', device.platform)!r}; use 'tiled' or 'lax' "
            "(Kernels(grouped_matmul=...))")
    # "lax" on a GPU is allowed on request (tests compare against it) but never picked by "auto".
    return impl


def grouped_matmul(x: jax.Array, w: jax.Array | QuantizedMatrix, group_sizes: jax.Array, *,
                   impl: str | None = None, quantized: str | None = None,
                   tile_groups: int | None = None, group_offset: int = 0) -> jax.Array:
    """Multiplies row groups of `x` by their group's matrix.

    Args:
        x: [M, K] rows sorted by group: rows 0..group_sizes[0]-1 belong to group 0, and so on.
        w: [G, K, N] one matrix per group, same dtype as `x`; or a `QuantizedMatrix`
            (fp8/int4/mxfp4 planes) whose dtype is x's.
        group_sizes: int32 [G]; sum(group_sizes) <= M. Rows past the sum (padding, which the
            model routes to no group) come back as zeros in every implementation; rows inside the
            groups are the same whether or not such rows exist.
        impl: auto|mosaic|lax|tiled (`Kernels.grouped_matmul`); None: auto.
        quantized: for a QuantizedMatrix, auto|fused|dequantize (`Kernels.quantized_matmul`,
            `kernels.quantized.resolve_quantized`); None: auto.
        tile_groups, group_offset: `w` and `group_sizes` are groups group_offset ..
            group_offset + G - 1 of `tile_groups` (a layer's experts multiplied in parts,
            `layers.moe.MoE.experts_part`): each row gets the bits the whole layer's matmul
            gives it. The Mosaic kernels take the whole layer's tiling; "lax", whose CPU
            lowering contracts every group's rows in one dot (its summation blocks depend on
            the group's place), the groups at their place among zeros.

    Returns:
        [M, N] in `x.dtype`, accumulated in float32.
    """
    if isinstance(w, QuantizedMatrix):
        if w.dtype != x.dtype:
            raise ValueError(f"grouped_matmul: x dtype {x.dtype} != the quantized matrix's "
                             f"dtype {w.dtype}")
        x, w = in_stored_order(x, w, group_sizes)  # act-order: x's columns in stored order
        path = resolve_quantized(quantized, w)
        groups = tile_groups or group_sizes.shape[0]
        if path == "mosaic":
            if w.kind == "mxfp4":
                return mosaic_mxfp4(x, w, group_sizes.astype(jnp.int32),
                                    tiles=mxfp4_tiles_for(w.shape[1]))
            if w.kind == "int4":
                tiles = int4_tiles_for(x.shape[0], groups)
                return mosaic_int4(x, w, group_sizes.astype(jnp.int32), tiles=tiles)
            tiles = fp8_tiles_for(x.shape[0], groups, w)
            return mosaic_fp8(x, w, group_sizes.astype(jnp.int32), tiles=tiles)
        with jax.named_scope("dequantize"):
            w = w.dequantize()
    m, k = x.shape
    g, k2, n = w.shape
    if k != k2:
        raise ValueError(f"grouped_matmul: x is [M, {k}] but w is [G, {k2}, N]")
    if group_sizes.shape != (g,):
        raise ValueError(f"grouped_matmul: group_sizes has shape {group_sizes.shape}, expected ({g},)")
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_matmul: x dtype {x.dtype} != w dtype {w.dtype}")
    group_sizes = group_sizes.astype(jnp.int32)
    impl = resolve_implementation(impl)
    if m == 0:
        return jnp.zeros((0, n), x.dtype)
    if impl == "mosaic":
        tiles = bf16_tiles_for(m, tile_groups or g, k, n, x.dtype)  # many: kernels.mosaic's
        if tiles is not None:
            return mosaic_bf16(x, w, group_sizes, tiles=tiles)
        if _mosaic_supports(k, n, x.dtype):
            return _mosaic_jit(x, w, group_sizes)
        impl = "tiled"  # shape the kernel cannot tile: stay memory-safe.
    if impl == "tiled":
        return _tiled(x, w, group_sizes, groups=tile_groups)
    if tile_groups and tile_groups != g:  # the whole layer's groups, zeros around these
        after = tile_groups - group_offset - g
        if group_offset < 0 or after < 0:
            raise ValueError(f"grouped_matmul: groups {group_offset}..{group_offset + g - 1} "
                             f"are not among {tile_groups}")
        w = jnp.pad(w, ((group_offset, after), (0, 0), (0, 0)))
        group_sizes = jnp.pad(group_sizes, (group_offset, after))
    return _lax(x, w, group_sizes)


PIECE_SHAPES = ("equal", "halving")


def row_pieces(m: int, pieces: int, align: int = MOSAIC_BLOCK_M,
               shape: str = "equal") -> tuple[int, ...]:
    """Static bounds that cut M sorted rows into `pieces` ranges, each boundary a multiple of
    `align` (the Mosaic kernel's row tile, so no piece pads a tile) where the smallest piece
    gets at least one such tile (M holds `pieces` of them for "equal", 2^(pieces-1) for
    "halving"), else anywhere. Returns (0, b1, ..., M) with no empty range: fewer pieces
    where M is too small.

    shape: "equal" (about M / pieces rows each) or "halving" (each piece half the one
    before, the last two equal: 1/2, 1/4, ..., 1/2^(pieces-1), 1/2^(pieces-1) of M; boundary
    p at M (1 - 2^-p)), so that the last piece, whose math follows the chunk's last copy, is
    the smallest (`StreamTuning.tail_shape`)."""
    if m < 0 or pieces < 1:
        raise ValueError(f"row_pieces: m={m}, pieces={pieces}; need m >= 0 and pieces >= 1")
    if shape not in PIECE_SHAPES:
        raise ValueError(f"row_pieces: shape={shape!r}; expected one of {PIECE_SHAPES}")
    smallest = 2 ** (pieces - 1) if shape == "halving" else pieces
    if m < align * smallest:
        align = 1
    bounds = [0]
    for p in range(1, pieces):
        if shape == "equal":
            b = round(m * p / pieces / align) * align
        else:
            b = round(m * (1 - 0.5 ** p) / align) * align
        if bounds[-1] < b < m:
            bounds.append(b)
    bounds.append(m)
    return tuple(bounds)


def piece_group_sizes(group_sizes: jax.Array, begin: int, end: int) -> jax.Array:
    """Each group's rows inside the sorted-row range [begin, end): the group sizes for a
    grouped matmul of x[begin:end]. Every row of the range keeps its group, so that matmul
    computes the same rows the whole one would (row by row, the same bits: tests check it),
    and rows of the range past the last group come back as zeros as before."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    return (jnp.clip(ends, begin, end) - jnp.clip(starts, begin, end)).astype(jnp.int32)


def _lax(x, w, group_sizes):
    with jax.named_scope("grouped_matmul_lax"):
        # Zero-size groups are multiplied by zero rows in the dense lowering: sanitise them so their
        # content (zeros, stale data, NaN) cannot reach the output.
        w = jnp.where((group_sizes > 0)[:, None, None], w, jnp.zeros((), w.dtype))
        return lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)


def _tiled(x, w, group_sizes, tile: int = 128, batch: int = 8, groups: int | None = None):
    """Row tiles of one group each, one small matmul per tile; `groups`: the tiles as for
    that many groups (`grouped_matmul`'s tile_groups: the same batches of tiles, the same
    bits, as the whole layer's call)."""
    with jax.named_scope("grouped_matmul_tiled"):
        m, k = x.shape
        g, _, n = w.shape
        tile = min(tile, max(8, 1 << (m - 1).bit_length()))
        n_tiles = -(-m // tile) + max(g, groups or g)  # a group adds at most a partial tile
        padded_sizes = -(-group_sizes // tile) * tile  # [G]
        starts = jnp.cumsum(group_sizes) - group_sizes  # [G] exclusive
        padded_ends = jnp.cumsum(padded_sizes)  # [G]
        padded_starts = padded_ends - padded_sizes

        # Padded slot p -> (group, source row); slots past the last group are invalid.
        p = jnp.arange(n_tiles * tile, dtype=jnp.int32)  # [P]
        group_of = jnp.minimum(jnp.searchsorted(padded_ends, p, side="right"), g - 1)  # [P]
        offset = p - padded_starts[group_of]
        valid = (offset < group_sizes[group_of]) & (p < padded_ends[-1])
        src = jnp.where(valid, starts[group_of] + offset, 0)
        xp = jnp.where(valid[:, None], x[src], jnp.zeros((), x.dtype))  # [P, K]
        xp = xp.reshape(n_tiles, tile, k)  # [n_tiles, tile, K]
        tile_group = group_of[::tile]  # [n_tiles]

        def one_tile(args):
            xt, gt = args
            return jnp.dot(xt, w[gt], preferred_element_type=jnp.float32).astype(x.dtype)

        out = lax.map(one_tile, (xp, tile_group), batch_size=batch)  # [n_tiles, tile, N]
        out = out.reshape(n_tiles * tile, n)

        # Row i (sorted) -> its padded slot.
        i = jnp.arange(m, dtype=jnp.int32)
        ends = jnp.cumsum(group_sizes)
        gi = jnp.minimum(jnp.searchsorted(ends, i, side="right"), g - 1)
        row_valid = i < ends[-1]
        slot = jnp.where(row_valid, padded_starts[gi] + (i - starts[gi]), 0)
        return jnp.where(row_valid[:, None], out[slot], jnp.zeros((), x.dtype))


# Imported on first use, not at the top: the bf16 kernel's module is part of recent jax only
# (jax 0.4.36, which pyproject accepts, has none), and the library must import without it.
@functools.cache
def _mosaic_module():
    try:
        return importlib.import_module("jax.experimental.pallas.ops.gpu.ragged_dot_mgpu")
    except Exception as e:  # noqa: BLE001 - any import failure means the kernel is unusable.
        raise RuntimeError(
            "the Mosaic GPU ragged_dot kernel (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu) "
            f"cannot be imported with jax {jax.__version__}: {e}; use "
            "Kernels(grouped_matmul='tiled')") from e


def _mosaic_supports(k: int, n: int, dtype) -> bool:
    return (k % MOSAIC_BLOCK_K == 0 and n % MOSAIC_BLOCK_N == 0
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def _mosaic(x, w, group_sizes, grid_block_n: int | None = None, block_k: int | None = None,
            stages: int | None = None):
    """The bf16 Mosaic kernel; grid_block_n: its column bands, at most that many column tiles
    (None: MOSAIC_GRID_BLOCK_N), the last band narrower where it does not divide them;
    block_k and stages: its k step and pipeline depth (None: MOSAIC_BLOCK_K, MOSAIC_STAGES).
    grouped_matmul_bench --grid-block-n / --block-k / --stages time the others."""
    with jax.named_scope("grouped_matmul_mosaic"):
        module = _mosaic_module()
        m, _ = x.shape
        n = w.shape[2]
        # The kernel tiles M by block_m; zero rows past the groups belong to no group and are
        # sliced off, so no expert's weights are read for them.
        pad = (-m) % MOSAIC_BLOCK_M
        if pad:
            x = jnp.pad(x, ((0, pad), (0, 0)))
        if grid_block_n is None:
            grid_block_n = MOSAIC_GRID_BLOCK_N
        grid_block_n = max(1, min(grid_block_n, -(-n // MOSAIC_BLOCK_N)))
        kwargs = dict(group_sizes=group_sizes, block_m=MOSAIC_BLOCK_M, block_n=MOSAIC_BLOCK_N,
                      block_k=block_k or MOSAIC_BLOCK_K,
                      max_concurrent_steps=stages or MOSAIC_STAGES,
                      grid_block_n=grid_block_n)
        accepted = inspect.signature(module.ragged_dot).parameters
        out = module.ragged_dot(x, w, **{k: v for k, v in kwargs.items() if k in accepted})
        out = out[:m] if pad else out
        # The kernel never stores rows past the last group (their tiles own no rows), so those
        # rows of its output buffer are uninitialised: zero them, as lax and tiled do.
        return zero_rows_past_groups(out, group_sizes)


# Through a jit of its own, a program lowers the kernel once per shape rather than once per call
# site (a model calls it three times per MoE layer): lowering a Mosaic kernel takes about half a
# second of Python, 12 s per program for eight layers otherwise. Same HLO inside, same bits.
_mosaic_jit = jax.jit(_mosaic, static_argnames=("grid_block_n", "block_k", "stages"))

