"""Loads the native library and registers its XLA FFI targets.

The library (``strata_jax/_native``, built by scikit-build-core from ``ffi/``)
is an importable extension module so that editable installs find it by name;
its functions are reached through ctypes. The failure this module guards
against is an obscure ImportError or segfault deep inside a prefill: a missing
or mismatched build is reported once, here, with the way to fix it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib

import jax

__all__ = ["EngineOptions", "lib", "has_cuda", "register_targets", "TARGETS"]

# XLA custom-call names; the same names are registered for "cpu" and "CUDA".
TARGETS = {
    "begin": "strata_begin_chunk",
    "publish": "strata_publish",
    "fetch": "strata_fetch",
    "fetch_piece": "strata_fetch_piece",
    "fetch_frame": "strata_fetch_frame",
    "release": "strata_release",
    "end": "strata_end_chunk",
}
# The handlers' exported symbols: each name + "Cpu", and + "Cuda" in a CUDA build (one templated
# handler a target, ffi/src/handlers.hpp, exported once a platform).
_SYMBOLS = {
    "begin": "StrataBegin",
    "publish": "StrataPublish",
    "fetch": "StrataFetch",
    "fetch_piece": "StrataFetchPiece",
    "fetch_frame": "StrataFetchFrame",
    "release": "StrataRelease",
    "end": "StrataEnd",
}


class EngineOptions(ctypes.Structure):
    """Mirror of ``strata::EngineOptions`` (ffi/src/engine.hpp)."""

    _fields_ = [
        ("backend", ctypes.c_int32),
        ("n_layers", ctypes.c_int32),
        ("n_experts", ctypes.c_int32),
        ("routed", ctypes.c_int32),
        ("blob_bytes", ctypes.c_int64),
        ("ring", ctypes.c_int64),
        ("depth", ctypes.c_int32),
        ("trace", ctypes.c_int32),
        ("sim_bandwidth", ctypes.c_double),
        ("sim_latency", ctypes.c_double),
        ("sim_jitter", ctypes.c_double),
        ("seed", ctypes.c_uint64),
        ("pin_mode", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("publish_mode", ctypes.c_int32),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    c = ctypes
    p = c.c_void_p
    sigs = {
        "strata_options_size": (c.c_int64, []),
        "strata_has_cuda": (c.c_int, []),
        "strata_engine_create": (c.c_int64, [c.POINTER(EngineOptions), c.c_char_p, c.c_int64]),
        "strata_engine_set_store": (c.c_int, [c.c_int64, c.c_int32, p, c.c_int64, c.c_char_p, c.c_int64]),
        "strata_engine_set_plan": (
            c.c_int,
            [c.c_int64, p, p, c.c_int64, p, p, c.c_int64, c.c_char_p, c.c_int64],
        ),
        "strata_engine_prepare": (c.c_int, [c.c_int64, c.c_char_p, c.c_int64]),
        "strata_engine_destroy": (c.c_int, [c.c_int64]),
        "strata_engine_abort": (c.c_int, [c.c_int64]),
        "strata_engine_cancel": (c.c_int, [c.c_int64, c.c_int32]),
        "strata_engine_prestart": (c.c_int, [c.c_int64, c.c_int32, c.c_char_p, c.c_int64]),
        "strata_engine_stage_ids": (c.c_int, [c.c_int64, c.c_void_p, c.c_int64, c.c_int32,
                                             c.c_char_p, c.c_int64]),
        "strata_engine_walk_active": (c.c_int, [c.c_int64]),
        "strata_engine_hold": (c.c_int64, [c.c_int64]),
        "strata_engine_inject_fault": (c.c_int, [c.c_int64, c.c_int32, c.c_int32]),
        "strata_engine_depth": (c.c_int, [c.c_int64]),
        "strata_engine_frames": (c.c_int, [c.c_int64, p, p]),
        "strata_engine_frame_of": (c.c_int64, [c.c_int64, c.c_int32]),
        "strata_dlpack_tensor": (p, [p, c.c_int32, p, c.c_int32, c.c_int32, c.c_int32,
                                     c.c_int32]),
        "strata_pinned_alloc": (p, [c.c_int64, c.c_char_p, c.c_int64]),
        "strata_pinned_free": (None, [p]),
        "strata_engine_host_times": (c.c_int, [c.c_int64, p]),
        "strata_engine_timing": (c.c_int, [c.c_int64, p, c.c_char_p, c.c_int64]),
        "strata_measure_h2d": (
            c.c_int,
            [c.c_int, c.c_int64, c.c_int64, c.c_int, c.c_int, c.c_int, c.POINTER(c.c_double),
             c.c_char_p, c.c_int64],
        ),
        "strata_measure_h2d_from": (
            c.c_int,
            [c.c_int, p, c.c_int64, c.c_int, c.POINTER(c.c_double), c.c_char_p, c.c_int64],
        ),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


@functools.cache
def lib() -> ctypes.CDLL:
    """The native library, loaded once; raises ImportError saying how to build it."""
    try:
        mod = importlib.import_module("strata_jax._native")
    except ImportError as e:
        raise ImportError(
            "strata_jax's native library is missing (strata_jax/_native was not "
            "built). Install the package with `pip install -e .[test]` (or, where "
            "there is no network, `pip install --no-build-isolation --no-deps -e .`) "
            f"so scikit-build-core compiles ffi/. Cause: {e}"
        ) from e
    handle = ctypes.CDLL(mod.__file__)
    _declare(handle)
    size = handle.strata_options_size()
    if size != ctypes.sizeof(EngineOptions):
        raise ImportError(
            f"strata_jax/_native is out of date: EngineOptions is {size} bytes in "
            f"the library and {ctypes.sizeof(EngineOptions)} in Python; rebuild "
            "with `pip install -e .`"
        )
    return handle


def has_cuda() -> bool:
    """Whether the native library was built with the CUDA backend."""
    return bool(lib().strata_has_cuda())


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
        ValueError: an unknown `host` mode.
    """
    mode = host if host is not None else ("alloc" if pinned else "pageable")
    if mode not in _HOST_MODES:
        raise ValueError(f"host={mode!r}: expected one of {sorted(_HOST_MODES)}")
    out = ctypes.c_double(0.0)
    err = ctypes.create_string_buffer(512)
    rc = lib().strata_measure_h2d(device, int(nbytes), int(block or nbytes), int(reps),
                                     _HOST_MODES[mode], int(bool(events)), ctypes.byref(out),
                                     err, len(err))
    if rc != 0:
        raise RuntimeError(f"link probe failed: {err.value.decode(errors='replace')}")
    return out.value


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
    out = ctypes.c_double(0.0)
    err = ctypes.create_string_buffer(512)
    rc = lib().strata_measure_h2d_from(device, address, int(nbytes), int(reps),
                                       ctypes.byref(out), err, len(err))
    if rc != 0:
        raise RuntimeError(f"link probe failed: {err.value.decode(errors='replace')}")
    return out.value


@functools.cache
def register_targets() -> None:
    """Registers the FFI targets for "cpu" and, when built with CUDA, "CUDA"."""
    handle = lib()
    for key, name in TARGETS.items():
        fn = getattr(handle, _SYMBOLS[key] + "Cpu")
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform="cpu")
        if has_cuda():
            fn = getattr(handle, _SYMBOLS[key] + "Cuda")
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform="CUDA")
