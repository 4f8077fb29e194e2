"""What the grouped-matmul kernels share: the device test, a ragged kernel's visits, operand
checks, and the zeroing of rows past the groups.

The kernels package imports in one direction: `common` (and `strata_jax.formats`) below
`mosaic`, `mosaic` below `mosaic_mxfp4`, both below `quantized`, and `grouped` over all of them
(pyproject.toml's import-linter contracts); nothing in it imports anything else of strata_jax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.formats import check_int4_plane, check_mxfp4_plane

_HOPPER_KINDS = ("H100", "H200", "H800", "GH200")


def is_hopper(device: jax.Device | None = None) -> bool:
    """Whether `device` (default: the first default-backend device) is an NVIDIA Hopper GPU."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return False
    kind = getattr(device, "device_kind", "") or ""
    if any(k in kind for k in _HOPPER_KINDS):
        return True
    capability = str(getattr(device, "compute_capability", "") or "")
    return capability.startswith("9.")


def group_metadata(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """A ragged kernel's visits for rows sorted by group: int32 [4, V] of (group, the first
    row of the visit's window of `block_m` rows, its first row, its end row) per visit,
    V = ceil((m + 7 (G + 1)) / block_m) + G (an upper bound on the visits; the unused ones
    have first row == end row and do nothing).

    Group g's windows start at its own rows: w_j = s8 + j * block_m, s8 the multiple of 8 at
    or below its first row (a window starts on a whole 8-row tile of the TMA load), storing
    rows [max(start, w_j), min(end, w_j + block_m)): ceil((r + start % 8) / block_m) visits for
    its r rows, never more than the fixed row tiles its rows touch, and at a handful of rows
    a group (512 experts, top-10) up to 40% fewer. A window past the rows padded to whole
    tiles, [0, ceil(m / block_m) * block_m), is moved back to end there (it still holds its
    rows). A window may hold rows of other groups: they are loaded and multiplied, not stored.

    The rows past the last group, [sum(group_sizes), m), are group G's: visits that store
    zeros (the kernel reads no weights for them), so the output needs no pass of its own to
    zero them. Groups with no rows have no visit, so their weights are never read (a streamed
    expert no token routes to may be stale or garbage)."""
    g = group_sizes.shape[0]
    tiles = -(-m // block_m)
    # sum_g ceil(a_g) <= ceil(sum_g a_g) + G, a_g = (r_g + 7) / block_m over G + 1 groups
    v = max(-(-(m + 7 * (g + 1)) // block_m) + g, 1)
    sizes = group_sizes.astype(jnp.int32)
    sizes = jnp.concatenate([sizes, jnp.maximum(m - jnp.sum(sizes), 0)[None]])
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts - starts % 8
    n_visits = jnp.where(sizes > 0, -(-(ends - first) // block_m), 0)
    visit_end = jnp.cumsum(n_visits)
    visit_start = visit_end - n_visits
    i = jnp.arange(v, dtype=jnp.int32)
    # one [V, G + 1] comparison (a single fusion), not a loop of binary-search steps
    group = jnp.minimum(jnp.searchsorted(visit_end, i, side="right", method="compare_all"),
                        g).astype(jnp.int32)
    valid = i < visit_end[-1]
    window = first[group] + (i - visit_start[group]) * block_m
    lo = jnp.maximum(starts[group], window)
    hi = jnp.minimum(ends[group], window + block_m)
    row0 = jnp.minimum(window, (tiles - 1) * block_m)
    zero = jnp.zeros_like(i)
    return jnp.stack([jnp.where(valid, group, zero), jnp.where(valid, row0, zero),
                      jnp.where(valid, lo, zero), jnp.where(valid, hi, zero)]).astype(jnp.int32)


def check_operands(name: str, x: jax.Array, w, group_sizes: jax.Array) -> tuple[int, int, int]:
    """(M, K, N) of a grouped matmul of x [M, K] by quantized matrix `w`'s [E, K, N]
    (`formats.QuantizedMatrix`) with group_sizes [E]; a ValueError naming `name` where the
    shapes disagree, x is not in the matrix's dtype, or an int4 or mxfp4 plane is not the
    format's."""
    m, k = x.shape
    e = w.q.shape[0]
    n = w.shape[1]
    if (k, n) != tuple(w.shape):
        raise ValueError(f"{name}: x is [M, {k}] but the matrix is {w.shape}")
    if group_sizes.shape != (e,):
        raise ValueError(f"{name}: group_sizes has shape {group_sizes.shape}, expected ({e},)")
    if x.dtype != w.dtype:
        raise ValueError(f"{name}: x dtype {x.dtype} != the matrix's {w.dtype}")
    if w.kind == "int4":
        check_int4_plane(w.q, w.shape, w.block)
    elif w.kind == "mxfp4":
        check_mxfp4_plane(w.q, w.shape)
    return m, k, n


def zero_rows_past_groups(out: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`out` [M, N] with the rows past the last group zeroed: a ragged kernel never stores them
    (they belong to no group), so its output buffer holds whatever was there."""
    rows = jnp.arange(out.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, jnp.zeros((), out.dtype))
