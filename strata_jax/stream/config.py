"""How experts stream: `StreamConfig` (what users choose), `StreamTuning` (what the engine
chooses, with measured defaults), the environment's defaults, and the native engine's modes.

`StreamConfig.resolved` fills the fields left unset (None) from the environment
(STRATA_PREFILL_ROUTED_STREAM, STRATA_PREFILL_ROUTED_STREAM_DEPTH, STRATA_TRACE) once, when an
engine is made, and checks every field: a value given explicitly always wins over the
environment. The mode tables here give the numbers the native engine
(ffi/src/engine.hpp) takes for the publish modes and for begin_chunk's chunk modes (the host
store's pin modes are in streamer.py).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np

from strata_jax.kernels.grouped import PIECE_SHAPES
from strata_jax.profile import ExpertProfile

DEPTH_MIN, DEPTH_MAX = 1, 256
DEPTH_DEFAULT = 16  # StreamConfig.depth not given, nor the environment's (the engine's default)
_ENV_ROUTED = "STRATA_PREFILL_ROUTED_STREAM"
_ENV_DEPTH = "STRATA_PREFILL_ROUTED_STREAM_DEPTH"
_ENV_TRACE = "STRATA_TRACE"
_PUBLISH_MODES = {"callback": 0, "event": 1}
# begin_chunk's modes (ffi/src/engine.hpp ChunkMode): a streamed chunk in layer frames, a
# routed-only chunk (frames too), a streamed chunk in the packed ring.
_MODE_STREAM, _MODE_ROUTED_ONLY, _MODE_STREAM_PACKED = 0, 1, 2
_STREAM_MODES = (_MODE_STREAM, _MODE_STREAM_PACKED)
_LAYOUTS = ("auto", "frames", "packed")
# StreamTuning.tail_from's defaults: where every piece pays per-expert tiles again (bf16), where
# a kernel visits only the experts with rows (a piece costs its boundary tiles), and where every
# piece dequantizes the whole layer again (a quantized format dequantized first).
TAIL_FROM_TILED = 8192
TAIL_FROM_VISITS = 1024
TAIL_FROM_DEQUANTIZED = 16384
# StreamTuning.tail_shape="auto": halving pieces up to this many expert FLOPs a copied byte
# (`NativeStreamer.tail_shape`), equal pieces above. Halving's first piece, half the layer's
# math, must fit in the second's copies, a quarter of the layer's: the math at most half the
# copies' time, which on a 55 GB/s link beside a Hopper GPU's grouped matmuls is near this
# many FLOPs a byte (DESIGN.md, "The last MoE layer in pieces").
TAIL_HALVING_MAX_INTENSITY = 1360.0


@dataclasses.dataclass(frozen=True)
class StreamTuning:
    """How the engine streams beyond what a user chooses: measured defaults, one frozen object.

    `StreamConfig.tuning` holds it. The defaults are what the benchmarks chose
    (docs/BENCHMARKS.md); the fields exist so that a benchmark can measure another value
    (`stream_bench --layout/--frames-from/--tail-pieces/--tail-from/--stream-floor`) and the
    tests can reach every path on small models.

    Attributes:
        ring: Ring slots, in whole frames of `n_experts / parts` slots (rounded down, at
            least one): each MoE layer's (or part's) experts land in row e of the frame it
            takes (they take frames in turn), and the model reads the frame where they landed.
            None: two frames (one layer plus a layer of read-ahead), capped by
            `StreamConfig.ring_budget_gib`.
        parts: Each MoE layer's experts in this many equal parts (a divisor of `n_experts`),
            each its own frame of n_experts / parts slots: the layer's expert math runs part by
            part, each part's once its copies land, so a ring smaller than one layer frame
            carries the layer (a DeepSeek-V3 layer of fp8 experts is 10.5 GiB). The same bits
            as the layer whole. None (the default): 1 where the ring budget holds a layer
            frame, else the fewest parts of which two frames fit it (`plan_stream`).
        layout: How a streamed chunk lays its copies out in the ring (the same memory either
            way; each chunk chooses, and end_chunk's trace and `ChunkStats.layout` say which):
            "frames": each expert split into the frame's planes (those of the expert format:
            gate, up, down, and their scales in a quantized one) as it crosses the link, and on
            CUDA the model reads a layer's experts where they landed (JAX arrays over the
            ring's memory, by DLPack): nothing is copied on XLA's stream, but the link makes up
            to one copy per plane per run of adjacent experts. Best where
            compute sets the pace. The CPU backend, whose XLA may run independent ops
            concurrently so that only a data dependency orders a read after fetch, reads a
            copy of the frame. "packed": whole blobs, one copy per run of adjacent experts on
            the link, and fetch splits each run into outputs of its own on the device as it
            lands. Best where the link sets the pace. "auto": packed for chunks shorter than
            `frames_from` tokens, frames from there on. Routed-only chunks (below
            `stream_floor`) copy into frames either way.
        frames_from: "auto"'s crossover in tokens: frames pay off once a chunk's compute
            outlasts its copies (Qwen3-30B-A3B shapes: near 24K-29K tokens). Measure a
            model's own with `stream_bench --layout frames|packed`.
        tail_pieces: In a streamed chunk of at least `tail_from` tokens, the last MoE
            layer's expert math runs in this many pieces of its rows (sorted by expert), each
            after a fetch that waits only for the copies of the experts with rows in it, so
            that only the last piece's math follows the chunk's last copy (1: the layer whole).
            The pieces give the same bits (each row keeps its expert and its math). With the
            bf16 grouped matmul each piece costs its per-expert tiles again, hence a floor on
            the length, and with the Mosaic kernel at most one piece per `n_experts` row tiles
            (128 rows) of the chunk (`NativeStreamer.tail_pieces`).
        tail_shape: The pieces' sizes (`kernels.grouped.row_pieces`): "halving" (each piece
            half the one before, the last two equal, so 1/2, 1/4, 1/8, 1/8 of the rows in
            four), which leaves less math after the last copy where each piece's math keeps
            up with the next piece's copies; "equal"; or "auto" (the default): halving where a
            layer's math is short beside its copies, equal where it is not
            (`NativeStreamer.tail_shape`, `TAIL_HALVING_MAX_INTENSITY`).
        tail_from: The shortest streamed chunk, in tokens, whose last MoE layer runs in
            `tail_pieces` pieces. None (the default): `TAIL_FROM_TILED` (8,192) where the
            expert math pays per-expert tiles per piece (bf16 experts),
            `TAIL_FROM_VISITS` (1,024) where a kernel visits only the experts with rows (the
            quantized Mosaic kernels: a piece costs its boundary tiles), and
            `TAIL_FROM_DEQUANTIZED` (16,384) for quantized experts dequantized first, where
            each piece dequantizes the whole layer again.
        stream_floor: With the routed switch on (`StreamConfig.routed`), chunks shorter than
            this many tokens use routed-only fetch (wait for the routing, copy only the routed
            experts). Stream-all (routed off) streams every chunk whatever its length: the
            floor does not apply.
        publish: How a layer's routing reaches the issuer on CUDA: "event" (an event recorded
            on XLA's stream after the counts' device-to-host copy, which the issuer polls before
            it fills the gate row itself; nothing waits) or "callback" (DESIGN.md's first
            design: a host callback, cudaLaunchHostFunc, fills the row; XLA's stream waits until
            a driver thread has run it, which holds the device per layer: hence the event
            default). The CPU backend publishes in the handler either way.
        sim_bandwidth: The CPU backend's simulated link bandwidth in bytes/s; 0 is unlimited.
        sim_latency: The simulated link's per-copy latency in seconds.
        sim_jitter: Up to this many extra seconds per simulated copy, uniform.
        seed: Seed of the simulated link's jitter.
    """

    ring: int | None = None
    parts: int | None = None
    layout: str = "auto"
    frames_from: int = 24576
    tail_pieces: int = 4
    tail_shape: str = "auto"
    tail_from: int | None = None
    stream_floor: int = 1024
    publish: str = "event"
    sim_bandwidth: float = 2e9
    sim_latency: float = 20e-6
    sim_jitter: float = 0.0
    seed: int = 0

    def checked(self) -> "StreamTuning":
        """Itself, after checking every field; a ValueError names the first bad one."""
        _check_int_fields(self, _TUNING_INT_FIELDS)
        if self.publish not in _PUBLISH_MODES:
            raise ValueError(f"publish={self.publish!r}: expected one of {sorted(_PUBLISH_MODES)}")
        if self.stream_floor < 1:
            raise ValueError(f"stream_floor={self.stream_floor}: must be at least 1")
        if self.layout not in _LAYOUTS:
            raise ValueError(f"layout={self.layout!r}: expected one of {list(_LAYOUTS)}")
        if self.frames_from < 1:
            raise ValueError(f"frames_from={self.frames_from}: must be at least 1 (a chunk "
                             f"length in tokens; layout='frames' or 'packed' fixes one layout)")
        if self.parts is not None and self.parts < 1:
            raise ValueError(f"parts={self.parts}: must be at least 1 (1: each layer whole) or "
                             "None (as the ring budget needs)")
        if self.tail_pieces < 1:
            raise ValueError(f"tail_pieces={self.tail_pieces}: must be at least 1 (1 runs the "
                             f"last MoE layer whole)")
        if self.tail_shape not in ("auto", *PIECE_SHAPES):
            raise ValueError(f"tail_shape={self.tail_shape!r}: expected one of "
                             f"{['auto', *PIECE_SHAPES]}")
        if self.tail_from is not None and self.tail_from < 1:
            raise ValueError(f"tail_from={self.tail_from}: must be at least 1 (a chunk length "
                             f"in tokens)")
        for name in ("sim_bandwidth", "sim_latency", "sim_jitter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
                    or not np.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r}: expected a finite number >= 0")
        return self


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """How experts stream: the few choices a user makes. The environment's values for the fields
    left unset are read once, when an engine is made (`resolved`).

    Attributes:
        routed: The routed switch. True: skip ring entries whose layer's routing
            landed before they were issued and whose expert no token routes
            to, and keep at most `depth` copies queued; chunks shorter than
            `StreamTuning.stream_floor` tokens are routed-only (wait for the
            routing, copy only the routed experts). False: stream-all, every
            streamed expert of every chunk crosses the link, whatever the chunk's
            length (`stream_floor` does not apply). None (the default): not
            given, so STRATA_PREFILL_ROUTED_STREAM=0/1 where it is set, else True.
        depth: Copies queued ahead of the link with the switch on; clamped to
            1..256 with a warning. None (the default): not given, so
            STRATA_PREFILL_ROUTED_STREAM_DEPTH where it is set, else 16 (`DEPTH_DEFAULT`).
        resident_per_layer: Experts kept resident on the device per MoE layer
            (the hottest by `profile`, else the lowest ids).
        resident_budget_gib: Alternatively, device memory for resident experts;
            the hottest experts by `profile` (globally) fill it.
        profile: An ExpertProfile (strata_jax.profile) or its counts, int
            [n_layers, n_experts]: orders each layer's stream list hottest first
            (ties by the lower id) and chooses the residents. A profile of
            another model's shape is refused when the engine (or its plan,
            `plan_stream`) is made.
        ring_budget_gib: Device memory the ring of streamed experts may take (two layer frames
            when they fit, else frames of each layer's parts: `StreamTuning.parts`;
            `StreamTuning.ring` sets slots instead).
        backend: "auto" (CUDA when JAX runs on a GPU and the library has CUDA),
            "cpu" (simulated link) or "cuda".
        trace: Print per-chunk copied/skipped lines; None reads STRATA_TRACE.
        device: CUDA device ordinal; the JAX GPU of this index is where the
            residents, the ring and the model are (NativeStreamer.jax_device).
        tuning: What the engine otherwise chooses itself (`StreamTuning`: the ring's
            slots and layout, the tail pieces, the routed-only floor, the publish mode, the
            CPU backend's simulated link).

    The environment never beats an explicit argument: STRATA_PREFILL_ROUTED_STREAM and
    STRATA_PREFILL_ROUTED_STREAM_DEPTH only fill `routed` and `depth` where they are None
    (not given). Where one is set to another value than the field given, the field wins and
    `resolved` warns (UserWarning) naming both; a malformed one is an error either way.
    `resolved()` returns the config that runs: `routed` a bool and `depth` an int, never None.
    """

    routed: bool | None = None
    depth: int | None = None
    resident_per_layer: int = 0
    resident_budget_gib: float | None = None
    profile: "ExpertProfile | np.ndarray | None" = dataclasses.field(
        default=None, compare=False, hash=False)
    ring_budget_gib: float = 4.0
    backend: str = "auto"
    trace: bool | None = None
    device: int = 0
    tuning: StreamTuning = StreamTuning()

    def resolved(self) -> "StreamConfig":
        """The config that runs: `routed` and `depth` filled where not given (None) from the
        environment, else their defaults (True, 16), and `trace` likewise from STRATA_TRACE;
        every field checked; depth clamped to 1..256. Warns on clamping, and where the
        environment sets another value than an explicit field (the field wins).

        Raises:
            ValueError: a bad field, or a malformed STRATA_PREFILL_ROUTED_STREAM(_DEPTH) (even
                where the field is given: a setting that means nothing is refused).
        """
        _check_ints(self)
        self.tuning.checked()
        routed, depth, trace = self.routed, self.depth, self.trace
        env_routed, env_depth = _env_routed(), _env_depth()
        if routed is None:
            routed = True if env_routed is None else env_routed
        elif env_routed is not None and env_routed != bool(routed):
            warnings.warn(
                f"{_ENV_ROUTED}={int(env_routed)} is ignored: routed={bool(routed)} was given "
                f"(an explicit argument wins over the environment)", stacklevel=3)
        source = "depth"
        if depth is None:
            depth = DEPTH_DEFAULT if env_depth is None else env_depth
            source = "depth" if env_depth is None else _ENV_DEPTH
        elif env_depth is not None and env_depth != int(depth):
            warnings.warn(
                f"{_ENV_DEPTH}={env_depth} is ignored: depth={int(depth)} was given (an "
                f"explicit argument wins over the environment)", stacklevel=3)
        used = min(max(int(depth), DEPTH_MIN), DEPTH_MAX)
        if used != depth:
            warnings.warn(
                f"{source}={depth} is outside {DEPTH_MIN}..{DEPTH_MAX}; using {used}",
                stacklevel=3)
        if trace is None:
            trace = os.environ.get(_ENV_TRACE, "0").strip() not in ("", "0")
        if self.backend not in ("auto", "cpu", "cuda"):
            raise ValueError(f"backend={self.backend!r}: expected 'auto', 'cpu' or 'cuda'")
        if self.resident_per_layer < 0:
            raise ValueError(f"resident_per_layer={self.resident_per_layer}: must be >= 0")
        return dataclasses.replace(self, routed=bool(routed), depth=used, trace=bool(trace))


def _env_routed() -> bool | None:
    """STRATA_PREFILL_ROUTED_STREAM as a bool, or None where it is unset or empty."""
    env = os.environ.get(_ENV_ROUTED)
    if env is None or env.strip() == "":
        return None
    if env.strip() not in ("0", "1"):
        raise ValueError(f"{_ENV_ROUTED}={env!r}: expected 0 or 1")
    return env.strip() == "1"


def _env_depth() -> int | None:
    """STRATA_PREFILL_ROUTED_STREAM_DEPTH as an int (not yet clamped), or None where it is
    unset or empty."""
    env = os.environ.get(_ENV_DEPTH)
    if env is None or env.strip() == "":
        return None
    try:
        return int(env)
    except ValueError:
        raise ValueError(f"{_ENV_DEPTH}={env!r}: expected an integer 1..256") from None


_TUNING_FIELDS = frozenset(f.name for f in dataclasses.fields(StreamTuning))
_dataclass_init = StreamConfig.__init__


def _init(self, *args, **kwargs):
    moved = sorted(set(kwargs) & _TUNING_FIELDS)
    if moved:
        given = ", ".join(f"{k}={kwargs[k]!r}" for k in moved)
        raise TypeError(f"StreamConfig({given}): {', '.join(moved)} "
                        f"{'is a field' if len(moved) == 1 else 'are fields'} of StreamTuning; "
                        f"pass StreamConfig(tuning=StreamTuning({given}))")
    _dataclass_init(self, *args, **kwargs)


_init.__doc__ = _dataclass_init.__doc__
_init.__wrapped__ = _dataclass_init
StreamConfig.__init__ = _init


# The integer fields and what each takes (the ValueError's wording).
_INT_FIELDS = {
    "depth": f"an integer {DEPTH_MIN}..{DEPTH_MAX} or None",
    "resident_per_layer": "an integer >= 0",
    "device": "an integer (a CUDA device ordinal)",
}
_TUNING_INT_FIELDS = {
    "ring": "an integer (ring slots) or None",
    "parts": "an integer >= 1 (a divisor of the experts per layer) or None",
    "frames_from": "an integer >= 1 (tokens)",
    "tail_pieces": "an integer >= 1",
    "tail_from": "an integer >= 1 (tokens) or None",
    "stream_floor": "an integer >= 1 (tokens)",
    "seed": "an integer",
}


def _check_int_fields(obj, fields: dict[str, str]) -> None:
    """A ValueError naming the option for an integer field given anything else (a str, a float,
    a bool), instead of int()'s or a comparison's bare message."""
    for name, expected in fields.items():
        value = getattr(obj, name)
        if value is None and name in ("depth", "ring", "parts", "tail_from"):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name}={value!r}: expected {expected}")


def _check_ints(sc: StreamConfig) -> None:
    """`_check_int_fields` over a StreamConfig's integer fields and its tuning's, and the type
    of its switches (a bool; `trace` also None) and budgets (a finite number of GiB;
    `resident_budget_gib` also None): a ValueError naming the field, never a string's
    truthiness or float()'s message."""
    _check_int_fields(sc, _INT_FIELDS)
    for name, env in (("routed", _ENV_ROUTED), ("trace", _ENV_TRACE)):
        value = getattr(sc, name)
        if not (isinstance(value, (bool, np.bool_)) or value is None):
            raise ValueError(f"{name}={value!r}: expected True or False (or None: read {env})")
    for name in ("ring_budget_gib", "resident_budget_gib"):
        value = getattr(sc, name)
        if value is None and name == "resident_budget_gib":
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)) \
                or np.isinf(value):  # NaN: plan_stream's "must be >= 0"
            raise ValueError(f"{name}={value!r}: expected a finite number of GiB >= 0"
                             + (" (or None)" if name == "resident_budget_gib" else ""))
    if not isinstance(sc.tuning, StreamTuning):
        raise ValueError(f"tuning={sc.tuning!r}: expected a StreamTuning")
    _check_int_fields(sc.tuning, _TUNING_INT_FIELDS)
