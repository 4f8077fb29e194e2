"""Presets of published shapes whose own attention is not implemented yet: the expert, router and
shared-expert shapes (the bytes the engine streams) are the published ones, the attention is
this package's grouped-query attention. Their checkpoints are refused; each preset's docstring
says what it replaces.
"""

from __future__ import annotations

from strata_jax.config import ModelConfig


def deepseek_v3() -> ModelConfig:
    """DeepSeek-V3-style: 256 routed experts, top-8, one shared expert, first 3 layers dense.

    Router as published: sigmoid scores, a selection bias used only for choosing, group-limited
    choice (8 groups, best 4 by the sum of their top-2 scores), weights renormalised and scaled by
    2.5. Attention is standard multi-head attention (128 heads of 128) in place of Multi-head
    Latent Attention (MLA); no multi-token-prediction layer.
    """
    return ModelConfig(
        name="deepseek-v3", vocab_size=129_280, hidden_size=7168, n_layers=61, n_heads=128,
        n_kv_heads=128, head_dim=128, n_experts=256, top_k=8, expert_intermediate=2048,
        n_dense_layers=3, dense_intermediate=18_432, shared_expert_intermediate=2048,
        router_scores="sigmoid", norm_topk_prob=True, routed_scaling=2.5, selection_bias=True,
        n_groups=8, topk_groups=4, qk_norm="none", rope_theta=10_000.0, rms_norm_eps=1e-6,
        max_seq_len=163_840)


PRESETS = {"deepseek-v3": deepseek_v3}
