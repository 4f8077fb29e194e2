"""Streaming benchmark (../shared/BENCHMARK.md): resident, stream-all and routed arms.

For each prompt length, reads a prompt of unique random tokens (a new nonce
each repetition) as one chunk and reports, per arm: median time, bytes copied,
effective link GB/s, the floor max(resident time, bytes / link ceiling) and
time / floor, plus the routed arm's skipped and unrouted experts. The link
ceiling (pinned H2D, 256 MB, median of 10) is measured in the same run.
Stream-all and routed are timed in the order OFF ON ON OFF per length; the
pair ratios (OFF/ON) and their median are reported. Logits and KV hashes of
every arm must equal the resident arm's.

    python -m strata_jax.benchmarks.stream_bench --preset qwen3-30b-a3b --layers 8 \
        --lengths 1024,2048,4096,8192 --skew 0 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def fast_params(config, seed: int, skew: float) -> dict:
    """Synthetic weights quickly at full expert shapes: experts tile a few random blocks."""
    from strata_jax.model import param_shapes
    from strata_jax.synthetic import _router

    rng = np.random.default_rng(seed)
    out = {}
    for name, spec in param_shapes(config).items():
        shape, leaf = tuple(spec.shape), name.rsplit(".", 1)[-1]
        if leaf == "router":
            v = _router(config, skew, rng)
        elif leaf == "weight":
            v = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        elif leaf == "selection_bias":
            v = np.zeros(shape, np.float32)
        elif leaf in ("gate", "up", "down") and ".mlp." in name and len(shape) == 3:
            base = (rng.standard_normal((8,) + shape[1:], dtype=np.float32)
                    / np.sqrt(shape[1])).astype(spec.dtype)
            v = np.tile(base, (shape[0] // 8 + 1, 1, 1))[: shape[0]]
        else:
            v = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(max(shape[0], 1))
        out[name] = np.ascontiguousarray(np.asarray(v).astype(spec.dtype))
    return out


def model_config(preset: str, layers: int, vocab: int, max_tokens: int):
    """The preset cut to `layers` layers and a `vocab` vocabulary, full expert shapes."""
    from strata_jax.config import get_preset

    base = get_preset(preset)
    return base.replace(name=f"{base.name}-{layers}L", n_layers=layers,
                        n_dense_layers=min(base.n_dense_layers, layers - 1),
                        vocab_size=vocab, max_seq_len=max(base.max_seq_len, max_tokens))


def _time(engine, tokens) -> tuple[float, object]:
    t0 = time.perf_counter()
    r = engine.prefill(tokens, sync_chunks=False)
    return (time.perf_counter() - t0) * 1e3, r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--skew", type=float, default=0.0)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3, help="resident repetitions")
    ap.add_argument("--json", default=None)
    ap.add_argument("--publication", action="store_true",
                    help="also measure the per-layer cost of publish+fetch with nothing streamed")
    args = ap.parse_args(argv)

    import jax

    from strata_jax import native
    from strata_jax.engine import Engine, sha256_of
    from strata_jax.stream import StreamConfig

    lengths = [int(x) for x in args.lengths.split(",")]
    cfg = model_config(args.preset, args.layers, args.vocab, max(lengths))
    link = native.measure_h2d(256 * 2**20, 10, pinned=True)
    pageable = native.measure_h2d(256 * 2**20, 5, pinned=False)
    print(f"link ceiling: pinned {link:.2f} GB/s, pageable {pageable:.2f} GB/s", flush=True)
    t0 = time.perf_counter()
    params = fast_params(cfg, 0, args.skew)
    print(f"params in {time.perf_counter() - t0:.1f}s; experts {cfg.expert_bytes_per_layer * len(cfg.moe_layers) / 1e9:.2f} GB", flush=True)
    rng = np.random.default_rng(1234)
    prompts = {n: [rng.integers(0, cfg.vocab_size, n) for _ in range(6)] for n in lengths}
    ctx = max(lengths)

    result = {"machine": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "preset": args.preset, "layers": args.layers, "skew": args.skew,
              "depth": args.depth, "link_pinned_gbps": link, "link_pageable_gbps": pageable,
              "rows": []}
    resident_ms, hashes = {}, {}
    with Engine(cfg, params, None, max_context=ctx, chunk_size=ctx) as eng:
        for n in lengths:
            eng.prefill(prompts[n][5])  # compile
            times = []
            for i in range(args.reps):
                ms, r = _time(eng, prompts[n][i % 4])
                times.append(ms)
                hashes[(n, i % 4)] = (sha256_of(r.logits), sha256_of(r.session.cache))
            resident_ms[n] = statistics.median(times)
            print(f"resident {n}: {resident_ms[n]:.1f} ms", flush=True)
            result["rows"].append({"arm": "resident", "tokens": n, "ms": resident_ms[n]})

    engines = {}
    for arm, routed in (("stream-all", False), ("routed", True)):
        engines[arm] = Engine(cfg, params, StreamConfig(routed=routed, depth=args.depth,
                                                        ring_budget_gib=8.0),
                              max_context=ctx, chunk_size=ctx)
        for n in lengths:
            engines[arm].prefill(prompts[n][5])  # compile
    identical = True
    for n in lengths:
        order = ["stream-all", "routed", "routed", "stream-all",
                 "routed", "stream-all", "stream-all", "routed"]
        meas = {"stream-all": [], "routed": []}
        for i, arm in enumerate(order):
            p = i // 2 % 4  # prompt index shared by the two arms of a pair
            ms, r = _time(engines[arm], prompts[n][p])
            tot = r.totals()
            same = (sha256_of(r.logits), sha256_of(r.session.cache)) == hashes.get((n, p), (None,))
            if (n, p) in hashes:
                identical &= same
            meas[arm].append((ms, tot))
        pairs = [meas["stream-all"][j][0] / meas["routed"][j][0] for j in range(4)]
        for arm in ("stream-all", "routed"):
            ms = statistics.median(m for m, _ in meas[arm])
            tot = meas[arm][0][1]
            copied = statistics.median(t["bytes"] for _, t in meas[arm])
            floor = max(resident_ms[n], copied / (link * 1e9) * 1e3)
            row = {"arm": arm, "tokens": n, "ms": ms, "bytes_copied": copied,
                   "gbps": copied / (ms * 1e-3) / 1e9, "link_fraction": copied / (ms * 1e-3) / 1e9 / link,
                   "floor_ms": floor, "time_over_floor": ms / floor,
                   "streamed": tot["streamed"], "copied": tot["copied"], "skipped": tot["skipped"],
                   "unrouted": tot["unrouted"]}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        result["rows"].append({"arm": "pairs", "tokens": n, "off_over_on": pairs,
                               "median": statistics.median(pairs)})
        print(f"pairs {n}: {pairs}", flush=True)
    result["identical"] = bool(identical)
    for e in engines.values():
        e.close()

    if args.publication:
        # Every expert resident, but through the stream: publish + fetch per layer, nothing copied
        # over the link. The difference to the plain resident arm is the publication's cost.
        with Engine(cfg, params, StreamConfig(resident_per_layer=cfg.n_experts),
                    max_context=ctx, chunk_size=ctx) as eng:
            n = lengths[0]
            eng.prefill(prompts[n][5])
            ms = statistics.median(_time(eng, prompts[n][i])[0] for i in range(args.reps))
            per_layer = (ms - resident_ms[n]) / len(cfg.moe_layers) * 1e3
            result["publication_us_per_layer"] = per_layer
            print(f"publish+fetch, nothing streamed: {ms:.1f} ms vs resident {resident_ms[n]:.1f}: "
                  f"{per_layer:.0f} us per layer", flush=True)
    print(f"identity across arms: {identical}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
