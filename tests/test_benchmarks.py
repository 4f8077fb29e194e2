"""The benchmark scripts run end to end on the CPU (tiny shapes), so they cannot rot between GPU
sessions: every part of stream_bench, its identity lane, and the plots made from its JSON."""

from __future__ import annotations

import json
import os
import re
import statistics

import numpy as np
import pytest

from strata_jax.benchmarks import common, plot, stream_bench


@pytest.mark.slow
def test_stream_bench_tiny_all_parts_and_plots(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = stream_bench.main(["--tiny", "--layers", "2", "--lengths", "40,100", "--parts",
                            "sweep,two-turn,layer-major,publication,floor", "--chunk", "64",
                            "--turn1", "150",
                            "--turn2", "50", "--turn-reps", "1", "--long", "256",
                            "--blocks", "1", "--json", str(out)])
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
            assert "host_end_to_return_ms" not in r  # measured nothing on the GPU: dropped
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
        n_moe = 2  # the tiny run's MoE layers
        want = (pub["through_stream_ms"] - pub["resident_ms"]) / n_moe * 1e3
        assert pub["per_layer_us"] == pytest.approx(want)
    stall = pubs["callback-stall"]["stall_us_per_layer"]
    assert stall == pytest.approx(pubs["all-resident-through-stream/callback"]["per_layer_us"]
                                  - pubs["all-resident-through-stream/event"]["per_layer_us"])
    written = plot.main([str(out), "--out", str(tmp_path)])
    assert written == 0
    assert (tmp_path / "bench_time.png").stat().st_size > 0
    assert (tmp_path / "bench_layers.png").stat().st_size > 0


@pytest.mark.parametrize("flags, layout, pieces", [
    (["--packed"], "packed", 1),  # the ninth session's spelling of --layout packed
    (["--layout", "frames"], "frames", 1),
    (["--frames-from", "40"], "frames", 1),  # auto: a 40-token chunk is at the crossover
    (["--frames-from", "41"], "packed", 1),
    # The last MoE layer in pieces (a 40-token chunk's bucket is at least 40).
    (["--layout", "packed", "--tail-pieces", "3", "--tail-from", "40"], "packed", 3),
])
@pytest.mark.slow
def test_stream_bench_layouts_are_identical_and_recorded(tmp_path, flags, layout, pieces):
    # The streamed arms' ring layout (StreamTuning.layout): each row records the one its chunk
    # used, and every arm hashes equal to the resident one.
    out = tmp_path / "layout.json"
    rc = stream_bench.main(["--tiny", "--layers", "2", "--lengths", "40", "--parts", "sweep",
                            "--chunk", "64", "--blocks", "1", "--stream-floor", "16", *flags,
                            "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["identical"]
    rows = [r for r in res["rows"] if r["arm"] in ("stream-all", "routed")]
    assert len(rows) == 2
    assert all(r["mode"] == "stream" for r in rows)
    assert all(r["identical_to_resident"] and r["layout"] == layout for r in rows)
    assert all(r["tail_pieces"] == pieces for r in rows)
    # The settings record what the arms ran with, defaults filled in, not the flags' None.
    from strata_jax.stream import StreamTuning
    assert res["layout"] == (layout if "--frames-from" not in flags else "auto")
    assert res["tail_shape"] == StreamTuning().tail_shape
    assert res["tail_from"] == (40 if "--tail-from" in flags else StreamTuning().tail_from)


@pytest.mark.slow
def test_stream_bench_sweep_rows_with_device_timing(tmp_path, monkeypatch):
    # The CPU backend keeps no device timing; a stand-in one (chunk 2 ms, copies 1.5 ms) checks
    # the rows built from it: the time outside the device chunk is each call's time less 2 ms.
    from strata_jax.stream import NativeStreamer

    monkeypatch.setattr(NativeStreamer, "device_timing", lambda self: (2.0, 1.5, 0.1, 0.4))
    out = tmp_path / "bench.json"
    assert stream_bench.main(["--tiny", "--layers", "2", "--lengths", "100", "--parts", "sweep",
                              "--json", str(out)]) == 0  # the default: ORDER twice over
    res = json.loads(out.read_text())
    assert res["blocks"] == 2
    rows = [r for r in res["rows"] if r["part"] == "sweep" and r["arm"] in ("stream-all", "routed")]
    assert len(rows) == 2
    (pairs,) = [r for r in res["rows"] if r["part"] == "sweep" and r["arm"] == "pairs"]
    assert len(pairs["off_over_on"]) == 8
    resident = [r for r in res["rows"] if r["part"] == "sweep" and r["arm"] == "resident"]
    assert resident[0]["reps"] == 16
    for r in rows:
        assert len(r["ms_each"]) == len(r["host_call_to_begin_each"]) == 8
        assert r["device_chunk_each"] == [2.0] * 8
        assert r["device_chunk_ms"] == 2.0 and r["device_copy_ms"] == 1.5
        assert (r["copy_lead_ms"], r["copy_tail_ms"]) == (0.1, 0.4)
        assert r["outside_device_chunk_ms"] == pytest.approx(statistics.median(r["ms_each"]) - 2.0)
        assert r["device_time_over_floor"] == pytest.approx(2.0 / r["floor_ms"])


@pytest.mark.slow
def test_stream_bench_resident_arm_alone(tmp_path):
    # --arms resident: the resident rows only, no streamed engine built.
    out = tmp_path / "resident.json"
    assert stream_bench.main(["--tiny", "--layers", "2", "--lengths", "40", "--parts", "sweep",
                              "--blocks", "1", "--quantize", "int4", "--arms", "resident",
                              "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = [r for r in result["rows"] if r["part"] == "sweep"]
    assert [(r["arm"], r["tokens"]) for r in rows] == [("resident", 40)]
    assert result["quantized_matmul"] == "dequantize"  # what "auto" reads int4 by on the CPU


@pytest.mark.slow
def test_stream_bench_tiny_mxfp4_widens_to_its_packs_and_streams_the_resident_bits(tmp_path):
    # --tiny --quantize mxfp4: the tiny model 64 wide (mxfp4 reads inputs in packs of 64), the
    # routed arm's reads the resident ones' bits.
    out = tmp_path / "mxfp4.json"
    assert stream_bench.main(["--tiny", "--layers", "2", "--lengths", "40", "--parts", "sweep",
                              "--blocks", "1", "--quantize", "mxfp4", "--arms",
                              "resident,routed", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["expert_format"], result["expert_block"]) == ("mxfp4", 32)
    assert result["quantized_matmul"] == "dequantize"
    rows = [r for r in result["rows"] if r["part"] == "sweep" and r["arm"] == "routed"]
    assert rows and all(r["identical_to_resident"] for r in rows)
    cfg = common.model_config("qwen3-30b-a3b", 2, 512, 40, tiny=True, quantize="mxfp4")
    assert cfg.hidden_size % 64 == 0 and cfg.expert_intermediate == 64


@pytest.mark.slow
def test_stream_bench_sweep_stopped_midway_keeps_the_lengths_it_finished(tmp_path, capsys,
                                                                          monkeypatch):
    # A run stopped inside its second length (here an error in a streamed call; on the GPU
    # machine, gpu_run.sh's timeout) has saved the resident rows and the first length's
    # streamed rows, each also printed as one short line.
    real = stream_bench._timed

    def timed(engine, tokens, *args, **kwargs):
        if engine.streamer is not None and np.size(tokens) == 100:
            raise RuntimeError("stopped in the second length")
        return real(engine, tokens, *args, **kwargs)

    monkeypatch.setattr(stream_bench, "_timed", timed)
    out = tmp_path / "part.json"
    with pytest.raises(RuntimeError, match="second length"):
        stream_bench.main(["--tiny", "--layers", "2", "--lengths", "40,100", "--parts", "sweep",
                           "--blocks", "1", "--arms", "resident,stream-all,routed",
                           "--json", str(out)])
    result = json.loads(out.read_text())
    rows = {(r["arm"], r["tokens"]) for r in result["rows"] if r["part"] == "sweep"}
    assert rows == {("resident", 40), ("resident", 100), ("stream-all", 40), ("routed", 40),
                    ("pairs", 40)}
    assert result["identical"] is True
    printed = capsys.readouterr().out
    assert re.search(r"^40 stream-all: [0-9.]+ ms, x floor [0-9.]+, link [0-9.]+ .*identical "
                     r"True$", printed, re.M), printed[-2000:]
    assert "40: both arms compiled in" in printed and "100: both arms compiled in" in printed


@pytest.mark.slow
def test_stream_bench_reports_accuracy_against_the_plain_model(tmp_path):
    # --parts accuracy with --quantize: per length, the quantized model's log-probabilities
    # and last logits against the plain model's on the same prompts (finite, nonzero: it
    # quantized; the NLLs near each other); without --quantize it is refused by name.
    out = tmp_path / "acc.json"
    assert stream_bench.main(["--tiny", "--layers", "2", "--lengths", "40,64", "--parts",
                              "accuracy", "--quantize", "int4", "--accuracy-prompts", "3",
                              "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["part"] == "accuracy"]
    assert [(r["tokens"], r["prompts"]) for r in rows] == [(40, 3), (64, 3)]
    for r in rows:
        assert r["finite"] and 0 < r["logprob_abs_diff_mean"] <= r["logprob_abs_diff_max"]
        assert 0 < r["last_logit_abs_diff_mean"] <= r["last_logit_abs_diff_max"]
        assert abs(r["nll_quantized"] - r["nll_plain"]) < 0.1 * r["nll_plain"]
        assert 0 <= r["last_top1_agreement"] <= 1 and 0 < r["top1_agreement"] <= 1
    with pytest.raises(SystemExit):
        stream_bench.main(["--tiny", "--parts", "accuracy"])


@pytest.mark.slow
def test_stream_bench_resident_ab_interleaves_the_plain_and_quantized_reads(tmp_path,
                                                                             monkeypatch):
    # --parts resident-ab: both resident models read in the sweep's order (plain in the OFF
    # slots); the row's medians and pair ratios are those of the reads it timed. Each read is
    # recorded by the engine it went to, so the order is checked, not assumed.
    seen = []
    real = stream_bench._timed

    def timed(engine, tokens, *a, **k):
        seen.append(engine.config.expert_format)
        return real(engine, tokens, *a, **k)

    monkeypatch.setattr(stream_bench, "_timed", timed)
    out = tmp_path / "ab.json"
    assert stream_bench.main(["--tiny", "--layers", "2", "--lengths", "40", "--parts",
                              "resident-ab", "--quantize", "fp8", "--blocks", "1",
                              "--json", str(out)]) == 0
    (row,) = [r for r in json.loads(out.read_text())["rows"] if r["part"] == "resident-ab"]
    assert seen == ["plain" if s == "stream-all" else "fp8" for s in common.ORDER]
    t = row["times_ms"]
    assert row["pair_ratios"] == pytest.approx([t[on] / t[off] for on, off in
                                                common.PAIRS])
    assert row["plain_ms"] == pytest.approx(statistics.median(t[i] for i in (0, 3, 5, 6)))
    assert row["quantized_ms"] == pytest.approx(statistics.median(t[i] for i in (1, 2, 4, 7)))
    lo, hi = row["pair_ratio_ci95"]
    assert lo <= hi and row["reps"] == 4
    with pytest.raises(SystemExit):
        stream_bench.main(["--tiny", "--parts", "resident-ab"])


@pytest.mark.slow
def test_stream_bench_reads_quantized_experts_as_told(tmp_path, monkeypatch):
    # --quantized-matmul reaches every engine the bench builds and its JSON.
    import strata_jax.engine as engine_mod
    seen = []
    real = engine_mod.Engine

    def recording(*args, kernels=None, **kwargs):
        seen.append(kernels.quantized_matmul)
        return real(*args, kernels=kernels, **kwargs)

    monkeypatch.setattr(engine_mod, "Engine", recording)
    out = tmp_path / "fused.json"
    assert stream_bench.main(["--tiny", "--layers", "2", "--lengths", "40", "--parts", "sweep",
                              "--blocks", "1", "--quantize", "fp8", "--arms", "resident",
                              "--quantized-matmul", "fused", "--json", str(out)]) == 0
    assert seen and set(seen) == {"fused"}
    # Off Hopper "fused" has no kernel: the experts are dequantized first.
    assert json.loads(out.read_text())["quantized_matmul"] == "dequantize"
    with pytest.raises(SystemExit):
        stream_bench.main(["--tiny", "--quantized-matmul", "mosaic"])


@pytest.mark.slow
def test_stream_bench_probes_the_link_before_and_after_each_length(tmp_path, monkeypatch):
    # With a probed link (CUDA), each length's rows are against the ceiling probed before its
    # calls; the probe after them is recorded beside it, with the fraction it would give.
    probes = iter([({"fresh": 50.0}, {}), ({"fresh": 40.0}, {})])
    monkeypatch.setattr(stream_bench, "_probes_link", lambda engines: True)
    monkeypatch.setattr(stream_bench, "_ceiling_probes", lambda engines: next(probes))
    out = tmp_path / "probes.json"
    assert stream_bench.main(["--tiny", "--layers", "2", "--lengths", "40", "--parts", "sweep",
                              "--blocks", "1", "--arms", "resident,stream-all,routed",
                              "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["link_probes"] == {"40": {"fresh": 50.0}}
    assert res["link_probes_after"] == {"40": {"fresh": 40.0}}
    rows = [r for r in res["rows"] if r["arm"] in ("stream-all", "routed")]
    assert len(rows) == 2
    for r in rows:
        assert r["link_ceiling_gbps"] == 50.0 and r["link_ceiling_after_gbps"] == 40.0
        assert r["link_fraction"] == pytest.approx(r["gbps"] / 50.0)
        assert r["link_fraction_after"] == pytest.approx(r["gbps"] / 40.0)


def test_schedule_repeats_order_and_pairs_stay_in_their_block():
    assert common.schedule(1) == common.ORDER
    two = common.schedule(2)
    assert two == common.ORDER * 2
    pairs = common._pairs(len(two))
    assert len(pairs) == 8
    for on, off in pairs:
        assert (two[on], two[off]) == ("routed", "stream-all")
        assert on // 8 == off // 8  # a pair never straddles two blocks
    # Times 1..16: each pair's OFF/ON ratio, from positions (1,0), (2,3), (4,5), (7,6) per block.
    ratios, _, _ = common._pair_ratios(list(range(1, 17)))
    assert ratios[:4] == [1 / 2, 4 / 3, 6 / 5, 7 / 8]
    assert ratios[4:] == [9 / 10, 12 / 11, 14 / 13, 15 / 16]
    with pytest.raises(ValueError, match="blocks=0"):
        common.schedule(0)
    with pytest.raises(SystemExit):
        stream_bench.main(["--tiny", "--blocks", "0"])


def test_bootstrap_interval():
    lo, hi = common.bootstrap_ci([1.0, 1.0, 1.0, 1.0])
    assert lo == hi == 1.0
    lo, hi = common.bootstrap_ci([1.1, 1.2, 1.3, 1.4])
    assert 1.1 <= lo < hi <= 1.4


@pytest.mark.parametrize("parts", ["nope", "sweep,nope"])
def test_stream_bench_refuses_unknown_parts(parts):
    with pytest.raises(SystemExit):
        stream_bench.main(["--tiny", "--parts", parts])


@pytest.mark.slow
def test_timeline_tiny_reads_back_the_trace(tmp_path, capsys):
    # On the CPU the profiler still records the Python thread and XLA's host threads: the
    # reduction must find the marked call, attribute its Python frames and write the raw events.
    import gzip

    from strata_jax.benchmarks import timeline

    out = tmp_path / "tl"
    assert timeline.main(["--tiny", "--layers", "2", "--tokens", "64", "--arms",
                          "resident,routed", "--between", "hash-hold-gc", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["between"] == "hash-hold-gc" and summary["chunk"] == 64
    assert set(summary["arms"]) == {"resident", "routed"}
    for arm, res in summary["arms"].items():
        assert res["first_prefill_s"] > 0
        for kind in ("python_traced", "plain"):
            s = res[kind]
            # The marked span is the call itself: within the host clock's wall time of it.
            assert 0 < s["call_ms"] <= s["wall_ms"] * 1.05 + 0.5, (arm, kind, s)
        frames = dict(res["python_traced"]["python_frames_ms"])
        assert any("prefill" in name for name in frames), list(frames)[:10]
        for name in (f"events_{arm}.json.gz", f"events_{arm}_python.json.gz"):
            with gzip.open(out / name, "rt") as f:
                events = json.load(f)
            assert any(e[2] == timeline.MARK for e in events), name
        with gzip.open(out / f"events_{arm}_python.json.gz", "rt") as f:
            assert any("prefill" in e[2] for e in json.load(f))  # the Python frames, in time
    assert "routed: wall" in capsys.readouterr().out


@pytest.mark.slow
def test_timeline_traces_a_prompt_of_several_chunks(tmp_path):
    from strata_jax.benchmarks import timeline

    out = tmp_path / "tl"
    assert timeline.main(["--tiny", "--layers", "2", "--tokens", "64", "--chunk", "32",
                          "--arms", "routed", "--quantize", "fp8", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["chunk"] == 32 and summary["arms"]["routed"]["plain"]["call_ms"] > 0
    assert summary["expert_format"] == "fp8"
    with pytest.raises(SystemExit):
        timeline.main(["--tiny", "--tokens", "64", "--chunk", "65", "--out", str(out)])


def test_timeline_removes_the_profilers_folder(tmp_path, monkeypatch):
    # Each traced call wrote a strata-trace-* folder into the temp directory and left it there.
    import tempfile

    import jax.numpy as jnp

    from strata_jax.benchmarks import timeline

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    ms, events = timeline._trace_one(lambda: jnp.arange(8) + 1, python=False)
    assert ms > 0 and any(e[2] == timeline.MARK for e in events)
    assert list(scratch.iterdir()) == []


def test_timeline_summarize_splits_host_and_device():
    # A hand-made trace: the call 0..10 ms, device work 2..9 ms on two streams, copies end at
    # 7 ms; the compute stream idles 3..5 ms.
    from strata_jax.benchmarks import timeline

    ms = 1_000_000
    ev = [("/host:CPU", "python3", timeline.MARK, 0, 10 * ms),  # the line is the process's name
          ("/host:CPU", "python3", "$engine.py:1 prefill", ms // 2, 9 * ms),
          ("/host:CPU", "worker", "Execute", ms, ms),
          ("/device:GPU:0", "Stream #1(Compute)", "k1", 2 * ms, 1 * ms),
          ("/device:GPU:0", "Stream #1(Compute)", "k2", 5 * ms, 4 * ms),
          ("/device:GPU:0", "Stream #2(MemcpyH2D)", "MemcpyH2D", 2 * ms, 2 * ms),
          ("/device:GPU:0", "Stream #2(MemcpyH2D)", "MemcpyH2D", 4 * ms, 3 * ms)]
    s = timeline.summarize(ev, gap_us=100)
    assert s["call_ms"] == 10
    assert (s["host_before_device_ms"], s["device_span_ms"], s["host_after_device_ms"]) == (2, 7, 1)
    assert s["last_copy_end_ms"] == 7
    assert [t["name"] for t in s["tail"]] == ["k2"]
    assert dict(s["python_frames_ms"])["$engine.py:1 prefill"] == 9
    assert set(s["host_threads"]) == {"worker"}
    compute = s["streams"]["/device:GPU:0 Stream #1(Compute)"]
    assert compute["busy_ms"] == 5 and compute["gaps"][0]["gap_us"] == 2000
    copy = s["streams"]["/device:GPU:0 Stream #2(MemcpyH2D)"]
    assert copy["busy_ms"] == 5 and copy["gaps"] == []


@pytest.mark.slow
def test_score_bench_tiny_times_score_against_prefill(tmp_path):
    # Score against prefill of the same prompt at tiny widths on the CPU: a row per arm with
    # both times and their ratio, the arms' scores the same bytes.
    from strata_jax.benchmarks import score_bench

    out = tmp_path / "score.json"
    rc = score_bench.main(["--tiny", "--layers", "2", "--long", "256", "--chunk", "128",
                           "--arms", "resident,routed", "--reps", "2", "--block-mib", "1,2",
                           "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["ok"] and res["identical_across_arms"] and res["vocab"] == 512
    assert [(r["arm"], r["score_block_mib"]) for r in res["rows"]] == [
        ("resident", 1), ("resident", 2), ("routed", 1), ("routed", 2)]
    from strata_jax.models import decoder as model
    assert model.SCORE_BLOCK_BYTES == 512 * 2**20  # the bench's setting is undone
    for r in res["rows"]:
        assert (r["tokens"], r["chunks"], r["chunk_size"]) == (256, 2, 128)
        assert len(r["prefill_ms_all"]) == len(r["score_ms_all"]) == 2
        assert r["score_over_prefill"] == pytest.approx(r["score_ms"] / r["prefill_ms"])
        assert r["finite"] and r["perplexity"] > 1
        assert r["kv_identical_to_prefill"] and r["logits_identical_to_prefill"]
    assert res["rows"][2]["bytes_copied"] > 0 == res["rows"][0]["bytes_copied"]


@pytest.mark.slow
def test_chunked_bench_tiny_reads_and_follow_up(tmp_path):
    # The chunked-prompt benchmark end to end at tiny widths on the CPU: every arm reads the
    # prompt in one chunk, in chunks and layer-major, each streamed read equal to the resident
    # read of the same order; then a follow-up turn per arm.
    from strata_jax.benchmarks import chunked_bench

    out = tmp_path / "chunked.json"
    rc = chunked_bench.main(["--tiny", "--layers", "2", "--parts", "prefill,follow-up",
                             "--long", "256", "--chunk", "128", "--turn1", "150", "--turn2", "40",
                             "--arms", "routed,stream-all", "--reps-prefill", "1",
                             "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    reads = {(r["arm"], r["read"]): r for r in rows if r["part"] == "prefill"}
    assert set(reads) == {(a, o) for a in ("resident", "routed", "stream-all")
                          for o in ("one", "chunked", "layer-major")}
    assert all(r["identical_to_resident"] is True for r in reads.values())
    assert [reads[("routed", o)]["chunks"] for o in ("one", "chunked", "layer-major")] == [1, 2, 1]
    assert reads[("resident", "one")]["chunk_choice"].startswith("auto: 256 tokens")
    follow = [r for r in rows if r["part"] == "follow-up"]
    assert [r["arm"] for r in follow] == ["resident", "routed", "stream-all"]
    assert all(r["over_first_chunk"] > 0 and "150 reused + 40 read" in r["summary"]
               for r in follow)
    # Host memory is reported; the simulated link has no ceiling to measure.
    assert all(r["peak_rss_bytes"] > 0 and r["peak_rss_over_experts"] > 0 for r in reads.values())
    assert all(r["link_gbps"] is None and r["link_gbps_after"] is None for r in reads.values())
    assert all(r["first_read_s"] > 0 for r in reads.values())  # its compile, for the record
    assert all(r["layer_parts"] == 1 for r in reads.values() if r["arm"] != "resident")
    # A run without the resident arm divides by the first run's resident one-chunk time; its
    # ring budget holds half a layer frame, so each layer streams in parts (the same bits).
    cfg = chunked_bench.model_config("qwen3-30b-a3b", 2, 32768, 256, tiny=True)
    half = (cfg.n_experts // 2 + 0.5) * cfg.expert_bytes / 2**30
    again = tmp_path / "again.json"
    rc = chunked_bench.main(["--tiny", "--layers", "2", "--parts", "prefill", "--long", "256",
                             "--chunk", "128", "--arms", "routed", "--orders", "layer-major",
                             "--no-resident", "--resident-json", str(out), "--ring-gib",
                             str(half), "--reps-prefill", "1", "--json", str(again)])
    assert rc == 0
    row, = json.loads(again.read_text())["rows"]
    assert row["layer_parts"] == 4 and row["ring_slots"] == cfg.n_experts // 2
    assert row["over_resident_one"] == pytest.approx(row["ms"] / reads[("resident", "one")]["ms"])
    assert row["identical_to_resident"] is True  # against the first run's resident read
    assert row["kv_sha256"] == reads[("resident", "layer-major")]["kv_sha256"]
    assert row["resident_read"] == "one"
    # Where the resident one chunk did not fit (no row), its layer-major read divides.
    lm = tmp_path / "layer_major_only.json"
    lm.write_text(json.dumps({"rows": [r for r in rows if r.get("read") != "one"]}))
    ms, read, hashes = chunked_bench._resident_reference(str(lm), 256)
    assert (ms, read) == (reads[("resident", "layer-major")]["ms"], "layer-major")
    assert ("layer-major", 1) in hashes and ("one", 1) not in hashes


def test_chunked_bench_exits_nonzero_when_a_read_fails(tmp_path, monkeypatch, capsys):
    # A read that failed (out of memory on a GPU) is an error row and a failing exit status.
    from strata_jax.benchmarks import chunked_bench

    def failing(eng, prompts, chunk, orders):
        for order in orders:
            yield order, "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory"

    monkeypatch.setattr(chunked_bench, "_reads", failing)
    out = tmp_path / "failed.json"
    rc = chunked_bench.main(["--tiny", "--layers", "2", "--parts", "prefill", "--long", "128",
                             "--chunk", "128", "--arms", "resident", "--resident-orders", "one",
                             "--reps-prefill", "1", "--json", str(out)])
    assert rc == 1 and "1 read(s) failed" in capsys.readouterr().out
    row, = json.loads(out.read_text())["rows"]
    assert row["error"].startswith("JaxRuntimeError") and "ms" not in row


def test_chunked_bench_link_floor_of_a_mesh_is_its_slowest_device():
    # One device: the copied bytes over the link. A mesh: each device's bytes over its own
    # ceiling, the floor the slowest device's, and each link's fraction of its ceiling.
    from types import SimpleNamespace

    from strata_jax.benchmarks.chunked_bench import _link_rows

    one = SimpleNamespace(devices=1, totals=lambda: {"bytes": 50e9})
    row = _link_rows(one, 2000.0, [50.0])
    assert row["link_floor_ms"] == pytest.approx(1000.0) and row["over_link_floor"] == 2.0
    two = SimpleNamespace(devices=2, totals=lambda: {"bytes": 80e9}, per_device=lambda: {
        "streamed": [{"bytes": 30e9}, {"bytes": 50e9}]})
    row = _link_rows(two, 1250.0, [60.0, 50.0])
    assert row["link_floor_ms"] == pytest.approx(1000.0)  # device 1: 50 GB at 50 GB/s
    assert row["over_link_floor"] == pytest.approx(1.25)
    assert row["device_link_fraction"] == pytest.approx([0.4, 0.8])
    assert _link_rows(two, 1.0, None)["link_floor_ms"] is None


@pytest.mark.slow
def test_chunked_bench_on_two_simulated_devices(tmp_path):
    # --devices 2 on the CPU (simulated devices, asked for before JAX starts, so in a process
    # of its own): the resident and streamed arms split the experts over the mesh, and every
    # streamed read equals the mesh's resident read.
    import subprocess
    import sys

    out = tmp_path / "mesh.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "strata_jax.benchmarks.chunked_bench", "--tiny", "--layers", "2",
         "--parts", "prefill", "--long", "256", "--chunk", "128", "--arms", "routed,stream-all",
         "--orders", "one,chunked", "--resident-orders", "one,chunked", "--reps-prefill", "1",
         "--devices", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in json.loads(out.read_text())["rows"] if r["part"] == "prefill"]
    assert {(r["arm"], r["read"]) for r in rows} == {
        (a, o) for a in ("resident", "routed", "stream-all") for o in ("one", "chunked")}
    assert all(r["devices"] == 2 and r["identical_to_resident"] is True for r in rows), rows


def _sweep_result(fmt: str, scale: float, identical: bool = True) -> dict:
    rows = []
    for n in (1024, 8192):
        rows.append({"part": "sweep", "arm": "resident", "tokens": n, "ms": 10.0 * (1 + (fmt != "plain") * 0.04)})
        for arm, ms in (("stream-all", 100.0), ("routed", 80.0)):
            rows.append({"part": "sweep", "arm": arm, "tokens": n, "ms": ms * scale,
                         "link_fraction": 0.98, "link_fraction_after": 0.99,
                         "time_over_floor": 1.02,
                         "bytes_copied": 1e9 * scale, "identical_to_resident": identical})
        rows.append({"part": "sweep", "arm": "pairs", "tokens": n, "median": 1.2})
    return {"expert_format": fmt, "preset": "p", "layers": 8, "skew": 0.0,
            "expert_bytes": int(1000 * scale), "rows": rows}


def test_quant_summary_compares_each_format_with_bf16(tmp_path, capsys):
    # Issue 21's figures from one sweep per format: times over bf16's, per arm and length.
    from strata_jax.benchmarks import quant_summary

    paths = []
    for fmt, scale in (("plain", 1.0), ("fp8", 0.5), ("int4", 0.26), ("int4-zp", 0.27),
                       ("int4-act", 0.265)):
        p = tmp_path / f"{fmt}.json"
        res = _sweep_result(fmt.split("-")[0], scale)
        res["expert_zero_points"] = fmt.endswith("-zp")
        res["expert_act_order"] = fmt.endswith("-act")
        if fmt == "fp8":  # a run with the accuracy part
            res["rows"].append({"part": "accuracy", "tokens": 8192, "finite": True,
                                "logprob_abs_diff_mean": 0.01, "nll_plain": 11.9,
                                "nll_quantized": 11.91, "top1_agreement": 0.93,
                                "last_top1_agreement": 1.0})
        p.write_text(json.dumps(res))
        paths.append(str(p))
    out = tmp_path / "q.json"
    assert quant_summary.main([*paths, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {(r["format"], r["tokens"]): r for r in res["rows"]}
    assert set(rows) == {(f, n) for f in ("plain", "fp8", "int4", "int4-zp", "int4-act")
                         for n in (1024, 8192)}
    assert rows[("int4-zp", 1024)]["routed_over_bf16"] == pytest.approx(0.27)
    assert rows[("int4-act", 1024)]["routed_over_bf16"] == pytest.approx(0.265)
    fp8 = rows[("fp8", 8192)]
    assert fp8["routed_over_bf16"] == pytest.approx(0.5)
    assert fp8["stream_all_over_bf16"] == pytest.approx(0.5)
    assert fp8["resident_over_bf16"] == pytest.approx(1.04)
    assert rows[("int4", 1024)]["routed_over_bf16"] == pytest.approx(0.26)
    assert fp8["identical"] and fp8["link_fraction"] == 0.98
    assert fp8["accuracy"]["logprob_abs_diff_mean"] == 0.01 and "accuracy" not in rows[
        ("fp8", 1024)]
    assert fp8["link_fraction_after"] == 0.99
    # a streamed read unequal to its resident read fails the summary
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_sweep_result("fp8", 0.5, identical=False)))
    assert quant_summary.main([paths[0], str(bad)]) == 1
    # no bf16 run (a call cut short): the link fractions without the ratios, and a note
    capsys.readouterr()
    assert quant_summary.main([paths[1], "--json", str(out)]) == 0
    assert "no bf16 (plain) result" in capsys.readouterr().err
    alone = {r["tokens"]: r for r in json.loads(out.read_text())["rows"]}
    assert alone[8192]["link_fraction"] == 0.98 and "routed_over_bf16" not in alone[8192]
    assert "resident_over_bf16" not in alone[8192]
    # a bf16 run without one of the lengths: that length's ratios left out, the others kept
    part = json.loads(open(paths[0]).read())
    part["rows"] = [r for r in part["rows"] if r["tokens"] != 8192]
    (tmp_path / "part.json").write_text(json.dumps(part))
    assert quant_summary.main([str(tmp_path / "part.json"), paths[1], "--json", str(out)]) == 0
    some = {r["tokens"]: r for r in json.loads(out.read_text())["rows"] if r["format"] == "fp8"}
    assert "routed_over_bf16" not in some[8192] and some[8192]["link_fraction"] == 0.98
    assert some[1024]["routed_over_bf16"] == pytest.approx(0.5)
    # two runs of one format: refused by name
    with pytest.raises(SystemExit):
        quant_summary.main([paths[0], paths[1], str(bad)])
    assert "two results for expert format 'fp8'" in capsys.readouterr().err


@pytest.mark.slow
def test_grouped_matmul_bench_rows_and_its_band_option(tmp_path, capsys):
    # A tiny layer on the CPU (lax): one row per length; --grid-block-n names the Mosaic
    # kernel's bands, refused by name where the grouped matmul is not that kernel.
    from strata_jax.benchmarks import grouped_matmul_bench

    out = tmp_path / "gmm.json"
    small = ["--tokens", "64", "--hidden", "128", "--intermediate", "128", "--experts", "4",
             "--top-k", "2", "--repeats", "1", "--warmup", "0"]
    assert grouped_matmul_bench.main([*small, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["rows"] == 128 and row["grid_block_n"] is None and row["grouped_ms"] > 0
    assert row["block_k"] is None and row["stages"] is None
    for option in (["--grid-block-n", "2", "8"], ["--block-k", "128"], ["--stages", "3"]):
        with pytest.raises(SystemExit, match="--block-k and --stages need the Mosaic kernel"):
            grouped_matmul_bench.main([*small, *option])
    with pytest.raises(SystemExit):
        grouped_matmul_bench.main([*small, "--block-k", "48"])
    assert "--block-k 48: a power of two" in capsys.readouterr().err


@pytest.mark.slow
def test_chunked_bench_reads_a_hybrid_model(tmp_path):
    # The hybrid preset (Gated DeltaNet + gated attention) through the chunked benchmark: every
    # streamed read equal to the resident read of the same order, across chunks and layer-major.
    from strata_jax.benchmarks import chunked_bench

    out = tmp_path / "hybrid.json"
    rc = chunked_bench.main(["--tiny", "--preset", "qwen3-next-80b-a3b", "--layers", "4",
                             "--parts", "prefill", "--long", "256", "--chunk", "128",
                             "--arms", "routed", "--reps-prefill", "1", "--json", str(out)])
    assert rc == 0
    reads = [r for r in json.loads(out.read_text())["rows"] if r["part"] == "prefill"]
    assert {r["arm"] for r in reads} == {"resident", "routed"} and len(reads) == 6
    assert all(r["identical_to_resident"] is True for r in reads)


PTXAS_OUT = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'delta_rule_walk' for 'sm_90a'
ptxas info    : Function properties for delta_rule_walk
    56 bytes stack frame, 56 bytes spill stores, 60 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 56 bytes cumulative stack size
ptxas info    : Function properties for ut_transform
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 246 registers, used 1 barriers
"""


def test_compile_check_reads_ptxas_and_flags_problems(capsys):
    """compile_check's parts that need no CUDA plugin: ptxas' report per kernel, the target
    description, what fails the check; without the plugin it says what to install."""
    import importlib.util

    from strata_jax.benchmarks import compile_check as cc

    assert cc.parse_ptxas(PTXAS_OUT) == {
        "delta_rule_walk": {"registers": 255, "spill_stores": 56, "spill_loads": 60},
        "ut_transform": {"registers": 246, "spill_stores": 0, "spill_loads": 0}}
    text = cc.target_config("h200")
    assert "core_count: 132" in text and "device_memory_size: 150754820096" in text
    assert "major: 9" in text and 'device_description_str: "NVIDIA H200"' in text
    with pytest.raises(ValueError, match="target 'a100'"):
        cc.target_config("a100")
    kernels = cc.parse_ptxas(PTXAS_OUT)
    rows = [{"ok": False, "error": "x", "products": "bf16", "block": 64, "bv": 32},
            {"ok": True, "default": True, "kernels": kernels, "products": "bf16", "block": 64,
             "bv": 32, "temp_bytes": 1},
            {"ok": True, "default": False, "kernels": kernels, "products": "bf16", "block": 64,
             "bv": 64, "temp_bytes": 1},
            {"ok": True, "mixer": "gated-deltanet (xla)", "kernels": {}, "temp_bytes": 9,
             "plan_bytes": 8},
            {"ok": True, "mixer": "gated-attention", "kernels": {}, "temp_bytes": 8,
             "plan_bytes": 8},
            {"ok": True, "model": "deepseek-v3", "kernels": {}, "temp_bytes": 10,
             "plan_bytes": 9}]
    assert cc.problems(rows) == [
        "delta rule bf16 64/32: does not compile",
        "delta rule bf16 64/32: the default launch spills registers",
        "gated-deltanet (xla): 9 temporary bytes, plan 8",
        "deepseek-v3: 10 temporary bytes, plan 9"]
    with pytest.raises(SystemExit):
        cc.main(["--cases", "delta-rule,nothing"])
    assert "--cases nothing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cc.main(["--preset", "qwen3-30b-a3b"])
    assert "not a hybrid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cc.main(["--mla-preset", "qwen3-next-80b-a3b"])
    assert "not a latent-attention model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cc.main(["--tokens", "4096", "--chunk", "8192"])
    assert "64 <= chunk <= tokens" in capsys.readouterr().err
    if importlib.util.find_spec("jax_plugins") is None:  # no CUDA plugin installed
        assert cc.main(["--cases", "delta-rule"]) == 2
        assert 'pip install "jax[cuda12]' in capsys.readouterr().err


@pytest.mark.slow
def test_hybrid_bench_tiny_times_both_mixers(tmp_path):
    from strata_jax.benchmarks import hybrid_bench

    out = tmp_path / "mixers.json"
    assert hybrid_bench.main(["--tiny", "--tokens", "128", "--chunk", "64", "--reps", "1",
                              "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mixer"] for r in rows[:3]] == ["gated-attention", "gated-deltanet (scan)",
                                              "gated-deltanet (pallas)"]
    assert all(r["over_attention"] > 0 for r in rows[1:3])
    assert rows[3]["deltanet_projections_ms"] > 0  # the layer's matmuls outside the rule
    rules = [(r["products"], r["carry"]) for r in rows if "delta_rule_block" in r]
    assert rules == [("float32", "xla"), ("float32", "pallas")]  # bf16 cases need a GPU
    assert any("ut_transform_block" in r for r in rows)


@pytest.mark.slow
def test_kernel_profile_tiny_traces_every_case(tmp_path):
    from strata_jax.benchmarks import kernel_profile

    out = tmp_path / "profile.json"
    assert kernel_profile.main(["--tiny", "--tokens", "64", "--chunk", "32", "--moe-tokens", "16",
                                "100", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["deltanet first 64", "deltanet 32 over 32",
                                         "attention first 64", "attention 32 over 32",
                                         "moe 16", "moe 100"]
    assert all(r["wall_ms"] > 0 and r["kernels_ms"] >= 0 for r in rows)


FUSED_HLO = """%fused_slice.2 (param_0: bf16[8,4]) -> bf16[8,2] {
  %param_0 = bf16[8,4]{1,0} parameter(0)
  %slice.1 = bf16[8,2]{1,0} slice(%param_0), slice={[0:8], [0:2]}
  %slice.2 = bf16[8,2]{1,0} slice(%param_0), slice={[0:8], [2:4]}
  ROOT %add.3 = bf16[8,2]{1,0} add(%slice.1, %slice.2)
}

ENTRY %main (p: bf16[8,4]) -> bf16[8,2] {
  %p = bf16[8,4]{1,0} parameter(0)
  ROOT %loop_slice_fusion.2 = bf16[8,2]{1,0} fusion(%p), kind=kLoop, calls=%fused_slice.2
}
"""


def test_kernel_profile_names_what_a_fusion_holds():
    from strata_jax.benchmarks.kernel_profile import fusion_summary

    assert fusion_summary(FUSED_HLO, "loop_slice_fusion_2") == \
        "bf16[8,2] <- p; slice x2, add x1"
    assert fusion_summary(FUSED_HLO, "loop_slice_fusion_1") is None
    assert fusion_summary(FUSED_HLO, "cudnn_sdpa_kernel") is None


@pytest.mark.slow
def test_mla_bench_tiny_times_first_and_later_chunks(tmp_path):
    from strata_jax.benchmarks import mla_bench

    out = tmp_path / "mla.json"
    assert mla_bench.main(["--tiny", "--tokens", "256", "--chunk", "64", "--reps", "1",
                           "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["what"] for r in rows[:3]] == ["attention, first chunk",
                                             "attention, later chunk (static start)",
                                             "attention, later chunk (traced start)"]
    assert rows[1]["prefix"] == 192 and rows[-1]["ratio_later_over_first_tflops"] > 0
