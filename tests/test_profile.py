"""Expert profiles: recording, the file format, validation, and how the stream plan uses them.

A profile of another model must be refused (with both shapes named), a file of another format or
version too; the stream list must put each layer's hottest experts first, and a GiB budget must
keep the model's hottest experts resident.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from strata_jax.models import get_preset
from strata_jax.profile import FORMAT, VERSION, ExpertProfile

# One dense layer then two MoE layers: dense rows must stay zero.
CFG = get_preset("deepseek-v3").scaled(n_layers=3, n_experts=8, top_k=2, hidden_size=64,
                                       expert_intermediate=32, param_dtype="bfloat16")


def _moe_counts(seed=0, tokens=10):
    rng = np.random.default_rng(seed)
    out = np.zeros((len(CFG.moe_layers), CFG.n_experts), np.int32)
    for row in out:
        for _ in range(tokens):
            row[rng.choice(CFG.n_experts, CFG.top_k, replace=False)] += 1
    return out


def test_record_maps_moe_rows_and_counts_tokens():
    assert CFG.moe_layers == (1, 2)
    p = ExpertProfile.empty(CFG)
    assert p.shape == (3, 8) and p.tokens == 0 and p.counts.dtype == np.int64
    a, b = _moe_counts(0, 10), _moe_counts(1, 6)
    assert p.record(a) is p
    assert p.tokens == 10  # inferred: a row sums to tokens * top_k
    result = types.SimpleNamespace(counts=b, read=6)  # duck-typed PrefillResult
    p.record(result)
    assert p.tokens == 16
    np.testing.assert_array_equal(p.counts[0], 0)  # the dense layer
    np.testing.assert_array_equal(p.counts[1:], a.astype(np.int64) + b)
    with pytest.raises(ValueError, match=r"shape \(2, 5\)"):
        p.record(np.zeros((2, 5), np.int32))
    with pytest.raises(ValueError, match=">= 0"):
        p.record(-np.ones((2, 8), np.int32))


def test_merge_adds_and_refuses_another_model():
    p, q = ExpertProfile.empty(CFG), ExpertProfile.empty(CFG)
    p.record(_moe_counts(0)), q.record(_moe_counts(1))
    expected = p.counts + q.counts
    assert p.merge(q) is p
    np.testing.assert_array_equal(p.counts, expected)
    assert p.tokens == 20
    other = ExpertProfile.empty(CFG.replace(n_experts=16, name="other"))
    with pytest.raises(ValueError, match=r"\(3, 16\).*\(3, 8\).*different models"):
        p.merge(other)


def test_order_is_hottest_first_ties_by_lower_id():
    counts = np.zeros((3, 8), np.int64)
    counts[1] = [5, 9, 5, 0, 9, 1, 0, 5]
    p = ExpertProfile(counts, model=CFG.name, top_k=2)
    assert p.order(1) == [1, 4, 0, 2, 7, 5, 3, 6]
    assert p.order(0) == list(range(8))  # all zero: lowest ids first


def test_resident_set_takes_the_hottest_of_the_whole_model():
    counts = np.zeros((3, 8), np.int64)
    counts[1] = [1, 50, 2, 3, 0, 0, 0, 40]
    counts[2] = [45, 0, 0, 40, 0, 0, 0, 0]
    p = ExpertProfile(counts, model=CFG.name, top_k=2)
    blob = 2**20
    # 4 MiB = 4 experts: 50 (1,1), 45 (2,0), then a tie at 40: layer 1 before layer 2.
    assert p.resident_set(CFG, 4 / 1024, blob) == [[], [1, 7], [0, 3]]
    assert p.resident_set(CFG, 3 / 1024, blob) == [[], [1, 7], [0]]
    assert p.resident_set(CFG, 0, blob) == [[], [], []]
    everything = p.resident_set(CFG, 1.0, blob)
    assert everything[0] == [] and everything[1] == everything[2] == list(range(8))
    with pytest.raises(ValueError, match=">= 0"):
        p.resident_set(CFG, -1.0, blob)


def test_save_load_roundtrip_and_format(tmp_path):
    p = ExpertProfile.empty(CFG)
    p.record(_moe_counts(3, 12))
    path = tmp_path / "run.profile"  # no .npz suffix: saved exactly there
    assert p.save(path) == str(path)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["run.profile"]
    with np.load(path, allow_pickle=False) as z:
        assert sorted(z.files) == ["counts", "meta"]
        assert z["counts"].dtype == np.int64 and z["counts"].shape == (3, 8)
        meta = json.loads(str(z["meta"]))
    assert meta == {"format": FORMAT, "version": VERSION, "model": CFG.name, "n_layers": 3,
                    "n_experts": 8, "top_k": 2, "tokens": 12}
    q = ExpertProfile.load(path, config=CFG)
    assert q == p
    np.testing.assert_array_equal(q.counts, p.counts)


def test_load_refuses_another_model(tmp_path):
    p = ExpertProfile.empty(CFG)
    p.record(_moe_counts())
    path = p.save(tmp_path / "p.npz")
    other = CFG.replace(name="bigger", n_experts=16)
    with pytest.raises(ValueError, match=r"\(3, 8\).*'bigger' needs \(3, 16\).*another model"):
        ExpertProfile.load(path, config=other)
    with pytest.raises(ValueError, match="another model"):
        ExpertProfile.load(path, config=CFG.replace(top_k=4))
    # Counts in a layer that is dense in the target model.
    all_moe = get_preset("qwen3-30b-a3b").scaled(n_layers=3, n_experts=8, top_k=2)
    q = ExpertProfile.empty(all_moe)
    q.record(np.ones((3, 8), np.int32))
    with pytest.raises(ValueError, match="dense"):
        ExpertProfile.load(q.save(tmp_path / "q.npz"), config=CFG)
    # Same shape, another name: accepted (a checkpoint may be named differently).
    assert ExpertProfile.load(path, config=CFG.replace(name="renamed")).model == CFG.name


def _write(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


@pytest.mark.parametrize("meta, pattern", [
    ({"format": "something-else", "version": 1}, "not 'strata-expert-profile'"),
    ({"format": FORMAT, "version": 2}, "version 2 is not supported"),
    ({"format": FORMAT, "version": 1, "model": "m"}, "lacks"),
    ({"format": FORMAT, "version": 1, "model": "m", "n_layers": 2, "n_experts": 8, "top_k": 2,
      "tokens": 0}, r"counts have shape \(3, 8\) but meta says \(2, 8\)"),
])
def test_load_refuses_unknown_format_or_version(tmp_path, meta, pattern):
    path = _write(tmp_path / "x.npz", counts=np.zeros((3, 8), np.int64),
                  meta=np.array(json.dumps(meta)))
    with pytest.raises(ValueError, match=pattern):
        ExpertProfile.load(path)


def test_load_refuses_files_that_are_not_profiles(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    with pytest.raises(ValueError, match="not an expert profile"):
        ExpertProfile.load(bad)
    other = _write(tmp_path / "weights.npz", w=np.zeros(3))
    with pytest.raises(ValueError, match="expected 'counts' and 'meta'"):
        ExpertProfile.load(other)
    with pytest.raises(FileNotFoundError):
        ExpertProfile.load(tmp_path / "missing.npz")


def test_files_numpy_cannot_read_say_what_a_profile_is(tmp_path):
    # numpy's own message for these ("contains pickled (object) data ... allow_pickle=") sent
    # the user toward unpickling a file that is simply not a profile.
    expected = "not an expert profile written by `strata-jax profile` or ExpertProfile.save"
    garbage = tmp_path / "garbage.txt"
    garbage.write_bytes(b"\x00\x01strata" + np.random.default_rng(0).bytes(300))
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    npy = tmp_path / "array.bin"
    with open(npy, "wb") as f:
        np.save(f, np.zeros(3))
    damaged = tmp_path / "damaged.npz"
    damaged.write_bytes(b"PK\x03\x04" + np.random.default_rng(1).bytes(100))
    objects = tmp_path / "objects.npz"
    np.savez(objects, counts=np.array([{"a": 1}], dtype=object), meta=np.array("{}"))
    for path in (garbage, text, npy, damaged, objects):
        with pytest.raises(ValueError) as e:
            ExpertProfile.load(path)
        message = str(e.value)
        assert message.startswith(f"{path}: {expected} ("), message
        assert "pickle" not in message and "\n" not in message, message


def test_bad_profile_values():
    with pytest.raises(ValueError, match="integers"):
        ExpertProfile(np.ones((3, 8)), model="m", top_k=2)
    with pytest.raises(ValueError, match="2-D"):
        ExpertProfile(np.ones(8, np.int64), model="m", top_k=2)
    with pytest.raises(ValueError, match=">= 0"):
        ExpertProfile(-np.ones((3, 8), np.int64), model="m", top_k=2)


# ---- the stream plan (builds a native NativeStreamer; no prefill) ------------------------------


def _skewed_profile():
    rng = np.random.default_rng(5)
    counts = np.zeros((3, 8), np.int64)
    counts[1:] = rng.integers(0, 100, (2, 8))
    counts[1, [2, 6]] = 77  # a tie: lower id first
    return ExpertProfile(counts, model=CFG.name, top_k=2)


@pytest.mark.parametrize("as_array", [False, True], ids=["ExpertProfile", "array"])
def test_stream_plan_orders_hottest_first_and_picks_residents(as_array):
    from strata_jax.stream import StreamConfig, NativeStreamer
    from strata_jax.synthetic import init_synthetic, split_experts

    _, experts = split_experts(CFG, init_synthetic(CFG, seed=0))
    p = _skewed_profile()
    prof = p.counts if as_array else p
    blob = 3 * CFG.hidden_size * CFG.expert_intermediate * CFG.dtype.itemsize
    with NativeStreamer(CFG, [experts.get(l) for l in range(3)],
                      StreamConfig(profile=prof, backend="cpu")) as se:
        for l in CFG.moe_layers:
            assert [e for ll, e in se.stream_list if ll == l] == p.order(l)
        assert se.resident == [[], [], []]
    budget = 5 * blob / 2**30
    with NativeStreamer(CFG, [experts.get(l) for l in range(3)],
                      StreamConfig(profile=prof, resident_budget_gib=budget, backend="cpu")) as se:
        want = p.resident_set(CFG, budget, blob)
        assert se.resident == want and sum(map(len, want)) == 5
        flat = sorted(((int(p.counts[l, e]), l, e) for l in (1, 2) for e in range(8)),
                      key=lambda t: (-t[0], t[1], t[2]))
        assert sorted((l, e) for _, l, e in flat[:5]) == sorted(
            (l, e) for l in range(3) for e in want[l])
        for l in CFG.moe_layers:  # the rest streams, still hottest first
            assert [e for ll, e in se.stream_list if ll == l] == [
                e for e in p.order(l) if e not in want[l]]


def test_stream_plan_refuses_another_models_profile():
    from strata_jax.stream import StreamConfig, NativeStreamer
    from strata_jax.synthetic import init_synthetic, split_experts

    _, experts = split_experts(CFG, init_synthetic(CFG, seed=0))
    other = ExpertProfile.empty(CFG.replace(name="other", n_experts=16))
    with pytest.raises(ValueError, match=r"\(3, 16\).*needs \(3, 8\).*another model"):
        NativeStreamer(CFG, [experts.get(l) for l in range(3)],
                     StreamConfig(profile=other, backend="cpu"))
    with pytest.raises(ValueError, match="integers"):
        NativeStreamer(CFG, [experts.get(l) for l in range(3)],
                     StreamConfig(profile=np.ones((3, 8)), backend="cpu"))
