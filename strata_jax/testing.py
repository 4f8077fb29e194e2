"""Test helpers: one tolerance table and a finite-first closeness check.

Guards against tolerances drifting test by test and against NaN passing a loose comparison
(`assert_allclose` with NaN on both sides, or an infinite error hidden by a large atol).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# dtype of the computation -> (rtol, atol) against the float64 reference. bfloat16 keeps 8 bits of
# mantissa, so logits of magnitude ~5 after a few layers land within a few 1e-2.
TOLERANCES: dict[np.dtype, tuple[float, float]] = {
    np.dtype(np.float64): (1e-10, 1e-10),
    np.dtype(np.float32): (1e-4, 1e-4),
    np.dtype(np.float16): (1e-2, 1e-2),
    np.dtype(ml_dtypes.bfloat16): (5e-2, 1e-1),
}


def tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol) for computations in `dtype`."""
    dtype = np.dtype(dtype)
    if dtype not in TOLERANCES:
        raise KeyError(f"no tolerance for dtype {dtype}; known: {[str(d) for d in TOLERANCES]}")
    return TOLERANCES[dtype]


def assert_close(actual, expected, dtype, *, err_msg: str = "") -> None:
    """Asserts `actual` is finite and within the tolerance of `dtype` of `expected`.

    Args:
        actual: array from the computation under test.
        expected: reference array (usually float64).
        dtype: dtype the computation ran in; picks the row of `TOLERANCES`.
        err_msg: extra context for the failure message.
    """
    actual = np.asarray(actual).astype(np.float64)
    expected = np.asarray(expected).astype(np.float64)
    bad = ~np.isfinite(actual)
    if bad.any():
        raise AssertionError(
            f"{err_msg} output has {int(bad.sum())} non-finite values of {actual.size} "
            f"(first at {np.argwhere(bad)[0].tolist()})")
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=err_msg)
