"""The expert stream: switches, the plan, the native engine and its JAX ops.

A `NativeStreamer` owns one native engine (ffi/src/engine.hpp): the host expert
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

One module per stage:
  config    StreamConfig (what users choose), StreamTuning (what the engine chooses),
            the environment switches, the publish/chunk modes
  plan      StreamPlan and plan_stream (pure: no device, no native library)
  streamer  NativeStreamer (the native engine's handle), stream_platform, ChunkStats
  group     StreamerGroup: one NativeStreamer per device of an expert-parallel mesh, each
            over its slice of every layer's experts, one native group the calls reach by
            device
  ops       the JAX primitive and its FFI custom calls: begin, publish, fetch,
            fetch_frame, release, end
  source    StreamedExperts, the model's expert source inside a jitted chunk
"""

# The names outside __all__ are imported from here by the engine and the tests.
from strata_jax.stream.config import (
    _STREAM_MODES, DEPTH_MAX, DEPTH_MIN, StreamConfig, StreamTuning
)
from strata_jax.stream.ops import begin, end, fetch, fetch_frame, publish, release  # noqa: F401
from strata_jax.stream.plan import StreamPlan, plan_stream
from strata_jax.stream.source import StreamedExperts
from strata_jax.stream.streamer import ChunkStats, NativeStreamer
from strata_jax.stream.backend import stream_platform
from strata_jax.stream.group import GroupChunkStats, StreamerGroup, expert_slices

__all__ = [
    "StreamConfig",
    "StreamTuning",
    "StreamPlan",
    "plan_stream",
    "NativeStreamer",
    "StreamedExperts",
    "ChunkStats",
    "StreamerGroup",
    "GroupChunkStats",
    "expert_slices",
    "DEPTH_MIN",
    "DEPTH_MAX",
]
