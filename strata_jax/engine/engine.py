"""The prefill engine: `Engine.prefill` and `Engine.score` read a prompt through the model with
experts resident or streamed (`StreamConfig`), chunk-major or layer-major, and return a
`PrefillResult` / `ScoreResult` with a `Session` for the next turn.

Chunks are padded to compile buckets (`results.compile_buckets`): each bucket and kind (first
chunk or follow-up) compiles once, and padding never shows (it routes to no expert, sits after
every real token, and lands in the KV cache's slack past `max_context`). Bad input is refused
before any device work; an error or Ctrl-C mid-prefill stops the chunk's walk, leaves the
engine usable and the caller's session unchanged. docs/DESIGN.md ("The engine") has the rest.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
import warnings
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.config import ModelConfig
from strata_jax.devices import free_memory
from strata_jax.engine.dense import HostDense, check_dense
from strata_jax.engine.memory import (MIN_BUCKET, chunk_bytes, choose_chunk, kv_cache_bytes,
                                      layer_major_bytes)
from strata_jax.engine.placement import (check_stream_device, counted, device_name, device_of,
                                         engine_mesh, first_local, info_sharding, on_mesh,
                                         settle)
from strata_jax.engine.results import chunk_ids, split_info
from strata_jax.engine.results import (ChunkRecord, PrefillResult, ScoreResult, Session, _bucket,
                                       compile_buckets, sha256_of)
from strata_jax.experts import ExpertWeights
from strata_jax.formats import ExpertFormat
from strata_jax.kernels import Kernels
from strata_jax.kernels.quantized import resolve_format
from strata_jax.layers.moe import PARTS_COMPILER_OPTIONS
from strata_jax.models import (build_model, expert_plane_names, init_cache, param_shapes,
                               validate_inputs)
from strata_jax.parallel import (EXPERT_AXIS, ExpertParallel, replicated, set_parallel,
                                 shard_map, state_shardings)
from strata_jax.profile import ExpertProfile
from strata_jax.stream import (_STREAM_MODES, NativeStreamer, StreamConfig, StreamedExperts,
                               StreamerGroup, stream_platform)
from strata_jax.text import Tokenizer, model_tokenizer, prompt_ids
from strata_jax.weights import LazyExperts, ParamsView

__all__ = ["Engine", "Session", "PrefillResult", "ScoreResult", "ChunkRecord",
           "ORDERS", "MIN_BUCKET", "compile_buckets", "sha256_of"]

ORDERS = ("chunk-major", "layer-major")

_engine_ids = itertools.count(1)


class Engine:
    """Prefill through an MoE model with experts resident or streamed.

    Args:
        config: Model config.
        params: Flat name -> array (see `models.param_shapes`), experts
            included (synthetic.init_synthetic or a checkpoint's arrays); host
            numpy arrays are fine: streamed experts stay in host memory. A mapping that
            makes each tensor when asked for (`synthetic.SyntheticParams`) is read one
            tensor at a time, the experts straight into the host store or onto the device
            (`strata_jax.weights`): no second copy of them is made.
        stream: None keeps every expert resident on the device; a StreamConfig
            streams the non-resident ones through the native engine.
        max_context: Positions a session may hold, in tokens.
        chunk_size: Tokens per chunk (chunk-major), also the largest compile bucket. None
            (the default): the engine chooses the largest chunk whose activations and KV cache
            fit the memory left on the device once the model is placed (`chunk_choice` says
            how; `memory_available`), at most `max_context`.
        experts: Optional layer -> ExpertWeights (or `weights.LazyExperts`) when the
            routed experts are not in `params` (a checkpoint's, `load_checkpoint`).
        order: Default read order of `prefill`: "chunk-major" or "layer-major"
            (falls back to chunk-major, with a warning and `result.fallback`, when its
            memory does not fit).
        sub_chunk: Layer-major compute sub-chunk in tokens; default chunk_size.
        layer_major_limit_bytes: Memory a prefill's activations may use: the
            automatic chunk size and layer-major's check. None: the device's
            free memory where the backend reports it (GPU), else the host's
            available RAM (CPU). On a GPU an explicit limit caps the free
            memory further.
        device: Where the model runs: a jax.Device or a platform name ("cpu", "gpu"; its
            first device). None: JAX's default device with every expert resident, the
            stream's device when streamed. A streamed engine runs where its stream backend
            puts the ring ("cpu": the CPU, "cuda": the GPU), so another device is a ValueError.
        progress: Called as progress(done_layers, total_layers) as a streamed engine writes
            each MoE layer's experts into its host store, or a resident one puts them on the
            device (the long part of making an engine for a full-size model).
        kernels: The grouped matmul and attention the engine's programs use (`Kernels`;
            default: the measured best on the device).
        mesh: Expert parallelism: a `jax.sharding.Mesh` with an "expert" axis, or a device
            count N (the first N devices: `parallel.expert_mesh`; with a stream, of the
            stream backend's platform). Each device holds its slice of every MoE layer's
            experts (experts E*d/G .. E*(d+1)/G), and the rest is replicated; each layer's
            partial outputs are summed across the devices (docs/DESIGN.md, "Several
            devices"). With a `stream`, each device streams its slice through its own native
            engine (`StreamerGroup`: its residents, ring and link; the budgets per device)
            and each chunk runs under `shard_map`. None: one device.
        tokenizer: A `strata_jax.Tokenizer`: `prefill` and `score` then take text (a str).
        dense: "device" (the default), or "host": every weight but the routed experts in
            pinned host memory, each layer's copied in while the one before computes
            (`engine/dense.py`; two layers' on the device at a time; once per chunk, once per
            prompt layer-major). One device only.
    """

    def __init__(self, config: ModelConfig, params: Mapping[str, np.ndarray],
                 stream: StreamConfig | None = None, *, max_context: int = 4096,
                 chunk_size: int | None = None,
                 experts: Mapping[int, ExpertWeights] | None = None,
                 order: str = "chunk-major", sub_chunk: int | None = None,
                 layer_major_limit_bytes: int | None = None,
                 device: "jax.Device | str | None" = None,
                 progress: Callable[[int, int], object] | None = None,
                 kernels: Kernels | None = None, mesh=None, tokenizer: Tokenizer | None = None,
                 dense: str = "device"):
        if kernels is not None and not isinstance(kernels, Kernels):
            raise TypeError(f"kernels must be a strata_jax.Kernels, got {type(kernels).__name__}")
        self.kernels = kernels if kernels is not None else Kernels()
        if chunk_size is not None and (isinstance(chunk_size, bool)
                                       or not isinstance(chunk_size, (int, np.integer))
                                       or chunk_size < 1):
            raise ValueError(f"chunk_size={chunk_size!r}: must be a positive int, or None to "
                             "let the engine choose")
        if max_context < 1 or max_context > config.max_seq_len:
            raise ValueError(f"max_context={max_context}: must be in 1..{config.max_seq_len} "
                             f"(the model's max_seq_len)")
        if order not in ORDERS:
            raise ValueError(f"order={order!r}: expected one of {', '.join(ORDERS)}")
        if sub_chunk is not None and sub_chunk < 1:
            raise ValueError(f"sub_chunk={sub_chunk}: must be at least 1 (or None: chunk_size)")
        if layer_major_limit_bytes is not None and layer_major_limit_bytes < 0:
            raise ValueError(f"layer_major_limit_bytes={layer_major_limit_bytes}: must be >= 0")
        self.dense = check_dense(dense)
        if dense == "host" and mesh is not None:
            raise ValueError("dense='host' with a mesh is not implemented (each device would "
                             "copy every layer's weights); use dense='device' with a mesh")
        self.config = config
        self.tokenizer = model_tokenizer(tokenizer, config.vocab_size)
        self.max_context = int(max_context)
        self.order = order
        self.layer_major_limit_bytes = layer_major_limit_bytes
        self._sub_chunk_arg = sub_chunk
        self.chunk_choice = "given"
        # The device the model lands on is known below; an automatic chunk is chosen there.
        self._set_chunk(int(chunk_size) if chunk_size is not None else min(1024, max_context))
        self.uid = next(_engine_ids)
        # Nothing is read here: `params` may make each tensor when asked (strata_jax.weights).
        host_experts = dict(experts or {})
        expert_names = set()
        for layer in config.moe_layers:
            names = expert_plane_names(config, layer)
            expert_names.update(names.values())
            if layer not in host_experts:
                missing = [n for n in names.values() if n not in params]
                if missing:
                    raise KeyError(f"missing expert parameter {missing[0]!r}")
                host_experts[layer] = LazyExperts(params, names)
        dense = ParamsView(params, expert_names)
        self._dense: HostDense | None = None

        wanted = device_of(device)
        self.streamer: NativeStreamer | StreamerGroup | None = None
        self.mesh = engine_mesh(mesh, config, stream, wanted)
        # A streamed mesh runs each chunk under shard_map (`_manual`): every device's stream
        # calls reach its own engine of the group.
        self._manual = self.mesh is not None and stream is not None
        if self._manual:
            self.device = first_local(self.mesh)
            if any(d.process_index != jax.process_index() for d in self.mesh.devices.flat):
                raise ValueError(
                    "a streamed mesh over several processes' devices is not implemented (each "
                    "process would stream its own devices' slices); use a mesh of this "
                    "process's devices, or stream=None to keep every expert resident on a "
                    "mesh over several processes")
            self.streamer = StreamerGroup(
                config, [host_experts.get(l) for l in range(config.n_layers)], stream,
                devices=list(self.mesh.devices.flat), progress=progress)
            try:
                self._stream_inputs = (self.streamer.sharded_resident_blobs(self.mesh), None)
                with jax.default_device(self.device):
                    model = build_model(config, dense, resident_experts=False,
                                        kernels=self.kernels)
            except BaseException:
                self.streamer.close()
                raise
            set_parallel(model, ExpertParallel(self.mesh, manual=True))
        elif self.mesh is not None:
            self.device = first_local(self.mesh)
            with jax.default_device(self.device):
                model = build_model(config, dense, experts=on_mesh(
                    counted(host_experts, progress), self.mesh),
                    resident_experts=True, kernels=self.kernels)
            set_parallel(model, ExpertParallel(self.mesh))
        elif stream is None:
            self.device = wanted if wanted is not None else jax.devices()[0]
            with jax.default_device(self.device):
                model = build_model(config, dense, experts=counted(host_experts, progress),
                                    resident_experts=True, kernels=self.kernels,
                                    on_host=self._dense_block(True))
        else:
            if wanted is not None and stream.backend in ("cpu", "cuda", "auto"):
                # Refused before the experts are packed: the stream's platform follows from its
                # backend alone ("auto" asks JAX and the library, as the NativeStreamer will).
                check_stream_device(wanted, stream_platform(stream.backend), stream.backend)
            self.streamer = NativeStreamer(
                config, [host_experts.get(l) for l in range(config.n_layers)], stream,
                progress=progress)
            self.device = self.streamer.jax_device
            if wanted is not None and wanted != self.device:
                self.streamer.close()
                raise ValueError(
                    f"device={device_name(wanted)} but the stream's residents and ring are on "
                    f"{device_name(self.device)} (StreamConfig.device={self.streamer.stream.device}); "
                    "pass device=None, or the stream's device")
            self._stream_inputs = (self.streamer.resident_blobs, self.streamer.frames)
            try:
                with jax.default_device(self.device):
                    model = build_model(config, dense, resident_experts=False,
                                        kernels=self.kernels, on_host=self._dense_block(False))
            except BaseException:
                self.streamer.close()
                raise
        self._graphdef, state = nnx.split(model)
        if self._dense is not None:  # built into pinned host memory: not the device's
            state = self._dense.take(state)
        if self.mesh is not None:
            state = jax.device_put(state, state_shardings(state, config, self.mesh))
        else:
            state = jax.device_put(state, self.device)
        if chunk_size is None:
            jax.block_until_ready(state)
            chunk, self.chunk_choice = self._choose_chunk()
            self._set_chunk(chunk)
        # The compiled call takes the state as a flat list (flattening an nnx.State costs
        # milliseconds of Python a call).
        self._state_leaves, self._state_def = jax.tree_util.tree_flatten(state)
        # One dispatch for a new session's cache (new_cache); a first chunk makes its own zeros.
        on_device = (jax.sharding.SingleDeviceSharding(self.device) if self.mesh is None
                     else replicated(self.mesh))
        self._zero_cache = jax.jit(self._zeros, out_shardings=on_device)
        self.compilations = 0
        self._info_sharding = info_sharding(self.device, self.mesh, split=self._manual)
        self._jit = jax.jit(self._prefill_on_mesh if self._manual else self._prefill_fn,
                            static_argnames=("first", "mode", "sub", "rows", "width", "score"),
                            out_shardings=(on_device, on_device, self._info_sharding),
                            compiler_options=PARTS_COMPILER_OPTIONS if self._parts > 1 else None)
        # The programs run once, by what jit keys them on (the state, blobs and shardings fixed):
        # a prestart before an uncompiled program would only hold its walk through the compile.
        self._launched: set = set()
        self._prefill_lock = threading.Lock()
        self._prefill_thread: int | None = None
        self._profile = ExpertProfile.empty(config)
        self._closed = False

    # -- chunk size ------------------------------------------------------------------------------

    def _dense_block(self, resident_experts: bool):
        """build_model's `on_host` with dense="host" (the host block, made here), else None."""
        if self.dense != "host":
            return None
        self._dense = HostDense(self.config, param_shapes(
            self.config, resident_experts=resident_experts), self.device)
        return self._dense.destination

    def _set_chunk(self, chunk: int) -> None:
        self.chunk_size = int(chunk)
        self.sub_chunk = int(self._sub_chunk_arg or chunk)
        self.buckets = compile_buckets(self.chunk_size)
        self.sub_buckets = compile_buckets(self.sub_chunk)
        # Padding slack: a padded chunk (or layer-major prompt) ends at most this far past the
        # last real position, so its writes never clamp onto real ones.
        self.capacity = self.max_context + max(self.chunk_size, self.sub_chunk)

    def kv_cache_bytes(self, capacity: int | None = None) -> int:
        """Bytes of one KV cache of `capacity` positions (default the engine's)."""
        return kv_cache_bytes(self.config, self.capacity if capacity is None else capacity)

    def chunk_bytes(self, chunk: int, capacity: int | None = None, *, first: bool = False) -> int:
        """Estimated activation bytes of one chunk of `chunk` tokens against a cache of
        `capacity` positions: `engine.memory.chunk_bytes` (what it counts), which the CLI checks
        a plan with before an engine exists, on this engine's device, stream and kernels (a
        quantized format's dequantized layer where "dequantize" reads it here)."""
        return chunk_bytes(self.config, chunk, self.capacity if capacity is None else capacity,
                           first=first, platform=self.device.platform,
                           streamed=self.streamer is not None,
                           attention=self.kernels.attention, dequantized=self._dequantized,
                           parts=self._parts)

    @property
    def _dequantized(self) -> bool:
        """Whether the expert math writes each quantized layer out dequantized (the
        "dequantize" path on this device) rather than reading its planes in a fused kernel."""
        fmt = ExpertFormat.of(self.config)
        return resolve_format(self.kernels.quantized_matmul, fmt, self.device) == "dequantize"

    def _choose_chunk(self) -> tuple[int, str]:
        """`engine.memory.choose_chunk` within `memory_available`."""
        return choose_chunk(self.config, self.max_context, self._sub_chunk_arg,
                            *self.memory_available(), platform=self.device.platform,
                            streamed=self.streamer is not None,
                            attention=self.kernels.attention, dequantized=self._dequantized,
                            parts=self._parts)

    # -- the compiled call ----------------------------------------------------------------------

    def _zeros(self):
        return init_cache(self.config, self.capacity, slack=self.capacity - self.max_context)

    def _prefill_fn(self, state_leaves, resident, ids, cache, *, first: bool, mode: int,
                    sub: int, width: int, rows: int = 0, score: bool = False):
        """One chunk (sub == 0) or a whole layer-major prompt in sub-chunks of `sub` tokens,
        its router and experts on `rows` rows at a time (0: `sub`).

        ids: int32 [width] = [bucket + 2], the padded token ids, then the chunk's start position
            and its number of real tokens (`_chunk_ids`); with `score`, [bucket + 3]: the token
            after the chunk's last (its last row's target) between the two. None with a
            stream, whose begin_chunk hands the chunk its staged ids (`_stage_ids`).
        cache: the session's cache, or None with `first` (zeros made here, not by a dispatch
            of their own before the chunk).

        Returns (logits, cache, info): info is int32, end_chunk's stats [L, 2] (none without a
        stream) then the router counts [n_moe, E], flat, so the host reads both in one copy;
        with `score`, then each row's log-probability of its target (float32 [bucket], bits as
        int32: `_split_info`) and each row's most likely token (int32 [bucket]). Row t's
        target is token t + 1 of the chunk, the next token for its last real row; padding rows
        score whatever follows them and are dropped on the host.
        """
        self.compilations += 1  # runs once per trace, i.e. per compilation
        if first:
            cache = self._zeros()
        state = jax.tree_util.tree_unflatten(self._state_def, state_leaves)
        if self._dense is None:
            model = nnx.merge(self._graphdef, state)
        else:
            model = nnx.merge(self._graphdef, state, self._dense.placeholders())
            model.dense_source = self._dense.calls()
        bucket = width - 2 - int(score)  # a scored chunk's ids hold the token after it too
        source = None
        if self.streamer is not None:
            # begin_chunk first, and the chunk's ids come out of it: nothing of the chunk runs
            # before the issuer and the link are started, wherever XLA would schedule it.
            blobs, frames = resident
            pieces = self._tail_pieces(mode, bucket, layer_major=bool(sub))
            source = StreamedExperts(
                self.streamer.id, mode,
                self.streamer.local_config if self._manual else self.config, blobs,
                jnp.zeros((), jnp.int32), n_ids=width, frames=frames,
                frame_of=self.streamer.frame_of, tail_pieces=pieces,
                tail_shape=self.streamer.tail_shape(bucket),
                tail_layer=self.streamer.tail_layer,
                expert_axis=EXPERT_AXIS if self._manual else None, parts=self._parts)
            ids = source.ids
        tokens, start, n_valid = ids[:bucket], ids[-2], ids[-1]
        start = 0 if first else start
        targets = None
        if score:  # row t scores token t + 1; the last real row the token after the chunk
            rows_at = jnp.arange(bucket, dtype=jnp.int32)
            targets = jnp.where(rows_at == n_valid - 1, ids[bucket], ids[1:bucket + 1])
        if sub:
            out, cache, counts = model.layer_major(tokens, cache, start, source, sub,
                                                   n_valid=n_valid, last_logits=True,
                                                   expert_rows=rows or None, targets=targets)
        else:
            out, cache, counts = model(tokens, cache, start, source, n_valid=n_valid,
                                       last_logits=True, targets=targets)
        logits, scores = out if score else (out, None)
        stats = source.finish() if source is not None else jnp.zeros((0, 2), jnp.int32)
        parts = [stats.reshape(-1), counts.astype(jnp.int32).reshape(-1)]
        if score:
            log_probs, top1 = scores
            parts += [jax.lax.bitcast_convert_type(log_probs, jnp.int32), top1]
        info = jnp.concatenate(parts)
        return logits, cache, info

    def _prefill_on_mesh(self, state_leaves, resident, ids, cache, **static):
        """`_prefill_fn` of a streamed engine on a mesh: the whole chunk under `shard_map`
        over the expert axis, so that each device's stream calls (begin, publish, fetch,
        release, end) run on it and reach its own engine of the group. The weights, the ids,
        the cache and the outputs are replicated (each device computes the same); the resident
        blobs are split (each device's its own); each MoE layer sums its devices' partial
        outputs (`ExpertParallel(manual=True)`). `info` comes back per device, [G * width]:
        each device's end_chunk stats, then the (same) counts and scores."""
        spec = jax.sharding.PartitionSpec
        body = functools.partial(self._prefill_fn, **static)
        return shard_map(body, mesh=self.mesh,
                         in_specs=(spec(), (spec(EXPERT_AXIS), spec()), spec(), spec()),
                         out_specs=(spec(), spec(), spec(EXPERT_AXIS)), check=False)(
            state_leaves, resident, ids, cache)

    @property
    def _parts(self) -> int:
        """The parts each MoE layer streams in (`NativeStreamer.parts`; 1 resident)."""
        return 1 if self.streamer is None else self.streamer.parts

    def _tail_pieces(self, mode: int, bucket: int, *, layer_major: bool) -> int:
        """The pieces a chunk's program runs its last MoE layer in (StreamTuning.tail_pieces),
        chunk-major only: a layer-major prompt's layers run once over all of its sub-chunks."""
        return 1 if layer_major else self.streamer.tail_pieces(
            mode, bucket, grouped_matmul=self.kernels.grouped_matmul,
            quantized=self.kernels.quantized_matmul)

    def _stage_ids(self, ids: list[np.ndarray], *, reset: bool = False) -> None:
        """Hands streamed chunks' ids (`_chunk_ids`, in dispatch order) to the engine before
        they are dispatched; each chunk's begin_chunk writes its own on the device as kernel
        arguments (`NativeStreamer.stage_ids`; `reset` drops ids left over), so no copy of the
        prefill's meets the walk's queue (DESIGN.md, "Staged ids")."""
        self.streamer.stage_ids(np.concatenate(ids), reset=reset)

    def _dispatch(self, piece: np.ndarray, bucket: int, cache, start: int, *,
                  mode: int, sub: int, prestart: bool = False, staged: bool = False,
                  rows: int = 0, next_token: int | None = None):
        """Queues one compiled call on `piece` padded to `bucket` tokens (returns at once).

        Its `info` lands in the device's pinned host memory, written by the program itself
        (`_info_sharding`); where it stays in device memory, the copy to the host is started
        here.

        prestart: no chunk of the stream is queued (a prefill's first chunk). A streamed chunk
        whose program has run before then begins from the host (NativeStreamer.prestart): its walk
        and the link start before the program's begin_chunk would start them (the host's
        launch time earlier). Not before a program's first run: the walk would wait through
        its compile.
        staged: the chunk's ids are staged with the stream already (`_stage_ids`, a prefill's
        chunks all at once); else a streamed chunk stages (queues) its own here, so calls
        dispatched back to back each get theirs.
        next_token: None for a prefill; for a score, the token after the chunk (`_chunk_ids`).
        """
        score = next_token is not None
        width = bucket + 2 + score
        ids = None
        if self.streamer is None:
            ids = chunk_ids(piece, bucket, start, next_token)
        elif not staged:
            self._stage_ids([chunk_ids(piece, bucket, start, next_token)])
        key = (bucket, cache is None, mode, sub, rows, score)
        if prestart and self.streamer is not None and mode in _STREAM_MODES \
                and key in self._launched:
            self.streamer.prestart(piece.size)
        resident = self._stream_inputs if self.streamer is not None else {}
        # Numpy ids (a resident engine's) are copied by the compiled call's C++ path (no host time
        # of a device_put first), the engine's own copy: a caller's transfer guard allows it.
        guard = (jax.transfer_guard_host_to_device("allow") if ids is not None
                 else contextlib.nullcontext())
        with guard:
            logits, cache, info = self._jit(self._state_leaves, resident, ids, cache,
                                            first=cache is None, mode=mode, sub=sub,
                                            rows=rows, width=width, score=score)
        if self._info_sharding.memory_kind != "pinned_host":
            info.copy_to_host_async()
        self._launched.add(key)
        return logits, cache, info

    def _split_info(self, info: np.ndarray) -> tuple[np.ndarray, ...]:
        """`results.split_info` of one of this engine's calls."""
        return split_info(info, self.config,
                          2 * self.streamer.native_layers if self.streamer is not None else 0,
                          self.n_devices if self._manual else 0)

    # -- public API -----------------------------------------------------------------------------

    @property
    def n_devices(self) -> int:
        """The devices the experts are split over: the mesh's expert axis, else 1."""
        return 1 if self.mesh is None else int(self.mesh.shape[EXPERT_AXIS])

    @property
    def mode(self) -> str:
        if self.streamer is None:
            return "resident"
        return "routed" if self.streamer.stream.routed else "stream-all"

    @property
    def profile(self) -> ExpertProfile:
        """Routing counts of every prefill this engine finished (since `reset_profile`)."""
        return self._profile

    def reset_profile(self) -> None:
        self._profile = ExpertProfile.empty(self.config)

    def new_cache(self):
        """A zero KV cache of the engine's capacity (max_context plus the padding slack)."""
        return self._zero_cache()

    def layer_major_shape(self, n_tokens: int) -> tuple[int, int]:
        """(padded prompt length, sub-chunk) of a layer-major read of `n_tokens` tokens."""
        if n_tokens <= self.sub_chunk:
            b = _bucket(n_tokens, self.sub_buckets)
            return b, b
        return -(-n_tokens // self.sub_chunk) * self.sub_chunk, self.sub_chunk

    def layer_major_bytes(self, n_tokens: int, expert_rows: int | None = None) -> int:
        """Estimated activation bytes of a layer-major read of `n_tokens` tokens whose router
        and experts run on `expert_rows` rows at a time (default one sub-chunk):
        `engine.memory.layer_major_bytes` on this engine's shapes and device."""
        p, s = self.layer_major_shape(n_tokens)
        return layer_major_bytes(self.config, p, s, self.capacity,
                                 s if expert_rows is None else int(expert_rows),
                                 platform=self.device.platform, attention=self.kernels.attention,
                                 parts=self._parts)

    def layer_major_rows(self, n_tokens: int, have: int | None = None) -> int:
        """The rows a layer-major read of `n_tokens` tokens runs each router/expert call on:
        the most whole sub-chunks, up to the padded prompt and at most the engine's chunk (the
        rows a chunk-major chunk runs), whose `layer_major_bytes` fit `have` bytes (default
        `memory_available`); one sub-chunk where none fits. A grouped matmul over more rows
        keeps its tiles fuller."""
        p, s = self.layer_major_shape(n_tokens)
        if have is None:
            have = self.memory_available()[0]
        most = max(1, min(p, max(self.chunk_size, s)) // s)
        for m in range(most, 0, -1):
            if self.layer_major_bytes(n_tokens, m * s) <= have:
                return m * s
        return s

    def memory_available(self) -> tuple[int, str]:
        """(bytes, what) layer-major may use: device free memory, host RAM, or the set limit;
        with dense="host", less the two layers' dense weights a program copies in."""
        have, what = free_memory(self.device, self.layer_major_limit_bytes, "layer_major_limit_bytes")
        if self._dense is None:
            return have, what
        return max(have - self._dense.in_flight_bytes, 0), f"{what}, less 2 layers' dense"

    def prefill(self, tokens, session: Session | None = None, *, order: str | None = None,
                progress: Callable[[int, int], object] | None = None,
                sync_chunks: bool = True, chunk_size: int | None = None) -> PrefillResult:
        """Reads `tokens` (after the session's positions, if any).

        Args:
            tokens: int token ids [T] of the new text only, or a str (with a `tokenizer`; with a
                `session`, encoded without special tokens: the turns read as one sequence).
            session: A Session from an earlier prefill of this engine, or None.
            order: "chunk-major" or "layer-major"; None: the engine's default
                (`Engine(order=...)`).
            progress: Called as progress(done_tokens, total_tokens) after each chunk (once at
                the end for layer-major), e.g. to drive a progress bar.
            sync_chunks: Wait for each chunk to finish so its time is measured
                (per-chunk `ms`). False dispatches each chunk while the one before runs
                (on the GPU the next chunk's copies start as soon as the ring allows), reports
                only the total time (chunk `ms` is None) and calls `progress` as chunks are
                dispatched.
            chunk_size: Chunk-major chunks of this many tokens for this call, at most the
                engine's `chunk_size` (its KV cache's padding slack); None: the engine's.

        Returns:
            PrefillResult.

        Raises:
            ValueError: bad token ids, an empty prompt, a prompt past the maximum context, a
                session from another engine or model, or an unknown order.
            RuntimeError: called from inside this engine's own prefill (its `progress`), or
                after `close()`.
            ValueError: chunk_size outside 1..the engine's chunk_size.
            TypeError: a str prompt and no `tokenizer`.

        An engine reads one prompt at a time: a prefill called from another thread meanwhile
        waits for this one to end (the stream's chunk protocol runs in one order, and a
        prefill's first chunk is begun from the host).
        """
        with self._one_prompt("prefill"):
            return self._prefill(tokens, session, order, progress, sync_chunks, chunk_size)

    def score(self, tokens, session: Session | None = None, *, order: str | None = None,
              progress: Callable[[int, int], object] | None = None,
              sync_chunks: bool = True, chunk_size: int | None = None) -> "ScoreResult":
        """Reads `tokens` as `prefill` does and scores them: the log-probability of each token
        after the first given everything before it (the session's positions included).

        Each chunk's program (or the layer-major prompt's) also runs its rows' final hidden
        states through the final norm and the LM head, in row blocks, and keeps only
        log p(next token) and the most likely token (`MoETransformer.score_rows`): no [T, V]
        logits, and both come back with the chunk's routing counts. The KV cache, the
        session, the last position's logits and the stats are the prefill's.

        Args: as `prefill`'s.

        Returns:
            ScoreResult: a PrefillResult with `logprobs` (float32 [T - 1]; logprobs[i] is
            log p(tokens[i + 1] | the session's tokens, tokens[:i + 1])), `top1` (int32
            [T - 1], the most likely token at each of those positions), `sum_logprob`,
            `mean_nll`, `perplexity` and `top1_accuracy`. tokens[0] is not scored: its
            context ends with the session's last position, whose logits the earlier result
            holds (log_softmax of its `logits` at tokens[0]).

        Raises:
            ValueError: what `prefill` refuses, and a prompt of one token (nothing to score).
            RuntimeError: as `prefill`.
        """
        with self._one_prompt("score"):
            return self._prefill(tokens, session, order, progress, sync_chunks, chunk_size,
                                 score=True)

    @contextlib.contextmanager
    def _one_prompt(self, what: str):
        """Holds the engine for one prefill or score: another thread's call waits; a call from
        inside one (its progress callback) is refused."""
        if self._prefill_thread == threading.get_ident():
            raise RuntimeError(
                f"Engine.{what} called from inside a prefill of the same engine (from its "
                "progress callback?); the engine reads one prompt at a time. Call it after "
                "this call returns, or with another Engine.")
        with self._prefill_lock:
            self._prefill_thread = threading.get_ident()
            try:
                yield
            finally:
                self._prefill_thread = None

    def _prefill(self, tokens, session, order, progress, sync_chunks, chunk,
                 score: bool = False) -> PrefillResult:
        # TypeError: text without a tokenizer; a follow-up turn's without special tokens (a BOS).
        tokens = prompt_ids(tokens, self.tokenizer, continuation=session is not None)
        order = self.order if order is None else order
        if chunk is None:
            chunk, buckets = self.chunk_size, self.buckets
        elif (isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer))
              or not 1 <= chunk <= self.chunk_size):
            raise ValueError(
                f"chunk_size={chunk!r}: a call's chunks must be 1..{self.chunk_size} tokens (the "
                "engine's chunk_size, which sets its KV cache's padding slack); make the Engine "
                "with a larger chunk_size for larger chunks")
        else:
            chunk = int(chunk)
            buckets = compile_buckets(chunk)
        if order not in ORDERS:
            raise ValueError(f"order={order!r}: expected one of {', '.join(ORDERS)}")
        if progress is not None and not callable(progress):
            raise TypeError(
                f"progress must be callable(done, total), got {type(progress).__name__}")
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
        n = int(np.size(tokens)) if np.ndim(tokens) == 1 else None
        if n is not None and start + n > self.max_context:
            fits = self.max_context - start
            raise ValueError(
                f"prompt past max context: {n} tokens after {start} in the session would end at "
                f"position {start + n}, past max_context={self.max_context}; {fits} more tokens "
                "fit. Shorten the prompt, start a new session, or make the Engine with a larger "
                "max_context.")
        arr = validate_inputs(self.config, tokens, self.max_context, start)
        if score and arr.size < 2:
            raise ValueError(
                "score: a prompt of 1 token has nothing to score (each token is scored given "
                "the ones before it, from the second on); pass at least 2 tokens, or prefill it "
                "and take log_softmax of the result's logits for the token after it")
        if self.closed:
            raise RuntimeError(f"Engine.{'score' if score else 'prefill'}: the engine was "
                               "closed; make a new Engine")
        if self.streamer is not None:
            self.streamer.check_process()

        fallback = None
        if order != "chunk-major":
            need = self.layer_major_bytes(arr.size)
            have, what = self.memory_available()
            if need > have:
                p, s = self.layer_major_shape(arr.size)
                why = (f"layer-major needs about {need / 2**20:.1f} MiB of activations for "
                       f"{arr.size} tokens (padded to {p}, sub-chunks of {s}) but {what} is "
                       f"{have / 2**20:.1f} MiB")
                fallback = (why + "; read chunk-major instead (a smaller sub_chunk or a "
                            "shorter prompt fits layer-major)")
                warnings.warn(fallback, RuntimeWarning, stacklevel=2)
                order = "chunk-major"
            else:
                order = "layer-major"

        if self.streamer is not None:
            self.streamer.cancel(False)  # a failed prefill before this one cancelled the stream
        cache = session.cache if session is not None else None  # None: zeros in the call
        records: list[ChunkRecord] = []
        counts_total = np.zeros((len(self.config.moe_layers), self.config.n_experts), np.int64)
        pending = []  # (record index, real tokens, info) per chunk, read at the end
        logits = None
        t0 = time.perf_counter()
        try:
            rows = 0
            if order == "layer-major":
                p, s = self.layer_major_shape(arr.size)
                pieces = [(0, arr, p, s)]
                rows = self.layer_major_rows(arr.size, have)
            else:
                pieces = [(off, arr[off:off + chunk],
                           _bucket(min(chunk, arr.size - off), buckets), 0)
                          for off in range(0, arr.size, chunk)]
            # A scored piece's last row scores the token after it (0 after the prompt's last).
            nexts = [(int(arr[off + piece.size]) if off + piece.size < arr.size else 0)
                     if score else None for off, piece, _, _ in pieces]
            if self.streamer is not None:  # nothing of this engine is queued: reset
                self._stage_ids([chunk_ids(piece, bucket, start + off, nxt)
                                 for (off, piece, bucket, _), nxt in zip(pieces, nexts)],
                                reset=True)
            pos = start
            for (off, piece, bucket, sub), nxt in zip(pieces, nexts):
                # The floor compares the chunk's real tokens: with the routed switch on, a chunk
                # below it reads only its routed experts even when its bucket reaches the floor
                # (at most one more program, for the bucket the floor falls in).
                mode = self.streamer.chunk_mode(piece.size) if self.streamer is not None else 0
                c0 = time.perf_counter()
                logits, cache, info = self._dispatch(piece, bucket, cache, pos, mode=mode,
                                                     sub=sub, rows=rows if sub else 0,
                                                     prestart=not records, staged=True,
                                                     next_token=nxt)
                chunk_ms = None
                if sync_chunks:
                    jax.block_until_ready((logits, cache))
                    chunk_ms = (time.perf_counter() - c0) * 1e3
                # Unsynced, the next chunk is dispatched while this one runs: its copies wait on
                # the device for this chunk's reads of the ring (and with publish="callback" its
                # begin_chunk waits on the host for this chunk's publish callbacks), so the link
                # does not idle through this chunk's tail. Its stats are read after the last
                # chunk.
                pending.append((len(records), int(piece.size), info))
                records.append(ChunkRecord(pos, int(piece.size), chunk_ms, None, bucket))
                pos += piece.size
                if progress is not None:
                    progress(pos - start, int(arr.size))
            # The infos' copies started at dispatch: reading them is the wait.
            infos = [self._split_info(info) for _, _, info in pending]
            jax.block_until_ready((logits, cache))
            for (i, n, _), (st, counts, _, _) in zip(pending, infos):
                counts_total += counts
                if self.streamer is not None:
                    pieces = self._tail_pieces(self.streamer.chunk_mode(n), records[i].bucket,
                                               layer_major=order == "layer-major")
                    records[i].stats = self.streamer.make_stats(
                        n, st, counts, pieces, self.streamer.tail_shape(records[i].bucket))
        except BaseException:
            # The caller's session is untouched. Queued chunks end at their next stream call (in
            # error) and are waited for; then the walk is stopped (aborting under a running chunk
            # could hang: a later queued chunk's begin_chunk reset the walk under it).
            if self.streamer is not None:
                try:
                    self.streamer.cancel()
                    settle([info for _, _, info in pending] + [logits, cache])
                finally:
                    self.streamer.abort()
                    self.streamer.clear_ids()  # the cancelled chunks' are left
            raise
        ms = (time.perf_counter() - t0) * 1e3
        new = Session(cache=cache, position=start + int(arr.size), engine_uid=self.uid,
                      model_name=self.config.name)
        extra = {}
        if score:  # each chunk's real rows; the prompt's last position has no target
            real = [(lp[:n], top[:n]) for (_, n, _), (_, _, lp, top) in zip(pending, infos)]
            top1 = np.concatenate([t for _, t in real])[:-1]
            extra = {"logprobs": np.concatenate([lp for lp, _ in real])[:-1], "top1": top1,
                     "top1_hits": int(np.count_nonzero(top1 == arr[1:]))}
        result = (ScoreResult if score else PrefillResult)(
            logits=logits, session=new, chunks=records, tokens=new.position, reused=start,
            read=int(arr.size), ms=ms, counts=counts_total, order=order, fallback=fallback,
            mode=self.mode, n_layers=self.config.n_layers,
            chunk_size=(self.layer_major_shape(arr.size)[1] if order == "layer-major"
                        else chunk),
            chunk_choice=self.chunk_choice, expert_rows=rows, devices=self.n_devices, **extra)
        self._profile.record(counts_total, tokens=int(arr.size))
        return result

    def close(self) -> None:
        """Ends the engine, resident or streamed (a streamed one's threads and host store go):
        a later `prefill` raises RuntimeError. Idempotent; `with Engine(...)` closes on exit.
        A prefill or score running on another thread ends first (close waits for it); from
        inside one (its progress callback) the engine closes under it and it fails."""
        self._closed = True
        if self._prefill_thread == threading.get_ident():
            if self.streamer is not None:
                self.streamer.close()
            return
        with self._prefill_lock:  # no program of this engine runs after its stream closes
            if self.streamer is not None:
                self.streamer.close()
            self._state_leaves = self._dense = None  # the weights go with their last reference

    @property
    def closed(self) -> bool:
        """True once `close()` ran (or the stream it streams through was closed)."""
        return self._closed or (self.streamer is not None and self.streamer.closed)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

