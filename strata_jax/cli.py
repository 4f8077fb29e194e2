"""The `strata-jax` command (also `python -m strata_jax`).

Subcommands:

  demo     (the default when no subcommand is given) one prompt through a scaled-down preset
           three ways, every expert resident, stream-all and the routed stream, with each arm's
           summary and whether the logits and KV cache are the same bytes in every arm. Needs no
           GPU and no files.
  prefill  reads a prompt through a model (a preset, optionally scaled down, with synthetic
           weights; or a safetensors checkpoint) and prints what was streamed, copied and
           skipped, per layer; `--json` prints one JSON object instead.
  profile  runs prefills of several prompts and saves the per-(layer, expert) routing counts
           (an ExpertProfile) for `prefill --profile`.
  info     devices, whether the native library has CUDA, the measured pinned link bandwidth, and
           the memory plan of a model.

Models: `--preset NAME` takes a preset's real shapes (`--scale full`, the default) or a
scaled-down copy of it (`--scale small`: the demo's size; `--scale tiny`: the tests' size); the
shape options (`--layers`, `--experts`, `--top-k`, `--hidden`, `--expert-width`, `--vocab`,
`--dtype`) override single fields on top of either. `--checkpoint DIR` loads a Hugging Face
safetensors directory instead (its shapes are fixed).

Exit codes: 0 done; 1 a run that failed (the demo's arms differ, an error in the engine);
2 bad input (one line on stderr naming the problem and the way out); 130 interrupted.
Progress bars and log lines go to stderr, so `--json` leaves exactly one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from .memory import _gib, _size, memory_plan

__all__ = ["SCALES", "UsageError", "main", "memory_plan", "model_config", "read_prompt_file"]

PROG = "strata-jax"

# Scaled-down sizes, applied with ModelConfig.scaled(); fields given on the command line
# (--layers, --experts, ...) win. `layers` counts MoE layers: a preset with dense layers
# (DeepSeek) keeps one of them in front.
SCALES: dict[str, dict] = {
    "small": dict(layers=4, hidden=128, max_experts=256, expert_width=64, max_seq_len=16_384),
    "tiny": dict(layers=2, hidden=64, max_experts=32, expert_width=32, max_seq_len=4096),
}
_SHAPE_OPTIONS = ("layers", "experts", "top_k", "hidden", "expert_width", "vocab", "dtype")
_DEFAULT_SKEW = None  # None: synthetic.SKEW_40_PERCENT_512_TOP10


class UsageError(Exception):
    """Bad input: main() prints the message as one line on stderr and returns 2."""


# ---- argument parsing ---------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (and the way to the help) and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps description/epilog line breaks; appends "(default: X)" where a default says something."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" not in text and action.default not in (None, False, argparse.SUPPRESS)
                and action.option_strings and action.nargs != 0):
            text += " (default: %(default)s)"
        return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _depth(text: str) -> int:
    value = _positive_int(text)
    if value > 256:
        raise argparse.ArgumentTypeError(f"{value} is more than 256 copies")
    return value


def _nonneg_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not np.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _model_options(p: argparse.ArgumentParser, *, required: bool) -> None:
    g = p.add_argument_group("model (a preset with synthetic weights, or a checkpoint)")
    g.add_argument("--preset", metavar="NAME",
                   help="model preset: qwen3-30b-a3b, qwen3-235b-a22b, qwen3-next-80b-a3b, "
                        "mixtral-8x7b, olmoe-1b-7b, deepseek-v3"
                        + ("" if required else " (no model: no memory plan)"))
    g.add_argument("--checkpoint", metavar="DIR",
                   help="Hugging Face safetensors directory (config.json + model.safetensors "
                        "[.index.json]) of a Qwen3-MoE, Mixtral or OLMoE model; instead of --preset")
    g.add_argument("--scale", choices=["full", "small", "tiny"], default=None,
                   help="size of a preset: full = its published shapes; small = "
                        f"{_scale_text('small')}; tiny = {_scale_text('tiny')} (default: full)")
    g.add_argument("--layers", type=_positive_int, metavar="N",
                   help="MoE layers (a preset's dense layers are kept in front: one when scaled)")
    g.add_argument("--experts", type=_positive_int, metavar="N", help="routed experts per layer")
    g.add_argument("--top-k", type=_positive_int, metavar="K",
                   help="experts per token (default: the preset's, at most --experts)")
    g.add_argument("--hidden", type=_positive_int, metavar="H", help="hidden size")
    g.add_argument("--expert-width", type=_positive_int, metavar="I",
                   help="per-expert SwiGLU width (intermediate size)")
    g.add_argument("--vocab", type=_positive_int, metavar="V", help="vocabulary size")
    g.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="parameter dtype (default: the preset's or the checkpoint's)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic weights and of the random prompts")
    g.add_argument("--skew", type=_float, default=_DEFAULT_SKEW, metavar="S",
                   help="routing skew of synthetic weights, >= 0 (0: uniform routing; default "
                        "0.52, which leaves ~40%% of a 512-expert top-10 layer unrouted at "
                        "1,000 tokens)")


def _scale_text(name: str) -> str:
    s = SCALES[name]
    return (f"{s['layers']} MoE layers, hidden {s['hidden']}, at most {s['max_experts']} experts "
            f"of width {s['expert_width']}, vocab 512")


def _prompt_options(p: argparse.ArgumentParser, *, tokens_default: int, files: bool = True,
                    many: bool = False, follow_up: bool = False) -> None:
    g = p.add_argument_group("prompts" if many else "prompt")
    if many:
        g.add_argument("--prompts", type=_positive_int, default=8, metavar="K",
                       help="random prompts to read, each a new session (ignored with "
                            "--prompt-file)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--tokens", type=_positive_int, default=tokens_default, metavar="N",
                     help="random prompt of N token ids (seeded by --seed)"
                          + (" per prompt" if many else ""))
    if files:
        src.add_argument("--prompt-file", metavar="FILE", action="append" if many else "store",
                         help="token ids: whitespace- or comma-separated integers, or a 1-D "
                              "integer .npy array" + (" (repeat for several prompts)" if many else ""))
    g.add_argument("--max-context", type=_positive_int, metavar="N",
                   help="KV cache capacity in tokens (default: what "
                        + ("the longest prompt needs" if many else
                           "the prompt and --follow-up need" if follow_up else
                           "the prompt needs") + "); scaled presets' "
                        "max_seq_len grows to fit it")
    if follow_up:
        g.add_argument("--follow-up", type=_nonneg_int, default=0, metavar="N",
                       help="then a second turn of N random tokens with the session "
                            "(reports reused + read; 0: none)")


def _stream_options(p: argparse.ArgumentParser, *, depth_default: int = 16,
                    bandwidth_default: float = 2.0) -> None:
    g = p.add_argument_group("stream (how experts reach the device)")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream non-resident experts through the native engine; --no-stream "
                        "keeps every expert resident on the --backend device (the resident arm)")
    g.add_argument("--routed", choices=["on", "off"], default="on",
                   help="on: skip copies of experts no token of the chunk routes to (routed "
                        "stream); off: copy every streamed expert of every chunk (stream-all; "
                        "the routed-only floor is set to 1 unless --stream-floor is given)")
    g.add_argument("--depth", type=_depth, default=depth_default, metavar="N",
                   help="copies queued ahead of the link with --routed on (1..256)")
    g.add_argument("--chunk", type=_positive_int, default=None, metavar="N",
                   help="tokens per prefill chunk (default: the engine chooses the largest "
                        "that fits the device's free memory; the JSON's chunk_choice says how)")
    g.add_argument("--stream-floor", type=_positive_int, metavar="N",
                   help="chunks shorter than N tokens use routed-only fetch: wait for the "
                        "routing, copy only routed experts (default: 1024 with --routed on)")
    res = g.add_mutually_exclusive_group()
    res.add_argument("--resident-gib", type=_float, metavar="GIB",
                     help="device memory for resident experts; the hottest by --profile fill "
                          "it (without a profile: the lowest ids, evenly per layer)")
    res.add_argument("--resident-per-layer", type=_nonneg_int, metavar="N",
                     help="experts kept resident per MoE layer (the hottest by --profile, else "
                          "the lowest ids)")
    g.add_argument("--ring-gib", type=_float, default=4.0, metavar="GIB",
                   help="device memory the ring may take: whole layer frames, where each "
                        "layer's experts land and are read (two frames when that fits)")
    g.add_argument("--layout", choices=["auto", "frames", "packed"], default="auto",
                   help="how a streamed chunk lays the ring out: frames (the model reads each "
                        "layer where it landed; best where compute sets the pace), packed "
                        "(fewest copies on the link; best where the link does) or auto "
                        "(packed below --frames-from tokens, frames from there on)")
    g.add_argument("--frames-from", type=_positive_int, metavar="N",
                   help="--layout auto's crossover, in tokens per chunk (default: "
                        "StreamConfig.frames_from, 24576)")
    g.add_argument("--tail-pieces", type=_positive_int, metavar="N",
                   help="run the last MoE layer's expert math in N pieces of its rows, each as "
                        "its experts land, so less of it follows the chunk's last copy; 1 runs "
                        "it whole (default: StreamConfig.tail_pieces, 4)")
    g.add_argument("--tail-from", type=_positive_int, metavar="N",
                   help="the shortest chunk, in tokens, whose last MoE layer runs in "
                        "--tail-pieces pieces (default: StreamConfig.tail_from, 8192)")
    g.add_argument("--profile", metavar="FILE",
                   help="expert profile saved by `strata-jax profile`: orders each layer's "
                        "stream hottest first and chooses the resident experts")
    g.add_argument("--order", choices=["chunk-major", "layer-major"], default="chunk-major",
                   help="chunk-major: each chunk runs through every layer; layer-major: each "
                        "layer reads the whole prompt (in --sub-chunk pieces) before the next, "
                        "so each expert crosses the link once per prompt")
    g.add_argument("--sub-chunk", type=_positive_int, metavar="N",
                   help="compute sub-chunk of --order layer-major (default: the engine's)")
    g.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA when JAX has a GPU and the library was built with CUDA, "
                        "else cpu; cpu: the simulated device (host-memory ring, a copy thread "
                        "playing the link); cuda: the GPU. With --no-stream, where the resident "
                        "arm runs: auto: JAX's default device; cpu: the CPU; cuda: the GPU")
    g.add_argument("--sim-bandwidth", type=_float, default=bandwidth_default, metavar="GBPS",
                   help="simulated link bandwidth in GB/s (cpu backend; 0: unlimited)")
    g.add_argument("--sim-latency", type=_float, default=20.0, metavar="US",
                   help="simulated per-copy latency in microseconds (cpu backend)")
    g.add_argument("--trace", action="store_true",
                   help="per-chunk 'ring entries, copied, skipped' lines from the engine (stderr)")


def _output_options(p: argparse.ArgumentParser, *, json_help: str) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help=json_help)
    g.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bars or log lines on stderr")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description=__doc__,
                 epilog=textwrap.dedent("""\
                     examples:
                       strata-jax                                   # the demo
                       strata-jax prefill --preset qwen3-30b-a3b --scale tiny --tokens 2000
                       strata-jax prefill --preset qwen3-next-80b-a3b --scale small --routed off --json
                       strata-jax profile --preset olmoe-1b-7b --scale tiny --prompts 8 --out prof.npz
                       strata-jax prefill --preset olmoe-1b-7b --scale tiny --profile prof.npz \\
                           --resident-per-layer 8
                       strata-jax info --preset qwen3-next-80b-a3b --resident-gib 20

                     `strata-jax SUBCOMMAND --help` lists every option of a subcommand."""),
                 formatter_class=_Formatter)
    from . import __version__
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="{demo,prefill,profile,info}")

    demo = sub.add_parser(
        "demo", formatter_class=_Formatter,
        help="(default) resident, stream-all and routed arms on a scaled-down preset",
        description="One prompt through the same model three ways (every expert resident, "
                    "stream-all, routed stream) on a scaled-down preset with synthetic weights: "
                    "each arm's summary, and whether logits and KV cache are identical. Exit 1 "
                    "if they are not.")
    _model_options(demo, required=False)
    demo.set_defaults(preset="qwen3-next-80b-a3b", scale="small")
    _prompt_options(demo, tokens_default=1024, files=False)
    g = demo.add_argument_group("stream")
    g.add_argument("--chunk", type=_positive_int, default=1024, metavar="N", help="tokens per chunk")
    g.add_argument("--depth", type=_depth, default=4, metavar="N",
                   help="copies queued ahead of the link in the routed arm")
    g.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto",
                   help="stream backend (auto: CUDA when JAX has a GPU and the library was built "
                        "with CUDA, else the simulated link); the resident arm runs on its "
                        "device (cuda: the GPU, cpu: the CPU)")
    g.add_argument("--sim-bandwidth", type=_float, default=0.2, metavar="GBPS",
                   help="simulated link bandwidth in GB/s (cpu backend)")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bars on stderr")

    pre = sub.add_parser(
        "prefill", formatter_class=_Formatter, help="read a prompt and report what streamed",
        description="Read a prompt through a model and report the prefill: the summary line "
                    "('N tokens = R reused + K read ...'), a per-layer table of streamed, "
                    "copied, skipped and unrouted experts, the arm and the backend. With "
                    "--follow-up N a second turn of N tokens reuses the session's KV cache.",
        epilog=textwrap.dedent("""\
            --json prints one object on stdout with: tokens, reused, read, prompt_ms,
            experts_streamed, copied, skipped, unrouted, bytes_copied, logits_sha256, kv_sha256,
            per_layer, order, chunks, mode, plus arm, backend, model, compilations, depth (the
            routed stream's, as it ran: after STRATA_PREFILL_ROUTED_STREAM_DEPTH and the clamp
            to 1..256; null when the routed switch is off), and follow_up (the same keys for the second turn)
            with --follow-up."""))
    _model_options(pre, required=True)
    _prompt_options(pre, tokens_default=1024, follow_up=True)
    _stream_options(pre)
    _output_options(pre, json_help="print exactly one JSON object on stdout (keys below)")

    prof = sub.add_parser(
        "profile", formatter_class=_Formatter, help="record an expert profile from prefills",
        description="Run prefills of several prompts, each a new session, and save the "
                    "per-(layer, expert) routing counts (an ExpertProfile) to --out; print "
                    "where it went and each layer's hottest experts.")
    _model_options(prof, required=True)
    _prompt_options(prof, tokens_default=1024, many=True)
    _stream_options(prof)
    _output_options(prof, json_help="print one JSON object on stdout: out, prompts, tokens, "
                                    "model, hottest (per layer [expert, count] pairs), "
                                    "never_routed (per layer)")
    og = next(g for g in prof._action_groups if g.title == "output")
    og.add_argument("--out", metavar="FILE", required=True,
                    help="where to save the profile (ExpertProfile.save; required)")
    og.add_argument("--top", type=_positive_int, default=5, metavar="N",
                    help="hottest experts shown per layer")

    info = sub.add_parser(
        "info", formatter_class=_Formatter, help="devices, link bandwidth, a model's memory plan",
        description="JAX devices (kind, memory where known), whether the native library has "
                    "CUDA, the measured pinned host-to-device bandwidth (with a CUDA device), and "
                    "with --preset/--checkpoint the memory plan of the model: expert bytes per "
                    "layer and in all, dense bytes, KV cache, the ring for a resident budget, "
                    "and what fits on the device.")
    _model_options(info, required=False)
    ig = info.add_argument_group("plan")
    ig.add_argument("--max-context", type=_positive_int, metavar="N",
                    help="KV cache capacity for the plan (default: the model's max_seq_len, at "
                         "most 32768)")
    res = ig.add_mutually_exclusive_group()
    res.add_argument("--resident-gib", type=_float, metavar="GIB",
                     help="device memory for resident experts (evenly per layer in the plan)")
    res.add_argument("--resident-per-layer", type=_nonneg_int, metavar="N",
                     help="experts resident per MoE layer")
    ig.add_argument("--ring-gib", type=_float, default=4.0, metavar="GIB",
                    help="device memory the ring may take")
    ig.add_argument("--no-measure", action="store_true",
                    help="skip the link bandwidth measurement")
    _output_options(info, json_help="print one JSON object on stdout: jax, devices, native, "
                                    "link, plan")
    return ap


# ---- helpers -----------------------------------------------------------------------------------


class _Log:
    """Lines and progress bars on stderr, both silenced by --quiet."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(message, file=sys.stderr, flush=True)

    def bar(self, **kwargs):
        from tqdm.auto import tqdm

        return tqdm(file=sys.stderr, disable=self.quiet, dynamic_ncols=True, **kwargs)

    def progress(self, bar) -> Callable[[int, int], None]:
        """A progress(done, total) callback driving `bar`."""

        def update(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)

        return update


def _preset_names() -> str:
    from .config import PRESETS

    return ", ".join(PRESETS)


def model_config(preset: str, scale: str | None = None, *, layers: int | None = None,
                 experts: int | None = None, top_k: int | None = None, hidden: int | None = None,
                 expert_width: int | None = None, vocab: int | None = None,
                 dtype: str | None = None, max_seq_len: int | None = None):
    """The ModelConfig the command line describes: a preset, scaled, with fields overridden.

    Args:
        preset: preset name (config.PRESETS).
        scale: None or "full" keeps the preset's shapes; "small" / "tiny" scale it down
            (SCALES) with ModelConfig.scaled().
        layers: MoE layers; a preset's dense layers stay in front (one of them when scaled).
        experts, top_k, hidden, expert_width, vocab, dtype: single fields to override.
        max_seq_len: at least this many positions, for scaled presets (a full preset keeps its
            published max_seq_len).

    Raises:
        UsageError: unknown preset or an inconsistent shape (the message says which).
    """
    from .config import PRESETS, get_preset

    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; known presets: {_preset_names()}")
    base = get_preset(preset)
    try:
        if scale in (None, "full"):
            changes = {}
            if layers is not None:
                changes.update(n_layers=base.n_dense_layers + layers)
            if experts is not None:
                changes.update(n_experts=experts, top_k=top_k or min(base.top_k, experts))
                if experts % base.n_groups:
                    changes.update(n_groups=1, topk_groups=1)
            if top_k is not None:
                changes["top_k"] = top_k
            for field, value in (("hidden_size", hidden), ("expert_intermediate", expert_width),
                                 ("vocab_size", vocab), ("param_dtype", dtype)):
                if value is not None:
                    changes[field] = value
            cfg = base.replace(**changes) if changes else base
        else:
            s = SCALES[scale]
            dense = min(base.n_dense_layers, 1)
            n_experts = experts or min(base.n_experts, s["max_experts"])
            cfg = base.scaled(
                n_layers=dense + (layers or s["layers"]),
                hidden_size=hidden or s["hidden"],
                n_experts=n_experts,
                top_k=top_k,
                expert_intermediate=expert_width or s["expert_width"],
                vocab_size=vocab,
                max_seq_len=max(min(base.max_seq_len, s["max_seq_len"]), max_seq_len or 0),
                param_dtype=dtype,
            )
    except ValueError as e:
        raise UsageError(f"preset {preset} with these shape options: {e}") from None
    return cfg


def read_prompt_file(path: str) -> np.ndarray:
    """Token ids from a file: whitespace/comma-separated integers, or a 1-D integer .npy.

    Raises:
        UsageError: missing or unreadable file, not integers, empty.
    """
    if not os.path.isfile(path):
        raise UsageError(f"prompt file {path!r} does not exist (give a text file of integer "
                         "token ids or a .npy array)")
    if path.endswith(".npy"):
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise UsageError(f"prompt file {path!r} is not a readable .npy array: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise UsageError(f"prompt file {path!r} holds a {arr.dtype} array of shape "
                             f"{arr.shape}; expected a 1-D integer array of token ids")
        tokens = arr.astype(np.int64)
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"prompt file {path!r} cannot be read as text: {e}") from None
        words = [w for w in re.split(r"[\s,]+", text.strip()) if w]
        values = []
        for i, w in enumerate(words):
            try:
                values.append(int(w))
            except ValueError:
                raise UsageError(
                    f"prompt file {path!r}: {w[:20]!r} (item {i}) is not an integer token id; "
                    "expected whitespace- or comma-separated integers, or a .npy file") from None
        tokens = np.asarray(values, np.int64)
    if tokens.size == 0:
        raise UsageError(f"prompt file {path!r} holds no token ids")
    return tokens


def _check_vocab(tokens: np.ndarray, vocab: int, what: str) -> None:
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab))
    if bad.size:
        i = int(bad[0])
        raise UsageError(f"token id {int(tokens[i])} at position {i} of {what} is outside the "
                         f"vocabulary [0, {vocab}) of the model; use ids below {vocab}")


def random_prompt(vocab: int, n: int, seed: int, stream: int) -> np.ndarray:
    """n random token ids; (seed, stream) picks the sequence (prompt 0, follow-up 1, ...)."""
    return np.random.default_rng([seed, stream]).integers(0, vocab, n).astype(np.int64)


class _Model:
    """What the model options resolve to, before any weights exist."""

    def __init__(self, args):
        self.checkpoint = getattr(args, "checkpoint", None)
        self.preset = getattr(args, "preset", None)
        self.shape = {k: getattr(args, k, None) for k in _SHAPE_OPTIONS}
        self.scale = getattr(args, "scale", None)
        self.seed = args.seed
        self.skew = args.skew
        if self.checkpoint and self.preset:
            raise UsageError("give either --preset or --checkpoint, not both")
        if self.checkpoint:
            given = [k for k in _SHAPE_OPTIONS if k != "dtype" and self.shape[k] is not None]
            if self.scale is not None or given:
                opts = ["--scale"] if self.scale is not None else []
                opts += ["--" + k.replace("_", "-") for k in given]
                raise UsageError(f"{', '.join(opts)} apply to --preset models; a checkpoint's "
                                 "shapes are fixed (drop them or use --preset)")
            self.config = self._checkpoint_config()
        elif self.preset:
            self.config = model_config(self.preset, self.scale, **self.shape)
        else:
            self.config = None
        if self.skew is not None and self.skew < 0:
            raise UsageError(f"--skew {self.skew}: the routing skew must be 0 or more")

    def require(self) -> None:
        if self.config is None:
            raise UsageError(f"no model: give --preset NAME (one of {_preset_names()}; add "
                             "--scale tiny|small for a scaled-down copy) or --checkpoint DIR")

    def _checkpoint_config(self):
        from .checkpoint import CheckpointError, config_from_hf

        path = os.path.join(self.checkpoint, "config.json")
        if not os.path.isdir(self.checkpoint):
            raise UsageError(f"checkpoint {self.checkpoint!r} is not a directory (give a Hugging "
                             "Face safetensors directory)")
        try:
            with open(path) as f:
                hf = json.load(f)
            return config_from_hf(hf, param_dtype=self.shape["dtype"])
        except OSError as e:
            raise UsageError(f"checkpoint {self.checkpoint!r}: cannot read config.json ({e})") from None
        except KeyError as e:
            raise UsageError(f"checkpoint {self.checkpoint!r}: config.json lacks {e}") from None
        except (json.JSONDecodeError, CheckpointError, ValueError) as e:
            raise UsageError(f"checkpoint {self.checkpoint!r}: {e}") from None

    @property
    def scaled(self) -> bool:
        return self.preset is not None and self.scale in ("small", "tiny")

    def fit_context(self, needed: int) -> None:
        """Scaled presets grow max_seq_len to `needed`; real shapes keep theirs."""
        if self.scaled and needed > self.config.max_seq_len:
            self.config = self.config.replace(max_seq_len=needed)

    def describe(self) -> str:
        c = self.config
        where = (f"checkpoint {self.checkpoint}" if self.checkpoint else
                 f"preset {self.preset}, scale {self.scale or 'full'}")
        dense = f" ({len(c.dense_layers)} dense)" if c.dense_layers else ""
        return (f"model {c.name} ({where}): {c.n_layers} layers{dense}, {c.n_experts} experts "
                f"top-{c.top_k}, hidden {c.hidden_size}, expert {_size(c.expert_bytes)}, "
                f"{c.param_dtype}")

    def summary(self) -> dict:
        c = self.config
        return {"name": c.name, "preset": self.preset, "scale": self.scale or (
            None if self.checkpoint else "full"), "checkpoint": self.checkpoint,
            "layers": c.n_layers, "moe_layers": len(c.moe_layers), "experts": c.n_experts,
            "top_k": c.top_k, "hidden": c.hidden_size, "expert_width": c.expert_intermediate,
            "vocab": c.vocab_size, "dtype": c.param_dtype, "expert_bytes": c.expert_bytes,
            "max_seq_len": c.max_seq_len}

    def weights(self, log: _Log):
        """(config, params, experts mapping or None), loading or generating with a progress bar."""
        if self.checkpoint:
            from .checkpoint import CheckpointError, load_checkpoint

            try:
                ckpt = load_checkpoint(self.checkpoint, param_dtype=self.shape["dtype"],
                                       progress=not log.quiet)
            except CheckpointError as e:
                raise UsageError(f"checkpoint {self.checkpoint!r}: {e}") from None
            return ckpt.config, ckpt.params, ckpt.experts.as_mapping()
        from .synthetic import SKEW_40_PERCENT_512_TOP10, init_synthetic

        self.check_host_memory()
        skew = SKEW_40_PERCENT_512_TOP10 if self.skew is None else self.skew
        with log.bar(desc="synthetic weights", unit="B", unit_scale=True, unit_divisor=1024) as bar:
            params = init_synthetic(self.config, self.seed, skew, progress=log.progress(bar))
        return self.config, params, None

    def check_host_memory(self) -> None:
        """UsageError when synthetic weights would not fit in the available host RAM."""
        if self.checkpoint or getattr(self, "_memory_checked", False):
            return
        self._memory_checked = True
        from .memory import host_memory, param_bytes
        from .model import param_shapes

        shapes = param_shapes(self.config).values()
        need = param_bytes(self.config)
        peak = max(int(np.prod(s.shape)) * 4 for s in shapes)  # one float32 draw at a time
        _, available = host_memory()
        if available is not None and need + peak > 0.9 * available:
            raise UsageError(
                f"synthetic weights of {self.config.name} need {_gib(need + peak)} of host "
                f"memory and {_gib(available)} is available; use --scale small|tiny or fewer "
                "--layers / --experts")


def _resolve_backend(requested: str) -> str:
    """'cpu' or 'cuda' for a stream backend (stream.streamer.choose_backend); UsageError when
    the native library does not load or cuda cannot run."""
    from . import native
    from .stream.streamer import BackendUnavailable, choose_backend

    try:
        native.has_cuda()
    except ImportError as e:
        raise UsageError(str(e).splitlines()[0]) from None
    try:
        return choose_backend(requested)
    except BackendUnavailable as e:
        if e.missing == "cuda-build":
            raise UsageError("--backend cuda: this strata_jax build has no CUDA backend (built "
                             "without nvcc); use --backend cpu, or rebuild with the CUDA "
                             "toolkit") from None
        raise UsageError(f"--backend cuda: JAX sees no GPU (its backend is {e.platform!r}); "
                         "use --backend cpu or auto, or install jax[cuda12]") from None


def _resident_device(requested: str):
    """The jax.Device of a --no-stream run: auto = JAX's default device, cpu, or cuda = the
    GPU (the native library is not used, so it needs no CUDA build); UsageError without one."""
    import jax

    if requested == "auto":
        return jax.devices()[0]
    platform = "gpu" if requested == "cuda" else "cpu"
    try:
        return jax.devices(platform)[0]
    except RuntimeError:
        raise UsageError(f"--backend {requested}: JAX sees no {platform.upper()} (its backend is "
                         f"{jax.default_backend()!r}); use --backend auto or cpu, or install "
                         "jax[cuda12]") from None


def _backends(args) -> tuple[str, object]:
    """(stream backend, resident device): the backend of a streamed run ('cpu' or 'cuda'), or
    for --no-stream the device its resident arm runs on (the backend is then its platform's)."""
    if args.stream:
        return _resolve_backend(args.backend), None
    device = _resident_device(args.backend)
    return ("cuda" if device.platform == "gpu" else "cpu"), device


# ---- prefill ------------------------------------------------------------------------------------


def _read_prompts(args, model: _Model, *, many: bool) -> list[tuple[np.ndarray, str]]:
    vocab = model.config.vocab_size
    out = []
    files = args.prompt_file
    if files:
        for path in (files if many else [files]):
            tokens = read_prompt_file(path)
            _check_vocab(tokens, vocab, f"prompt file {path!r}")
            out.append((tokens, f"{tokens.size} tokens from {path}"))
    else:
        count = args.prompts if many else 1
        for i in range(count):
            out.append((random_prompt(vocab, args.tokens, args.seed, 10 + i),
                        f"{args.tokens} random tokens (seed {args.seed})"))
    return out


def _context(args, model: _Model, needed: int, what: str) -> int:
    """The KV capacity: --max-context or what is needed; UsageError past the limits."""
    cap = args.max_context or needed
    model.fit_context(cap)
    limit = model.config.max_seq_len
    if cap > limit:
        raise UsageError(f"--max-context {cap} passes the model's maximum context "
                         f"({limit} positions, its max_seq_len); use at most {limit}"
                         if args.max_context else
                         f"{what} {needed} positions, past the model's maximum context "
                         f"({limit}, its max_seq_len); shorten the prompt")
    if needed > cap:
        raise UsageError(f"{what} {needed} positions, past the maximum context of "
                         f"{cap} (--max-context); raise --max-context to at least {needed} or "
                         "shorten the prompt")
    return cap


def _check_budget(args, model: _Model, backend: str) -> None:
    cfg = model.config
    if not args.stream and (args.resident_gib is not None or args.resident_per_layer is not None
                            or args.profile):
        raise UsageError("--no-stream keeps every expert resident; --resident-gib, "
                         "--resident-per-layer and --profile apply to a streamed run")
    _check_stream_budget(args, cfg, "gpu" if backend == "cuda" else "cpu")


def _check_stream_budget(args, cfg, platform: str) -> None:
    """--ring-gib, --resident-per-layer and --resident-gib as `prefill`, `profile` and `info`
    all refuse them; a resident budget is checked against the memory of the `platform` device
    ("gpu" or "cpu": host RAM, the cpu backend's simulated device)."""
    if args.ring_gib <= 0:
        raise UsageError(f"--ring-gib {args.ring_gib}: the ring needs a positive budget")
    if args.resident_per_layer is not None and args.resident_per_layer > cfg.n_experts:
        raise UsageError(f"--resident-per-layer {args.resident_per_layer} exceeds the "
                         f"{cfg.n_experts} experts of a layer; use 0..{cfg.n_experts}")
    if args.resident_gib is not None:
        if args.resident_gib < 0:
            raise UsageError(f"--resident-gib {args.resident_gib}: a budget must be 0 or more")
        from .memory import device_memory

        limit, what = device_memory(platform)
        if limit is not None and args.resident_gib * 2**30 > limit:
            raise UsageError(f"--resident-gib {args.resident_gib} is more than the device has "
                             f"({_gib(limit)} of {what}); use a smaller budget")


def _check_plan(model: _Model, *, max_context: int, n_tokens: int, chunk: int | None,
                sub_chunk: int | None, backend: str, stream) -> None:
    """UsageError when the prefill cannot fit the memory of the device it will run on: its
    two KV caches and the activations of its smallest chunk (memory.chunk_memory, the
    estimate an Engine chooses its chunk by; `chunk`, else the smallest an automatic choice
    can take), `n_tokens` token ids and the weights that device holds. Checked before any
    weights exist or anything is allocated; arithmetic only.

    The device: the GPU (`backend` "cuda": its memory limit, none of this run's yet; the
    weights there are the dense ones and the residents, or every one with `stream` None;
    the ring is the native engine's own allocation, outside that limit) or the CPU (available
    host RAM; the weights there are all of them, and a streamed run's simulated ring).
    """
    from .memory import (TOKEN_ID_BYTES, device_memory, host_memory, most_that_fits,
                         prefill_bytes, weight_bytes)
    from .stream import plan_stream

    cfg = model.config
    platform = "gpu" if backend == "cuda" else "cpu"
    if platform == "gpu":
        have, what = device_memory("gpu")
    else:
        have, what = host_memory()[1], "host RAM"
    if have is None:
        return

    plan = None
    if stream is not None:
        try:
            plan = plan_stream(cfg, stream, check_ring_budget=False)
        except ValueError as e:
            raise UsageError(str(e).splitlines()[0]) from None
    weights = weight_bytes(cfg, plan, platform)

    def need(context: int) -> tuple[int, int, int, int, int]:
        """(bytes in all, activations, KV caches, their capacity, chunk) for `context`."""
        return prefill_bytes(cfg, weights, context, max_context=max_context, n_tokens=n_tokens,
                             chunk=chunk, sub_chunk=sub_chunk, platform=platform,
                             streamed=stream is not None)

    total, act, kv, cap, c = need(max_context)
    if total <= have:
        return
    lo = most_that_fits(lambda context: need(context)[0] <= have, max_context)  # positions
    way = (f"use fewer tokens or a smaller --max-context (about {lo} positions fit)" if lo else
           "not one position fits beside the weights; use a smaller model"
           + (" or fewer resident experts" if stream is not None and platform == "gpu" else ""))
    raise UsageError(
        f"this prefill needs about {_gib(total)} of {what} and {_gib(have)} is available: "
        f"KV cache {_gib(kv)} (2 copies of {cap} positions: a context of {max_context} and "
        f"a chunk's slack), activations of a {c}-token chunk {_gib(act)}, token ids "
        f"{_gib(n_tokens * TOKEN_ID_BYTES)}, weights {_gib(weights)}; {way}")


def _load_profile(path: str | None, config):
    if path is None:
        return None
    if not os.path.isfile(path):
        raise UsageError(f"profile {path!r} does not exist (record one with `strata-jax "
                         "profile --out FILE`)")
    from .profile import ExpertProfile

    try:
        return ExpertProfile.load(path, config=config)
    except (OSError, ValueError, KeyError) as e:
        message = str(e).splitlines()[0]
        if message.startswith(f"{path}: "):  # load's messages name the file: name it once
            message = message[len(path) + 2:]
        raise UsageError(f"profile {path!r}: {message}") from None


def _stream_config(args, backend: str, profile):
    from .stream import StreamConfig

    if not args.stream:
        return None
    routed = args.routed == "on"
    kw = {}
    if args.stream_floor is not None:
        kw["stream_floor"] = args.stream_floor
    elif not routed:
        kw["stream_floor"] = 1  # stream-all: no routed-only chunks either
    if args.frames_from is not None:
        kw["frames_from"] = args.frames_from
    if args.tail_pieces is not None:
        kw["tail_pieces"] = args.tail_pieces
    if args.tail_from is not None:
        kw["tail_from"] = args.tail_from
    if args.resident_gib is not None:
        kw["resident_budget_gib"] = args.resident_gib
    if args.resident_per_layer is not None:
        kw["resident_per_layer"] = args.resident_per_layer
    if profile is not None:
        kw["profile"] = profile
    return StreamConfig(routed=routed, depth=args.depth, backend=backend,
                        layout=args.layout,
                        ring_budget_gib=args.ring_gib, sim_bandwidth=args.sim_bandwidth * 1e9,
                        sim_latency=args.sim_latency * 1e-6, trace=True if args.trace else None,
                        **kw)


def _routed_depth(stream) -> int | None:
    """The depth the routed stream will run with (StreamConfig.resolved(): after
    STRATA_PREFILL_ROUTED_STREAM(_DEPTH) and the clamp to 1..256); None when nothing streams or
    the routed switch is off. The engine warns about a clamp once it is made; this look-ahead
    stays quiet."""
    if stream is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            resolved = stream.resolved()
        except ValueError as e:  # a bad environment override: as the engine would report it
            raise UsageError(str(e).splitlines()[0]) from None
    return int(resolved.depth) if resolved.routed else None


def _arm(args) -> str:
    if not args.stream:
        return "resident"
    return "routed" if args.routed == "on" else "stream-all"


def _backend_text(args, backend: str, device=None) -> str:
    if not args.stream:
        return f"resident on {device.platform}:{device.id} ({device.device_kind})"
    if backend == "cuda":
        return "cuda (pinned host store, device ring)"
    return (f"cpu (simulated link {args.sim_bandwidth:g} GB/s, {args.sim_latency:g} us per copy)")


def _make_engine(args, cfg, params, experts, stream, max_context, log: _Log, device=None):
    from .engine import Engine

    kwargs = dict(max_context=max_context, chunk_size=args.chunk, experts=experts,
                  order=args.order, device=device)
    if args.sub_chunk is not None:
        kwargs["sub_chunk"] = args.sub_chunk
    log("building the engine (packing experts, placing weights)")
    try:
        if stream is None:
            return Engine(cfg, params, stream, **kwargs)
        with log.bar(desc="packing experts", total=len(cfg.moe_layers), unit="layer") as bar:
            return Engine(cfg, params, stream, progress=log.progress(bar), **kwargs)
    except ValueError as e:
        raise UsageError(str(e).splitlines()[0]) from None


def _prefill(engine, tokens, session, log: _Log, desc: str):
    with log.bar(desc=desc, total=int(tokens.size), unit="tok") as bar:
        try:
            return engine.prefill(tokens, session, progress=log.progress(bar))
        except ValueError as e:
            raise UsageError(str(e).splitlines()[0]) from None


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


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


def cmd_prefill(args, log: _Log) -> int:
    model = _Model(args)
    model.require()
    # A prompt file is read now; a random prompt is drawn once the plan is known to fit.
    files = _read_prompts(args, model, many=False) if args.prompt_file else None
    needed = (int(files[0][0].size) if files else args.tokens) + args.follow_up
    what = ("the prompt and the follow-up need" if args.follow_up else "the prompt needs")
    max_context = _context(args, model, needed, what)
    backend, device = _backends(args)
    _check_budget(args, model, backend)
    profile = _load_profile(args.profile, model.config)
    stream = _stream_config(args, backend, profile)
    depth = _routed_depth(stream)  # what runs, not --depth: the environment overrides it
    model.check_host_memory()
    _check_plan(model, max_context=max_context, n_tokens=needed, chunk=args.chunk,
                sub_chunk=args.sub_chunk, backend=backend, stream=stream)
    (tokens, prompt_text), = files or _read_prompts(args, model, many=False)

    if not args.json:
        print(model.describe())
        print(f"arm {_arm(args)}" + (f" (depth {depth})" if depth is not None else "")
              + f", backend {_backend_text(args, backend, device)}; chunk {args.chunk or 'auto'}, "
              f"order {args.order}")
        if args.profile:
            print(f"profile {args.profile}: stream order hottest first"
                  + (", residents chosen from it" if (args.resident_gib or args.resident_per_layer)
                     else ""))
        print(f"prompt: {prompt_text}", flush=True)
    cfg, params, experts = model.weights(log)
    engine = _make_engine(args, cfg, params, experts, stream, max_context, log, device)
    with engine:
        first = _prefill(engine, tokens, None, log, "prefill")
        out = _jsonable(first.to_dict())
        follow = None
        if args.follow_up:
            more = random_prompt(cfg.vocab_size, args.follow_up, args.seed, 1)
            follow = _prefill(engine, more, first.session, log, "follow-up")
            out["follow_up"] = _jsonable(follow.to_dict())
        out.update(arm=_arm(args), backend=backend if args.stream else "resident",
                   model=model.summary(), profile=args.profile,
                   compilations=int(engine.compilations),
                   depth=(int(engine.streamer.stream.depth)
                          if engine.streamer is not None and engine.streamer.stream.routed
                          else None))

    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(first.summary())
    if first.fallback:
        print(f"note: {first.fallback}")
    print(_layer_table(out, cfg.moe_layers))
    print(f"logits sha256 {out['logits_sha256'][:16]}..., kv sha256 {out['kv_sha256'][:16]}...")
    if follow is not None:
        print(f"follow-up: {follow.summary()}")
    return 0


# ---- profile ------------------------------------------------------------------------------------


def hottest(counts: np.ndarray, layers: Sequence[int], top: int) -> dict[int, list[list[int]]]:
    """Per MoE layer, the `top` most routed experts as [expert, count] pairs, hottest first."""
    out = {}
    for l in layers:
        order = np.argsort(-counts[l], kind="stable")[:top]
        out[int(l)] = [[int(e), int(counts[l, e])] for e in order]
    return out


def cmd_profile(args, log: _Log) -> int:
    from .profile import ExpertProfile

    model = _Model(args)
    model.require()
    # Prompt files are read now; random prompts are drawn once the plan is known to fit.
    prompts = _read_prompts(args, model, many=True) if args.prompt_file else None
    sizes = [int(t.size) for t, _ in prompts] if prompts else [args.tokens] * args.prompts
    max_context = _context(args, model, max(sizes), "the longest prompt needs")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise UsageError(f"--out {args.out!r}: the directory {out_dir!r} does not exist")
    backend, device = _backends(args)
    _check_budget(args, model, backend)
    base = _load_profile(args.profile, model.config)
    stream = _stream_config(args, backend, base)
    model.check_host_memory()
    _check_plan(model, max_context=max_context, n_tokens=sum(sizes), chunk=args.chunk,
                sub_chunk=args.sub_chunk, backend=backend, stream=stream)
    prompts = prompts or _read_prompts(args, model, many=True)

    if not args.json:
        print(model.describe(), flush=True)
    cfg, params, experts = model.weights(log)
    profile = ExpertProfile.empty(cfg)
    total = 0
    engine = _make_engine(args, cfg, params, experts, stream, max_context, log, device)
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
                          "hottest": {str(l): v for l, v in hot.items()},
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


# ---- info ---------------------------------------------------------------------------------------


def cmd_info(args, log: _Log) -> int:
    import jax

    from . import native
    from .memory import device_memory, host_memory, memory_stats

    out: dict = {"jax": {"version": jax.__version__, "backend": jax.default_backend()}}
    devices = []
    for d in jax.devices():
        devices.append({"id": d.id, "platform": d.platform, "kind": d.device_kind,
                        "memory_bytes": memory_stats(d).get("bytes_limit")})
    out["devices"] = devices
    try:
        has_cuda = native.has_cuda()
        out["native"] = {"built": True, "cuda": has_cuda}
    except ImportError as e:
        has_cuda = False
        out["native"] = {"built": False, "cuda": False, "error": str(e).splitlines()[0]}
    has_gpu = any(d["platform"] == "gpu" for d in devices)
    link = {"pinned_gbps": None}
    if args.no_measure:
        link["note"] = "not measured: --no-measure"
    elif not (has_gpu and has_cuda):
        link["note"] = ("not measured: no CUDA device" if not has_gpu else
                        "not measured: the native library has no CUDA backend")
    else:
        log("measuring pinned host-to-device bandwidth (256 MiB x 10)")
        try:
            link["pinned_gbps"] = native.measure_h2d(256 * 2**20, 10, pinned=True)
            link["note"] = "pinned host to device, 256 MiB copies, median of 10"
        except RuntimeError as e:
            link["note"] = f"not measured: {str(e).splitlines()[0]}"
    out["link"] = link
    host_total, host_avail = host_memory()
    out["host"] = {"memory_bytes": host_total, "available_bytes": host_avail}

    model = _Model(args)
    if model.config is not None:
        cfg = model.config
        max_context = args.max_context or min(cfg.max_seq_len, 32_768)
        model.fit_context(max_context)
        cfg = model.config
        if max_context > cfg.max_seq_len:
            raise UsageError(f"--max-context {max_context} passes the model's maximum context "
                             f"({cfg.max_seq_len}); use at most {cfg.max_seq_len}")
        platform = "gpu" if has_gpu else "cpu"
        _check_stream_budget(args, cfg, platform)  # what prefill refuses, in its words
        device_bytes, device_what = device_memory(platform)
        try:
            plan = memory_plan(cfg, max_context=max_context, resident_gib=args.resident_gib,
                               resident_per_layer=args.resident_per_layer,
                               ring_gib=args.ring_gib, device_bytes=device_bytes)
        except ValueError as e:
            raise UsageError(str(e).splitlines()[0]) from None
        plan["device"] = device_what
        plan["model"] = model.summary()
        out["plan"] = plan

    if args.json:
        print(json.dumps(_jsonable(out), sort_keys=True))
        return 0
    print(f"jax {out['jax']['version']}, default backend {out['jax']['backend']}")
    for d in devices:
        mem = _gib(d["memory_bytes"]) if d["memory_bytes"] else "memory not reported"
        print(f"  device {d['platform']}:{d['id']} {d['kind']}, {mem}")
    if host_total:
        print(f"  host RAM {_gib(host_total)} ({_gib(host_avail or 0)} available)")
    nat = out["native"]
    print("native library: " + ("not built: " + nat["error"] if not nat["built"] else
                                "built with CUDA" if nat["cuda"] else "built without CUDA (cpu backend only)"))
    print("link: " + (f"{link['pinned_gbps']:.1f} GB/s ({link['note']})"
                      if link["pinned_gbps"] else link["note"]))
    if "plan" in out:
        p = out["plan"]
        print(f"memory plan for {model.describe()[6:]}:")
        print(f"  experts: {_size(p['expert_bytes'])} each, {_size(p['expert_bytes_per_layer'])} "
              f"per layer, {_size(p['expert_bytes_total'])} in all ({p['moe_layers']} MoE layers)"
              " — kept in host RAM")
        print(f"  dense weights {_size(p['dense_bytes'])}; KV cache {_size(p['kv_bytes'])} for "
              f"{p['max_context']} positions")
        print(f"  resident {p['resident_per_layer']} experts per layer "
              f"({_size(p['resident_bytes'])}); {p['streamed_per_layer']} streamed per layer "
              f"through a ring of {p['ring_slots']} slots ({p['ring_frames']} layer frames, "
              f"{_size(p['ring_bytes'])})"
              + ("" if p["ring_fits_budget"] else
                 f" — MORE than --ring-gib {args.ring_gib}: raise it or keep more resident"))
        dev = p["device_memory"]
        print(f"  on the device: {_size(p['device_bytes_streamed'])} streamed, "
              f"{_size(p['device_bytes_all_resident'])} with every expert resident "
              "(activations not counted)")
        if p["streamed_note"]:
            print(f"  note: {p['streamed_note']}")
        if dev is not None:
            print(f"  {p['device']}: {_size(dev)}: streamed plan "
                  f"{'fits' if p['fits_streamed'] else 'does NOT fit'}; all resident "
                  f"{'fits' if p['fits_all_resident'] else 'does not fit'}; up to about "
                  f"{p['max_resident_gib']:.1f} GiB of resident experts fit beside the rest")
        else:
            print(f"  {p['device']}: size unknown")
        if host_total:
            fits = p["host_store_bytes"] <= host_total
            print(f"  host store: {_size(p['host_store_bytes'])} of experts in {_gib(host_total)} "
                  f"of host RAM: {'fits' if fits else 'does NOT fit'}")
    return 0


# ---- demo ---------------------------------------------------------------------------------------


def cmd_demo(args, log: _Log) -> int:
    from .engine import Engine, sha256_of
    from .stream import StreamConfig
    from .synthetic import SKEW_40_PERCENT_512_TOP10

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
    link = dict(backend=backend, sim_bandwidth=args.sim_bandwidth * 1e9)
    resident_device = "gpu" if backend == "cuda" else "cpu"  # the arms compare on one device
    arms = {
        "resident": None,
        "stream-all": StreamConfig(routed=False, stream_floor=1, **link),
        "routed": StreamConfig(routed=True, depth=args.depth, **link),
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
                # Routed-only chunks (below stream_floor) wait for the routing: no blind window.
                if name == "routed" and any(c.stats is not None and c.stats.mode == "stream"
                                            for c in r.chunks):
                    bar.write(f"{'':>10}  (skips depend on timing: an unrouted expert is skipped "
                              "only when its layer's routing reaches the issuer before the walk "
                              "has queued its copy; the copies queued before that, up to --depth "
                              f"{args.depth} ahead of the link plus those it has landed, are the "
                              "blind window)", file=sys.stdout)
                bar.update(1)
    same = len(set(hashes.values())) == 1
    print(f"logits {hashes['resident'][0][:16]}..., kv {hashes['resident'][1][:16]}...: "
          f"{'identical in every arm' if same else 'DIFFERENT across arms'}")
    return 0 if same else 1


# ---- entry point --------------------------------------------------------------------------------

_COMMANDS = {"demo": cmd_demo, "prefill": cmd_prefill, "profile": cmd_profile, "info": cmd_info}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit code (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["demo", *argv]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help / --version (0) or a usage error (2)
        return int(e.code or 0)
    log = _Log(getattr(args, "quiet", False))
    try:
        with warnings.catch_warnings():
            if log.quiet:  # -q: the library's warnings too (errors still print below)
                warnings.simplefilter("ignore")
            return _COMMANDS[args.command](args, log)
    except UsageError as e:
        print(f"{PROG} {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:  # the engine or the device failed: not bad input, still one line
        print(f"{PROG} {args.command}: failed: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
