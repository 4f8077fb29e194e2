"""Plots from a stream_bench JSON: time against prompt length per arm, and one request's per-layer
copied / skipped experts.

    python -m strata_jax.benchmarks.plot docs/results/stream_sweep_1k4k8k_s11_pieces_h200.json --out /tmp/plots
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--out", default=".")
    ap.add_argument("--name", default=None, help="file name stem (default: the JSON's)")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.json) as f:
        res = json.load(f)
    stem = args.name or os.path.splitext(os.path.basename(args.json))[0]
    os.makedirs(args.out, exist_ok=True)
    rows = [r for r in res["rows"] if r.get("part", "sweep") == "sweep" and "ms" in r]
    written = []
    if rows:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for arm in ("resident", "jax-pinned-host", "stream-all", "routed"):
            pts = sorted((r["tokens"], r["ms"]) for r in rows if r["arm"] == arm)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=arm)
        floor = sorted((r["tokens"], r["floor_ms"]) for r in rows if r["arm"] == "routed")
        if floor:
            ax.plot(*zip(*floor), ls="--", color="grey", label="routed floor")
        tokens = [r["tokens"] for r in rows]
        if max(tokens) > 8 * min(tokens):
            ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens (one chunk)")
        ax.set_ylabel("prefill time (ms)")
        links = [r["link_pinned_gbps"] for r in res.get("runs", [])] or [
            res.get("link_pinned_gbps", 0)]
        link = (f"{links[0]:.1f}" if len(links) == 1
                else f"{min(links):.1f}-{max(links):.1f} ({len(links)} runs)")
        ax.set_title(f"{res.get('preset')} x {res.get('layers')} layers, {res.get('machine')}\n"
                     f"link {link} GB/s pinned, skew {res.get('skew')}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        path = os.path.join(args.out, f"{stem}_time.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        written.append(path)
    ex = res.get("per_layer_example")
    if ex:
        layers = [i for i, s in enumerate(ex["streamed"]) if s]
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        copied = [ex["copied"][i] for i in layers]
        skipped = [ex["skipped"][i] for i in layers]
        unrouted = [ex["unrouted"][i] for i in layers]
        ax.bar(layers, copied, label="copied")
        ax.bar(layers, skipped, bottom=copied, label="skipped")
        ax.plot(layers, [c + u for c, u in zip(copied, unrouted)], "k_", ms=14,
                label="copied + unrouted")
        ax.set_xticks(layers)
        ax.set_xlabel("layer")
        ax.set_ylabel("streamed experts")
        ax.set_title(f"one {ex['tokens']}-token request, {ex['arm']}", fontsize=9)
        ax.legend(fontsize=8)
        path = os.path.join(args.out, f"{stem}_layers.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        written.append(path)
    for p in written:
        print(p)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
