"""`strata-jax score`: the log-probability of each token of a prompt given the ones before it,
computed on the device chunk by chunk (`Engine.score`), with its sum, perplexity and top-1
accuracy (how often the token was the model's most likely one); the same
model and stream options as `prefill`; `--json` prints one JSON object.
"""

from __future__ import annotations

import json

from strata_jax.cli.common import UsageError, _jsonable, _Log
from strata_jax.cli.prefill import _engine, _prepare, _print_notes, _run_fields


def cmd_score(args, log: _Log) -> int:
    read = _prepare(args, scoring=True)
    _, engine = _engine(args, read, log)
    with engine:
        before = int(engine.compilations)
        with log.bar(desc="score", total=int(read.tokens.size), unit="tok") as bar:
            try:
                result = engine.score(read.tokens, progress=log.progress(bar))
            except ValueError as e:
                raise UsageError(str(e).splitlines()[0]) from None
        out = _jsonable(result.to_dict())
        out["compiled"] = int(engine.compilations) - before  # programs compiled by this call
        out.update(_run_fields(args, read, engine))

    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(result.summary())
    _print_notes(result, out["compiled"], read.depth)
    print(f"sum log-probability {result.sum_logprob:.4f} nats over {result.scored} tokens "
          f"(perplexity {result.perplexity:.6g}); top-1 {result.top1_hits} of {result.scored}")
    print(f"logprobs sha256 {out['logprobs_sha256'][:16]}..., kv sha256 "
          f"{out['kv_sha256'][:16]}...")
    if args.logprobs:
        print("logprobs (token i+1 given tokens 0..i): "
              + " ".join(f"{x:.4f}" for x in result.logprobs))
    return 0
