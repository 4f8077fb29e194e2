"""Grouped expert matmuls vs a dense matmul of the same M, all experts resident.

Guards against shipping a grouped matmul that is far from dense throughput (the default CUDA
`ragged_dot` runs at ~5 TFLOP/s): for a Qwen3-30B-A3B-shaped layer (H 2048, I 768, 128 experts,
top-8, uniform routing) it times the SwiGLU projections gate [M,H]x[H,I], up [M,H]x[H,I] and down
[M,I]x[I,H] as grouped matmuls over M = tokens * top_k rows sorted by expert, and the same three
products as dense bf16 matmuls with one weight matrix, then reports TFLOP/s of each and the ratio.
The bar on the H200 is grouped >= 50% of dense.

    python -m strata_jax.benchmarks.grouped_matmul_bench --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.models import get_preset
from strata_jax.kernels.grouped import _mosaic_jit, grouped_matmul, resolve_implementation


def uniform_group_sizes(tokens: int, n_experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """Per-expert row counts of `tokens` tokens each routed to top_k distinct uniform experts."""
    rng = np.random.default_rng(seed)
    choice = np.argsort(rng.random((tokens, n_experts)), axis=1)[:, :top_k]  # [T, k] distinct
    return np.bincount(choice.ravel(), minlength=n_experts).astype(np.int32)


def _time(fn, args, warmup: int, repeats: int, batch: int = 1) -> float:
    """Median seconds of `fn(*args)`: each of `repeats` samples dispatches `batch` calls and
    waits for the last (block_until_ready), divided by `batch`. With batch 1 a sample
    includes the call's dispatch and the host's wake after it (a few tenths of a
    millisecond); with more, the calls queue on the device back to back and those costs
    are paid once a sample."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(batch - 1):
            fn(*args)
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - t0) / batch)
    return statistics.median(samples)


def bench_one(tokens: int, hidden: int, inter: int, n_experts: int, top_k: int, *,
              impl: str | None, warmup: int, repeats: int, dtype=jnp.bfloat16,
              grid_block_n: int | None = None, block_k: int | None = None,
              stages: int | None = None) -> dict:
    """Times grouped and dense SwiGLU projections for one token count (grid_block_n, block_k,
    stages: the Mosaic kernel's column bands, k step and pipeline depth, None for its
    defaults)."""
    m = tokens * top_k
    sizes = jnp.asarray(uniform_group_sizes(tokens, n_experts, top_k))
    keys = jax.random.split(jax.random.key(0), 8)
    x = jax.random.normal(keys[0], (m, hidden), dtype)
    h = jax.random.normal(keys[1], (m, inter), dtype)
    wg = (jax.random.normal(keys[2], (n_experts, hidden, inter), dtype) * 0.02).astype(dtype)
    wu = (jax.random.normal(keys[3], (n_experts, hidden, inter), dtype) * 0.02).astype(dtype)
    wd = (jax.random.normal(keys[4], (n_experts, inter, hidden), dtype) * 0.02).astype(dtype)
    dg, du, dd = wg[0], wu[0], wd[0]

    tiling = dict(grid_block_n=grid_block_n, block_k=block_k, stages=stages)
    if all(v is None for v in tiling.values()):
        def mm(a, b, s):
            return grouped_matmul(a, b, s, impl=impl)
    else:
        if resolve_implementation(impl) != "mosaic":
            raise SystemExit(f"--grid-block-n, --block-k and --stages need the Mosaic kernel "
                             f"(impl {impl!r} resolves to {resolve_implementation(impl)!r})")

        def mm(a, b, s):
            return _mosaic_jit(a, b, s, **tiling)

    @jax.jit
    def grouped(x, h, wg, wu, wd, sizes):
        return mm(x, wg, sizes), mm(x, wu, sizes), mm(h, wd, sizes)

    @jax.jit
    def dense(x, h, dg, du, dd):
        return (jnp.dot(x, dg, preferred_element_type=jnp.float32).astype(dtype),
                jnp.dot(x, du, preferred_element_type=jnp.float32).astype(dtype),
                jnp.dot(h, dd, preferred_element_type=jnp.float32).astype(dtype))

    flops = 3 * 2.0 * m * hidden * inter
    t_grouped = _time(grouped, (x, h, wg, wu, wd, sizes), warmup, repeats)
    t_dense = _time(dense, (x, h, dg, du, dd), warmup, repeats)
    return dict(tokens=tokens, rows=m, hidden=hidden, intermediate=inter, experts=n_experts,
                top_k=top_k, grid_block_n=grid_block_n, block_k=block_k, stages=stages,
                flops=flops,
                grouped_ms=t_grouped * 1e3, dense_ms=t_dense * 1e3,
                grouped_tflops=flops / t_grouped / 1e12, dense_tflops=flops / t_dense / 1e12,
                ratio=t_dense / t_grouped)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status."""
    preset = get_preset("qwen3-30b-a3b")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write results here")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--hidden", type=int, default=preset.hidden_size)
    p.add_argument("--intermediate", type=int, default=preset.expert_intermediate)
    p.add_argument("--experts", type=int, default=preset.n_experts)
    p.add_argument("--top-k", type=int, default=preset.top_k)
    p.add_argument("--impl", default=None, help="auto|mosaic|lax|tiled (default: auto)")
    p.add_argument("--grid-block-n", type=int, nargs="+", default=[None],
                   help="the Mosaic kernel's column bands to time (each a row per length; "
                        "default: the kernel's own choice)")
    p.add_argument("--block-k", type=int, nargs="+", default=[None],
                   help="the Mosaic kernel's k steps to time (a power of two >= 16)")
    p.add_argument("--stages", type=int, nargs="+", default=[None],
                   help="the Mosaic kernel's pipeline depths to time")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--min-ratio", type=float, default=0.0,
                   help="exit 1 if grouped/dense throughput falls below this (0.5 on the H200)")
    args = p.parse_args(argv)

    device = jax.devices()[0]
    impl = resolve_implementation(args.impl)
    results = []
    print(f"device {getattr(device, 'device_kind', device.platform)}, grouped impl {impl}, "
          f"H {args.hidden}, I {args.intermediate}, E {args.experts}, top-{args.top_k}")
    print(f"{'tokens':>7} {'rows':>8} {'grouped ms':>11} {'TFLOP/s':>8} {'dense ms':>9} "
          f"{'TFLOP/s':>8} {'ratio':>6}")
    for bk in args.block_k:
        if bk is not None and (bk < 16 or bk & (bk - 1)):
            p.error(f"--block-k {bk}: a power of two, at least 16")
    if any(st is not None and st < 1 for st in args.stages):
        p.error("--stages: each at least 1")
    for tokens in args.tokens:
        for gbn, bk, st in itertools.product(args.grid_block_n, args.block_k, args.stages):
            r = bench_one(tokens, args.hidden, args.intermediate, args.experts, args.top_k,
                          impl=args.impl, warmup=args.warmup, repeats=args.repeats,
                          grid_block_n=gbn, block_k=bk, stages=st)
            results.append(r)
            tiling = ", ".join(f"{k} {v}" for k, v in
                               (("grid_block_n", gbn), ("block_k", bk), ("stages", st)) if v)
            print(f"{r['tokens']:>7} {r['rows']:>8} {r['grouped_ms']:>11.3f} "
                  f"{r['grouped_tflops']:>8.1f} {r['dense_ms']:>9.3f} {r['dense_tflops']:>8.1f} "
                  f"{r['ratio']:>6.2f}" + (f"  ({tiling})" if tiling else ""))
    report = dict(device=str(getattr(device, "device_kind", device.platform)),
                  platform=device.platform, jax=jax.__version__, impl=impl,
                  warmup=args.warmup, repeats=args.repeats, statistic="median", results=results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    worst = min(r["ratio"] for r in results)
    if worst < args.min_ratio:
        print(f"FAIL: grouped/dense ratio {worst:.2f} < {args.min_ratio}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
