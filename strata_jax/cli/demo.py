"""`strata-jax demo` (the default): one prompt through a scaled-down preset three ways
(every expert resident, stream-all, routed) and whether the logits and KV cache agree.
"""

from __future__ import annotations

import sys

from strata_jax.cli.checks import _check_plan
from strata_jax.cli.common import (
    UsageError,
    _context,
    _Log,
    _Model,
    _resolve_backend,
    random_prompt,
)
from strata_jax.cli.prefill import _skip_note
from strata_jax.engine import Engine, sha256_of
from strata_jax.stream import StreamConfig, StreamTuning
from strata_jax.stream.config import _env_depth
from strata_jax.synthetic import SKEW_40_PERCENT_512_TOP10


def cmd_demo(args, log: _Log) -> int:

    args.checkpoint = None
    model = _Model(args)
    max_context = _context(args, model, args.tokens, "the prompt needs")
    backend = _resolve_backend(args.backend)
    model.check_host_memory()
    # The resident arm's plan: every weight on the device (the arms run one at a time).
    _check_plan(model, max_context=max_context, n_tokens=args.tokens, chunk=args.chunk,
                sub_chunk=None, backend=backend, stream=None)
    cfg = model.config
    skew = SKEW_40_PERCENT_512_TOP10 if args.skew is None else args.skew
    tokens = random_prompt(cfg.vocab_size, args.tokens, args.seed, 10)
    print(f"model {cfg.name}: {cfg.n_layers} layers, {cfg.n_experts} experts top-{cfg.top_k}, "
          f"expert {cfg.expert_bytes / 2**10:.0f} KiB; prompt {args.tokens} tokens in chunks of "
          f"{args.chunk}; routing skew {skew}; backend {backend}"
          + (f" (simulated link {args.sim_bandwidth:g} GB/s)" if backend == "cpu" else ""),
          flush=True)
    _, params, _ = model.weights(log)
    link = dict(sim_bandwidth=args.sim_bandwidth * 1e9)
    resident_device = "gpu" if backend == "cuda" else "cpu"  # the arms compare on one device
    # Each arm says what it is (routed=False/True), so STRATA_PREFILL_ROUTED_STREAM changes
    # none (the engine warns where it is set otherwise). The routed arm's depth: --depth where
    # given (it wins over the environment), else STRATA_PREFILL_ROUTED_STREAM_DEPTH where set
    # (depth=None reads it), else the demo's 4.
    try:
        depth = args.depth if args.depth is not None else (None if _env_depth() is not None
                                                           else 4)
    except ValueError as e:
        raise UsageError(str(e)) from None
    arms = {
        "resident": None,
        "stream-all": StreamConfig(routed=False, backend=backend, tuning=StreamTuning(**link)),
        "routed": StreamConfig(routed=True, depth=depth, backend=backend,
                               tuning=StreamTuning(**link)),
    }
    hashes = {}
    print("each arm's first prefill; its time includes compiling the chunk programs:", flush=True)
    with log.bar(desc="arms", total=len(arms)) as bar:
        for name, sc in arms.items():
            with Engine(cfg, params, sc, max_context=max_context, chunk_size=args.chunk,
                        device=None if sc else resident_device) as eng:
                r = eng.prefill(tokens)
                hashes[name] = (sha256_of(r.logits), sha256_of(r.session.cache))
                bar.write(f"{name:>10}: {r.summary()}", file=sys.stdout)
                note = (_skip_note(r, f"depth {eng.streamer.stream.depth}")
                        if eng.streamer is not None else None)
                if note:
                    bar.write(f"{'':>10}  {note}", file=sys.stdout)
                bar.update(1)
    same = len(set(hashes.values())) == 1
    print(f"logits {hashes['resident'][0][:16]}..., kv {hashes['resident'][1][:16]}...: "
          f"{'identical in every arm' if same else 'DIFFERENT across arms'}")
    return 0 if same else 1
