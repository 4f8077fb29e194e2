"""`strata-jax demo` (the default): one prompt through a scaled-down preset three ways
(every expert resident, stream-all, routed) and whether the logits and KV cache agree.
"""

from __future__ import annotations

import sys
import time

from strata_jax.cli.checks import _check_plan
from strata_jax.cli.common import (UsageError, _context, _Log, _Model, _resolve_backend,
                                   random_prompt)
from strata_jax.cli.prefill import _skip_note
from strata_jax.engine import Engine, sha256_of
from strata_jax.kernels import Kernels
from strata_jax.stream import StreamConfig, StreamTuning
from strata_jax.stream.config import _env_depth
from strata_jax.synthetic import SKEW_40_PERCENT_512_TOP10

# The simulated link's pace in the demo (cpu backend, no --sim-bandwidth): one MoE layer's expert
# copies take LINK_TO_COMPUTE times the layer's compute, measured on the resident arm, as
# Qwen3-30B-A3B's do on the H200 at 8K tokens (55 GB/s: 174 ms of copies over 32.7 ms of compute,
# docs/BENCHMARKS.md), where the routed stream skipped 69% of the unrouted experts. A link that
# outruns the compute (any fixed rate on a slow CPU) has every copy issued before its layer's
# routing lands, and the routed arm skips nothing. At 1K tokens the H200's ratio is about 20:
# a demo at that pace would mostly wait.
LINK_TO_COMPUTE = 5.0


def demo_bandwidth(cfg, compute_s: float, ratio: float = LINK_TO_COMPUTE) -> float:
    """The simulated link's bytes/s at which one MoE layer's streamed experts (all of them: the
    demo keeps none resident) take `ratio` times the layer's share of `compute_s`, a prefill's
    time with every expert resident."""
    layers = len(cfg.moe_layers)
    return layers * cfg.n_experts * cfg.expert_bytes / (ratio * max(compute_s, 1e-9))


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
    # The simulated link's pace: --sim-bandwidth where given, else LINK_TO_COMPUTE times the
    # compute, timed on the resident arm (which runs first).
    measure = backend == "cpu" and args.sim_bandwidth is None
    link = {} if args.sim_bandwidth is None else {"sim_bandwidth": args.sim_bandwidth * 1e9}
    # On the CPU every arm reads the experts with the row-tiled grouped matmul: lax.ragged_dot's
    # CPU lowering (the CPU's "auto") multiplies every row by every expert's weights, which made
    # the demo's compute ten times longer or more. One kernel in every arm: the same bits.
    kernels = Kernels(grouped_matmul="tiled") if backend == "cpu" else Kernels()
    pace = ("" if backend != "cpu" else " (simulated link: set from the resident arm's compute)"
            if measure else f" (simulated link {args.sim_bandwidth:g} GB/s)")
    print(f"model {cfg.name}: {cfg.n_layers} layers, {cfg.n_experts} experts top-{cfg.top_k}, "
          f"expert {cfg.expert_bytes / 2**10:.0f} KiB; prompt {args.tokens} tokens in chunks of "
          f"{args.chunk}; routing skew {skew}; backend {backend}{pace}"
          + ("; grouped matmul tiled" if backend == "cpu" else ""), flush=True)
    _, params, _ = model.weights(log)
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
    arms = {"resident": None, "stream-all": False, "routed": True}  # the routed switch
    hashes = {}
    print("each arm's first prefill; its time includes compiling the chunk programs:", flush=True)
    with log.bar(desc="arms", total=len(arms)) as bar:
        for name, routed in arms.items():
            # Made when its arm runs: the link's pace may come from the resident arm.
            sc = None if routed is None else StreamConfig(
                routed=routed, depth=depth if routed else None, backend=backend,
                tuning=StreamTuning(**link))
            with Engine(cfg, params, sc, max_context=max_context, chunk_size=args.chunk,
                        device=None if sc else resident_device, kernels=kernels) as eng:
                r = eng.prefill(tokens)
                hashes[name] = (sha256_of(r.logits), sha256_of(r.session.cache))
                bar.write(f"{name:>10}: {r.summary()}", file=sys.stdout)
                if sc is None and measure:
                    start = time.perf_counter()
                    eng.prefill(tokens)  # compiled now: the compute alone
                    compute = time.perf_counter() - start
                    link["sim_bandwidth"] = demo_bandwidth(cfg, compute)
                    per_layer = compute / len(cfg.moe_layers)
                    bar.write(f"{'':>10}  simulated link {link['sim_bandwidth'] / 1e9:.3g} GB/s: "
                              f"a layer's {cfg.n_experts} expert copies take "
                              f"{LINK_TO_COMPUTE:g}x its compute ({per_layer * 1e3:.0f} ms, "
                              "timed on a second resident prefill), as on an H200 at 8K tokens",
                              file=sys.stdout)
                note = (_skip_note(r, f"depth {eng.streamer.stream.depth}")
                        if eng.streamer is not None else None)
                if note:
                    bar.write(f"{'':>10}  {note}", file=sys.stdout)
                bar.update(1)
    same = len(set(hashes.values())) == 1
    print(f"logits {hashes['resident'][0][:16]}..., kv {hashes['resident'][1][:16]}...: "
          f"{'identical in every arm' if same else 'DIFFERENT across arms'}")
    return 0 if same else 1
