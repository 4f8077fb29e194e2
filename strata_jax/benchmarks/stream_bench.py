"""Streaming benchmark (../shared/BENCHMARK.md): resident, stream-all, routed and pure-JAX arms.

Seven parts, each optional:

  sweep       For each prompt length, one chunk per prompt: the all-resident arm (the compute
              ceiling), the pure-JAX baseline (each MoE layer's experts moved from `pinned_host`
              memory with `jax.device_put` inside the jitted prefill), and stream-all (routed
              switch off) against routed, timed in the order OFF ON ON OFF ON OFF OFF ON with
              pairs (2,1), (3,4), (5,6), (8,7). Every repetition reads a new random prompt (a
              nonce). Rows: time, floor = max(resident time, bytes copied / link ceiling),
              time / floor, effective link GB/s and its fraction of the ceiling, the device's own
              copy-window rate, bytes, copied / skipped / unrouted experts; per length the OFF/ON
              pair ratios, their median and a percentile-bootstrap 95% interval (20,000
              resamples). Logits and KV SHA-256 of every streamed repetition must equal the
              resident arm's for the same prompt.
  two-turn    A conversation: --turn1 tokens, then a follow-up of --turn2 tokens reusing the
              session (reported as reused + read), chunked by --chunk, routed against stream-all.
  layer-major A --long-token prompt read layer-major (sub-chunks of --chunk) against chunk-major
              (chunks of --chunk), routed: bytes copied and time for each.
  publication The stream's per-layer cost with nothing on the link (every expert resident, read
              through the stream: fetch's device copy, the publication and the calls) against
              the resident engine, once per publish mode, and the host callback's stall (the
              difference between the modes), at the first of --lengths tokens.
  floor       Where the stream floor should be: for each of --lengths, the routed switch with
              the default floor (below it, routed-only: wait for each layer's routing, copy only
              its routed experts) against the routed stream forced (stream_floor=1), in the
              sweep's paired order, with time / floor for each.
  accuracy    With --quantize: what the format costs against the plain (bf16) model, both all
              resident, on --accuracy-prompts prompts of each of --lengths: the log-probability
              of every next token (`Engine.score`) and the last position's logits, as the
              mean and largest |difference|, the mean NLL of each, and how often the two
              models' most likely token is the same, at every position (`top1_agreement`)
              and at the last.
  resident-ab With --quantize: the resident compute cost of the format, the plain (bf16) and the
              quantized model both resident in one process, their reads interleaved in the
              sweep's order (plain in stream-all's slots, quantized in routed's), a new prompt
              each slot, after an untimed read of each: per length each arm's median and the
              quantized/plain pair ratios, their median and 95% interval. Drift of the GPU's
              speed between two sweeps (another process, minutes apart) does not enter the
              ratio.

Weights: `SyntheticParams(tile=8)`, made as each engine takes them (no copy of the experts
outside the engines' stores); with accuracy or resident-ab, `common.fast_params` kept whole,
the plain model beside the quantized one.

The link ceiling (pinned H2D, 256 MB, median of 10) is measured in the same run, before the
parts and again after them (`link_pinned_gbps_end`, to show its drift). On the GPU the sweep
probes it again before each length's streamed calls, from a fresh pinned buffer and from each
engine's own store (`link_probes`); that length's rows, the JAX arm's included, are stated
against the highest of those and the first probe (`link_ceiling_gbps`), and the probes are
taken again after the length's calls (`link_probes_after`; each streamed row's
`link_ceiling_after_gbps` and `link_fraction_after`), so a row says whether the link itself
moved under it.

    python -m strata_jax.benchmarks.stream_bench --preset qwen3-30b-a3b --layers 8 \\
        --lengths 950,1024,2048,4096,6144 --parts sweep --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time

import numpy as np

from strata_jax.benchmarks.common import (QUANTIZED_MATMUL, SAME_ARM, PinnedHostBaseline,
                                          _hashes, _nonce_prompts, _pair_ratios, _pairs,
                                          _resident_reference, _stream_config, _timed,
                                          add_model_args, add_stream_args, bootstrap_ci, engine,
                                          fast_params, model_config, quantized, schedule)
from strata_jax.formats import QUANTIZE_CHOICES

def _save(args, result) -> None:
    """Writes `result` to --json (if given): after each part, and inside the sweep after each
    length, so that a run stopped by a timeout keeps what it finished."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def sweep(args, cfg, params, link, result):
    """The sweep part; saves (`_save`) after the resident rows and after each length's
    streamed rows, so that a run stopped by a timeout keeps every length it finished."""
    import jax

    lengths = [int(x) for x in args.lengths.split(",")]
    ctx = max(lengths)
    # A new prompt (nonce) for every measured repetition; the resident arm reads each one too,
    # which gives its time and the hashes every streamed repetition must equal.
    slots = len(schedule(args.blocks))
    prompts = _nonce_prompts(cfg, lengths, 1234, slots)
    t0 = time.perf_counter()
    resident_ms, hashes = _resident_reference(cfg, params, ctx, lengths, prompts, slots)
    for n in lengths:
        result["rows"].append({"part": "sweep", "arm": "resident", "tokens": n,
                               "ms": resident_ms[n], "reps": slots})
        print(f"resident {n}: {resident_ms[n]:.1f} ms (median of {slots})", flush=True)
    print(f"resident arm: {time.perf_counter() - t0:.1f} s with its compiles", flush=True)
    _save(args, result)

    if "jax-pinned-host" in args.arms and jax.devices()[0].platform == "gpu":
        try:
            _baseline(cfg, params, ctx, lengths, prompts, hashes, resident_ms, link, result)
            _save(args, result)
        except Exception as e:  # the baseline is a comparison; its failure must not end the run
            result["rows"].append({"part": "sweep", "arm": "jax-pinned-host",
                                   "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"jax-pinned-host arm failed: {type(e).__name__}: {e}", flush=True)
    if {"stream-all", "routed"} & set(args.arms.split(",")):
        _streamed_arms(args, cfg, params, ctx, lengths, prompts, hashes, resident_ms, link,
                       result)


def _baseline(cfg, params, ctx, lengths, prompts, hashes, resident_ms, link, result):
    from strata_jax.engine import sha256_of

    base = PinnedHostBaseline(cfg, params, ctx)
    nbytes = cfg.expert_bytes * cfg.n_experts * len(cfg.moe_layers)
    for n in lengths:
        base.prefill(prompts[n][-1])  # compile
        times, same = [], []
        for i in range(len(prompts[n]) // 2):  # as many as each engine arm's repetitions
            ms, logits, cache = base.prefill(prompts[n][i])
            times.append(ms)
            same.append((sha256_of(logits), sha256_of(cache)) == hashes[(n, i)])
        ms = statistics.median(times)
        row = {"part": "sweep", "arm": "jax-pinned-host", "tokens": n, "ms": ms,
               "bytes_copied": nbytes, **_against(ms, nbytes, link, resident_ms[n]),
               "identical_to_resident": all(same), "identical_each": same}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    del base


def _streamed_arms(args, cfg, params, ctx, lengths, prompts, hashes, resident_ms, link, result):
    """The sweep's stream-all and routed arms: one engine each, every length compiled just
    before it is timed (`_streamed_length`), the result saved after each length."""
    engines = {}
    try:
        t0 = time.perf_counter()
        for arm, routed in (("stream-all", False), ("routed", True)):
            engines[arm] = engine(cfg, params, _stream_config(args, routed),
                                   max_context=ctx, chunk_size=ctx)
        print(f"streamed engines: {time.perf_counter() - t0:.1f} s", flush=True)
        for n in lengths:
            # Each length compiles just before it is timed, so a run cut short by a timeout has
            # timed (and saved) every length before the one it stopped in.
            t0 = time.perf_counter()
            for arm in engines:
                engines[arm].prefill(prompts[n][-1])  # compile
            print(f"{n}: both arms compiled in {time.perf_counter() - t0:.1f} s", flush=True)
            t0 = time.perf_counter()
            identical = _streamed_length(args, engines, n, prompts[n], hashes, resident_ms[n],
                                         link, result)
            if n == lengths[0]:
                r = engines["routed"].prefill(prompts[n][0])
                result["per_layer_example"] = {"tokens": n, "arm": "routed", **r.per_layer()}
            print(f"{n}: timed in {time.perf_counter() - t0:.1f} s", flush=True)
            result["identical"] = result.get("identical", True) and bool(identical)
            _save(args, result)
    finally:
        for e in engines.values():
            e.close()


def _streamed_length(args, engines, n: int, prompts, hashes, resident: float, link: float,
                     result) -> bool:
    """Times both streamed arms at `n` tokens in `schedule(args.blocks)`'s order, a new prompt
    each slot (on CUDA the link probed before and after: `_ceiling_probes`), and appends a row
    per arm (`_arm_row`) and their pairs' row; whether every read hashed as the resident
    one."""
    cuda = _probes_link(engines)
    ceiling = link
    if cuda:
        probes, errors = _ceiling_probes(engines)
        ceiling = max(link, *probes.values())
        result.setdefault("link_probes", {})[str(n)] = probes
        if errors:
            result.setdefault("link_probe_errors", {})[str(n)] = errors
        print(f"{n}: link probes {json.dumps(probes)}; ceiling {ceiling:.2f} GB/s", flush=True)
        _rebase_rows(result, n, ceiling, resident)
    meas = []
    identical = True
    for i, arm in enumerate(schedule(args.blocks)):
        gc.collect()  # see _gc_note; before `call`, which host_call_to_begin counts from
        call = time.monotonic()
        ms, r = _timed(engines[arm], prompts[i], collect=False)
        same = _hashes(r) == hashes[(n, i)]
        identical &= same
        timing = engines[arm].streamer.device_timing() if len(r.chunks) == 1 else None
        # Host time from the call to begin_chunk's handler, in ms. (On the GPU a handler runs
        # when the host launches its call, not when the device reaches it, so the time after
        # end_chunk's handler covers the device's work: `outside_device_chunk_ms` in the rows
        # is the call's time outside the device chunk instead.)
        begin, _ = engines[arm].streamer.host_times()
        meas.append(_Read(arm, ms, r.totals(), timing, same, r.chunks[0].stats.mode,
                          (begin - call) * 1e3, r.chunks[0].stats.layout,
                          r.chunks[0].stats.tail_pieces, r.chunks[0].stats.tail_shape))
        del r  # see _drop_note
    after = None
    if cuda:  # the ceiling again after the timed calls: how far it moved under them
        probes, _ = _ceiling_probes(engines)
        after = max(probes.values())
        result.setdefault("link_probes_after", {})[str(n)] = probes
    for arm in ("stream-all", "routed"):
        row = _arm_row(arm, n, [m for m in meas if m.arm == arm], ceiling, after, resident)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        print(_brief(row), flush=True)
    ratios, median, ci = _pair_ratios([m.ms for m in meas])
    # Two slots of the same arm side by side in each block: how far one arm moves alone.
    spread = [abs(meas[x].ms / meas[y].ms - 1) for x, y in _pairs(len(meas), SAME_ARM)]
    pair = {"part": "sweep", "arm": "pairs", "tokens": n, "off_over_on": ratios,
            "median": median, "ci95": ci, "same_arm_spread": statistics.median(spread)}
    result["rows"].append(pair)
    print(json.dumps(pair), flush=True)
    return identical


@dataclasses.dataclass(frozen=True)
class _Read:
    """One timed streamed read of the sweep: its arm, wall ms, `PrefillResult.totals()`, the
    streamer's device timing (None: several chunks), whether it hashed as the resident read,
    its chunk's mode, host ms from the call to begin_chunk, ring layout and tail pieces."""

    arm: str
    ms: float
    totals: dict
    timing: tuple | None
    same: bool
    mode: str
    host_to_begin_ms: float
    layout: str
    tail_pieces: int
    tail_shape: str | None


def _arm_row(arm: str, n: int, reads: list, ceiling: float, after: float | None,
             resident: float) -> dict:
    """The sweep row of one streamed arm at `n` tokens from its timed `_Read`s: medians of the
    reads against the link `ceiling` probed before them (and `after` them, where probed) and
    the resident time; with device timing, the device chunk and its copies' window."""
    ms = statistics.median(m.ms for m in reads)
    copied_bytes = statistics.median(m.totals["bytes"] for m in reads)
    row = {"part": "sweep", "arm": arm, "tokens": n, "ms": ms,
           "ms_each": [m.ms for m in reads],
           "mode": reads[0].mode, "layout": reads[0].layout, "tail_pieces": reads[0].tail_pieces,
           "tail_shape": reads[0].tail_shape,
           "bytes_copied": copied_bytes,
           **_against(ms, copied_bytes, ceiling, resident),
           "streamed": reads[0].totals["streamed"],
           "copied": statistics.median(m.totals["copied"] for m in reads),
           "skipped": statistics.median(m.totals["skipped"] for m in reads),
           "unrouted": statistics.median(m.totals["unrouted"] for m in reads),
           "identical_to_resident": all(m.same for m in reads),
           "host_call_to_begin_ms": statistics.median(m.host_to_begin_ms for m in reads),
           "host_call_to_begin_each": [round(m.host_to_begin_ms, 3) for m in reads]}
    if after is not None:
        # The rows' ceiling is the one probed before the calls (BENCHMARK.md); this says
        # whether the link itself moved while they ran.
        row["link_ceiling_after_gbps"] = after
        row["link_fraction_after"] = row["gbps"] / after
    timed = [m for m in reads if m.timing is not None and m.timing[1] > 0]
    if timed:
        chunk, copy, lead, tail = (statistics.median(m.timing[i] for m in timed)
                                   for i in range(4))
        row["device_chunk_ms"] = chunk
        row["device_copy_ms"] = copy
        # Begin to the first copy's start, and the last copy's end to the chunk's end: the
        # pipeline's head and tail (the last layer's math after its last copy).
        row["copy_lead_ms"] = lead
        row["copy_tail_ms"] = tail
        row["copy_window_link_fraction"] = statistics.median(
            m.totals["bytes"] / (m.timing[1] * 1e-3) / 1e9 / ceiling for m in timed)
        row["device_time_over_floor"] = chunk / row["floor_ms"]
        # Host time before and after the device chunk, and device work outside its begin/end
        # events (the last layer's math after end_chunk, the logits).
        row["outside_device_chunk_ms"] = statistics.median(m.ms - m.timing[0] for m in timed)
        row["device_chunk_each"] = [round(m.timing[0], 3) for m in timed]
    if row["unrouted"]:
        row["skipped_of_unrouted"] = row["skipped"] / row["unrouted"]
    return row


def _brief(row: dict) -> str:
    """One short line for a streamed sweep row (its JSON line is too long to read in a log's
    tail): time, time over floor, link fraction (and after), time after the last copy,
    identity with the resident read."""
    def f(key, fmt="{:.4f}"):
        v = row.get(key)
        return "-" if v is None else fmt.format(v)
    return (f"{row['tokens']} {row['arm']}: {row['ms']:.2f} ms, x floor {f('time_over_floor')}, "
            f"link {f('link_fraction')} (after {f('link_fraction_after')}), after the last "
            f"copy {f('copy_tail_ms', '{:.3f}')} ms, identical {row['identical_to_resident']}")


def _probes_link(engines) -> bool:
    """Whether the sweep probes the link around each length (a CUDA stream: the CPU backend's
    simulated link has the configured rate)."""
    return engines["stream-all"].streamer.backend == "cuda"


def _ceiling_probes(engines) -> dict:
    """The link ceiling probed again just before a length's timed calls (BENCHMARK.md: 256 MB,
    median of 10): a fresh pinned buffer, and each engine's own store (`measure_link`, the
    pages its ring reads). The rows take the highest of these and the run's first probe: the
    walk's copies have read above a fresh buffer's probe in the same call (sixth session)."""
    from strata_jax import native

    probes, errors = {"fresh": native.measure_h2d(256 * 2**20, 10)}, {}
    for arm, eng in engines.items():
        try:  # an engine whose arena fell back to registering or staging has no store probe
            probes[f"store_{arm}"] = eng.streamer.measure_link(256 * 2**20, 10)
        except RuntimeError as e:
            errors[f"store_{arm}"] = str(e)
    return probes, errors


def _rebase_rows(result, n: int, ceiling: float, resident: float) -> None:
    """Restates the rows of length `n` already written (the JAX arm's, measured before the
    engines existed) against the length's ceiling, so every arm of a length has one."""
    for row in result["rows"]:
        if row.get("part") != "sweep" or row.get("tokens") != n or "bytes_copied" not in row:
            continue
        row.update(_against(row["ms"], row["bytes_copied"], ceiling, resident))


def _against(ms: float, nbytes: float, ceiling: float, resident: float) -> dict:
    """A sweep row's figures against a link ceiling (GB/s): the effective rate and its fraction
    of the ceiling, the floor max(resident time, bytes / ceiling) and time / floor."""
    gbps = nbytes / (ms * 1e-3) / 1e9
    floor = max(resident, nbytes / (ceiling * 1e9) * 1e3)
    return {"link_ceiling_gbps": ceiling, "gbps": gbps, "link_fraction": gbps / ceiling,
            "floor_ms": floor, "time_over_floor": ms / floor}


def two_turn(args, cfg, params, link, result):
    rng = np.random.default_rng(99)
    t1, t2 = args.turn1, args.turn2
    ctx = t1 + t2
    hashes = {}
    first = [rng.integers(0, cfg.vocab_size, t1) for _ in range(args.turn_reps + 1)]
    second = [rng.integers(0, cfg.vocab_size, t2) for _ in range(args.turn_reps + 1)]
    for arm, sc in (("resident", None),
                    ("stream-all", _stream_config(args, False)),
                    ("routed", _stream_config(args, True))):
        with engine(cfg, params, sc, max_context=ctx, chunk_size=args.chunk) as eng:
            r = eng.prefill(first[0])
            eng.prefill(second[0], r.session)  # compile both kinds
            rows = []
            for i in range(args.turn_reps):
                r1 = eng.prefill(first[0])
                ms, r2 = _timed(eng, second[i + 1], r1.session)
                rows.append((ms, r2))
            ms = statistics.median(m for m, _ in rows)
            r2 = rows[0][1]
            tot = r2.totals()
            row = {"part": "two-turn", "arm": arm, "turn1": t1, "turn2": t2, "ms": ms,
                   "reused": r2.reused, "read": r2.read, "chunks": len(r2.chunks),
                   "bytes_copied": tot["bytes"], "streamed": tot["streamed"],
                   "copied": tot["copied"], "skipped": tot["skipped"],
                   "unrouted": tot["unrouted"], "summary": r2.summary()}
            hashes[arm] = _hashes(rows[0][1])
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    res_ms = next(r["ms"] for r in result["rows"] if r.get("part") == "two-turn"
                  and r["arm"] == "resident")
    for r in result["rows"]:
        if r.get("part") == "two-turn" and r["arm"] != "resident":
            r["floor_ms"] = max(res_ms, r["bytes_copied"] / (link * 1e9) * 1e3)
            r["time_over_floor"] = r["ms"] / r["floor_ms"]
    same = len(set(hashes.values())) == 1
    result["two_turn_identical"] = same
    result["identical"] = result.get("identical", True) and same


def layer_major(args, cfg, params, link, result):
    rng = np.random.default_rng(7)
    n = args.long
    prompts = [rng.integers(0, cfg.vocab_size, n) for _ in range(3)]
    for routed in (True, False):
        arm = "routed" if routed else "stream-all"
        sc = _stream_config(args, routed)
        with engine(cfg, params, sc, max_context=n, chunk_size=args.chunk,
                     sub_chunk=args.chunk) as eng:
            out = {}
            for order in ("chunk-major", "layer-major"):
                eng.prefill(prompts[0], order=order)  # compile
                times, rs = [], []
                for p in prompts[1:]:
                    ms, r = _timed(eng, p, order=order)
                    times.append(ms)
                    rs.append(r)
                tot = rs[0].totals()
                row = {"part": "layer-major", "arm": arm, "order": rs[0].order,
                       "fallback": rs[0].fallback, "tokens": n, "chunk": args.chunk,
                       "ms": statistics.median(times), "bytes_copied": tot["bytes"],
                       "copied": tot["copied"], "skipped": tot["skipped"],
                       "streamed": tot["streamed"], "chunks": len(rs[0].chunks),
                       "link_fraction": tot["bytes"] / (statistics.median(times) * 1e-3) / 1e9
                       / link}
                out[order] = rs[0]
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            a = np.asarray(out["chunk-major"].logits, np.float32)
            b = np.asarray(out["layer-major"].logits, np.float32)
            result.setdefault("layer_major_logit_diff", {})[arm] = {
                "max_abs": float(np.max(np.abs(a - b))),
                "max_abs_ref": float(np.max(np.abs(a)))}


def accuracy_part(args, plain, quantized_model, result):
    """The quantized model against the plain one (`plain`, `quantized_model`: (config,
    params)), each resident, on the same prompts: one row per length."""
    lengths = [int(x) for x in args.lengths.split(",")]
    ctx = max(lengths)
    prompts = _nonce_prompts(plain[0], lengths, 99, args.accuracy_prompts - 1)
    got = {}
    for name, (cfg, params) in (("plain", plain), ("quantized", quantized_model)):
        with engine(cfg, params, None, max_context=ctx, chunk_size=ctx) as eng:
            for n in lengths:
                for i, p in enumerate(prompts[n]):
                    r = eng.score(p)
                    got[(name, n, i)] = (np.asarray(r.logits, np.float64),
                                         np.asarray(r.logprobs, np.float64), r.top1)
                    del r
    for n in lengths:
        keys = range(len(prompts[n]))
        logits = [(got[("plain", n, i)][0], got[("quantized", n, i)][0]) for i in keys]
        lps = [(got[("plain", n, i)][1], got[("quantized", n, i)][1]) for i in keys]
        same_top1 = np.concatenate([got[("plain", n, i)][2] == got[("quantized", n, i)][2]
                                    for i in keys])
        dlogit = np.concatenate([np.abs(a - b).ravel() for a, b in logits])
        dlp = np.concatenate([np.abs(a - b) for a, b in lps])
        finite = all(np.isfinite(a).all() and np.isfinite(b).all() for a, b in logits + lps)
        row = {"part": "accuracy", "tokens": n, "prompts": len(prompts[n]), "finite": finite,
               "logprob_abs_diff_mean": float(dlp.mean()),
               "logprob_abs_diff_max": float(dlp.max()),
               "nll_plain": float(-np.mean([a.mean() for a, _ in lps])),
               "nll_quantized": float(-np.mean([b.mean() for _, b in lps])),
               "last_logit_abs_diff_mean": float(dlogit.mean()),
               "last_logit_abs_diff_max": float(dlogit.max()),
               "top1_agreement": float(same_top1.mean()),
               "last_top1_agreement": float(np.mean([a.argmax() == b.argmax()
                                                     for a, b in logits]))}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)


def resident_ab(args, plain, quantized_model, result):
    """The resident-ab part: the quantized model's resident reads against the plain one's,
    interleaved (`schedule`'s order, `_pairs`), one row per length."""
    lengths = [int(x) for x in args.lengths.split(",")]
    ctx = max(lengths)
    arm_of = {"stream-all": "plain", "routed": "quantized"}
    arms = [arm_of[slot] for slot in schedule(args.blocks)]
    slots = len(arms)
    prompts = _nonce_prompts(plain[0], lengths, 4321, slots)
    engines = {}
    try:
        for name, (cfg, params) in (("plain", plain), ("quantized", quantized_model)):
            engines[name] = engine(cfg, params, None, max_context=ctx, chunk_size=ctx)
        for n in lengths:
            for _ in range(2):  # compile, then one read each before the timed ones
                for eng in engines.values():
                    eng.prefill(prompts[n][-1])
            times = []
            for i, arm in enumerate(arms):
                ms, r = _timed(engines[arm], prompts[n][i])
                del r  # see _drop_note
                times.append(ms)
            # each pair's quantized (ON slot) over plain (OFF slot) time
            ratios = [times[on] / times[off] for on, off in _pairs(len(times))]
            plain_ms, quant_ms = (statistics.median(t for t, a in zip(times, arms) if a == arm)
                                  for arm in ("plain", "quantized"))
            row = {"part": "resident-ab", "tokens": n, "reps": slots // 2,
                   "plain_ms": plain_ms, "quantized_ms": quant_ms,
                   "quantized_over_plain": quant_ms / plain_ms,
                   "pair_ratios": ratios, "pair_ratio_median": statistics.median(ratios),
                   "pair_ratio_ci95": list(bootstrap_ci(ratios)), "times_ms": times}
            result["rows"].append(row)
            print(f"resident-ab {n}: plain {plain_ms:.2f} ms, {args.quantize} {quant_ms:.2f} ms "
                  f"({quant_ms / plain_ms:.4f}); pair ratios median "
                  f"{row['pair_ratio_median']:.4f}, mean's 95% "
                  f"[{row['pair_ratio_ci95'][0]:.4f}, {row['pair_ratio_ci95'][1]:.4f}]",
                  flush=True)
            _save(args, result)
    finally:
        for e in engines.values():
            e.close()


def floor_part(args, cfg, params, link, result):
    lengths = [int(x) for x in args.lengths.split(",")]
    ctx = max(lengths)
    slots = len(schedule(args.blocks))
    prompts = _nonce_prompts(cfg, lengths, 4321, slots)
    resident_ms, hashes = _resident_reference(cfg, params, ctx, lengths, prompts, slots)
    # ORDER's "stream-all" slots run the default floor, its "routed" slots the forced stream.
    arms = {"stream-all": "default-floor", "routed": "forced-stream"}
    engines = {
        "default-floor": engine(cfg, params, _stream_config(args, True),
                                 max_context=ctx, chunk_size=ctx),
        "forced-stream": engine(cfg, params, _stream_config(args, True, stream_floor=1),
                                 max_context=ctx, chunk_size=ctx)}
    identical = True
    try:
        for n in lengths:
            for eng in engines.values():
                eng.prefill(prompts[n][-1])
            meas = []
            for i, slot in enumerate(schedule(args.blocks)):
                arm = arms[slot]
                ms, r = _timed(engines[arm], prompts[n][i])
                identical &= _hashes(r) == hashes[(n, i)]
                meas.append((arm, ms, r.totals(), r.chunks[0].stats.mode))
                del r  # see _drop_note
            for arm in engines:
                rows = [m for m in meas if m[0] == arm]
                ms = statistics.median(m[1] for m in rows)
                copied = statistics.median(m[2]["bytes"] for m in rows)
                floor = max(resident_ms[n], copied / (link * 1e9) * 1e3)
                row = {"part": "floor", "arm": arm, "tokens": n, "mode": rows[0][3], "ms": ms,
                       "resident_ms": resident_ms[n], "bytes_copied": copied, "floor_ms": floor,
                       "time_over_floor": ms / floor}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            ratios, median, ci = _pair_ratios([m[1] for m in meas])
            row = {"part": "floor", "arm": "pairs", "tokens": n,
                   "default_over_forced": ratios, "median": median, "ci95": ci}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        for eng in engines.values():
            eng.close()
    result["floor_identical"] = bool(identical)
    result["identical"] = result.get("identical", True) and bool(identical)


def publication(args, cfg, params, link, result):
    """Per-layer cost of the stream's publish + fetch with nothing crossing the link: every
    expert resident, read through the stream, against the plain resident engine, once per
    publish mode. Fetch then copies each layer's experts device-to-device (split into the gate,
    up and down planes) besides the publication (counts to the host, then the host callback or
    the event) and the calls' own cost. The callback's stall of the device is the difference
    between the two modes. (An XLA split of the same bytes timed on its own, by wall clock
    around its dispatch, was subtracted here once; fetch's split kernel is faster than that
    figure, so it is no longer reported.)"""
    from strata_jax.stream import StreamConfig, StreamTuning

    n = int(args.lengths.split(",")[0])
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, cfg.vocab_size, n) for _ in range(args.turn_reps + 1)]
    arms = [("resident", None)] + [
        (f"all-resident-through-stream/{mode}",
         StreamConfig(resident_per_layer=cfg.n_experts, tuning=StreamTuning(publish=mode)))
        for mode in ("callback", "event")]
    times = {}
    # Interleaved, so a drift of the machine's clocks lands on every arm alike.
    engines = {arm: engine(cfg, params, sc, max_context=n, chunk_size=n) for arm, sc in arms}
    try:
        for eng in engines.values():
            eng.prefill(prompts[-1])
        reps = {arm: [] for arm in engines}
        for p in prompts[:-1]:
            for arm, eng in engines.items():
                reps[arm].append(_timed(eng, p)[0])
        times = {arm: statistics.median(r) for arm, r in reps.items()}
    finally:
        for eng in engines.values():
            eng.close()
    n_moe = len(cfg.moe_layers)
    per_mode = {}
    for arm, _ in arms[1:]:
        mode = arm.split("/")[1]
        per_layer_us = (times[arm] - times["resident"]) / n_moe * 1e3
        row = {"part": "publication", "arm": arm, "publish": mode, "tokens": n,
               "resident_ms": times["resident"], "through_stream_ms": times[arm],
               "per_layer_us": per_layer_us}
        per_mode[mode] = per_layer_us
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    row = {"part": "publication", "arm": "callback-stall", "tokens": n,
           "stall_us_per_layer": per_mode["callback"] - per_mode["event"]}
    result["rows"].append(row)
    print(json.dumps(row), flush=True)




def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--tiny", action="store_true", help="scaled-down widths (CPU smoke run)")
    ap.add_argument("--parts", default="sweep",
                    help="comma list of sweep,two-turn,layer-major,publication,floor,accuracy,"
                         "resident-ab (accuracy, resident-ab: with --quantize)")
    ap.add_argument("--arms", default="resident,stream-all,routed,jax-pinned-host")
    ap.add_argument("--lengths", default="950,1024,2048,4096,6144")
    ap.add_argument("--skew", type=float, default=0.0)
    ap.add_argument("--blocks", type=int, default=2,
                    help="the sweep's and floor's ORDER of 8 slots run this many times over "
                         "(4 repetitions per arm and 4 pairs per block)")
    add_stream_args(ap)
    ap.add_argument("--chunk", type=int, default=8192, help="chunk for two-turn and layer-major")
    ap.add_argument("--turn1", type=int, default=18700)
    ap.add_argument("--turn2", type=int, default=1800)
    ap.add_argument("--turn-reps", type=int, default=3)
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--quantize", choices=list(QUANTIZE_CHOICES), default=None,
                    help="the experts in this format (stored, streamed and read quantized)")
    ap.add_argument("--quantized-matmul", choices=["auto", "fused", "dequantize"], default="auto",
                    help="how quantized experts are read (Kernels.quantized_matmul)")
    ap.add_argument("--accuracy-prompts", type=int, default=2,
                    help="the accuracy part's prompts per length")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    QUANTIZED_MATMUL["impl"] = args.quantized_matmul
    if args.blocks < 1:
        ap.error(f"--blocks {args.blocks}: must be at least 1")

    import jax

    from strata_jax import native
    from strata_jax.formats import ExpertFormat
    from strata_jax.kernels.quantized import resolve_format

    parts = args.parts.split(",")
    unknown = set(parts) - {"sweep", "two-turn", "layer-major", "publication", "floor",
                            "accuracy", "resident-ab"}
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}")
    for part in ("accuracy", "resident-ab"):
        if part in parts and args.quantize is None:
            ap.error(f"--parts {part} compares a --quantize format with the plain model: give "
                     "--quantize")
    if args.accuracy_prompts < 1:
        ap.error(f"--accuracy-prompts {args.accuracy_prompts}: must be at least 1")
    lengths = [int(x) for x in args.lengths.split(",")]
    longest = max(lengths + [args.turn1 + args.turn2, args.long])
    cfg = model_config(args.preset, args.layers, args.vocab, longest, tiny=args.tiny,
                       quantize=args.quantize)
    gpu = jax.devices()[0].platform == "gpu"
    if gpu:
        link = native.measure_h2d(256 * 2**20, 10)
        pageable = native.measure_h2d(256 * 2**20, 5, pinned=False)
    else:
        link, pageable = 2.0, float("nan")  # the CPU backend's default simulated link, GB/s
    print(f"link ceiling: pinned {link:.2f} GB/s, pageable {pageable:.2f} GB/s", flush=True)
    t0 = time.perf_counter()
    if {"accuracy", "resident-ab"} & set(parts):  # the plain model beside the quantized one
        params = fast_params(cfg, 0, args.skew)
    else:  # nothing drawn here: each engine draws the experts into its store or the device
        from strata_jax.synthetic import SyntheticParams

        params = SyntheticParams(cfg, 0, args.skew, tile=8)
    plain = (cfg, params)
    cfg, params = quantized(cfg, params, args.quantize, tile=8)  # 8 experts' draws repeated
    print(f"params in {time.perf_counter() - t0:.1f}s; experts "
          f"{cfg.expert_bytes * cfg.n_experts * len(cfg.moe_layers) / 1e9:.2f} GB", flush=True)
    tuning = _stream_config(args, routed=False).tuning  # with StreamTuning's defaults filled in
    result = {"machine": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "preset": args.preset, "layers": args.layers, "skew": args.skew,
              "blocks": args.blocks, "depth": args.depth, "publish": tuning.publish,
              "layout": tuning.layout, "frames_from": tuning.frames_from,
              "tail_pieces": tuning.tail_pieces, "tail_shape": tuning.tail_shape,
              "tail_from": tuning.tail_from, "stream_floor": tuning.stream_floor,
              "link_pinned_gbps": link,
              "link_pageable_gbps": pageable,
              "expert_bytes": cfg.expert_bytes, "n_experts": cfg.n_experts, "top_k": cfg.top_k,
              "expert_format": cfg.expert_format, "expert_block": cfg.expert_block,
              "expert_zero_points": bool(cfg.expert_zero_points),
              "expert_act_order": bool(cfg.expert_act_order),
              # the kernel the experts are read with here (None: a plain format)
              "quantized_matmul": resolve_format(args.quantized_matmul, ExpertFormat.of(cfg)),
              "argv": sys.argv[1:] if argv is None else list(argv), "rows": []}
    for part, fn in (("sweep", sweep), ("two-turn", two_turn), ("layer-major", layer_major),
                     ("publication", publication), ("floor", floor_part)):
        if part in parts:
            fn(args, cfg, params, link, result)
            _save(args, result)  # keep what finished if a later part runs out of time
    if "accuracy" in parts:
        accuracy_part(args, plain, (cfg, params), result)
        _save(args, result)
    if "resident-ab" in parts:
        resident_ab(args, plain, (cfg, params), result)
    if gpu:  # the ceiling drifts: its value at the end says how far the rows' ceiling held
        result["link_pinned_gbps_end"] = native.measure_h2d(256 * 2**20, 10)
        print(f"link ceiling at the end: pinned {result['link_pinned_gbps_end']:.2f} GB/s")
        _save(args, result)
    print(f"identity across arms: {result.get('identical', True)}")
    return 0 if result.get("identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())
