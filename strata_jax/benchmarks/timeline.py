"""Where a prefill's wall time goes: one traced prefill per arm, read back from the profiler.

Each arm (resident, stream-all, routed) prefills a warm-up prompt, then one new prompt under
`jax.profiler.trace` (once with the Python tracer, which names the Python frames, and once
without, which is the timing to believe). The trace (XSpace) is read back with jaxlib's
ProfileData and reduced to:

  * the prefill call on the Python thread: call -> return, and its longest Python frames;
  * per device stream (XLA's compute stream, the engine's copy stream): first start, last end,
    busy time, events, and the gaps of more than --gap-us on the compute stream;
  * the compute stream's events after the copy stream's last copy ends (the chunk's tail);
  * wall time split into host time before the first device event, device span, and host time
    after the last device event.

`--between hash-hold` reproduces what stream_bench's sweep did between calls (a result hashed
and held through the next call), to compare with back-to-back calls; `hash-hold-gc` adds the
gc.collect() the sweep now makes before each timed call (stream_bench's _gc_note). Raw events
of the untraced-Python run (events_<arm>.json.gz: [plane, line, name, start ns, duration ns]
each) and of the Python-traced one (events_<arm>_python.json.gz) are written for later
reading.

    python -m strata_jax.benchmarks.timeline --tokens 1024 --out out/timeline
"""

from __future__ import annotations

import argparse
import gc
import glob
import gzip
import json
import os
import sys
import tempfile
import time

import numpy as np

from strata_jax.formats import QUANTIZE_CHOICES


MARK = "strata_timeline_call"  # the traced call's own span on the host


def _events(path: str) -> list[tuple[str, str, str, int, int]]:
    """(plane, line, name, start_ns, duration_ns) of every event in an xplane.pb."""
    from jax._src.lib import _profile_data

    data = _profile_data.ProfileData.from_file(path)
    out = []
    for plane in data.planes:
        for line in plane.lines:
            for e in line.events:
                out.append((plane.name, line.name, e.name, int(e.start_ns),
                            int(e.duration_ns)))
    return out


def _trace_one(fn, python: bool) -> tuple[float, list]:
    """Runs fn() under the profiler; (wall ms of fn, events)."""
    import jax

    opts = None
    if not python and hasattr(jax.profiler, "ProfileOptions"):
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
    kw = {"profiler_options": opts} if opts is not None else {}
    # The profiler's folder is read back here and removed: what is kept goes to --out.
    with tempfile.TemporaryDirectory(prefix="strata-trace-") as d:
        with jax.profiler.trace(d, **kw):
            t0 = time.perf_counter()
            with jax.profiler.TraceAnnotation(MARK):
                # Held past the mark: freeing the result (its device buffers) is not the
                # call's time.
                result = fn()
            ms = (time.perf_counter() - t0) * 1e3
        del result
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            raise RuntimeError("the profiler wrote no xplane.pb")
        return ms, _events(files[0])


def summarize(events, gap_us: float = 100.0, tail_ms: float = 8.0) -> dict:
    """The reduction described in the module docstring, from (plane, line, name, start, dur)."""
    mark = [e for e in events if e[0] == "/host:CPU" and e[2] == MARK]
    # The calling thread's line carries the mark; its name is the process's ("python3", ...).
    caller = mark[0][1] if mark else "python"
    py = [e for e in events if e[0] == "/host:CPU" and e[1] == caller]
    if mark:
        c0, c1 = mark[0][3], mark[0][3] + mark[0][4]
    else:
        c0 = min(e[3] for e in events)
        c1 = max(e[3] + e[4] for e in events)
    dev = [e for e in events if e[0].startswith("/device:") and e[4] >= 0
           and c0 - 1e6 <= e[3] <= c1 + 1e6]
    out = {"call_ms": (c1 - c0) / 1e6, "streams": {}}
    if dev:
        d0 = min(e[3] for e in dev)
        d1 = max(e[3] + e[4] for e in dev)
        out.update(host_before_device_ms=(d0 - c0) / 1e6, device_span_ms=(d1 - d0) / 1e6,
                   host_after_device_ms=(c1 - d1) / 1e6)
    lines: dict = {}
    for e in dev:
        lines.setdefault((e[0], e[1]), []).append(e)
    copy_end = None
    for (plane, line), evs in sorted(lines.items()):
        evs.sort(key=lambda e: e[3])
        busy, last_end, gaps = 0, None, []
        for e in evs:
            s, t = e[3], e[3] + e[4]
            if last_end is not None and s - last_end > gap_us * 1e3:
                gaps.append({"after": prev_name, "before": e[2],
                             "at_ms": (last_end - c0) / 1e6, "gap_us": (s - last_end) / 1e3})
            lo = max(s, last_end) if last_end is not None else s
            busy += max(0, t - lo)
            last_end = t if last_end is None else max(last_end, t)
            prev_name = e[2]
        hd = sum(1 for e in evs if "HtoD" in e[2] or "H2D" in e[2] or "MemcpyH2D" in e[2])
        if hd > len(evs) // 2:
            copy_end = max(copy_end or 0, last_end)
        out["streams"][f"{plane} {line}"] = {
            "events": len(evs), "first_ms": (evs[0][3] - c0) / 1e6,
            "last_end_ms": (last_end - c0) / 1e6, "busy_ms": busy / 1e6,
            "h2d_events": hd, "gaps": sorted(gaps, key=lambda g: -g["gap_us"])[:25]}
    if copy_end is not None:
        out["last_copy_end_ms"] = (copy_end - c0) / 1e6
        tail = sorted((e for e in dev if e[3] + e[4] > copy_end and "HtoD" not in e[2]),
                      key=lambda e: e[3])
        out["tail"] = [{"name": e[2][:120], "line": e[1], "start_ms": (e[3] - c0) / 1e6,
                        "us": e[4] / 1e3} for e in tail[:400]]
    frames: dict = {}
    for e in py:
        if c0 <= e[3] <= c1:
            frames[e[2]] = frames.get(e[2], 0) + e[4]
    out["python_frames_ms"] = sorted(((k[:140], v / 1e6) for k, v in frames.items()),
                                     key=lambda kv: -kv[1])[:40]
    host_lines: dict = {}
    for e in events:
        if e[0] == "/host:CPU" and c0 <= e[3] <= c1 and e[1] != caller:
            host_lines.setdefault(e[1], []).append(e)
    out["host_threads"] = {
        name: {"events": len(evs),
               "longest": sorted(((x[2][:100], (x[3] - c0) / 1e6, x[4] / 1e3) for x in evs),
                                 key=lambda t: -t[2])[:12]}
        for name, evs in host_lines.items()}
    return out


def main(argv=None) -> int:
    from strata_jax.benchmarks.common import add_model_args, add_stream_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=None,
                    help="chunk size (default --tokens: one chunk); smaller traces a prompt of "
                         "several chunks, each dispatched while the one before runs")
    ap.add_argument("--arms", default="resident,stream-all,routed")
    add_stream_args(ap)
    ap.add_argument("--gap-us", type=float, default=100.0)
    ap.add_argument("--between", default="none",
                    choices=["none", "hash", "hash-hold", "hash-hold-gc"],
                    help="before each traced call: prefill and hash a result (hash), keep it "
                         "alive through the call (hash-hold), then gc.collect() before the "
                         "call, as stream_bench's timed calls do (hash-hold-gc)")
    ap.add_argument("--tiny", action="store_true", help="scaled-down widths (CPU smoke run)")
    ap.add_argument("--quantize", choices=list(QUANTIZE_CHOICES), default=None,
                    help="the experts in this format (stored, streamed and read quantized)")
    ap.add_argument("--out", required=True, help="folder for summary.json and raw events")
    args = ap.parse_args(argv)
    if args.chunk is not None and not 0 < args.chunk <= args.tokens:
        ap.error(f"--chunk {args.chunk}: must be in 1..--tokens ({args.tokens})")

    from strata_jax.benchmarks.common import (
        _hashes, _stream_config, fast_params, model_config, quantized
    )
    from strata_jax.engine import Engine
    from strata_jax.kernels.grouped import resolve_implementation

    arms = args.arms.split(",")
    unknown = set(arms) - {"resident", "stream-all", "routed"}
    if unknown:
        ap.error(f"unknown arms {sorted(unknown)}")
    os.makedirs(args.out, exist_ok=True)
    cfg = model_config(args.preset, args.layers, args.vocab, args.tokens, tiny=args.tiny,
                       quantize=args.quantize)
    cfg, params = quantized(cfg, fast_params(cfg, 0, 0.0), args.quantize)
    rng = np.random.default_rng(1)
    summary = {"tokens": args.tokens, "chunk": args.chunk or args.tokens,
               "preset": args.preset, "layers": args.layers,
               "between": args.between, "expert_format": cfg.expert_format,
               "grouped_matmul": resolve_implementation(), "arms": {}}
    for arm in arms:
        stream = None if arm == "resident" else _stream_config(args, arm == "routed")
        with Engine(cfg, params, stream, max_context=args.tokens,
                    chunk_size=args.chunk or args.tokens) as eng:
            t0 = time.perf_counter()
            eng.prefill(rng.integers(0, cfg.vocab_size, args.tokens))
            first_s = time.perf_counter() - t0  # compile and first run
            eng.prefill(rng.integers(0, cfg.vocab_size, args.tokens), sync_chunks=False)
            print(f"{arm}: first prefill (compile) {first_s:.1f} s", flush=True)
            res = {"first_prefill_s": first_s}
            for python in (True, False):
                prompt = rng.integers(0, cfg.vocab_size, args.tokens)
                held = None
                if args.between != "none":
                    prev = eng.prefill(rng.integers(0, cfg.vocab_size, args.tokens),
                                       sync_chunks=False)
                    _hashes(prev)
                    held = prev if args.between.startswith("hash-hold") else None
                    del prev
                    if args.between == "hash-hold-gc":
                        gc.collect()  # jaxlib frees the hash's host copies here (_gc_note)
                ms, events = _trace_one(lambda: eng.prefill(prompt, sync_chunks=False), python)
                del held
                s = summarize(events, args.gap_us)
                s["wall_ms"] = ms
                if eng.streamer is not None:
                    # The last chunk's; None where the backend has none.
                    timing = eng.streamer.device_timing()
                    s["engine_device_timing"] = list(timing) if timing else None
                res["python_traced" if python else "plain"] = s
                # Both runs' raw events: the traced one has the Python frames in time order.
                name = f"events_{arm}.json.gz" if not python else f"events_{arm}_python.json.gz"
                with gzip.open(os.path.join(args.out, name), "wt") as f:
                    json.dump([e for e in events if e[0] != "/host:metadata"], f)
            summary["arms"][arm] = res
            p = res["plain"]
            with open(os.path.join(args.out, "summary.json"), "w") as f:
                # What finished, if a later arm runs out of time.
                json.dump(summary, f, indent=1)
            print(f"{arm}: wall {p['wall_ms']:.2f} ms; host before device "
                  f"{p.get('host_before_device_ms', float('nan')):.3f}, device span "
                  f"{p.get('device_span_ms', float('nan')):.3f}, host after device "
                  f"{p.get('host_after_device_ms', float('nan')):.3f}; last copy end "
                  f"{p.get('last_copy_end_ms', float('nan')):.3f}", flush=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
