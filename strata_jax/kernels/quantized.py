"""How a grouped matmul reads quantized expert planes: the Mosaic GPU kernel or dequantize-first.

`QuantizedMatrix` (`strata_jax.formats`) is one matrix of a layer's experts as its planes hold it
(fp8: e4m3 values and 128 x 128 block scales; int4: 4-bit values in group halves and group
scales, optionally zero-points and an act-order permutation; mxfp4: e2m1 codes in pack halves
and e8m0 exponents per 32 inputs). The expert math hands one for
each of gate, up and down to `kernels.grouped.grouped_matmul`, which reads it one of two ways,
chosen here from `Kernels.quantized_matmul` and the device (`resolve_quantized`):

    mosaic      the Hopper Mosaic GPU kernels (`kernels.mosaic`, fp8; `kernels.mosaic_int4`;
                `kernels.mosaic_mxfp4`): each weight tile is dequantized in registers
                between its load and the tensor-core product, so the layer is never written
                out in bf16. They give dequantize's bits.
    dequantize  the whole matrix to the parameter dtype first (`QuantizedMatrix.dequantize`),
                then the bf16 grouped matmul.

An act-order matrix (`perm`) is read as its stored rows with each row's inputs gathered into
stored order first (`in_stored_order`), by either path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.formats import QuantizedMatrix
from strata_jax.kernels import QUANTIZED_MATMULS
from strata_jax.kernels.common import is_hopper
from strata_jax.kernels.mosaic import MOSAIC_TILES, mosaic_supports
from strata_jax.kernels.mosaic_int4 import MOSAIC_INT4_TILES, mosaic_int4_supports
from strata_jax.kernels.mosaic_mxfp4 import mosaic_mxfp4_supports, mxfp4_tiles_for

__all__ = ["in_stored_order", "resolve_quantized", "resolve_format"]


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


def resolve_quantized(impl: str | None, w: QuantizedMatrix,
                      device: jax.Device | None = None) -> str:
    """The path that reads `w` for `impl` (`Kernels.quantized_matmul`; None: auto): "mosaic"
    (on a Hopper GPU: `kernels.mosaic` for fp8, `kernels.mosaic_int4` and
    `kernels.mosaic_mxfp4`) or "dequantize" (the matrix to its dtype first, then the plain
    grouped matmul; any matrix no kernel reads).

    fused: mosaic where a kernel reads the matrix, else dequantize. auto: the same, but int4
    with zero-points dequantizes (the kernel reading them is slower than dequantizing first:
    DESIGN.md, "int4 with zero-points"). An act-order matrix (`perm`) resolves as its stored
    rows do: `grouped_matmul` reorders the inputs first."""
    impl = (impl or "auto").lower()
    if impl not in QUANTIZED_MATMULS:
        raise ValueError(f"quantized matmul {impl!r}: expected one of "
                         f"{'|'.join(QUANTIZED_MATMULS)}")
    if impl == "dequantize":
        return impl
    w = w.stored()
    device = device or jax.devices()[0]
    if not is_hopper(device):
        return "dequantize"
    if mosaic_supports(w, MOSAIC_TILES) or mosaic_int4_supports(w, MOSAIC_INT4_TILES):
        if w.zero is None or impl == "fused":  # zero-points take the kernel only when asked for
            return "mosaic"
    if mosaic_mxfp4_supports(w, mxfp4_tiles_for(w.shape[1])):
        return "mosaic"
    return "dequantize"


def resolve_format(impl: str | None, fmt, device: jax.Device | None = None) -> str | None:
    """`resolve_quantized` over the matrices of expert format `fmt` (a `formats.ExpertFormat`):
    "dequantize" if any of them is dequantized first, else "mosaic"; None for a plain format
    (its planes are the weights)."""
    if fmt.kind == "plain":
        return None
    # A stand-in plane says the format has zero-points (what the path depends on).
    zero = np.zeros((0,), np.uint8) if getattr(fmt, "zero_points", False) else None
    paths = {resolve_quantized(impl, QuantizedMatrix(None, None, fmt.kind, fmt.block,
                                                     fmt.matrix_shape(m), fmt.dtype, zero),
                               device)
             for m in ("gate", "up", "down")}
    return "dequantize" if "dequantize" in paths else "mosaic"
