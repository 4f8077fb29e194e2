"""Property tests of the stream plan (hypothesis): for any model shape, profile and budgets the
plan accepts, every expert of a MoE layer is either resident or streamed exactly once, each
layer's stream is hottest first, the resident set respects its budget and takes the hottest
experts, and the ring holds at least one layer's streamed experts."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_jax.models import get_preset
from strata_jax.stream import StreamConfig, plan_stream

BASE = get_preset("qwen3-30b-a3b")


@st.composite
def plans(draw):
    n_layers = draw(st.integers(1, 4))
    n_experts = draw(st.integers(2, 24))
    top_k = draw(st.integers(1, min(4, n_experts)))
    cfg = BASE.scaled(n_layers=n_layers, n_experts=n_experts, top_k=top_k, hidden_size=64,
                      expert_intermediate=16)
    blob = cfg.expert_bytes
    profile = None
    if draw(st.booleans()):
        profile = np.array(draw(st.lists(st.integers(0, 50), min_size=cfg.n_layers * n_experts,
                                         max_size=cfg.n_layers * n_experts)),
                           np.int64).reshape(cfg.n_layers, n_experts)
        for l in range(cfg.n_layers):
            if l not in cfg.moe_layers:
                profile[l] = 0
    kind = draw(st.sampled_from(["none", "per_layer", "budget"]))
    kw = {}
    if kind == "per_layer":
        kw["resident_per_layer"] = draw(st.integers(0, n_experts))
    elif kind == "budget":
        kw["resident_budget_gib"] = draw(st.integers(0, n_experts * len(cfg.moe_layers))) * blob / 2**30
    kw["ring_budget_gib"] = draw(st.integers(n_experts, 3 * n_experts)) * blob / 2**30
    return cfg, StreamConfig(profile=profile, **kw), profile, kind, kw


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_plan_invariants(args):
    cfg, sc, profile, kind, kw = args
    plan = plan_stream(cfg, sc)
    E = cfg.n_experts
    seen = np.zeros((cfg.n_layers, E), np.int64)
    for l, e in plan.stream_list:
        seen[l, e] += 1
    for l in range(cfg.n_layers):
        for e in plan.resident[l]:
            seen[l, e] += 1
        assert list(plan.resident[l]) == sorted(plan.resident[l])
    for l in range(cfg.n_layers):
        want = 1 if l in cfg.moe_layers else 0
        assert (seen[l] == want).all(), f"layer {l}: each expert resident or streamed once"
    np.testing.assert_array_equal(plan.streamed_mask, seen.astype(bool) & ~_resident_mask(plan, cfg))
    np.testing.assert_array_equal(plan.streamed_per_layer, plan.streamed_mask.sum(axis=1))
    # Layer order, and hottest first within a layer (ties: lower id first).
    layers = [l for l, _ in plan.stream_list]
    assert layers == sorted(layers)
    for l in cfg.moe_layers:
        order = [e for ll, e in plan.stream_list if ll == l]
        key = (lambda e: (-profile[l, e], e)) if profile is not None else (lambda e: e)
        assert order == sorted(order, key=key)
    # Residents: the budget is respected, and with a profile they are the hottest.
    count = sum(len(r) for r in plan.resident)
    if kind == "per_layer":
        assert all(len(plan.resident[l]) == kw["resident_per_layer"] for l in cfg.moe_layers)
    if kind == "budget":
        assert count * plan.blob_bytes <= kw["resident_budget_gib"] * 2**30 + 1
    if profile is not None and count:
        res = [profile[l, e] for l in cfg.moe_layers for e in plan.resident[l]]
        streamed = [profile[l, e] for l, e in plan.stream_list]
        if kind == "budget" and streamed:
            assert min(res) >= max(streamed)  # globally hottest
        if kind == "per_layer":
            for l in cfg.moe_layers:
                s = [profile[l, e] for ll, e in plan.stream_list if ll == l]
                r = [profile[l, e] for e in plan.resident[l]]
                if s and r:
                    assert min(r) >= max(s)  # hottest of each layer
    need = int(plan.streamed_per_layer.max(initial=0))
    assert plan.ring >= max(need, 1)


def _resident_mask(plan, cfg):
    m = np.zeros((cfg.n_layers, cfg.n_experts), bool)
    for l in range(cfg.n_layers):
        m[l, list(plan.resident[l])] = True
    return m
