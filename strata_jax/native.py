"""Loads the native library and registers its XLA FFI targets.

The library (``strata_jax/_native``, a nanobind module built by scikit-build-core from ``ffi/``)
holds the streaming engine (``Streamer``), pinned host memory, the link probe and the FFI
handlers. The failure this module guards against is an obscure ImportError or segfault deep
inside a prefill: a missing or stale build is reported once, here, with the way to fix it.
Nothing here imports the library until it is needed, so planning works without it.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import jax

__all__ = ["module", "has_cuda", "measure_h2d", "measure_h2d_from", "register_targets",
           "TARGETS"]

# XLA custom-call names, by the keys the library's `registrations()` uses; the same names are
# registered for "cpu" and "CUDA".
TARGETS = {
    "begin": "strata_begin_chunk",
    "publish": "strata_publish",
    "fetch": "strata_fetch",
    "fetch_piece": "strata_fetch_piece",
    "fetch_frame": "strata_fetch_frame",
    "release": "strata_release",
    "end": "strata_end_chunk",
    "dense_fetch": "strata_dense_fetch",
    "dense_wait": "strata_dense_wait",
}
# The library's interface version this Python speaks (module.cc, kApiVersion).
_API_VERSION = 6


@functools.cache
def module() -> ModuleType:
    """The native module, imported once; raises ImportError saying how to build it."""
    try:
        mod = importlib.import_module("strata_jax._native")
    except ImportError as e:
        raise ImportError(
            "strata_jax's native library is missing (strata_jax/_native was not "
            "built). Install the package with `pip install -e .[test]` (or, where "
            "there is no network, `pip install --no-build-isolation --no-deps -e .`) "
            f"so scikit-build-core compiles ffi/. Cause: {e}"
        ) from e
    version = getattr(mod, "api_version", None)
    if version != _API_VERSION:
        raise ImportError(
            f"strata_jax/_native is out of date: its interface is version {version}, this "
            f"Python speaks version {_API_VERSION}; rebuild with `pip install -e .`")
    return mod


def has_cuda() -> bool:
    """Whether the native library was built with the CUDA backend."""
    return bool(module().has_cuda())


_HOST_MODES = {"pageable": 0, "alloc": 1, "register": 2}


def measure_h2d(nbytes: int = 256 * 2**20, reps: int = 10, *, pinned: bool = True,
                host: str | None = None, block: int | None = None, events: bool = False,
                device: int = 0) -> float:
    """Median host-to-device copy rate in GB/s over `reps` timed repetitions (CUDA events).

    Args:
        nbytes: Bytes per repetition.
        reps: Timed repetitions (after one warm-up).
        pinned: cudaHostAlloc memory (True) or pageable malloc memory (False);
            ignored when `host` is given.
        host: "alloc" (cudaHostAlloc), "register" (malloc + cudaHostRegister, how
            the engine pins a store in place) or "pageable".
        block: Split each repetition into back-to-back copies of this many bytes
            (the ring's traffic: one copy per expert); None copies `nbytes` at once.
        events: Record an event after every block, as the ring records `copied`.
        device: CUDA device ordinal.

    Raises:
        RuntimeError: the library has no CUDA, or a CUDA call failed (named).
        ValueError: an unknown `host` mode, or a non-positive size or count.
    """
    mode = host if host is not None else ("alloc" if pinned else "pageable")
    if mode not in _HOST_MODES:
        raise ValueError(f"host={mode!r}: expected one of {sorted(_HOST_MODES)}")
    return module().measure_h2d(device, int(nbytes), int(block or nbytes), int(reps),
                                _HOST_MODES[mode], bool(events))


def measure_h2d_from(address: int, nbytes: int, reps: int = 10, *, device: int = 0) -> float:
    """`measure_h2d` out of pinned host memory the caller owns (an expert store's arena):
    the median rate in GB/s of `reps` timed copies (after one warm-up) of `nbytes` from
    `address`, which must stay valid until this returns.

    Raises:
        RuntimeError: the library has no CUDA, or a CUDA call failed (named).
        ValueError: a null address, or a non-positive size or count.
    """
    if not address or nbytes <= 0 or reps < 1:
        raise ValueError(f"link probe of {nbytes} bytes at {address!r}, {reps} repetitions: "
                         "needs a host address, a positive size and at least one repetition")
    return module().measure_h2d_from(device, int(address), int(nbytes), int(reps))


@functools.cache
def register_targets() -> None:
    """Registers the FFI targets for "cpu" and, when built with CUDA, "CUDA"."""
    for platform, handlers in module().registrations().items():
        if handlers.keys() != TARGETS.keys():
            raise ImportError(
                f"strata_jax/_native's {platform} handlers are {sorted(handlers)}, not "
                f"{sorted(TARGETS)}: the library is out of date; rebuild with `pip install -e .`")
        for key, name in TARGETS.items():
            jax.ffi.register_ffi_target(name, handlers[key], platform=platform)
