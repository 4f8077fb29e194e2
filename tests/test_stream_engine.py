"""The streaming engine on the CPU backend (simulated link): issue #4.

Logits and KV cache must be byte-identical (SHA-256) across the all-resident,
stream-all and routed arms, whatever the ring, depth, link or chunk size; the
stream's counts must add up; a failure mid-chunk must leave no thread running
and the next prefill correct.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import time
import warnings

import numpy as np
import pytest

from strata_jax.models import get_preset
from strata_jax.engine import Engine, sha256_of
from strata_jax.engine.results import chunk_ids
from strata_jax.stream import StreamConfig, StreamTuning, plan_stream
from strata_jax.testing import settled
from strata_jax.synthetic import init_synthetic

CHUNK = 32
CFG = get_preset("qwen3-30b-a3b").scaled(n_layers=3, n_experts=16, top_k=2, hidden_size=64,
                                         expert_intermediate=32, param_dtype="bfloat16")
# 80 tokens in chunks of 32: two chunks at the floor (32) and one below it (16).
TOKENS = np.random.default_rng(7).integers(0, CFG.vocab_size, 80)
SLOW = dict(sim_bandwidth=20e6, sim_latency=100e-6)  # ~0.3 ms per copy: routing lands first
JITTERY = dict(sim_bandwidth=50e6, sim_latency=20e-6, sim_jitter=400e-6)
FLOOR = StreamConfig(tuning=StreamTuning(stream_floor=CHUNK))  # every chunk of CHUNK streams
_TUNING = set(StreamTuning.__dataclass_fields__)


def _config(**fields) -> StreamConfig:
    """A StreamConfig from StreamConfig and StreamTuning fields given in one keyword list."""
    tuning = {k: fields.pop(k) for k in list(fields) if k in _TUNING}
    return StreamConfig(tuning=StreamTuning(**tuning), **fields)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@functools.cache
def _resident_reference(skew: float):
    """(skew, params, logits hash, KV hash) of the resident engine on TOKENS."""
    params = init_synthetic(CFG, seed=3, routing_skew=skew)
    eng = Engine(CFG, params, None, max_context=256, chunk_size=CHUNK)
    r = eng.prefill(TOKENS)
    return skew, params, sha256_of(r.logits), r.session.kv_sha256()


SKEWS = {"uniform": 0.0, "skewed": 2.0}


# The skewed routing (skips happen) by default; the uniform one in the slow run.
@pytest.fixture(scope="module", params=[pytest.param("uniform", marks=pytest.mark.slow),
                                        "skewed"])
def routing(request):
    return _resident_reference(SKEWS[request.param])


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
    # The packed ring (layout="packed"): blobs copied whole, split into fetch's outputs.
    "packed-stream-all": (dict(routed=False, layout="packed", stream_floor=CHUNK, **SLOW),
                          CHUNK),
    "packed-routed-d2-ring3layers-jittery": (
        dict(routed=True, depth=2, ring=48, layout="packed", stream_floor=CHUNK, **JITTERY),
        CHUNK),
    "packed-resident-half": (dict(routed=True, resident_per_layer=8, layout="packed",
                                  stream_floor=CHUNK, **SLOW), CHUNK),
    "packed-routed-only-below-floor": (dict(routed=True, layout="packed", stream_floor=4096,
                                            **SLOW), CHUNK),
    # layout="auto": each chunk chooses, so the ring changes layout between chunks (frames,
    # frames, packed, then frames again in the second prefill; packed, packed, routed-only's
    # frames, packed ...).
    "auto-frames-then-packed": (dict(routed=True, depth=2, stream_floor=16, frames_from=32,
                                     **JITTERY), CHUNK),
    "auto-packed-and-routed-only": (dict(routed=True, depth=4, ring=48, stream_floor=CHUNK,
                                         frames_from=CHUNK + 1, **SLOW), CHUNK),
    # The last MoE layer in row pieces (tail_pieces), each fetch waiting only for its experts:
    # frames (read through a copy on the CPU, row by row), packed (fetch_piece adds each
    # piece's experts to the outputs so far), with residents, a skewed routing's empty pieces.
    "pieces-routed-d2-frames": (dict(routed=True, depth=2, tail_pieces=4, tail_from=CHUNK,
                                     layout="frames", stream_floor=CHUNK, **SLOW), CHUNK),
    "pieces-packed-routed-jittery": (dict(routed=True, depth=4, tail_pieces=3,
                                          tail_from=CHUNK, layout="packed", stream_floor=CHUNK,
                                          **JITTERY), CHUNK),
    "pieces-packed-stream-all-resident-half": (
        dict(routed=False, resident_per_layer=8, tail_pieces=4, tail_from=CHUNK,
             layout="packed", stream_floor=CHUNK, **SLOW), CHUNK),
    # tail_shape="halving": pieces of 1/2, 1/4, 1/8 and 1/8 of the rows.
    "pieces-halving-packed-stream-all": (
        dict(routed=False, tail_pieces=4, tail_shape="halving", tail_from=CHUNK,
             layout="packed", stream_floor=CHUNK, **JITTERY), CHUNK),
    "pieces-frames-stream-all-ring3layers": (
        dict(routed=False, ring=48, tail_pieces=2, tail_from=CHUNK, layout="frames",
             stream_floor=16, **SLOW), CHUNK),
    # Each layer in parts (StreamTuning.parts), each part a native layer with its frame:
    # a ring of two parts' frames, of one part's, the parts a budget below a layer chooses.
    "parts4-routed-d2-frames-ring2parts": (dict(routed=True, depth=2, parts=4, ring=8,
                                                layout="frames", stream_floor=CHUNK, **SLOW),
                                           CHUNK),
    "parts4-packed-routed-d2-ring3parts-jittery": (
        dict(routed=True, depth=2, parts=4, ring=12, layout="packed", stream_floor=CHUNK,
             **JITTERY), CHUNK),
    "parts2-packed-stream-all-ring1part": (dict(routed=False, parts=2, ring=8,
                                                layout="packed", stream_floor=CHUNK,
                                                **JITTERY), CHUNK),
    "parts-by-budget-routed-only-resident-half": (
        dict(routed=True, resident_per_layer=8, stream_floor=4096,
             ring_budget_gib=10 * CFG.expert_bytes / 2**30, **SLOW), CHUNK),
}


# The default run's arm: the packed layout, a jittery link and a ring of three frames, each
# layer in parts (whole layers in the packed ring: the slow run's arm of that name; the frames
# layout, which "auto" picks per chunk, stream-all, residents and the floor: test_engine's
# arms; the tail pieces and routed frames: test_quantized's).
# Every arm under both routings, the layout changing between chunks among them, runs in the
# slow run.
DEFAULT_ARMS = {("skewed", "parts4-packed-routed-d2-ring3parts-jittery")}


def _arm_cases():
    cases = []
    for arm in sorted(ARMS):
        for name in sorted(SKEWS, reverse=True):
            marks = () if (name, arm) in DEFAULT_ARMS else (pytest.mark.slow,)
            cases.append(pytest.param(name, arm, id=f"{name}-{arm}", marks=marks))
    return cases


@pytest.mark.parametrize("routing_name, arm", _arm_cases())
def test_arms_are_byte_identical(routing_name, arm):
    skew, params, logits_hash, kv_hash = _resident_reference(SKEWS[routing_name])
    kwargs, chunk = ARMS[arm]
    with Engine(CFG, params, _config(**kwargs), max_context=256, chunk_size=chunk) as eng:
        # The second prefill's first chunk, its program compiled by the first, is prestarted
        # from the host (when it streams) and adopted by its program: both must be identical.
        for _ in range(2):
            r = eng.prefill(TOKENS)
            assert sha256_of(r.logits) == logits_hash
            assert r.session.kv_sha256() == kv_hash
            assert not eng.streamer.walk_active() and eng.streamer.hold() == 0
        assert (eng.streamer.parts > 1) == arm.startswith("parts")
        want_pieces = [kwargs.get("tail_pieces", 4)
                       if c.stats.mode == "stream" and c.bucket >= kwargs.get("tail_from", 8192)
                       else 1 for c in r.chunks]
        assert [c.stats.tail_pieces for c in r.chunks] == want_pieces
        # this tiny model's math is short beside its copies: "auto" takes halving
        assert [c.stats.tail_shape for c in r.chunks] == [
            kwargs.get("tail_shape", "halving") if p > 1 else None for p in want_pieces]
        if "tail_pieces" in kwargs:
            assert max(want_pieces) > 1
        layouts = {"auto-frames-then-packed": ["frames", "frames", "packed"],
                   "auto-packed-and-routed-only": ["packed", "packed", "frames"]}
        if arm in layouts:
            assert [c.stats.layout for c in r.chunks] == layouts[arm]
        elif kwargs.get("layout") == "packed":
            assert [c.stats.layout for c in r.chunks if c.stats.mode == "stream"] == \
                ["packed"] * sum(c.stats.mode == "stream" for c in r.chunks)
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


@pytest.mark.slow  # the documented switch; a streamed engine of its own per routing
def test_switch_off_by_environment(monkeypatch, routing):
    # routed not given (None): the environment's value applies
    _, params, logits_hash, _ = routing
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM", "0")
    with Engine(CFG, params, StreamConfig(tuning=StreamTuning(stream_floor=CHUNK, **SLOW)),
                max_context=256, chunk_size=CHUNK) as eng:
        assert eng.mode == "stream-all"
        r = eng.prefill(TOKENS)
        assert sha256_of(r.logits) == logits_hash
        assert [c.stats.mode for c in r.chunks] == ["stream"] * 3  # no floor for stream-all
        assert sum(int(c.stats.skipped.sum()) for c in r.chunks) == 0


def test_environment_fills_only_what_is_not_given(monkeypatch):
    # Not given (None): the environment's value where set, else routed on at depth 16.
    monkeypatch.delenv("STRATA_PREFILL_ROUTED_STREAM", raising=False)
    monkeypatch.delenv("STRATA_PREFILL_ROUTED_STREAM_DEPTH", raising=False)
    sc = StreamConfig()
    assert (sc.routed, sc.depth) == (None, None)
    assert (sc.resolved().routed, sc.resolved().depth) == (True, 16)
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM", "0")
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM_DEPTH", "4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: nothing was given
        r = StreamConfig().resolved()
    assert (r.routed, r.depth) == (False, 4)
    # Given explicitly, the field wins over the environment, with a warning naming both.
    with pytest.warns(UserWarning) as caught:
        r = StreamConfig(routed=True, depth=8).resolved()
    assert (r.routed, r.depth) == (True, 8)
    assert sorted(str(w.message) for w in caught) == [
        "STRATA_PREFILL_ROUTED_STREAM=0 is ignored: routed=True was given (an explicit argument "
        "wins over the environment)",
        "STRATA_PREFILL_ROUTED_STREAM_DEPTH=4 is ignored: depth=8 was given (an explicit "
        "argument wins over the environment)"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same values: no conflict, no warning
        r = StreamConfig(routed=False, depth=4).resolved()
    assert (r.routed, r.depth) == (False, 4)
    # A malformed variable is refused even where the field is given.
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM", "yes")
    with pytest.raises(ValueError, match="STRATA_PREFILL_ROUTED_STREAM='yes': expected 0 or 1"):
        StreamConfig(routed=True).resolved()


def test_explicit_routed_wins_over_the_environment_in_the_engine(monkeypatch):
    params = init_synthetic(CFG, seed=3)
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM", "0")
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM_DEPTH", "4")
    with pytest.warns(UserWarning, match="is ignored"):
        eng = Engine(CFG, params, StreamConfig(routed=True, depth=8, backend="cpu"),
                     max_context=256, chunk_size=CHUNK)
    with eng:
        assert eng.mode == "routed"
        assert (eng.streamer.stream.routed, eng.streamer.stream.depth) == (True, 8)
        assert eng.streamer.depth() == 8  # what the native engine runs
    with Engine(CFG, params, StreamConfig(backend="cpu"), max_context=256,
                chunk_size=CHUNK) as eng:  # nothing given: the environment's
        assert eng.mode == "stream-all"


def test_stream_all_streams_chunks_under_the_floor(routing):
    # StreamConfig(routed=False) is stream-all: stream_floor is the routed stream's only, so
    # every chunk, even one far below the floor, copies every non-resident expert and skips none.
    _, params, logits_hash, kv_hash = routing
    sc = StreamConfig(routed=False, resident_per_layer=4,
                      tuning=StreamTuning(stream_floor=4096, **SLOW))
    with Engine(CFG, params, sc, max_context=256, chunk_size=CHUNK) as eng:
        s = eng.streamer
        assert all(s.chunk_mode(n) != 1 for n in (1, CHUNK, 4095))  # 1: routed-only
        r = eng.prefill(TOKENS)
        assert sha256_of(r.logits) == logits_hash and r.session.kv_sha256() == kv_hash
        non_resident = len(s.stream_list)
        assert non_resident == len(CFG.moe_layers) * (CFG.n_experts - 4)
        for c in r.chunks:
            assert c.stats.tokens < sc.tuning.stream_floor
            assert c.stats.mode == "stream"
            assert int(c.stats.copied.sum()) == non_resident
            assert int(c.stats.skipped.sum()) == 0
            np.testing.assert_array_equal(c.stats.copied, s.streamed_per_layer)


def test_engine_options_are_one_struct_bound_once():
    # _native.EngineOptions is the C++ struct itself: its defaults are the struct's, and the
    # streamer fills every field from the StreamConfig and the plan in one place.
    from strata_jax import native
    from strata_jax import stream as S
    from strata_jax.stream.streamer import engine_options
    from strata_jax.synthetic import split_experts

    mod = native.module()
    d = mod.EngineOptions()
    assert (d.backend, d.n_layers, d.n_experts, d.routed, d.blob_bytes, d.ring, d.depth,
            d.trace, d.sim_bandwidth, d.sim_latency, d.sim_jitter, d.seed, d.pin_mode,
            d.device, d.publish_mode, d.plane_offsets, d.plane_bytes) == (
        0, 0, 0, False, 0, 0, 16, False, 0.0, 0.0, 0.0, 0, 1, 0, 1, [], [])
    with pytest.raises(TypeError):  # one options object, not keyword arguments
        mod.Streamer(backend=0, n_layers=1)
    with pytest.raises(ValueError, match="a ring of 0 slots cannot work"):
        mod.Streamer(d)
    _, experts = split_experts(CFG, init_synthetic(CFG, seed=3))
    sc = StreamConfig(routed=False, depth=5, backend="cpu",
                      tuning=StreamTuning(ring=32, sim_bandwidth=3e9, sim_latency=7e-6,
                                          sim_jitter=1e-6, seed=9, publish="callback"))
    eng = S.NativeStreamer(CFG, [experts.get(l) for l in range(CFG.n_layers)], sc)
    try:
        o = engine_options(eng.config, eng.stream, eng.plan, eng.format, backend=eng.backend,
                           device=eng.device_ordinal)
        assert (o.backend, o.n_layers, o.n_experts, o.routed, o.blob_bytes, o.ring, o.depth,
                o.sim_bandwidth, o.sim_latency, o.sim_jitter, o.seed, o.publish_mode) == (
            0, CFG.n_layers, CFG.n_experts, False, eng.blob_bytes, 32, 5, 3e9, 7e-6, 1e-6, 9, 0)
        assert o.plane_offsets == list(eng.format.offsets)
        assert o.plane_bytes == [p.nbytes for p in eng.format.planes]
        assert "EngineOptions(backend=0" in repr(o)
        with pytest.raises(ValueError, match="resolved StreamConfig"):  # routed None
            engine_options(eng.config, StreamConfig(), eng.plan, eng.format, backend="cpu",
                           device=0)
    finally:
        eng.close()


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


def _refused_by_name(bad: StreamConfig, message: str) -> None:
    """Resolving `bad` and planning with it both raise the ValueError `message`."""
    with pytest.raises(ValueError, match=re.escape(message)):
        bad.resolved()
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_stream(CFG, bad)


@pytest.mark.parametrize("field, value, message", [
    ("depth", "abc", "depth='abc': expected an integer 1..256"),
    ("depth", 2.7, "depth=2.7: expected an integer 1..256"),  # not "outside 1..256; using 2"
    ("depth", True, "depth=True: expected an integer 1..256"),
    ("stream_floor", "64", "stream_floor='64': expected an integer >= 1"),
    ("tail_pieces", 1.5, "tail_pieces=1.5: expected an integer >= 1"),
    ("resident_per_layer", "4", "resident_per_layer='4': expected an integer >= 0"),
    ("ring", "32", "ring='32': expected an integer (ring slots) or None"),
    ("seed", "s", "seed='s': expected an integer"),
    ("device", "0", "device='0': expected an integer"),
])
def test_integer_options_given_other_things_name_the_option(field, value, message):
    # int()'s or a comparison's own message ("invalid literal for int() with base 10") said
    # nothing of which option was wrong.
    _refused_by_name(_config(**{field: value}), message)
    assert StreamConfig(depth=np.int64(8),
                        tuning=StreamTuning(ring=None)).resolved().depth == 8  # numpy ints are fine


@pytest.mark.parametrize("field, value, message", [
    ("routed", "no", "routed='no': expected True or False"),  # not a truthy string: routed on
    ("routed", 1, "routed=1: expected True or False"),
    ("trace", "no", "trace='no': expected True or False (or None: read STRATA_TRACE)"),
    ("ring_budget_gib", "4", "ring_budget_gib='4': expected a finite number of GiB >= 0"),
    ("resident_budget_gib", "x", "resident_budget_gib='x': expected a finite number of GiB"),
    ("resident_budget_gib", float("inf"), "resident_budget_gib=inf: expected a finite number"),
])
def test_switches_and_budgets_given_other_things_name_the_option(field, value, message):
    # Before: "no" switched routing (and tracing) on, float() said "could not convert string
    # to float: 'x'" and an infinite budget "cannot convert float infinity to integer".
    _refused_by_name(StreamConfig(**{field: value}), message)
    ok = StreamConfig(routed=np.bool_(False), trace=None, ring_budget_gib=np.float32(2),
                      resident_budget_gib=1).resolved()  # numpy bools and numbers are fine
    assert (ok.routed, ok.ring_budget_gib, ok.resident_budget_gib) == (False, 2.0, 1)


def test_tuning_fields_given_to_stream_config_say_where_they_belong():
    # What the engine chooses itself lives in StreamTuning; StreamConfig names the way there.
    with pytest.raises(TypeError, match=re.escape(
            "StreamConfig(stream_floor=1): stream_floor is a field of StreamTuning; pass "
            "StreamConfig(tuning=StreamTuning(stream_floor=1))")):
        StreamConfig(routed=False, stream_floor=1)
    with pytest.raises(TypeError, match="layout, ring are fields of StreamTuning"):
        dataclasses.replace(StreamConfig(), ring=32, layout="packed")
    with pytest.raises(ValueError, match="tuning=.*expected a StreamTuning"):
        StreamConfig(tuning={"ring": 32}).resolved()
    with pytest.raises(ValueError, match=r"sim_bandwidth=-1\.0: expected a finite number >= 0"):
        StreamConfig(tuning=StreamTuning(sim_bandwidth=-1.0)).resolved()
    sc = StreamConfig(routed=False, tuning=StreamTuning(stream_floor=1, ring=32))
    assert (sc.tuning.stream_floor, sc.tuning.ring, sc.routed) == (1, 32, False)
    assert sc == StreamConfig(routed=False, tuning=StreamTuning(ring=32, stream_floor=1))


def test_publish_mode_from_config_not_the_environment(monkeypatch):
    assert StreamConfig().resolved().tuning.publish == "event"
    sc = StreamConfig(tuning=StreamTuning(publish="callback"))
    assert sc.resolved().tuning.publish == "callback"
    monkeypatch.setenv("STRATA_PUBLISH", "callback")  # not a switch of the library
    assert StreamConfig().resolved().tuning.publish == "event"
    with pytest.raises(ValueError, match=r"publish='host': expected one of"):
        StreamConfig(tuning=StreamTuning(publish="host")).resolved()


def test_bad_stream_configs():
    params = init_synthetic(CFG, seed=3)
    with pytest.raises(ValueError, match="ring of 0 slots"):
        Engine(CFG, params, StreamConfig(tuning=StreamTuning(ring=0)), max_context=256)
    with pytest.raises(ValueError, match="cannot hold one layer's 16 streamed experts"):
        Engine(CFG, params, StreamConfig(tuning=StreamTuning(ring=8)), max_context=256)
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


@pytest.mark.slow  # parts chunk-major: the default arms' parts4-routed-d2-frames-ring2parts
def test_layers_in_parts_read_layer_major_and_a_follow_up_turn_with_the_resident_bits(routing):
    # A ring of two parts' frames (each layer in 4 parts): a layer-major prefill (each part
    # fetched once for every sub-chunk) and a chunked follow-up turn give the resident
    # engine's bits; the stats fold each layer's parts back into the layer.
    _, params, _, _ = routing
    more = np.random.default_rng(9).integers(0, CFG.vocab_size, 20)
    got = []
    for stream in (None, _config(routed=True, depth=2, parts=4, ring=8, stream_floor=CHUNK,
                                 **SLOW)):
        with Engine(CFG, params, stream, max_context=256, chunk_size=CHUNK, sub_chunk=16) as eng:
            r = eng.prefill(TOKENS, order="layer-major")
            r2 = eng.prefill(more, session=r.session)
            got.append((sha256_of(r.logits), r.session.kv_sha256(), sha256_of(r2.logits),
                        r2.session.kv_sha256()))
            if stream is not None:
                assert eng.streamer.parts == 4 and eng.streamer.native_layers == 4 * CFG.n_layers
                for rec in r.chunks + r2.chunks:
                    s = rec.stats
                    assert s.streamed.shape == (CFG.n_layers,)
                    np.testing.assert_array_equal(s.copied + s.skipped, s.streamed)
                    assert np.all(s.skipped <= s.unrouted)
    assert got[0] == got[1]


def test_ring_layout_per_chunk_and_bad_layouts():
    from strata_jax import stream as S
    from strata_jax.synthetic import split_experts

    with pytest.raises(ValueError, match=r"layout='planes': expected one of \['auto', 'frames', 'packed'\]"):
        StreamConfig(tuning=StreamTuning(layout="planes")).resolved()
    with pytest.raises(ValueError, match="frames_from=0: must be at least 1"):
        StreamConfig(tuning=StreamTuning(frames_from=0)).resolved()
    with pytest.raises(ValueError, match=r"tail_shape='even': expected one of \['auto', "
                                         r"'equal', 'halving'\]"):
        StreamConfig(tuning=StreamTuning(tail_shape="even")).resolved()
    assert StreamConfig().resolved().tuning.tail_shape == "auto"  # the default
    _, experts = split_experts(CFG, init_synthetic(CFG, seed=3))
    stores = [experts.get(l) for l in range(CFG.n_layers)]
    cases = {  # StreamConfig kwargs: {chunk tokens: (layout, begin_chunk mode)}
        "auto": ({"stream_floor": 16, "frames_from": 64},
                 {8: ("frames", 1), 16: ("packed", 2), 63: ("packed", 2), 64: ("frames", 0)}),
        "frames": ({"layout": "frames", "stream_floor": 16},
                   {8: ("frames", 1), 16: ("frames", 0), 10**6: ("frames", 0)}),
        "packed": ({"layout": "packed", "stream_floor": 16},
                   {8: ("frames", 1), 16: ("packed", 2), 10**6: ("packed", 2)}),
    }
    for name, (kwargs, want) in cases.items():
        eng = S.NativeStreamer(CFG, stores, _config(**kwargs))
        try:
            got = {n: (eng.layout(n), eng.chunk_mode(n)) for n in want}
            assert got == want, name
            if name == "auto":  # a mode the native engine does not know is refused, both ways
                import jax
                import jax.numpy as jnp

                with pytest.raises(Exception, match=r"begin_chunk: mode 3 is not 0 \(stream, "
                                                    r"frames\), 1 \(routed-only\) or 2"):
                    jax.block_until_ready(jax.jit(functools.partial(
                        S.begin, eng.id, 3))(jnp.zeros((), jnp.int32))[0])
                with pytest.raises(ValueError, match="prestart: mode -1 is not 0"):
                    eng.handle.prestart(-1)
                assert not eng.walk_active()
        finally:
            eng.close()


@pytest.mark.parametrize("fault", ["error", pytest.param("stop", marks=pytest.mark.slow)])
def test_failure_mid_chunk_leaves_no_thread_and_engine_usable(routing, fault):
    _, params, logits_hash, kv_hash = routing
    with Engine(CFG, params, StreamConfig(routed=True,
                                          tuning=StreamTuning(stream_floor=CHUNK, **SLOW)),
                max_context=256, chunk_size=CHUNK) as eng:
        first = eng.prefill(TOKENS)  # starts the link worker: the steady thread count
        baseline = _threads()
        eng.streamer.inject_fault(1, fault)
        with pytest.raises(Exception, match="injected fault|walk was stopped"):
            eng.prefill(TOKENS, first.session)
        assert not eng.streamer.walk_active()
        assert settled(_threads, baseline) == baseline
        again = eng.prefill(TOKENS)
        assert sha256_of(again.logits) == logits_hash
        assert again.session.kv_sha256() == kv_hash
        assert settled(_threads, baseline) == baseline


def _issuer_tids() -> list[str]:
    from strata_jax.testing import thread_names

    return [tid for tid, name in thread_names().items() if name == "strata-issuer"]


@pytest.mark.slow  # a streamed engine of its own
def test_one_issuer_thread_serves_every_chunk():
    # The walk runs on a thread the engine keeps: no thread is made per chunk (its creation
    # was on the critical path between begin_chunk and the first copy).
    params = init_synthetic(CFG, seed=3)
    before = _issuer_tids()
    with Engine(CFG, params, FLOOR, max_context=256,
                chunk_size=CHUNK) as eng:
        eng.prefill(TOKENS)  # two streamed chunks and one routed-only
        first = sorted(set(_issuer_tids()) - set(before))
        assert len(first) == 1
        for _ in range(3):
            eng.prefill(TOKENS)
            assert sorted(set(_issuer_tids()) - set(before)) == first
        assert not eng.streamer.walk_active()
    assert sorted(_issuer_tids()) == sorted(before)  # closing the engine ends it


def test_engines_made_alike_one_after_another_make_the_same_program():
    # A closed engine's id is taken again by the next one (the FFI calls carry it as an
    # attribute), so the programs of engines made alike are the same HLO, which a compilation
    # cache serves; engines alive at once keep ids of their own.
    params = init_synthetic(CFG, seed=3)

    def text(eng):  # the HLO of a first streamed chunk of CHUNK tokens
        return eng._jit.lower(eng._state_leaves, eng._stream_inputs, None, None, first=True,
                              mode=eng.streamer.chunk_mode(CHUNK), sub=0, rows=0,
                              width=CHUNK + 2, score=False).as_text()

    with Engine(CFG, params, FLOOR, max_context=256, chunk_size=CHUNK) as a:
        first, program = a.streamer.id, text(a)
        with Engine(CFG, params, FLOOR, max_context=256, chunk_size=CHUNK) as b:
            assert b.streamer.id != first
            assert text(b) != program
    with Engine(CFG, params, FLOOR, max_context=256, chunk_size=CHUNK) as c:
        assert c.streamer.id == first
        assert text(c) == program
        r = c.prefill(TOKENS)  # and it reads the resident bits
        assert (sha256_of(r.logits), r.session.kv_sha256()) == _resident_reference(0.0)[2:]


_INTERRUPT_SCRIPT = r"""
import sys
import numpy as np
from strata_jax.models import get_preset
from strata_jax.engine import Engine, sha256_of
from strata_jax.experts import ExpertWeights
from strata_jax.stream import StreamConfig, StreamTuning
from strata_jax.synthetic import init_synthetic

CFG = get_preset("qwen3-30b-a3b").scaled(n_layers=3, n_experts=16, top_k=2, hidden_size=64,
                                         expert_intermediate=32, param_dtype="bfloat16")
TOKENS = np.random.default_rng(7).integers(0, CFG.vocab_size, 80)
params = init_synthetic(CFG, seed=3, routing_skew=2.0)
with Engine(CFG, params, None, max_context=256, chunk_size=32) as ref_eng:
    ref = sha256_of(ref_eng.prefill(TOKENS).logits)
sc = StreamConfig(routed=True,
                  tuning=StreamTuning(stream_floor=32, sim_bandwidth=20e6, sim_latency=100e-6))
with Engine(CFG, params, sc, max_context=256, chunk_size=32) as eng:
    eng.prefill(TOKENS)

    def stop_after_first(done, total):
        if done >= 32:
            raise KeyboardInterrupt

    for i in range(int(sys.argv[1])):
        try:
            eng.prefill(TOKENS, progress=stop_after_first, sync_chunks=False)
            raise SystemExit("the interrupt did not propagate")
        except KeyboardInterrupt:
            pass
        assert not eng.streamer.walk_active(), i
    assert sha256_of(eng.prefill(TOKENS).logits) == ref
print("ok")
"""


@pytest.mark.slow  # the GPU suite's test_cuda_prestart_is_adopted in every GPU run
def test_a_compiled_prefill_prestarts_its_first_chunk_and_the_program_adopts_it(routing):
    # A prefill whose first chunk's program has run before begins that chunk from the host; the
    # program's begin_chunk adopts the walk (and lifts its hold) instead of starting another. A
    # delay put between the two shows which begin the chunk kept: the adopted one is timed
    # within the prestart, before the delay. Never before a program's first run (the walk would
    # wait through the compile), never for a later chunk (one is queued) or a chunk below the
    # floor (no walk).
    _, params, logits_hash, kv_hash = routing
    sc = StreamConfig(routed=True, tuning=StreamTuning(ring=16, stream_floor=CHUNK, **SLOW))
    with Engine(CFG, params, sc, max_context=256, chunk_size=CHUNK) as eng:
        real = eng.streamer.prestart
        seen, holds, done = [], [], []

        def slow_prestart(n):
            seen.append(n)
            real(n)
            done.append(time.monotonic())
            holds.append(eng.streamer.hold())
            time.sleep(0.3)

        eng.streamer.prestart = slow_prestart
        eng.prefill(TOKENS)  # compiles: no prestart
        assert seen == []
        for _ in range(2):  # compiled the first time: a chunk below the floor has no walk
            eng.prefill(TOKENS[:16])
        assert seen == []
        t0 = time.monotonic()
        r = eng.prefill(TOKENS[:CHUNK])
        begin, _ = eng.streamer.host_times()
        assert seen == [CHUNK] and holds == [32]
        assert t0 <= begin <= done[0], "the program began its own chunk: prestart not adopted"
        assert eng.streamer.hold() == 0, "adoption did not lift the hold"
        assert not eng.streamer.walk_active()
        st = r.chunks[0].stats
        assert (st.copied + st.skipped == st.streamed).all()
        seen.clear()
        r = eng.prefill(TOKENS, sync_chunks=False)  # three chunks: only the first prestarts
        assert seen == [CHUNK]
        assert sha256_of(r.logits) == logits_hash and r.kv_sha256() == kv_hash
        for c in r.chunks:
            assert (c.stats.copied + c.stats.skipped == c.stats.streamed).all()


@pytest.mark.slow  # the GPU suite's test_cuda_begin_chunk_writes_the_staged_ids in every GPU run
def test_a_streamed_prefill_stages_every_chunks_ids_before_its_walk(routing, monkeypatch):
    # Every chunk's ids go to the engine (host memory) in one call before the first chunk's
    # walk begins, and each begin_chunk hands its chunk its own: a streamed prefill makes no
    # host-to-device copy (PjRt's copy of the ids, queued behind the walk's copies, waited
    # 44 ms on the H200 at 32K tokens). The resident engine, with no walk, passes numpy.
    import jax

    _, params, logits_hash, kv_hash = routing
    sc = StreamConfig(routed=True, tuning=StreamTuning(stream_floor=CHUNK, **SLOW))
    real_put = jax.device_put
    for stream in (sc, None):
        events, puts = [], []
        with Engine(CFG, params, stream, max_context=256, chunk_size=CHUNK) as eng:
            eng.prefill(TOKENS)  # compiles

            def put(*args, puts=puts, **kwargs):
                puts.append(1)
                return real_put(*args, **kwargs)

            if eng.streamer is not None:
                real_stage, real_pre = eng.streamer.stage_ids, eng.streamer.prestart
                eng.streamer.stage_ids = lambda ids, real_stage=real_stage, events=events, **kw: (
                    events.append(("staged", np.array(ids), kw)), real_stage(ids, **kw))
                eng.streamer.prestart = lambda n, real_pre=real_pre, events=events: (
                    events.append(("prestart", n)), real_pre(n))
            monkeypatch.setattr(jax, "device_put", put)
            guard = "disallow" if stream is not None else "allow"
            with jax.transfer_guard_host_to_device(guard):
                r = eng.prefill(TOKENS, sync_chunks=False)
            monkeypatch.setattr(jax, "device_put", real_put)
            assert sha256_of(r.logits) == logits_hash and r.kv_sha256() == kv_hash
        assert puts == []
        if stream is not None:
            want = np.concatenate([chunk_ids(TOKENS[o:o + CHUNK], b, o)
                                   for o, b in ((0, CHUNK), (CHUNK, CHUNK), (2 * CHUNK, 16))])
            assert [e[0] for e in events] == ["staged", "prestart"] and events[1][1] == CHUNK
            assert np.array_equal(events[0][1], want)
            assert events[0][2] == {"reset": True}  # a prefill drops any ids left over


def test_begin_chunk_hands_out_the_staged_ids_in_order():
    # Staged ids form a queue: each begin_chunk takes the next n; past the last it fails with a
    # message that names the fix; one that fails uses its ids up; reset drops what is left.
    import jax
    import jax.numpy as jnp

    from strata_jax import stream as S
    from strata_jax.synthetic import split_experts

    params = init_synthetic(CFG, seed=3)
    _, experts = split_experts(CFG, params)
    eng = S.NativeStreamer(CFG, [experts.get(l) for l in range(CFG.n_layers)],
                         StreamConfig(routed=True,
                                      tuning=StreamTuning(sim_bandwidth=0, sim_latency=0)))

    @functools.cache
    def chunk(n):
        def run():
            tok, ids = S.begin(eng.id, 1, jnp.zeros((), jnp.int32), n)  # routed-only: no walk
            return S.end(eng.id, tok, CFG.n_layers), ids
        return jax.jit(run)

    def take(n):
        return np.asarray(chunk(n)()[1])

    try:
        ids = np.random.default_rng(0).integers(-2**31, 2**31 - 1, 306, dtype=np.int64)
        eng.stage_ids(ids[:5])
        eng.stage_ids(ids[5:])  # appended
        got = [take(n) for n in (5, 0, 300, 1)]
        assert [g.dtype for g in got] == [np.int32] * 4
        assert np.array_equal(np.concatenate(got), ids)
        with pytest.raises(Exception, match="takes 1 token ids but 0 are staged"):
            jax.block_until_ready(chunk(1)())
        assert not eng.walk_active()
        # A begin that fails (here: cancelled) uses its ids up; the next chunk gets its own.
        eng.stage_ids(ids[:6])
        eng.cancel()
        with pytest.raises(Exception, match="cancelled"):
            jax.block_until_ready(chunk(2)())
        eng.cancel(False)
        assert np.array_equal(take(4), ids[2:6])
        # reset drops the ids no chunk took.
        eng.stage_ids(ids[:3])
        eng.stage_ids(ids[10:12], reset=True)
        assert np.array_equal(take(2), ids[10:12])
        eng.stage_ids(ids[:3])
        eng.clear_ids()
        with pytest.raises(Exception, match="but 0 are staged"):
            jax.block_until_ready(chunk(1)())
        with pytest.raises(ValueError, match="1-D integer"):
            eng.stage_ids(ids.reshape(2, -1))
        with pytest.raises(ValueError, match="1-D integer"):
            eng.stage_ids(ids.astype(np.float32))
        with pytest.raises(ValueError, match="outside int32"):
            eng.stage_ids(np.array([2**31]))
    finally:
        eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.stage_ids(ids)
    eng.clear_ids()  # nothing to clear: a failed prefill's cleanup never raises over its error


def test_chunks_dispatched_back_to_back_each_get_their_ids(routing):
    # Two calls queued without waiting (routed-only chunks: no walk to serialise them): each
    # stages its ids when dispatched and its begin_chunk takes them, in dispatch order.
    import jax

    _, params, _, _ = routing
    a, b = TOKENS[:CHUNK], TOKENS[CHUNK:2 * CHUNK]
    with Engine(CFG, params, None, max_context=256, chunk_size=CHUNK) as res:
        want = [sha256_of(res._dispatch(t, CHUNK, None, 0, mode=0, sub=0)[0]) for t in (a, b)]
    sc = StreamConfig(routed=True, tuning=StreamTuning(stream_floor=4096, **SLOW))
    with Engine(CFG, params, sc, max_context=256, chunk_size=CHUNK) as eng:
        jax.block_until_ready(eng._dispatch(a, CHUNK, None, 0, mode=1, sub=0))  # compiles
        for _ in range(10):
            ra = eng._dispatch(a, CHUNK, None, 0, mode=1, sub=0)
            rb = eng._dispatch(b, CHUNK, None, 0, mode=1, sub=0)
            assert [sha256_of(ra[0]), sha256_of(rb[0])] == want


@pytest.mark.slow  # the prestart's other two failure paths run by default
def test_a_prefill_after_a_prestart_nobody_adopted(routing):
    # A caller's prestart left open does not stop the next prefill: it stages its ids and its
    # own first chunk replaces the stale walk.
    _, params, logits_hash, kv_hash = routing
    sc = StreamConfig(routed=True, tuning=StreamTuning(stream_floor=CHUNK, **SLOW))
    with Engine(CFG, params, sc, max_context=256, chunk_size=CHUNK) as eng:
        eng.prefill(TOKENS)
        eng.streamer.prestart(CHUNK)
        assert eng.streamer.walk_active()
        r = eng.prefill(TOKENS)
        assert sha256_of(r.logits) == logits_hash and r.kv_sha256() == kv_hash
        assert not eng.streamer.walk_active()


@pytest.mark.slow  # a streamed engine of its own
def test_a_prestart_is_dropped_by_abort_and_by_a_begin_of_another_mode(routing):
    _, params, logits_hash, kv_hash = routing
    sc = StreamConfig(routed=True, tuning=StreamTuning(ring=16, stream_floor=CHUNK, **SLOW))
    with Engine(CFG, params, sc, max_context=256, chunk_size=CHUNK) as eng:
        eng.streamer.prestart(CHUNK // 2)  # routed-only: no walk, nothing held
        assert not eng.streamer.walk_active() and eng.streamer.hold() == 0
        eng.streamer.prestart(CHUNK)  # a streamed chunk: the walk starts, held
        assert eng.streamer.walk_active() and eng.streamer.hold() == 32
        eng.streamer.abort()
        assert not eng.streamer.walk_active() and eng.streamer.hold() == 0
        eng.streamer.prestart(CHUNK)
        eng.streamer.prestart(CHUNK)  # replaces the first
        assert eng.streamer.walk_active() and eng.streamer.hold() == 32
        # A routed-only prestart, then the program of a streamed chunk: its begin_chunk drops
        # the prestart and begins its own chunk (timed after the prestart), unheld.
        eng.streamer.prestart(CHUNK // 2)
        t = time.monotonic()
        _, _, info = eng._dispatch(TOKENS[:CHUNK], CHUNK, None, 0,
                                   mode=eng.streamer.chunk_mode(CHUNK), sub=0)
        st, counts, _, _ = eng._split_info(info)
        stats = eng.streamer.make_stats(CHUNK, st, counts)
        assert stats.mode == "stream" and eng.streamer.hold() == 0
        assert eng.streamer.host_times()[0] > t, "the streamed program adopted a routed-only one"
        assert (stats.copied + stats.skipped == stats.streamed).all()
        assert not eng.streamer.walk_active()
        r = eng.prefill(TOKENS)
    assert sha256_of(r.logits) == logits_hash and r.kv_sha256() == kv_hash


def test_a_prefill_that_fails_after_its_prestart_leaves_no_walk(routing, monkeypatch):
    # The prestarted walk is running (held) when the dispatch raises: the prefill's failure path
    # stops it, and the engine's next prefill is right.
    _, params, logits_hash, kv_hash = routing
    sc = StreamConfig(routed=False, tuning=StreamTuning(ring=16, stream_floor=CHUNK, **SLOW))
    with Engine(CFG, params, sc, max_context=256, chunk_size=CHUNK) as eng:
        eng.prefill(TOKENS)
        threads = _threads()
        held = []

        def failing_jit(*a, **k):
            held.append((eng.streamer.walk_active(), eng.streamer.hold()))
            raise RuntimeError("dispatch failed")

        monkeypatch.setattr(eng, "_jit", failing_jit)
        with pytest.raises(RuntimeError, match="dispatch failed"):
            eng.prefill(TOKENS)
        assert held == [(True, 32)]  # the prestarted walk ran, held, when the dispatch failed
        assert not eng.streamer.walk_active() and eng.streamer.hold() == 0
        monkeypatch.undo()
        r = eng.prefill(TOKENS)
        assert sha256_of(r.logits) == logits_hash and r.kv_sha256() == kv_hash
        assert settled(_threads, threads) == threads


def test_prestart_refuses_a_bad_engine_state():
    params = init_synthetic(CFG, seed=3)
    eng = Engine(CFG, params, FLOOR, max_context=256,
                 chunk_size=CHUNK)
    eng.streamer.cancel()
    with pytest.raises(RuntimeError, match="prestart: begin_chunk: the prefill was cancelled"):
        eng.streamer.prestart(CHUNK)
    assert not eng.streamer.walk_active() and eng.streamer.hold() == 0
    eng.streamer.cancel(False)
    eng.close()
    with pytest.raises(RuntimeError, match="prestart: no engine"):
        eng.streamer.prestart(CHUNK)


def test_measure_link_refuses_a_store_without_a_pinned_arena():
    from strata_jax import native

    params = init_synthetic(CFG, seed=3)
    eng = Engine(CFG, params, StreamConfig(backend="cpu", tuning=StreamTuning(stream_floor=CHUNK)),
                 max_context=256,
                 chunk_size=CHUNK)
    try:
        with pytest.raises(RuntimeError, match="has none \\(backend 'cpu'.*native.measure_h2d"):
            eng.streamer.measure_link()
    finally:
        eng.close()
    with pytest.raises(RuntimeError, match="engine was closed"):
        eng.streamer.measure_link()
    with pytest.raises(ValueError, match="needs a host address"):
        native.measure_h2d_from(0, 2**20)
    with pytest.raises(ValueError, match="needs a host address"):
        native.measure_h2d_from(4096, 2**20, reps=0)


@pytest.mark.slow
def test_interrupt_with_chunks_queued_never_hangs():
    # The caller raises (here from `progress`, as Ctrl-C would) after the first chunk is queued
    # and while later ones are queued behind it (sync_chunks=False). The engine used to abort
    # under the running chunks: a queued chunk's begin_chunk reset the walk under the abort,
    # and within 15 to 55 rounds the process hung. Run in a child so a hang fails, not stalls.
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", _INTERRUPT_SCRIPT, "80"],
                             capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung: 80 interrupted prefills did not finish in 300 s ({e.stdout!r})")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


_FORK_SCRIPT = r"""
import os, sys, warnings
import numpy as np
warnings.simplefilter("ignore")  # JAX warns that fork() and its threads do not mix
from strata_jax.models import get_preset
from strata_jax.engine import Engine, sha256_of
from strata_jax.experts import ExpertWeights
from strata_jax.stream import StreamConfig, StreamTuning
from strata_jax.synthetic import init_synthetic

CFG = get_preset("qwen3-30b-a3b").scaled(n_layers=3, n_experts=16, top_k=2, hidden_size=64,
                                         expert_intermediate=32, param_dtype="bfloat16")
TOKENS = np.random.default_rng(7).integers(0, CFG.vocab_size, 80)
eng = Engine(CFG, init_synthetic(CFG, seed=3), StreamConfig(tuning=StreamTuning(stream_floor=32)),
             max_context=256, chunk_size=32)
want = sha256_of(eng.prefill(TOKENS).logits)
pid = os.fork()
if pid == 0:
    code = 0
    try:
        eng.prefill(TOKENS)
        code |= 1
    except RuntimeError as e:
        code |= 0 if "forked" in str(e) and "new Engine" in str(e) else 2
    if eng.streamer.handle.walk_active():  # the parent's engine is not found here
        code |= 4
    eng.streamer.handle.close()  # drops the copy; joined the parent's threads
    eng.close()  # the finalizer touches nothing in a child
    os._exit(code)  # not sys.exit: a forked JAX process crashes in JAX's own exit
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
assert sha256_of(eng.prefill(TOKENS).logits) == want  # the parent's engine is untouched
eng.close()
print("ok")
"""


@pytest.mark.slow
def test_a_forked_child_gets_a_clear_error_and_never_hangs():
    # After os.fork() the child has a copy of the engine but not its threads (issuer, simulated
    # link). A prefill there used to wait forever, and destroying the copy (the finalizer at the
    # child's exit) hung joining the parent's threads.
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, check=False,
                             text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung after fork ({e.stdout!r})")
    assert out.returncode == 0 and out.stdout.split() == ["child", "0", "ok"], (
        out.stdout, out.stderr[-3000:])


def test_closing_the_engine_stops_its_threads():
    params = init_synthetic(CFG, seed=3)
    # A first engine's prefill starts what XLA starts once per process (its thread pools, two
    # more threads where this is the worker's first such program), so that the count below
    # sees the second engine's threads alone: a leak shows again there.
    with Engine(CFG, params, FLOOR, max_context=256, chunk_size=CHUNK) as first:
        first.prefill(TOKENS[:CHUNK])
    before = _threads()
    eng = Engine(CFG, params, FLOOR, max_context=256, chunk_size=CHUNK)
    eng.prefill(TOKENS[:CHUNK])
    eng.close()
    assert settled(_threads, before) == before
    with pytest.raises(RuntimeError, match="closed"):
        eng.prefill(TOKENS[:CHUNK])


def test_close_from_another_thread_waits_for_the_running_prefill():
    # A prefill running on one thread ends with the resident bits before another thread's
    # close() ends the engine: no program of a closed engine runs after its close (a new
    # engine may take its id).
    import threading

    params = init_synthetic(CFG, seed=3)
    eng = Engine(CFG, params, _config(stream_floor=CHUNK, **SLOW), max_context=256,
                 chunk_size=CHUNK)
    eng.prefill(TOKENS)  # compiled
    started, got = threading.Event(), []

    def read():
        got.append(eng.prefill(TOKENS, progress=lambda done, total: started.set()))

    t = threading.Thread(target=read)
    t.start()
    assert started.wait(60)  # its first chunk is dispatched; two more to go
    eng.close()
    t.join(60)
    assert not t.is_alive() and len(got) == 1
    assert (sha256_of(got[0].logits), got[0].session.kv_sha256()) == _resident_reference(0.0)[2:]
    assert eng.closed
    with pytest.raises(RuntimeError, match="closed"):
        eng.prefill(TOKENS)


@pytest.mark.slow
def test_trace_lines(capfd):
    params = init_synthetic(CFG, seed=3, routing_skew=2.0)
    with Engine(CFG, params, StreamConfig(trace=True,
                                          tuning=StreamTuning(stream_floor=CHUNK, **SLOW)),
                max_context=256, chunk_size=CHUNK) as eng:
        eng.prefill(TOKENS[:64])
    err = capfd.readouterr().err
    assert "ring entries 48, copied" in err
    assert err.count("strata: chunk") == 2
    # Chunks far below frames_from use the packed ring, and the line says so.
    assert err.count("(routed stream, packed ring, cpu simulated link)") == 2


# ---- the plan: one pure function, the engine's own ----------------------------------------------

PLANS = {
    # name: StreamConfig kwargs
    "default": dict(),
    "resident-per-layer": dict(resident_per_layer=5),
    "all-resident": dict(resident_per_layer=16),
    "explicit-ring": dict(ring=20),
    "ring-capped-by-budget": dict(ring_budget_gib=20 * CFG.expert_bytes / 2**30),
    "resident-budget": dict(resident_budget_gib=7 * CFG.expert_bytes / 2**30),
    "budget-with-profile": dict(
        resident_budget_gib=7 * CFG.expert_bytes / 2**30,
        profile=np.random.default_rng(1).integers(0, 50, (CFG.n_layers, CFG.n_experts))),
    "profile-order": dict(
        resident_per_layer=3,
        profile=np.random.default_rng(2).integers(0, 5, (CFG.n_layers, CFG.n_experts))),
    "parts-by-budget-with-profile": dict(
        ring_budget_gib=10 * CFG.expert_bytes / 2**30, resident_per_layer=3,
        profile=np.random.default_rng(4).integers(0, 5, (CFG.n_layers, CFG.n_experts))),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_engine_follows_plan_stream(name):
    from strata_jax.stream import NativeStreamer, plan_stream
    from strata_jax.synthetic import split_experts

    sc = _config(backend="cpu", **PLANS[name])
    plan = plan_stream(CFG, sc)
    _, experts = split_experts(CFG, init_synthetic(CFG, seed=3))
    with NativeStreamer(CFG, [experts.get(l) for l in range(CFG.n_layers)], sc) as eng:
        assert eng.plan == plan
        assert eng.resident == [list(r) for r in plan.resident]
        assert eng.stream_list == list(plan.stream_list)
        assert eng.ring == plan.ring and eng.blob_bytes == plan.blob_bytes
        # The frame each layer's weights are read from: Python's (which view the model reads
        # on the GPU) is the native engine's (where the walk copies them).
        assert eng.frame_of == {l: eng.handle.frame_of(l) for l in eng.native_moe_layers}
        assert eng.native_moe_layers == tuple(l * plan.parts + p for l in CFG.moe_layers
                                              for p in range(plan.parts))
        assert all(eng.handle.frame_of(l) == -1 for l in range(plan.native_layers)
                   if l not in eng.native_moe_layers)
        assert set(eng.frame_of.values()) <= set(range(plan.frames))
        assert sorted(eng.resident_blobs) == list(eng.native_moe_layers)
        stream, resident = plan.native_plan()
        for v, blobs in eng.resident_blobs.items():  # each part's residents, its rows
            assert blobs.shape == (len(resident[v]), plan.blob_bytes)
        np.testing.assert_array_equal(eng.streamed_mask, plan.streamed_mask)
        np.testing.assert_array_equal(eng.streamed_per_layer, plan.streamed_per_layer)
    # The figures hang together.
    assert plan.resident_bytes == sum(map(len, plan.resident)) * CFG.expert_bytes
    assert plan.ring_bytes == plan.ring * CFG.expert_bytes
    assert plan.streamed_mask.sum() == len(plan.stream_list)
    for l in CFG.moe_layers:
        assert set(plan.resident[l]).isdisjoint(e for ll, e in plan.stream_list if ll == l)
        assert len(plan.resident[l]) + int(plan.streamed_per_layer[l]) == CFG.n_experts


def test_plan_stream_rules():
    from strata_jax.stream import plan_stream

    E = CFG.n_experts
    p = plan_stream(CFG)  # nothing resident: two layers of read-ahead when the budget allows
    assert p.resident == ((),) * CFG.n_layers and p.ring == 2 * E
    assert p.stream_list == tuple((l, e) for l in CFG.moe_layers for e in range(E))
    assert p.frames == 2
    # The ring is whole layer frames: a budget of 20 slots holds one frame of 16, not two.
    p20 = plan_stream(CFG, StreamConfig(ring_budget_gib=20 * CFG.expert_bytes / 2**30))
    assert (p20.ring, p20.frames) == (16, 1)
    # An explicit ring rounds down to whole frames, at least one, whatever is resident.
    assert plan_stream(CFG, StreamConfig(tuning=StreamTuning(ring=47))).ring == 32
    assert plan_stream(CFG, StreamConfig(resident_per_layer=11,
                                         tuning=StreamTuning(ring=5))).ring == 16
    # Nothing streams: one frame, which fetch fills from the resident cache.
    assert plan_stream(CFG, StreamConfig(resident_per_layer=E)).ring == E
    # A budget of 7 experts without a profile: 7 // 3 layers = 2 per layer, the lowest ids.
    p = plan_stream(CFG, StreamConfig(resident_budget_gib=7 * CFG.expert_bytes / 2**30))
    assert p.resident == ((0, 1),) * 3 and p.resident_bytes == 6 * CFG.expert_bytes
    # Hottest first within a layer, ties by the lower id.
    counts = np.zeros((CFG.n_layers, E), np.int64)
    counts[1, [9, 3, 12]] = [5, 7, 5]
    p = plan_stream(CFG, StreamConfig(profile=counts, resident_per_layer=1))
    assert p.resident[1] == (3,)
    assert [e for l, e in p.stream_list if l == 1][:3] == [9, 12, 0]
    # A budget below one layer frame: the fewest equal parts of which two frames fit, as many
    # frames as it holds (up to two layers' worth); parts may be fixed.
    p10 = plan_stream(CFG, StreamConfig(ring_budget_gib=10 * CFG.expert_bytes / 2**30))
    assert (p10.parts, p10.part_experts, p10.frames, p10.ring) == (4, 4, 2, 8)
    assert p10.ring_fits_budget and p10.native_layers == 4 * CFG.n_layers
    p15 = plan_stream(CFG, StreamConfig(ring_budget_gib=15 * CFG.expert_bytes / 2**30))
    assert (p15.parts, p15.frames, p15.ring) == (4, 3, 12)  # two frames of 8 do not fit
    p2 = plan_stream(CFG, StreamConfig(tuning=StreamTuning(parts=2)))
    assert (p2.parts, p2.frames, p2.ring) == (2, 4, 32)
    assert plan_stream(CFG, StreamConfig(tuning=StreamTuning(parts=4, ring=13))).ring == 12
    # The native plan: part p of layer l is layer l * parts + p, with ids within the part.
    pr = plan_stream(CFG, StreamConfig(resident_per_layer=6, tuning=StreamTuning(parts=4)))
    stream, resident = pr.native_plan()
    assert resident[:4] == [[0, 1, 2, 3], [0, 1], [], []]
    assert stream[:2] == [(1, 2), (1, 3)] and stream[-1] == (11, 3)
    assert len(stream) == len(pr.stream_list) and [l for l, _ in stream] == sorted(
        l for l, _ in stream)
    # The plan is frozen, its arrays read-only.
    with pytest.raises(AttributeError):
        p.ring = 3
    with pytest.raises(ValueError, match="read-only"):
        p.streamed_mask[0, 0] = False


@pytest.mark.parametrize("kwargs, extra, pattern", [
    (dict(ring=0), {}, "ring of 0 slots cannot work"),
    (dict(ring=8), {}, r"ring of 8 slots cannot hold one layer's 16 streamed experts; use StreamTuning\(ring=16\) or more"),
    (dict(ring_budget_gib=1e-6), {}, r"ring_budget_gib=1e-06 holds 0 experts .* fewer than one "
                                     r"frame of 1 expert \(a layer of 16 in 16 parts\)"),
    (dict(ring_budget_gib=1e-6, parts=1), {}, r"holds 0 experts .* fewer than one layer frame "
                                              "of 16 experts"),
    (dict(parts=3), {}, r"parts=3 does not divide the 16 experts of a layer; take a divisor"),
    (dict(parts=0), {}, r"parts=0: must be at least 1"),
    (dict(parts=2, ring=7), {}, r"ring of 7 slots cannot hold one of 2 parts of a layer: 8 "
                                r"streamed experts; use StreamTuning\(ring=8\)"),
    (dict(ring_budget_gib=-1.0), {}, r"ring_budget_gib=-1.0: must be >= 0"),
    (dict(resident_per_layer=17), {}, "resident_per_layer=17 exceeds the 16 experts"),
    (dict(resident_per_layer=-1), {}, "resident_per_layer=-1: must be >= 0"),
    (dict(resident_budget_gib=-1.0), {}, r"resident_budget_gib=-1.0: must be >= 0"),
    (dict(resident_budget_gib=float("nan")), {}, r"resident_budget_gib=nan: must be >= 0"),
    (dict(resident_budget_gib=16.0), dict(device_bytes=8 * 2**30),
     r"resident_budget_gib=16 is larger than the device \(8.0 GiB"),
    (dict(profile=np.ones((2, 5), np.int64)), {}, r"profile has shape \(2, 5\).*needs \(3, 16\)"),
    (dict(profile=np.ones((3, 16))), {}, "integers"),
    (dict(), dict(blob_bytes=0), "blob_bytes=0"),
])
def test_plan_stream_refuses_what_cannot_work(kwargs, extra, pattern):
    from strata_jax.stream import plan_stream

    with pytest.raises(ValueError, match=pattern):
        plan_stream(CFG, _config(**kwargs), **extra)


def test_plan_stream_reports_an_over_budget_ring_when_asked():
    from strata_jax.stream import plan_stream

    sc = StreamConfig(ring_budget_gib=10 * CFG.expert_bytes / 2**30,  # 10 slots < 16
                      tuning=StreamTuning(parts=1))
    p = plan_stream(CFG, sc, check_ring_budget=False)
    assert (p.ring, p.ring_budget_slots, p.ring_fits_budget) == (16, 10, False)
    assert plan_stream(CFG, StreamConfig()).ring_fits_budget is True
    with pytest.raises(ValueError, match="holds 10 experts"):
        plan_stream(CFG, sc)
    # An explicit ring too small for a layer is an error either way.
    with pytest.raises(ValueError, match="ring of 8 slots"):
        plan_stream(CFG, StreamConfig(tuning=StreamTuning(ring=8)), check_ring_budget=False)


def test_plan_stream_needs_no_native_library_and_no_device(monkeypatch):
    import jax

    from strata_jax import native
    from strata_jax.stream import plan_stream

    def refuse(*args, **kwargs):
        raise AssertionError("plan_stream touched the native library or a device")

    monkeypatch.setattr(native, "module", refuse)
    monkeypatch.setattr(native, "has_cuda", refuse)
    monkeypatch.setattr(jax, "devices", refuse)
    monkeypatch.setattr(jax, "default_backend", refuse)
    counts = np.random.default_rng(0).integers(0, 9, (CFG.n_layers, CFG.n_experts))
    p = plan_stream(CFG, StreamConfig(backend="cuda", profile=counts,
                                      resident_budget_gib=5 * CFG.expert_bytes / 2**30))
    assert p.resident_count == 5 and len(p.stream_list) == 3 * 16 - 5
    with pytest.raises(ValueError, match="ring of 0 slots"):
        plan_stream(CFG, StreamConfig(tuning=StreamTuning(ring=0)))


@pytest.mark.slow
def test_plan_stream_imports_without_the_native_library():
    """A fresh interpreter where strata_jax._native cannot be imported still plans."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['strata_jax._native'] = None\n"  # import of it now fails
        "from strata_jax import native\n"
        "try:\n    native.module()\nexcept ImportError:\n    pass\n"
        "else:\n    raise SystemExit('the native library loaded')\n"
        "from strata_jax.models import get_preset\n"
        "from strata_jax.stream import StreamConfig, plan_stream\n"
        "cfg = get_preset('qwen3-next-80b-a3b')\n"  # the full model: no weights needed
        "p = plan_stream(cfg, StreamConfig(resident_budget_gib=20))\n"
        "print(p.ring, p.resident_count)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    ring, resident = map(int, out.stdout.split())
    assert ring >= 1 and resident > 0


def test_prefill_program_has_no_jax_effects():
    # The stream calls carry their side effect in the HLO only. A JAX-level effect (what
    # jax.ffi.ffi_call(has_side_effect=True) adds) sends every call of the jitted prefill down
    # JAX's Python dispatch path, milliseconds per call before the device starts.
    import jax

    params = init_synthetic(CFG, seed=3)
    with Engine(CFG, params, StreamConfig(routed=True,
                                          tuning=StreamTuning(stream_floor=CHUNK, **SLOW)),
                max_context=256, chunk_size=CHUNK) as eng:
        cache = eng.new_cache()
        fn = functools.partial(eng._prefill_fn, first=False, mode=0, sub=0, width=CHUNK + 2)
        resident = (eng.streamer.resident_blobs, eng.streamer.frames)
        jaxpr = jax.make_jaxpr(fn)(eng._state_leaves, resident, None, cache)
        calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "strata_stream_call"]
        # begin, publish + fetch + release per layer, end
        assert len(calls) == 2 + 3 * len(CFG.moe_layers)
        assert not jaxpr.effects
        # The chunk's ids come out of begin_chunk: the program takes none from the host.
        assert calls[0].outvars[1].aval.shape == (CHUNK + 2,)
        hlo = jax.jit(eng._prefill_fn, static_argnames=("first", "mode", "sub", "width")).lower(
            eng._state_leaves, resident, None, None, first=True, mode=0, sub=0,
            width=CHUNK + 2).as_text()
        assert hlo.count("has_side_effect = true") == len(calls)


@pytest.mark.parametrize("steps, pattern, ring", [
    # (layer index into moe_layers, call) in order; the chunk must fail with the pattern.
    ([(1, "fetch")], r"fetch, layer \d+: out of order: layer \d+ fetches next", None),
    ([(0, "fetch"), (1, "fetch")], r"layer \d+ has not released its frame", None),
    ([(0, "release")], "release, layer \\d+: no fetched layer to release", None),
    ([(0, "fetch"), (1, "release")], r"release, layer \d+: layer \d+ is the one fetched", None),
    ([(0, "fetch"), (0, "release"), (1, "fetch"), ("end", None)],
     r"end_chunk: layer \d+ was fetched but never released", None),
    # One frame: the last layer's copies wait for a release that never comes; end_chunk must
    # stop the walk, not wait for it.
    ([(0, "fetch"), (0, "release"), ("end", None)], "fetch read .* the walk stopped", 16),
    ([(0, "fetch"), (1, "fetch")], r"layer \d+ has not released its frame", "packed"),
    # A layer in pieces (StreamTuning.tail_pieces): every piece, in order, before its release.
    ([(0, "piece:1/2")], r"piece 1 of 2: its piece 0 was not fetched", "packed"),
    ([(0, "piece:0/2"), (0, "release")], r"release, layer \d+: fetched 1 of its 2 pieces",
     "packed"),
    ([(0, "piece:0/3"), (0, "piece:2/3")], r"piece 2 of 3: layer \d+ fetches piece 1 of 3",
     "packed"),
    ([(0, "piece:0/2"), (1, "fetch")], r"layer \d+ fetched 1 of its 2 pieces \(each piece",
     "packed"),
    ([(0, "piece:0/2"), ("end", None)], r"end_chunk: layer \d+ fetched 1 of its 2 pieces",
     None),
])
def test_frames_are_fetched_and_released_in_layer_order(steps, pattern, ring):
    # A layer's fetch readies its ring frame; its release (after its expert math) lets the walk
    # fill the frame with a later layer. Out of order, either would let the walk overwrite a
    # frame still read (or deadlock it): each is refused with a message, no thread is left, and
    # the next chunk is whole.
    import jax
    import jax.numpy as jnp

    from strata_jax import stream as S
    from strata_jax.synthetic import split_experts

    _, experts = split_experts(CFG, init_synthetic(CFG, seed=3))
    eng = S.NativeStreamer(CFG, [experts.get(l) for l in range(CFG.n_layers)],
                         StreamConfig(routed=False,
                                      tuning=StreamTuning(
                                          sim_bandwidth=0, sim_latency=0,
                                          ring=ring if ring != "packed" else None,
                                          layout="packed" if ring == "packed" else "frames")))
    assert eng.plan.frames == (1 if ring == 16 else 2)
    counts = jnp.ones((CFG.n_experts,), jnp.int32)
    layers = list(CFG.moe_layers)

    def chunk(steps):
        tok, _ = S.begin(eng.id, eng.chunk_mode(eng.tuning.stream_floor), jnp.zeros((), jnp.int32))
        outs = []
        so_far = None
        w = {p.name: jax.ShapeDtypeStruct((CFG.n_experts, *p.shape), p.dtype)
             for p in eng.format.planes}
        for i, call in steps:
            if i == "end":
                break
            l = layers[i]
            if call == "fetch":
                tok = S.publish(eng.id, l, tok, counts)
                w, tok = S.fetch(eng.id, l, tok, eng.resident_blobs[l], CFG.n_experts,
                                 eng.format)
                outs.append(w["gate"].sum())
            elif call.startswith("piece:"):
                p, n = map(int, call[len("piece:"):].split("/"))
                if p == 0:
                    tok = S.publish(eng.id, l, tok, counts)
                    so_far = None
                elif so_far is None:  # a later piece first: made-up weights so far
                    so_far = jax.tree_util.tree_map(jnp.zeros_like, w)
                rows = CFG.n_experts  # one token per expert
                w, tok = S.fetch(eng.id, l, tok, eng.resident_blobs[l], CFG.n_experts,
                                 eng.format, piece=p, pieces=n,
                                 rows=(p * rows // n, (p + 1) * rows // n), so_far=so_far,
                                 after=outs[-1] if p > 0 and outs else tok)
                so_far = w
                outs.append(w["gate"].sum())
            else:
                tok = S.release(eng.id, l, tok, outs[-1] if outs else tok)
        return S.end(eng.id, tok, CFG.n_layers), outs

    whole = [(i, c) for i in range(len(layers)) for c in ("fetch", "release")]
    try:
        with pytest.raises(Exception, match=pattern):
            jax.block_until_ready(jax.jit(lambda: chunk(steps))())
        assert not eng.walk_active()
        stats, _ = jax.jit(lambda: chunk(whole))()
        assert np.asarray(stats)[layers, 0].sum() == len(eng.stream_list)
    finally:
        eng.close()


def test_a_chunk_that_skips_a_layers_fetch_fails_at_end_and_the_engine_recovers():
    # The protocol driven by hand: begin, then publish + fetch for every MoE layer but the last,
    # then end. end_chunk must refuse (what fetch read differs from what the walk issued) with a
    # message, leave no thread running, and the next full chunk must succeed.
    import jax
    import jax.numpy as jnp

    from strata_jax import stream as S
    from strata_jax.synthetic import split_experts

    params = init_synthetic(CFG, seed=3)
    _, experts = split_experts(CFG, params)
    eng = S.NativeStreamer(CFG, [experts.get(l) for l in range(CFG.n_layers)],
                         StreamConfig(routed=False,
                                      tuning=StreamTuning(sim_bandwidth=0, sim_latency=0)))
    counts = jnp.ones((CFG.n_experts,), jnp.int32)
    layers = list(CFG.moe_layers)

    def chunk(n_fetched):
        tok, _ = S.begin(eng.id, eng.chunk_mode(eng.tuning.stream_floor), jnp.zeros((), jnp.int32))
        outs = []
        for l in layers[:n_fetched]:
            tok = S.publish(eng.id, l, tok, counts)
            w, tok = S.fetch(eng.id, l, tok, eng.resident_blobs[l], CFG.n_experts, eng.format)
            outs.append(w["gate"].sum())
            tok = S.release(eng.id, l, tok, outs[-1])
        return S.end(eng.id, tok, CFG.n_layers), outs

    try:
        with pytest.raises(Exception, match="fetch read .* the walk"):
            jax.block_until_ready(jax.jit(lambda: chunk(len(layers) - 1))())
        assert not eng.walk_active()
        stats, _ = jax.jit(lambda: chunk(len(layers)))()
        stats = np.asarray(stats)
        assert stats[layers, 0].sum() == len(eng.stream_list)  # every entry copied
    finally:
        eng.close()


def test_auto_tail_shape_follows_the_math_per_copied_byte():
    # Qwen3-30B-A3B's experts: halving while a layer's math is short beside its copies
    # (bf16 to 16K tokens, fp8 to 8K, int4 to 4K), equal pieces above
    # TAIL_HALVING_MAX_INTENSITY (int4 at 8K: 1,986 FLOPs a byte); a shape given is kept.
    from strata_jax.formats import ExpertFormat
    from strata_jax.stream.streamer import expert_intensity, tail_shape_for

    base = get_preset("qwen3-30b-a3b")
    want = {"plain": {8192: "halving", 16384: "halving", 24576: "equal"},
            "fp8": {4096: "halving", 8192: "halving", 16384: "equal"},
            "int4": {1024: "halving", 4096: "halving", 8192: "equal"}}
    for fmt, by_length in want.items():
        c = base.replace(expert_format=fmt)
        blob = ExpertFormat.of(c).blob_bytes
        got = {n: tail_shape_for("auto", c, n, blob) for n in by_length}
        assert got == by_length, fmt
    c = base.replace(expert_format="int4")
    assert expert_intensity(c, 8192, ExpertFormat.of(c).blob_bytes) == pytest.approx(1986, abs=1)
    assert [tail_shape_for(s, c, 8192, ExpertFormat.of(c).blob_bytes)
            for s in ("equal", "halving")] == ["equal", "halving"]


@pytest.mark.parametrize("layout, mode, shape, max_intensity, bounds", [
    ("frames", 0, "equal", None, (0, 21, 43, 64)),
    pytest.param("packed", 2, "auto", 0.0, (0, 21, 43, 64), marks=pytest.mark.slow),
    ("packed", 2, "auto", None, (0, 32, 48, 64))])
def test_tail_pieces_program(monkeypatch, layout, mode, shape, max_intensity, bounds):
    # The last MoE layer in pieces: one fetch per piece for it alone, the later ones writing
    # the weights so far in place (packed): XLA must not copy a layer's weights per piece.
    # The pieces' rows follow tail_shape: equal thirds, or halving (1/2, 1/4, 1/4); "auto"
    # takes halving for this tiny model (4 FLOPs a copied byte), equal where the threshold
    # is below that.
    import jax

    import strata_jax.stream.streamer as stream_module

    if max_intensity is not None:
        monkeypatch.setattr(stream_module, "TAIL_HALVING_MAX_INTENSITY", max_intensity)
    params = init_synthetic(CFG, seed=3)
    stream = StreamConfig(routed=True,
                          tuning=StreamTuning(stream_floor=CHUNK, tail_pieces=3, tail_from=CHUNK,
                                              tail_shape=shape, layout=layout, **SLOW))
    with Engine(CFG, params, stream, max_context=256, chunk_size=CHUNK) as eng:
        assert eng.streamer.tail_pieces(mode, CHUNK) == 3
        assert eng.streamer.tail_shape(CHUNK) == ("halving" if bounds[1] == 32 else "equal")
        assert eng.streamer.tail_pieces(mode, CHUNK - 1) == 1
        assert eng.streamer.tail_pieces(1, 4096) == 1  # routed-only: whole layers
        # The Mosaic kernel's grid holds E - 1 more tiles than the rows' own: at most one piece
        # per E row tiles (here 16 experts, top-2, 128-row tiles: one per 1,024 tokens).
        for impl, want in (("mosaic", [1, 2, 3, 3]), ("tiled", [3] * 4), ("lax", [3] * 4)):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(stream_module, "resolve_implementation", lambda _, impl=impl: impl)
                assert [eng.streamer.tail_pieces(mode, n)
                        for n in (1024, 2048, 3072, 8192)] == want, impl
        resident = (eng.streamer.resident_blobs, eng.streamer.frames)
        fn = functools.partial(eng._prefill_fn, first=False, mode=mode, sub=0, width=CHUNK + 2)
        jaxpr = jax.make_jaxpr(fn)(eng._state_leaves, resident, None, eng.new_cache())
        fetches = [(int(e.params["layer"]), int(e.params["piece"]), int(e.params["pieces"]),
                    int(e.params["row_begin"]), int(e.params["row_end"]))
                   for e in jaxpr.jaxpr.eqns if e.primitive.name == "strata_stream_call"
                   and "fetch" in e.params["target"]]
        last = max(CFG.moe_layers)
        assert CHUNK * CFG.top_k == 64
        assert fetches == [(l, 0, 1, 0, 0) for l in CFG.moe_layers if l != last] + [
            (last, p, 3, bounds[p], bounds[p + 1]) for p in range(3)]
        hlo = jax.jit(eng._prefill_fn, static_argnames=("first", "mode", "sub", "width")).lower(
            eng._state_leaves, resident, None, None, first=True, mode=mode, sub=0,
            width=CHUNK + 2).compile().as_text()
        assert "strata_fetch_piece" in hlo
        assert "copy(%strata_stream_call" not in hlo
