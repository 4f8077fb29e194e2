"""The prefill engine: jit-compiled chunked prefill, sessions and stats.

`Engine.prefill(tokens, session=None)` reads a prompt in chunks through the
model, with experts resident or streamed (StreamConfig), and returns the last
position's logits, a `Session` (KV cache and position) for the next turn and
per-chunk stats. One compiled program per chunk length and first/follow-up
kind: repeated calls of the same shapes never recompile (`compilations`).

Failure rule: bad input is refused before any device work; an error or
Ctrl-C mid-prefill stops the chunk's walk, leaves the engine usable and the
caller's session unchanged (sessions are immutable; a new one is returned
only when the whole prompt was read).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import ModelConfig
from .experts import ExpertWeights
from .model import KVCache, build_model, expert_param_names, init_cache, validate_inputs
from .stream import ChunkStats, StreamConfig, StreamedExperts, StreamEngine

__all__ = ["Engine", "Session", "PrefillResult", "sha256_of"]

_engine_ids = itertools.count(1)


def sha256_of(*arrays) -> str:
    """SHA-256 of the raw bytes of arrays (device arrays are fetched)."""
    h = hashlib.sha256()
    for a in arrays:
        for leaf in jax.tree_util.tree_leaves(a):
            h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Session:
    """What a follow-up turn needs: the KV cache and how many positions it holds."""

    cache: KVCache
    position: int
    engine_uid: int
    model_name: str


@dataclasses.dataclass
class PrefillResult:
    """The outcome of `Engine.prefill`.

    Attributes:
        logits: float32 [V], the last position's logits.
        session: Session for the next turn.
        chunks: per-chunk stats (ChunkStats with `ms` added), in order.
        tokens: positions in the session after this prefill.
        reused: positions taken from the session passed in.
        read: tokens read by this call.
        ms: wall time of the whole prefill, device-synchronised.
    """

    logits: jax.Array
    session: Session
    chunks: list
    tokens: int
    reused: int
    read: int
    ms: float

    def totals(self) -> dict:
        out = {"streamed": 0, "copied": 0, "skipped": 0, "unrouted": 0, "bytes": 0}
        for c in self.chunks:
            if c.stats is not None:
                for k, v in c.stats.totals().items():
                    out[k] += v
        return out

    def per_layer(self) -> dict:
        """Per model layer sums over chunks: streamed, copied, skipped, unrouted, bytes."""
        keys = ("streamed", "copied", "skipped", "unrouted", "bytes")
        stats = [c.stats for c in self.chunks if c.stats is not None]
        if not stats:
            return {}
        return {k: [int(x) for x in sum(getattr(s, k) for s in stats)] for k in keys}

    def summary(self) -> str:
        t = self.totals()
        line = (f"{self.tokens} tokens = {self.reused} reused + {self.read} read in "
                f"{self.ms:.1f} ms ({len(self.chunks)} chunks)")
        if t["streamed"]:
            line += (f"; experts streamed {t['streamed']}, copied {t['copied']}, skipped "
                     f"{t['skipped']} of {t['unrouted']} unrouted, {t['bytes'] / 2**20:.1f} MiB")
        return line


@dataclasses.dataclass
class ChunkRecord:
    start: int
    length: int
    ms: float
    stats: ChunkStats | None


class Engine:
    """Prefill through an MoE model with experts resident or streamed.

    Args:
        config: Model config.
        params: Flat name -> array (see `model.param_shapes`), experts
            included (synthetic.init_synthetic or a checkpoint's arrays); host
            numpy arrays are fine: streamed experts stay in host memory.
        stream: None keeps every expert resident on the device; a StreamConfig
            streams the non-resident ones through the native engine.
        max_context: KV cache capacity in tokens.
        chunk_size: Tokens per chunk.
        experts: Optional layer -> ExpertWeights when the routed experts are
            not in `params` (a checkpoint's host expert store).
    """

    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray],
                 stream: StreamConfig | None = None, *, max_context: int = 4096,
                 chunk_size: int = 1024,
                 experts: Mapping[int, ExpertWeights] | None = None):
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size}: must be at least 1")
        if max_context < 1 or max_context > config.max_seq_len:
            raise ValueError(f"max_context={max_context}: must be in 1..{config.max_seq_len} "
                             f"(the model's max_seq_len)")
        self.config = config
        self.max_context = int(max_context)
        self.chunk_size = int(chunk_size)
        self.uid = next(_engine_ids)
        host_experts = dict(experts or {})
        expert_names = set()
        for layer in config.moe_layers:
            names = expert_param_names(config, layer)
            expert_names.update(names)
            if layer not in host_experts:
                missing = [n for n in names if n not in params]
                if missing:
                    raise KeyError(f"missing expert parameter {missing[0]!r}")
                host_experts[layer] = ExpertWeights(*(np.asarray(params[n]) for n in names))
        dense = {k: v for k, v in params.items() if k not in expert_names}

        self.streamer: StreamEngine | None = None
        if stream is None:
            self.device = jax.devices()[0]
            model = build_model(config, dense, experts=host_experts, resident_experts=True)
        else:
            self.streamer = StreamEngine(
                config, [host_experts.get(l) for l in range(config.n_layers)], stream)
            self.device = jax.devices(self.streamer.platform)[0]
            with jax.default_device(self.device):
                model = build_model(config, dense, resident_experts=False)
        self._graphdef, self._state = nnx.split(model)
        self._state = jax.device_put(self._state, self.device)
        self.compilations = 0
        self._jit = jax.jit(self._chunk_fn, static_argnames=("first", "mode"))

    # -- the compiled chunk -------------------------------------------------------------------

    def _chunk_fn(self, state, resident, tokens, cache, start, *, first: bool, mode: int):
        self.compilations += 1  # runs once per trace, i.e. per compilation
        model = nnx.merge(self._graphdef, state)
        source = None
        if self.streamer is not None:
            source = StreamedExperts(self.streamer.id, mode, self.config, resident,
                                     jnp.zeros((), jnp.int32))
        logits, cache, counts = model(tokens, cache, 0 if first else start, source)
        stats = source.finish() if source is not None else jnp.zeros((0, 2), jnp.int32)
        return logits[-1], cache, counts, stats

    # -- public API -----------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        if self.streamer is None:
            return "resident"
        return "routed" if self.streamer.stream.routed else "stream-all"

    def new_cache(self) -> KVCache:
        with jax.default_device(self.device):
            return init_cache(self.config, self.max_context)

    def prefill(self, tokens, session: Session | None = None, *, sync_chunks: bool = True
                ) -> PrefillResult:
        """Reads `tokens` (after the session's positions, if any).

        Args:
            tokens: int token ids [T] of the new text only.
            session: A Session from an earlier prefill of this engine, or None.
            sync_chunks: Wait for each chunk to finish so its time is measured
                (per-chunk ms); False lets chunks overlap and reports only the total.

        Returns:
            PrefillResult.

        Raises:
            ValueError: bad token ids, an empty prompt, a prompt past the
                maximum context, or a session from another engine or model.
        """
        start = 0
        if session is not None:
            if not isinstance(session, Session):
                raise TypeError(f"session must be a Session, got {type(session).__name__}")
            if session.model_name != self.config.name or session.engine_uid != self.uid:
                raise ValueError(
                    f"session belongs to another engine (model {session.model_name!r}, engine "
                    f"{session.engine_uid}); this is engine {self.uid} of {self.config.name!r}. "
                    "Start a new session (session=None) or use the engine that made it.")
            start = session.position
        arr = validate_inputs(self.config, tokens, self.max_context, start)
        if self.streamer is not None and self.streamer.closed:
            raise RuntimeError("the engine's stream was closed; make a new Engine")
        cache = session.cache if session is not None else self.new_cache()
        resident = self.streamer.resident_blobs if self.streamer is not None else {}
        records: list[ChunkRecord] = []
        logits = None
        t0 = time.perf_counter()
        try:
            pos = start
            for off in range(0, arr.size, self.chunk_size):
                piece = arr[off:off + self.chunk_size]
                mode = self.streamer.chunk_mode(piece.size) if self.streamer is not None else 0
                c0 = time.perf_counter()
                logits, cache, counts, st = self._jit(
                    self._state, resident, jax.device_put(piece, self.device), cache,
                    jnp.int32(pos), first=(pos == 0), mode=mode)
                stats = None
                if sync_chunks or self.streamer is not None:
                    jax.block_until_ready((logits, cache))
                if self.streamer is not None:
                    stats = self.streamer.make_stats(piece.size, np.asarray(st), np.asarray(counts))
                records.append(ChunkRecord(pos, int(piece.size),
                                           (time.perf_counter() - c0) * 1e3, stats))
                pos += piece.size
            jax.block_until_ready((logits, cache))
        except BaseException:
            # Stop the walk of the chunk in flight; the caller's session is untouched.
            if self.streamer is not None:
                self.streamer.abort()
            raise
        ms = (time.perf_counter() - t0) * 1e3
        new = Session(cache=cache, position=start + int(arr.size), engine_uid=self.uid,
                      model_name=self.config.name)
        return PrefillResult(logits=logits, session=new, chunks=records, tokens=new.position,
                             reused=start, read=int(arr.size), ms=ms)

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
