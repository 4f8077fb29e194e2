"""Several devices: `StreamerGroup`, one native engine per device of an expert-parallel mesh.

Device d of G holds the contiguous slice [E*d/G, E*(d+1)/G) of every MoE layer's experts
(`expert_slices`): its own `NativeStreamer` (host store, ring, link or simulated link, issuer
thread and route gate) over that slice, as experts 0..E/G-1 of its own. The native engines
form one group (`_native.register_group`) whose id the stream's custom calls carry: under
`jax.shard_map` one custom call runs once per device, and each reaches its device's engine by
the device ordinal in XLA's FFI call context. Each device publishes the routing counts of its
own experts and its issuer skips its own unrouted entries.

A failure on one device ends every device's walk: the group's calls defer their errors to the
chunk's end_chunk (the program runs on, so that every device reaches the same collectives) and
the first one stops the chunk on every other member (at once where it runs, at its begin_chunk
where it has not begun), whose next fetch fails likewise; each end_chunk then fails, naming
the device and the cause (ffi/src/handlers.hpp; `last_errors` has each device's). No thread
outlives the chunk and the group is usable afterwards. Every program of the group runs on all
its devices: the members number their chunks alike.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from strata_jax import native
from strata_jax.config import ModelConfig
from strata_jax.parallel import expert_slices
from strata_jax.stream.config import StreamConfig
from strata_jax.stream.streamer import ChunkStats, Closable, NativeStreamer, tail_shape_for
from strata_jax.stream.backend import choose_backend, stream_platform

__all__ = ["StreamerGroup", "GroupChunkStats", "expert_slices", "group_devices"]


def group_devices(devices: int | Sequence[jax.Device], platform: str) -> tuple[jax.Device, ...]:
    """The group's devices: `devices` (distinct JAX devices of `platform`, in mesh order), or
    the first `devices` of JAX's `platform` devices when an int.

    Raises:
        ValueError: no device, a repeated one, one of another platform or not this process's,
            or more devices than JAX has (the error says how to get simulated CPU devices).
    """
    have = jax.devices(platform)
    if isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        n = int(devices)
        if n < 1:
            raise ValueError(f"devices={n}: a group needs at least one device")
        if n > len(have):
            how = (f"; for simulated CPU devices set XLA_FLAGS="
                   f"--xla_force_host_platform_device_count={n} (or "
                   f"jax.config.update('jax_num_cpu_devices', {n})) before JAX starts"
                   if platform == "cpu" else "")
            raise ValueError(f"devices={n}, but JAX has {len(have)} {platform} device"
                             f"{'s' if len(have) != 1 else ''}{how}")
        return tuple(have[:n])
    devs = tuple(devices)
    if not devs:
        raise ValueError("devices=(): a group needs at least one device")
    for d in devs:
        if not isinstance(d, jax.Device):
            raise ValueError(f"devices: {d!r} is not a jax.Device (give devices, or a count)")
        if d.platform != platform:
            raise ValueError(f"devices: {d} is a {d.platform} device; this stream backend "
                             f"runs on {platform} devices")
        if d not in have or d.process_index != jax.process_index():
            raise ValueError(f"devices: {d} is not one of this process's {platform} devices "
                             f"{list(have)}")
    if len(set(devs)) != len(devs):
        raise ValueError(f"devices {list(devs)}: a device is given twice (one engine each)")
    return devs


@dataclasses.dataclass
class GroupChunkStats:
    """One chunk's stats per device (`devices[d]`, over device d's experts, in its local ids)
    and summed over the devices (`summed`: streamed, copied, skipped, unrouted and bytes per
    model layer)."""

    devices: tuple[ChunkStats, ...]
    summed: ChunkStats

    def totals(self) -> dict:
        """The summed totals (ChunkStats.totals)."""
        return self.summed.totals()

    def device_totals(self) -> list[dict]:
        """Each device's totals (ChunkStats.totals), in mesh order."""
        return [d.totals() for d in self.devices]

    # Read as a ChunkStats (Engine's records and sums): the summed chunk's fields.
    tokens = property(lambda self: self.summed.tokens)
    mode = property(lambda self: self.summed.mode)
    layout = property(lambda self: self.summed.layout)
    tail_pieces = property(lambda self: self.summed.tail_pieces)
    tail_shape = property(lambda self: self.summed.tail_shape)
    streamed = property(lambda self: self.summed.streamed)
    copied = property(lambda self: self.summed.copied)
    skipped = property(lambda self: self.summed.skipped)
    unrouted = property(lambda self: self.summed.unrouted)
    bytes = property(lambda self: self.summed.bytes)


class StreamerGroup(Closable):
    """One `NativeStreamer` per device: device d holds `expert_slices(E, G)[d]` of every MoE
    layer, with its own residents, ring, link and issuer, all in one native group (`id`).

    Args:
        config: The model config (all E experts).
        experts: Per model layer its whole routed experts, as `NativeStreamer` takes them;
            each engine writes its slice into its own host store.
        stream: StreamConfig, the same for every device: `resident_per_layer` and the budgets
            are per device (each GPU has its own memory), `device` is not read (the devices
            are `devices`).
        devices: The devices in mesh order (device d takes the d-th slice), or a count (the
            first that many of the backend's platform).
        progress: Called as progress(done, total) over every device's MoE layers.

    Raises:
        ValueError: E not a multiple of the device count, devices JAX does not have, a
            repeated device, a device of another platform (`group_devices`).
    """

    def __init__(self, config: ModelConfig, experts, stream: StreamConfig | None = None, *,
                 devices: int | Sequence[jax.Device],
                 progress: Callable[[int, int], object] | None = None):
        stream = stream or StreamConfig()
        if not isinstance(devices, (int, np.integer)):
            devices = tuple(devices)
        expert_slices(config.n_experts, devices if isinstance(devices, (int, np.integer))
                      else len(devices))  # the split, checked before the devices
        self.platform = stream_platform(choose_backend(stream.backend))
        self.devices = group_devices(devices, self.platform)
        self.config = config
        self.slices = expert_slices(config.n_experts, len(self.devices))
        n_moe = len(config.moe_layers)
        total = n_moe * len(self.devices)
        self.streamers: tuple[NativeStreamer, ...] = ()
        made: list[NativeStreamer] = []
        try:
            for d, (dev, rng) in enumerate(zip(self.devices, self.slices)):
                step = (None if progress is None else
                        (lambda done, _n, d=d: progress(d * n_moe + done, total)))
                made.append(NativeStreamer(config, experts, stream, progress=step, device=dev,
                                           expert_range=rng))
            self.id = native.module().register_group([s.id for s in made],
                                                     [s.device_ordinal for s in made])
        except BaseException:
            for s in made:
                s.close()
            raise
        self.streamers = tuple(made)
        self.pid = os.getpid()
        self._finalizer = weakref.finalize(self, _destroy, self.id, self.streamers, self.pid)
        first = self.streamers[0]
        self.stream, self.tuning, self.backend = first.stream, first.tuning, first.backend
        self.format, self.blob_bytes = first.format, first.blob_bytes
        self.moe_layers = first.moe_layers
        self.local_config = first.config  # each device's view: E/G experts
        if any(s.frame_of != first.frame_of for s in self.streamers):
            self.close()
            raise RuntimeError(f"the devices' engines put the MoE layers in different ring "
                               f"frames: {[s.frame_of for s in self.streamers]}")

    # -- the members ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.streamers)

    def __getitem__(self, d: int) -> NativeStreamer:
        return self.streamers[d]

    @property
    def n_local_experts(self) -> int:
        """Experts of each MoE layer on each device."""
        return self.slices[0][1] - self.slices[0][0]

    @property
    def ordinals(self) -> tuple[int, ...]:
        """Each device's ordinal, as XLA's FFI call context names it."""
        return tuple(s.device_ordinal for s in self.streamers)

    def check_mesh(self, mesh: jax.sharding.Mesh, axis: str = "expert") -> None:
        """Raises ValueError unless `mesh`'s `axis` lists exactly the group's devices, in the
        group's order (device d of the axis holds slice d), and the mesh has no other axis of
        more than one device."""
        if axis not in mesh.axis_names:
            raise ValueError(f"the mesh's axes are {mesh.axis_names}; the group needs {axis!r}")
        others = {a: n for a, n in mesh.shape.items() if a != axis and n != 1}
        if others:
            raise ValueError(f"the mesh has axes {others} besides {axis!r}: a group spans one "
                             "expert axis")
        order = tuple(np.moveaxis(mesh.devices, mesh.axis_names.index(axis), 0).reshape(-1))
        if order != self.devices:
            raise ValueError(f"the mesh's {axis!r} axis lists devices {list(order)}; the group's "
                             f"are {list(self.devices)}, in that order (device d holds slice d)")

    def sharded_resident_blobs(self, mesh: jax.sharding.Mesh,
                               axis: str = "expert") -> dict[int, jax.Array]:
        """Per MoE layer every device's resident blobs as one array, uint8 [G * R, blob bytes]
        sharded over `axis` (device d's shard its own R, what its fetch copies residents from):
        the operand a shard_map'd fetch takes with in_specs P(axis).

        Raises:
            ValueError: the mesh is not the group's (`check_mesh`), or a layer keeps a
                different number of residents on different devices (a budget filled by a
                profile: a sharded operand needs equal shards).
        """

        self.check_mesh(mesh, axis)
        sharding = NamedSharding(mesh, PartitionSpec(axis))
        out = {}
        for l in self.moe_layers:
            parts = [s.resident_blobs[l] for s in self.streamers]
            counts = {int(p.shape[0]) for p in parts}
            if len(counts) != 1:
                raise ValueError(
                    f"layer {l} keeps {[int(p.shape[0]) for p in parts]} resident experts on "
                    "the devices: a sharded operand needs as many on each (use "
                    "resident_per_layer, or a budget without a profile)")
            out[l] = jax.make_array_from_single_device_arrays(
                (len(parts) * counts.pop(), self.blob_bytes), sharding, parts)
        return out

    # -- the prefill protocol, on every member --------------------------------------------------

    def stage_ids(self, ids: np.ndarray, *, reset: bool = False) -> None:
        """Stages the chunks' ids with every device's engine (each device's begin_chunk takes
        the same ids; `NativeStreamer.stage_ids`)."""
        for s in self.streamers:
            s.stage_ids(ids, reset=reset)

    def clear_ids(self) -> None:
        for s in self.streamers:
            s.clear_ids()

    def prestart(self, n_tokens: int) -> None:
        """Begins the chunk on every device from the host (`NativeStreamer.prestart`)."""
        for s in self.streamers:
            s.prestart(n_tokens)

    def cancel(self, on: bool = True) -> None:
        """`NativeStreamer.cancel` on every device."""
        for s in self.streamers:
            s.cancel(on)

    def abort(self) -> None:
        """`NativeStreamer.abort` on every device: only with no chunk queued or running."""
        for s in self.streamers:
            s.abort()

    def walk_active(self) -> bool:
        """Whether any device's walk is running."""
        return any(s.walk_active() for s in self.streamers)

    def hold(self) -> int:
        return max(s.hold() for s in self.streamers)

    def inject_fault(self, device: int, layer: int, kind: str) -> None:
        """Test hook: fail ("error") or stop ("stop") the next fetch of `layer` on the group's
        device number `device` (an index into `devices`)."""
        if not 0 <= device < len(self.streamers):
            raise ValueError(f"device {device}: the group has devices 0..{len(self) - 1}")
        self.streamers[device].inject_fault(layer, kind)

    def last_errors(self) -> tuple[str, ...]:
        """Per device, the error its last chunk ended with ("" where it ended well): the
        program reports one device's; each device's own cause is here
        (`NativeStreamer.last_error`)."""
        return tuple(s.last_error() for s in self.streamers)

    def chunk_mode(self, n_tokens: int) -> int:
        return self.streamers[0].chunk_mode(n_tokens)

    def layout(self, n_tokens: int) -> str:
        return self.streamers[0].layout(n_tokens)

    @property
    def tail_layer(self) -> int | None:
        """The last MoE layer (`NativeStreamer.tail_layer`)."""
        return self.streamers[0].tail_layer

    def tail_pieces(self, mode: int, n_tokens: int, grouped_matmul: str = "auto",
                    quantized: str = "auto") -> int:
        """`NativeStreamer.tail_pieces` (the same on every device)."""
        return self.streamers[0].tail_pieces(mode, n_tokens, grouped_matmul, quantized)

    def tail_shape(self, n_tokens: int) -> str:
        """`NativeStreamer.tail_shape` of the whole model (each device's share of the rows
        and of the experts is the same fraction of them)."""
        first = self.streamers[0]
        return tail_shape_for(first.tuning.tail_shape, self.config, n_tokens, first.blob_bytes)

    # A frames chunk on a mesh reads each device's frame through fetch's copy: the ring's
    # in-place views (`NativeStreamer.frames`, CUDA) are per-device arrays, and a program
    # under shard_map would need them as one array sharded over the mesh.
    frames = None
    read_in_place = False
    parts = 1  # NativeStreamer.parts: an engine of a group refuses a layer in parts

    @property
    def native_layers(self) -> int:
        """Rows of each device's end_chunk stats (`NativeStreamer.native_layers`)."""
        return self.streamers[0].native_layers
    frames_note = ("layer frames, read through a copy on each device (in-place views of "
                   "several devices' rings are not built)")

    @property
    def frame_of(self) -> dict[int, int]:
        """The ring frame each MoE layer lands in: the same on every device (each device's
        plan fetches every MoE layer)."""
        return self.streamers[0].frame_of

    def check_process(self) -> None:
        self.streamers[0].check_process()

    # -- stats ----------------------------------------------------------------------------------

    def make_stats(self, n_tokens: int, native_stats: np.ndarray, counts: np.ndarray,
                   tail_pieces: int = 1, tail_shape: str | None = None) -> GroupChunkStats:
        """Per device and summed stats of one chunk.

        Args:
            native_stats: every device's end_chunk output, [G, L, 2] (or [G * L, 2], a
                shard_map output with out_specs P(axis)).
            counts: the chunk's router counts over all experts, [n_moe, E] (each device's
                are its slice's columns), or per device [G, n_moe, E/G].
        """
        G, L = len(self.streamers), self.config.n_layers
        st = np.asarray(native_stats).reshape(G, L, 2)
        counts = np.asarray(counts)
        if counts.ndim == 2:
            per = [counts[:, lo:hi] for lo, hi in self.slices]
        else:
            per = [counts[d] for d in range(G)]
        devs = tuple(s.make_stats(n_tokens, st[d], per[d], tail_pieces, tail_shape)
                     for d, s in enumerate(self.streamers))
        first = devs[0]
        fields = ("streamed", "copied", "skipped", "unrouted", "bytes")
        summed = dataclasses.replace(
            first, **{f: np.sum([getattr(c, f) for c in devs], axis=0) for f in fields})
        return GroupChunkStats(devices=devs, summed=summed)

    # -- life -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Ends the group and closes every device's engine (threads stopped, memory freed).
        Idempotent."""
        self._finalizer()
        for s in self.streamers:
            s.close()



def _destroy(group_id: int, streamers, pid: int) -> None:
    if os.getpid() != pid:
        return  # a fork's copy: the engines are the parent's
    native.module().destroy_group(group_id)
    for s in streamers:
        s.close()
