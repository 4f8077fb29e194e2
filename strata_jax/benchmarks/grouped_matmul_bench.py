"""Grouped expert matmuls vs a dense matmul of the same M, all experts resident.

Guards against shipping a grouped matmul that is far from dense throughput (the default CUDA
`ragged_dot` runs at ~5 TFLOP/s): for a Qwen3-30B-A3B-shaped layer (H 2048, I 768, 128 experts,
top-8, uniform routing) it times the SwiGLU projections gate [M,H]x[H,I], up [M,H]x[H,I] and down
[M,I]x[I,H] as grouped matmuls over M = tokens * top_k rows sorted by expert, and the same three
products as dense bf16 matmuls with one weight matrix, then reports TFLOP/s of each and the ratio.
The bar on the H200 is grouped >= 50% of dense.

    python -m strata_jax.benchmarks.grouped_matmul_bench --json out.json

`grouped_matmul_bench sweep` times one layer's expert math per format at candidate tilings (512
experts of width 512, top-10, and Qwen3-30B-A3B's shape; `sweep`, gpu_moe512.sh; `--set gptoss`:
gpt-oss-120b's 128 experts of 2880 x 2880, top-4, bf16 and mxfp4).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

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


def _tiles(spec: str):
    """"jax" (the bf16 `ragged_dot_mgpu` kernel at the library's tiling) or
    "bm,bn,bk,stages,grid_block_n[,per_sm[,compute_wgs]]" -> MosaicTiles."""
    from strata_jax.kernels.mosaic import MosaicTiles
    return spec if spec == "jax" else MosaicTiles(*(int(v) for v in spec.split(",")))


def _random_planes(kind: str, e: int, k: int, n: int, seed: int):
    """A `QuantizedMatrix` [E, k, n] of random planes drawn on the device (a 512-expert layer
    quantized on the host would take minutes): fp8 e4m3 values and float32 block scales,
    int4 random bytes and float16 group scales, mxfp4 random bytes and e8m0 exponents 2**-9 ..
    2**-6 per 32 inputs."""
    from strata_jax.formats import MXFP4_GROUP, QuantizedMatrix
    key1, key2 = jax.random.split(jax.random.key(seed))
    if kind == "fp8":
        q = jax.random.normal(key1, (e, k, n), jnp.float32).astype(jnp.float8_e4m3fn)
        s = jax.random.uniform(key2, (e, k // 128, n // 128), jnp.float32, 0.005, 0.02)
    elif kind == "mxfp4":
        q = jax.random.bits(key1, (e, k // 2, n), jnp.uint8)
        s = jax.random.randint(key2, (e, k // MXFP4_GROUP, n), 118, 122).astype(jnp.uint8)
        return QuantizedMatrix(q, s, kind, MXFP4_GROUP, (k, n), np.dtype(jnp.bfloat16))
    else:
        q = jax.random.bits(key1, (e, k // 2, n), jnp.uint8)
        s = jax.random.uniform(key2, (e, k // 128, n), jnp.float32, 0.002, 0.01
                               ).astype(jnp.float16)
    return QuantizedMatrix(q, s, kind, 128, (k, n), np.dtype(jnp.bfloat16))


def sweep(shapes, tokens_list, candidates, *, warmup: int, repeats: int, batch: int,
          budget_s: float, out=None) -> list[dict]:
    """Times one MoE layer's expert math (gate and up [M,H]x[H,I], SwiGLU, down [M,I]x[I,H])
    per format at each candidate tiling, and the three dense products of the same rows.

    shapes: (experts, hidden, intermediate, top_k) each; candidates: {format: [spec, ...]}
    (`_tiles`; bf16 "jax" is the `ragged_dot_mgpu` kernel; fp8/int4 the kernels of
    `kernels.mosaic`, mxfp4 `kernels.mosaic_mxfp4`'s; "auto" what `grouped_matmul` picks
    (mxfp4: dequantized first), "fused" what it reads with quantized_matmul="fused"; "A/B"
    tiling A for gate and up, B for down). Two experts get no rows and NaN weights. Each row
    says whether its output has the bits of the reference: the bf16 "jax" kernel over the
    weights (for fp8, int4 and mxfp4, over the dequantized weights), or where its 128-column
    tiles do not cover the widths (gpt-oss's 2880) this package's bf16 kernel at the mxfp4
    kernel's 64-column tiling. Stops starting rows after budget_s seconds;
    each row is also written to `out` (a file) as a JSON line."""
    from strata_jax.kernels.grouped import _mosaic_jit
    from strata_jax.kernels.mosaic import mosaic_bf16_grouped_matmul, mosaic_grouped_matmul
    from strata_jax.kernels.mosaic_int4 import mosaic_int4_grouped_matmul
    from strata_jax.kernels.mosaic_mxfp4 import (
        MOSAIC_MXFP4_NARROW_TILES, mosaic_mxfp4_grouped_matmul
    )
    t_start = time.perf_counter()
    rows = []

    def swiglu(mm):
        def layer(x, w, s):
            g, u = mm(x, w[0], s), mm(x, w[1], s)
            h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
            return mm(h, w[2], s)
        return jax.jit(layer)

    def kernel(fmt, spec):
        if spec == "jax":
            return lambda a, b, c: _mosaic_jit(a, b, c)
        if spec == "auto":  # what the library picks
            return grouped_matmul
        if spec == "fused":  # what the library reads a quantized matrix with, asked to fuse
            return lambda a, b, c: grouped_matmul(a, b, c, quantized="fused")
        if "/" in spec:  # gate's and up's tiling / down's
            wide, tall = (kernel(fmt, part) for part in spec.split("/"))
            return lambda a, b, c: (wide if b.shape[-2] > b.shape[-1] else tall)(a, b, c)
        t = _tiles(spec)
        fn = {"bf16": mosaic_bf16_grouped_matmul, "fp8": mosaic_grouped_matmul,
              "int4": mosaic_int4_grouped_matmul, "mxfp4": mosaic_mxfp4_grouped_matmul}[fmt]
        return lambda a, b, c: fn(a, b, c, tiles=t)

    def emit(r):
        rows.append(r)
        print(json.dumps(r), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(r) + "\n")

    for e, hid, inter, top_k in shapes:
        mats = ((hid, inter, 0), (hid, inter, 1), (inter, hid, 2))
        wb = tuple((jax.random.normal(jax.random.key(10 + i), (e, a, b), jnp.float32) * 0.02
                    ).astype(jnp.bfloat16) for a, b, i in mats)
        quant = {kind: tuple(_random_planes(kind, e, a, b, 20 + i) for a, b, i in mats)
                 for kind in ("fp8", "int4", "mxfp4") if candidates.get(kind)}
        poison = jnp.arange(e) < 2  # experts 0 and 1: no rows, NaN weights

        def poisoned(w):
            return jnp.where(poison[:, None, None], jnp.nan, w).astype(w.dtype)

        weights = {"bf16": tuple(poisoned(w) for w in wb)}
        for kind, ws in quant.items():
            weights[kind] = tuple(dataclasses.replace(w, scale=poisoned(w.scale)) for w in ws)
        if hid % 128 == 0 and inter % 128 == 0:
            reference = swiglu(lambda a, b, c: _mosaic_jit(a, b, c))
        else:  # jax's kernel tiles 128 columns: this package's at the mxfp4 kernel's 64
            reference = swiglu(lambda a, b, c: mosaic_bf16_grouped_matmul(
                a, b, c, tiles=MOSAIC_MXFP4_NARROW_TILES))
        for tokens in tokens_list:
            m = tokens * top_k
            sizes = np.zeros(e, np.int32)
            sizes[2:] = uniform_group_sizes(tokens, e - 2, top_k)
            sizes = jnp.asarray(sizes)
            x = jax.random.normal(jax.random.key(1), (m, hid), jnp.bfloat16)
            h = jax.random.normal(jax.random.key(2), (m, inter), jnp.bfloat16)
            flops = 3 * 2.0 * m * hid * inter
            dense = jax.jit(lambda x, h, a, b, c: (x @ a, x @ b, h @ c))
            t_dense = _time(dense, (x, h, wb[0][2], wb[1][2], wb[2][2]), warmup, repeats, batch)
            base = dict(experts=e, hidden=hid, intermediate=inter, top_k=top_k, tokens=tokens,
                        rows=m, rows_per_expert=m / (e - 2))
            emit(dict(base, format="dense", ms=t_dense * 1e3,
                      tflops=flops / t_dense / 1e12))
            for fmt, specs in candidates.items():
                if fmt not in weights:
                    continue
                wref = weights[fmt] if fmt == "bf16" else tuple(
                    poisoned(w.dequantize()) for w in weights[fmt])
                want = reference(x, wref, sizes)
                del wref
                for spec in specs:
                    if time.perf_counter() - t_start > budget_s:
                        emit(dict(base, format=fmt, tiles=spec, error="out of time budget"))
                        continue
                    try:
                        f = swiglu(kernel(fmt, spec))
                        got = f(x, weights[fmt], sizes)
                        same = bool(jnp.all(got == want))
                        finite = bool(jnp.all(jnp.isfinite(got)))
                        t = _time(f, (x, weights[fmt], sizes), warmup, repeats, batch)
                    except Exception as ex:  # noqa: BLE001 - a tiling that fails is reported
                        emit(dict(base, format=fmt, tiles=spec,
                                  error=f"{type(ex).__name__}: {ex}"[:400]))
                        continue
                    emit(dict(base, format=fmt, tiles=spec, ms=t * 1e3,
                              tflops=flops / t / 1e12, over_dense=t / t_dense,
                              same_bits=same, finite=finite))
                del want
        del wb, quant, weights
    return rows


SWEEP_512 = {
    "bf16": ["jax", "128,128,64,4,8", "64,128,64,4,8", "64,128,64,3,8,2", "64,256,64,4,8",
             "64,128,128,3,8", "128,128,64,4,8,1,2", "128,256,64,3,8,1,2",
             "256,128,64,3,8,1,2"],
    "fp8": ["128,128,128,3,8", "256,128,64,3,8,1,2", "64,128,128,3,8", "64,128,64,3,8,2",
            "128,128,64,3,8,1,2"],
    "int4": ["128,128,64,3,8,2", "64,128,64,3,8,2", "64,128,64,4,8"],
    "mxfp4": ["auto", "fused", "64,128,64,3,8,2", "128,64,64,3,16,2"],
}
SWEEP_128 = {
    "bf16": ["jax", "128,128,64,4,8", "64,128,64,4,8", "128,128,64,4,8,1,2",
             "256,128,64,3,8,1,2"],
    "fp8": ["128,128,128,3,8", "256,128,64,3,8,1,2", "64,128,128,3,8"],
    "int4": ["128,128,64,3,8,2", "64,128,64,3,8,2"],
    "mxfp4": ["auto", "fused", "128,64,64,3,16,2", "128,128,64,4,8,1"],
}
# gpt-oss-120b's experts (2880 = 45 x 64 wide both ways): bf16 as grouped_matmul reads it (row
# tiles: jax's kernel tiles 128 columns) and at 64-column tiles of this package's kernel; mxfp4
# dequantized first, fused, and at other tilings.
SWEEP_GPTOSS = {
    "bf16": ["auto", "128,64,64,4,16", "128,64,64,3,16,2"],
    "mxfp4": ["auto", "fused", "128,64,64,4,16,1", "64,64,64,3,16,2", "256,64,64,3,16,1"],
}


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status."""
    from strata_jax.models import get_preset

    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "sweep":  # the tiling sweep (gpu_moe512.sh): sweep --help
        q = argparse.ArgumentParser(prog="grouped_matmul_bench sweep",
                                    description=sweep.__doc__.split("\n\n")[0])
        q.add_argument("--set", choices=("512", "128", "both", "gptoss"), default="both",
                       help="512 experts of width 512 top-10 (H 2048), Qwen3-30B-A3B's 128 "
                            "of width 768 top-8, both, or gpt-oss-120b's 128 of 2880 x 2880 "
                            "top-4 (--formats bf16,mxfp4 --tokens 1024 4096 8192)")
        q.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
        q.add_argument("--formats", default="bf16,fp8,int4",
                       help="comma list of bf16|fp8|int4|mxfp4")
        q.add_argument("--warmup", type=int, default=2)
        q.add_argument("--repeats", type=int, default=5)
        q.add_argument("--batch", type=int, default=5)
        q.add_argument("--budget-s", type=float, default=1e9)
        q.add_argument("--out", default=None, help="append each row here as a JSON line")
        q.add_argument("--cand", action="append", default=[], metavar="FORMAT=SPEC",
                       help="time these instead of the set's candidates (repeatable; SPEC: "
                            "jax | auto | fused | bm,bn,bk,stages,grid_block_n[,per_sm[,wgs]] | "
                            "A/B)")
        a = q.parse_args(argv[1:])
        fmts = a.formats.split(",")
        chosen = {}
        for c in a.cand:
            fmt, spec = c.split("=", 1)
            chosen.setdefault(fmt, []).append(spec)
        sets = {"512": [((512, 2048, 512, 10), chosen or SWEEP_512)],
                "128": [((128, 2048, 768, 8), chosen or SWEEP_128)],
                "gptoss": [((128, 2880, 2880, 4), chosen or SWEEP_GPTOSS)]}
        todo = sets["512"] + sets["128"] if a.set == "both" else sets[a.set]
        print(f"jax {jax.__version__} {jax.devices()}", flush=True)
        t0 = time.perf_counter()
        for shape, cands in todo:
            sweep([shape], a.tokens, {f: c for f, c in cands.items() if f in fmts},
                  warmup=a.warmup, repeats=a.repeats, batch=a.batch,
                  budget_s=a.budget_s - (time.perf_counter() - t0), out=a.out)
        return 0
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
