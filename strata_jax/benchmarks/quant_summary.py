"""Quantized experts against bf16: issue 21's targets from one stream_bench sweep per format.

Reads the JSON of `stream_bench --parts sweep` run once with bf16 experts and once per
quantized format (`--quantize fp8`, `int4`, `int4-zp`, `int4-act` or `mxfp4`), same preset, layers,
lengths and arms, and gives per format and length (the ratios to bf16 only where the bf16 run
has that length: a run cut short, or none at all, leaves them out):

    routed_over_bf16        routed prefill time over bf16's (targets: fp8 <= 0.55 at 1K-8K,
                            int4 <= 0.32 at 1K-4K)
    stream_all_over_bf16    the same for stream-all
    link_fraction           stream-all's bytes actually moved over its time, as a fraction of
                            the link ceiling (target >= 0.97); link_fraction_after against the
                            ceiling probed after the length's calls (how far the link moved);
                            copy_tail_ms, the device's time after the chunk's last copy
    resident_over_bf16      the all-resident prefill's time over bf16's: what dequantizing
                            adds to the compute (target <= 1.05 at 8K)
    identical               every streamed read equal to the resident read of its format
    accuracy                from a run with `--parts sweep,accuracy`: against the plain model,
                            the mean |difference| of every next token's log-probability, the
                            two mean NLLs, and how often the two models' most likely token
                            agrees over every position (`top1_agreement`; the last
                            position's alone in the JSON)

    python -m strata_jax.benchmarks.quant_summary bf16.json fp8.json int4.json --json q.json
"""

from __future__ import annotations

import argparse
import json
import sys


def _rows(result: dict) -> dict:
    """(arm, tokens) -> the sweep row."""
    return {(r["arm"], r["tokens"]): r for r in result["rows"]
            if r.get("part") == "sweep" and "tokens" in r and "ms" in r}


def summarize(results: list[dict]) -> dict:
    """The targets' figures of `results` (stream_bench JSONs, at most one per format). Without
    a plain (bf16) result, or where it lacks a length or arm, the ratios to bf16 are left out
    and the rest (link fractions, time over floor, identity) is still given: a call cut short
    keeps what it measured."""
    by_format = {}
    for res in results:
        # int4 with zero-points (`--quantize int4-zp`) or act-order (`int4-act`) is a format
        # of its own here
        fmt = (res.get("expert_format", "plain") + ("-zp" if res.get("expert_zero_points") else "")
               + ("-act" if res.get("expert_act_order") else ""))
        if fmt in by_format:
            raise ValueError(f"two results for expert format {fmt!r}")
        by_format[fmt] = res
    if not by_format:
        raise ValueError("no results to summarize")
    base = by_format.get("plain")
    first = base if base is not None else next(iter(by_format.values()))
    keys = ("preset", "layers", "skew")
    for fmt, res in by_format.items():
        differ = [k for k in keys if res.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"the {fmt} run differs from the "
                             f"{'bf16' if base is not None else 'first'} run in {differ}")
    brows = _rows(base) if base is not None else {}
    out = {"preset": first.get("preset"), "layers": first.get("layers"),
           "machine": first.get("machine"), "expert_bytes": {}, "rows": [],
           "has_bf16": base is not None}
    for fmt, res in by_format.items():
        out["expert_bytes"][fmt] = res.get("expert_bytes")
        rows = _rows(res)
        accuracy = {r["tokens"]: r for r in res["rows"] if r.get("part") == "accuracy"}
        for (arm, n), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if arm != "resident":
                continue
            row = {"format": fmt, "tokens": n, "resident_ms": r["ms"]}
            if ("resident", n) in brows:
                row["resident_over_bf16"] = r["ms"] / brows[("resident", n)]["ms"]
            for a, key in (("routed", "routed"), ("stream-all", "stream_all")):
                got, ref = rows.get((a, n)), brows.get((a, n))
                if got is None:
                    continue
                row[f"{key}_ms"] = got["ms"]
                row[f"{key}_time_over_floor"] = got.get("time_over_floor")
                if ref is not None:
                    row[f"{key}_over_bf16"] = got["ms"] / ref["ms"]
                row.setdefault("identical", True)
                row["identical"] &= bool(got.get("identical_to_resident"))
                if a == "stream-all":
                    row["link_fraction"] = got.get("link_fraction")
                    if "link_fraction_after" in got:  # against the ceiling probed after
                        row["link_fraction_after"] = got["link_fraction_after"]
                    row["bytes_copied"] = got.get("bytes_copied")
                    if "copy_tail_ms" in got:  # the device's time after the last copy
                        row["copy_tail_ms"] = got["copy_tail_ms"]
            acc = accuracy.get(n)
            if acc is not None:
                row["accuracy"] = {k: acc[k] for k in (
                    "logprob_abs_diff_mean", "nll_plain", "nll_quantized",
                    "top1_agreement", "last_top1_agreement", "finite")}
            out["rows"].append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="stream_bench JSON files, one per format")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = []
    for path in args.results:
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            ap.error(f"{path}: {e}")
    try:
        out = summarize(results)
    except ValueError as e:
        ap.error(str(e))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if not out["has_bf16"]:
        print("no bf16 (plain) result: the times over bf16's are left out (run stream_bench "
              "without --quantize too, in the same call, for them)", file=sys.stderr)
    print(f"{'format':>11} {'tokens':>6} {'routed/bf16':>11} {'all/bf16':>9} {'link':>6} "
          f"{'after':>6} {'tail ms':>7} {'resident/bf16':>13} identical  |dlogp|  "
          f"NLL bf16 -> this  top-1")
    for r in out["rows"]:
        def f(key, fmt="{:.3f}"):
            v = r.get(key)
            return fmt.format(v) if v is not None else "-"
        acc = r.get("accuracy")
        tail = (f"  {acc['logprob_abs_diff_mean']:.4f}  {acc['nll_plain']:.3f} -> "
                f"{acc['nll_quantized']:.3f}  {acc['top1_agreement']:.3f}" if acc else "")
        print(f"{r['format']:>11} {r['tokens']:>6} {f('routed_over_bf16'):>11} "
              f"{f('stream_all_over_bf16'):>9} {f('link_fraction', '{:.4f}'):>6} "
              f"{f('link_fraction_after', '{:.4f}'):>6} {f('copy_tail_ms'):>7} "
              f"{f('resident_over_bf16'):>13} {r.get('identical')}{tail}")
    ok = all(r.get("identical", True) and r.get("accuracy", {}).get("finite", True)
             for r in out["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
