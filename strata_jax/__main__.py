"""`python -m strata_jax`: a prefill demo on a scaled-down preset.

Reads one prompt through the same model three ways — every expert resident,
every non-resident expert streamed (routed switch off), and the routed stream
— on the CPU backend's simulated link (or the GPU when JAX has one), prints
each arm's summary and checks that logits and KV cache are the same bytes.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m strata_jax", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-next-80b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--skew", type=float, default=None,
                    help="routing skew (default: the ~40%%-unrouted calibration)")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from strata_jax.config import get_preset
    from strata_jax.engine import Engine, sha256_of
    from strata_jax.stream import StreamConfig
    from strata_jax.synthetic import SKEW_40_PERCENT_512_TOP10, init_synthetic

    base = get_preset(args.preset)
    cfg = base.scaled(n_layers=args.layers, n_experts=args.experts,
                      top_k=min(base.top_k, args.experts), hidden_size=128,
                      expert_intermediate=64, max_seq_len=max(4096, args.tokens))
    skew = SKEW_40_PERCENT_512_TOP10 if args.skew is None else args.skew
    params = init_synthetic(cfg, seed=0, routing_skew=skew)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, args.tokens)
    print(f"model {cfg.name}: {cfg.n_layers} layers, {cfg.n_experts} experts top-{cfg.top_k}, "
          f"expert {cfg.expert_bytes / 2**10:.0f} KiB; prompt {args.tokens} tokens in chunks of "
          f"{args.chunk}; routing skew {skew}")
    arms = {
        "resident": None,
        "stream-all": StreamConfig(routed=False, backend=args.backend, sim_bandwidth=0.2e9),
        "routed": StreamConfig(routed=True, depth=args.depth, backend=args.backend,
                               sim_bandwidth=0.2e9),
    }
    hashes = {}
    for name, sc in tqdm(arms.items(), desc="arms", total=len(arms)):
        with Engine(cfg, params, sc, max_context=cfg.max_seq_len, chunk_size=args.chunk) as eng:
            r = eng.prefill(tokens)
            hashes[name] = (sha256_of(r.logits), sha256_of(r.session.cache))
            tqdm.write(f"{name:>10}: {r.summary()}")
    same = len(set(hashes.values())) == 1
    print(f"logits {hashes['resident'][0][:16]}..., kv {hashes['resident'][1][:16]}...: "
          f"{'identical in every arm' if same else 'DIFFERENT across arms'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
