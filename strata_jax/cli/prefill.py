"""`strata-jax prefill`: one prompt (and an optional follow-up turn) through a model, with
the summary, the per-layer table of what streamed, or one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Sequence

import numpy as np

from strata_jax.cli.checks import _check_budget, _check_plan
from strata_jax.cli.common import (UsageError, _backends, _context, _jsonable, _load_profile, _Log,
                                   _make_engine, _Model, _output_tokenizer, _prompt_source,
                                   _prompts_given, _read_prompts, _stream_config, _stream_device,
                                   random_prompt)
from strata_jax.formats import ExpertFormat
from strata_jax.kernels.quantized import resolve_format


def _stream_arm(stream) -> tuple[str, int | None]:
    """(arm, depth): what will run (StreamConfig.resolved(): --routed and --depth where given,
    else STRATA_PREFILL_ROUTED_STREAM(_DEPTH) where set, else on and 16; the depth clamped to
    1..256): the arm ("resident", "stream-all" or "routed") and the routed stream's depth, None
    when nothing streams or the routed switch is off. The engine warns about a clamp (or an
    environment variable an explicit flag overrides) once it is made; this look-ahead stays
    quiet."""
    if stream is None:
        return "resident", None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            resolved = stream.resolved()
        except ValueError as e:  # a bad environment variable: as the engine would report it
            raise UsageError(str(e).splitlines()[0]) from None
    if not resolved.routed:
        return "stream-all", None
    return "routed", int(resolved.depth)


def _backend_text(args, backend: str, device=None) -> str:
    if not args.stream and getattr(args, "devices", 1) > 1:
        return (f"resident, experts split over {args.devices} {device.platform} devices "
                f"({device.device_kind})")
    if not args.stream:
        return f"resident on {device.platform}:{device.id} ({device.device_kind})"
    n = getattr(args, "devices", 1)
    over = f", one engine on each of {n} devices" if n > 1 else ""
    if backend == "cuda":
        return f"cuda (pinned host store, device ring{over})"
    return (f"cpu (simulated link {args.sim_bandwidth:g} GB/s, {args.sim_latency:g} us per "
            f"copy{over})")


def _prefill(engine, tokens, session, log: _Log, desc: str):
    with log.bar(desc=desc, total=int(tokens.size), unit="tok") as bar:
        try:
            return engine.prefill(tokens, session, progress=log.progress(bar))
        except ValueError as e:
            raise UsageError(str(e).splitlines()[0]) from None


def _skip_note(result, depth: str) -> str | None:
    """Why a routed result's skips depend on timing, where a chunk streamed (a routed-only
    chunk, below stream_floor, waits for the routing and skips every unrouted expert); `depth`
    names the depth ("--depth 4")."""
    if result.mode != "routed" or not any(c.stats is not None and c.stats.mode == "stream"
                                          for c in result.chunks):
        return None
    return ("(skips depend on timing: an unrouted expert is skipped only when its layer's "
            "routing reaches the issuer before the walk has queued its copy; the copies queued "
            f"before that, up to {depth} ahead of the link plus those it has landed, are the "
            "blind window)")


def _compiled_note(compiled: int) -> str | None:
    """What a call's printed time holds when the call compiled `compiled` programs."""
    if not compiled:
        return None
    return (f"  (this time includes compiling {compiled} chunk program"
            f"{'s' if compiled != 1 else ''}, once per chunk shape; a later call of the same "
            "shapes on this engine runs without it)")


def _per_layer_rows(per_layer: dict) -> list[dict]:
    """to_dict()'s per_layer ({"copied": [one int per model layer], ...}) as one dict per layer."""
    keys = list(per_layer)
    n = len(per_layer[keys[0]]) if keys else 0
    return [{"layer": i, **{k: per_layer[k][i] for k in keys}} for i in range(n)]


def _layer_table(d: dict, moe_layers: Sequence[int]) -> str:
    rows = [r for r in _per_layer_rows(d["per_layer"]) if r["layer"] in set(moe_layers)]
    if not d["experts_streamed"]:
        return "  (nothing streamed: every expert is resident)"
    head = f"  {'layer':>5} {'streamed':>9} {'copied':>8} {'skipped':>8} {'unrouted':>9} {'copied MiB':>11}"
    lines = [head]
    for r in rows:
        lines.append(f"  {r['layer']:>5} {r['streamed']:>9} {r['copied']:>8} {r['skipped']:>8} "
                     f"{r['unrouted']:>9} {r['bytes'] / 2**20:>11.2f}")
    lines.append(f"  {'all':>5} {d['experts_streamed']:>9} {d['copied']:>8} {d['skipped']:>8} "
                 f"{d['unrouted']:>9} {d['bytes_copied'] / 2**20:>11.2f}")
    return "\n".join(lines)


@dataclasses.dataclass
class _Read:
    """What `prefill` and `score` settle before any weight is made: the model, the prompt, the
    stream and where it runs, each checked (plan, budgets, host memory)."""

    model: _Model
    tokens: np.ndarray
    stream: object  # StreamConfig or None (all resident)
    backend: str
    device: object
    max_context: int
    depth: int | None  # what runs (--depth, else the environment's, else 16; clamped)
    quantized: str | None  # the kernel quantized experts are read with (None: plain)
    tokenizer: object = None  # the checkpoint's Tokenizer, None without one
    follow_up: np.ndarray | None = None  # the second turn's ids (None: no second turn)


_FOLLOW_UP_IDS = "pass token ids instead (--follow-up-file FILE of ids, or --follow-up N)"


def _follow_up(args, model: _Model) -> tuple[np.ndarray, str] | None:
    """The second turn given as text or a file ((ids, what they are)), read as the prompt is
    (its text encoded without the special tokens: a continuation); None where there is none or
    it is --follow-up N random ids (drawn once the plan is known to fit)."""
    text, path = getattr(args, "follow_up_prompt", None), getattr(args, "follow_up_file", None)
    given = "--follow-up-prompt" if text is not None else "--follow-up-file" if path else None
    if given and getattr(args, "follow_up", 0):
        raise UsageError(f"--follow-up {args.follow_up} and {given} both give the second turn; "
                         f"give one: --follow-up N random ids, or {given} "
                         + ("TEXT" if text is not None else "FILE"))
    if given is None:
        return None
    return _prompt_source(model, text=text, path=path, as_text=args.prompt_format == "text",
                          where=given, ids=_FOLLOW_UP_IDS, continuation=True)


def _prepare(args, *, scoring: bool = False) -> _Read:
    """Checks the whole read (the prompt, the plan, budgets, host memory) before any weight is
    made, prints the header unless --json, and returns it."""
    model = _Model(args)
    model.require()
    # A prompt file or text is read now; a random prompt is drawn once the plan is known to fit.
    files = _read_prompts(args, model, many=False) if _prompts_given(args) else None
    more = _follow_up(args, model)
    tokenizer = _output_tokenizer(model, _Log(args.quiet))
    prompt = int(files[0][0].size) if files else args.tokens
    if scoring and prompt < 2:
        raise UsageError(f"a prompt of {prompt} token has nothing to score (each token is "
                         "scored given the ones before it); give at least 2 tokens")
    follow_up = int(more[0].size) if more else getattr(args, "follow_up", 0)
    needed = prompt + follow_up
    what = "the prompt and the follow-up need" if follow_up else "the prompt needs"
    max_context = _context(args, model, needed, what)
    backend, device = _backends(args)
    _check_budget(args, model, backend)
    profile = _load_profile(args.profile, model.config)
    stream = _stream_config(args, backend, profile)
    arm, depth = _stream_arm(stream)
    model.check_host_memory(streamed=stream is not None)
    path = _quantized_path(args, model.config, backend, device)
    _check_plan(model, max_context=max_context, n_tokens=needed, chunk=args.chunk,
                sub_chunk=args.sub_chunk, backend=backend, stream=stream,
                devices=args.devices, dequantized=path == "dequantize", dense_on=args.dense)
    (tokens, prompt_text), = files or _read_prompts(args, model, many=False)
    if not args.json:
        print(model.describe() + ("" if path is None else f"; experts {_QUANTIZED_PATHS[path]}"))
        print(f"arm {arm}" + (f" (depth {depth})" if depth is not None else "")
              + f", backend {_backend_text(args, backend, device)}; chunk {args.chunk or 'auto'}, "
              f"order {args.order}")
        if args.profile:
            print(f"profile {args.profile}: stream order hottest first"
                  + (", residents chosen from it" if (args.resident_gib or args.resident_per_layer)
                     else ""))
        print(f"prompt: {prompt_text}", flush=True)
    if follow_up and not more:
        more = (random_prompt(model.config.vocab_size, follow_up, args.seed, 1),
                f"{follow_up} random tokens (seed {args.seed})")
    if more and not args.json:
        print(f"follow-up prompt: {more[1]}", flush=True)
    return _Read(model, tokens, stream, backend, device, max_context, depth, path, tokenizer,
                 more[0] if more else None)


_QUANTIZED_PATHS = {"mosaic": "read by the fused Mosaic GPU kernel",
                    "dequantize": "dequantized a layer at a time before the matmuls"}


def _quantized_path(args, config, backend: str, device) -> str | None:
    """The kernel quantized experts are read with (`kernels.quantized.resolve_format` of
    --quantized-matmul on the device the expert math runs on); None for a plain format."""

    return resolve_format(args.quantized_matmul, ExpertFormat.of(config),
                          device if device is not None else _stream_device(backend))


def _engine(args, read: _Read, log: _Log):
    """(config, engine): the weights made straight into the engine's store or device."""
    cfg, params, experts = read.model.weights(log)
    return cfg, _make_engine(args, cfg, params, experts, read.stream, read.max_context, log,
                             read.device, read.model.weights_desc)


def _shown(ids, tokenizer) -> list[str]:
    """Each token id, with its text beside it where a tokenizer is known."""
    ids = [int(i) for i in ids]
    if tokenizer is None:
        return [str(i) for i in ids]
    return [f"{i} {piece!r}" for i, piece in zip(ids, tokenizer.pieces(ids))]


def next_tokens(result, tokenizer, k: int = 5) -> list[dict]:
    """The k most likely tokens after the prompt (its last position's logits): id, logprob and
    text (where a tokenizer is known)."""
    logits = np.asarray(result.logits, np.float64).reshape(-1)
    logp = logits - logits.max()
    logp -= np.log(np.exp(logp).sum())
    top = np.argsort(-logp, kind="stable")[:k]
    texts = tokenizer.pieces(top) if tokenizer is not None else [None] * len(top)
    return [{"id": int(i), "logprob": float(logp[i]), "text": t} for i, t in zip(top, texts)]


def _print_next(tops: list[dict], tokenizer, label: str = "next tokens") -> None:
    print(f"{label}: " + ", ".join(
        f"{s} (p {np.exp(t['logprob']):.3f})"
        for s, t in zip(_shown([t["id"] for t in tops], tokenizer), tops)))


def _run_fields(args, read: _Read, engine) -> dict:
    """The JSON keys that say how the read ran (arm, backend, model, compilations, depth): the
    arm and depth the engine ran, whatever decided them (flags or the environment)."""
    streamer = engine.streamer
    return dict(arm=engine.mode, backend=read.backend if args.stream else "resident",
                model=read.model.summary(), profile=args.profile, devices=args.devices,
                quantized_matmul=read.quantized,
                compilations=int(engine.compilations),
                depth=(int(streamer.stream.depth)
                       if streamer is not None and streamer.stream.routed else None))


def _print_notes(result, compiled: int, depth: int | None) -> None:
    """The lines under a result's summary: compilation, a fallback, why skips vary."""
    skips = _skip_note(result, f"depth {depth}")
    for line in (_compiled_note(compiled), result.fallback and f"note: {result.fallback}",
                 skips and f"  {skips}"):
        if line:
            print(line)


def cmd_prefill(args, log: _Log) -> int:
    read = _prepare(args)
    cfg, engine = _engine(args, read, log)
    with engine:
        before = int(engine.compilations)
        first = _prefill(engine, read.tokens, None, log, "prefill")
        out = _jsonable(first.to_dict())
        out["compiled"] = int(engine.compilations) - before  # programs compiled by this call
        out["next_tokens"] = next_tokens(first, read.tokenizer)
        follow = None
        if read.follow_up is not None:
            before = int(engine.compilations)
            follow = _prefill(engine, read.follow_up, first.session, log, "follow-up")
            out["follow_up"] = _jsonable(follow.to_dict())
            out["follow_up"]["compiled"] = int(engine.compilations) - before
            out["follow_up"]["next_tokens"] = next_tokens(follow, read.tokenizer)
        out.update(_run_fields(args, read, engine))

    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(first.summary())
    _print_notes(first, out["compiled"], read.depth)
    print(_layer_table(out, cfg.moe_layers))
    if first.devices > 1:
        per = first.per_device()
        rows = per["rows"]
        print(f"  token copies per device's experts: {rows} (all {sum(rows)})")
        if "streamed" in per:
            print("  streamed per device: " + "; ".join(
                f"{d}: copied {t['copied']}, skipped {t['skipped']} of {t['unrouted']} "
                f"unrouted" for d, t in enumerate(per["streamed"])))
    print(f"logits sha256 {out['logits_sha256'][:16]}..., kv sha256 {out['kv_sha256'][:16]}...")
    _print_next(out["next_tokens"], read.tokenizer)
    if follow is not None:
        print(f"follow-up: {follow.summary()}")
        note = _compiled_note(out["follow_up"]["compiled"])
        if note:
            print(note)
        _print_next(out["follow_up"]["next_tokens"], read.tokenizer, "follow-up next tokens")
    return 0
