"""Multi-head latent attention on a CUDA GPU: the fused (cuDNN) parts against the exact XLA
parts on a first chunk and on later chunks over a prefix of several blocks, and the DeepSeek-V3
model through the real stream byte-identical across the resident, stream-all and routed arms
(padded chunks, a follow-up turn, a layer-major read). Run with STRATA_REQUIRE_GPU=1 on the GPU
machine."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _config():
    from strata_jax.models import get_preset

    return get_preset("deepseek-v3").scaled(n_experts=32, top_k=4, hidden_size=256,
                                            expert_intermediate=128, n_heads=8,
                                            param_dtype="bfloat16")


def test_cuda_mla_fused_and_xla_parts_match_the_float64_reference(monkeypatch):
    """bf16, heads of 16 + 8 (values 16), every token routed to every expert (top-k = E: no
    routing choice that bf16 rounding could flip between the two paths): 300 tokens, then 200
    more over a prefix read in blocks of 256, on cuDNN's parts and on XLA's, each within the
    bf16 tolerance of the float64 reference on the same bf16 weights."""
    from strata_jax.kernels import Kernels
    from strata_jax.layers import mla
    from strata_jax.models import build_model, forward, init_cache
    from strata_jax.reference import reference_forward
    from strata_jax.synthetic import init_synthetic
    from strata_jax.testing import assert_close

    monkeypatch.setattr(mla, "PREFIX_BLOCK_BYTES", 1)
    cfg = _config().replace(n_experts=4, top_k=4, n_groups=1, topk_groups=1)
    params = init_synthetic(cfg, seed=3)
    toks = np.random.default_rng(1).integers(0, cfg.vocab_size, 500).astype(np.int32)
    ref, _ = reference_forward(cfg, params, toks)
    for path in ("cudnn", "split"):
        model = build_model(cfg, params, kernels=Kernels(attention=path))
        first, cache, _ = forward(model, toks[:300], init_cache(cfg, 1024))
        second, _, _ = forward(model, toks[300:], cache, start=300)
        assert_close(first, ref[:300], cfg.dtype, err_msg=f"{path}: the first chunk")
        assert_close(second, ref[300:], cfg.dtype, err_msg=f"{path}: over the prefix")


def test_cuda_mla_turns_and_layer_major_identical(stream_arms):
    from strata_jax.engine import Engine
    from strata_jax.synthetic import init_synthetic
    from strata_jax.testing import arm_reads

    cfg = _config()
    out = arm_reads(Engine, cfg, init_synthetic(cfg, seed=5, routing_skew=2.0), stream_arms(),
                    max_context=1024, chunk_size=64)
    assert out["stream-all"] == out["resident"]
    assert out["routed"] == out["resident"]
