"""Chunked prompts against one chunk: the attention of a chunk over its cached prefix, end to end.

Three parts, each optional (`--parts`):

  attention   One layer's attention of a chunk over a cache prefix, per shape `T/start` of
              `--shapes` (default 8192/8192, 8192/24576, 1800/18700), Qwen3-30B-A3B heads (32
              query, 4 KV, head_dim 128), bf16, the cache as large as an engine's (prompt plus a
              chunk of slack): the engine's path (two fused cuDNN parts merged by log-sum-exp),
              the cuDNN prefix part over an exactly sized prefix (what a padding mask costs), and
              the blocked path it replaces; against the first-chunk path (one causal cuDNN call)
              at the same number of query-key pairs. TFLOP/s count 4 * pairs * heads * head_dim.
  prefill     A `--long` prompt through `--layers` layers: all resident in one chunk (the
              reference), in `--chunk` chunks chunk-major, and layer-major in `--chunk`
              sub-chunks; then the same for each streamed arm of `--arms` (routed, stream-all,
              with `--resident-gib` of residents) and the pure-JAX pinned_host arm (one chunk).
              Rows: ms, tokens/s, time over the resident one-chunk time, bytes copied. Logits and
              KV hashes of every streamed read equal the resident read of the same order.
              With `--engine-chunk` every engine chooses its own chunk (`Engine(chunk_size=
              None)`, what a smaller device gets: run under XLA_CLIENT_MEM_FRACTION) and "one"
              is that choice; `--no-resident` leaves out a resident arm that does not fit,
              `--resident-ms` then gives the one-chunk time the ratios divide by and the
              first arm's reads are the ones the others must equal (`--resident-json`
              takes that time, and the resident reads' hashes to compare with, from an
              earlier run's JSON). Each streamed row also has the
              link floor: its bytes at the ceiling measured from the engine's own store.
  follow-up   A `--turn2`-token turn over a `--turn1`-token session, against a `--turn2`-token
              first chunk, resident; then routed against stream-all (skip share).

Weights: `SyntheticParams(tile=8)`, made as each engine takes them: the experts go straight
into its host store (or onto the device), so host RAM holds them once however many layers
(`--layers 48`: the whole Qwen3-30B-A3B, 58 GB of bf16 experts). Every row has the process's
peak resident host memory so far (`peak_rss_bytes`, VmHWM) against the experts' bytes.

    python -m strata_jax.benchmarks.chunked_bench --layers 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from strata_jax.formats import QUANTIZE_CHOICES

from strata_jax.benchmarks.common import (
    QUANTIZED_MATMUL, PinnedHostBaseline, _hashes, _timed, model_config, quantized
)

# Each routed expert tensor repeats this many experts' draws (SyntheticParams(tile=...)).
TILE = 8


def peak_rss_bytes() -> int | None:
    """The process's peak resident host memory so far (VmHWM), None where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _engine(cfg, params, stream, **kwargs):
    """An Engine with a progress bar (stderr) over the layers its experts go into."""
    from tqdm.auto import tqdm

    from strata_jax.engine import Engine
    from strata_jax.kernels import Kernels

    where = "the host store" if stream is not None else "the device"
    with tqdm(total=len(cfg.moe_layers), desc=f"experts into {where}", unit="layer",
              file=sys.stderr) as bar:
        def update(done: int, total: int) -> None:  # a mesh's streamed engine: every device's
            bar.total = total
            bar.update(done - bar.n)

        return Engine(cfg, params, stream, progress=update,
                      kernels=Kernels(quantized_matmul=QUANTIZED_MATMUL["impl"]), **kwargs)


def _link_gbps(eng) -> list[float] | None:
    """The link ceiling of each device's store (`NativeStreamer.measure_link`; one device:
    one figure, a mesh: one per device in mesh order); None where it cannot be measured (the
    simulated link, a staged store)."""
    s = eng.streamer
    if s is None:
        return None
    try:
        return [m.measure_link() for m in getattr(s, "streamers", [s])]
    except RuntimeError:
        return None


def _ring_rows(eng) -> dict:
    """The ring a streamed engine read through: its slots and bytes, and the parts each
    layer streamed in (StreamTuning.parts); empty for the resident engine."""
    s = eng.streamer
    if s is None:
        return {}
    plan = getattr(s, "plan", None)  # a mesh's group: the first device's plan stands for all
    plan = plan if plan is not None else s.streamers[0].plan
    return {"ring_slots": plan.ring, "ring_bytes": plan.ring_bytes, "layer_parts": plan.parts}


def _link_rows(r, ms: float, link: list[float] | None) -> dict:
    """A streamed read's time against its link floor: the floor is the slowest device's bytes
    over its own ceiling (one device: the copied bytes over the link), and each device's link
    fraction is its bytes over the read's time and its ceiling."""
    if not link:
        return {"link_gbps": None, "link_floor_ms": None, "over_link_floor": None}
    per = r.per_device().get("streamed") if r.devices > 1 else None
    dev_bytes = [d["bytes"] for d in per] if per else [r.totals()["bytes"]]
    floor = max(b / (g * 1e9) for b, g in zip(dev_bytes, link)) * 1e3
    out = {"link_gbps": link[0] if len(link) == 1 else link, "link_floor_ms": floor,
           "over_link_floor": ms / floor if floor else None}
    if len(link) > 1:
        out["device_bytes"] = dev_bytes
        out["device_link_fraction"] = [b / (ms / 1e3) / (g * 1e9)
                                       for b, g in zip(dev_bytes, link)]
    return out


def _mesh(args):
    """Engine(mesh=) for --devices: None for one device."""
    return args.devices if args.devices > 1 else None


def _median_ms(fn, *args, reps: int = 10, warm: int = 2) -> float:
    """Median ms of `fn(*args)` after `warm` calls, synchronised (grouped_matmul_bench's)."""
    from strata_jax.benchmarks.grouped_matmul_bench import _time

    return _time(fn, args, warm, reps) * 1e3


def attention_part(args, result):
    import jax
    import jax.numpy as jnp

    from strata_jax.layers import attention as A

    n, kvh, d = 32, 4, 128
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        t, start = (int(x) for x in shape.split("/"))
        cap = start + t + args.chunk  # an engine's cache: its context plus a chunk of slack
        q = jnp.asarray(rng.standard_normal((t, n, d)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((cap, kvh, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((cap, kvh, d)), jnp.bfloat16)
        kc, vc = k[start:start + t], v[start:start + t]
        pos = jnp.arange(start, start + t, dtype=jnp.int32)
        pairs = t * start + t * (t + 1) // 2
        flop = 4 * pairs * n * d

        engine_path = jax.jit(lambda q, kc, vc, k, v, s: A.chunk_over_cache(
            q, kc, vc, k, v, s, path="cudnn"))
        ms = {"fused": _median_ms(engine_path, q, kc, vc, k, v, jnp.int32(start),
                                  reps=args.reps)}
        exact = jax.jit(lambda q, k, v: A.cudnn_part(q, k, v)[0])
        ms["prefix_exact_part"] = _median_ms(exact, q, k[:start], v[:start], reps=args.reps)
        padded = jax.jit(lambda q, k, v, s: A.cudnn_part(q, k, v, kv_len=s)[0])
        ms["prefix_padded_part"] = _median_ms(padded, q, k, v, jnp.int32(start), reps=args.reps)
        if not args.skip_blocked:
            block = A.attention_key_block(n, t, cap)
            blocked = jax.jit(A.blocked_attention, static_argnums=4)
            ms["blocked"] = _median_ms(blocked, q, k, v, pos, block, reps=3, warm=1)
        # The first-chunk path at the same number of query-key pairs: L(L+1)/2 = pairs.
        L = round((np.sqrt(8 * pairs + 1) - 1) / 2 / 128) * 128
        ql = jnp.asarray(rng.standard_normal((L, n, d)), jnp.bfloat16)
        kl = jnp.asarray(rng.standard_normal((L, kvh, d)), jnp.bfloat16)
        first = jax.jit(lambda q, k, v: A.attend_first(q, k, v, "cudnn"))
        first_ms = _median_ms(first, ql, kl, kl, reps=args.reps)
        first_tflops = 4 * (L * (L + 1) // 2) * n * d / (first_ms * 1e-3) / 1e12
        got = np.asarray(engine_path(q, kc, vc, k, v, jnp.int32(start)), np.float32)
        want = np.asarray(jax.jit(lambda q, kc, vc, k, v, s: A.chunk_over_cache(
            q, kc, vc, k, v, s, path="split"))(q, kc, vc, k, v, jnp.int32(start)), np.float32) \
            if t * cap * n * 4 < 2**33 else None
        row = {"part": "attention", "queries": t, "prefix": start, "cache": cap,
               "tflop": flop / 1e12, "first_chunk_len": L, "first_chunk_ms": first_ms,
               "first_chunk_tflops": first_tflops,
               **{f"{k_}_ms": v_ for k_, v_ in ms.items()},
               **{f"{k_}_tflops": flop / (v_ * 1e-3) / 1e12 for k_, v_ in ms.items()
                  if k_ in ("fused", "blocked")},
               "fused_over_first_chunk": flop / (ms["fused"] * 1e-3) / 1e12 / first_tflops,
               "max_abs_diff_vs_split": None if want is None
               else float(np.abs(got - want).max())}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)


def _stream(args, routed: bool):
    from strata_jax.stream import StreamConfig

    return StreamConfig(routed=routed, resident_budget_gib=args.resident_gib,
                        ring_budget_gib=args.ring_gib)


def _error_text(e: BaseException) -> str:
    """A failed read's row text: the exception's type and its first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _pinned_host_rows(args, cfg, params, prompts, orders, hashes, resident_one):
    """The pure-JAX arm: each read of `orders` ("one": one chunk, "chunked": `--chunk`
    chunks); a read that does not fit the device is a row with its error."""
    import jax

    from strata_jax.engine import sha256_of

    n = args.long
    rows = []
    try:
        base = PinnedHostBaseline(cfg, params, n)
    except Exception as e:  # noqa: BLE001 - a comparison arm; its failure is a row
        return [{"part": "prefill", "arm": "jax-pinned-host", "read": o, "tokens": n,
                 "error": _error_text(e)} for o in orders]
    for order in orders:
        if order not in ("one", "chunked"):
            continue
        chunk = args.chunk if order == "chunked" else None
        try:
            base.prefill(prompts[0], chunk)
            times = []
            for p in prompts[1:]:
                ms, logits, _ = base.prefill(p, chunk)
                times.append(ms)
        except Exception as e:  # noqa: BLE001 - out of memory on a smaller device
            rows.append({"part": "prefill", "arm": "jax-pinned-host", "read": order,
                         "tokens": n, "error": _error_text(e)})
            continue
        ms = statistics.median(times)
        ref = hashes.get((order, len(prompts) - 1))
        rows.append({"part": "prefill", "arm": "jax-pinned-host", "read": order, "tokens": n,
                     "chunk_size": chunk or n, "ms": ms, "tok_per_s": n / ms * 1e3,
                     "over_resident_one": ms / resident_one if resident_one else None,
                     "bytes_copied": (cfg.expert_bytes * cfg.n_experts * len(cfg.moe_layers)
                                      * -(-n // (chunk or n))),
                     "identical_logits": None if ref is None else sha256_of(logits) == ref[0]})
    del base
    jax.clear_caches()
    return rows


def _reads(eng, prompts, chunk: int, orders):
    """Times each read of `orders` ("one", "chunked", "layer-major") over prompts[1:] after a
    compile read of prompts[0]: yields (order, (median ms, last result, the compile read's
    seconds) or the error's text (a read that does not fit the device)) as each order ends."""
    for order in orders:
        kw = ({"order": "chunk-major"} if order == "one" else
              {"order": "chunk-major", "chunk_size": chunk} if order == "chunked" else
              {"order": "layer-major"})
        try:
            t0 = time.perf_counter()
            eng.prefill(prompts[0], **kw)  # compile
            first_s = time.perf_counter() - t0
            times, r = [], None
            for p in prompts[1:]:
                del r
                ms, r = _timed(eng, p, **kw)
                times.append(ms)
        except Exception as e:  # noqa: BLE001 - out of memory on a smaller device: a row
            yield order, _error_text(e)
            continue
        yield order, (statistics.median(times), r, first_s)
        del r


def prefill_part(args, cfg, params, result, save=lambda: None):
    import jax

    n = args.long
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, cfg.vocab_size, n) for _ in range(args.reps_prefill + 1)]
    # (order, prompt) -> the reference read's hashes: the resident arm's, or `--resident-json`'s.
    hashes, resident_one = dict(args.reference_hashes), args.resident_ms
    resident_read = args.resident_read
    arms = ([] if args.no_resident else ["resident"]) + [
        a for a in args.arms.split(",") if a != "resident"]
    for arm in arms:
        if arm == "jax-pinned-host":
            if jax.devices()[0].platform != "gpu" or args.devices > 1:
                continue  # a one-GPU arm
            for row in _pinned_host_rows(args, cfg, params, prompts, args.orders.split(","),
                                         hashes, resident_one):
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            save()
            continue
        sc = None if arm == "resident" else _stream(args, arm == "routed")
        orders = (args.resident_orders if arm == "resident" else args.orders).split(",")
        own = args.engine_chunk or arm == "resident"
        t0 = time.perf_counter()
        with _engine(cfg, params, sc, max_context=n, chunk_size=None if own else n,
                     sub_chunk=args.chunk, mesh=_mesh(args),
                     dense=args.dense if sc is not None else "device") as eng:
            made_s = time.perf_counter() - t0
            link = _link_gbps(eng)
            # Each order's row is saved as it ends: a long run keeps what finished.
            for order, read in _reads(eng, prompts, args.chunk, orders):
                if isinstance(read, str):
                    row = {"part": "prefill", "arm": arm, "read": order, "tokens": n,
                           "error": read, "chunk_choice": eng.chunk_choice}
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
                    continue
                ms, r, first_s = read
                after = _link_gbps(eng)  # again after the reads: the link can drift by a few %
                # The denominator: the resident one-chunk read, or its layer-major read where
                # the one chunk did not fit.
                if arm == "resident" and (order == "one" or resident_read != "one"):
                    resident_one, resident_read = ms, order
                h = _hashes(r)
                first_of_order = (order, len(prompts) - 1) not in hashes
                if first_of_order:  # the resident arm's, else the first arm that read it
                    hashes[(order, len(prompts) - 1)] = h
                tot = r.totals()
                row = {"part": "prefill", "arm": arm, "read": order, "tokens": n,
                       "chunks": len(r.chunks), "chunk_size": r.chunk_size, "ms": ms,
                       "tok_per_s": n / ms * 1e3,
                       "over_resident_one": ms / resident_one if resident_one else None,
                       "resident_read": resident_read if resident_one else None,
                       "bytes_copied": tot["bytes"], "copied": tot["copied"],
                       "skipped": tot["skipped"], "unrouted": tot["unrouted"],
                       "streamed": tot["streamed"],
                       # The resident read is the reference (equal to itself); with no
                       # resident arm the first arm's reads are, and are not compared.
                       "identical_to_resident": (None if first_of_order and arm != "resident"
                                                 else h == hashes[(order, len(prompts) - 1)]),
                       "prompt": len(prompts) - 1, "logits_sha256": h[0], "kv_sha256": h[1],
                       "expert_rows": r.expert_rows, "engine_s": made_s,
                       "first_read_s": first_s,  # the compile read (compile + one read)
                       "chunk_choice": r.chunk_choice, "fallback": r.fallback,
                       "devices": r.devices, **_link_rows(r, ms, link),
                       **_ring_rows(eng),
                       "link_gbps_after": after[0] if after and len(after) == 1 else after,
                       "peak_rss_bytes": peak_rss_bytes(),
                       "peak_rss_over_experts": _over_experts(cfg)}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                del read, r
                save()
    result["identical"] = all(r.get("identical_to_resident") is not False
                              and r.get("identical_logits") is not False
                              for r in result["rows"])


def _over_experts(cfg) -> float | None:
    peak = peak_rss_bytes()
    return peak / cfg.expert_bytes_total if peak else None


def follow_up_part(args, cfg, params, result):
    rng = np.random.default_rng(12)
    t1, t2 = args.turn1, args.turn2
    firsts = [rng.integers(0, cfg.vocab_size, t1) for _ in range(args.reps_prefill + 1)]
    seconds = [rng.integers(0, cfg.vocab_size, t2) for _ in range(args.reps_prefill + 1)]
    first_ms = None
    for arm in ["resident"] + [a for a in args.arms.split(",") if a in ("routed", "stream-all")]:
        sc = None if arm == "resident" else _stream(args, arm == "routed")
        # The engine's own chunk (chunk_size=None): the first turn in as few chunks as fit.
        with _engine(cfg, params, sc, max_context=t1 + t2, chunk_size=None,
                     mesh=_mesh(args)) as eng:
            if arm == "resident":  # a first chunk of turn2 tokens
                eng.prefill(seconds[0])
                first_ms = statistics.median(_timed(eng, p)[0] for p in seconds[1:])
            r1 = eng.prefill(firsts[0])
            eng.prefill(seconds[0], r1.session)  # compile
            times, r2 = [], None
            for a, b in zip(firsts[1:], seconds[1:]):
                r1 = eng.prefill(a)
                ms, r2 = _timed(eng, b, r1.session)
                times.append(ms)
            ms = statistics.median(times)
            tot = r2.totals()
            row = {"part": "follow-up", "arm": arm, "turn1": t1, "turn2": t2, "ms": ms,
                   "first_chunk_ms": first_ms, "over_first_chunk": ms / first_ms,
                   "bytes_copied": tot["bytes"], "streamed": tot["streamed"],
                   "copied": tot["copied"], "skipped": tot["skipped"],
                   "unrouted": tot["unrouted"],
                   "skipped_of_unrouted": tot["skipped"] / tot["unrouted"] if tot["unrouted"]
                   else None, "chunk_choice": eng.chunk_choice, "summary": r2.summary()}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)


def _resident_reference(path: str, tokens: int) -> tuple[float, dict]:
    """From an earlier run's JSON: the resident one-chunk ms of `tokens` tokens (its
    layer-major ms where it has no one-chunk read: the one chunk did not fit), that read, and its
    resident reads' hashes {(order, prompt): (logits, kv)} (the same weights and prompts: a
    run with the same --long and --reps-prefill), which this run's reads must equal. Exits
    with the reason where it has no such row."""
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"--resident-json {path}: cannot read its rows ({e})") from None
    resident = [r for r in rows if r.get("arm") == "resident" and r.get("tokens") == tokens
                and r.get("ms")]
    one = ([r for r in resident if r.get("read") == "one"]
           or [r for r in resident if r.get("read") == "layer-major"])
    if not one:
        raise SystemExit(f"--resident-json {path}: no resident one-chunk or layer-major row of "
                         f"{tokens} tokens")
    hashes = {(r["read"], r["prompt"]): (r["logits_sha256"], r["kv_sha256"])
              for r in resident if "logits_sha256" in r}
    return float(one[0]["ms"]), one[0]["read"], hashes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="attention,prefill,follow-up")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--tiny", action="store_true", help="scaled-down widths (CPU smoke run)")
    ap.add_argument("--arms", default="routed,stream-all,jax-pinned-host")
    ap.add_argument("--shapes", default="8192/8192,8192/24576,1800/18700")
    ap.add_argument("--skip-blocked", action="store_true")
    ap.add_argument("--orders", default="one,chunked,layer-major",
                    help="the streamed arms' reads: one chunk, --chunk chunks, layer-major")
    ap.add_argument("--resident-orders", default="one,chunked,layer-major",
                    help="the resident arm's reads (a streamed read is checked against the "
                         "resident read of the same order where there is one)")
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--turn1", type=int, default=18700)
    ap.add_argument("--turn2", type=int, default=1800)
    ap.add_argument("--resident-gib", type=float, default=None,
                    help="the streamed arms' resident budget (default: none resident)")
    ap.add_argument("--ring-gib", type=float, default=8.0)
    ap.add_argument("--engine-chunk", action="store_true",
                    help="every engine chooses its chunk (what fits the device); 'one' is it")
    ap.add_argument("--no-resident", action="store_true",
                    help="no resident arm (the experts do not fit the device)")
    ap.add_argument("--resident-ms", type=float, default=None,
                    help="with --no-resident: the resident one-chunk time to divide by")
    ap.add_argument("--resident-json", default=None,
                    help="with --no-resident: an earlier run's --json (same --long and "
                         "--reps-prefill) whose resident one-chunk row (else its layer-major "
                         "row) gives --resident-ms and whose resident reads this run's must "
                         "equal")
    ap.add_argument("--reps", type=int, default=10, help="attention repetitions")
    ap.add_argument("--reps-prefill", type=int, default=3)
    ap.add_argument("--quantize", choices=list(QUANTIZE_CHOICES), default=None,
                    help="the experts in this format (stored, streamed and read quantized)")
    ap.add_argument("--quantized-matmul", choices=["auto", "fused", "dequantize"], default="auto",
                    help="how quantized experts are read (Kernels.quantized_matmul)")
    ap.add_argument("--dense", choices=["device", "host"], default="device",
                    help="the streamed arms' decoder-layer weights: on the device, or in pinned "
                         "host memory copied in one layer ahead (Engine(dense=))")
    ap.add_argument("--drop-dense", action="store_true",
                    help="keep no dense weight in host memory once on the device (each engine "
                         "draws them again): for a model whose dense weights do not fit in host "
                         "RAM beside its expert store")
    ap.add_argument("--devices", type=int, default=1,
                    help="split every MoE layer's experts over the first N devices "
                         "(Engine(mesh=N)): the resident and streamed arms; the pure-JAX arm "
                         "is one device's and is left out. On the CPU, N simulated devices.")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    QUANTIZED_MATMUL["impl"] = args.quantized_matmul
    if args.devices < 1:
        ap.error(f"--devices {args.devices}: expected at least 1")
    if args.devices > 1:
        from strata_jax.cli.common import _simulated_cpu_devices

        _simulated_cpu_devices(args.devices)
    parts = args.parts.split(",")
    unknown = set(parts) - {"attention", "prefill", "follow-up"}
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}")

    args.reference_hashes = {}
    if args.resident_json:
        args.resident_ms, args.resident_read, args.reference_hashes = _resident_reference(
            args.resident_json, args.long)
    else:
        args.resident_read = "one" if args.resident_ms else None

    import jax

    stats = jax.devices()[0].memory_stats() or {}
    result = {"machine": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "device_bytes_limit": stats.get("bytes_limit"),
              "argv": sys.argv[1:] if argv is None else list(argv), "rows": []}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    if "attention" in parts:
        attention_part(args, result)
        save()
    if "prefill" in parts or "follow-up" in parts:
        cfg = model_config(args.preset, args.layers, args.vocab,
                           max(args.long, args.turn1 + args.turn2), tiny=args.tiny,
                           quantize=args.quantize)
        from strata_jax.synthetic import SyntheticParams

        # Nothing is drawn here: each engine draws the experts into its store or the device.
        params = SyntheticParams(cfg, 0, 0.0, tile=TILE, keep_dense=not args.drop_dense)
        cfg, params = quantized(cfg, params, args.quantize)
        print(f"experts {cfg.expert_bytes_total / 1e9:.2f} GB ({len(cfg.moe_layers)} MoE "
              f"layers), made as each engine takes them", flush=True)
        result.update(layers=args.layers, preset=args.preset, resident_gib=args.resident_gib,
                      expert_bytes_total=cfg.expert_bytes_total,
                      expert_format=cfg.expert_format, expert_block=cfg.expert_block,
                      weights=f"SyntheticParams(seed 0, skew 0, tile {TILE})"
                              + (f", quantized to {args.quantize}" if args.quantize else ""))
        if "prefill" in parts:
            prefill_part(args, cfg, params, result, save)
            save()
        if "follow-up" in parts:
            follow_up_part(args, cfg, params, result)
            save()
    result["peak_rss_bytes"] = peak_rss_bytes()
    save()
    failed = [r for r in result["rows"] if "error" in r]
    print(f"identity across arms: {result.get('identical', True)}; peak host RSS "
          f"{(result['peak_rss_bytes'] or 0) / 1e9:.2f} GB"
          + (f"; {len(failed)} read(s) failed" if failed else ""))
    return 0 if result.get("identical", True) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
