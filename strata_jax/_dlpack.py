"""JAX arrays over memory the native engine owns, with no copy (DLPack).

The ring's layer frames live in device memory the engine allocated (planned beside XLA's
preallocation). The model reads a layer's experts there, where their copies landed, so each frame
plane is handed to JAX as an array over that memory: a DLPack tensor whose deleter frees only its
own structure (the engine frees the memory, after the arrays are deleted; `NativeStreamer.close`).

The failure this guards against is a silent copy: JAX may copy what it imports (an alignment or
layout it does not take as is), and a copy would be a snapshot of the ring, read stale. `view`
checks that the array's buffer is the memory given and raises otherwise.
"""

from __future__ import annotations

import jax
import numpy as np

from strata_jax import native

__all__ = ["view"]

_KDL_CPU, _KDL_CUDA = 1, 2
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BFLOAT = 0, 1, 2, 4


def _dl_dtype(dtype: np.dtype) -> tuple[int, int]:
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return _KDL_BFLOAT, 16
    kinds = {"f": _KDL_FLOAT, "i": _KDL_INT, "u": _KDL_UINT}
    if dtype.kind not in kinds:
        raise TypeError(f"no DLPack view of dtype {dtype}")
    return kinds[dtype.kind], dtype.itemsize * 8


class _Exporter:
    """The minimal DLPack producer `jax.dlpack.from_dlpack` takes."""

    def __init__(self, capsule, device: tuple[int, int]):
        self._capsule = capsule
        self._device = device

    def __dlpack__(self, *args, **kwargs):
        del args, kwargs  # the memory is ready: there is no producer stream to wait on
        capsule, self._capsule = self._capsule, None
        if capsule is None:
            raise RuntimeError("this DLPack view was consumed already")
        return capsule

    def __dlpack_device__(self):
        return self._device


def view(ptr: int, shape: tuple[int, ...], dtype, device: jax.Device) -> jax.Array:
    """A JAX array over `ptr` (row-major `shape` of `dtype` on `device`), never a copy.

    Raises RuntimeError when JAX would have copied it (the caller then falls back to reading a
    copy of its own) and TypeError for a dtype DLPack cannot name.
    """
    if device.platform == "gpu":
        dl_device = (_KDL_CUDA, int(device.local_hardware_id or device.id))
    elif device.platform == "cpu":
        dl_device = (_KDL_CPU, 0)
    else:
        raise RuntimeError(f"no DLPack view on platform {device.platform!r}")
    code, bits = _dl_dtype(dtype)
    # The structure is the native library's, freed by its own (C) deleter when JAX drops the
    # array: no Python runs then, which may be at interpreter exit.
    try:
        capsule = native.module().dlpack_tensor(ptr, [int(n) for n in shape], code, bits,
                                                *dl_device)
    except ValueError as e:  # a rank DLPack's structure here cannot hold
        raise RuntimeError(str(e)) from e
    try:
        try:
            arr = jax.dlpack.from_dlpack(_Exporter(capsule, dl_device), copy=False)
        except TypeError:  # a jax without the copy argument (the capsule is still unused)
            arr = jax.dlpack.from_dlpack(_Exporter(capsule, dl_device))
    except (ValueError, RuntimeError) as e:  # JaxRuntimeError is a RuntimeError
        raise RuntimeError(f"no view of the memory at {ptr:#x} (shape {shape}, "
                           f"{np.dtype(dtype)}): {e}") from e
    if arr.unsafe_buffer_pointer() != ptr:
        arr.delete()
        raise RuntimeError(
            f"JAX copied the memory at {ptr:#x} instead of viewing it (shape {shape}, "
            f"{np.dtype(dtype)})")
    if arr.shape != tuple(shape) or arr.dtype != np.dtype(dtype):
        raise RuntimeError(f"DLPack view came back as {arr.shape} {arr.dtype}, not "
                           f"{tuple(shape)} {np.dtype(dtype)}")
    return arr
