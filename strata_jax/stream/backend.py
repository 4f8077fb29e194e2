"""Where a stream runs: the backend ("cpu", the simulated link; "cuda", the GPU's PCIe link), the
JAX platform of its ring, and the device ordinal the FFI calls carry.
"""

from __future__ import annotations

import jax

from strata_jax import native


class BackendUnavailable(RuntimeError):
    """backend 'cuda' where it cannot run: `missing` is "cuda-build" (the native library was
    built without CUDA) or "gpu" (JAX's default backend, `platform`, is not a GPU)."""

    def __init__(self, message: str, missing: str, platform: str):
        super().__init__(message)
        self.missing = missing
        self.platform = platform


def choose_backend(requested: str) -> str:
    """The stream backend ("cpu" or "cuda") that `requested` ("auto", "cpu", "cuda") runs on:
    auto is CUDA when JAX's default backend is a GPU and the native library has CUDA, else
    cpu. The one choice of a backend (the NativeStreamer's and the CLI's).

    Raises:
        BackendUnavailable: "cuda" where it cannot run (a RuntimeError; the CLI words it as
            its options).
    """
    platform = jax.default_backend()
    if requested == "auto":
        return "cuda" if platform == "gpu" and native.has_cuda() else "cpu"
    if requested == "cuda":
        if not native.has_cuda():
            raise BackendUnavailable(
                "backend='cuda' but strata_jax was built without CUDA support; install the "
                "CUDA toolkit and reinstall (`pip install --no-build-isolation -e .`)",
                "cuda-build", platform)
        if platform != "gpu":
            raise BackendUnavailable(
                f"backend='cuda' but JAX's default backend is {platform!r}; install jax[cuda12] "
                "or use backend='cpu'", "gpu", platform)
    return requested


def stream_platform(backend: str) -> str:
    """The JAX platform ("cpu" or "gpu") a stream backend ("auto", "cpu", "cuda") runs on:
    the simulated link's ring is host memory, the CUDA ring is on the GPU; "auto" is
    decided as a NativeStreamer decides it."""
    if backend == "auto":
        backend = choose_backend(backend)
    return "gpu" if backend == "cuda" else "cpu"


def device_ordinal(device: jax.Device) -> int:
    """The ordinal XLA's FFI call context gives a call running on `device` (the handlers'
    `DeviceOrdinal`): its local hardware id (the CUDA ordinal on a GPU), else its id."""
    hw = getattr(device, "local_hardware_id", None)
    return int(hw) if hw is not None else int(device.id)
