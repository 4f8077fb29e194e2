"""Layers by kind, shared by the model families: attention paths (`attention`) and the
grouped-query attention block (`gqa`), norms, RoPE, the dense MLP and the MoE block (`moe`:
router, experts, shared expert)."""
