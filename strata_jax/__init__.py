"""Prefill prompts through mixture-of-experts models whose experts stream from pinned host RAM.

A Flax model computes attention, routing and the expert math on the device; the routed experts
that are not resident cross the PCIe link through a ring of device slots, copied by a native
issuer thread behind XLA FFI custom calls, which skips the experts no token of a chunk routes
to. The outputs are the same bits whether experts are resident, all streamed or routed-streamed.

The main names:
    Engine, StreamConfig, StreamTuning, Session   prefill and score, resident or streamed
    ModelConfig, PRESETS, get_preset              model shapes and published presets
    Kernels                                       which kernels the programs run
    load_checkpoint (strata_jax.checkpoint)       Hugging Face safetensors checkpoints
    SyntheticParams, init_synthetic               synthetic weights with controlled routing
    ExpertProfile                                 routing counts, for choosing residents
    Tokenizer (strata_jax.text)                   a checkpoint's tokenizer.json: text in and out

Importing the package loads no native code: the stream and the engine load the native library
on first use (`strata_jax.native`).
"""

from strata_jax._version import __version__
from strata_jax.config import ModelConfig
from strata_jax.engine import Engine, PrefillResult, ScoreResult, Session
from strata_jax.experts import (ExpertSource, ExpertWeights, ResidentExperts, pack_expert_blobs,
                                unpack_expert_blobs)
from strata_jax.kernels import Kernels
from strata_jax.models import (PRESETS, KVCache, MoETransformer, build_model, forward,
                               get_preset, init_cache)
from strata_jax.profile import ExpertProfile
from strata_jax.stream import StreamConfig, StreamTuning
from strata_jax.synthetic import SKEW_40_PERCENT_512_TOP10, SyntheticParams, init_synthetic
from strata_jax.text import Tokenizer

__all__ = [
    "__version__",
    "Engine", "StreamConfig", "StreamTuning", "Session", "PrefillResult", "ScoreResult",
    "ModelConfig", "PRESETS", "get_preset", "Kernels", "ExpertProfile", "ExpertSource",
    "ExpertWeights", "ResidentExperts", "pack_expert_blobs", "unpack_expert_blobs", "KVCache",
    "MoETransformer", "build_model", "forward", "init_cache", "SKEW_40_PERCENT_512_TOP10",
    "init_synthetic", "SyntheticParams", "Tokenizer",
]
