"""Shared test setup: the `gpu` marker and STRATA_REQUIRE_GPU; one compilation cache per run.

GPU tests skip where JAX sees no GPU, unless STRATA_REQUIRE_GPU=1, which turns
the skip into a failure so a GPU run cannot pass by skipping.

Where jax has no GPU plugin installed (CPU runs, CI), the run shares one JAX persistent
compilation cache among its workers: many tests build engines of the same shapes, whose
programs then compile once per run instead of once per engine. The cache lives in a temporary
folder that the run removes at its end; a JAX_COMPILATION_CACHE_DIR of the caller's is left alone.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile

import pytest

_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def _cpu_only() -> bool:
    return not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))


def pytest_configure(config):
    # The controller (or a run without xdist) makes the folder; xdist's workers inherit the
    # environment it sets before they start.
    if hasattr(config, "workerinput") or os.environ.get(_CACHE_ENV) or not _cpu_only():
        return
    path = tempfile.mkdtemp(prefix="strata-jax-test-cache-")
    config._strata_cache = path
    os.environ[_CACHE_ENV] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


def pytest_unconfigure(config):
    path = getattr(config, "_strata_cache", None)
    if path:
        os.environ.pop(_CACHE_ENV, None)
        shutil.rmtree(path, ignore_errors=True)


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


@pytest.fixture
def stream_arms():
    """stream_arms(backend="cuda", floor=16): the identity tests' arms (`testing.arm_reads`):
    ("resident", None), stream-all and routed (depth 4) on `backend`, chunks of `floor` tokens
    and more streamed."""
    from strata_jax.stream import StreamConfig, StreamTuning

    def arms(backend: str = "cuda", floor: int = 16) -> tuple:
        tuning = StreamTuning(stream_floor=floor)
        return (("resident", None),
                ("stream-all", StreamConfig(routed=False, backend=backend, tuning=tuning)),
                ("routed", StreamConfig(routed=True, depth=4, backend=backend, tuning=tuning)))

    return arms
