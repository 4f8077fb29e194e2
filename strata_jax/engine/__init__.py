"""The prefill engine: `Engine` (prefill and score, resident or streamed, chunk-major or
layer-major), what it returns (`Session`, `PrefillResult`, `ScoreResult`), the memory plan
(`engine.memory`) and where its model goes (`engine.placement`).
"""

from strata_jax.engine.engine import ORDERS, Engine
from strata_jax.engine.memory import MIN_BUCKET
from strata_jax.engine.results import (ChunkRecord, PrefillResult, ScoreResult, Session,
                                       compile_buckets, sha256_of)

__all__ = ["Engine", "Session", "PrefillResult", "ScoreResult", "ChunkRecord", "ORDERS",
           "MIN_BUCKET", "compile_buckets", "sha256_of"]
