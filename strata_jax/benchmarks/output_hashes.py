"""Hashes of every arm's outputs over a fixed set of models: run it before and after a change
that must keep the outputs' bits, and compare the two JSON files.

    python -m strata_jax.benchmarks.output_hashes --json before.json [--backend cuda]

Each case is a scaled preset (or one with quantized experts) with synthetic weights, read
resident, stream-all and routed, in one chunk and in several, chunk-major and layer-major; a
row is the SHA-256 of the logits, of the whole KV cache and of its valid positions. On a GPU (`--backend cuda`) the arms run
on the GPU; on the CPU through the simulated link.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np

import strata_jax as sj
from strata_jax.formats import quantized_config
from strata_jax.weights import QuantizedParams

CASES = (  # (preset, expert format, n_experts) of the scaled models
    ("qwen3-30b-a3b", "plain", 16), ("mixtral-8x7b", "plain", 8), ("olmoe-1b-7b", "plain", 16),
    ("deepseek-v3", "plain", 16), ("qwen3-next-80b-a3b", "plain", 32),
    ("qwen3-30b-a3b", "fp8", 16), ("qwen3-30b-a3b", "int4", 16),
)


def _sha(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        if isinstance(a, (tuple, list)):
            h.update(_sha(*a).encode())
            continue
        if hasattr(a, "keys") and hasattr(a, "values") and not hasattr(a, "shape"):
            h.update(_sha(*a).encode())
            continue
        a = np.asarray(a)
        h.update(str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
    return h.hexdigest()


def _case(preset: str, fmt: str, n_experts: int, dtype: str):
    cfg = sj.get_preset(preset).scaled(n_experts=n_experts, top_k=min(4, n_experts),
                                       hidden_size=128, expert_intermediate=128,
                                       param_dtype=dtype)
    params = sj.SyntheticParams(cfg, seed=1)
    if fmt != "plain":
        cfg = quantized_config(cfg, fmt, 32)
        params = QuantizedParams(params, cfg)
    return cfg, params


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", default=None)
    p.add_argument("--cases", default=None,
                   help="comma list of PRESET/FORMAT to run (default: every case)")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = {}
    wanted = None if a.cases is None else set(a.cases.split(","))
    for preset, fmt, e in CASES:
        if wanted is not None and f"{preset}/{fmt}" not in wanted:
            continue
        cfg, params = _case(preset, fmt, e, a.dtype)
        tokens = rng.integers(0, cfg.vocab_size, 200).astype(np.int32)
        arms = {"resident": None,
                "stream-all": sj.StreamConfig(routed=False, backend=a.backend,
                                              tuning=sj.StreamTuning(stream_floor=1)),
                "routed": sj.StreamConfig(routed=True, backend=a.backend)}
        for arm, sc in arms.items():
            for order, chunk in (("chunk-major", 256), ("chunk-major", 64), ("layer-major", 64)):
                dev = None if sc is not None else ("gpu" if a.backend == "cuda" else "cpu")
                with sj.Engine(cfg, params, sc, max_context=256, chunk_size=chunk,
                               order=order, device=dev) as eng:
                    r = eng.prefill(tokens)
                    key = f"{preset}/{fmt}/{arm}/{order}/{chunk}"
                    rows[key] = {"logits": _sha(r.logits), "cache": _sha(r.session.cache),
                                 "valid_cache": _sha(r.session.valid_cache())}
                    print(key, rows[key]["logits"][:16], rows[key]["cache"][:16], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    # Within a case, every arm must give the resident arm's bits at the same order and chunk:
    # the logits and the cache's valid positions (past them lie the padded writes' slack).
    bad = 0
    for key, row in rows.items():
        preset, fmt, arm, order, chunk = key.split("/")
        ref = rows[f"{preset}/{fmt}/resident/{order}/{chunk}"]
        if (row["logits"], row["valid_cache"]) != (ref["logits"], ref["valid_cache"]):
            bad += 1
            print(f"DIFFERENT from resident: {key}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
