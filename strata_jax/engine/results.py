"""What a prefill returns: `Session` (the KV cache and position a follow-up turn needs),
`PrefillResult` and `ScoreResult` (logits or scores, per-chunk `ChunkRecord`s, per-layer stats,
routing counts, hashes), and the compile buckets chunks are padded to.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np

from strata_jax.engine.memory import MIN_BUCKET
from strata_jax.parallel import device_rows
from strata_jax.stream import ChunkStats

_STAT_KEYS = ("streamed", "copied", "skipped", "unrouted", "bytes")


def sha256_of(*arrays) -> str:
    """SHA-256 of the raw bytes of arrays (device arrays are fetched)."""
    h = hashlib.sha256()
    for a in arrays:
        for leaf in jax.tree_util.tree_leaves(a):
            h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


def compile_buckets(limit: int) -> tuple[int, ...]:
    """Padded lengths for chunks of at most `limit` tokens: powers of two from 16 below `limit`,
    then `limit` itself."""
    out, b = [], MIN_BUCKET
    while b < limit:
        out.append(b)
        b *= 2
    out.append(int(limit))
    return tuple(out)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= n)


@dataclasses.dataclass(frozen=True)
class Session:
    """What a follow-up turn needs: the KV cache and how many positions it holds.

    `cache` has the engine's full capacity (max_context plus padding slack); only positions
    0..position-1 are meaningful (`valid_cache`).
    """

    cache: Any  # the model's cache (`models.init_cache`; a KVCache for the decoder stack)
    position: int
    engine_uid: int
    model_name: str

    def valid_cache(self):
        """The cache's valid positions only (its `valid(position)`; the decoder stack's: per
        layer [position, KVH, D])."""
        p = self.position
        return self.cache.valid(p)

    def kv_sha256(self) -> str:
        """SHA-256 of the valid positions' keys then values, layer by layer (`valid_cache`'s
        bytes): each array is fetched whole and cut on the host, so hashing a session takes no
        device memory (a device-side cut of a 32K cache is a second cache)."""
        p = self.position
        valid = jax.tree_util.tree_leaves(jax.eval_shape(lambda c: c.valid(p), self.cache))
        h = hashlib.sha256()
        for leaf, want in zip(jax.tree_util.tree_leaves(self.cache), valid):
            a = np.asarray(leaf)
            h.update(np.ascontiguousarray(a if a.shape == want.shape else a[:want.shape[0]])
                     .tobytes())
        return h.hexdigest()


@dataclasses.dataclass
class ChunkRecord:
    """One compiled call: `length` real tokens from position `start`, padded to `bucket`."""

    start: int
    length: int
    ms: float | None  # None when the prefill did not wait for each chunk (sync_chunks=False)
    stats: ChunkStats | None
    bucket: int = 0

    def to_dict(self) -> dict:
        out = {"start": self.start, "tokens": self.length, "bucket": self.bucket,
               "ms": None if self.ms is None else round(self.ms, 3)}
        if self.stats is not None:
            out["stream_mode"] = self.stats.mode
            out["ring_layout"] = self.stats.layout
            out["tail_pieces"] = self.stats.tail_pieces
            if self.stats.tail_shape is not None:
                out["tail_shape"] = self.stats.tail_shape
            out.update(self.stats.totals())
            if hasattr(self.stats, "device_totals"):  # a streamed mesh's (GroupChunkStats)
                out["per_device"] = self.stats.device_totals()
        return out


@dataclasses.dataclass
class PrefillResult:
    """The outcome of `Engine.prefill`.

    Attributes:
        logits: float32 [V], the last position's logits.
        session: Session for the next turn.
        chunks: per-call records (ChunkRecord: start, length, bucket, ms, ChunkStats), in order.
            Layer-major reads the prompt as one record.
        tokens: positions in the session after this prefill.
        reused: positions taken from the session passed in.
        read: tokens read by this call.
        ms: wall time of the whole prefill, device-synchronised (also `prompt_ms`).
        counts: int64 [n_moe_layers, E], routing counts of the tokens read (padding excluded).
        order: "chunk-major" or "layer-major": what actually ran.
        fallback: None, or why a requested layer-major read fell back to chunk-major.
        mode: "resident", "stream-all" or "routed".
        n_layers: the model's layers (for per-layer lists).
        chunk_size: the chunk (chunk-major) or sub-chunk (layer-major) the prompt was read in.
        chunk_choice: how the engine's chunk size was set: "given", or the automatic choice
            with its memory figures (Engine(chunk_size=None)).
        expert_rows: layer-major only: the rows each router/expert call ran on (a multiple of
            the sub-chunk, at most the engine's chunk: `Engine.layer_major_rows`); else 0.
        devices: the devices the experts were split over (`Engine(mesh=)`; 1 without a mesh).
    """

    logits: jax.Array
    session: Session
    chunks: list
    tokens: int
    reused: int
    read: int
    ms: float
    counts: np.ndarray | None = None
    order: str = "chunk-major"
    fallback: str | None = None
    mode: str = "resident"
    n_layers: int = 0
    chunk_size: int = 0
    chunk_choice: str = "given"
    expert_rows: int = 0
    devices: int = 1

    def per_device(self) -> dict:
        """Per device of the expert split: "rows", the token copies its experts computed
        (routing counts summed over its expert slice and the MoE layers); a streamed mesh's
        also "streamed", each device's stream totals (streamed, copied, skipped, unrouted,
        bytes) summed over the chunks."""
        out = {"rows": [0] * self.devices}
        if self.counts is not None:
            out["rows"] = [int(x) for x in device_rows(self.counts, self.devices).sum(0)]
        per = [c.stats.device_totals() for c in self.chunks
               if c.stats is not None and hasattr(c.stats, "device_totals")]
        if per:
            out["streamed"] = [{k: sum(p[d][k] for p in per) for k in _STAT_KEYS}
                               for d in range(self.devices)]
        return out

    @property
    def prompt_ms(self) -> float:
        return self.ms

    def totals(self) -> dict:
        out = dict.fromkeys(_STAT_KEYS, 0)
        for c in self.chunks:
            if c.stats is not None:
                for k, v in c.stats.totals().items():
                    out[k] += v
        return out

    def per_layer(self) -> dict:
        """Per model layer sums over chunks: streamed, copied, skipped, unrouted, bytes.

        All zeros for a resident engine (nothing streams); {} when the layer count is unknown.
        """
        stats = [c.stats for c in self.chunks if c.stats is not None]
        if not stats:
            return {k: [0] * self.n_layers for k in _STAT_KEYS} if self.n_layers else {}
        return {k: [int(x) for x in sum(getattr(s, k) for s in stats)] for k in _STAT_KEYS}

    def logits_sha256(self) -> str:
        return sha256_of(self.logits)

    def kv_sha256(self) -> str:
        """SHA-256 of the session's valid KV positions (never the padding slack)."""
        return self.session.kv_sha256()

    def summary(self) -> str:
        t = self.totals()
        n = len(self.chunks)
        how = f"{n} chunk{'s' if n != 1 else ''} of {self.chunk_size}"
        if self.order == "layer-major":
            how = f"layer-major, sub-chunks of {self.chunk_size}"
            if self.expert_rows > self.chunk_size:
                how += f", experts over {self.expert_rows} rows"
        line = (f"{self.tokens} tokens = {self.reused} reused + {self.read} read in "
                f"{self.ms:.1f} ms ({how})")
        if t["streamed"]:
            line += (f"; experts streamed {t['streamed']}, copied {t['copied']}, skipped "
                     f"{t['skipped']} of {t['unrouted']} unrouted, {t['bytes'] / 2**20:.1f} MiB")
        return line

    def to_dict(self) -> dict:
        """A JSON-ready summary: counts, hashes, per-layer and per-chunk stats."""
        t = self.totals()
        return {
            "tokens": self.tokens,
            "reused": self.reused,
            "read": self.read,
            "prompt_ms": round(self.ms, 3),
            "mode": self.mode,
            "order": self.order,
            "fallback": self.fallback,
            "chunk_size": self.chunk_size,
            "chunk_choice": self.chunk_choice,
            "expert_rows": self.expert_rows,
            "devices": self.devices,
            "per_device": self.per_device(),
            "experts_streamed": t["streamed"],
            "copied": t["copied"],
            "skipped": t["skipped"],
            "unrouted": t["unrouted"],
            "bytes_copied": t["bytes"],
            "logits_sha256": self.logits_sha256(),
            "kv_sha256": self.kv_sha256(),
            "per_layer": self.per_layer(),
            "chunks": [c.to_dict() for c in self.chunks],
        }


@dataclasses.dataclass
class ScoreResult(PrefillResult):
    """The outcome of `Engine.score`: its prefill (the PrefillResult fields: logits, session,
    stats, times) and the prompt's per-token log-probabilities and most likely tokens.

    Attributes:
        logprobs: float32 [read - 1]; logprobs[i] = log p(tokens[i + 1] | the session's
            tokens, tokens[:i + 1]), computed on the device in float32.
        top1: int32 [read - 1]; top1[i] = the token the model finds most likely at that
            position (the argmax of the logits logprobs[i] comes from; the lowest id among
            equal largest logits).
        top1_hits: positions where top1[i] == tokens[i + 1].
    """

    logprobs: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))
    top1: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    top1_hits: int = 0

    @property
    def scored(self) -> int:
        """Tokens scored: the prompt's tokens after its first."""
        return int(self.logprobs.size)

    @property
    def sum_logprob(self) -> float:
        """Sum of `logprobs` (in float64)."""
        return float(np.sum(self.logprobs, dtype=np.float64))

    @property
    def mean_nll(self) -> float:
        """Mean negative log-likelihood per scored token, in nats."""
        return -self.sum_logprob / self.scored

    @property
    def perplexity(self) -> float:
        """exp(mean_nll)."""
        with np.errstate(over="ignore"):
            return float(np.exp(self.mean_nll))

    @property
    def top1_accuracy(self) -> float:
        """The fraction of scored tokens that were the model's most likely next token."""
        return self.top1_hits / self.scored

    def logprobs_sha256(self) -> str:
        return sha256_of(self.logprobs)

    def summary(self) -> str:
        return (f"{super().summary()}; scored {self.scored} tokens: mean NLL "
                f"{self.mean_nll:.4f} nats, perplexity {self.perplexity:.4g}, top-1 "
                f"{self.top1_accuracy:.1%}")

    def to_dict(self) -> dict:
        """PrefillResult.to_dict() plus scored, sum_logprob, mean_nll, perplexity,
        top1_accuracy, logprobs_sha256, logprobs (one float per scored token) and top1 (one
        token id per scored token)."""
        out = super().to_dict()
        out.update(scored=self.scored, sum_logprob=self.sum_logprob, mean_nll=self.mean_nll,
                   perplexity=self.perplexity, top1_accuracy=self.top1_accuracy,
                   logprobs_sha256=self.logprobs_sha256(),
                   logprobs=[float(x) for x in self.logprobs],
                   top1=[int(x) for x in self.top1])
        return out


def chunk_ids(piece: np.ndarray, bucket: int, start: int,
               next_token: int | None = None) -> np.ndarray:
    """A chunk's program input: its ids padded to `bucket`, then its start and its length;
    a scored chunk's (`next_token` given: the token after the chunk, 0 after the prompt's
    last) has `next_token` between the padded ids and the start."""
    ids = np.zeros(bucket + 2 + (next_token is not None), np.int32)
    ids[:piece.size] = piece
    if next_token is not None:
        ids[bucket] = next_token
    ids[-2], ids[-1] = start, piece.size
    return ids


def split_info(info, config, n_stats: int, devices: int = 0) -> tuple[np.ndarray, ...]:
    """(end_chunk stats [L, 2] or [0, 2] (with `devices`, a streamed mesh's: every device's,
    [G, L, 2]), counts [n_moe, E], a scored call's per-row log-probabilities float32 [bucket]
    and most likely tokens int32 [bucket] (both [0] unscored)) from a call's info, read once.
    `n_stats`: the stats' int32 values (2 per native layer; 0 unstreamed)."""
    n_counts = len(config.moe_layers) * config.n_experts
    info = np.asarray(info)
    stats = info[:n_stats].reshape(-1, 2)
    if devices:  # [G * width]: each device's stats, then the same counts and scores
        per = info.reshape(devices, -1)
        info = per[0]
        stats = per[:, :n_stats].reshape(devices, -1, 2)
    rows = info[n_stats + n_counts:]
    half = rows.size // 2  # [bucket] log-probabilities, then [bucket] tokens
    return (stats, info[n_stats:n_stats + n_counts].reshape(len(config.moe_layers),
                                                            config.n_experts),
            rows[:half].view(np.float32), rows[half:])
