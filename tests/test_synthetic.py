"""Synthetic weights: determinism, dtypes, and the routing-skew calibration."""

import numpy as np
import pytest

from strata_jax import models
from strata_jax.models import decoder as M
from strata_jax.models import get_preset
from strata_jax.synthetic import (SKEW_40_PERCENT_512_TOP10, init_synthetic, synthetic_model,
                                  unrouted_fraction)


def test_deterministic_and_typed():
    c = get_preset("deepseek-v3").scaled(n_experts=16)
    a, b = init_synthetic(c, 5), init_synthetic(c, 5)
    assert a.keys() == set(models.param_shapes(c))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert a["layers.1.mlp.gate"].dtype == c.dtype  # bf16 preset
    assert a["layers.1.mlp.selection_bias"].dtype == np.float32
    assert not np.array_equal(init_synthetic(c, 6)["embed"], a["embed"])


def test_uniform_routing_leaves_nothing_unrouted():
    assert unrouted_fraction(get_preset("qwen3-next-80b-a3b"), 0.0, 1000) == 0.0


def test_documented_skew_leaves_about_40_percent_unrouted():
    frac = unrouted_fraction(get_preset("qwen3-next-80b-a3b"), SKEW_40_PERCENT_512_TOP10, 1000, seed=7)
    assert 0.33 < frac < 0.47


def test_skew_is_monotone():
    c = get_preset("qwen3-next-80b-a3b")
    fracs = [unrouted_fraction(c, s, 1000, seed=1) for s in (0.0, 0.3, 0.6, 1.2)]
    assert fracs == sorted(fracs) and fracs[-1] > 0.5


def test_skewed_model_routes_fewer_experts():
    c = get_preset("qwen3-next-80b-a3b").scaled(n_experts=128, top_k=4, param_dtype="float32")
    toks = np.random.default_rng(0).integers(0, c.vocab_size, 40).astype(np.int32)
    unrouted = []
    for skew in (0.0, 1.5):
        _, _, counts = M.forward(synthetic_model(c, 0, skew), toks, models.init_cache(c, 64))
        unrouted.append(int((np.asarray(counts) == 0).sum()))
    assert unrouted[1] > unrouted[0] + 20


def test_negative_skew_rejected():
    with pytest.raises(ValueError, match="routing_skew"):
        init_synthetic(get_preset("olmoe-1b-7b").scaled(), 0, -1.0)


def test_progress_reports_every_byte_once_and_leaves_weights_unchanged():
    c = get_preset("qwen3-30b-a3b").scaled(n_experts=8)
    calls = []
    with_progress = init_synthetic(c, 2, 0.5, progress=lambda done, total: calls.append((done, total)))
    plain = init_synthetic(c, 2, 0.5)
    total = sum(a.nbytes for a in plain.values())
    assert len(calls) == len(plain)
    assert [t for _, t in calls] == [total] * len(calls)
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and dones[-1] == total
    for name in plain:
        np.testing.assert_array_equal(with_progress[name], plain[name])


@pytest.mark.parametrize("tile", [None, 3])
def test_dropped_dense_tensors_come_back_as_the_same_bits(tile):
    # keep_dense=False keeps no non-expert tensor, and one asked for again (or out of order)
    # is drawn again (from its recorded state, or its own generators with a tile): the same
    # bits as the default's.
    from strata_jax.synthetic import SyntheticParams

    c = get_preset("qwen3-30b-a3b").scaled(n_experts=8, top_k=2)
    kept = SyntheticParams(c, 4, tile=tile)
    dropped = SyntheticParams(c, 4, tile=tile, keep_dense=False)
    names = [n for n in kept if not kept.is_expert(n)]
    for n in names[::-1] + names:  # out of order, then again
        np.testing.assert_array_equal(dropped[n], kept[n])
    assert not dropped._kept and len(kept._kept) == len(names)


def test_a_tile_alone_is_the_first_rows_of_the_tiled_tensor():
    from strata_jax.synthetic import SyntheticParams

    c = get_preset("qwen3-30b-a3b").scaled(n_experts=8, top_k=2)
    p = SyntheticParams(c, 2, tile=3)
    name = next(n for n in p if p.is_expert(n))
    full = p[name]
    np.testing.assert_array_equal(p.tile_of(name), full[:3])
    np.testing.assert_array_equal(full[3:6], full[:3])
    with pytest.raises(ValueError, match="only a routed expert tensor of tiled weights"):
        SyntheticParams(c, 2).tile_of(name)


def test_tiled_dense_tensors_are_drawn_alone_in_blocks(monkeypatch):
    # With a tile, a dense tensor comes from generators of its own, block by block: the same
    # bits whatever else was drawn before, and in many blocks (on threads) still its own
    # _dense_value transform (an embedding: plain standard normals).
    from strata_jax import synthetic
    from strata_jax.synthetic import SyntheticParams

    c = get_preset("qwen3-30b-a3b").scaled(n_experts=8, top_k=2)
    a, b = SyntheticParams(c, 1, tile=2), SyntheticParams(c, 1, tile=2)
    names = [n for n in a if not a.is_expert(n)]
    last = a[names[-1]]  # drawn first, alone
    for n in names:
        b[n]
    np.testing.assert_array_equal(b[names[-1]], last)
    monkeypatch.setattr(synthetic, "_DENSE_BLOCK", 1000)  # many blocks, many threads
    emb = SyntheticParams(c, 1, tile=2)["embed"].astype(np.float32)
    assert emb.shape == (c.vocab_size, c.hidden_size) and np.isfinite(emb).all()
    assert abs(emb.mean()) < 0.05 and 0.9 < emb.std() < 1.1
    assert len(np.unique(emb[:, 0])) > c.vocab_size // 2  # the blocks are not copies
    assert not np.array_equal(SyntheticParams(c, 2, tile=2)["embed"], a["embed"])
