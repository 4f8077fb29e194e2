"""Config presets: exact published expert/router shapes, derived byte counts, validation."""

import dataclasses

import pytest

from strata_jax.models import PRESETS, get_preset
from strata_jax.config import ModelConfig

# name -> (layers, hidden, experts, top_k, expert intermediate, heads, kv heads, vocab)
PUBLISHED = {
    "qwen3-30b-a3b": (48, 2048, 128, 8, 768, 32, 4, 151_936),
    "qwen3-235b-a22b": (94, 4096, 128, 8, 1536, 64, 4, 151_936),
    "qwen3-next-80b-a3b": (48, 2048, 512, 10, 512, 16, 2, 151_936),
    "mixtral-8x7b": (32, 4096, 8, 2, 14_336, 32, 8, 32_000),
    "olmoe-1b-7b": (16, 2048, 64, 8, 1024, 16, 16, 50_304),
    "deepseek-v3": (61, 7168, 256, 8, 2048, 128, 128, 129_280),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_shapes(name):
    c = get_preset(name)
    got = (c.n_layers, c.hidden_size, c.n_experts, c.top_k, c.expert_intermediate, c.n_heads,
           c.n_kv_heads, c.vocab_size)
    assert got == PUBLISHED[name]
    assert c.expert_bytes == 3 * c.hidden_size * c.expert_intermediate * 2  # bf16
    assert c.expert_bytes_per_layer == c.n_experts * c.expert_bytes
    assert c.expert_bytes_total == len(c.moe_layers) * c.expert_bytes_per_layer


def test_qwen3_30b_expert_bytes_match_design():
    # DESIGN.md: 128 experts of 9.44 MB per layer.
    c = get_preset("qwen3-30b-a3b")
    assert c.expert_bytes == 9_437_184
    assert c.moe_layers == tuple(range(48))
    assert c.qk_norm == "per_head" and c.norm_topk_prob


def test_routing_flavours():
    ds = get_preset("deepseek-v3")
    assert ds.moe_layers == tuple(range(3, 61)) and ds.dense_layers == (0, 1, 2)
    assert (ds.dense_intermediate, ds.shared_expert_intermediate) == (18_432, 2048)
    assert ds.router_scores == "sigmoid" and ds.selection_bias and ds.routed_scaling == 2.5
    assert (ds.n_groups, ds.topk_groups) == (8, 4)
    assert not get_preset("olmoe-1b-7b").norm_topk_prob
    assert get_preset("mixtral-8x7b").norm_topk_prob
    nxt = get_preset("qwen3-next-80b-a3b")
    assert nxt.shared_expert_intermediate == 512 and nxt.shared_expert_gate


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_scaled_keeps_structure(name):
    full = get_preset(name)
    small = full.scaled(n_experts=16 if full.n_experts > 16 else None)
    assert small.hidden_size == 64 and small.vocab_size == 512
    for field in ("router_scores", "norm_topk_prob", "selection_bias", "qk_norm",
                  "shared_expert_gate", "tie_embeddings", "routed_scaling"):
        assert getattr(small, field) == getattr(full, field), field
    assert bool(small.n_dense_layers) == bool(full.n_dense_layers)
    assert bool(small.shared_expert_intermediate) == bool(full.shared_expert_intermediate)
    assert small.moe_layers
    assert small.expert_bytes < full.expert_bytes


def test_group_limited_routing_needs_two_experts_a_group():
    # A group's score sums its two best experts: one expert a group is refused by name, and
    # scaling a model to fewer experts than two a group turns the grouping off.
    ds = get_preset("deepseek-v3")
    with pytest.raises(ValueError, match="n_groups=8 leaves 1 expert per group"):
        dataclasses.replace(ds, n_experts=8, top_k=4)
    small = ds.scaled(n_experts=8)
    assert (small.n_groups, small.topk_groups) == (1, 1)
    assert ds.scaled(n_experts=16).n_groups == 8


def test_unknown_preset_lists_names():
    with pytest.raises(ValueError, match="qwen3-30b-a3b.*deepseek-v3"):
        get_preset("gpt-5")


def test_top_k_over_experts_names_both():
    base = get_preset("mixtral-8x7b")
    with pytest.raises(ValueError, match=r"top_k=9 exceeds n_experts=8"):
        dataclasses.replace(base, top_k=9)


@pytest.mark.parametrize("changes, pattern", [
    (dict(n_heads=30), "n_heads=30 is not a multiple of n_kv_heads=8"),
    (dict(router_scores="relu"), "router_scores"),
    (dict(qk_norm="both"), "qk_norm"),
    (dict(param_dtype="int8"), "param_dtype"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(n_experts=True), r"n_experts must be a positive int, got True"),  # not 1
    (dict(n_dense_layers=40), "n_dense_layers=40"),
    (dict(selection_bias=True), "selection_bias"),
])
def test_validation(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        dataclasses.replace(get_preset("mixtral-8x7b"), **changes)


def test_frozen():
    c = get_preset("olmoe-1b-7b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.top_k = 2  # type: ignore[misc]
    assert isinstance(c, ModelConfig)
