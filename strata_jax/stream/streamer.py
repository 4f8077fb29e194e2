"""The expert stream: switches, the host store, the native engine and its JAX ops.

A `StreamEngine` owns one native engine (ffi/src/engine.hpp): the host expert
store, the ring, the issuer thread and the route gate. Inside a jitted chunk,
`StreamedExperts` is the model's expert source: after each MoE layer's router
it publishes the layer's per-expert counts (`publish`) and takes the layer's
full expert weights from the stream (`fetch`); `begin`/`end` bracket the
chunk. The four are XLA FFI custom calls threaded by a token so XLA keeps
their order; the same names are registered for "cpu" (simulated link) and
"CUDA".

`plan_stream` is the plan an engine follows (which experts stay resident, the stream
order, the ring); it is pure, so `strata-jax info` reports it without a device or the
native library.

The failure this guards against: an expert the chunk needs that is not where
the math reads it. Every routed expert's bytes arrive unchanged, skipped
experts have no token, so the outputs are the same bits in every mode.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import warnings
import weakref
from typing import TYPE_CHECKING, Callable, Sequence

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from .. import _dlpack, native
from ..config import ModelConfig
from ..experts import ExpertWeights, blob_size, pack_expert_blobs_np
from ..grouped_matmul import MGPU_BLOCK_M, resolve_implementation, row_pieces

if TYPE_CHECKING:  # pragma: no cover
    from ..profile import ExpertProfile

__all__ = [
    "StreamConfig",
    "StreamPlan",
    "plan_stream",
    "StreamEngine",
    "StreamedExperts",
    "ChunkStats",
    "DEPTH_MIN",
    "DEPTH_MAX",
]

DEPTH_MIN, DEPTH_MAX = 1, 256
_ENV_ROUTED = "STRATA_PREFILL_ROUTED_STREAM"
_ENV_DEPTH = "STRATA_PREFILL_ROUTED_STREAM_DEPTH"
_ENV_TRACE = "STRATA_TRACE"
_ENV_PUBLISH = "STRATA_PUBLISH"
_PIN_MODES = {"register": 0, "arena": 1, "none": 2}
_PUBLISH_MODES = {"callback": 0, "event": 1}
# begin_chunk's modes (ffi/src/engine.hpp ChunkMode): a streamed chunk in layer frames, a
# routed-only chunk (frames too), a streamed chunk in the packed ring.
_MODE_STREAM, _MODE_ROUTED_ONLY, _MODE_STREAM_PACKED = 0, 1, 2
_STREAM_MODES = (_MODE_STREAM, _MODE_STREAM_PACKED)
_LAYOUTS = ("auto", "frames", "packed")


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """How experts stream. Environment overrides are read once, when an engine is made.

    Attributes:
        routed: The routed switch: skip ring entries whose layer's routing
            landed before they were issued and whose expert no token routes
            to, and keep at most `depth` copies queued. Overridden by
            STRATA_PREFILL_ROUTED_STREAM=0/1.
        depth: Copies queued ahead of the link with the switch on; clamped to
            1..256 with a warning. Overridden by STRATA_PREFILL_ROUTED_STREAM_DEPTH.
        ring: Ring slots, in whole layer frames of `n_experts` slots (rounded down, at least
            one): each MoE layer's experts land in row e of the frame it takes (layers take
            frames in turn), and the model reads the frame where they landed. None: two
            frames (one layer plus a layer of read-ahead), capped by `ring_budget_gib`.
        ring_budget_gib: Device memory the ring may take when `ring` is None.
        layout: How a streamed chunk lays its copies out in the ring (the same memory either
            way; each chunk chooses, and end_chunk's trace and `ChunkStats.layout` say which):
            "frames": each expert split into the frame's three planes (gate, up, down) as it
            crosses the link, and on CUDA the model reads a layer's experts where they landed
            (JAX arrays over the ring's memory, by DLPack): nothing is copied on XLA's stream,
            but the link makes up to three copies per run of adjacent experts. Best where
            compute sets the pace (32K tokens on the H200: 1.03-1.04 of the floor, against
            1.05 packed). The CPU backend, whose XLA may run independent ops concurrently so
            that only a data dependency orders a read after fetch, reads a copy of the frame.
            "packed": whole blobs, one copy per run of adjacent experts on the link, and fetch
            splits each run into outputs of its own on the device as it lands. Best where the
            link sets the pace (routed 1K-6K: 1.03-1.04 of the floor, against up to 1.06 with
            frames). "auto": packed for chunks shorter than `frames_from` tokens, frames
            from there on. Routed-only chunks (below `stream_floor`) copy into frames either
            way. docs/BENCHMARKS.md, tenth session.
        frames_from: "auto"'s crossover in tokens. Frames pay off once the chunk's compute
            outlasts its copies, and packed until its split no longer hides behind the link: on
            the H200 with Qwen3-30B-A3B shapes (8 layers, 9.66 GB streamed) resident compute
            reaches the stream's 174 ms near 29K tokens; at 16K packed read 1.051 of the floor
            against 1.057 for frames (routed; stream-all equal), at 32K frames 1.039 against
            1.050. Measure a model's own with `stream_bench --layout frames|packed`.
        tail_pieces: In a streamed chunk of at least `tail_from` tokens, the last MoE
            layer's expert math runs in this many pieces of its rows (sorted by expert), each
            after a fetch that waits only for the copies of the experts with rows in it, so
            that only the last piece's math follows the chunk's last copy (1: the layer whole).
            The pieces give the same bits (each row keeps its expert and its math). Each piece
            costs the Mosaic grouped matmul's per-expert tiles again, hence a floor on the
            length, and at most one piece per `n_experts` row tiles (128 rows) of the chunk
            there (`StreamEngine.tail_pieces`). H200, Qwen3-30B-A3B shapes: routed 1.033-1.039
            of its floor at 12K-24K with 4 pieces, against 1.051-1.064 whole (BENCHMARKS.md,
            eleventh session).
        tail_from: The shortest streamed chunk, in tokens, whose last MoE layer runs in
            `tail_pieces` pieces.
        stream_floor: Chunks shorter than this many tokens use routed-only
            fetch (wait for the routing, copy only the routed experts).
        resident_per_layer: Experts kept resident on the device per MoE layer
            (the hottest by `profile`, else the lowest ids).
        resident_budget_gib: Alternatively, device memory for resident experts;
            the hottest experts by `profile` (globally) fill it.
        profile: An ExpertProfile (strata_jax.profile) or its counts, int
            [n_layers, n_experts]: orders each layer's stream list hottest first
            (ties by the lower id) and chooses the residents. A profile of
            another model's shape is refused when the engine (or its plan,
            `plan_stream`) is made.
        backend: "auto" (CUDA when JAX runs on a GPU and the library has CUDA),
            "cpu" (simulated link) or "cuda".
        pin: CUDA host store: "arena" (packed straight into one cudaHostAlloc
            block; the fastest source, measured 1% over registered memory),
            "register" (cudaHostRegister the packed arrays in place) or "none"
            (stage through pinned bounce buffers; such entries are never
            skipped). A store that cannot be pinned falls back to staging and
            the trace says so.
        publish: How a layer's routing reaches the issuer on CUDA: "event" (an event recorded
            on XLA's stream after the counts' device-to-host copy, which the issuer polls before
            it fills the gate row itself; nothing waits) or "callback" (DESIGN.md's first
            design: a host callback, cudaLaunchHostFunc, fills the row; XLA's stream waits until
            a driver thread has run it). On the H200 the callback stalled the device 116 us per
            layer more than the event, and its threads grew without bound over a 210-chunk
            stress (docs/BENCHMARKS.md), hence the default. Overridden by
            STRATA_PUBLISH=callback|event. The CPU backend publishes in the handler either way.
        sim_bandwidth: Simulated link bandwidth in bytes/s (CPU backend); 0 is unlimited.
        sim_latency: Simulated per-copy latency in seconds (CPU backend).
        sim_jitter: Up to this many extra seconds per copy, uniform (CPU backend).
        seed: Seed of the simulated link's jitter.
        trace: Print per-chunk copied/skipped lines; None reads STRATA_TRACE.
        device: CUDA device ordinal; the JAX GPU of this index is where the
            residents, the ring and the model are (StreamEngine.jax_device).
    """

    routed: bool = True
    depth: int = 16
    ring: int | None = None
    ring_budget_gib: float = 4.0
    layout: str = "auto"
    frames_from: int = 24576
    tail_pieces: int = 4
    tail_from: int = 8192
    stream_floor: int = 1024
    resident_per_layer: int = 0
    resident_budget_gib: float | None = None
    profile: "ExpertProfile | np.ndarray | None" = dataclasses.field(
        default=None, compare=False, hash=False)
    backend: str = "auto"
    pin: str = "arena"
    publish: str = "event"
    sim_bandwidth: float = 2e9
    sim_latency: float = 20e-6
    sim_jitter: float = 0.0
    seed: int = 0
    trace: bool | None = None
    device: int = 0

    def resolved(self) -> "StreamConfig":
        """Applies the environment overrides and clamps; warns on clamping."""
        _check_int_fields(self)
        routed, depth, trace = self.routed, self.depth, self.trace
        env = os.environ.get(_ENV_ROUTED)
        if env is not None and env.strip() != "":
            if env.strip() not in ("0", "1"):
                raise ValueError(f"{_ENV_ROUTED}={env!r}: expected 0 or 1")
            routed = env.strip() == "1"
        env = os.environ.get(_ENV_DEPTH)
        source = "depth"
        if env is not None and env.strip() != "":
            try:
                depth = int(env)
            except ValueError:
                raise ValueError(f"{_ENV_DEPTH}={env!r}: expected an integer 1..256") from None
            source = _ENV_DEPTH
        used = min(max(int(depth), DEPTH_MIN), DEPTH_MAX)
        if used != depth:
            warnings.warn(
                f"{source}={depth} is outside {DEPTH_MIN}..{DEPTH_MAX}; using {used}",
                stacklevel=3)
        if trace is None:
            trace = os.environ.get(_ENV_TRACE, "0").strip() not in ("", "0")
        publish = self.publish
        env = os.environ.get(_ENV_PUBLISH)
        if env is not None and env.strip() != "":
            publish = env.strip()
            if publish not in _PUBLISH_MODES:
                raise ValueError(f"{_ENV_PUBLISH}={env!r}: expected one of "
                                 f"{sorted(_PUBLISH_MODES)}")
        if publish not in _PUBLISH_MODES:
            raise ValueError(f"publish={publish!r}: expected one of {sorted(_PUBLISH_MODES)}")
        if self.pin not in _PIN_MODES:
            raise ValueError(f"pin={self.pin!r}: expected one of {sorted(_PIN_MODES)}")
        if self.backend not in ("auto", "cpu", "cuda"):
            raise ValueError(f"backend={self.backend!r}: expected 'auto', 'cpu' or 'cuda'")
        if self.stream_floor < 1:
            raise ValueError(f"stream_floor={self.stream_floor}: must be at least 1")
        if self.layout not in _LAYOUTS:
            raise ValueError(f"layout={self.layout!r}: expected one of {list(_LAYOUTS)}")
        if self.frames_from < 1:
            raise ValueError(f"frames_from={self.frames_from}: must be at least 1 (a chunk "
                             f"length in tokens; layout='frames' or 'packed' fixes one layout)")
        if self.tail_pieces < 1:
            raise ValueError(f"tail_pieces={self.tail_pieces}: must be at least 1 (1 runs the "
                             f"last MoE layer whole)")
        if self.tail_from < 1:
            raise ValueError(f"tail_from={self.tail_from}: must be at least 1 (a chunk length "
                             f"in tokens)")
        if self.resident_per_layer < 0:
            raise ValueError(f"resident_per_layer={self.resident_per_layer}: must be >= 0")
        return dataclasses.replace(self, routed=routed, depth=used, trace=bool(trace),
                                   publish=publish)


# StreamConfig's integer fields and what each takes (the ValueError's wording).
_INT_FIELDS = {
    "depth": f"an integer {DEPTH_MIN}..{DEPTH_MAX}",
    "ring": "an integer (ring slots) or None",
    "frames_from": "an integer >= 1 (tokens)",
    "tail_pieces": "an integer >= 1",
    "tail_from": "an integer >= 1 (tokens)",
    "stream_floor": "an integer >= 1 (tokens)",
    "resident_per_layer": "an integer >= 0",
    "seed": "an integer",
    "device": "an integer (a CUDA device ordinal)",
}


def _check_int_fields(sc: StreamConfig) -> None:
    """A ValueError naming the option for an integer field given anything else (a str, a float,
    a bool), instead of int()'s or a comparison's bare message."""
    for name, expected in _INT_FIELDS.items():
        value = getattr(sc, name)
        if value is None and name == "ring":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name}={value!r}: expected {expected}")


@dataclasses.dataclass
class ChunkStats:
    """What one chunk streamed, per MoE layer (numpy int64 arrays over model layers).

    `unrouted` counts streamed experts with no token; `skipped` those the walk
    did not copy (a subset of unrouted, never a routed one).
    """

    tokens: int
    mode: str  # "stream" or "routed-only"
    layout: str  # how the chunk laid the ring out: "frames" or "packed" (StreamConfig.layout)
    tail_pieces: int  # pieces its last MoE layer ran in (StreamConfig.tail_pieces)
    streamed: np.ndarray
    copied: np.ndarray
    skipped: np.ndarray
    unrouted: np.ndarray
    bytes: np.ndarray

    def totals(self) -> dict:
        return {
            "streamed": int(self.streamed.sum()),
            "copied": int(self.copied.sum()),
            "skipped": int(self.skipped.sum()),
            "unrouted": int(self.unrouted.sum()),
            "bytes": int(self.bytes.sum()),
        }


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """Where each expert of a model lives, and the ring that carries the streamed ones.

    Made by `plan_stream`; a StreamEngine follows it, and `strata-jax info` reports it.

    Attributes:
        resident: Per model layer, the sorted ids of the experts kept on the device (empty for
            dense layers).
        stream_list: The (layer, expert) entries of one chunk's stream, in layer order and
            hottest first within a layer (by the profile; without one, the lowest ids).
        streamed_mask: bool [n_layers, n_experts], read-only: which experts cross the link.
        streamed_per_layer: int64 [n_layers], read-only: streamed experts per layer.
        ring: Ring slots, `frames` layer frames of n_experts slots each.
        blob_bytes: Bytes of one expert (one ring slot).
        ring_budget_slots: Slots `ring_budget_gib` holds, or None when the ring was given.
        ring_fits_budget: False only for a plan made with `check_ring_budget=False` whose ring
            budget cannot hold one layer frame (`ring` is then one frame).
    """

    resident: tuple[tuple[int, ...], ...]
    stream_list: tuple[tuple[int, int], ...]
    streamed_mask: np.ndarray = dataclasses.field(compare=False, repr=False)
    streamed_per_layer: np.ndarray = dataclasses.field(compare=False, repr=False)
    ring: int
    blob_bytes: int
    ring_budget_slots: int | None = None
    ring_fits_budget: bool = True

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
        """Layer frames in the ring: MoE layer number i (in order) uses frame i % frames."""
        n_experts = self.streamed_mask.shape[1]
        return self.ring // n_experts if n_experts else 0

    @property
    def max_streamed_per_layer(self) -> int:
        """The most experts one layer streams: what the ring must hold at least."""
        return int(self.streamed_per_layer.max(initial=0))


def _as_profile(config: ModelConfig, prof) -> "ExpertProfile | None":
    """StreamConfig.profile as an ExpertProfile checked against `config`, or None."""
    from ..profile import ExpertProfile

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
                check_ring_budget: bool = True) -> StreamPlan:
    """The stream plan of a model: resident experts, the stream order and the ring.

    Pure: reads neither the environment nor a device, and needs no native library. A
    StreamEngine made with the same config follows exactly this plan.

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
        and never fewer than one; one frame when nothing streams.

    Args:
        config: The model config.
        stream: The StreamConfig whose ring, ring_budget_gib, resident_per_layer,
            resident_budget_gib and profile are planned (default: StreamConfig()).
        blob_bytes: Bytes of one expert; default: the config's (gate + up + down in its dtype).
        device_bytes: Memory of the device the residents go to, where known: a
            `resident_budget_gib` larger than it is refused.
        check_ring_budget: False returns a plan whose ring budget cannot hold one layer's
            streamed experts (with `ring_fits_budget=False` and a one-layer ring) instead of
            raising, for reports such as `strata-jax info`.

    Raises:
        ValueError: a profile of another model (or not integer counts); a negative
            resident_per_layer or one above the experts of a layer; a negative resident budget,
            or one larger than `device_bytes`; a ring of fewer than one slot or than one layer's
            streamed experts; a ring budget that cannot hold one layer frame.
    """
    sc = StreamConfig() if stream is None else stream
    L, E = config.n_layers, config.n_experts
    moe_layers = tuple(config.moe_layers)
    if blob_bytes is None:
        blob_bytes = blob_size(config.hidden_size, config.expert_intermediate) * \
            np.dtype(config.dtype).itemsize
    blob_bytes = int(blob_bytes)
    if blob_bytes < 1:
        raise ValueError(f"blob_bytes={blob_bytes}: an expert takes at least one byte")
    _check_int_fields(sc)
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

    need = int(per_layer.max(initial=0))
    budget_slots, fits = None, True
    if sc.ring is not None:
        ring = int(sc.ring)
        if ring < 1:
            raise ValueError(f"a ring of {ring} slots cannot work; it needs at least one slot")
        if ring < need:
            raise ValueError(
                f"a ring of {ring} slots cannot hold one layer's {need} streamed experts; "
                f"use ring >= {need} (one layer plus read-ahead: {2 * E})")
        frames = max(1, ring // E) if E else 1
    else:
        if not float(sc.ring_budget_gib) >= 0:
            raise ValueError(f"ring_budget_gib={sc.ring_budget_gib}: must be >= 0 (GiB of "
                             "device memory for the ring)")
        budget_slots = int(sc.ring_budget_gib * 2**30) // blob_bytes
        budget_frames = budget_slots // E if E else 1
        if need == 0:
            frames = 1
        else:
            fits = budget_frames >= 1
            if not fits and check_ring_budget:
                raise ValueError(
                    f"ring_budget_gib={sc.ring_budget_gib} holds {budget_slots} experts of "
                    f"{blob_bytes / 2**20:.1f} MiB, fewer than one layer frame of {E} experts "
                    f"({E * blob_bytes / 2**30:.2f} GiB: a layer is read where it lands, its "
                    "resident experts copied in); raise the budget")
            frames = max(1, min(2, budget_frames))
    ring = frames * max(E, 1)
    return StreamPlan(
        resident=tuple(tuple(sorted(r)) for r in resident), stream_list=tuple(stream_list),
        streamed_mask=mask, streamed_per_layer=per_layer, ring=ring, blob_bytes=blob_bytes,
        ring_budget_slots=budget_slots, ring_fits_budget=fits)


def _check(rc: int, err: ctypes.Array, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"strata engine: {what}: {err.value.decode(errors='replace')}")


def _choose_backend(requested: str) -> str:
    platform = jax.default_backend()
    if requested == "auto":
        return "cuda" if platform == "gpu" and native.has_cuda() else "cpu"
    if requested == "cuda":
        if not native.has_cuda():
            raise RuntimeError(
                "backend='cuda' but strata_jax was built without CUDA support; install the "
                "CUDA toolkit and reinstall (`pip install --no-build-isolation -e .`)")
        if platform != "gpu":
            raise RuntimeError(
                f"backend='cuda' but JAX's default backend is {platform!r}; install jax[cuda12] "
                "or use backend='cpu'")
    return requested


def stream_platform(backend: str) -> str:
    """The JAX platform ("cpu" or "gpu") a stream backend ("auto", "cpu", "cuda") runs on:
    the simulated link's ring is host memory, the CUDA ring is on the GPU; "auto" is
    decided as a StreamEngine decides it."""
    if backend == "auto":
        backend = _choose_backend(backend)
    return "gpu" if backend == "cuda" else "cpu"


class StreamEngine:
    """A native streaming engine for one model: host store, ring, issuer, gate.

    Args:
        config: The model config.
        experts: Per model layer, that layer's routed experts as numpy
            ExpertWeights (host memory), or None for dense layers.
        stream: StreamConfig (environment overrides applied here, once).
        progress: Called as progress(done_layers, total_layers) as each MoE layer's experts
            are packed into the host store (long for a full-size model).

    The engine follows `plan_stream(config, stream)` (its `plan`; the residents, stream list
    and ring are also its attributes `resident`, `stream_list`, `streamed_mask`,
    `streamed_per_layer` and `ring`), refusing a resident budget larger than the device where
    the backend reports the device's size.

    The host store keeps one contiguous blob per expert so one copy moves it.
    Close the engine (or use it as a context manager) to stop its threads and
    free its memory; it is also closed when garbage-collected.
    """

    def __init__(self, config: ModelConfig,
                 experts: Sequence[ExpertWeights | np.ndarray | None],
                 stream: StreamConfig | None = None, *,
                 progress: Callable[[int, int], object] | None = None):
        native.register_targets()
        self.config = config
        self.stream = (stream or StreamConfig()).resolved()
        self.backend = _choose_backend(self.stream.backend)
        self.platform = stream_platform(self.backend)
        L, E = config.n_layers, config.n_experts
        if len(experts) != L:
            raise ValueError(f"experts has {len(experts)} layers; the model has {L}")
        self.dtype = np.dtype(config.dtype)
        self.blob_elems = blob_size(config.hidden_size, config.expert_intermediate)
        self.blob_bytes = self.blob_elems * self.dtype.itemsize
        self.moe_layers = tuple(config.moe_layers)
        # The plan (plan_stream): residents, the stream order, the ring. The device check of a
        # resident budget needs the device, so only the engine makes it. Planned before
        # packing: a bad plan is refused before any host memory is pinned.
        device_bytes = (self._device_memory_bytes()
                        if self.stream.resident_budget_gib is not None else None)
        self.plan = plan_stream(config, self.stream, self.blob_bytes, device_bytes=device_bytes)
        self.resident = [list(r) for r in self.plan.resident]
        self.stream_list = list(self.plan.stream_list)
        # [L, E]: which experts cross the link. Static for the engine's life; every chunk's
        # stats are read against it.
        self.streamed_mask = self.plan.streamed_mask
        self.streamed_per_layer = self.plan.streamed_per_layer
        self.ring = self.plan.ring
        self._stores: list[np.ndarray | None] = [None] * L
        # Pin mode "arena" on CUDA: pack every layer straight into one pinned block, which the
        # engine then copies from in place (no cudaHostRegister, no second host copy).
        self._pinned = None
        arena = None
        if self.backend == "cuda" and self.stream.pin == "arena":
            arena = self._pinned_arena(len(self.moe_layers) * E * self.blob_bytes)
        try:
            for layer in range(L):
                w = experts[layer]
                if layer not in self.moe_layers:
                    if w is not None:
                        raise ValueError(f"layer {layer} is dense but experts were given for it")
                    continue
                if w is None:
                    raise ValueError(f"MoE layer {layer} has no expert weights")
                store = self._pack(layer, w)
                if arena is not None:
                    i = self.moe_layers.index(layer)
                    dst = arena[i * E * self.blob_bytes:(i + 1) * E * self.blob_bytes]
                    dst = dst.reshape(E, self.blob_bytes)
                    dst[...] = store
                    store = dst
                self._stores[layer] = store
                if progress is not None:
                    progress(self.moe_layers.index(layer) + 1, len(self.moe_layers))
        except BaseException:
            # No engine owns the pinned block yet: free it here (bad expert shapes, Ctrl-C).
            self._stores = [None] * L
            arena = None
            if self._pinned:
                native.lib().strata_pinned_free(self._pinned)
                self._pinned = None
            raise

        opts = native.EngineOptions(
            backend=1 if self.backend == "cuda" else 0,
            n_layers=L, n_experts=E, routed=int(self.stream.routed),
            blob_bytes=self.blob_bytes, ring=self.ring, depth=self.stream.depth,
            trace=int(self.stream.trace), sim_bandwidth=self.stream.sim_bandwidth,
            sim_latency=self.stream.sim_latency, sim_jitter=self.stream.sim_jitter,
            seed=self.stream.seed, pin_mode=_PIN_MODES[self.stream.pin],
            publish_mode=_PUBLISH_MODES[self.stream.publish],
            device=self.stream.device)
        lib = native.lib()
        err = ctypes.create_string_buffer(1024)
        self.id = int(lib.strata_engine_create(ctypes.byref(opts), err, len(err)))
        if self.id == 0:
            if self._pinned:
                lib.strata_pinned_free(self._pinned)
                self._pinned = None
            raise RuntimeError(f"strata engine: {err.value.decode(errors='replace')}")
        # The engine goes first: its copies read the pinned block.
        self.pid = os.getpid()  # the process whose threads serve this engine
        self._finalizer = weakref.finalize(self, _destroy, self.id, self._pinned, self.pid)
        for layer, store in enumerate(self._stores):
            if store is not None:
                _check(lib.strata_engine_set_store(self.id, layer, store.ctypes.data,
                                                   store.nbytes, err, len(err)),
                       err, f"host store of layer {layer}")
        layers = np.array([l for l, _ in self.stream_list], np.int32)
        exps = np.array([e for _, e in self.stream_list], np.int32)
        staged = np.zeros(len(self.stream_list), np.uint8)
        rl = np.array([l for l in range(L) for _ in self.resident[l]], np.int32)
        re_ = np.array([e for l in range(L) for e in self.resident[l]], np.int32)
        _check(lib.strata_engine_set_plan(
            self.id, layers.ctypes.data, exps.ctypes.data, staged.ctypes.data, len(layers),
            rl.ctypes.data, re_.ctypes.data, len(rl), err, len(err)), err, "stream plan")
        _check(lib.strata_engine_prepare(self.id, err, len(err)), err, "prepare")
        self._resident_blobs = self._put_resident()
        # The frame each MoE layer's experts land in, as the native engine assigns them (the
        # views the model reads must be those frames).
        self.frame_of = {l: int(lib.strata_engine_frame_of(self.id, l)) for l in self.moe_layers}
        self.frames_note = ""
        self._frames = self._frame_views()

    def _frame_views(self) -> tuple[ExpertWeights, ...] | None:
        """The ring's layer frames as JAX arrays over the ring's memory, frame f's gate/up
        [E, H, I] and down [E, I, H]: what the model reads a layer's experts from in a frames
        chunk (StreamConfig.layout, CUDA). None where fetch copies the frame out instead (or
        no chunk uses frames), with the reason in `frames_note`."""
        if self.stream.layout == "packed" and self.stream.stream_floor <= 1:
            self.frames_note = "every chunk uses the packed ring: fetch splits its blobs out"
            return None
        if self.backend != "cuda":
            self.frames_note = "layer frames, read through a copy (CPU backend)"
            return None
        c, E = self.config, self.config.n_experts
        h, i = c.hidden_size, c.expert_intermediate
        planes = (ctypes.c_void_p * 3)()
        n = ctypes.c_int64()
        if native.lib().strata_engine_frames(self.id, planes, ctypes.byref(n)) != 0:
            raise RuntimeError(f"strata engine {self.id}: no ring frames (engine closed?)")
        part = h * i * self.dtype.itemsize
        shapes = ((E, h, i), (E, h, i), (E, i, h))
        frames = []
        try:
            for f in range(int(n.value)):
                frames.append(ExpertWeights(*(
                    _dlpack.view(int(planes[p]) + f * E * part, shapes[p], self.dtype,
                                 self.jax_device) for p in range(3))))
        except (RuntimeError, TypeError) as e:
            for w in frames:
                for a in w:
                    a.delete()
            self.frames_note = f"fetch copies each frame out: {e}"
            warnings.warn(f"strata: the model cannot read the ring in place, so fetch copies "
                          f"each layer out of it (slower): {e}", RuntimeWarning, stacklevel=3)
            return None
        self.frames_note = "the model reads each layer's experts in its ring frame"
        return tuple(frames)

    @property
    def frames(self) -> tuple[ExpertWeights, ...] | None:
        """The ring's frames as JAX arrays read in place (`_frame_views`), or None."""
        return self._frames

    @property
    def read_in_place(self) -> bool:
        """Whether a frames chunk's model reads the ring in place (else fetch copies out)."""
        return self._frames is not None

    def layout(self, n_tokens: int) -> str:
        """How a chunk of `n_tokens` tokens lays the ring out: "frames" or "packed"
        (StreamConfig.layout; routed-only chunks use frames)."""
        if n_tokens < self.stream.stream_floor or self.stream.layout == "frames":
            return "frames"
        if self.stream.layout == "packed" or n_tokens < self.stream.frames_from:
            return "packed"
        return "frames"

    def _pinned_arena(self, nbytes: int) -> np.ndarray | None:
        """One pinned host block of `nbytes` as a uint8 array, or None (the engine then pins
        or stages the packed arrays itself, and says which in its trace)."""
        if nbytes == 0:
            return None
        err = ctypes.create_string_buffer(512)
        ptr = native.lib().strata_pinned_alloc(nbytes, err, len(err))
        if not ptr:
            warnings.warn(f"pinned arena of {nbytes / 2**30:.2f} GiB not allocated "
                          f"({err.value.decode(errors='replace')}); the engine will pin or stage "
                          "the store instead", stacklevel=3)
            return None
        self._pinned = ptr
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    # -- planning -----------------------------------------------------------------------------

    def _pack(self, layer: int, w) -> np.ndarray:
        E, H, I = self.config.n_experts, self.config.hidden_size, self.config.expert_intermediate
        if isinstance(w, np.ndarray):
            blobs = w
            if blobs.shape != (E, self.blob_elems):
                raise ValueError(f"layer {layer} blobs have shape {blobs.shape}; "
                                 f"expected ({E}, {self.blob_elems})")
        else:
            shapes = {"gate": (E, H, I), "up": (E, H, I), "down": (E, I, H)}
            for name, want in shapes.items():
                got = tuple(np.shape(getattr(w, name)))
                if got != want:
                    raise ValueError(f"layer {layer} expert {name} has shape {got}; expected {want}")
            blobs = pack_expert_blobs_np(w)
        blobs = np.ascontiguousarray(blobs, dtype=self.dtype)
        return blobs.view(np.uint8).reshape(E, self.blob_bytes)

    def _device_memory_bytes(self) -> int | None:
        """Total memory of the device the residents go to, where the backend reports it."""
        if self.backend != "cuda":
            return None  # the simulated device is host memory: no device-size check
        try:
            stats = jax.devices("gpu")[self.stream.device].memory_stats() or {}
        except (RuntimeError, IndexError):
            return None
        limit = stats.get("bytes_limit")
        return int(limit) if limit else None

    def _put_resident(self) -> dict[int, jax.Array]:
        device = self.jax_device
        out = {}
        for l in self.moe_layers:
            rows = self._stores[l][self.resident[l]].view(self.dtype)  # [R, blob]
            out[l] = jax.device_put(np.ascontiguousarray(rows), device)
        return out

    # -- properties ---------------------------------------------------------------------------

    @property
    def jax_device(self) -> jax.Device:
        """The JAX device the residents and the ring are on, where the model must run: the GPU
        of ordinal `StreamConfig.device` on CUDA, the CPU device on the simulated link."""
        if self.backend == "cuda":
            return jax.devices("gpu")[self.stream.device]
        return jax.devices("cpu")[0]

    @property
    def resident_blobs(self) -> dict[int, jax.Array]:
        return self._resident_blobs

    def walk_active(self) -> bool:
        return bool(native.lib().strata_engine_walk_active(self.id))

    def depth(self) -> int:
        return int(native.lib().strata_engine_depth(self.id))

    def hold(self) -> int:
        """Entries a prestarted walk may run ahead of its landed copies until the program
        adopts it (`prestart`); 0 when the walk is not held."""
        return int(native.lib().strata_engine_hold(self.id))

    def abort(self) -> None:
        """Stops the current chunk's walk, if any; the engine stays usable. Call it only when
        no chunk of this engine is queued or running (else `cancel` first, then wait)."""
        native.lib().strata_engine_abort(self.id)

    def prestart(self, n_tokens: int) -> None:
        """Begins the chunk of `n_tokens` tokens the caller is about to dispatch, from the host,
        so its walk and the link start while the program is still being launched; the program's
        begin_chunk adopts the walk. Until then the walk stays a few copies (the native
        kPrestartHold, 32 entries) ahead of those landed, so a copy another stream queues
        meanwhile (a caller's; the prefill makes none of its own, see `stage_ids`) meets a
        shallow queue. Only with no chunk of this engine queued (a prefill's first chunk); an
        abort, or a begin_chunk of another mode, drops it. A prestart no program adopts keeps
        its walk (and the engine's chunk) open until `abort` or the next begin_chunk;
        `Engine.prefill` always ends one."""
        err = ctypes.create_string_buffer(1024)
        rc = native.lib().strata_engine_prestart(self.id, self.chunk_mode(n_tokens), err,
                                                 len(err))
        _check(rc, err, "prestart")

    def stage_ids(self, ids: np.ndarray, *, reset: bool = False) -> None:
        """Hands the engine chunks' token ids before the chunks are dispatched: their program
        inputs, in dispatch order, as one int32 array (`Engine` stages each chunk's padded ids,
        start and length). They join a queue; each begin_chunk takes the next ones (`begin`'s
        `n_ids`), in the order the chunks were dispatched, and writes them on the device by
        kernels whose arguments carry them, on XLA's own stream. A begin_chunk that fails
        uses its ids up all the same, so the chunks queued after it keep theirs.

        So a streamed prefill makes no host-to-device copy of its own: on the H200 one queued
        on another stream waited for the walk's copies to drain (44 ms at 32K tokens), and
        placing the ids before the walk instead cost about 1 ms per prefill.

        reset: drop the ids left in the queue first (`clear_ids`); only with no chunk of this
            engine queued, else a queued chunk would take another's ids.

        Raises:
            ValueError: `ids` is not a one-dimensional integer array within int32.
            RuntimeError: the engine is closed.
        """
        if self.closed:
            raise RuntimeError("stage_ids: the engine was closed; make a new one")
        a = np.asarray(ids)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise ValueError(f"stage_ids takes a 1-D integer array, not {a.dtype} {a.shape}")
        if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
            raise ValueError("stage_ids: ids outside int32")
        a = np.ascontiguousarray(a, np.int32)
        err = ctypes.create_string_buffer(1024)
        rc = native.lib().strata_engine_stage_ids(self.id, a.ctypes.data, a.size, int(reset),
                                                  err, len(err))
        _check(rc, err, "stage_ids")

    def clear_ids(self) -> None:
        """Drops the staged ids no begin_chunk has taken (a prefill that failed leaves its
        cancelled chunks' behind); only with no chunk of this engine queued. Nothing to do on
        a closed engine."""
        if not self.closed:
            self.stage_ids(np.zeros(0, np.int32), reset=True)

    def cancel(self, on: bool = True) -> None:
        """Safe while chunks are queued: stops the running chunk's walk and fails every later
        begin_chunk until `cancel(False)`, so queued chunks end at once, in error."""
        native.lib().strata_engine_cancel(self.id, int(bool(on)))

    def inject_fault(self, layer: int, kind: str) -> None:
        """Test hook: fail ("error") or stop ("stop") the next fetch of `layer`."""
        kinds = {"none": 0, "error": 1, "stop": 2}
        if kind not in kinds:
            raise ValueError(f"fault kind {kind!r}: expected one of {sorted(kinds)}")
        native.lib().strata_engine_inject_fault(self.id, layer, kinds[kind])

    def device_timing(self) -> tuple[float, float, float, float] | None:
        """Device timing of the last finished chunk, in ms, or None.

        Returns (chunk, copy, lead, tail): begin_chunk to end_chunk on XLA's stream; the
        start of the chunk's first ring copy to the end of its last on the copy stream;
        begin to the first copy's start; the last copy's end to end_chunk (the last three
        are 0 when nothing was copied). A prestarted chunk (`prestart`) begins on the copy
        stream when the host began it, before its first copy: its chunk time covers the
        host's launch of the program too, and its lead is next to nothing. None on the CPU
        backend or before the chunk's device work has finished.
        """
        out = (ctypes.c_double * 4)()
        err = ctypes.create_string_buffer(256)
        if native.lib().strata_engine_timing(self.id, out, err, len(err)) != 0:
            return None
        return tuple(float(x) for x in out)

    def measure_link(self, nbytes: int = 256 * 2**20, reps: int = 10) -> float:
        """The link ceiling out of this engine's own store: the median GB/s of `reps` copies
        of `nbytes` (the benchmark's 256 MB) from the front of the pinned arena the ring reads,
        to a scratch device buffer, on a stream of their own (`native.measure_h2d_from`). A
        fresh probe buffer is other host memory and can read a different peak than these
        pages give; the benchmarks take the higher of the two.

        Raises:
            RuntimeError: the store is not in a pinned arena (the simulated link, or pin
                modes "register" / "none", or an arena that could not be allocated); a walk
                is running (it would share the link); or a CUDA call failed.
        """
        if self.closed:
            raise RuntimeError("measure_link: the engine was closed (its arena is freed); "
                               "make a new one")
        self.check_process()
        if self._pinned is None:
            raise RuntimeError(
                "measure_link reads the store's pinned arena, and this engine has none "
                f"(backend {self.backend!r}, pin {self.stream.pin!r}); use "
                "native.measure_h2d for a probe buffer of its own")
        if self.walk_active():
            raise RuntimeError("measure_link while a chunk's walk runs: it would share the "
                               "link with it; call it between prefills")
        size = len(self.moe_layers) * self.config.n_experts * self.blob_bytes
        return native.measure_h2d_from(self._pinned, min(int(nbytes), size), reps,
                                       device=self.stream.device)

    def host_times(self) -> tuple[float, float]:
        """Host clock (time.monotonic seconds) at which the last chunk began (its begin_chunk
        handler ran, or the host prestarted the chunk its program adopted) and at which its
        end_chunk handler ran; with the call's own monotonic times they split a prefill's wall
        time into host time before the device chunk, the chunk, and host time after it."""
        out = (ctypes.c_double * 2)()
        native.lib().strata_engine_host_times(self.id, out)
        return float(out[0]), float(out[1])

    def close(self) -> None:
        """Stops the threads and frees the engine. Idempotent."""
        self._stores = [None] * len(self._stores)  # may view the pinned block freed next
        # The frame views go before the ring they view (the engine's teardown synchronizes
        # the device first, so no program still reads them).
        for w in getattr(self, "_frames", None) or ():
            for a in w:
                if not a.is_deleted():
                    a.delete()
        self._frames = None
        self._finalizer()
        self._pinned = None  # freed by the finalizer

    def check_process(self) -> None:
        """Raises RuntimeError in a process forked after the engine was made: its issuer (and
        the simulated link's worker) stayed in the parent, so a chunk here would wait forever."""
        if os.getpid() != self.pid:
            raise RuntimeError(
                f"this engine's stream was made in process {self.pid}; this is process "
                f"{os.getpid()}, forked from it, and the stream's threads did not come along. "
                "Make a new Engine in this process (or start workers with the 'spawn' method).")

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def chunk_mode(self, n_tokens: int) -> int:
        """begin_chunk's mode for a chunk of `n_tokens` tokens: routed-only below the stream
        floor, else streamed in the chunk's `layout`."""
        if n_tokens < self.stream.stream_floor:
            return _MODE_ROUTED_ONLY
        return _MODE_STREAM_PACKED if self.layout(n_tokens) == "packed" else _MODE_STREAM

    def tail_pieces(self, mode: int, n_tokens: int) -> int:
        """Pieces the last MoE layer runs in, in a chunk of `mode` compiled for `n_tokens`
        tokens (its bucket; StreamConfig.tail_pieces): 1 for routed-only or short chunks.

        With the Mosaic grouped matmul, whose grid holds E - 1 tiles more than the rows' own
        whatever the rows, at most one piece per E row tiles of the chunk: a piece must hold
        at least as many tiles of its own as it adds (Qwen3-30B-A3B, 128 experts top-8: all
        four pieces from 8,192 tokens; 512 experts top-10: two from 13,108 tokens, four from
        26,215)."""
        if mode not in _STREAM_MODES or n_tokens < self.stream.tail_from or not self.moe_layers:
            return 1
        pieces = self.stream.tail_pieces
        if pieces > 1 and resolve_implementation() == "mgpu":
            tiles = n_tokens * self.config.top_k // MGPU_BLOCK_M
            pieces = min(pieces, tiles // self.config.n_experts)
        return max(pieces, 1)

    @property
    def tail_layer(self) -> int | None:
        """The layer `tail_pieces` applies to: the last MoE layer."""
        return max(self.moe_layers) if self.moe_layers else None

    def make_stats(self, n_tokens: int, native_stats: np.ndarray, counts: np.ndarray,
                   tail_pieces: int = 1) -> ChunkStats:
        """ChunkStats from end_chunk's output [L, 2] and the router counts [n_moe, E];
        `tail_pieces`: what the chunk's program used (`tail_pieces`)."""
        native_stats = np.asarray(native_stats, np.int64)
        copied, skipped = native_stats[:, 0], native_stats[:, 1]
        unrouted = np.zeros(self.config.n_layers, np.int64)
        idle = np.asarray(counts) == 0  # [n_moe, E]
        unrouted[list(self.moe_layers)] = (idle & self.streamed_mask[list(self.moe_layers)]).sum(1)
        streamed = self.streamed_per_layer
        return ChunkStats(
            tokens=n_tokens,
            mode="stream" if self.chunk_mode(n_tokens) in _STREAM_MODES else "routed-only",
            layout=self.layout(n_tokens),
            tail_pieces=tail_pieces,
            streamed=streamed.copy(), copied=copied, skipped=skipped, unrouted=unrouted,
            bytes=copied * self.blob_bytes)


# -- the JAX ops -----------------------------------------------------------------------------


def _destroy(engine_id: int, pinned: int | None, pid: int) -> None:
    if os.getpid() != pid:
        return  # a fork's copy (at the child's exit): the engine and its memory are the parent's
    lib = native.lib()
    lib.strata_engine_destroy(engine_id)
    if pinned:
        lib.strata_pinned_free(pinned)


# The four calls are one primitive whose custom call carries has_side_effect in the HLO, so XLA
# never removes, merges, duplicates or reorders them (they are also token-chained), but whose
# jaxpr carries no JAX effect. `jax.ffi.ffi_call(has_side_effect=True)` would add an unordered
# effect, and a jitted function with one never takes JAX's C++ dispatch path: every prefill
# call would pay the Python dispatch path (milliseconds, measured) before the device starts.
_stream_call_p = jex_core.Primitive("strata_stream_call")
_stream_call_p.multiple_results = True


try:
    _ShapedArray = jax.core.ShapedArray
except AttributeError:  # moved out of jax.core in some releases
    from jax._src.core import ShapedArray as _ShapedArray


def _stream_call_abstract(*operands, target, results, aliases=(), **attrs):
    del operands, target, aliases, attrs
    return [_ShapedArray(shape, dtype) for shape, dtype in results]


def _stream_call_eager(*operands, target, **params):
    raise RuntimeError(f"{target} runs only inside a jitted prefill (Engine.prefill), not eagerly")


def _stream_call_lowering(ctx, *operands, target, results, aliases=(), **attrs):
    """`aliases`: (operand, result) pairs that share a buffer (fetch_piece's outputs)."""
    del results
    extra = {"operand_output_aliases": dict(aliases)} if aliases else {}
    return jax.ffi.ffi_lowering(target, has_side_effect=True, **extra)(ctx, *operands, **attrs)


_stream_call_p.def_abstract_eval(_stream_call_abstract)
_stream_call_p.def_impl(_stream_call_eager)
mlir.register_lowering(_stream_call_p, _stream_call_lowering)


def _call(target: str, results, *operands, aliases=(), **attrs):
    results = tuple((tuple(shape), np.dtype(dtype)) for shape, dtype in results)
    return _stream_call_p.bind(*operands, target=native.TARGETS[target], results=results,
                               aliases=tuple(aliases), **attrs)


def _piece_attrs(piece: int, pieces: int, rows: tuple[int, int]) -> dict:
    return {"piece": np.int32(piece), "pieces": np.int32(pieces),
            "row_begin": np.int64(rows[0]), "row_end": np.int64(rows[1])}


def begin(engine_id: int, mode: int, token: jax.Array,
          n_ids: int = 0) -> tuple[jax.Array, jax.Array]:
    """begin_chunk: (token, ids), ids being int32 [n_ids], the next `n_ids` of the ids staged
    with the engine (`StreamEngine.stage_ids`), written on the device as kernel arguments."""
    tok, ids = _call("begin", [((), jnp.int32), ((n_ids,), jnp.int32)], token,
                     engine=np.int64(engine_id), mode=np.int32(mode))
    return tok, ids


def publish(engine_id: int, layer: int, token: jax.Array, counts: jax.Array) -> jax.Array:
    (tok,) = _call("publish", [((), jnp.int32)], token, counts.astype(jnp.int32),
                   engine=np.int64(engine_id), layer=np.int32(layer))
    return tok


def fetch(engine_id: int, layer: int, token: jax.Array, resident: jax.Array, n_experts: int,
          hidden: int, intermediate: int, *, piece: int = 0, pieces: int = 1,
          rows: tuple[int, int] = (0, 0), so_far: ExpertWeights | None = None,
          after: jax.Array | None = None) -> tuple[ExpertWeights, jax.Array]:
    """The layer's expert weights, gate/up [E, H, I] and down [E, I, H] in the resident blobs'
    dtype: fetch splits each packed blob into the three matrices as it copies it, so the model
    reads them with no further copy.

    In pieces (`piece` of `pieces`, `rows` the piece's sorted rows [begin, end)): each call
    readies the experts with rows in its range (and those before); piece 0 makes the outputs,
    each later piece adds its experts to the outputs of the piece before (`so_far`, whose
    buffers it writes in place: fetch_piece) after that piece's math (`after`, one of its
    outputs)."""
    h, i, dt = hidden, intermediate, resident.dtype
    shapes = [((n_experts, h, i), dt), ((n_experts, h, i), dt), ((n_experts, i, h), dt),
              ((), jnp.int32)]
    attrs = dict(engine=np.int64(engine_id), layer=np.int32(layer),
                 **_piece_attrs(piece, pieces, rows))
    if so_far is None:
        gate, up, down, tok = _call("fetch", shapes, token, resident, **attrs)
    else:
        if after is None:
            raise ValueError("fetch: a later piece needs `after` (the piece before's output)")
        gate, up, down, tok = _call("fetch_piece", shapes, token, resident, *so_far, after,
                                    aliases=((2, 0), (3, 1), (4, 2)), **attrs)
    return ExpertWeights(gate, up, down), tok


def fetch_frame(engine_id: int, layer: int, token: jax.Array, resident: jax.Array, *,
                piece: int = 0, pieces: int = 1, rows: tuple[int, int] = (0, 0)) -> jax.Array:
    """fetch_frame: readies the layer's ring frame (residents copied in, skipped rows zeroed,
    its copies waited for on XLA's stream); the model then reads the frame in place. In pieces
    (`fetch`), only the copies of the experts with rows in the piece's range are waited for."""
    (tok,) = _call("fetch_frame", [((), jnp.int32)], token, resident,
                   engine=np.int64(engine_id), layer=np.int32(layer),
                   **_piece_attrs(piece, pieces, rows))
    return tok


def release(engine_id: int, layer: int, token: jax.Array, after: jax.Array) -> jax.Array:
    """release: the layer's expert math (`after`, one of its outputs) is done with its frame,
    which the walk may then fill with a later layer."""
    (tok,) = _call("release", [((), jnp.int32)], token, after,
                   engine=np.int64(engine_id), layer=np.int32(layer))
    return tok


def end(engine_id: int, token: jax.Array, n_layers: int) -> jax.Array:
    (stats,) = _call("end", [((n_layers, 2), jnp.int32)], token, engine=np.int64(engine_id))
    return stats


class StreamedExperts:
    """The model's expert source inside one traced chunk.

    Made inside the jitted function: `begin` on construction (`ids`: the chunk's next `n_ids`
    staged token ids), then for each MoE layer `publish` (the router's counts), `fetch` (the
    layer's weights: in a frames chunk its ring frame, read in place where `frames` are
    given, else a copy of it; in a packed chunk fetch's own outputs, split from the copied
    blobs) and, after the layer's expert math, `release` (its frame may take a later layer);
    `finish` returns end_chunk's per-layer (copied, skipped).

    `tail_pieces` > 1 (a streamed chunk; StreamConfig.tail_pieces): the layer `tail_layer`
    (the last MoE layer) is fetched in that many pieces of its sorted rows (`row_pieces`,
    `expert_weights_piece`), so that its expert math runs as its copies land and only the
    last piece's math follows the chunk's last copy.
    """

    def __init__(self, engine_id: int, mode: int, config: ModelConfig,
                 resident_blobs: dict[int, jax.Array], token: jax.Array, n_ids: int = 0,
                 frames: tuple[ExpertWeights, ...] | None = None,
                 frame_of: dict[int, int] | None = None, *, tail_pieces: int = 1,
                 tail_layer: int | None = None):
        if frames is not None and frame_of is None:
            raise ValueError("frames need frame_of (StreamEngine.frame_of)")
        if tail_pieces < 1:
            raise ValueError(f"tail_pieces={tail_pieces}: must be at least 1")
        if tail_pieces > 1 and mode not in _STREAM_MODES:
            raise ValueError("tail_pieces > 1 needs a streamed chunk (a routed-only chunk "
                             "fetches each layer whole)")
        self.engine_id = engine_id
        self.config = config
        self.resident_blobs = resident_blobs
        # A packed chunk's layers come out of fetch; a frames chunk reads its frames.
        self.frames = None if mode == _MODE_STREAM_PACKED else frames
        self.frame_of = frame_of
        self.tail_pieces = tail_pieces
        self.tail_layer = tail_layer
        self._so_far: ExpertWeights | None = None  # a packed layer's outputs, piece by piece
        self.token, self.ids = begin(engine_id, mode, token, n_ids)

    def expert_weights(self, layer: int, counts: jax.Array,
                       resident: ExpertWeights | None) -> ExpertWeights:
        del resident  # the stream supplies every expert, resident ones from the cache
        self._publish(layer, counts)
        with jax.named_scope(f"stream_fetch_{layer}"):
            return self._fetch(layer, 0, 1, (0, 0))

    def _publish(self, layer: int, counts: jax.Array) -> None:
        with jax.named_scope(f"stream_publish_{layer}"):
            self.token = publish(self.engine_id, layer, self.token, counts)

    def row_pieces(self, layer: int, n_rows: int) -> tuple[int, ...] | None:
        """The static bounds of `layer`'s pieces over its `n_rows` sorted rows, or None where
        the layer is fetched whole."""
        if layer != self.tail_layer or self.tail_pieces <= 1:
            return None
        bounds = row_pieces(n_rows, self.tail_pieces)
        return bounds if len(bounds) > 2 else None

    def expert_weights_piece(self, layer: int, counts: jax.Array, bounds: tuple[int, ...],
                             piece: int, after: jax.Array | None) -> ExpertWeights:
        """The layer's weights for piece `piece` of `bounds` (`row_pieces`): every expert with
        rows in the piece's range is there (and those of the pieces before). Pieces come in
        order; `after` (an output of the piece before's expert math) makes this piece's
        fetch, and its wait for the piece's copies, follow that math on XLA's stream."""
        if piece == 0:
            self._publish(layer, counts)
        elif after is None:
            raise ValueError(f"piece {piece} of layer {layer} needs `after`")
        with jax.named_scope(f"stream_fetch_{layer}_{piece}"):
            return self._fetch(layer, piece, len(bounds) - 1, (bounds[piece], bounds[piece + 1]),
                               after)

    def _fetch(self, layer: int, piece: int, pieces: int, rows: tuple[int, int],
               after: jax.Array | None = None) -> ExpertWeights:
        attrs = {"piece": piece, "pieces": pieces, "rows": rows}
        if self.frames is None:
            w, self.token = fetch(self.engine_id, layer, self.token, self.resident_blobs[layer],
                                  self.config.n_experts, self.config.hidden_size,
                                  self.config.expert_intermediate,
                                  so_far=self._so_far if piece > 0 else None,
                                  after=after if piece > 0 else None, **attrs)
            self._so_far = w if piece + 1 < pieces else None
            return w
        if piece > 0:  # the frame is read in place: the order is all this needs
            _, self.token = jax.lax.optimization_barrier((after, self.token))
        tok = fetch_frame(self.engine_id, layer, self.token, self.resident_blobs[layer],
                          **attrs)
        # The frame is a program input: the barrier makes every read of it wait for fetch.
        w, self.token = jax.lax.optimization_barrier(
            (tuple(self.frames[self.frame_of[layer]]), tok))
        return ExpertWeights(*w)

    def release(self, layer: int, outs):
        """After the layer's expert math: `outs` (its outputs, any pytree of arrays) come back
        once all are computed and the layer's frame is released."""
        with jax.named_scope(f"stream_release_{layer}"):
            outs = jax.lax.optimization_barrier(outs)  # every output, before the release
            tok = release(self.engine_id, layer, self.token, jax.tree_util.tree_leaves(outs)[0])
            outs, self.token = jax.lax.optimization_barrier((outs, tok))
        return outs

    def finish(self) -> jax.Array:
        return end(self.engine_id, self.token, self.config.n_layers)
