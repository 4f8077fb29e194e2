"""`strata-jax score`: the log-probability of each token of a prompt given the ones before it,
computed on the device chunk by chunk (`Engine.score`), with its sum, perplexity and top-1
accuracy (how often the token was the model's most likely one); the same
model and stream options as `prefill`; `--json` prints one JSON object.
"""

from __future__ import annotations

import json

import numpy as np

from strata_jax.cli.common import UsageError, _jsonable, _Log
from strata_jax.cli.prefill import (_engine, _prepare, _print_next, _print_notes, _run_fields,
                                    _shown, next_tokens)


def costliest(result, tokens, tokenizer, k: int = 5) -> list[dict]:
    """The k scored tokens of highest negative log-likelihood, costliest first: position (in
    the prompt), id, nll (nats) and text (where a tokenizer is known)."""
    nll = -np.asarray(result.logprobs, np.float64)
    worst = np.argsort(-nll, kind="stable")[:k]
    ids = np.asarray(tokens)[worst + 1]
    texts = tokenizer.pieces(ids) if tokenizer is not None else [None] * len(ids)
    return [{"position": int(i) + 1, "id": int(t), "nll": float(nll[i]), "text": x}
            for i, t, x in zip(worst, ids, texts)]


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
        out["next_tokens"] = next_tokens(result, read.tokenizer)
        out["costliest"] = costliest(result, read.tokens, read.tokenizer)
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
    worst = out["costliest"]
    print("costliest tokens: " + ", ".join(
        f"position {c['position']}: {s} (NLL {c['nll']:.3f})"
        for s, c in zip(_shown([c["id"] for c in worst], read.tokenizer), worst)))
    _print_next(out["next_tokens"], read.tokenizer)
    if args.logprobs:
        print("logprobs (token i+1 given tokens 0..i): "
              + " ".join(f"{x:.4f}" for x in result.logprobs))
    return 0
