"""Yardstick for layer-major numerics: how far layer-major logits sit from chunk-major, next to
how far the same model's bf16 logits sit from its float32 logits (the model's own rounding).

    python -m strata_jax.benchmarks.order_numerics [--tokens 2048 --chunk 512] [--full]

Uses stream_bench's synthetic weights and the 8-layer Qwen3-30B-shaped model (tiny widths unless
--full), every expert resident, on whatever JAX device is default. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def measure(tokens: int, chunk: int, layers: int = 8, full: bool = False, seed: int = 0) -> dict:
    from strata_jax.benchmarks.stream_bench import fast_params, model_config
    from strata_jax.engine import Engine

    cfg = model_config("qwen3-30b-a3b", layers, 4096, tokens, tiny=not full)
    params = fast_params(cfg, seed, 0.0)
    toks = np.random.default_rng(seed + 7).integers(0, cfg.vocab_size, tokens)

    def logits(c, p, order):
        with Engine(c, p, None, max_context=tokens, chunk_size=chunk, sub_chunk=chunk) as e:
            return np.asarray(e.prefill(toks, order=order).logits, np.float64)

    chunk_major = logits(cfg, params, "chunk-major")
    layer_major = logits(cfg, params, "layer-major")
    c32 = cfg.replace(param_dtype="float32")
    f32 = logits(c32, {k: np.asarray(v, np.float32) for k, v in params.items()}, "chunk-major")
    for name, a in (("chunk-major", chunk_major), ("layer-major", layer_major), ("float32", f32)):
        if not np.isfinite(a).all():
            raise FloatingPointError(f"{name} logits are not finite")
    return {"tokens": tokens, "chunk": chunk, "layers": layers, "dtype": cfg.param_dtype,
            "hidden": cfg.hidden_size, "max_abs_logit": float(np.abs(chunk_major).max()),
            "layer_vs_chunk_major": float(np.abs(layer_major - chunk_major).max()),
            "bf16_vs_float32": float(np.abs(chunk_major - f32).max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--full", action="store_true", help="the preset's full widths (a GPU job)")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.chunk < 1:
        ap.error("--tokens and --chunk must be at least 1")
    print(json.dumps(measure(args.tokens, args.chunk, args.layers, args.full)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
