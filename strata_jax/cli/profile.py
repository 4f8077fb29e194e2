"""`strata-jax profile`: prefills of several prompts, their routing counts saved as an
ExpertProfile (for `prefill --profile`), each layer's hottest experts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

from strata_jax.cli.checks import _check_budget, _check_plan
from strata_jax.cli.common import (UsageError, _backends, _context, _load_profile, _Log,
                                   _make_engine, _Model, _output_tokenizer, _prompts_given,
                                   _read_prompts, _stream_config)
from strata_jax.cli.prefill import _shown
from strata_jax.profile import ExpertProfile

HEAD = 8  # tokens shown of each prompt


def hottest(counts: np.ndarray, layers: Sequence[int], top: int) -> dict[int, list[list[int]]]:
    """Per MoE layer, the `top` most routed experts as [expert, count] pairs, hottest first."""
    out = {}
    for l in layers:
        order = np.argsort(-counts[l], kind="stable")[:top]
        out[int(l)] = [[int(e), int(counts[l, e])] for e in order]
    return out


def _input(tokens: np.ndarray, source: str, tokenizer) -> dict:
    """A prompt as the output shows it: its size, where it came from, its first HEAD ids and
    their text (None without a tokenizer)."""
    head = [int(t) for t in tokens[:HEAD]]
    return {"tokens": int(tokens.size), "source": source, "head": head,
            "head_text": tokenizer.decode(head) if tokenizer is not None else None}


def cmd_profile(args, log: _Log) -> int:

    model = _Model(args)
    model.require()
    # Prompt files and texts are read now; random prompts are drawn once the plan is known to
    # fit.
    prompts = _read_prompts(args, model, many=True) if _prompts_given(args) else None
    tokenizer = _output_tokenizer(model, log)
    sizes = [int(t.size) for t, _ in prompts] if prompts else [args.tokens] * args.prompts
    max_context = _context(args, model, max(sizes), "the longest prompt needs")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise UsageError(f"--out {args.out!r}: the directory {out_dir!r} does not exist")
    backend, device = _backends(args)
    _check_budget(args, model, backend)
    base = _load_profile(args.profile, model.config)
    stream = _stream_config(args, backend, base)
    model.check_host_memory(streamed=stream is not None)
    _check_plan(model, max_context=max_context, n_tokens=sum(sizes), chunk=args.chunk,
                sub_chunk=args.sub_chunk, backend=backend, stream=stream,
                devices=args.devices)
    prompts = prompts or _read_prompts(args, model, many=True)

    inputs = [_input(tokens, source, tokenizer) for tokens, source in prompts]
    if not args.json:
        print(model.describe())
        for i, d in enumerate(inputs):
            print(f"prompt {i + 1}: {d['source']}; first tokens: "
                  + ", ".join(_shown(d["head"], tokenizer))
                  + (", ..." if d["tokens"] > HEAD else ""), flush=True)
    cfg, params, experts = model.weights(log)
    profile = ExpertProfile.empty(cfg)
    total = 0
    engine = _make_engine(args, cfg, params, experts, stream, max_context, log, device,
                          model.weights_desc)
    with engine, log.bar(desc="profile prompts", total=len(prompts), unit="prompt") as bar:
        for tokens, _ in prompts:
            try:
                r = engine.prefill(tokens)
            except ValueError as e:
                raise UsageError(str(e).splitlines()[0]) from None
            profile.record(r)
            total += int(tokens.size)
            bar.update(1)
    try:
        profile.save(args.out)
    except OSError as e:
        raise UsageError(f"--out {args.out!r}: cannot write the profile ({e})") from None
    counts = np.asarray(profile.counts)
    hot = hottest(counts, cfg.moe_layers, args.top)
    if args.json:
        print(json.dumps({"out": args.out, "prompts": len(prompts), "tokens": total,
                          "model": model.summary(),
                          "hottest": {str(l): v for l, v in hot.items()}, "inputs": inputs,
                          "never_routed": {str(l): int((counts[l] == 0).sum())
                                           for l in cfg.moe_layers}}, sort_keys=True))
        return 0
    print(f"profile of {len(prompts)} prompts ({total} tokens) on {cfg.name} saved to {args.out}")
    print("hottest experts per layer (expert: share of the layer's routings):")
    for l in cfg.moe_layers:
        layer_total = max(int(counts[l].sum()), 1)
        items = ", ".join(f"{e}: {100 * c / layer_total:.1f}%" for e, c in hot[l])
        idle = int((counts[l] == 0).sum())
        print(f"  layer {l}: {items}; never routed: {idle} of {cfg.n_experts}")
    return 0
