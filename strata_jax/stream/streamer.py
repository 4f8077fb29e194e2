"""The native streamer: `NativeStreamer`, one native engine's handle, and `ChunkStats`.

A `NativeStreamer` owns one native engine (ffi/src/engine.hpp): the host expert store, the
ring, the issuer thread and the route gate. It follows `plan_stream`'s plan, puts the resident
experts on the device, exposes the ring's layer frames to the model (DLPack), and turns each
chunk's end_chunk output into `ChunkStats`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
import weakref
from collections.abc import Mapping
from typing import Callable, Sequence

import jax
import numpy as np

from strata_jax import _dlpack, native
from strata_jax.config import ModelConfig
from strata_jax.experts import BiasedExpertWeights, ExpertWeights
from strata_jax.formats import ExpertFormat
from strata_jax.kernels.grouped import MOSAIC_BLOCK_M, resolve_implementation
from strata_jax.devices import check_host_bytes, device_memory
from strata_jax.kernels.quantized import resolve_format
from strata_jax.stream.backend import choose_backend, device_ordinal, stream_platform
from strata_jax.stream.config import (
    TAIL_FROM_DEQUANTIZED, TAIL_FROM_TILED, TAIL_FROM_VISITS, TAIL_HALVING_MAX_INTENSITY,
    _MODE_ROUTED_ONLY, _MODE_STREAM, _MODE_STREAM_PACKED, _PUBLISH_MODES, _STREAM_MODES,
    StreamConfig
)
from strata_jax.stream.plan import _local_profile, local_config, plan_stream

# The native engine's host store on CUDA (EngineOptions.pin_mode): a pinned arena, with the
# automatic fallback to staging through pinned bounce buffers where pinning fails.
_PIN_ARENA, _PIN_STAGED = 1, 2
# True: stage the host store from the start, the fallback's path (tests set it to check that
# path on a machine where pinning succeeds).
_STAGE_HOST_STORE = False

# The byte alignment XLA requires of a buffer a program takes as input on the GPU.
_XLA_ALIGN = 256


@dataclasses.dataclass
class ChunkStats:
    """What one chunk streamed, per MoE layer (numpy int64 arrays over model layers).

    `unrouted` counts streamed experts with no token; `skipped` those the walk
    did not copy (a subset of unrouted, never a routed one).
    """

    tokens: int
    mode: str  # "stream" or "routed-only"
    layout: str  # how the chunk laid the ring out: "frames" or "packed" (StreamTuning.layout)
    tail_pieces: int  # pieces its last MoE layer ran in (StreamTuning.tail_pieces)
    streamed: np.ndarray
    copied: np.ndarray
    skipped: np.ndarray
    unrouted: np.ndarray
    bytes: np.ndarray
    # the pieces' sizes (`NativeStreamer.tail_shape`) where tail_pieces > 1, else None
    tail_shape: str | None = None

    def totals(self) -> dict:
        return {
            "streamed": int(self.streamed.sum()),
            "copied": int(self.copied.sum()),
            "skipped": int(self.skipped.sum()),
            "unrouted": int(self.unrouted.sum()),
            "bytes": int(self.bytes.sum()),
        }


class Closable:
    """`closed` and the context manager of an object whose `close()` runs its
    `_finalizer` (a weakref.finalize that frees its native resources once)."""

    _finalizer: weakref.finalize

    def close(self) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def expert_intensity(config: ModelConfig, n_tokens: int, blob_bytes: int) -> float:
    """A streamed layer's expert FLOPs per byte it copies, in a chunk of `n_tokens` tokens:
    its rows' gate, up and down products (2 FLOPs a multiply-add) over all `n_experts`
    blobs of `blob_bytes` bytes."""
    c = config
    flops = 6.0 * n_tokens * c.top_k * c.hidden_size * c.expert_intermediate
    return flops / (c.n_experts * blob_bytes)


def tail_shape_for(shape: str, config: ModelConfig, n_tokens: int, blob_bytes: int) -> str:
    """StreamTuning.tail_shape `shape` for a chunk of `n_tokens` tokens of the model `config`
    (`NativeStreamer.tail_shape`): "equal" or "halving" as given; "auto" takes "halving" up
    to `TAIL_HALVING_MAX_INTENSITY` (`expert_intensity`), "equal" above."""
    if shape != "auto":
        return shape
    return ("halving" if expert_intensity(config, n_tokens, blob_bytes)
            <= TAIL_HALVING_MAX_INTENSITY else "equal")


class NativeStreamer(Closable):
    """A native streaming engine for one model: host store, ring, issuer, gate.

    Args:
        config: The model config.
        experts: Per model layer, that layer's routed experts in the config's expert format
            (`ExpertFormat.of(config)`), or None for dense layers: uint8 [E, blob_bytes]
            blobs (a plain format's also [E, blob_elems] in its dtype), a Mapping plane name
            -> [E, *plane.shape] array, an ExpertWeights (plain formats), or an object whose
            `fill(views)` writes {plane name: numpy view of the store} (a
            `weights.LazyExperts`, its tensors made as they are written). Each layer is taken
            once, in order, and written straight into the host store, one tensor at a time.
        stream: StreamConfig (environment overrides applied here, once).
        progress: Called as progress(done_layers, total_layers) as each MoE layer's experts
            are written into the host store (long for a full-size model).
        device: The JAX device this engine serves (its residents, its ring and the model's
            program there); default: the GPU of ordinal `StreamConfig.device` on CUDA, the
            first CPU device on the simulated link. An engine of a `StreamerGroup`, one per
            device.
        expert_range: (lo, hi): the engine holds experts lo..hi-1 of every MoE layer only, as
            experts 0..hi-lo-1 of its own (expert parallelism: `StreamerGroup` gives device d
            the d-th contiguous slice). `experts` are still the whole layers; the engine's
            `config` is the slice's (`local_config`), its plan, stats and fetch are over the
            slice, and `full_config` is the model's. Default: every expert.

    Raises:
        HostMemoryError: the host store (on the CPU backend with the simulated device's ring
            and residents) passes the available host RAM; checked before any is allocated.

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
                 progress: Callable[[int, int], object] | None = None,
                 device: jax.Device | None = None,
                 expert_range: tuple[int, int] | None = None):
        native.register_targets()
        stream = stream or StreamConfig()
        self.full_config = config
        self.expert_range = (0, config.n_experts)
        if expert_range is not None:
            self.expert_range = _check_range(config, expert_range)
            config = local_config(config, *self.expert_range)
            stream = dataclasses.replace(
                stream, profile=_local_profile(self.full_config, stream.profile,
                                               *self.expert_range, config.top_k))
        self.config = config
        self.stream = stream.resolved()
        self.tuning = self.stream.tuning
        self.backend = choose_backend(self.stream.backend)
        self.platform = stream_platform(self.backend)
        self._device = device
        if device is not None and device.platform != self.platform:
            raise ValueError(f"device={device}: the {self.backend} stream backend runs on a "
                             f"{self.platform} device")
        # The device's ordinal: the CUDA device the engine copies to, and what XLA's FFI call
        # context names the device by (a group's calls find their engine by it).
        self.device_ordinal = (device_ordinal(device) if device is not None
                               else self.stream.device)
        L, E = config.n_layers, config.n_experts
        if len(experts) != L:
            raise ValueError(f"experts has {len(experts)} layers; the model has {L}")
        self.dtype = np.dtype(config.dtype)
        # The layout of an expert's blob: the store's rows, the ring's slots and frame planes.
        self.format = ExpertFormat.of(config)
        self.blob_elems = self.format.blob_elems if self.format.uniform is not None else None
        self.blob_bytes = self.format.blob_bytes
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
        # Each MoE layer in `parts` parts (StreamPlan.parts): part p of layer l is the native
        # engine's layer l * parts + p, of E / parts experts, with a frame of its own.
        self.parts = self.plan.parts
        if self.parts > 1 and self.expert_range != (0, self.full_config.n_experts):
            raise ValueError(
                f"a layer in {self.parts} parts (a ring budget below one frame of "
                f"{E} experts) with expert parallelism is not implemented; raise "
                "ring_budget_gib to hold a frame of each device's experts")
        self._stores: list[np.ndarray | None] = [None] * L
        # On CUDA every layer is written straight into one pinned block (on the GPU's host NUMA
        # node where the machine has several: `numa_node`), which the engine then copies from
        # in place (no second host copy). Where that block cannot be allocated, the
        # engine copies the store into a pinned arena of its own, else stages it through pinned
        # bounce buffers (such entries are never skipped); the trace says which.
        self._pinned = None  # the pinned block (native PinnedBuffer), freed with its last view
        self._check_host_memory()
        arena = None
        if self.backend == "cuda" and not _STAGE_HOST_STORE:
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
                if arena is not None:
                    i = self.moe_layers.index(layer)
                    store = arena[i * E * self.blob_bytes:(i + 1) * E * self.blob_bytes]
                    store = store.reshape(E, self.blob_bytes)
                else:
                    store = np.empty((E, self.blob_bytes), np.uint8)
                self._fill(layer, w, store)
                del w  # a lazy layer's tensors went as they were written
                self._stores[layer] = store
                if progress is not None:
                    progress(self.moe_layers.index(layer) + 1, len(self.moe_layers))
        except BaseException:
            # No engine reads the pinned block yet: its views go, and it with them (bad expert
            # shapes, Ctrl-C; the traceback keeps this frame's locals).
            self._stores = [None] * L
            arena = store = self._pinned = None
            raise
        arena = store = None  # the stores view the pinned block now

        try:
            # The native engine's handle (strata_jax._native.Streamer). It holds the stores it
            # is given, so the memory its copies read outlives it.
            self.handle = native.module().Streamer(engine_options(
                config, self.stream, self.plan, self.format, backend=self.backend,
                device=self.device_ordinal))
        except BaseException:
            self._stores = [None] * L
            self._pinned = None
            raise
        self.id = self.handle.id
        self.pid = os.getpid()  # the process whose threads serve this engine
        self._finalizer = weakref.finalize(self, _destroy, self.handle, self.pid)
        per = self.plan.part_experts
        for layer, store in enumerate(self._stores):
            if store is not None:
                for p in range(self.parts):  # rows of one part: a view, no copy
                    self.handle.set_store(self.native_layer(layer, p),
                                          store[p * per:(p + 1) * per])
        stream, resident = self.plan.native_plan()
        layers = np.array([l for l, _ in stream], np.int32)
        exps = np.array([e for _, e in stream], np.int32)
        rl = np.array([l for l, r in enumerate(resident) for _ in r], np.int32)
        re_ = np.array([e for r in resident for e in r], np.int32)
        self.handle.set_plan(layers, exps, rl, re_)
        self.handle.prepare()
        self._resident_blobs = self._put_resident(resident)
        # The frame each native layer's experts land in (a MoE layer's, or each of its parts'),
        # as the native engine assigns them (the views the model reads must be those frames).
        self.frame_of = {v: self.handle.frame_of(v) for v in self.native_moe_layers}
        self.frames_note = ""
        self._frames = self._frame_views()

    def _frame_views(self) -> tuple[ExpertWeights | dict[str, jax.Array], ...] | None:
        """The ring's layer frames as JAX arrays over the ring's memory: per frame f, each
        plane of the format, [E, *plane.shape], an ExpertWeights (gate/up [E, H, I], down
        [E, I, H]) for a plain format, else a dict plane name -> array (a plane whose dtype
        DLPack cannot name, float8, as unsigned ints of its width: the model bitcasts it).
        What the model reads a layer's experts from in a frames chunk (StreamTuning.layout,
        CUDA). None where fetch copies the frame out instead (or no chunk uses frames), with
        the reason in `frames_note`."""
        if self.tuning.layout == "packed" and not self._routed_only_below_floor:
            self.frames_note = "every chunk uses the packed ring: fetch splits its blobs out"
            return None
        if self.backend != "cuda":
            self.frames_note = "layer frames, read through a copy (CPU backend)"
            return None
        E = self.plan.part_experts  # a frame's slots: a layer's experts, or a part's
        planes, n = self.handle.frames()
        # A frame's plane p: E rows of the format's plane p, in the ring's region of plane p
        # ([ring, plane bytes]).
        fp = self.format.planes
        odd = [f"{p.name} ({E * p.nbytes} bytes)" for p in fp if (E * p.nbytes) % _XLA_ALIGN]
        if odd and n > 1:
            # Frames lie back to back in each plane's region: where a frame's plane is not a
            # multiple of XLA's buffer alignment, later frames start misaligned and XLA
            # refuses them as inputs. Only small models' scale planes come out this way.
            self.frames_note = (f"fetch copies each frame out: a frame's {', '.join(odd)} is "
                                f"not a multiple of {_XLA_ALIGN} bytes, XLA's buffer alignment")
            return None
        frames = []
        try:
            for f in range(n):
                views = {p.name: _dlpack.view(planes[i] + f * E * p.nbytes, (E, *p.shape),
                                              _dlpack_dtype(p.dtype), self.jax_device)
                         for i, p in enumerate(fp)}
                frames.append(ExpertWeights(**views) if self.format.kind == "plain" else views)
        except (RuntimeError, TypeError) as e:
            for w in frames:
                for a in _frame_arrays(w):
                    a.delete()
            self.frames_note = f"fetch copies each frame out: {e}"
            warnings.warn(f"strata: the model cannot read the ring in place, so fetch copies "
                          f"each layer out of it (slower): {e}", RuntimeWarning, stacklevel=3)
            return None
        self.frames_note = "the model reads each layer's experts in its ring frame"
        return tuple(frames)

    @property
    def frames(self) -> tuple[ExpertWeights | dict[str, jax.Array], ...] | None:
        """The ring's frames as JAX arrays read in place (`_frame_views`), or None."""
        return self._frames

    @property
    def read_in_place(self) -> bool:
        """Whether a frames chunk's model reads the ring in place (else fetch copies out)."""
        return self._frames is not None

    def layout(self, n_tokens: int) -> str:
        """How a chunk of `n_tokens` tokens lays the ring out: "frames" or "packed"
        (StreamTuning.layout; routed-only chunks use frames)."""
        if self._routed_only(n_tokens) or self.tuning.layout == "frames":
            return "frames"
        if self.tuning.layout == "packed" or n_tokens < self.tuning.frames_from:
            return "packed"
        return "frames"

    @property
    def numa_node(self) -> int | None:
        """The host NUMA node the pinned store was allocated on (its GPU's, `PinnedBuffer`),
        or None where none was chosen (one node, a GPU without a host node, the CPU backend, a
        store the engine pinned itself: its trace line names that node)."""
        node = self._pinned.numa_node if self._pinned is not None else -1
        return node if node >= 0 else None

    def _pinned_arena(self, nbytes: int) -> np.ndarray | None:
        """One pinned host block of `nbytes` as a uint8 array, or None (the engine then pins
        or stages the packed arrays itself, and says which in its trace)."""
        if nbytes == 0:
            return None
        try:
            self._pinned = native.module().PinnedBuffer(nbytes, device=self.device_ordinal)
        except RuntimeError as e:
            warnings.warn(f"pinned arena of {nbytes / 2**30:.2f} GiB not allocated ({e}); the "
                          "engine will pin or stage the store instead", stacklevel=3)
            return None
        return self._pinned.array()

    # -- planning -----------------------------------------------------------------------------

    def _check_host_memory(self) -> None:
        """HostMemoryError before anything is allocated when the host store (on the CPU
        backend with the simulated device's ring and residents, host memory too) passes the
        available host RAM."""
        c, n_moe = self.config, len(self.moe_layers)
        need = n_moe * c.n_experts * self.blob_bytes
        what = (f"the host store of {c.name} ({n_moe} MoE layers x {c.n_experts} experts x "
                f"{self.blob_bytes / 2**20:.2f} MiB)")
        if self.backend != "cuda":
            need += self.plan.ring_bytes + self.plan.resident_bytes
            what += " with the simulated device's ring and resident experts"
        check_host_bytes(need, what, "free host memory, or stream a smaller model (fewer "
                         "layers or experts)")

    def _fill(self, layer: int, w, store: np.ndarray) -> None:
        """Writes MoE layer `layer`'s experts `w` into `store` (its [E, blob bytes] uint8 rows
        of the host store) in the format's blob layout, one tensor at a time and with no packed
        copy between: `w` is blobs, a Mapping of planes, an ExpertWeights (plain formats) or
        an object with `fill(views)` (see the class's `experts`)."""
        lo, hi = self.expert_range
        if (lo, hi) != (0, self.full_config.n_experts):
            # The slice of the whole layer: written whole into one layer of scratch host
            # memory (each engine of a group makes the layer once), its rows lo..hi-1 kept.
            whole = np.empty((self.full_config.n_experts, self.blob_bytes), np.uint8)
            self._fill_rows(layer, w, whole, self.full_config.n_experts)
            store[...] = whole[lo:hi]
            return
        self._fill_rows(layer, w, store, self.config.n_experts)

    def _fill_rows(self, layer: int, w, store: np.ndarray, E: int) -> None:
        """`_fill` into `store`, the [E, blob bytes] rows of E experts."""
        fmt = self.format
        if isinstance(w, np.ndarray):
            if w.dtype == np.uint8 and w.shape == (E, self.blob_bytes):
                store[...] = w
            elif fmt.uniform is not None and w.dtype == fmt.uniform and \
                    w.shape == (E, self.blob_elems):
                store.view(fmt.uniform)[...] = w
            else:
                plain = (f" or {fmt.uniform.name} ({E}, {self.blob_elems})"
                         if fmt.uniform is not None else "")
                raise ValueError(f"layer {layer} blobs are {w.dtype} {w.shape}; expected uint8 "
                                 f"({E}, {self.blob_bytes}){plain} for the {fmt.name} format")
            return
        views = fmt.split_np(store)  # plane name -> [E, *shape] view in the plane's dtype
        if not isinstance(w, Mapping) and hasattr(w, "fill"):
            w.fill(views)
            return
        if isinstance(w, Mapping):
            planes = w
        elif fmt.kind == "plain" and isinstance(w, (ExpertWeights, BiasedExpertWeights)):
            planes = w._asdict()
        else:
            raise TypeError(
                f"layer {layer} experts are a {type(w).__name__}; the {fmt.name} format takes "
                "blobs, a Mapping plane name -> array, an object with fill(views)"
                + (" or an ExpertWeights" if fmt.kind == "plain" else
                   " (ExpertWeights are plain: quantize them with ExpertFormat.quantize_np)"))
        missing = [p.name for p in fmt.planes if p.name not in planes]
        extra = sorted(set(planes) - set(views))
        if missing or extra:
            raise ValueError(f"layer {layer} experts: the {fmt.name} format's planes "
                             f"{[p.name for p in fmt.planes]}; missing {missing}, not in the "
                             f"format {extra}")
        for p in fmt.planes:
            got = planes[p.name]
            want = (E, *p.shape)
            if tuple(np.shape(got)) != want:
                raise ValueError(f"layer {layer} expert {p.name} has shape "
                                 f"{tuple(np.shape(got))}; expected {want}")
            # A plain format casts its matrices; a quantized plane's bits are not cast.
            if fmt.kind != "plain" and np.dtype(got.dtype) != p.dtype:
                raise ValueError(f"layer {layer} expert {p.name} is {np.dtype(got.dtype)}; "
                                 f"the {fmt.name} format stores it as {p.dtype}")
        for p in fmt.planes:
            views[p.name][...] = np.asarray(planes[p.name])

    def _device_memory_bytes(self) -> int | None:
        """Total memory of the device the residents go to, where the backend reports it."""
        if self.backend != "cuda":
            return None  # the simulated device is host memory: no device-size check
        return device_memory("gpu", self.device_ordinal)[0]

    def _put_resident(self, resident: list[list[int]]) -> dict[int, jax.Array]:
        """Per native MoE layer its residents' blobs on the device (`StreamPlan.native_plan`)."""
        device = self.jax_device
        per = self.plan.part_experts
        out = {}
        for l in self.moe_layers:
            for p in range(self.parts):
                v = self.native_layer(l, p)
                rows = self._stores[l][[p * per + e for e in resident[v]]]  # uint8 [R, blob]
                out[v] = jax.device_put(np.ascontiguousarray(rows), device)
        return out

    @property
    def native_moe_layers(self) -> tuple[int, ...]:
        """The native engine's layers that are parts of MoE layers (`native_layer`), in
        order: the MoE layers themselves where layers are whole."""
        return tuple(self.native_layer(l, p) for l in self.moe_layers for p in range(self.parts))

    def native_layer(self, layer: int, part: int = 0) -> int:
        return self.plan.native_layer(layer, part)  # StreamPlan.native_layer

    @property
    def native_layers(self) -> int:
        return self.plan.native_layers  # end_chunk's stats rows: L x parts

    # -- properties ---------------------------------------------------------------------------

    @property
    def jax_device(self) -> jax.Device:
        """The JAX device the residents and the ring are on, where the model must run: the
        `device` given, else the GPU of ordinal `StreamConfig.device` on CUDA, the CPU device
        on the simulated link."""
        if self._device is not None:
            return self._device
        if self.backend == "cuda":
            return jax.devices("gpu")[self.stream.device]
        return jax.devices("cpu")[0]

    @property
    def resident_blobs(self) -> dict[int, jax.Array]:
        """Per native MoE layer (a MoE layer, or each of its parts: `native_moe_layers`) its
        resident experts' blobs on the device, uint8 [R, blob_bytes] (in every format), in the
        plan's order: what fetch copies residents from."""
        return self._resident_blobs

    def walk_active(self) -> bool:
        return self.handle.walk_active()

    def depth(self) -> int:
        return self.handle.depth()

    def hold(self) -> int:
        """Entries a prestarted walk may run ahead of its landed copies until the program
        adopts it (`prestart`); 0 when the walk is not held."""
        return self.handle.hold()

    def abort(self) -> None:
        """Stops the current chunk's walk, if any; the engine stays usable. Call it only when
        no chunk of this engine is queued or running (else `cancel` first, then wait)."""
        self.handle.abort()

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
        self.handle.prestart(self.chunk_mode(n_tokens))

    def stage_ids(self, ids: np.ndarray, *, reset: bool = False) -> None:
        """Hands the engine chunks' token ids before the chunks are dispatched: their program
        inputs, in dispatch order, as one int32 array (`Engine` stages each chunk's padded ids,
        start and length). They join a queue; each begin_chunk takes the next ones (`begin`'s
        `n_ids`), in the order the chunks were dispatched, and writes them on the device by
        kernels whose arguments carry them, on XLA's own stream. A begin_chunk that fails
        uses its ids up all the same, so the chunks queued after it keep theirs.

        So a streamed prefill makes no host-to-device copy of its own: one queued on another
        stream waits for the walk's copies to drain, and placing the ids before the walk
        instead waits for their copy on every prefill (DESIGN.md).

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
        self.handle.stage_ids(a, bool(reset))

    def clear_ids(self) -> None:
        """Drops the staged ids no begin_chunk has taken (a prefill that failed leaves its
        cancelled chunks' behind); only with no chunk of this engine queued. Nothing to do on
        a closed engine."""
        if not self.closed:
            self.stage_ids(np.zeros(0, np.int32), reset=True)

    def cancel(self, on: bool = True) -> None:
        """Safe while chunks are queued: stops the running chunk's walk and fails every later
        begin_chunk until `cancel(False)`, so queued chunks end at once, in error."""
        self.handle.cancel(bool(on))

    def inject_fault(self, layer: int, kind: str) -> None:
        """Test hook: fail ("error") or stop ("stop") the next fetch of `layer`."""
        kinds = {"none": 0, "error": 1, "stop": 2}
        if kind not in kinds:
            raise ValueError(f"fault kind {kind!r}: expected one of {sorted(kinds)}")
        self.handle.inject_fault(layer, kinds[kind])

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
        return self.handle.timing()

    def measure_link(self, nbytes: int = 256 * 2**20, reps: int = 10) -> float:
        """The link ceiling out of this engine's own store: the median GB/s of `reps` copies
        of `nbytes` (the benchmark's 256 MB) from the front of the pinned arena the ring reads,
        to a scratch device buffer, on a stream of their own (`native.measure_h2d_from`). A
        fresh probe buffer is other host memory and can read a different peak than these
        pages give; the benchmarks take the higher of the two.

        Raises:
            RuntimeError: the store is not in a pinned arena (the simulated link, or an arena
                that could not be allocated, so the store is staged); a walk
                is running (it would share the link); or a CUDA call failed.
        """
        if self.closed:
            raise RuntimeError("measure_link: the engine was closed (its arena is freed); "
                               "make a new one")
        self.check_process()
        if self._pinned is None:
            raise RuntimeError(
                "measure_link reads the store's pinned arena, and this engine has none "
                f"(backend {self.backend!r}{', store staged' if _STAGE_HOST_STORE else ''}); "
                "use "
                "native.measure_h2d for a probe buffer of its own")
        if self.walk_active():
            raise RuntimeError("measure_link while a chunk's walk runs: it would share the "
                               "link with it; call it between prefills")
        size = len(self.moe_layers) * self.config.n_experts * self.blob_bytes
        return native.measure_h2d_from(self._pinned.address, min(int(nbytes), size), reps,
                                       device=self.device_ordinal)

    def last_error(self) -> str:
        """The error this engine's last chunk ended with as a member of a `StreamerGroup`
        (its device's own cause, e.g. "device 0: fetch, layer 2: the walk was stopped: device
        1: ..."), until its next chunk begins; "" when it ended well (or the engine is in no
        group: its errors reach the caller as they happen)."""
        return "" if self.closed else self.handle.last_error()

    def host_times(self) -> tuple[float, float]:
        """Host clock (time.monotonic seconds) at which the last chunk began (its begin_chunk
        handler ran, or the host prestarted the chunk its program adopted) and at which its
        end_chunk handler ran; with the call's own monotonic times they split a prefill's wall
        time into host time before the device chunk, the chunk, and host time after it."""
        return self.handle.host_times()

    def close(self) -> None:
        """Stops the threads and frees the engine. Idempotent."""
        self._stores = [None] * len(self._stores)  # may view the pinned block freed next
        # The frame views go before the ring they view (the engine's teardown synchronizes
        # the device first, so no program still reads them).
        for w in getattr(self, "_frames", None) or ():
            for a in _frame_arrays(w):
                if not a.is_deleted():
                    a.delete()
        self._frames = None
        self._finalizer()
        self._pinned = None  # freed with its last view, which the engine held

    def check_process(self) -> None:
        """Raises RuntimeError in a process forked after the engine was made: its issuer (and
        the simulated link's worker) stayed in the parent, so a chunk here would wait forever."""
        if os.getpid() != self.pid:
            raise RuntimeError(
                f"this engine's stream was made in process {self.pid}; this is process "
                f"{os.getpid()}, forked from it, and the stream's threads did not come along. "
                "Make a new Engine in this process (or start workers with the 'spawn' method).")

    @property
    def _routed_only_below_floor(self) -> bool:
        """Whether some chunks are routed-only: with the routed switch on and a stream floor
        above one token. Stream-all (routed off) streams every chunk, whatever its length."""
        return bool(self.stream.routed) and self.tuning.stream_floor > 1

    def _routed_only(self, n_tokens: int) -> bool:
        """Whether a chunk of `n_tokens` tokens is routed-only: below the stream floor with the
        routed switch on (StreamTuning.stream_floor applies only to the routed stream)."""
        return bool(self.stream.routed) and n_tokens < self.tuning.stream_floor

    def chunk_mode(self, n_tokens: int) -> int:
        """begin_chunk's mode for a chunk of `n_tokens` tokens: routed-only below the stream
        floor with the routed switch on, else streamed in the chunk's `layout` (stream-all,
        `StreamConfig(routed=False)`, streams every chunk)."""
        if self._routed_only(n_tokens):
            return _MODE_ROUTED_ONLY
        return _MODE_STREAM_PACKED if self.layout(n_tokens) == "packed" else _MODE_STREAM

    def tail_pieces(self, mode: int, n_tokens: int, grouped_matmul: str = "auto",
                    quantized: str = "auto") -> int:
        """Pieces the last MoE layer runs in, in a chunk of `mode` compiled for `n_tokens`
        tokens (its bucket; StreamTuning.tail_pieces): 1 for routed-only or short chunks.
        `grouped_matmul`, `quantized`: the model's `Kernels`, which decide what a piece costs.

        A kernel that visits only the experts with rows (the quantized Mosaic
        kernels, `kernels.quantized.resolve_format`) costs a piece its boundary tiles: pieces from
        `tail_from` tokens, by default 1,024 (`TAIL_FROM_VISITS`). A quantized format
        dequantized first dequantizes the whole layer again in every piece: pieces from
        16,384 tokens (`TAIL_FROM_DEQUANTIZED`). The bf16 grouped matmul pays per-expert tiles
        again in every piece: pieces from `tail_from` tokens, by default 8,192
        (`TAIL_FROM_TILED`); with the Mosaic
        kernel, whose grid holds E - 1 tiles more than the rows' own whatever the rows, at
        most one piece per E row tiles of the chunk: a piece must hold at least as many tiles
        of its own as it adds (Qwen3-30B-A3B, 128 experts top-8: all four pieces from 8,192
        tokens; 512 experts top-10: two from 13,108 tokens, four from 26,215)."""
        if mode not in _STREAM_MODES or not self.moe_layers or self.parts > 1:
            return 1  # a layer in parts already runs its math as each part lands
        pieces = self.tuning.tail_pieces
        path = resolve_format(quantized, self.format, self.jax_device)  # None: plain
        visits = path == "mosaic"
        floor = self.tuning.tail_from
        if floor is None:
            floor = (TAIL_FROM_VISITS if visits else
                     TAIL_FROM_DEQUANTIZED if path == "dequantize" else TAIL_FROM_TILED)
        if n_tokens < floor:
            return 1
        if pieces > 1 and not visits and resolve_implementation(grouped_matmul) == "mosaic":
            tiles = n_tokens * self.config.top_k // MOSAIC_BLOCK_M
            pieces = min(pieces, tiles // self.config.n_experts)
        return max(pieces, 1)

    def tail_shape(self, n_tokens: int) -> str:
        """The last MoE layer's pieces' sizes in a chunk of `n_tokens` tokens
        (StreamTuning.tail_shape): "auto" takes "halving" up to `TAIL_HALVING_MAX_INTENSITY`
        FLOPs a copied byte (`expert_intensity`), where a piece's math fits in the next,
        half as large, piece's copies, and "equal" above, where it does not and the pieces'
        math falls behind the copies (DESIGN.md, "The last MoE layer in pieces")."""
        return tail_shape_for(self.tuning.tail_shape, self.config, n_tokens, self.blob_bytes)

    @property
    def tail_layer(self) -> int | None:
        """The layer `tail_pieces` applies to: the last MoE layer."""
        return max(self.moe_layers) if self.moe_layers else None

    def make_stats(self, n_tokens: int, native_stats: np.ndarray, counts: np.ndarray,
                   tail_pieces: int = 1, tail_shape: str | None = None) -> ChunkStats:
        """ChunkStats from end_chunk's output [native_layers, 2] (a layer's parts summed) and
        the router counts [n_moe, E]; `tail_pieces`, `tail_shape`: what the chunk's program
        used (`tail_pieces`, `tail_shape`; the shape is kept only where there were pieces)."""
        native_stats = np.asarray(native_stats, np.int64).reshape(
            self.config.n_layers, self.parts, 2).sum(axis=1)
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
            bytes=copied * self.blob_bytes, tail_shape=tail_shape if tail_pieces > 1 else None)

def engine_options(config: ModelConfig, stream: StreamConfig, plan, fmt: ExpertFormat, *,
                   backend: str, device: int):
    """The native engine's options (`_native.EngineOptions`, ffi/src/engine.hpp), filled once
    from a resolved StreamConfig (`stream`: its routed switch, depth, trace and tuning), the
    plan it follows (`plan_stream`: ring and blob size), the expert format (`fmt`: the plane
    table), the backend ("cpu" or "cuda") and the CUDA device ordinal. Every field the engine
    has is set here; `_native.Streamer(options)` checks them."""
    if stream.routed is None or stream.depth is None:
        raise ValueError("engine_options takes a resolved StreamConfig (routed and depth set: "
                         "StreamConfig.resolved())")
    tuning = stream.tuning
    o = native.module().EngineOptions()
    o.backend = 1 if backend == "cuda" else 0
    o.n_layers = plan.native_layers  # a layer's parts are layers of their own
    o.n_experts = plan.part_experts
    o.routed = bool(stream.routed)
    o.blob_bytes = int(plan.blob_bytes)
    o.ring = int(plan.ring)
    o.depth = int(stream.depth)
    o.trace = bool(stream.trace)
    o.sim_bandwidth = float(tuning.sim_bandwidth)
    o.sim_latency = float(tuning.sim_latency)
    o.sim_jitter = float(tuning.sim_jitter)
    o.seed = int(tuning.seed)
    o.pin_mode = _PIN_STAGED if _STAGE_HOST_STORE else _PIN_ARENA
    o.device = int(device)
    o.publish_mode = _PUBLISH_MODES[tuning.publish]
    o.plane_offsets = [int(x) for x in fmt.offsets]
    o.plane_bytes = [int(p.nbytes) for p in fmt.planes]
    return o


def _check_range(config: ModelConfig, expert_range) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in expert_range)
    except (TypeError, ValueError):
        raise ValueError(f"expert_range={expert_range!r}: expected (lo, hi), two ints") from None
    if not 0 <= lo < hi <= config.n_experts:
        raise ValueError(f"expert_range=({lo}, {hi}): expected 0 <= lo < hi <= "
                         f"{config.n_experts} (the model's experts per layer)")
    return lo, hi



def _frame_arrays(frame) -> list:
    """A frame's arrays (`NativeStreamer._frame_views`: an ExpertWeights or a dict)."""
    return list(frame.values() if isinstance(frame, dict) else frame)


def _dlpack_dtype(dtype: np.dtype) -> np.dtype:
    """`dtype`, or the unsigned int of its width where DLPack has no code for it (float8)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "fiu" or dtype.name == "bfloat16":
        return dtype
    return np.dtype(f"u{dtype.itemsize}")


def _destroy(handle, pid: int) -> None:
    if os.getpid() != pid:
        return  # a fork's copy (at the child's exit): the engine and its memory are the parent's
    handle.close()  # the engine first, then the stores (and pinned block) its copies read
