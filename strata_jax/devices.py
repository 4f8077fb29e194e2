"""The memory there is: host RAM (`host_memory`, the one reader of /proc/meminfo), a JAX device's
(`memory_stats`, `device_memory`, `free_memory`), and the check of new host memory against the
available RAM (`check_host_bytes`: a `HostMemoryError` with the figures and the way out).

Guards against an allocation that takes the machine down: a streamed engine checks its host
store here before allocating it.
"""

from __future__ import annotations

import os

import jax

__all__ = ["host_memory", "memory_stats", "device_memory", "free_memory", "HostMemoryError",
           "check_host_bytes", "gib", "size"]

def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"



def host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of host RAM from /proc/meminfo (MemTotal, MemAvailable), each
    None where unknown. The one reader of /proc/meminfo (the engine's and the CLI's)."""
    found = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found.get("MemTotal"), found.get("MemAvailable")


class HostMemoryError(MemoryError):
    """Host RAM cannot hold what an engine or a command would allocate; the message has the
    figures and the way out."""


def check_host_bytes(need: int, what: str, way: str) -> None:
    """Refuses `need` bytes of new host memory (`what`: what they are) past the available
    host RAM (MemAvailable); nothing where that is unknown.

    Raises:
        HostMemoryError: "{what} needs N GiB of host RAM and M GiB is available; {way}".
    """
    available = host_memory()[1]
    if available is not None and need > available:
        raise HostMemoryError(f"{what} needs {gib(need)} of host RAM and {gib(available)} is "
                              f"available; {way}")


def _host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo, else free physical pages."""
    available = host_memory()[1]
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 2**63 - 1


def memory_stats(device) -> dict:
    """`device.memory_stats()` (bytes_limit, bytes_in_use, ...), {} where the backend reports
    none: the one query of a JAX device's memory (the engine's, the stream's and the CLI's)."""
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without stats raise or return None
        return {}


def device_memory(platform: str, index: int = 0) -> tuple[int | None, str]:
    """(bytes, what) of the device a stream backend or the resident arm uses: "gpu", the
    memory limit of JAX's GPU `index` (None where it reports none or there is no such GPU);
    else host RAM, the cpu backend's simulated device (None where unknown)."""
    if platform == "gpu":
        try:
            device = jax.devices("gpu")[index]
        except (RuntimeError, IndexError):  # no GPU, or not that many
            return None, "GPU memory"
        limit = memory_stats(device).get("bytes_limit")
        return (int(limit) if limit else None), "GPU memory"
    total, _ = host_memory()
    return total, "host RAM (the cpu backend's simulated device)"


def free_memory(device, limit: int | None = None,
                limit_what: str = "the limit") -> tuple[int, str]:
    """(bytes, what) a computation on `device` may take: its free memory (bytes_limit less
    bytes_in_use) where it reports them, else available host RAM; `limit` (named
    `limit_what`), where given, caps the first and replaces the second."""
    stats = memory_stats(device)
    if stats.get("bytes_limit"):
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        what = f"free memory of {device.device_kind}"
        if limit is not None and limit < free:
            return int(limit), limit_what
        return free, what
    if limit is not None:
        return int(limit), limit_what
    return _host_available_bytes(), "available host RAM"
