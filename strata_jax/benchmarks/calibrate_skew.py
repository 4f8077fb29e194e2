"""Calibrates stream_bench's routing skew on the model's own hidden states, on the CPU.

BENCHMARK.md asks for a skewed setting that leaves about 40% of a 512-expert top-10 model's
streamed experts unrouted at ~1,000 tokens. The fraction depends on the hidden states reaching each
router, so this reads a prompt through the first `--layers` layers of the preset with
stream_bench's weights (`fast_params`) and prints each MoE layer's unrouted fraction per skew. The
expert width is cut (`--expert-width`): the first MoE layer's routing does not depend on it, later
layers' only through the expert outputs, and the CPU's dense `ragged_dot` needs the memory.

    python -m strata_jax.benchmarks.calibrate_skew --preset qwen3-next-80b-a3b --skews 0.3,0.4,0.52
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-next-80b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--expert-width", type=int, default=8)
    ap.add_argument("--skews", default="0.3,0.4,0.52")
    args = ap.parse_args(argv)

    from strata_jax.benchmarks.stream_bench import fast_params, model_config
    from strata_jax.engine import Engine

    cfg = model_config(args.preset, args.layers, args.vocab, args.tokens).replace(
        expert_intermediate=args.expert_width)
    prompt = np.random.default_rng(args.tokens).integers(0, cfg.vocab_size, args.tokens)
    rows = []
    for skew in (float(x) for x in args.skews.split(",")):
        params = fast_params(cfg, 0, skew)
        with Engine(cfg, params, None, max_context=args.tokens,
                    chunk_size=args.tokens) as eng:
            r = eng.prefill(prompt)
        frac = (r.counts == 0).mean(axis=1)
        row = {"skew": skew, "tokens": args.tokens, "unrouted_per_layer": frac.round(4).tolist(),
               "unrouted_mean": round(float(frac.mean()), 4)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del params
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
