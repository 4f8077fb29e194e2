"""The `strata-jax` argument parser: its classes, the option types, the option groups shared
by the subcommands and `build_parser`. DESCRIPTION is the command's --help text (what each
subcommand does, the model options, the exit codes).
"""

from __future__ import annotations

import argparse
import textwrap

import numpy as np

from strata_jax._version import __version__
from strata_jax.cli.common import SCALES
from strata_jax.cli.demo import LINK_TO_COMPUTE
from strata_jax.formats import QUANTIZE_CHOICES
from strata_jax.kernels import ATTENTION_PATHS, DELTA_RULES, GROUPED_MATMULS, QUANTIZED_MATMULS
from strata_jax.models import FAMILIES, PRESETS

PROG = "strata-jax"

DESCRIPTION = """The `strata-jax` command (also `python -m strata_jax`).

Subcommands:

  demo     (the default when no subcommand is given) one prompt through a scaled-down preset
           three ways, every expert resident, stream-all and the routed stream, with each arm's
           summary and whether the logits and KV cache are the same bytes in every arm. Needs no
           GPU and no files.
  prefill  reads a prompt through a model (a preset, optionally scaled down, with synthetic
           weights; or a safetensors checkpoint) and prints what was streamed, copied and
           skipped, per layer; `--json` prints one JSON object instead.
  score    reads a prompt as prefill does and prints its per-token log-probabilities' sum, mean
           negative log-likelihood and perplexity, computed on the device chunk by chunk.
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
2 bad input (one line on stderr naming the problem and the way out); 130 interrupted; 141 stdout
closed by its reader before the output ended (`| head`; quietly, no traceback).
Progress bars and log lines go to stderr, so `--json` leaves exactly one JSON object on stdout.
"""

_DEFAULT_SKEW = None  # None: synthetic.SKEW_40_PERCENT_512_TOP10


# ---- option types -------------------------------------------------------------------------------


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


def _int_in(lo: int, too_low: str, hi: int | None = None, too_high: str = ""):
    """An option type: an integer of at least `lo` (and at most `hi`), else `too_low`/`too_high`
    after the value."""
    def parse(text: str) -> int:
        value = _int(text)
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} {too_low}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"{value} {too_high}")
        return value

    return parse


_positive_int = _int_in(1, "must be at least 1")
_depth = _int_in(1, "must be at least 1", 256, "is more than 256 copies")
_nonneg_int = _int_in(0, "must be 0 or more")


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not np.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


# ---- option groups ------------------------------------------------------------------------------


def _model_options(p: argparse.ArgumentParser, *, required: bool) -> None:
    g = p.add_argument_group("model (a preset with synthetic weights, or a checkpoint)")
    g.add_argument("--preset", metavar="NAME",
                   help="model preset: " + ", ".join(PRESETS)
                        + ("" if required else " (no model: no memory plan)"))
    g.add_argument("--checkpoint", metavar="DIR",
                   help="Hugging Face safetensors directory (config.json + model.safetensors "
                        "[.index.json]) of a model of one of the families (" + ", ".join(FAMILIES)
                        + "); instead of --preset")
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
    g.add_argument("--quantize", choices=list(QUANTIZE_CHOICES), default=None,
                   help="store, stream and read the routed experts quantized: fp8 (e4m3, "
                        "block scales), int4 (GPTQ's values, group scales, symmetric), "
                        "int4-zp (int4 with a zero-point per group, GPTQ's asymmetric grid), "
                        "int4-act (int4 with act-order: each matrix's rows grouped by "
                        "magnitude and stored in group order, the inputs gathered into it) or "
                        "mxfp4 (OCP Microscaling FP4, gpt-oss's: e2m1 values, a power-of-two "
                        "scale per 32 inputs; widths multiples of 64), "
                        "made from the preset's or the bf16 checkpoint's weights as they are "
                        "loaded")
    g.add_argument("--quant-block", type=_positive_int, default=None, metavar="N",
                   help="fp8's scale block side or int4's group (default: the largest of "
                        "128, 64, 32, 16, 8 that divides the hidden and expert widths; 128 "
                        "for the presets); mxfp4's is 32, its only one")
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
                    many: bool = False, follow_up: bool = False, text: bool = False) -> None:
    g = p.add_argument_group("prompts" if many else "prompt")
    if many:
        g.add_argument("--prompts", type=_positive_int, default=8, metavar="K",
                       help="random prompts to read, each a new session (ignored with "
                            "--prompt-file or --prompt)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--tokens", type=_positive_int, default=tokens_default, metavar="N",
                     help="random prompt of N token ids (seeded by --seed)"
                          + (" per prompt" if many else ""))
    if files:
        src.add_argument("--prompt-file", metavar="FILE", action="append" if many else "store",
                         help="token ids: whitespace- or comma-separated integers, or a 1-D "
                              "integer .npy array; text with --prompt-format text"
                              + (" (repeat for several prompts)" if many else ""))
    if text:
        src.add_argument("--prompt", metavar="TEXT", action="append" if many else "store",
                         help="the prompt as text, encoded by the checkpoint's tokenizer.json "
                              "(a --preset model has no tokenizer: give ids)"
                              + (" (repeat for several prompts)" if many else ""))
        g.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                       help="what --prompt-file" + (" and --follow-up-file hold" if follow_up
                                                    else " holds")
                            + ": ids (as above) or text (UTF-8, encoded by the "
                            "checkpoint's tokenizer.json)")
    g.add_argument("--max-context", type=_positive_int, metavar="N",
                   help="KV cache capacity in tokens (default: what "
                        + ("the longest prompt needs" if many else
                           "the prompt and the follow-up need" if follow_up else
                           "the prompt needs") + "); scaled presets' "
                        "max_seq_len grows to fit it")
    if follow_up:
        g.add_argument("--follow-up", type=_nonneg_int, default=0, metavar="N",
                       help="then a second turn of N random tokens with the session "
                            "(reports reused + read; 0: none)"
                            + ("; --follow-up-prompt or --follow-up-file give it instead"
                               if text else ""))
    if follow_up and text:
        fu = g.add_mutually_exclusive_group()
        fu.add_argument("--follow-up-prompt", metavar="TEXT",
                        help="then a second turn of this text with the session, encoded by "
                             "the checkpoint's tokenizer.json without its special tokens (the "
                             "first turn has them); instead of --follow-up N")
        fu.add_argument("--follow-up-file", metavar="FILE",
                        help="then a second turn read from FILE as --prompt-file is: token "
                             "ids, or text with --prompt-format text; instead of --follow-up N")


def _stream_options(p: argparse.ArgumentParser, *, depth_default: int | None = None,
                    bandwidth_default: float = 2.0) -> None:
    g = p.add_argument_group("stream (how experts reach the device)")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream non-resident experts through the native engine; --no-stream "
                        "keeps every expert resident on the --backend device (the resident arm)")
    g.add_argument("--routed", choices=["on", "off"], default=None,
                   help="on: skip copies of experts no token of the chunk routes to (routed "
                        "stream); off: copy every streamed expert of every chunk (stream-all, "
                        "--stream-floor does not apply). Given, it wins over "
                        "STRATA_PREFILL_ROUTED_STREAM; default: that variable's 0/1 where set, "
                        "else on")
    g.add_argument("--depth", type=_depth, default=depth_default, metavar="N",
                   help="copies queued ahead of the link with --routed on (1..256). Given, it "
                        "wins over STRATA_PREFILL_ROUTED_STREAM_DEPTH; default: that variable "
                        "where set, else 16")
    g.add_argument("--chunk", type=_positive_int, default=None, metavar="N",
                   help="tokens per prefill chunk (default: the engine chooses the largest "
                        "that fits the device's free memory; the JSON's chunk_choice says how)")
    g.add_argument("--stream-floor", type=_positive_int, metavar="N",
                   help="with --routed on, chunks shorter than N tokens use routed-only fetch: "
                        "wait for the routing, copy only routed experts (default 1024; "
                        "stream-all streams every chunk)")
    res = g.add_mutually_exclusive_group()
    res.add_argument("--resident-gib", type=_float, metavar="GIB",
                     help="device memory for resident experts; the hottest by --profile fill "
                          "it (without a profile: the lowest ids, evenly per layer)")
    res.add_argument("--resident-per-layer", type=_nonneg_int, metavar="N",
                     help="experts kept resident per MoE layer (the hottest by --profile, else "
                          "the lowest ids)")
    g.add_argument("--ring-gib", type=_float, default=4.0, metavar="GIB",
                   help="device memory the ring may take: whole layer frames, where each "
                        "layer's experts land and are read (two frames when that fits); below "
                        "one frame, each layer streams in parts with frames of their own")
    g.add_argument("--layout", choices=["auto", "frames", "packed"], default="auto",
                   help="how a streamed chunk lays the ring out: frames (the model reads each "
                        "layer where it landed; best where compute sets the pace), packed "
                        "(fewest copies on the link; best where the link does) or auto "
                        "(packed below --frames-from tokens, frames from there on)")
    g.add_argument("--frames-from", type=_positive_int, metavar="N",
                   help="--layout auto's crossover, in tokens per chunk (default: "
                        "StreamTuning.frames_from, 24576)")
    g.add_argument("--tail-pieces", type=_positive_int, metavar="N",
                   help="run the last MoE layer's expert math in N pieces of its rows, each as "
                        "its experts land, so less of it follows the chunk's last copy; 1 runs "
                        "it whole (default: StreamTuning.tail_pieces, 4)")
    g.add_argument("--tail-shape", choices=["auto", "equal", "halving"],
                   help="the --tail-pieces pieces' sizes: equal, or halving (each half the one "
                        "before, the last two equal: 1/2, 1/4, 1/8, 1/8), which leaves less "
                        "math after the last copy where each piece's math fits in the next "
                        "piece's copies; auto: halving where a layer's math is short beside its "
                        "copies, equal where not (default: StreamTuning.tail_shape, auto)")
    g.add_argument("--tail-from", type=_positive_int, metavar="N",
                   help="the shortest chunk, in tokens, whose last MoE layer runs in "
                        "--tail-pieces pieces (default: StreamTuning.tail_from: 8192 for bf16 "
                        "experts, 1024 for quantized ones read by a fused kernel, 16384 for "
                        "quantized ones dequantized first)")
    g.add_argument("--profile", metavar="FILE",
                   help="expert profile saved by `strata-jax profile`: orders each layer's "
                        "stream hottest first and chooses the resident experts")
    g.add_argument("--order", choices=["chunk-major", "layer-major"], default="chunk-major",
                   help="chunk-major: each chunk runs through every layer; layer-major: each "
                        "layer reads the whole prompt (in --sub-chunk pieces) before the next, "
                        "so each expert crosses the link once per prompt")
    g.add_argument("--sub-chunk", type=_positive_int, metavar="N",
                   help="compute sub-chunk of --order layer-major (default: the engine's)")
    g.add_argument("--dense", choices=["device", "host"], default="device",
                   help="where the dense weights (all but the routed experts) live: on the "
                        "device, or in pinned host memory, each layer's copied in while the "
                        "layer before computes (a model whose dense weights outgrow the card; "
                        "each layer's cross the link once per chunk, once per prompt with "
                        "--order layer-major)")
    g.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA when JAX has a GPU and the library was built with CUDA, "
                        "else cpu; cpu: the simulated device (host-memory ring, a copy thread "
                        "playing the link); cuda: the GPU. With --no-stream, where the resident "
                        "arm runs: auto: JAX's default device; cpu: the CPU; cuda: the GPU")
    g.add_argument("--sim-bandwidth", type=_float, default=bandwidth_default, metavar="GBPS",
                   help="simulated link bandwidth in GB/s (cpu backend; 0: unlimited)")
    _devices_option(g)
    g.add_argument("--sim-latency", type=_float, default=20.0, metavar="US",
                   help="simulated per-copy latency in microseconds (cpu backend)")
    g.add_argument("--trace", action="store_true",
                   help="per-chunk 'ring entries, copied, skipped' lines from the engine (stderr)")
    _kernel_options(p)


def _kernel_options(p: argparse.ArgumentParser) -> None:

    g = p.add_argument_group("kernels (strata_jax.Kernels; each choice reads the same bits in "
                             "every arm)")
    g.add_argument("--grouped-matmul", choices=GROUPED_MATMULS, default="auto",
                   help="the experts' grouped matmul (auto: the Mosaic GPU kernel on Hopper, "
                        "row tiles on other GPUs, lax.ragged_dot on the CPU)")
    g.add_argument("--quantized-matmul", choices=QUANTIZED_MATMULS, default="auto",
                   help="how fp8/int4/mxfp4 experts are read (--quantize or a quantized "
                        "checkpoint): fused kernels that dequantize tiles as they multiply, or "
                        "the layer dequantized first (auto: the Mosaic kernels for fp8, int4 "
                        "and mxfp4 on Hopper, int4 with zero-points dequantized; elsewhere "
                        "dequantize)")
    g.add_argument("--attention", choices=ATTENTION_PATHS, default="auto",
                   help="the attention path (auto: fused cuDNN for bf16/fp16 on a GPU, exact "
                        "XLA paths elsewhere)")
    g.add_argument("--delta-rule", choices=DELTA_RULES, default="auto",
                   help="a Gated DeltaNet layer's chunkwise rule (hybrid models): XLA's matmuls "
                        "with a scan over the blocks, or two Pallas kernels (auto: the "
                        "kernels, bf16 products, for a bf16/fp16 model on a GPU; xla for "
                        "float32 and off a GPU)")


def _devices_option(g) -> None:
    g.add_argument("--devices", type=_positive_int, default=1, metavar="N",
                   help="expert parallelism: split every MoE layer's experts over N devices of "
                        "the --backend platform (each holds 1/N of them; attention and dense "
                        "weights are replicated); on the CPU, N simulated devices. Streamed, "
                        "each device has its own engine over its slice: its residents "
                        "(--resident-per-layer / --resident-gib are per device), ring and link")


def _output_options(p: argparse.ArgumentParser, *, json_help: str) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help=json_help)
    g.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bars or log lines on stderr")


# ---- the parser ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description=DESCRIPTION,
                 epilog=textwrap.dedent("""\
                     examples:
                       strata-jax                                   # the demo
                       strata-jax prefill --preset qwen3-30b-a3b --scale tiny --tokens 2000
                       strata-jax prefill --preset qwen3-next-80b-a3b --scale small --routed off --json
                       strata-jax score --preset qwen3-30b-a3b --scale tiny --tokens 2000 --json
                       strata-jax profile --preset olmoe-1b-7b --scale tiny --prompts 8 --out prof.npz
                       strata-jax prefill --preset olmoe-1b-7b --scale tiny --profile prof.npz \\
                           --resident-per-layer 8
                       strata-jax info --preset qwen3-next-80b-a3b --resident-gib 20

                     `strata-jax SUBCOMMAND --help` lists every option of a subcommand."""),
                 formatter_class=_Formatter)
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="{demo,prefill,score,profile,info}")

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
    g.add_argument("--depth", type=_depth, default=None, metavar="N",
                   help="copies queued ahead of the link in the routed arm (1..256; default: "
                        "STRATA_PREFILL_ROUTED_STREAM_DEPTH where set, else 4)")
    g.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto",
                   help="stream backend (auto: CUDA when JAX has a GPU and the library was built "
                        "with CUDA, else the simulated link); the resident arm runs on its "
                        "device (cuda: the GPU, cpu: the CPU)")
    g.add_argument("--sim-bandwidth", type=_float, default=None, metavar="GBPS",
                   help="simulated link bandwidth in GB/s (cpu backend; 0: unlimited). Default: "
                        f"the rate at which a layer's expert copies take {LINK_TO_COMPUTE:g}x "
                        "its compute, timed "
                        "on the resident arm, as on an H200 (55 GB/s) at 8K tokens; a link "
                        "faster than the compute has every copy issued before its layer's "
                        "routing lands, and the routed arm skips nothing")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bars on stderr")

    pre = sub.add_parser(
        "prefill", formatter_class=_Formatter, help="read a prompt and report what streamed",
        description="Read a prompt through a model and report the prefill: the summary line "
                    "('N tokens = R reused + K read ...'), a per-layer table of streamed, "
                    "copied, skipped and unrouted experts, the arm and the backend. With "
                    "--follow-up N (random ids), --follow-up-prompt TEXT or --follow-up-file "
                    "FILE a second turn reuses the session's KV cache.",
        epilog=textwrap.dedent("""\
            --json prints one object on stdout with: tokens, reused, read, prompt_ms,
            experts_streamed, copied, skipped, unrouted, bytes_copied, logits_sha256, kv_sha256,
            per_layer, order, chunks, mode, compiled (the chunk programs this call compiled:
            prompt_ms includes compiling them), plus arm, backend, model, compilations (the
            engine's, in all), depth (the routed stream's, as it ran: --depth, else
            STRATA_PREFILL_ROUTED_STREAM_DEPTH, else 16, clamped to 1..256; null when the routed
            switch is off), next_tokens (the 5 most likely tokens after the prompt: id, logprob,
            text: null without a tokenizer.json), and follow_up (the same keys for the second
            turn, its next_tokens included) with --follow-up, --follow-up-prompt or
            --follow-up-file."""))
    _model_options(pre, required=True)
    _prompt_options(pre, tokens_default=1024, follow_up=True, text=True)
    _stream_options(pre)
    _output_options(pre, json_help="print exactly one JSON object on stdout (keys below)")

    score = sub.add_parser(
        "score", formatter_class=_Formatter, help="a prompt's per-token log-probabilities",
        description="Read a prompt through a model and score it: the log-probability of each "
                    "token after the first given the ones before it, computed on the device "
                    "in each chunk's program (no [tokens, vocab] logits), and their sum, mean "
                    "negative log-likelihood, perplexity and top-1 accuracy (how often the "
                    "token was the model's most likely one); the prefill's summary line too. "
                    "Every arm (--no-stream, --routed on/off) gives the same bits.",
        epilog=textwrap.dedent("""\
            --json prints one object on stdout with prefill's keys (tokens, reused, read,
            prompt_ms, experts_streamed, copied, skipped, unrouted, bytes_copied, logits_sha256,
            kv_sha256, per_layer, order, chunks, mode, compiled, arm, backend, model,
            compilations, depth) plus scored, sum_logprob, mean_nll, perplexity,
            top1_accuracy, logprobs_sha256, logprobs (one float per scored token: entry i is
            log p(token i+1 | tokens 0..i)) and top1 (one token id per scored token: the most
            likely token i+1 given tokens 0..i), next_tokens (as prefill's) and costliest (the
            5 scored tokens of highest negative log-likelihood: position, id, nll, text)."""))
    _model_options(score, required=True)
    _prompt_options(score, tokens_default=1024, text=True)
    _stream_options(score)
    _output_options(score, json_help="print exactly one JSON object on stdout (keys below)")
    next(g for g in score._action_groups if g.title == "output").add_argument(
        "--logprobs", action="store_true",
        help="also print each token's log-probability (the JSON always holds them)")

    prof = sub.add_parser(
        "profile", formatter_class=_Formatter, help="record an expert profile from prefills",
        description="Run prefills of several prompts, each a new session, and save the "
                    "per-(layer, expert) routing counts (an ExpertProfile) to --out; print "
                    "each prompt (its first tokens, as text beside the ids where the "
                    "checkpoint has a tokenizer.json), where the profile went and each layer's "
                    "hottest experts. The prompts are --prompts K random ones, --prompt TEXT "
                    "or --prompt-file FILE (each repeatable), as prefill reads them.")
    _model_options(prof, required=True)
    _prompt_options(prof, tokens_default=1024, many=True, text=True)
    _stream_options(prof)
    _output_options(prof, json_help="print one JSON object on stdout: out, prompts, tokens, "
                                    "model, hottest (per layer [expert, count] pairs), "
                                    "never_routed (per layer), inputs (per prompt: tokens, "
                                    "source, head: its first 8 ids, head_text: their text, "
                                    "null without a tokenizer.json)")
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
    ig.add_argument("--dense", choices=["device", "host"], default="device",
                    help="plan the dense weights on the device, or in host memory (two layers' "
                         "on the device at a time: prefill --dense host)")
    ig.add_argument("--no-measure", action="store_true",
                    help="skip the link bandwidth measurement")
    ig.add_argument("--devices", type=_positive_int, default=1, metavar="N",
                    help="plan for N devices sharing the experts (expert parallelism): the "
                         "plan's per_device figures, resident and streamed (each device's "
                         "slice, residents and ring)")
    _output_options(info, json_help="print one JSON object on stdout: jax, devices, native, "
                                    "link, plan")
    return ap
