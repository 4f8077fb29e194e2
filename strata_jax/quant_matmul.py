"""Grouped matmul over quantized expert planes, dequantizing tiles inside the kernel.

`QuantizedMatrix` is one matrix of a layer's experts as its planes hold it (fp8: e4m3 values
and 128 x 128 block scales; int4: 4-bit values in group halves and group scales;
`strata_jax.formats`). The expert
math gets one for each of gate, up and down of a quantized format and hands it to
`grouped_matmul`, which either dequantizes the whole matrix to the parameter dtype first and
runs the bf16 grouped matmul ("dequantize"), or runs `fused_grouped_matmul` ("fused"): a Pallas
Triton kernel that reads the quantized tiles of the routed experts, converts each to bf16 in
registers and accumulates in float32 with the scale applied to each block's partial product.
The layer is never written out in bf16, so the fused path adds no pass over the weights.

The fused kernel (one program per (column block, visit)):
    rows are sorted by expert; a visit is one (row tile, expert) pair with rows of that expert
    in the tile (`group_metadata`): a tile that holds the end of one expert's rows and the start
    of the next is visited once per expert, each visit storing only its own rows. An expert with
    no rows owns no visit, so its weights are never read (streamed experts with no token may be
    stale or garbage). Rows past the last expert are zeros.

    fp8   acc += dot(x[:, kblk], bf16(q[kblk, nblk])) * scale[kblk, nblk]   (e4m3 is exact in
          bf16; with the column block inside one scale block the scale is one number a step)
    int4  acc += dot(x[:, group], bf16(q'[group, nblk] - 8)) * scale[group, nblk]  (one step a
          scale group; q' unpacks the group's [group / 2, BN] byte tile: its low nibbles are
          the group's first half of rows, its high nibbles the second)

The result equals dequantize-then-matmul up to float32 summation order (tests compare both with
the float64 reference within the dtype's tolerance); between the resident and streamed arms it
is the same kernel on the same bytes, so the same bits.

On the CPU the kernel runs in Pallas' interpret mode (tests); on a GPU through Triton.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FUSED_KINDS = ("fp8", "int4")
_INT4_ZERO = 8


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "scale", "zero", "perm"],
                   meta_fields=["kind", "block", "shape", "dtype"])
@dataclasses.dataclass(frozen=True)
class QuantizedMatrix:
    """One matrix of a layer's experts in a quantized format (`strata_jax.formats`).

    Attributes:
        q: fp8: float8_e4m3fn [E, K, N]; int4: uint8 [E, K/2, N] (each group's values in
            two nibble halves, `formats.int4_halves_np`).
        scale: fp8: float32 [E, ceil(K/b), ceil(N/b)]; int4: float16 [E, K/b, N].
        kind: "fp8" or "int4".
        block: fp8's scale block side, int4's group (b).
        shape: (K, N), the matrix's [in, out] shape.
        dtype: the dtype the expert math reads (`dequantize` gives it).
        zero: int4 with zero-points: uint8 [E, K/b, N], each group and column's zero-point
            (w = (q - zero) * scale); None: symmetric, the implicit 8 (and fp8).
        perm: int4 with act-order: int32 [E, K], the input row each stored row is (the rows
            stored in group order, `formats`): x @ w = x[:, perm] @ (the stored rows), which
            `grouped_matmul` reads as a plain int4 matrix (`in_stored_order`); None:
            stored row k is input row k.
    """

    q: jax.Array
    scale: jax.Array
    kind: str
    block: int
    shape: tuple[int, int]
    dtype: np.dtype
    zero: jax.Array | None = None
    perm: jax.Array | None = None

    def dequantize(self, dtype=None) -> jax.Array:
        """[E, K, N] in `dtype` (default `self.dtype`): each value one float32 product and one
        cast, as `ExpertFormat.dequantize` (which calls this); with `perm`, in input order."""
        return dequantize_matrix(self.kind, self.block, self.shape, self.q, self.scale,
                                 dtype or self.dtype, self.zero, self.perm)

    def stored(self) -> "QuantizedMatrix":
        """The matrix of the stored rows (without `perm`): what x[:, perm] multiplies."""
        return dataclasses.replace(self, perm=None)


def in_stored_order(x: jax.Array, w: QuantizedMatrix | jax.Array, group_sizes: jax.Array,
                    rows: jax.Array | None = None
                    ) -> tuple[jax.Array, QuantizedMatrix | jax.Array]:
    """(x, w) as every path reads them: for an act-order `w`, x [M, K] (rows sorted by
    group) with each row's columns in its group's stored order, out[j, i] = x[j, perm[g(j),
    i]] (rows past the groups take the last group's; their outputs are zeros anyway), and
    `w.stored()`; any other `w` as given.

    rows: None, or int32 [M], the row of x each output row is (x then holds the tokens,
    [T, K], and `rows` their sorted copies' tokens, `order // k`): out[j, i] = x[rows[j],
    perm[g(j), i]] in one gather, where `x[rows]` first would be a second pass over the
    [M, K] rows; x[rows] for any other `w`."""
    perm = w.perm if isinstance(w, QuantizedMatrix) else None
    if perm is None:
        return (x if rows is None else x[rows]), w
    m = x.shape[0] if rows is None else rows.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    group = jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right")
    group = jnp.minimum(group, perm.shape[0] - 1)
    cols = perm.astype(jnp.int32)[group]  # [M, K]
    with jax.named_scope("act_order_inputs"):
        if rows is None:
            return jnp.take_along_axis(x, cols, axis=1), w.stored()
        return x[rows.astype(jnp.int32)[:, None], cols], w.stored()


def dequantize_matrix(kind: str, block: int, shape: tuple[int, int], q: jax.Array,
                      scale: jax.Array, dtype, zero: jax.Array | None = None,
                      perm: jax.Array | None = None) -> jax.Array:
    """A quantized matrix's values in `dtype`: fp8 float(q) * scale[k // b, n // b]; int4
    (nibble - z) * scale[k // b, n], z the implicit 8 or `zero`[k // b, n], and with act-order
    stored row k put at input row `perm`[k]; one float32 product and one cast each."""
    k, n = shape
    s = scale.astype(jnp.float32)
    if kind == "fp8":
        s = jnp.repeat(jnp.repeat(s, block, axis=-2), block, axis=-1)[..., :k, :n]
        return (q.astype(jnp.float32) * s).astype(dtype)
    if kind != "int4":
        raise ValueError(f"quantized matrix kind {kind!r}: expected one of {FUSED_KINDS}")
    _check_int4_plane(q, shape, block)
    lead = q.shape[:-2]
    # [..., group, half, row of the half, column]: one elementwise fusion (shift, mask, product,
    # cast) with the group's scale broadcast, no concatenation of the halves.
    b = q.astype(jnp.int32).reshape(*lead, k // block, 1, block // 2, n)
    shift = jnp.asarray([0, 4], jnp.int32).reshape(2, 1, 1)
    z = (_INT4_ZERO if zero is None
         else zero.astype(jnp.int32).reshape(*lead, k // block, 1, 1, n))
    vals = ((b >> shift) & 15) - z
    s = s.reshape(*lead, k // block, 1, 1, n)
    w = (vals.astype(jnp.float32) * s).astype(dtype).reshape(*lead, k, n)
    if perm is None:
        return w
    inverse = jnp.argsort(perm.astype(jnp.int32), axis=-1)  # input row r is stored row inv[r]
    return jnp.take_along_axis(w, inverse[..., :, None], axis=-2)


def _check_int4_plane(q, shape: tuple[int, int], block: int) -> None:
    """A ValueError unless `q` is an int4 plane as the formats make it: uint8 [..., K/2, N],
    each group's values in two nibble halves (not GPTQ's int32 words)."""
    k, n = shape
    if np.dtype(q.dtype) != np.uint8 or tuple(q.shape[-2:]) != (k // 2, n):
        raise ValueError(
            f"int4 plane {np.dtype(q.dtype).name} {tuple(q.shape)}: expected uint8 "
            f"[..., {k // 2}, {n}] (each group of {block} values in two nibble halves); "
            "GPTQ's int32 words convert with strata_jax.formats.gptq_halves_np")


def dense(w):
    """`w` (a matrix or an ExpertWeights of them) with every QuantizedMatrix dequantized."""
    if isinstance(w, QuantizedMatrix):
        return w.dequantize()
    if isinstance(w, tuple) and hasattr(w, "_fields"):
        return type(w)(*(dense(a) for a in w))
    return w


# ---------------------------------------------------------------------------------------------
# Tiles.


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The fused kernel's tiling: rows a tile, columns a tile, Triton warps and stages, and
    for int4 how a group's byte tile unpacks ("tile": one [group, BN] tile and one dot a
    group; "split": its two [group / 2, BN] nibble halves, two dots)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    unpack: str = "tile"

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Tiles({name}={v}): a power of two, at least 16")
        if self.unpack not in ("tile", "split"):
            raise ValueError(f"Tiles(unpack={self.unpack!r}): expected 'tile' or 'split'")


# The Triton kernel's tiling for each kind: the fastest of quant_matmul_bench's sweep on the H200
# (BENCHMARKS.md, "Fused kernels").
TILES = {"fp8": Tiles(64, 128, 4, 3), "int4": Tiles(128, 128, 8, 3)}


def tiles_for(w: QuantizedMatrix) -> Tiles:
    """The Triton tiling for `w` (one per kind at every length): the kind's `TILES`, with
    columns a tile halved (down to 16) until they divide the matrix's N and, for fp8, its
    scale block."""
    t = TILES[w.kind]
    bn, n = t.block_n, w.shape[1]
    while bn > 16 and (n % bn or (w.kind == "fp8" and w.block % bn)):
        bn //= 2
    return dataclasses.replace(t, block_n=bn)


def resolve_quantized(impl: str | None, w: QuantizedMatrix,
                      device: jax.Device | None = None) -> str:
    """The kernel that reads `w` for `impl` (`Kernels.quantized_matmul`; None: auto):
    "mosaic" (`quant_mosaic`, fp8 and int4 on a Hopper GPU), "triton"
    (`fused_grouped_matmul`) or "dequantize" (the matrix to its dtype first, then the plain
    grouped matmul).

    auto: mosaic where it reads the matrix, but not int4 with zero-points (the kernel reading
    them is slower than dequantizing first: DESIGN.md, "int4 with zero-points"), else
    dequantize (the Triton kernel is slower than dequantize-then-matmul for int4 at every
    length measured); fused: mosaic where it reads the matrix, else triton, else dequantize.
    An act-order matrix (`perm`) resolves as its stored rows do: `grouped_matmul` reorders the
    inputs first."""
    from .grouped_matmul import is_hopper
    from .quant_mosaic import (MOSAIC_INT4_TILES, MOSAIC_TILES, mosaic_int4_supports,
                               mosaic_supports)

    impl = (impl or "auto").lower()
    if impl not in ("auto", "fused", "dequantize"):
        raise ValueError(f"quantized matmul {impl!r}: expected one of auto|fused|dequantize")
    if impl == "dequantize":
        return impl
    w = w.stored()
    device = device or jax.devices()[0]
    if is_hopper(device) and (mosaic_supports(w, MOSAIC_TILES)
                              or mosaic_int4_supports(w, MOSAIC_INT4_TILES)):
        if w.zero is None or impl == "fused":  # zero-points take the kernel only when asked for
            return "mosaic"
    if impl == "fused" and fused_supports(w, tiles_for(w)):
        return "triton"
    return "dequantize"


def resolve_format(impl: str | None, fmt, device: jax.Device | None = None) -> str | None:
    """`resolve_quantized` over the matrices of expert format `fmt` (a `formats.ExpertFormat`):
    "dequantize" if any of them is dequantized first, else the kernel that reads them
    ("mosaic" where it reads them all, else "triton"); None for a plain format (its planes
    are the weights)."""
    if fmt.kind == "plain":
        return None
    # A stand-in plane says the format has zero-points (what the path depends on).
    zero = np.zeros((0,), np.uint8) if getattr(fmt, "zero_points", False) else None
    paths = {resolve_quantized(impl, QuantizedMatrix(None, None, fmt.kind, fmt.block,
                                                     fmt.matrix_shape(m), fmt.dtype, zero),
                               device)
             for m in ("gate", "up", "down")}
    if "dequantize" in paths:
        return "dequantize"
    return "mosaic" if paths == {"mosaic"} else "triton"


def fused_supports(w: QuantizedMatrix, tiles: Tiles | None = None) -> bool:
    """Whether the fused kernel can tile `w` (else `grouped_matmul` dequantizes first): not
    int4 with zero-points, nor an act-order matrix (`grouped_matmul` hands it the stored
    rows)."""
    if w.kind not in FUSED_KINDS or w.zero is not None or w.perm is not None:
        return False
    k, n = w.shape
    t = tiles or TILES[w.kind]
    b = w.block
    if n % t.block_n:
        return False
    if w.kind == "fp8":
        # Row steps of min(b, 128), column blocks inside one scale block: one scale a step.
        bk = min(b, 128)
        return _pow2(bk) and bk >= 16 and b % bk == 0 and k % bk == 0 and b % t.block_n == 0
    return _pow2(b) and b >= 16 and k % b == 0 and (t.unpack == "tile" or b // 2 >= 16)


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def group_metadata(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """The kernel's visits for rows sorted by group: int32 [4, V] of (group, row tile, first
    row, end row) per visit, V = ceil(m / block_m) + G - 1 (an upper bound on the visits; the
    unused ones have first row == end row and do nothing).

    Group g with rows [start, end) visits each row tile that holds one of its rows, storing
    rows [max(start, tile start), min(end, tile end)). Groups with no rows have no visit."""
    g = group_sizes.shape[0]
    tiles = -(-m // block_m)
    v = max(tiles + g - 1, 1)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // block_m
    n_visits = jnp.where(sizes > 0, (ends - 1) // block_m - first + 1, 0)
    visit_end = jnp.cumsum(n_visits)
    visit_start = visit_end - n_visits
    i = jnp.arange(v, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(visit_end, i, side="right"), g - 1).astype(jnp.int32)
    valid = i < visit_end[-1]
    tile = first[group] + i - visit_start[group]
    lo = jnp.maximum(starts[group], tile * block_m)
    hi = jnp.minimum(ends[group], (tile + 1) * block_m)
    zero = jnp.zeros_like(i)
    return jnp.stack([jnp.where(valid, group, zero), jnp.where(valid, tile, zero),
                      jnp.where(valid, lo, zero), jnp.where(valid, hi, zero)]).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# The kernel.


def _kernel(meta_ref, x_ref, q_ref, s_ref, o_ref, *, kind, block, k, tiles, dot):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    bm, bn = tiles.block_m, tiles.block_n
    nb = pl.program_id(0)
    visit = pl.program_id(1)
    g = meta_ref[0, visit]
    row0 = meta_ref[1, visit] * bm
    lo = meta_ref[2, visit]
    hi = meta_ref[3, visit]
    n0 = nb * bn

    @pl.when(hi > lo)
    def _():
        if kind == "fp8":
            bk = min(block, 128)

            def step(i, acc):
                k0 = i * bk
                xt = x_ref[pl.ds(row0, bm), pl.ds(k0, bk)]
                wt = q_ref[g, pl.ds(k0, bk), pl.ds(n0, bn)].astype(xt.dtype)
                s = s_ref[g, k0 // block, n0 // block]
                return acc + dot(xt, wt) * s

            steps = k // bk
        else:
            half = block // 2

            def step(i, acc):
                k0 = i * block
                packed = q_ref[g, pl.ds(i * half, half), pl.ds(n0, bn)].astype(jnp.int32)
                s = s_ref[g, i, pl.ds(n0, bn)].astype(jnp.float32)[None, :]
                if tiles.unpack == "tile":
                    rep = jnp.broadcast_to(packed[None], (2, half, bn)).reshape(block, bn)
                    shift = (lax.broadcasted_iota(jnp.int32, (block, bn), 0) // half) * 4
                    wt = (((rep >> shift) & 15) - _INT4_ZERO).astype(x_ref.dtype)
                    part = dot(x_ref[pl.ds(row0, bm), pl.ds(k0, block)], wt)
                else:
                    part = jnp.zeros((bm, bn), jnp.float32)
                    for j in range(2):
                        wt = (((packed >> (4 * j)) & 15) - _INT4_ZERO).astype(x_ref.dtype)
                        part = part + dot(x_ref[pl.ds(row0, bm), pl.ds(k0 + j * half, half)],
                                          wt)
                return acc + part * s

            steps = k // block
        acc = lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), jnp.float32))
        rows = row0 + lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
        out = o_ref.at[pl.ds(row0, bm), pl.ds(n0, bn)]
        plt.store(out, acc.astype(o_ref.dtype), mask=(rows >= lo) & (rows < hi))


def fused_grouped_matmul(x: jax.Array, w: QuantizedMatrix, group_sizes: jax.Array, *,
                         tiles: Tiles | None = None, interpret: bool | None = None) -> jax.Array:
    """Rows of x [M, K] sorted by expert times their expert's quantized matrix -> [M, N] in
    x.dtype (float32 accumulation; rows past the groups are zeros).

    Args:
        x: [M, K] in the matrix's dtype (bf16 or fp16).
        w: the experts' matrix, [E, ...] planes (`QuantizedMatrix`).
        group_sizes: int32 [E], summing to at most M.
        tiles: the tiling (default `tiles_for`); it must satisfy `fused_supports`.
        interpret: run in Pallas' interpret mode (default: on a non-GPU backend).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    m, k, n = check_operands("fused_grouped_matmul", x, w, group_sizes)
    if w.zero is not None:
        raise ValueError("fused_grouped_matmul: an int4 matrix with zero-points is not read by "
                         "the Triton kernel; use grouped_matmul, which dequantizes it first")
    if w.perm is not None:
        raise ValueError("fused_grouped_matmul: an act-order matrix multiplies its inputs in "
                         "stored order; use grouped_matmul, which reorders them "
                         "(in_stored_order) and reads w.stored()")
    tiles = tiles or tiles_for(w)
    if not fused_supports(w, tiles):
        raise ValueError(f"fused_grouped_matmul: {w.kind} matrix {w.shape} with block "
                         f"{w.block} cannot be tiled by {tiles}; use grouped_matmul, which "
                         "dequantizes such a matrix first")
    if interpret is None:
        interpret = jax.devices()[0].platform != "gpu"
    if m == 0:
        return jnp.zeros((0, n), x.dtype)
    bm = tiles.block_m
    m_pad = -(-m // bm) * bm
    xp = x
    if m_pad != m:
        xp = jnp.pad(xp, ((0, m_pad - m), (0, 0)))
    meta = group_metadata(group_sizes, m, bm)
    dot = _interpret_dot if interpret else plt.dot
    kernel = functools.partial(_kernel, kind=w.kind, block=w.block, k=k, tiles=tiles, dot=dot)
    call = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m_pad, n), x.dtype),
        grid=(n // tiles.block_n, meta.shape[1]), interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(
            num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        name=f"grouped_matmul_{w.kind}")
    with jax.named_scope(f"grouped_matmul_{w.kind}"):
        out = call(meta, xp, w.q, w.scale)[:m]
        return zero_rows_past_groups(out, group_sizes)


def check_operands(name: str, x: jax.Array, w: QuantizedMatrix,
                   group_sizes: jax.Array) -> tuple[int, int, int]:
    """(M, K, N) of a grouped matmul of x [M, K] by `w`'s [E, K, N] with group_sizes [E];
    a ValueError naming `name` where the shapes disagree."""
    m, k = x.shape
    e = w.q.shape[0]
    n = w.shape[1]
    if (k, n) != tuple(w.shape):
        raise ValueError(f"{name}: x is [M, {k}] but the matrix is {w.shape}")
    if group_sizes.shape != (e,):
        raise ValueError(f"{name}: group_sizes has shape {group_sizes.shape}, expected ({e},)")
    if w.kind == "int4":
        _check_int4_plane(w.q, w.shape, w.block)
    return m, k, n


def zero_rows_past_groups(out: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`out` [M, N] with the rows past the last group zeroed: a ragged kernel never stores them
    (they belong to no group), so its output buffer holds whatever was there."""
    rows = jnp.arange(out.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, jnp.zeros((), out.dtype))


def _interpret_dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def fused_reference(x, w: QuantizedMatrix, group_sizes) -> np.ndarray:
    """NumPy float64: x times each group's matrix dequantized in float64 from its planes by the
    reference's published formulas (rows past the groups zero)."""
    from .grouped_matmul import grouped_matmul_reference
    from .reference import dequantized64

    deq = dequantized64(w.kind, w.block, w.shape, w.q, w.scale, w.zero, w.perm)
    return grouped_matmul_reference(np.asarray(x, np.float64), deq, group_sizes)
