"""The benchmark scripts run end to end on the CPU (tiny shapes), so they cannot rot between GPU
sessions: every part of stream_bench, its identity lane, and the plots made from its JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from strata_jax.benchmarks import plot, stream_bench


def test_stream_bench_tiny_all_parts_and_plots(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = stream_bench.main(["--tiny", "--layers", "2", "--lengths", "40,100", "--parts",
                            "sweep,two-turn,layer-major,publication,floor", "--chunk", "64",
                            "--turn1", "150",
                            "--turn2", "50", "--turn-reps", "1", "--long", "256",
                            "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["identical"] and res["two_turn_identical"]
    rows = res["rows"]
    arms = {(r["part"], r["arm"]) for r in rows}
    for arm in ("resident", "stream-all", "routed", "pairs"):
        assert ("sweep", arm) in arms
    for r in rows:
        if r["part"] == "sweep" and r["arm"] in ("stream-all", "routed"):
            assert r["identical_to_resident"]
            assert r["copied"] + r["skipped"] == r["streamed"]
            assert r["time_over_floor"] > 0
            assert 0 <= r["host_call_to_begin_ms"] <= max(r["ms_each"])
            assert 0 <= r["host_end_to_return_ms"] <= max(r["ms_each"])
        if r["part"] == "sweep" and r["arm"] == "pairs":
            lo, hi = r["ci95"]
            assert lo <= hi and len(r["off_over_on"]) == 4
    turns = [r for r in rows if r["part"] == "two-turn"]
    assert {r["arm"] for r in turns} == {"resident", "stream-all", "routed"}
    assert all((r["reused"], r["read"]) == (150, 50) for r in turns)
    lm = {(r["arm"], r["order"]): r for r in rows if r["part"] == "layer-major"}
    for arm in ("routed", "stream-all"):
        # Layer-major reads each streamed expert at most once; chunk-major up to once per chunk.
        assert lm[(arm, "layer-major")]["copied"] <= lm[(arm, "layer-major")]["streamed"]
        assert lm[(arm, "chunk-major")]["chunks"] == 4
    assert res["floor_identical"]
    floor = {(r["arm"], r["tokens"]): r for r in rows if r["part"] == "floor"}
    for n in (40, 100):
        # The tiny run's lengths sit below the default floor of 1,024 tokens.
        assert floor[("default-floor", n)]["mode"] == "routed-only"
        assert floor[("forced-stream", n)]["mode"] == "stream"
        assert len(floor[("pairs", n)]["default_over_forced"]) == 4
    pubs = {r["arm"]: r for r in rows if r["part"] == "publication"}
    assert set(pubs) == {"all-resident-through-stream/callback",
                         "all-resident-through-stream/event", "callback-stall"}
    for mode in ("callback", "event"):
        pub = pubs[f"all-resident-through-stream/{mode}"]
        assert pub["publish"] == mode
        assert pub["resident_ms"] > 0 and pub["through_stream_ms"] > 0
        assert pub["layer_copy_us"] > 0
    assert np.isfinite(pubs["callback-stall"]["stall_us_per_layer"])
    written = plot.main([str(out), "--out", str(tmp_path)])
    assert written == 0
    assert (tmp_path / "bench_time.png").stat().st_size > 0
    assert (tmp_path / "bench_layers.png").stat().st_size > 0


def test_bootstrap_interval():
    lo, hi = stream_bench.bootstrap_ci([1.0, 1.0, 1.0, 1.0])
    assert lo == hi == 1.0
    lo, hi = stream_bench.bootstrap_ci([1.1, 1.2, 1.3, 1.4])
    assert 1.1 <= lo < hi <= 1.4


@pytest.mark.parametrize("parts", ["nope", "sweep,nope"])
def test_stream_bench_refuses_unknown_parts(parts):
    with pytest.raises(SystemExit):
        stream_bench.main(["--tiny", "--parts", parts])


def test_order_numerics_yardstick(capsys):
    # The layer-major yardstick runs end to end: with sub-chunks equal to the chunk, layer-major
    # equals chunk-major bit for bit on the CPU, and bf16 sits measurably off float32.
    from strata_jax.benchmarks import order_numerics

    assert order_numerics.main(["--tokens", "128", "--chunk", "64", "--layers", "2"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["layer_vs_chunk_major"] == 0.0
    assert 0.0 < row["bf16_vs_float32"] < row["max_abs_logit"]
