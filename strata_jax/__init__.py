"""strata_jax: prefill prompts through MoE models whose experts stream from pinned host RAM.

The model, configs and checkpoints import without the native library; the
stream and the prefill engine load it on first use (`strata_jax.native`).
"""

from .config import PRESETS, ModelConfig, get_preset
from .kernels import Kernels
from .experts import (ExpertSource, ExpertWeights, ResidentExperts, pack_expert_blobs,
                      unpack_expert_blobs)
from .model import KVCache, MoETransformer, build_model, forward, init_cache
from .profile import ExpertProfile
from .synthetic import SKEW_40_PERCENT_512_TOP10, SyntheticParams, init_synthetic

__all__ = [
    "PRESETS", "ModelConfig", "get_preset", "ExpertSource", "ExpertWeights", "ResidentExperts",
    "pack_expert_blobs", "unpack_expert_blobs", "KVCache", "MoETransformer", "build_model",
    "forward", "init_cache", "SKEW_40_PERCENT_512_TOP10", "init_synthetic", "SyntheticParams",
    "Engine", "StreamConfig", "StreamTuning", "Session", "ExpertProfile", "Kernels",
]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: these load the native library.
    if name in ("Engine", "Session"):
        from . import engine
        return getattr(engine, name)
    if name in ("StreamConfig", "StreamTuning"):
        from . import stream
        return getattr(stream, name)
    raise AttributeError(f"module 'strata_jax' has no attribute {name!r}")
