"""4-bit values two to a byte, in halves: the byte layout the int4 and mxfp4 expert formats share.

A run of `group` consecutive input rows (int4: a GPTQ group of 128; mxfp4: a pack of 64, two
32-input scale groups) is a [group/2, N] byte tile: byte row r holds row r of the run in its
low nibble and row group/2 + r in its high one, so each nibble half of a tile is a contiguous
run of rows (what a kernel unpacks with one shift, and for mxfp4 exactly one scale group).
`strata_jax.formats` re-exports both functions.
"""

from __future__ import annotations

import numpy as np

__all__ = ["int4_halves_np", "int4_values_np"]


def int4_halves_np(values: np.ndarray, group: int) -> np.ndarray:
    """4-bit values [..., K, N] (0..15) -> the int4 plane's bytes uint8 [..., K/2, N]: byte
    row r of group g holds row g*group + r in its low nibble, g*group + group/2 + r in its
    high one."""
    *lead, k, n = values.shape
    if k % group or group % 2:
        raise ValueError(f"int4 halves: {k} inputs are not whole groups of {group}")
    v = np.asarray(values, dtype=np.uint8).reshape(*lead, k // group, 2, group // 2, n)
    out = np.left_shift(v[..., 1, :, :], 4)
    np.bitwise_or(out, v[..., 0, :, :], out=out)
    return out.reshape(*lead, k // 2, n)


def int4_values_np(q: np.ndarray, group: int) -> np.ndarray:
    """The int4 plane's bytes uint8 [..., K/2, N] -> its 4-bit values uint8 [..., K, N]
    (`int4_halves_np` undone)."""
    q = np.asarray(q)
    *lead, k2, n = q.shape
    half = group // 2
    if k2 % half:
        raise ValueError(f"int4 plane of {k2} byte rows: not whole groups of {group}")
    b = q.reshape(*lead, k2 // half, 1, half, n)
    return np.concatenate([b & 15, b >> 4], axis=-3).reshape(*lead, 2 * k2, n)
