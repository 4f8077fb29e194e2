"""Where an engine's model and experts go: its device, a mesh of devices for expert parallelism,
and the memory kinds the device offers.
"""

from __future__ import annotations

import itertools
from typing import Callable

import jax
import numpy as np

from strata_jax.config import ModelConfig
from strata_jax.formats import ExpertWeights
from strata_jax.parallel import EXPERT_AXIS, ShardedExperts, check_mesh, expert_mesh, replicated
from strata_jax.stream import stream_platform
from strata_jax.stream.group import group_devices
from strata_jax.weights import LazyExperts


def info_sharding(device: jax.Device, mesh=None, *,
                   split: bool = False) -> jax.sharding.Sharding:
    """Where each compiled call's `info` (end_chunk's stats and the router counts, a few KiB)
    lands: the device's pinned host memory, written by the program's own last copy, so it is in
    host memory when the call ends; a device without pinned host memory keeps it in device
    memory, and `_dispatch` starts its copy to the host. On a mesh: replicated on its devices,
    in pinned host memory where each of them has it (`split`: each device's own, a
    streamed mesh's, split over the expert axis)."""
    pinned = all("pinned_host" in memory_kinds(d)
                 for d in (mesh.devices.flat if mesh is not None else [device]))
    kind = "pinned_host" if pinned else None
    if split:
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(EXPERT_AXIS),
                                          memory_kind=kind)
    if mesh is not None:
        return replicated(mesh, kind)
    return jax.sharding.SingleDeviceSharding(device, memory_kind=kind)


def memory_kinds(device: jax.Device) -> set:
    try:
        return {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 - a backend without memory spaces, another process's device
        return set()


def engine_mesh(mesh, config: ModelConfig, stream, device):
    """Engine(mesh=...) as a checked jax.sharding.Mesh (None stays None); refused with a
    device (the mesh says where the model runs)."""
    if mesh is None:
        return None
    if device is not None:
        raise ValueError(f"device={device_name(device)} and mesh= both say where the model runs; "
                         "give one (the mesh's devices, or device= for one device)")
    if not isinstance(mesh, jax.sharding.Mesh):
        if stream is not None and isinstance(mesh, (int, np.integer)) \
                and not isinstance(mesh, bool) and mesh >= 1:
            # A count: the first devices of the stream's platform (its engines' devices).
            mesh = list(group_devices(mesh, stream_platform(stream.backend)))
        mesh = expert_mesh(mesh)
    check_mesh(mesh, config.n_experts)
    return mesh


def first_local(mesh) -> jax.Device:
    """The mesh's first device of this process (where weights land before placement and
    whose memory the engine's estimates read)."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if not local:
        raise ValueError(f"the mesh has no device of this process (process "
                         f"{jax.process_index()}); each process must hold part of the mesh")
    return local[0]


def on_mesh(experts: dict, mesh) -> dict:
    """Each layer's expert planes put on `mesh` one at a time, split over its expert axis."""
    return {l: ShardedExperts(w if not isinstance(w, ExpertWeights) else w._asdict(), mesh)
            for l, w in experts.items()}


def device_name(device: jax.Device) -> str:
    return f"{device.platform}:{device.id}"


def device_of(device) -> jax.Device | None:
    """Engine(device=...) as a jax.Device (None stays None); clear errors for the rest."""
    if device is None or isinstance(device, jax.Device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be a jax.Device, a platform name ('cpu', 'gpu') or None, "
                        f"got {type(device).__name__}")
    try:
        found = jax.devices(device)
    except RuntimeError:  # an unknown platform, or one that did not initialise
        have = sorted({d.platform for d in jax.devices()})
        raise ValueError(
            f"device={device!r}: JAX has no {device!r} device here (platforms present: "
            f"{', '.join(map(repr, have))}); use one of those, a jax.Device, or None for JAX's "
            "default device") from None
    return found[0]


def check_stream_device(device: jax.Device, platform: str, backend: str) -> None:
    if device.platform != platform:
        raise ValueError(
            f"device={device_name(device)} but the stream backend {backend!r} runs on a {platform} "
            f"device; pass device=None, a {platform} device, or StreamConfig(backend="
            f"{'cuda' if device.platform == 'gpu' else 'cpu'!r}) for the {device.platform}")


def counted(experts: dict, progress: Callable[[int, int], object] | None) -> dict:
    """`experts` (layer -> ExpertWeights or LazyExperts), each layer calling
    progress(done_layers, total_layers) once all its tensors have been read."""
    if progress is None:
        return experts
    done = itertools.count(1)
    total = len(experts)
    return {l: LazyExperts.of(w, lambda: progress(next(done), total))
            for l, w in experts.items()}


def settle(arrays) -> None:
    """Waits until each array's computation has ended, whether it succeeded or failed."""
    for a in arrays:
        if a is None:
            continue
        try:
            jax.block_until_ready(a)
        except Exception:  # noqa: BLE001 - a cancelled chunk ends in error; that is the point
            pass
