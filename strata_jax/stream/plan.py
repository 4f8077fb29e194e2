"""The stream plan: which experts stay resident, the stream order and the ring.

`plan_stream` is the plan a `NativeStreamer` follows; it is pure (no environment, no device, no
native library), so `strata-jax info` reports it without either.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from strata_jax.config import ModelConfig
from strata_jax.formats import ExpertFormat
from strata_jax.parallel import expert_slices
from strata_jax.profile import ExpertProfile
from strata_jax.stream.config import StreamConfig, _check_ints


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """Where each expert of a model lives, and the ring that carries the streamed ones.

    Made by `plan_stream`; a NativeStreamer follows it, and `strata-jax info` reports it.

    Attributes:
        resident: Per model layer, the sorted ids of the experts kept on the device (empty for
            dense layers).
        stream_list: The (layer, expert) entries of one chunk's stream, in layer order and
            hottest first within a layer (by the profile; without one, the lowest ids).
        streamed_mask: bool [n_layers, n_experts], read-only: which experts cross the link.
        streamed_per_layer: int64 [n_layers], read-only: streamed experts per layer.
        ring: Ring slots, `frames` frames of `part_experts` slots each.
        blob_bytes: Bytes of one expert (one ring slot).
        ring_budget_slots: Slots `ring_budget_gib` holds, or None when the ring was given.
        ring_fits_budget: False only for a plan made with `check_ring_budget=False` whose ring
            budget cannot hold one frame of the layer or of its smallest part (`ring` is then
            one frame).
        parts: Each MoE layer's experts in this many equal parts (`StreamTuning.parts`), each
            fetched, multiplied and released on its own: part p of layer l is the native
            engine's layer `native_layer(l, p)`, of `part_experts` experts. 1: layers whole.
    """

    resident: tuple[tuple[int, ...], ...]
    stream_list: tuple[tuple[int, int], ...]
    streamed_mask: np.ndarray = dataclasses.field(compare=False, repr=False)
    streamed_per_layer: np.ndarray = dataclasses.field(compare=False, repr=False)
    ring: int
    blob_bytes: int
    ring_budget_slots: int | None = None
    ring_fits_budget: bool = True
    parts: int = 1

    @property
    def resident_count(self) -> int:
        """Experts resident on the device, all layers."""
        return sum(len(r) for r in self.resident)

    @property
    def resident_bytes(self) -> int:
        """Device bytes of the resident experts."""
        return self.resident_count * self.blob_bytes

    @property
    def ring_bytes(self) -> int:
        """Device bytes of the ring."""
        return self.ring * self.blob_bytes

    @property
    def frames(self) -> int:
        """Frames in the ring (each a layer's, or a part's with `parts` > 1): the native
        layers that fetch take them in turn."""
        per = self.part_experts
        return self.ring // per if per else 0

    @property
    def part_experts(self) -> int:
        """Experts in one part of a layer (n_experts / parts): a frame's slots."""
        return self.streamed_mask.shape[1] // self.parts

    @property
    def native_layers(self) -> int:
        """Layers the native engine sees: each model layer's `parts` parts."""
        return self.streamed_mask.shape[0] * self.parts

    def native_layer(self, layer: int, part: int = 0) -> int:
        """The native engine's layer of part `part` of model layer `layer`."""
        return layer * self.parts + part

    def native_plan(self) -> tuple[list[tuple[int, int]], list[list[int]]]:
        """The plan in the native engine's layers (`native_layer`): its stream list of
        (native layer, expert within the part), in native-layer order and each layer's own
        order within it, and per native layer its resident experts within the part."""
        per = self.part_experts
        stream = sorted(((self.native_layer(l, e // per), e % per) for l, e in self.stream_list),
                        key=lambda entry: entry[0])  # stable: each part keeps its order
        resident: list[list[int]] = [[] for _ in range(self.native_layers)]
        for l, ids in enumerate(self.resident):
            for e in ids:
                resident[self.native_layer(l, e // per)].append(e % per)
        return stream, resident

    @property
    def max_streamed_per_layer(self) -> int:
        """The most experts one layer streams: what the ring must hold at least."""
        return int(self.streamed_per_layer.max(initial=0))


def _as_profile(config: ModelConfig, prof) -> "ExpertProfile | None":
    """StreamConfig.profile as an ExpertProfile checked against `config`, or None."""
    if prof is None:
        return None
    if isinstance(prof, ExpertProfile):
        return prof.check(config)
    counts = np.asarray(prof)
    L, E = config.n_layers, config.n_experts
    if counts.shape != (L, E):
        raise ValueError(
            f"expert profile has shape {counts.shape}; this model {config.name!r} needs ({L}, {E}) "
            "(a profile recorded on another model?)")
    if counts.size and not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"expert profile counts must be integers, got dtype {counts.dtype}")
    return ExpertProfile(counts, model=config.name, top_k=config.top_k).check(config)


def plan_stream(config: ModelConfig, stream: StreamConfig | None = None,
                blob_bytes: int | None = None, *, device_bytes: int | None = None,
                check_ring_budget: bool = True, devices: int = 1,
                device: int = 0) -> StreamPlan:
    """The stream plan of a model: resident experts, the stream order and the ring.

    Pure: reads neither the environment nor a device, and needs no native library. A
    NativeStreamer made with the same config follows exactly this plan.

    Rules:
      - Residents: `resident_budget_gib` (when given) is filled with the hottest experts of the
        whole model by `profile`, or without a profile spread evenly over the MoE layers (the
        lowest ids of each); else `resident_per_layer` experts per MoE layer (the hottest by
        `profile`, else the lowest ids).
      - The stream list: every other expert of each MoE layer, in layer order, hottest first
        within a layer (ties by the lower id; without a profile, by id).
      - The ring: whole layer frames of n_experts slots (a layer's experts are read where they
        land, resident ones copied in, so a frame holds a whole layer). `ring` slots when given
        (at least one layer's streamed experts), rounded down to whole frames, at least one;
        else two frames (one layer plus a layer of read-ahead), capped by `ring_budget_gib`,
        and never fewer than one; one frame when nothing streams. Where the budget holds less
        than one layer frame, each layer in the fewest equal parts of which two frames fit
        (`StreamTuning.parts`, which may also fix them): as many frames of n_experts / parts
        slots as the budget holds, up to two layers' worth.

    Args:
        config: The model config.
        stream: The StreamConfig whose ring (tuning.ring), ring_budget_gib, resident_per_layer,
            resident_budget_gib and profile are planned (default: StreamConfig()).
        blob_bytes: Bytes of one expert; default: the blob of the config's plain
            `ExpertFormat` (gate + up + down in its dtype).
        device_bytes: Memory of the device the residents go to, where known: a
            `resident_budget_gib` larger than it is refused.
        check_ring_budget: False returns a plan whose ring budget cannot hold one layer's
            streamed experts (with `ring_fits_budget=False` and a one-layer ring) instead of
            raising, for reports such as `strata-jax info`.
        devices, device: Expert parallelism over `devices` devices (`StreamerGroup`): the plan
            of device number `device`, over its slice [E*d/G, E*(d+1)/G) of every MoE layer in
            its own ids 0..E/G-1 (the profile's columns of the slice), with the resident
            budgets and the ring its own (each device has its own memory): the plan that
            device's engine follows.

    Raises:
        ValueError: a profile of another model (or not integer counts); a negative
            resident_per_layer or one above the experts of a layer; a negative resident budget,
            or one larger than `device_bytes`; a ring of fewer than one slot or than one
            frame's streamed experts; a ring budget that cannot hold one frame; parts that do
            not divide n_experts.
    """
    sc = StreamConfig() if stream is None else stream
    if devices != 1 or device != 0:
        slices = expert_slices(config.n_experts, devices)
        if isinstance(device, bool) or not isinstance(device, (int, np.integer)) \
                or not 0 <= device < devices:
            raise ValueError(f"device={device!r}: expected 0..{devices - 1}, one of the "
                             f"{devices} devices")
        lo, hi = slices[device]
        sc = dataclasses.replace(sc, profile=_local_profile(config, sc.profile, lo, hi,
                                                            min(config.top_k, hi - lo)))
        config = local_config(config, lo, hi)
    L, E = config.n_layers, config.n_experts
    moe_layers = tuple(config.moe_layers)
    if blob_bytes is None:
        blob_bytes = ExpertFormat.of(config).blob_bytes
    blob_bytes = int(blob_bytes)
    if blob_bytes < 1:
        raise ValueError(f"blob_bytes={blob_bytes}: an expert takes at least one byte")
    _check_ints(sc)
    if sc.resident_per_layer < 0:
        raise ValueError(f"resident_per_layer={sc.resident_per_layer}: must be >= 0")

    profile = _as_profile(config, sc.profile)
    order = {l: (profile.order(l) if profile is not None else list(range(E)))
             for l in moe_layers}  # hottest first; without a profile the lowest ids
    resident: list[list[int]] = [[] for _ in range(L)]
    if sc.resident_budget_gib is not None:
        budget_gib = float(sc.resident_budget_gib)
        if not budget_gib >= 0:
            raise ValueError(f"resident_budget_gib={sc.resident_budget_gib}: must be >= 0 "
                             "(GiB of device memory for resident experts)")
        if device_bytes is not None and budget_gib * 2**30 > device_bytes:
            raise ValueError(
                f"resident_budget_gib={budget_gib:g} is larger than the device "
                f"({device_bytes / 2**30:.1f} GiB in all); give at most what is left after "
                "the dense weights, KV cache and ring")
        if profile is not None:
            resident = profile.resident_set(config, budget_gib, blob_bytes)
        else:
            budget = int(budget_gib * 2**30) // blob_bytes
            per = budget // max(len(moe_layers), 1)
            for l in moe_layers:
                resident[l] = [int(e) for e in order[l][:min(per, E)]]
    elif sc.resident_per_layer:
        if sc.resident_per_layer > E:
            raise ValueError(f"resident_per_layer={sc.resident_per_layer} exceeds the "
                             f"{E} experts of a layer")
        for l in moe_layers:
            resident[l] = [int(e) for e in order[l][:sc.resident_per_layer]]
    stream_list: list[tuple[int, int]] = []
    for l in moe_layers:
        res = set(resident[l])
        stream_list += [(l, int(e)) for e in order[l] if e not in res]

    # [L, E]: which experts cross the link; every chunk's stats are read against it.
    mask = np.zeros((L, E), bool)
    for l, e in stream_list:
        mask[l, e] = True
    per_layer = mask.sum(axis=1).astype(np.int64)
    mask.flags.writeable = False
    per_layer.flags.writeable = False

    parts = sc.tuning.parts
    if parts is not None and parts < 1:
        sc.tuning.checked()  # names the field
    if parts is not None and E and E % parts:
        raise ValueError(f"parts={parts} does not divide the {E} experts of a layer; take a "
                         f"divisor of {E} (StreamTuning.parts)")
    need = int(per_layer.max(initial=0))
    budget_slots, fits = None, True
    if sc.tuning.ring is not None:
        ring = int(sc.tuning.ring)
        parts = parts or 1
        per = E // parts if E else 1
        if ring < 1:
            raise ValueError(f"a ring of {ring} slots cannot work; it needs at least one slot")
        need_part = int(mask.reshape(L, parts, per).sum(axis=2).max(initial=0)) if E else 0
        if ring < need_part:
            what = "one layer's" if parts == 1 else f"one of {parts} parts of a layer:"
            raise ValueError(
                f"a ring of {ring} slots cannot hold {what} {need_part} streamed experts; "
                f"use StreamTuning(ring={need_part}) or more (plus read-ahead: {2 * per}), "
                "or more parts (StreamTuning.parts)")
        frames = max(1, ring // per) if E else 1
    else:
        if not float(sc.ring_budget_gib) >= 0:
            raise ValueError(f"ring_budget_gib={sc.ring_budget_gib}: must be >= 0 (GiB of "
                             "device memory for the ring)")
        budget_slots = int(sc.ring_budget_gib * 2**30) // blob_bytes
        if need == 0:
            frames, parts = 1, parts or 1
        else:
            if parts is None:  # whole layers where a frame fits, else the fewest parts of
                parts = 1      # which two frames fit (one being read, the next landing)
                if budget_slots < E:
                    parts = next((d for d in range(2, E + 1)
                                  if E % d == 0 and budget_slots >= 2 * (E // d)), E)
            per = E // parts
            fits = budget_slots >= per
            if not fits and check_ring_budget:
                frame = (f"one layer frame of {E} experts ({E * blob_bytes / 2**30:.2f} GiB: a "
                         "layer is read where it lands, its resident experts copied in)"
                         if parts == 1 else
                         f"one frame of {per} expert{'s' if per != 1 else ''} (a layer of "
                         f"{E} in {parts} parts)")
                raise ValueError(
                    f"ring_budget_gib={sc.ring_budget_gib} holds {budget_slots} experts of "
                    f"{blob_bytes / 2**20:.1f} MiB, fewer than {frame}; raise the budget")
            # two frames of whole layers; parts take what the budget holds, up to two
            # layers' worth (more parts of read-ahead)
            frames = max(1, min(2 if parts == 1 else 2 * parts, budget_slots // per))
    ring = frames * max(E // parts, 1)
    return StreamPlan(
        resident=tuple(tuple(sorted(r)) for r in resident), stream_list=tuple(stream_list),
        streamed_mask=mask, streamed_per_layer=per_layer, ring=ring, blob_bytes=blob_bytes,
        ring_budget_slots=budget_slots, ring_fits_budget=fits, parts=parts)


def local_config(config: ModelConfig, lo: int, hi: int) -> ModelConfig:
    """`config` as one engine of a group sees it: experts lo..hi-1 of every MoE layer as its
    experts 0..hi-lo-1 (`n_experts` = hi - lo; `top_k` at most that, routing groups off: the
    engine moves experts and does no routing). Everything else is the model's."""
    n = hi - lo
    return dataclasses.replace(config, n_experts=n, top_k=min(config.top_k, n), n_groups=1,
                               topk_groups=1)


def _local_profile(config: ModelConfig, profile, lo: int, hi: int, top_k: int):
    """StreamConfig.profile (an ExpertProfile or its counts) over experts lo..hi-1 only."""
    prof = _as_profile(config, profile)  # checked against the whole model
    if prof is None:
        return None
    return ExpertProfile(prof.counts[:, lo:hi], model=config.name, top_k=top_k,
                         tokens=prof.tokens)
