"""GPTQ's layouts as the int4 expert format reads them (`strata_jax.formats`): `qweight`'s
int32 words rearranged into group halves (`gptq_halves_np`), and act-order's row orders (GPTQ
`desc_act`: `g_idx` names each input row's group; the format stores the rows by group with a
plane naming each stored row's input row). `strata_jax.formats` re-exports them.
"""

from __future__ import annotations

import numpy as np

from strata_jax.nibbles import int4_halves_np

__all__ = ["INT4_PER_WORD", "act_order_g_idx", "act_order_perm", "g_idx_perm", "gptq_halves_np",
           "perm_g_idx", "unequal_group"]

INT4_PER_WORD = 8  # 4-bit values per int32 word of GPTQ's qweight


def gptq_halves_np(qweight: np.ndarray, group: int) -> np.ndarray:
    """GPTQ `qweight` int32 [..., K/8, N] (row 8r + j in bits 4j..4j+3 of word r) -> the int4
    plane's bytes uint8 [..., K/2, N] (`int4_halves_np`): the same values, rearranged."""
    # Byte j of a little-endian word holds rows 8r + 2j (low nibble) and 8r + 2j + 1 (high).
    words = np.ascontiguousarray(qweight, dtype="<i4")
    *lead, k8, n = words.shape
    b = np.moveaxis(words.view(np.uint8).reshape(*lead, k8, n, 4), -1, -2)  # [..., K/8, 4, N]
    vals = np.empty((*lead, k8, 4, 2, n), np.uint8)
    np.bitwise_and(b, 15, out=vals[..., 0, :])
    np.right_shift(b, 4, out=vals[..., 1, :])
    return int4_halves_np(vals.reshape(*lead, k8 * INT4_PER_WORD, n), group)



def act_order_perm(x: np.ndarray, group: int) -> np.ndarray:
    """The act-order stored row order int32 [E, K] of experts x [E, K, N] (the format's
    `<m>_perm` plane): each expert's rows ranked by descending largest magnitude (ties by
    row), the first `group` of that ranking group 0 and so on (GPTQ ranks rows by its
    calibration data's Hessian; with none, the rows' own magnitude stands in), and stored by
    group, ascending rows within one (`g_idx_perm` of `act_order_g_idx`: what loading the
    GPTQ checkpoint of those groups stores)."""
    return g_idx_perm(act_order_g_idx(x, group), group)


def act_order_g_idx(x: np.ndarray, group: int) -> np.ndarray:
    """GPTQ's `g_idx` int32 [E, K] of experts x [E, K, N] (what an act-order checkpoint's
    files hold): `act_order_perm`'s ranking, row of rank i in group i // group."""
    amax = np.abs(np.asarray(x, np.float32)).max(axis=2)  # [E, K]
    return perm_g_idx(np.argsort(-amax, axis=1, kind="stable"), group)


def perm_g_idx(perm: np.ndarray, group: int) -> np.ndarray:
    """Each input row's group int32 [..., K] for a row order [..., K] (`<m>_perm`)."""
    perm = np.asarray(perm)
    g_idx = np.empty(perm.shape, np.int32)
    np.put_along_axis(g_idx, perm, np.broadcast_to(
        (np.arange(perm.shape[-1]) // group).astype(np.int32), perm.shape), axis=-1)
    return g_idx


def g_idx_perm(g_idx: np.ndarray, group: int) -> np.ndarray:
    """The stored row order int32 [..., K] (`<m>_perm`) of GPTQ group indices [..., K]: the
    rows sorted by group, stable. A ValueError unless every group holds `group` rows (as
    GPTQ's act-order makes them)."""
    g_idx = np.asarray(g_idx)
    k = g_idx.shape[-1]
    if g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= k // group:
        raise ValueError(f"int4 act-order: g_idx names groups outside 0 .. {k // group - 1}")
    bad = unequal_group(g_idx, group)
    if bad is not None:
        raise ValueError(f"int4 act-order: group {bad[0]} holds {bad[1]} rows, not {group}: "
                         "act-order groups of unequal size are not read")
    return np.argsort(g_idx, axis=-1, kind="stable").astype(np.int32)


def unequal_group(g_idx: np.ndarray, group: int) -> tuple[int, int] | None:
    """(the first group, its row count) among GPTQ group indices [..., K] (each 0 .. K/group
    - 1) that does not hold `group` rows, or None where every group does (the stored order
    `g_idx_perm` reads needs it)."""
    g_idx = np.asarray(g_idx)
    k = g_idx.shape[-1]
    counts = np.apply_along_axis(np.bincount, -1, g_idx.reshape(-1, k), minlength=k // group)
    bad = np.argwhere(counts != group)
    if not bad.size:
        return None
    return int(bad[0][-1]), int(counts[tuple(bad[0])])
