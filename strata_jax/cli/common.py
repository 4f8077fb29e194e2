"""What several `strata-jax` commands share: the usage error and the log, the model the
options describe (`_Model`, model_config, prompts), the backend and device, the prompt's KV
capacity, the profile, the stream config, making the engine and JSON output.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable

import jax
import numpy as np
from tqdm.auto import tqdm

from strata_jax import native
from strata_jax.checkpoint import CheckpointError, config_from_hf, load_checkpoint
from strata_jax.checkpoint.safetensors import shard_files
from strata_jax.devices import HostMemoryError, gib, host_memory, size
from strata_jax.engine import Engine, memory
from strata_jax.formats import MXFP4_GROUP, QUANTIZE_CHOICES, quantized_config
from strata_jax.kernels import Kernels
from strata_jax.models import PRESETS, expert_plane_names, get_preset
from strata_jax.parallel import expert_mesh
from strata_jax.profile import ExpertProfile
from strata_jax.stream import StreamConfig, StreamTuning
from strata_jax.stream.backend import BackendUnavailable, choose_backend
from strata_jax.synthetic import SKEW_40_PERCENT_512_TOP10, SyntheticParams
from strata_jax.text import Tokenizer, TokenizerError, tokenizer_path
from strata_jax.weights import LazyExperts, QuantizedParams

# Scaled-down sizes, applied with ModelConfig.scaled(); fields given on the command line
# (--layers, --experts, ...) win. `layers` counts MoE layers: a preset with dense layers
# (DeepSeek) keeps one of them in front.
SCALES: dict[str, dict] = {
    "small": dict(layers=4, hidden=128, max_experts=256, expert_width=64, max_seq_len=16_384),
    "tiny": dict(layers=2, hidden=64, max_experts=32, expert_width=32, max_seq_len=4096),
}

_SHAPE_OPTIONS = ("layers", "experts", "top_k", "hidden", "expert_width", "vocab", "dtype")


# How to give token ids where text needs a tokenizer the model lacks.
IDS_WAY_OUT = "pass token ids instead (--prompt-file FILE of ids, or --tokens N)"


class UsageError(Exception):
    """Bad input: main() prints the message as one line on stderr and returns 2."""


class _Log:
    """Lines and progress bars on stderr, both silenced by --quiet."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(message, file=sys.stderr, flush=True)

    def bar(self, **kwargs):

        return tqdm(file=sys.stderr, disable=self.quiet, dynamic_ncols=True, **kwargs)

    def progress(self, bar) -> Callable[[int, int], None]:
        """A progress(done, total) callback driving `bar`."""

        def update(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)

        return update


# ---- the model ----------------------------------------------------------------------------------


def _preset_names() -> str:

    return ", ".join(PRESETS)


def model_config(preset: str, scale: str | None = None, *, layers: int | None = None,
                 experts: int | None = None, top_k: int | None = None, hidden: int | None = None,
                 expert_width: int | None = None, vocab: int | None = None,
                 dtype: str | None = None, max_seq_len: int | None = None):
    """The ModelConfig the command line describes: a preset, scaled, with fields overridden.

    Args:
        preset: preset name (models.PRESETS).
        scale: None or "full" keeps the preset's shapes; "small" / "tiny" scale it down
            (SCALES) with ModelConfig.scaled().
        layers: MoE layers; a preset's dense layers stay in front (one of them when scaled).
        experts, top_k, hidden, expert_width, vocab, dtype: single fields to override.
        max_seq_len: at least this many positions, for scaled presets (a full preset keeps its
            published max_seq_len).

    Raises:
        UsageError: unknown preset or an inconsistent shape (the message says which).
    """

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
                    "expected whitespace- or comma-separated integers, or a .npy file (prefill "
                    "and score read a file of text with --prompt-format text)") from None
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
        self.quantize = getattr(args, "quantize", None)
        self.quant_block = getattr(args, "quant_block", None)
        self.plain_config = self.config  # the weights' own format (what --quantize reads)
        if self.quant_block is not None and self.quantize is None:
            raise UsageError("--quant-block applies with --quantize "
                             f"{'|'.join(QUANTIZE_CHOICES)}")
        if self.quantize and self.config is not None:
            self.config = self._quantized(self.config)

    def _quantized(self, config):
        """`config` with its experts in the --quantize format (UsageError where it cannot)."""
        if config.expert_format != "plain":
            raise UsageError(f"--quantize {self.quantize}: the checkpoint's experts are already "
                             f"{config.expert_format} (drop --quantize)")
        block = self.quant_block
        if block is None and self.quantize == "mxfp4":
            block = MXFP4_GROUP  # its one scale group
        if block is None:
            widths = (config.hidden_size, config.expert_intermediate)
            block = next((b for b in (128, 64, 32, 16, 8) if all(w % b == 0 for w in widths)),
                         128 if self.quantize == "fp8" else None)  # fp8 blocks may be partial
            if block is None:
                raise UsageError(f"--quantize {self.quantize}: the widths {widths} of "
                                 f"{config.name} have no group of 8 or more dividing both "
                                 "(int4 needs one)")
        try:
            return quantized_config(config, self.quantize, block)
        except ValueError as e:
            raise UsageError(f"--quantize {self.quantize}: {e}") from None

    def require(self) -> None:
        if self.config is None:
            raise UsageError(f"no model: give --preset NAME (one of {_preset_names()}; add "
                             "--scale tiny|small for a scaled-down copy) or --checkpoint DIR")

    def _checkpoint_config(self):

        path = os.path.join(self.checkpoint, "config.json")
        if not os.path.isdir(self.checkpoint):
            raise UsageError(f"checkpoint {self.checkpoint!r} is not a directory (give a Hugging "
                             "Face safetensors directory)")
        try:
            with open(path) as f:
                hf = json.load(f)
            config = config_from_hf(hf, param_dtype=self.shape["dtype"])
            # The weights' files, each whole, before anything is printed: an empty or cut shard
            # is bad input (one line), not a safetensors traceback once the header is out.
            shard_files(self.checkpoint)
            return config
        except OSError as e:
            raise UsageError(f"checkpoint {self.checkpoint!r}: cannot read config.json ({e})") from None
        except KeyError as e:
            raise UsageError(f"checkpoint {self.checkpoint!r}: config.json lacks {e}") from None
        except json.JSONDecodeError as e:
            raise UsageError(f"checkpoint {self.checkpoint!r}: config.json is not valid JSON "
                             f"({e})") from None
        except (CheckpointError, ValueError) as e:
            raise UsageError(f"checkpoint {self.checkpoint!r}: {e}") from None

    def tokenizer(self, text: str | None = None, ids: str = IDS_WAY_OUT) -> Tokenizer | None:
        """The checkpoint's tokenizer.json (None without one, or where it cannot be read:
        `tokenizer_error` says why). `text` names what gives text ("--prompt"): then the
        tokenizer is required (UsageError, one line, saying to pass ids: `ids`)."""
        if not hasattr(self, "_tokenizer"):
            self._tokenizer, self.tokenizer_error = None, None
            path = tokenizer_path(self.checkpoint) if self.checkpoint else None
            try:
                self._tokenizer = path and Tokenizer.from_file(path, self.config.vocab_size)
            except TokenizerError as e:
                self.tokenizer_error = str(e)
        if text is not None and self._tokenizer is None:
            if self.tokenizer_error:
                raise UsageError(f"{text}: {self.tokenizer_error}; {ids}")
            if not self.checkpoint:
                raise UsageError(f"{text} needs a tokenizer, and a --preset model (synthetic "
                                 f"weights) has none; {ids}")
            raise UsageError(f"{text}: checkpoint {self.checkpoint!r} has no tokenizer.json to "
                             f"encode it with; {ids}")
        return self._tokenizer

    @property
    def scaled(self) -> bool:
        return self.preset is not None and self.scale in ("small", "tiny")

    def fit_context(self, needed: int) -> None:
        """Scaled presets grow max_seq_len to `needed`; real shapes keep theirs."""
        if self.scaled and needed > self.config.max_seq_len:
            self.config = self.config.replace(max_seq_len=needed)
            self.plain_config = self.plain_config.replace(max_seq_len=needed)

    def describe(self) -> str:
        c = self.config
        where = (f"checkpoint {self.checkpoint}" if self.checkpoint else
                 f"preset {self.preset}, scale {self.scale or 'full'}")
        dense = f" ({len(c.dense_layers)} dense)" if c.dense_layers else ""
        return (f"model {c.name} ({where}): {c.n_layers} layers{dense}, {c.n_experts} experts "
                f"top-{c.top_k}, hidden {c.hidden_size}, expert {size(c.expert_bytes)}"
                f"{'' if c.expert_format == 'plain' else ' ' + c.expert_format}"
                f"{' with zero-points' if c.expert_zero_points else ''}"
                f"{' with act-order groups' if c.expert_act_order else ''}, "
                f"{c.param_dtype}")

    def summary(self) -> dict:
        c = self.config
        return {"name": c.name, "preset": self.preset, "scale": self.scale or (
            None if self.checkpoint else "full"), "checkpoint": self.checkpoint,
            "layers": c.n_layers, "moe_layers": len(c.moe_layers), "experts": c.n_experts,
            "top_k": c.top_k, "hidden": c.hidden_size, "expert_width": c.expert_intermediate,
            "vocab": c.vocab_size, "dtype": c.param_dtype, "expert_bytes": c.expert_bytes,
            "expert_format": c.expert_format, "expert_block": c.expert_block or None,
            "expert_zero_points": bool(c.expert_zero_points),
            "expert_act_order": bool(c.expert_act_order), "max_seq_len": c.max_seq_len}

    def weights(self, log: _Log):
        """(config, params, experts mapping or None). Nothing of the experts is made or read
        here: a checkpoint's stay in its files and synthetic ones are drawn as the engine
        takes them (its progress bar), straight into its host store or onto the device."""
        if self.checkpoint:

            try:
                ckpt = load_checkpoint(self.checkpoint, param_dtype=self.shape["dtype"],
                                       progress=not log.quiet)
            except CheckpointError as e:
                raise UsageError(f"checkpoint {self.checkpoint!r}: {e}") from None
            if not self.quantize:
                return ckpt.config, ckpt.params, ckpt.experts.as_mapping()

            config = self._quantized(ckpt.config)
            experts = QuantizedParams(ckpt.experts, config)
            return config, ckpt.params, {l: LazyExperts(experts, expert_plane_names(config, l))
                                         for l in config.moe_layers}

        self.check_host_memory()
        skew = SKEW_40_PERCENT_512_TOP10 if self.skew is None else self.skew
        params = SyntheticParams(self.plain_config, self.seed, skew)
        if self.quantize:

            params = QuantizedParams(params, self.config)
        return self.config, params, None

    @property
    def weights_desc(self) -> str:
        """What the engine's progress bar is making."""
        return "checkpoint experts" if self.checkpoint else "synthetic weights"

    def check_host_memory(self, streamed: bool = True) -> None:
        """UsageError when the weights would not fit in the available host RAM: the host
        store (every routed expert once, when `streamed`), the dense weights (kept in host
        memory) and one expert tensor in flight. A resident run's experts go to the device
        (`_check_plan` checks it, host RAM for the cpu backend)."""
        if getattr(self, "_memory_checked", False):
            return
        self._memory_checked = True
        c = self.config
        store = c.expert_bytes_total if streamed else 0
        dense = memory.param_bytes(c, resident_experts=False)
        # One gate, up or down tensor of a layer; quantized from the plain one, that tensor
        # with its float32 temporaries and planes.
        tensor = self.plain_config.expert_bytes_per_layer // 3
        if c.expert_format != "plain":
            tensor *= 1 + 2 * 4 // self.plain_config.dtype.itemsize
        need = store + dense + tensor
        _, available = host_memory()
        if available is not None and need > 0.9 * available:
            what = "synthetic weights" if not self.checkpoint else "the checkpoint's weights"
            raise UsageError(
                f"{what} of {c.name} need {gib(need)} of host memory (host store "
                f"{gib(store)}, dense weights {gib(dense)}, one expert tensor {gib(tensor)}) "
                f"and {gib(available)} is available; use --scale small|tiny or fewer "
                "--layers / --experts")


# ---- backend and device -------------------------------------------------------------------------


def _resolve_backend(requested: str) -> str:
    """'cpu' or 'cuda' for a stream backend (stream.streamer.choose_backend); UsageError when
    the native library does not load or cuda cannot run."""

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
    for --no-stream the device its resident arm runs on (the backend is then its platform's;
    with --devices N, the first of the N, `_devices` checks they are there)."""
    n = getattr(args, "devices", 1)
    if n > 1:  # before anything starts JAX's backends
        _simulated_cpu_devices(n)
    if args.stream:
        backend = _resolve_backend(args.backend)
        if n > 1:  # one engine per device of the stream's platform
            _devices(args, _stream_device(backend))
        return backend, None
    device = _resident_device(args.backend)
    if n > 1:
        _devices(args, device)
    return ("cuda" if device.platform == "gpu" else "cpu"), device


def _stream_device(backend: str):
    """The first device of a stream backend's platform ("cpu": the CPU, "cuda": the GPU)."""

    return jax.devices("gpu" if backend == "cuda" else "cpu")[0]


def _simulated_cpu_devices(n: int) -> None:
    """Asks JAX for n CPU devices where its backends are not started yet (the CPU's devices
    of --devices N) and XLA_FLAGS does not set their count already."""

    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except (RuntimeError, AttributeError):  # JAX started already, or has no such option
        pass


def _devices(args, device) -> list:
    """The --devices N devices of `device`'s platform (the first N); UsageError where JAX has
    fewer."""

    n = getattr(args, "devices", 1)
    have = jax.devices(device.platform)
    if len(have) < n:
        hint = (f" (for N simulated CPU devices set XLA_FLAGS=--xla_force_host_platform_"
                f"device_count={n} before the command starts)" if device.platform == "cpu"
                else "")
        raise UsageError(f"--devices {n}: JAX sees {len(have)} {device.platform} device"
                         f"{'s' if len(have) != 1 else ''}; use at most {len(have)}{hint}")
    if n > 1:
        return list(have[:n])
    return [device]


# ---- prompts, profile, stream, engine -----------------------------------------------------------


def _encode_text(model: _Model, text: str, where: str, option: str, ids: str = IDS_WAY_OUT,
                 continuation: bool = False) -> tuple[np.ndarray, str]:
    """`text` (from `where`: an option or a file) encoded by the checkpoint's tokenizer.json;
    `option` and `ids` name what gave text and the way to give ids instead where there is no
    tokenizer. A `continuation` (a follow-up turn) is encoded without the special tokens, as
    `Engine.prefill(text, session)` encodes it."""
    tokenizer = model.tokenizer(option, ids)
    try:
        tokens = tokenizer.encode(text, add_special_tokens=not continuation).astype(np.int64)
    except TokenizerError as e:
        raise UsageError(f"{where}: {e}") from None
    if tokens.size == 0:
        raise UsageError(f"{where}: the text encodes to no tokens; give some text")
    return tokens, (f"{tokens.size} tokens of text from {where} ({len(text)} characters, "
                    f"{tokenizer.path})")


def _read_text(path: str) -> str:
    """A prompt file's text (--prompt-format text)."""
    if path.endswith(".npy"):
        raise UsageError(f"prompt file {path!r} is a .npy array of token ids; drop "
                         "--prompt-format text")
    if not os.path.isfile(path):
        raise UsageError(f"prompt file {path!r} does not exist (give a UTF-8 text file with "
                         "--prompt-format text)")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"prompt file {path!r} cannot be read as UTF-8 text: {e}") from None


def _prompt_source(model: _Model, *, text: str | None = None, path: str | None = None,
                  as_text: bool = False, where: str = "--prompt", ids: str = IDS_WAY_OUT,
                  continuation: bool = False) -> tuple[np.ndarray, str]:
    """(token ids, what they are) of one prompt: `text` (an option's value, named by `where`),
    or the file `path` (given by the option `where`) of text (`as_text`: --prompt-format text)
    or of token ids. `ids` is the way to give ids where text needs a tokenizer the model lacks;
    a `continuation` (a follow-up turn) is encoded without the special tokens."""
    if text is not None:
        return _encode_text(model, text, where, where, ids, continuation)
    if as_text:
        option = "--prompt-format text" + ("" if where == "--prompt" else f" ({where})")
        return _encode_text(model, _read_text(path), path, option, ids, continuation)
    tokens = read_prompt_file(path)
    _check_vocab(tokens, model.config.vocab_size, f"prompt file {path!r}")
    return tokens, f"{tokens.size} tokens from {path}"


def _prompts_given(args) -> bool:
    """Whether the prompts are given (text, or files) rather than drawn (--tokens N)."""
    return bool(args.prompt_file or getattr(args, "prompt", None) is not None
                or (getattr(args, "prompt_format", "ids") == "text"
                    and not getattr(args, "follow_up_file", None)))


def _read_prompts(args, model: _Model, *, many: bool) -> list[tuple[np.ndarray, str]]:
    """The prompts, each (token ids, what they are): --prompt TEXT (repeatable where `many`),
    --prompt-file FILE (ids, or text with --prompt-format text) or random (--tokens N, and
    --prompts K where `many`)."""
    vocab = model.config.vocab_size
    texts, files = getattr(args, "prompt", None), args.prompt_file
    as_text = getattr(args, "prompt_format", "ids") == "text"
    if texts is not None:
        texts = texts if many else [texts]
        return [_prompt_source(model, text=t, where="--prompt" if len(texts) == 1 else
                              f"--prompt #{i + 1}") for i, t in enumerate(texts)]
    if as_text and not files and not getattr(args, "follow_up_file", None):
        raise UsageError("--prompt-format text applies to --prompt-file FILE (--prompt TEXT is "
                         "text already)")
    if files:
        return [_prompt_source(model, path=path, as_text=as_text)
                for path in (files if many else [files])]
    count = args.prompts if many else 1
    return [(random_prompt(vocab, args.tokens, args.seed, 10 + i),
             f"{args.tokens} random tokens (seed {args.seed})") for i in range(count)]


def _output_tokenizer(model: _Model, log: _Log) -> Tokenizer | None:
    """The tokenizer that shows tokens as text (None without one: a warning where the
    checkpoint's tokenizer.json cannot be read)."""
    if model.tokenizer() is None and model.tokenizer_error:
        log(f"warning: {model.tokenizer_error}; tokens are shown as ids only")
    return model.tokenizer()


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


def _load_profile(path: str | None, config):
    if path is None:
        return None
    if not os.path.isfile(path):
        raise UsageError(f"profile {path!r} does not exist (record one with `strata-jax "
                         "profile --out FILE`)")

    try:
        return ExpertProfile.load(path, config=config)
    except (OSError, ValueError, KeyError) as e:
        message = str(e).splitlines()[0]
        if message.startswith(f"{path}: "):  # load's messages name the file: name it once
            message = message[len(path) + 2:]
        raise UsageError(f"profile {path!r}: {message}") from None


def _stream_config(args, backend: str, profile):

    if not args.stream:
        return None
    # --routed and --depth given are explicit (they win over STRATA_PREFILL_ROUTED_STREAM and
    # its _DEPTH); not given (None), the environment's value applies, else the default.
    routed = None if args.routed is None else args.routed == "on"
    kw, tuning = {}, {}
    for name in ("stream_floor", "frames_from", "tail_pieces", "tail_shape", "tail_from"):
        if getattr(args, name) is not None:
            tuning[name] = getattr(args, name)
    if args.resident_gib is not None:
        kw["resident_budget_gib"] = args.resident_gib
    if args.resident_per_layer is not None:
        kw["resident_per_layer"] = args.resident_per_layer
    if profile is not None:
        kw["profile"] = profile
    tuning = StreamTuning(layout=args.layout, sim_bandwidth=args.sim_bandwidth * 1e9,
                          sim_latency=args.sim_latency * 1e-6, **tuning)
    return StreamConfig(routed=routed, depth=args.depth, backend=backend,
                        ring_budget_gib=args.ring_gib, trace=True if args.trace else None,
                        tuning=tuning, **kw)


def _make_engine(args, cfg, params, experts, stream, max_context, log: _Log, device=None,
                 what: str = "experts"):

    kwargs = dict(max_context=max_context, chunk_size=args.chunk, experts=experts,
                  order=args.order, device=device, dense=getattr(args, "dense", "device"),
                  kernels=Kernels(grouped_matmul=args.grouped_matmul, attention=args.attention,
                                  quantized_matmul=args.quantized_matmul,
                                  delta_rule=args.delta_rule))
    if getattr(args, "devices", 1) > 1:  # expert parallel: the mesh says where it runs

        if device is None:  # streamed: the stream backend's devices
            device = _stream_device("cuda" if stream.backend == "cuda" else "cpu")
        kwargs.update(device=None, mesh=expert_mesh(_devices(args, device)))
    if args.sub_chunk is not None:
        kwargs["sub_chunk"] = args.sub_chunk
    where = "the host store" if stream is not None else "the device"
    log(f"building the engine (experts into {where}, placing weights)")
    desc = f"{what} into {where}"  # what: `_Model.weights_desc`
    try:
        with log.bar(desc=desc, total=len(cfg.moe_layers), unit="layer") as bar:
            return Engine(cfg, params, stream, progress=log.progress(bar), **kwargs)
    except (ValueError, HostMemoryError) as e:
        raise UsageError(str(e).splitlines()[0]) from None


# ---- output -------------------------------------------------------------------------------------


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
