"""One expert matmul of a Qwen3-30B-A3B-shaped layer, run a few times, for a profiler to read.

For each path given, the grouped matmul of one matrix (gate [M, 2048] x [2048, 768], or down
[M, 768] x [768, 2048]; M = tokens x top-k rows, uniform routing) is compiled, then run
--runs times, each waited for. Under Nsight Compute (BENCHMARKS.md, "Not run yet"):

    ncu --replay-mode application --section SpeedOfLight --section WarpStateStats \\
        --kernel-name regex:mosaic --launch-skip 1 --launch-count 1 \\
        python -m strata_jax.benchmarks.kernel_once --paths int4 --matrix gate

With --profile-dir, the fp8 and int4 Mosaic kernels run once under Mosaic GPU's own profiler
(`quant_mosaic.KernelProfile`: each warpgroup times its step's regions) and the trace each
run writes is summarized: per region, how many, their median and total time per warpgroup,
and the time between regions (the pipeline's waits for its copies, the loop's own code):

    python -m strata_jax.benchmarks.kernel_once --paths int4 --tokens 1024 --runs 1 \\
        --profile-dir out/prof --profile-regions 224 --profile-scopes convert
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.benchmarks.grouped_matmul_bench import uniform_group_sizes
from strata_jax.config import get_preset
from strata_jax.formats import ExpertFormat, quantized_config
from strata_jax.grouped_matmul import grouped_matmul

PATHS = ("bf16", "fp8", "int4")


def summarize_trace(path: str) -> dict:
    """A Mosaic GPU profiler trace (Perfetto JSON of "B"/"E" events, one track a warpgroup)
    summed up: per region its count, median and mean duration and its total per track; each
    track's span from its first to its last event, and the part of it outside every region
    ("between"). The profiler stamps events with the SM's clock: a track's `ts` is its
    start (microseconds) plus cycles / 1000, so the durations (the "_us" keys) are
    thousands of SM clock cycles."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    tracks = collections.defaultdict(list)
    for ev in events:
        tracks[(ev["pid"], ev["tid"])].append(ev)
    durations = collections.defaultdict(list)
    spans, inside = [], []
    for evs in tracks.values():
        evs.sort(key=lambda ev: ev["ts"])
        open_at, depth, covered, outer_start = {}, 0, 0.0, None
        for ev in evs:
            if ev["ph"] == "B":
                open_at.setdefault(ev["name"], []).append(ev["ts"])
                if depth == 0:
                    outer_start = ev["ts"]
                depth += 1
            elif open_at.get(ev["name"]):
                durations[ev["name"]].append(ev["ts"] - open_at[ev["name"]].pop())
                depth -= 1
                if depth == 0:
                    covered += ev["ts"] - outer_start
        spans.append(evs[-1]["ts"] - evs[0]["ts"])
        inside.append(covered)
    n_tracks = max(len(tracks), 1)
    out = {"tracks": len(tracks), "span_us_median": statistics.median(spans) if spans else 0.0,
           "between_us_per_track": (sum(spans) - sum(inside)) / n_tracks, "regions": {}}
    for name, d in sorted(durations.items()):
        out["regions"][name] = {"count": len(d), "median_us": statistics.median(d),
                                "mean_us": sum(d) / len(d), "total_us_per_track":
                                sum(d) / n_tracks}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="bf16,int4", help="comma list of " + "|".join(PATHS))
    ap.add_argument("--matrix", choices=("gate", "down"), default="gate")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--profile-dir", default=None,
                    help="profile the fp8/int4 Mosaic kernels' regions into this directory "
                         "(GPU only) and summarize each trace")
    ap.add_argument("--profile-scopes", default=None,
                    help="comma list of the regions to record (default all): fewer regions "
                         "a step let more steps fit the profile's space")
    ap.add_argument("--mosaic", default=None,
                    help='the Mosaic kernel\'s tiling, as quant_matmul_bench --mosaic (default: '
                         "the model's)")
    ap.add_argument("--profile-regions", type=int, default=512,
                    help="regions each warpgroup can record (16 bytes of shared memory each; "
                         "the int4 kernel's two programs an SM fit one SM at 224, not at 512)")
    a = ap.parse_args(argv)
    paths = a.paths.split(",")
    if set(paths) - set(PATHS):
        ap.error(f"--paths {a.paths!r}: a comma list of {'|'.join(PATHS)}")
    mosaic_flags = [f for f, v in (("--profile-dir", a.profile_dir), ("--mosaic", a.mosaic))
                    if v is not None]
    if mosaic_flags and "bf16" in paths:
        ap.error(f"{' and '.join(mosaic_flags)}: the fp8/int4 Mosaic kernels only; leave bf16 "
                 "out of --paths")
    profile = None
    if a.profile_dir is not None:
        from strata_jax.quant_mosaic import KernelProfile
        os.makedirs(a.profile_dir, exist_ok=True)
        try:
            profile = KernelProfile(os.path.abspath(a.profile_dir), a.profile_regions,
                                    None if a.profile_scopes is None
                                    else tuple(a.profile_scopes.split(",")))
        except ValueError as e:
            ap.error(str(e))
    tiles = None
    if a.mosaic is not None:
        from strata_jax.benchmarks.quant_matmul_bench import parse_mosaic
        try:
            tiles = parse_mosaic(a.mosaic)
        except (ValueError, TypeError) as e:
            ap.error(str(e))
    cfg = get_preset("qwen3-30b-a3b")
    h, i, e = cfg.hidden_size, cfg.expert_intermediate, cfg.n_experts
    k, n = (h, i) if a.matrix == "gate" else (i, h)
    m = a.tokens * cfg.top_k
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(uniform_group_sizes(a.tokens, e, cfg.top_k))
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    w32 = rng.standard_normal((e, k, n), np.float32) * 0.02
    for path in paths:
        if profile is None and tiles is None:
            f = jax.jit(grouped_matmul)
        else:  # the Mosaic kernel itself, profiled and/or at a tiling
            from strata_jax.quant_mosaic import mosaic_grouped_matmul, mosaic_int4_grouped_matmul
            mm = mosaic_int4_grouped_matmul if path == "int4" else mosaic_grouped_matmul
            f = jax.jit(lambda x, w, s, mm=mm: mm(x, w, s, tiles=tiles, profile=profile))
        if path == "bf16":
            w = jnp.asarray(w32, jnp.bfloat16)
        else:
            fmt = ExpertFormat.of(quantized_config(cfg.replace(param_dtype="bfloat16"), path, 0))
            planes = {name: jnp.asarray(v) for name, v in
                      fmt.quantize_matrix_np(a.matrix, w32).items()}
            w = fmt.matrix(planes, a.matrix, jnp.bfloat16)
        for _ in range(a.runs):
            f(x, w, sizes).block_until_ready()
        print(f"{path} {a.matrix} {a.tokens} tokens: ran {a.runs}", flush=True)
    if profile is not None:
        jax.effects_barrier()  # the traces are written by a host callback after each run
        for trace in sorted(glob.glob(os.path.join(profile.dir, "*-trace.json"))):
            print(os.path.basename(trace), json.dumps(summarize_trace(trace)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
