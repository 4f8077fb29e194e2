"""The streaming engine on the CPU backend (simulated link): issue #4.

Logits and KV cache must be byte-identical (SHA-256) across the all-resident,
stream-all and routed arms, whatever the ring, depth, link or chunk size; the
stream's counts must add up; a failure mid-chunk must leave no thread running
and the next prefill correct.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from strata_jax.config import get_preset
from strata_jax.engine import Engine, sha256_of
from strata_jax.stream import StreamConfig
from strata_jax.synthetic import init_synthetic

CHUNK = 32
CFG = get_preset("qwen3-30b-a3b").scaled(n_layers=3, n_experts=16, top_k=2, hidden_size=64,
                                         expert_intermediate=32, param_dtype="bfloat16")
# 80 tokens in chunks of 32: two chunks at the floor (32) and one below it (16).
TOKENS = np.random.default_rng(7).integers(0, CFG.vocab_size, 80)
SLOW = dict(sim_bandwidth=20e6, sim_latency=100e-6)  # ~0.3 ms per copy: routing lands first
JITTERY = dict(sim_bandwidth=50e6, sim_latency=20e-6, sim_jitter=400e-6)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture(scope="module", params=[0.0, 2.0], ids=["uniform", "skewed"])
def routing(request):
    params = init_synthetic(CFG, seed=3, routing_skew=request.param)
    eng = Engine(CFG, params, None, max_context=256, chunk_size=CHUNK)
    r = eng.prefill(TOKENS)
    return request.param, params, sha256_of(r.logits), r.session.kv_sha256()


ARMS = {
    # name: (StreamConfig kwargs, chunk size)
    "stream-all": (dict(routed=False, stream_floor=CHUNK, **SLOW), CHUNK),
    "routed-d16-ring1layer": (dict(routed=True, depth=16, ring=16, stream_floor=CHUNK, **SLOW), CHUNK),
    "routed-d1-ring3layers": (dict(routed=True, depth=1, ring=48, stream_floor=CHUNK, **SLOW), CHUNK),
    "routed-d256-jittery": (dict(routed=True, depth=256, stream_floor=CHUNK, **JITTERY), CHUNK),
    "routed-fast-link": (dict(routed=True, sim_bandwidth=0, sim_latency=0, stream_floor=CHUNK), CHUNK),
    "routed-d2-above-floor": (dict(routed=True, depth=2, stream_floor=24, **SLOW), 48),
    "routed-only-below-floor": (dict(routed=True, stream_floor=4096, **SLOW), CHUNK),
    "resident-half": (dict(routed=True, resident_per_layer=8, stream_floor=CHUNK, **SLOW), CHUNK),
}


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_arms_are_byte_identical(routing, arm):
    skew, params, logits_hash, kv_hash = routing
    kwargs, chunk = ARMS[arm]
    with Engine(CFG, params, StreamConfig(**kwargs), max_context=256, chunk_size=chunk) as eng:
        r = eng.prefill(TOKENS)
        assert sha256_of(r.logits) == logits_hash
        assert r.session.kv_sha256() == kv_hash
        assert not eng.streamer.walk_active()
        streamed_total = 0
        for rec in r.chunks:
            s = rec.stats
            np.testing.assert_array_equal(s.copied + s.skipped, s.streamed)
            assert np.all(s.skipped <= s.unrouted), "a routed expert was skipped"
            np.testing.assert_array_equal(s.bytes, s.copied * eng.streamer.blob_bytes)
            if s.mode == "stream" and not kwargs["routed"]:
                assert s.skipped.sum() == 0
            if s.mode == "routed-only":
                np.testing.assert_array_equal(s.skipped, s.unrouted)  # routed-only skips exactly
            streamed_total += int(s.streamed.sum())
        assert streamed_total == len(eng.streamer.stream_list) * len(r.chunks)
        # Skips are certain only when the walk is held well behind the routing: a slow link
        # and a depth far below a layer's 16 streamed experts (the blind window is ~depth).
        slow_link = kwargs.get("sim_bandwidth", 0) > 0
        if skew > 0 and kwargs["routed"] and slow_link and kwargs.get("depth", 16) <= 2:
            stream_chunks = [c.stats for c in r.chunks if c.stats.mode == "stream"]
            assert sum(int(s.skipped.sum()) for s in stream_chunks) > 0, \
                "skewed routing on a slow link skipped nothing"


def test_switch_off_by_environment(monkeypatch, routing):
    _, params, logits_hash, _ = routing
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM", "0")
    with Engine(CFG, params, StreamConfig(routed=True, stream_floor=CHUNK, **SLOW),
                max_context=256, chunk_size=CHUNK) as eng:
        assert eng.mode == "stream-all"
        r = eng.prefill(TOKENS)
        assert sha256_of(r.logits) == logits_hash
        assert sum(int(c.stats.skipped.sum()) for c in r.chunks if c.stats.mode == "stream") == 0


def test_depth_environment_is_clamped_with_warning(monkeypatch):
    params = init_synthetic(CFG, seed=3)
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM_DEPTH", "999")
    with pytest.warns(UserWarning, match="999 is outside 1..256; using 256"):
        eng = Engine(CFG, params, StreamConfig(), max_context=256, chunk_size=CHUNK)
    assert eng.streamer.depth() == 256
    eng.close()
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM_DEPTH", "0")
    with pytest.warns(UserWarning, match="0 is outside 1..256; using 1"):
        StreamConfig().resolved()


def test_bad_stream_configs():
    params = init_synthetic(CFG, seed=3)
    with pytest.raises(ValueError, match="ring of 0 slots"):
        Engine(CFG, params, StreamConfig(ring=0), max_context=256)
    with pytest.raises(ValueError, match="cannot hold one layer's 16 streamed experts"):
        Engine(CFG, params, StreamConfig(ring=8), max_context=256)
    with pytest.raises(ValueError, match="STRATA_PREFILL_ROUTED_STREAM"):
        os.environ["STRATA_PREFILL_ROUTED_STREAM"] = "yes"
        try:
            StreamConfig().resolved()
        finally:
            del os.environ["STRATA_PREFILL_ROUTED_STREAM"]
    with pytest.raises(ValueError, match="profile has shape"):
        Engine(CFG, params, StreamConfig(profile=np.ones((2, 5))), max_context=256)
    with pytest.raises(ValueError, match="exceeds the 16 experts"):
        Engine(CFG, params, StreamConfig(resident_per_layer=17), max_context=256)


@pytest.mark.parametrize("fault", ["error", "stop"])
def test_failure_mid_chunk_leaves_no_thread_and_engine_usable(routing, fault):
    _, params, logits_hash, kv_hash = routing
    with Engine(CFG, params, StreamConfig(routed=True, stream_floor=CHUNK, **SLOW),
                max_context=256, chunk_size=CHUNK) as eng:
        first = eng.prefill(TOKENS)  # starts the link worker: the steady thread count
        baseline = _threads()
        eng.streamer.inject_fault(1, fault)
        with pytest.raises(Exception, match="injected fault|walk was stopped"):
            eng.prefill(TOKENS, first.session)
        assert not eng.streamer.walk_active()
        assert _threads() == baseline
        again = eng.prefill(TOKENS)
        assert sha256_of(again.logits) == logits_hash
        assert again.session.kv_sha256() == kv_hash
        assert _threads() == baseline


def test_closing_the_engine_stops_its_threads():
    params = init_synthetic(CFG, seed=3)
    before = _threads()
    eng = Engine(CFG, params, StreamConfig(stream_floor=CHUNK), max_context=256, chunk_size=CHUNK)
    eng.prefill(TOKENS[:CHUNK])
    eng.close()
    assert _threads() == before
    with pytest.raises(RuntimeError, match="closed"):
        eng.prefill(TOKENS[:CHUNK])


def test_trace_lines(capfd):
    params = init_synthetic(CFG, seed=3, routing_skew=2.0)
    with Engine(CFG, params, StreamConfig(trace=True, stream_floor=CHUNK, **SLOW),
                max_context=256, chunk_size=CHUNK) as eng:
        eng.prefill(TOKENS[:64])
    err = capfd.readouterr().err
    assert "ring entries 48, copied" in err
    assert err.count("strata: chunk") == 2
