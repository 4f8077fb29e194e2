"""The experts' grouped matmuls with quantized weights: the Mosaic GPU kernels vs
dequantize-then-matmul vs bf16, all experts resident.

For a preset's MoE layer (default Qwen3-30B-A3B: H 2048, I 768, 128 experts, top-8; uniform
routing) it times one layer's expert math (gate and up [M,H]x[H,I], silu(gate) * up, down
[M,I]x[I,H]; M = tokens * top_k rows sorted by expert) in these ways per format:
    bf16        the bf16 weights through `grouped_matmul` (the plain model's path);
    dequantize  the quantized planes dequantized to bf16, then the bf16 grouped matmuls;
    mosaic      the Mosaic GPU kernel at each tiling given (`--mosaic`; none given: the one
                the model reads the layer with, `model_mosaic_tiles`): fp8
                `kernels.mosaic.mosaic_grouped_matmul`; int4 `kernels.mosaic_int4`
                (k steps of half a scale group; its conversion, `int4_conversion`, in the
                row's "int_to_float"); mxfp4 `kernels.mosaic_mxfp4.mosaic_mxfp4_grouped_matmul`
                (k steps of one pack; by default each matrix at `mxfp4_tiles_for` its width,
                what quantized_matmul="fused" reads it with).
It reports each time over bf16's and dequantize's, whether a kernel's output has exactly the
dequantize path's bits, and its largest difference from them relative to the output's largest
magnitude (both read the same quantized values). Where jax's bf16 kernel does not tile the
widths (gpt-oss's 2880 columns) the bf16 and dequantize paths' matmul is row tiles (XLA's dot),
whose sums run in another order: same_bits is false there.

    python -m strata_jax.benchmarks.quant_matmul_bench --json out.json
    # gpt-oss-120b's MXFP4 experts (128 of 2880 x 2880, top-4): fused kernel vs dequantize
    python -m strata_jax.benchmarks.quant_matmul_bench --preset gpt-oss-120b --formats mxfp4 \
        --tokens 1024,4096,8192 --json mxfp4.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.benchmarks.grouped_matmul_bench import _random_planes, _time, uniform_group_sizes
from strata_jax.experts import ExpertWeights
from strata_jax.formats import MATRICES, QUANTIZE_CHOICES, ExpertFormat, quantized_config
from strata_jax.kernels.grouped import grouped_matmul
from strata_jax.kernels.mosaic import (
    MosaicTiles, fp8_tiles_for, mosaic_grouped_matmul, mosaic_supports
)
from strata_jax.kernels.mosaic_int4 import (
    int4_conversion, int4_tiles_for, mosaic_int4_grouped_matmul, mosaic_int4_supports
)
from strata_jax.kernels.mosaic_mxfp4 import (
    mosaic_mxfp4_grouped_matmul, mosaic_mxfp4_supports, mxfp4_tiles_for
)
from strata_jax.kernels.quantized import in_stored_order
from strata_jax.models import get_preset


def _swiglu(x, w, sizes, mm):
    g = mm(x, w.gate, sizes)
    u = mm(x, w.up, sizes)
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
    return mm(h, w.down, sizes)


def parse_mosaic(spec: str) -> MosaicTiles:
    """"bm,bn,bk,stages,grid_block_n[,per_sm[,compute_wgs]]" -> MosaicTiles."""
    parts = spec.split(",")
    if not 5 <= len(parts) <= 7:
        raise ValueError(f"--mosaic {spec!r}: expected bm,bn,bk,stages,grid_block_n"
                         "[,per_sm[,compute_wgs]]")
    return MosaicTiles(*(int(p) for p in parts))


def model_mosaic_tiles(kind: str, tokens: int, config) -> MosaicTiles | None:
    """The Mosaic tiling the model reads a `kind` layer of `tokens` tokens with (int4:
    `int4_tiles_for`, fp8: `fp8_tiles_for` its rows and experts; None for mxfp4, whose kernel
    takes `mxfp4_tiles_for` each matrix's width)."""
    if kind == "mxfp4":
        return None
    if kind.startswith("int4"):
        return int4_tiles_for(tokens * config.top_k, config.n_experts)
    return fp8_tiles_for(tokens * config.top_k, config.n_experts)


def bench_one(tokens: int, config, kind: str, *, warmup: int, repeats: int,
              mosaic: list[MosaicTiles] | None = None, per_matrix: bool = False,
              batch: int = 1) -> list[dict]:
    """The rows of one format at one length: bf16, dequantize, then the Mosaic kernel at each
    tiling of `mosaic` (None: the model's), each also per matrix with `per_matrix`."""
    m = tokens * config.top_k
    h, i, e = config.hidden_size, config.expert_intermediate, config.n_experts
    sizes = jnp.asarray(uniform_group_sizes(tokens, e, config.top_k))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, h), np.float32), jnp.bfloat16)
    # block 0: the checkpoints' 128 (fp8's block side, int4's group; mxfp4's 32)
    fmt = ExpertFormat.of(quantized_config(config.replace(param_dtype="bfloat16"), kind, 0))
    shapes = {"gate": (h, i), "up": (h, i), "down": (i, h)}
    if fmt.kind == "mxfp4":  # random codes and exponents drawn on the device (quantizing
        # gpt-oss-120b's layer on the host takes minutes); bf16: the same values
        wq = ExpertWeights(*(_random_planes("mxfp4", e, *shapes[mt], 20 + j)
                             for j, mt in enumerate(MATRICES)))
        wb = ExpertWeights(*(a.dequantize() for a in wq))
    else:
        w32 = ExpertWeights(*(rng.standard_normal((e, *shapes[mt]), np.float32) * 0.02
                              for mt in MATRICES))
        planes = {k: jnp.asarray(v) for k, v in fmt.quantize_np(w32).items()}
        wq = ExpertWeights(*(fmt.matrix(planes, mt, jnp.bfloat16) for mt in MATRICES))
        wb = ExpertWeights(*(jnp.asarray(a, jnp.bfloat16) for a in w32))
        del w32

    bf16 = jax.jit(lambda x, w, s: _swiglu(x, w, s, grouped_matmul))
    deq = jax.jit(lambda x, w, s: _swiglu(
        x, w, s, functools.partial(grouped_matmul, quantized="dequantize")))
    t_bf16 = _time(bf16, (x, wb, sizes), warmup, repeats, batch)
    want = deq(x, wq, sizes)
    t_deq = _time(deq, (x, wq, sizes), warmup, repeats, batch)
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    flops = 2 * m * h * i * 3
    rows = [dict(kind=kind, tokens=tokens, path="bf16", ms=t_bf16 * 1e3, over_bf16=1.0,
                 tflops=flops / t_bf16 / 1e12),
            dict(kind=kind, tokens=tokens, path="dequantize", ms=t_deq * 1e3,
                 over_bf16=t_deq / t_bf16, tflops=flops / t_deq / 1e12)]

    def timed(path, name, mm, **extra):
        """The row of one kernel (`mm(x, w, sizes)` for each matrix) on the layer."""
        fused = jax.jit(lambda x, w, s: _swiglu(
            x, w, s, lambda a, b, c: mm(*in_stored_order(a, b, c), c)))
        base = dict(kind=kind, tokens=tokens, path=path, tiles=name, **extra)
        try:
            got = fused(x, wq, sizes)
            diff = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            same = bool(jnp.all(got == want))
            finite = bool(jnp.all(jnp.isfinite(got)))
            tf = _time(fused, (x, wq, sizes), warmup, repeats, batch)
        except Exception as ex:  # noqa: BLE001 - a tiling that does not compile is reported
            return dict(base, error=f"{type(ex).__name__}: {ex}"[:600])
        return dict(base, ms=tf * 1e3, over_bf16=tf / t_bf16, over_dequantize=tf / t_deq,
                    tflops=flops / tf / 1e12, finite=finite, same_bits=same,
                    max_diff_over_max=diff / scale)

    # per_matrix: gate's (as up's) and down's matmul alone, bf16 and each Mosaic tiling
    inputs = {"gate": x, "down": jnp.asarray(rng.standard_normal((m, i), np.float32),
                                             jnp.bfloat16)} if per_matrix else {}
    t_matrix = {}
    for mt, xin in inputs.items():
        f = jax.jit(lambda a, b, c: grouped_matmul(a, b, c))
        t_matrix[mt] = _time(f, (xin, getattr(wb, mt), sizes), warmup, repeats, batch)
        rows.append(dict(kind=kind, tokens=tokens, path="bf16", matrix=mt,
                         ms=t_matrix[mt] * 1e3, over_bf16=1.0))

    def timed_matrices(name, mm, **extra):
        """Rows of one kernel (`mm(x, w, sizes)`) on each matrix alone."""
        out = []
        for mt, xin in inputs.items():
            f = jax.jit(lambda a, b, c: mm(a, b, c))
            try:
                t = _time(f, (xin, getattr(wq, mt), sizes), warmup, repeats, batch)
            except Exception as ex:  # noqa: BLE001 - reported as timed() does
                out.append(dict(kind=kind, tokens=tokens, path="mosaic", tiles=name,
                                matrix=mt, error=f"{type(ex).__name__}: {ex}"[:600], **extra))
                continue
            out.append(dict(kind=kind, tokens=tokens, path="mosaic", tiles=name, matrix=mt,
                            ms=t * 1e3, over_bf16=t / t_matrix[mt], **extra))
        return out

    def tiles_name(tiles):
        return ",".join(str(int(v)) for v in dataclasses.astuple(tiles))

    for tiles in ([model_mosaic_tiles(kind, tokens, config)] if mosaic is None else mosaic):
        if fmt.kind == "mxfp4":  # None: each matrix at mxfp4_tiles_for its width
            each = [tiles or mxfp4_tiles_for(a.shape[1]) for a in wq]
            name = "/".join(dict.fromkeys(tiles_name(t) for t in each))
            if not all(mosaic_mxfp4_supports(a, t) for a, t in zip(wq, each)):
                rows.append(dict(kind=kind, tokens=tokens, path="mosaic", tiles=name,
                                 error="unsupported (mxfp4 reads block_k 64 with one compute "
                                       "warpgroup, block_n dividing each matrix's columns)"))
                continue
            def mm(a, b, c, tiles=tiles):
                return mosaic_mxfp4_grouped_matmul(a, b, c, tiles=tiles)
            rows.append(timed("mosaic", name, mm))
            rows.extend(timed_matrices(name, mm))
            continue
        name = tiles_name(tiles)
        if fmt.kind == "int4":
            if not all(mosaic_int4_supports(a.stored(), tiles) for a in wq):
                rows.append(dict(kind=kind, tokens=tokens, path="mosaic", tiles=name,
                                 error="unsupported (int4 reads block_k 64 with one "
                                       "compute warpgroup, groups k // 128)"))
                continue
            conv = int4_conversion(jnp.bfloat16, wq.gate.scale.dtype)
            def mm(a, b, c, tiles=tiles):
                return mosaic_int4_grouped_matmul(a, b, c, tiles=tiles)
            rows.append(timed("mosaic", name, mm, int_to_float=conv))
            rows.extend(timed_matrices(name, mm, int_to_float=conv))
            continue
        if not all(mosaic_supports(a, tiles) for a in wq):
            rows.append(dict(kind=kind, tokens=tokens, path="mosaic", tiles=name,
                             error="unsupported"))
            continue
        def mm(a, b, c, tiles=tiles):
            return mosaic_grouped_matmul(a, b, c, tiles=tiles)
        rows.append(timed("mosaic", name, mm))
        rows.extend(timed_matrices(name, mm))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="mxfp4 (gpt-oss-120b's experts, 128 of 2880 x 2880, top-4; the fused kernel "
               "against dequantize-first and bf16):\n  python -m "
               "strata_jax.benchmarks.quant_matmul_bench --preset gpt-oss-120b --formats mxfp4 "
               "--tokens 1024,4096,8192 --json mxfp4.json\n  (add --mosaic 128,64,64,3,16,2 ... "
               "to time other tilings; 2880 columns take bn 64)")
    p.add_argument("--preset", default="qwen3-30b-a3b",
                   help="the layer's shape (gpt-oss-120b: mxfp4's model)")
    p.add_argument("--tokens", default="1024,4096,8192")
    p.add_argument("--formats", default="fp8,int4",
                   help="comma list of " + "|".join(QUANTIZE_CHOICES) + " (int4-zp: with "
                        "zero-points; int4-act: act-order, rows stored in group order, each path "
                        "reading the inputs gathered into that order; mxfp4: e2m1 codes and e8m0 "
                        "scales, its kernel what quantized_matmul=fused reads it with)")
    p.add_argument("--mosaic", action="append", default=[],
                   help='a Mosaic kernel tiling (default: the one the model reads the layer '
                        'with) "bm,bn,bk,stages,grid_block_n[,per_sm[,compute_wgs]]" '
                        "(repeatable; int4 takes those with bk 64 and one compute warpgroup; "
                        "mxfp4 those with bk 64, one compute warpgroup and bn dividing each "
                        "matrix's columns (2880: 64); compute_wgs 2, fp8 with bk 64: two compute "
                        "warpgroups on halves of bm rows sharing each converted weight tile)")
    p.add_argument("--per-matrix", action="store_true",
                   help="also time gate's (as up's) and down's matmul alone, bf16 and each "
                        "Mosaic tiling (rows with 'matrix')")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--batch", type=int, default=10,
                   help="calls a sample dispatches before it waits (its time / batch): the "
                        "host's dispatch and wake are paid once a sample")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    config = get_preset(a.preset)
    try:
        mosaic = [parse_mosaic(s) for s in a.mosaic] or None  # None: the model's tiling
        if a.batch < 1:
            raise ValueError(f"--batch {a.batch}: at least 1")
        for kind in a.formats.split(","):
            if kind not in QUANTIZE_CHOICES:
                raise ValueError(f"--formats: {kind!r} is not one of "
                                 f"{'|'.join(QUANTIZE_CHOICES)}")
    except ValueError as e:  # a malformed tiling: the usage error names it
        p.error(str(e))
    rows = []
    print(f"jax {jax.__version__} {jax.devices()}", flush=True)
    for kind in a.formats.split(","):
        for tokens in (int(t) for t in a.tokens.split(",")):
            for r in bench_one(tokens, config, kind, warmup=a.warmup, repeats=a.repeats,
                               mosaic=mosaic, per_matrix=a.per_matrix, batch=a.batch):
                print(json.dumps(r), flush=True)
                rows.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"jax": jax.__version__, "device": str(jax.devices()[0]), "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
