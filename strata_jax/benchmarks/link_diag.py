"""Where the streamed arms lose link time: probes beside the engine, timed on the device.

Prints (and writes with --json) the pinned link ceiling for the shapes the ring uses — one
256 MB block; one expert-sized block at a time with an event after each, from cudaHostAlloc
memory and from cudaHostRegister'd malloc memory — then, for each arm, the
engine's own device timing of a chunk: begin-to-end on XLA's stream and first-to-last copy on
the copy stream, so the link rate while copying is separated from time outside the copies.

    python -m strata_jax.benchmarks.link_diag --layers 8 --tokens 1024 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def main(argv=None) -> int:
    from strata_jax.benchmarks.stream_bench import add_model_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--tokens", default="1024")
    ap.add_argument("--arms", default="stream-all,routed")
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from strata_jax import native
    from strata_jax.benchmarks.stream_bench import fast_params, model_config
    from strata_jax.engine import Engine
    from strata_jax.stream import StreamConfig

    lengths = [int(x) for x in args.tokens.split(",")]
    cfg = model_config(args.preset, args.layers, args.vocab, max(lengths))
    blob = cfg.expert_bytes
    out = {"probes": {}, "runs": []}
    layer_bytes = blob * cfg.n_experts
    probes = {
        "alloc_256MB": dict(nbytes=256 * 2**20, host="alloc"),
        "alloc_expert_blocks": dict(nbytes=layer_bytes, host="alloc", block=blob, events=True),
        "register_256MB": dict(nbytes=256 * 2**20, host="register"),
        "register_expert_blocks": dict(nbytes=layer_bytes, host="register", block=blob,
                                       events=True),
    }
    for name, kw in probes.items():
        out["probes"][name] = native.measure_h2d(reps=10, **kw)
        print(f"probe {name}: {out['probes'][name]:.2f} GB/s", flush=True)
    link = out["probes"]["alloc_256MB"]

    params = fast_params(cfg, 0, 0.0)

    def breakdown(eng, tokens) -> dict:
        # One chunk of Engine.prefill, step by step: where the host's time goes.
        import jax

        t = [time.perf_counter()]
        piece = np.asarray(tokens, np.int32)
        mode = eng.streamer.chunk_mode(piece.size)
        call = time.monotonic()
        res = eng._dispatch(piece, piece.size, None, 0, mode=mode, sub=0)
        t.append(time.perf_counter())
        jax.block_until_ready(res)
        ready = time.monotonic()
        t.append(time.perf_counter())
        eng._split_info(res[2])
        t.append(time.perf_counter())
        names = ("dispatch", "ready", "stats")
        out = {f"{n}_ms": (b - a) * 1e3 for n, a, b in zip(names, t, t[1:])}
        begin, end = eng.streamer.host_times()
        out["call_to_begin_ms"] = (begin - call) * 1e3
        out["end_to_ready_ms"] = (ready - end) * 1e3
        return out

    rng = np.random.default_rng(7)
    for arm in args.arms.split(","):
        sc = StreamConfig(routed=(arm == "routed"), depth=args.depth,
                          ring_budget_gib=8.0)
        with Engine(cfg, params, sc, max_context=max(lengths),
                    chunk_size=max(lengths)) as eng:
            for n in lengths:
                eng.prefill(rng.integers(0, cfg.vocab_size, n))  # compile
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    r = eng.prefill(rng.integers(0, cfg.vocab_size, n))
                    wall = (time.perf_counter() - t0) * 1e3
                    chunk_ms, copy_ms, lead_ms, tail_ms = eng.streamer.device_timing()
                    nbytes = r.totals()["bytes"]
                    row = {"arm": arm, "tokens": n, "wall_ms": wall,
                           "chunk_ms": chunk_ms, "copy_ms": copy_ms, "lead_ms": lead_ms,
                           "tail_ms": tail_ms, "bytes": nbytes,
                           "copied": r.totals()["copied"],
                           "link_in_window": nbytes / (copy_ms * 1e-3) / 1e9 / link,
                           "link_over_chunk": nbytes / (chunk_ms * 1e-3) / 1e9 / link,
                           "link_over_wall": nbytes / (wall * 1e-3) / 1e9 / link}
                    bd = breakdown(eng, rng.integers(0, cfg.vocab_size, n))
                    row.update({k: round(v, 2) for k, v in bd.items()})
                    row["breakdown_chunk_ms"] = eng.streamer.device_timing()[0]
                    out["runs"].append(row)
                    print(json.dumps(row), flush=True)
    out["link_ceiling_gbps"] = link
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
