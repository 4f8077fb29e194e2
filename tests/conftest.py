"""Shared test setup: the `gpu` marker and STRATA_REQUIRE_GPU.

GPU tests skip where JAX sees no GPU, unless STRATA_REQUIRE_GPU=1, which turns
the skip into a failure so a GPU run cannot pass by skipping.
"""

from __future__ import annotations

import functools
import os

import pytest


@functools.cache
def _has_gpu() -> bool:
    import jax

    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None or _has_gpu():
        return
    if os.environ.get("STRATA_REQUIRE_GPU") == "1":
        pytest.fail("STRATA_REQUIRE_GPU=1 but JAX sees no GPU", pytrace=False)
    pytest.skip("needs a CUDA GPU (set STRATA_REQUIRE_GPU=1 to make this a failure)")
