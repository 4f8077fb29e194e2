"""`strata-jax score`: the log-probability of each token of a prompt given the ones before it,
computed on the device chunk by chunk (`Engine.score`), with its sum and perplexity; the same
model and stream options as `prefill`; `--json` prints one JSON object.
"""

from __future__ import annotations

import json

from .checks import _check_budget, _check_plan
from .common import (UsageError, _backends, _context, _jsonable, _load_profile, _Log,
                     _make_engine, _Model, _read_prompts, _stream_config)
from .prefill import _arm, _backend_text, _compiled_note, _routed_depth, _skip_note


def cmd_score(args, log: _Log) -> int:
    model = _Model(args)
    model.require()
    # A prompt file is read now; a random prompt is drawn once the plan is known to fit.
    files = _read_prompts(args, model, many=False) if args.prompt_file else None
    needed = int(files[0][0].size) if files else args.tokens
    if needed < 2:
        raise UsageError(f"a prompt of {needed} token has nothing to score (each token is "
                         "scored given the ones before it); give at least 2 tokens")
    max_context = _context(args, model, needed, "the prompt needs")
    backend, device = _backends(args)
    _check_budget(args, model, backend)
    profile = _load_profile(args.profile, model.config)
    stream = _stream_config(args, backend, profile)
    depth = _routed_depth(stream)
    model.check_host_memory(streamed=stream is not None)
    _check_plan(model, max_context=max_context, n_tokens=needed, chunk=args.chunk,
                sub_chunk=args.sub_chunk, backend=backend, stream=stream)
    (tokens, prompt_text), = files or _read_prompts(args, model, many=False)

    if not args.json:
        print(model.describe())
        print(f"arm {_arm(args)}" + (f" (depth {depth})" if depth is not None else "")
              + f", backend {_backend_text(args, backend, device)}; chunk {args.chunk or 'auto'}, "
              f"order {args.order}")
        print(f"prompt: {prompt_text}", flush=True)
    cfg, params, experts = model.weights(log)
    engine = _make_engine(args, cfg, params, experts, stream, max_context, log, device,
                          model.weights_desc)
    with engine:
        before = int(engine.compilations)
        with log.bar(desc="score", total=int(tokens.size), unit="tok") as bar:
            try:
                result = engine.score(tokens, progress=log.progress(bar))
            except ValueError as e:
                raise UsageError(str(e).splitlines()[0]) from None
        out = _jsonable(result.to_dict())
        out["compiled"] = int(engine.compilations) - before  # programs compiled by this call
        out.update(arm=_arm(args), backend=backend if args.stream else "resident",
                   model=model.summary(), profile=args.profile,
                   compilations=int(engine.compilations),
                   depth=(int(engine.streamer.stream.depth)
                          if engine.streamer is not None and engine.streamer.stream.routed
                          else None))

    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(result.summary())
    skips = _skip_note(result, f"depth {depth}")
    for line in (_compiled_note(out["compiled"]), result.fallback and f"note: {result.fallback}",
                 skips and f"  {skips}"):
        if line:
            print(line)
    print(f"sum log-probability {result.sum_logprob:.4f} nats over {result.scored} tokens "
          f"(perplexity {result.perplexity:.6g})")
    print(f"logprobs sha256 {out['logprobs_sha256'][:16]}..., kv sha256 "
          f"{out['kv_sha256'][:16]}...")
    if args.logprobs:
        print("logprobs (token i+1 given tokens 0..i): "
              + " ".join(f"{x:.4f}" for x in result.logprobs))
    return 0
