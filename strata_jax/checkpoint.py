"""Loading Hugging Face safetensors checkpoints of MoE models.

Guards against putting every expert on the device (a 235B model's experts do not fit) and against
silent mis-mapping: every tensor is looked up by its exact Hugging Face name and checked against the
expected shape; a missing or misshaped tensor, or an unknown architecture, is a `CheckpointError`
naming it before anything reaches the device. And against a model that is silently another one:
every config.json field is honoured, refused with its value, or known to have no effect on the
logits (`FIELDS`, `IGNORED_FIELDS`; the transformers 4 and 5 spellings are both read), and a
tensor in the files that the load does not read is an error.

Quantized checkpoints (FP8 block-scaled as Qwen3-30B-A3B-FP8, 4-bit GPTQ as
Qwen3-30B-A3B-GPTQ-Int4; `QUANT_FIELDS`): the routed experts keep the checkpoint's format
(`ModelConfig.expert_format`, `strata_jax.formats`), every other quantized linear is dequantized
to the parameter dtype on load.

Non-expert weights come back as a flat dict of NumPy arrays (model layout: projections as
[in, out]); routed experts as a `CheckpointExperts`, checked but left in the files until used:
a streaming engine reads them straight into its host store (`Engine(..., experts=
ckpt.experts.as_mapping())`), a resident model onto the device, one tensor at a time, so host RAM
never holds them twice. `HostExpertStore` keeps every expert in host memory as blobs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Iterator, Mapping

import ml_dtypes  # also registers bfloat16 with NumPy so safe_open can return BF16 tensors
import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from strata_jax.config import ModelConfig, _DTYPES
from strata_jax.experts import ExpertWeights, blob_size, unpack_expert_blobs_np
from strata_jax.formats import (INT4_PER_WORD, INT4_ZERO, ExpertFormat, g_idx_perm,
                                gptq_halves_np, int4_halves_np, int4_values_np, unequal_group)
from strata_jax.rope import RopeScaling, rope_frequencies


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: missing/misshaped/unused tensor, unknown architecture, a
    config.json field this engine does not implement, bad files."""


@dataclasses.dataclass(frozen=True)
class _Arch:
    moe_prefix: str  # "mlp" or "block_sparse_moe"
    router: str  # router tensor under the MoE prefix
    expert_names: tuple[str, str, str]  # gate, up, down under experts.{e}.
    qk_norm: str
    model_type: str  # config.json's model_type for this architecture
    rope_theta: float  # transformers' default when config.json gives none
    rms_norm_eps: float
    max_position_embeddings: int
    norm_topk_prob: bool


_QWEN3, _MIXTRAL, _OLMOE = "Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM"

# Defaults are transformers' own for a field config.json leaves out.
ARCHITECTURES: dict[str, _Arch] = {
    _QWEN3: _Arch("mlp", "gate", ("gate_proj", "up_proj", "down_proj"), "per_head", "qwen3_moe",
                  10_000.0, 1e-6, 32_768, False),
    # Mixtral renormalises its top-k weights always (it has no norm_topk_prob field).
    _MIXTRAL: _Arch("block_sparse_moe", "gate", ("w1", "w3", "w2"), "none", "mixtral",
                    1_000_000.0, 1e-5, 131_072, True),
    _OLMOE: _Arch("mlp", "gate", ("gate_proj", "up_proj", "down_proj"), "full", "olmoe",
                  10_000.0, 1e-5, 4096, False),
}

# ---- config.json fields: each one honoured, refused or of no effect, in one place ---------------

HONOURED, NO_EFFECT = "honoured", "no effect"
_ALL = (_QWEN3, _MIXTRAL, _OLMOE)


def _each(status: str, archs=_ALL) -> dict[str, str]:
    return {a: status for a in archs}


# Field -> architecture -> how the loader treats it: "honoured" (read and implemented), "refused
# unless ..." (any other value is a CheckpointError naming it), "no effect" (does not change the
# logits). A field an architecture's entry leaves out is not one of its fields (transformers would
# ignore it): a config.json that carries it is refused. docs/CHECKPOINTS.md shows this table.
FIELDS: dict[str, dict[str, str]] = {
    "architectures": _each("honoured: picks the architecture"),
    "model_type": _each("refused unless it names the architecture"),
    "vocab_size": _each(HONOURED),
    "hidden_size": _each(HONOURED),
    "num_hidden_layers": _each(HONOURED),
    "num_attention_heads": _each(HONOURED),
    "num_key_value_heads": _each(HONOURED),
    "head_dim": _each(HONOURED),
    "num_experts": _each("honoured (either spelling; refused if they differ)"),
    "num_local_experts": _each("honoured (either spelling; refused if they differ)"),
    "num_experts_per_tok": _each(HONOURED),
    "moe_intermediate_size": _each(HONOURED, (_QWEN3,)),
    "intermediate_size": {_QWEN3: "no effect (dense MLP width; every layer is MoE)",
                          _MIXTRAL: HONOURED, _OLMOE: HONOURED},
    "norm_topk_prob": {_QWEN3: HONOURED, _OLMOE: HONOURED,
                       _MIXTRAL: "refused unless true (Mixtral always renormalises)"},
    "decoder_sparse_step": _each("refused unless 1 (dense layers)", (_QWEN3,)),
    "mlp_only_layers": _each("refused unless empty (dense layers)", (_QWEN3,)),
    "hidden_act": _each("honoured: silu (swish); others refused"),
    "rms_norm_eps": _each(HONOURED),
    "tie_word_embeddings": _each(HONOURED),
    "max_position_embeddings": _each("honoured: longest context (yarn: factor x original)"),
    "rope_theta": _each("honoured (4.x spelling; refused if it differs from rope_parameters')"),
    "rope_scaling": _each("honoured: default, linear, dynamic (up to max_position_embeddings),"
                          " yarn; other types refused"),
    "rope_parameters": _each("honoured (5.x spelling): as rope_theta and rope_scaling"),
    "partial_rotary_factor": _each("refused unless 1"),
    "attention_bias": {_QWEN3: HONOURED, _OLMOE: HONOURED,
                       _MIXTRAL: "refused unless false (Mixtral has no attention biases)"},
    "clip_qkv": _each("refused unless null", (_OLMOE,)),
    "use_sliding_window": _each("honoured: sliding_window in every layer", (_QWEN3,)),
    "sliding_window": {_QWEN3: "honoured when use_sliding_window", _MIXTRAL: HONOURED,
                       _OLMOE: "refused unless null (transformers applies it only in some "
                               "attention kernels)"},
    "max_window_layers": _each("no effect unless use_sliding_window; then refused unless 0 "
                               "(transformers versions disagree)", (_QWEN3,)),
    "dtype": _each("honoured: parameter dtype (param_dtype= overrides)"),
    "torch_dtype": _each("honoured: parameter dtype (4.x spelling)"),
    "router_jitter_noise": _each("no effect (training only)", (_MIXTRAL,)),
    "quantization_config": _each("honoured: fp8 (block-scaled e4m3) and gptq (4-bit; "
                                 "symmetric or with zero-points, with or without "
                                 "act-order); its own fields in the next table"),
    "pruned_heads": _each("refused unless empty"),
    "is_encoder_decoder": _each("refused unless false"),
    "add_cross_attention": _each("refused unless false"),
}

# Fields that do not change the logits of any supported architecture: bookkeeping, token ids,
# training-only settings (dropout, router losses, initialisation) and the generation defaults
# transformers 4 wrote into config.json.
IGNORED_FIELDS: frozenset[str] = frozenset({
    "_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation_autoset",
    "use_cache", "initializer_range", "attention_dropout", "output_router_logits",
    "router_aux_loss_coef", "gradient_checkpointing",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "tokenizer_class", "id2label", "label2id", "num_labels", "problem_type", "finetuning_task",
    "prefix", "task_specific_params", "return_dict", "output_hidden_states", "output_attentions",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "chunk_size_feed_forward", "is_decoder",
    "cross_attention_hidden_size", "tie_encoder_decoder",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})

# RoPE scaling keys each rope type reads (besides rope_type / type, rope_theta and
# partial_rotary_factor, read for every type).
_ROPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor",
                       "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
}


def fields_markdown() -> str:
    """The field table of docs/CHECKPOINTS.md, from `FIELDS` and `IGNORED_FIELDS`."""
    names = {_QWEN3: "Qwen3-MoE", _MIXTRAL: "Mixtral", _OLMOE: "OLMoE"}
    lines = ["| field | " + " | ".join(names[a] for a in _ALL) + " |",
             "|---|" + "---|" * len(_ALL)]
    for field, per in FIELDS.items():
        cells = [per.get(a, "refused (not a field)") for a in _ALL]
        lines.append(f"| `{field}` | " + " | ".join(cells) + " |")
    lines.append(f"| {', '.join(f'`{f}`' for f in sorted(IGNORED_FIELDS))} | "
                 + " | ".join([NO_EFFECT] * len(_ALL)) + " |")
    return "\n".join(lines) + "\n"


# ---- quantization_config: the FP8 and GPTQ checkpoints, in one place -----------------------------

_FP8, _GPTQ = "fp8", "gptq"

# quantization_config field -> quant_method -> how the loader treats it (as FIELDS). Routed experts
# keep the checkpoint's format in the engine's store (`strata_jax.formats`: ModelConfig
# expert_format "fp8" / "int4", expert_block the block or group); every other quantized linear is
# dequantized to the parameter dtype on load (one float32 product, then one cast), since only the
# routed experts stream. docs/CHECKPOINTS.md shows this table.
QUANT_FIELDS: dict[str, dict[str, str]] = {
    "quant_method": {_FP8: "honoured: fp8 (experts stored as fp8)",
                     _GPTQ: "honoured: gptq (experts stored as int4)"},
    "fmt": {_FP8: "refused unless e4m3 (float8_e4m3fn weights)"},
    "weight_block_size": {_FP8: "honoured: a square block [b, b] of float32 `weight_scale_inv` "
                                "(experts: expert_block = b); non-square and absent (per-tensor "
                                "scales) refused"},
    "activation_scheme": {_FP8: "honoured: dynamic, as weight-only quantization (activations stay "
                                "in the parameter dtype; FP8 kernels would round them to e4m3 per "
                                "token group: a deliberate difference); static refused"},
    "modules_to_not_convert": {_FP8: "honoured: the linears it names (whole dotted components, "
                                     "e.g. `model.layers.0.mlp.gate`) stay unquantized; lm_head "
                                     "always does"},
    "ignored_layers": {_FP8: "honoured: as modules_to_not_convert (vLLM's spelling; refused if "
                             "both are given and differ)"},
    "bits": {_GPTQ: "refused unless 4"},
    "group_size": {_GPTQ: "honoured: the scales' group along the input dim (experts: "
                          "expert_block); -1 (one group per column) refused"},
    "sym": {_GPTQ: "honoured: true (every `qzeros` entry must hold the implicit zero 8) or "
                   "false (zero-points: the routed experts keep them as a plane of their own, "
                   "`expert_zero_points`; other quantized linears are dequantized with them)"},
    "desc_act": {_GPTQ: "honoured: true (act-order: every quantized linear's `g_idx` names each "
                        "input row's group; the routed experts' rows are stored in group order "
                        "beside a plane naming each one's input row, `expert_act_order`, and "
                        "their groups must hold group_size rows each; other linears are "
                        "dequantized with it) or false (a `g_idx` other than k // group is "
                        "refused)"},
    "checkpoint_format": {_GPTQ: "honoured: gptq (v1, qzeros stored minus one: the zero 8 as "
                                 "7) and gptq_v2 (stored as is: 8); marlin and others refused"},
    "pack_dtype": {_GPTQ: "refused unless int32"},
    "lm_head": {_GPTQ: "refused unless false (a quantized lm_head is not implemented)"},
    "dynamic": {_GPTQ: "refused unless empty (per-module bits or groups)"},
    "is_marlin_format": {_GPTQ: "refused unless false"},
    "modules_in_block_to_quantize": {_GPTQ: "honoured: checked against the tensors (a linear "
                                            "with `qweight` is quantized, one with `weight` not)"},
    **{k: {_GPTQ: "no effect (how the weights were calibrated, or which kernel runs them)"}
       for k in ("damp_percent", "damp_auto_increment", "true_sequential", "static_groups",
                 "model_name_or_path", "model_file_base_name", "quantizer", "meta", "dataset",
                 "tokenizer", "use_exllama", "exllama_config", "use_cuda_fp16",
                 "max_input_length", "cache_block_outputs", "batch_size", "backend",
                 "module_name_preceding_first_block", "block_name_to_quantize")},
}


def quant_fields_markdown() -> str:
    """The quantization_config table of docs/CHECKPOINTS.md, from `QUANT_FIELDS`."""
    lines = ["| field | fp8 | gptq |", "|---|---|---|"]
    for field, per in QUANT_FIELDS.items():
        cells = [per.get(m, "refused (not a field)") for m in (_FP8, _GPTQ)]
        lines.append(f"| `{field}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class _Quant:
    """A checkpoint's quantization_config, read and checked.

    Attributes:
        method: "fp8" or "gptq".
        block: fp8's square scale block side, or GPTQ's group.
        not_converted: fp8: the modules modules_to_not_convert / ignored_layers name.
        zero_stored: gptq: how `qzeros` stores the zero 8 (7 in v1, which stores zero-points
            minus one; 8 in v2): symmetric checkpoints hold it in every entry.
        in_block: gptq: modules_in_block_to_quantize flattened (names within a layer), or None.
        sym: gptq: symmetric (the implicit zero 8) or with zero-points (`qzeros` read).
        act_order: gptq: `desc_act` true: each linear's `g_idx` (required) names its rows'
            groups; false: a `g_idx` must be k // group.
    """

    method: str
    block: int
    not_converted: frozenset[str] = frozenset()
    zero_stored: int = 0
    in_block: frozenset[str] | None = None
    sym: bool = True
    act_order: bool = False

    @property
    def zero_offset(self) -> int:
        """gptq: what a stored `qzeros` entry is short of its zero-point (1 in v1, 0 in v2)."""
        return INT4_ZERO - self.zero_stored

    @property
    def expert_format(self) -> str:
        """The routed experts' store format when they are quantized."""
        return "fp8" if self.method == _FP8 else "int4"

    def fp8(self, module: str) -> bool:
        """fp8: whether linear `module` (a Hugging Face module name) is quantized per the config:
        not lm_head, and no entry of modules_to_not_convert is a run of its dotted components."""
        if module == "lm_head":
            return False
        parts = module.split(".")
        return not any(".".join(parts[i:j]) in self.not_converted
                       for i in range(len(parts)) for j in range(i + 1, len(parts) + 1))


def _quant_refuse(field: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"config.json quantization_config {field}={value!r}: {why}")


def _quantization(hf: Mapping) -> _Quant | None:
    """config.json's quantization_config read (`QUANT_FIELDS`), or None for a plain checkpoint."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise _refuse("quantization_config", q, "expected an object of fields")
    method = q.get("quant_method")
    if method not in (_FP8, _GPTQ):
        raise _quant_refuse("quant_method", method, "implemented: fp8 (block-scaled e4m3, as "
                            "Qwen3-30B-A3B-FP8) and gptq (4-bit, as Qwen3-30B-A3B-GPTQ-Int4)")
    unknown = sorted(k for k in q if method not in QUANT_FIELDS.get(k, {}))
    if unknown:
        raise _unknown_fields(q, unknown, "quantization_config field(s)", f"{method} fields")

    def only(key, allowed, why, default=None):
        value = q.get(key, default)
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise _quant_refuse(key, value, why)
        return value

    def size(key, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _quant_refuse(key, q.get(key), "expected a positive integer")
        return value

    if method == _FP8:
        only("fmt", ("e4m3",), "only e4m3 (float8_e4m3fn) weights are implemented", "e4m3")
        only("activation_scheme", ("dynamic",), "static activation scales are not "
             "implemented (dynamic is read as weight-only)", "dynamic")
        block = q.get("weight_block_size")
        if block is None:
            raise _quant_refuse("weight_block_size", block, "per-tensor FP8 scales are not "
                                "implemented; expected a square block such as [128, 128]")
        if not isinstance(block, (list, tuple)) or len(block) != 2:
            raise _quant_refuse("weight_block_size", block, "expected [b, b]")
        side = size("weight_block_size", block[0])
        if size("weight_block_size", block[1]) != side:
            raise _quant_refuse("weight_block_size", block, "non-square scale blocks are not "
                                "implemented")
        lists = {}
        for key in ("modules_to_not_convert", "ignored_layers"):
            value = q.get(key)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise _quant_refuse(key, value, "expected a list of module names")
            lists[key] = frozenset(value)
        if len(set(lists.values())) > 1:
            raise CheckpointError("config.json quantization_config modules_to_not_convert and "
                                  "ignored_layers disagree")
        return _Quant(_FP8, side, next(iter(lists.values()), frozenset()))
    if isinstance(q.get("bits"), bool) or q.get("bits") != 4:
        raise _quant_refuse("bits", q.get("bits"), "only 4-bit GPTQ is implemented")
    group = q.get("group_size")
    if group == -1:
        raise _quant_refuse("group_size", group, "one group per input column is not implemented")
    group = size("group_size", group)
    sym = only("sym", (True, False), "expected true or false", True)
    act_order = only("desc_act", (True, False), "expected true or false", False)
    fmt = only("checkpoint_format", ("gptq", "gptq_v2"), "implemented: gptq (v1) and gptq_v2",
               "gptq")
    only("pack_dtype", ("int32",), "only int32 packing is implemented", "int32")
    only("lm_head", (False,), "a quantized lm_head is not implemented", False)
    only("is_marlin_format", (False,), "Marlin's repacked layout is not implemented", False)
    if q.get("dynamic") not in (None, {}):
        raise _quant_refuse("dynamic", q["dynamic"], "per-module overrides are not implemented")
    in_block = q.get("modules_in_block_to_quantize")
    if in_block is not None:
        flat = [n for part in in_block for n in ([part] if isinstance(part, str) else part)]
        if not all(isinstance(n, str) for n in flat):
            raise _quant_refuse("modules_in_block_to_quantize", in_block,
                                "expected lists of module names")
        in_block = frozenset(flat)
    zero = INT4_ZERO - 1 if fmt == "gptq" else INT4_ZERO
    return _Quant(_GPTQ, group, zero_stored=zero, in_block=in_block, sym=sym,
                  act_order=act_order)


def _expert_format(quant: _Quant | None, arch: _Arch, n_layers: int, n_experts: int) -> str:
    """The routed experts' store format: the checkpoint's, unless the config leaves every routed
    expert unquantized ("plain"); some quantized and some not is refused (one store format)."""
    if quant is None:
        return "plain"
    if quant.method == _FP8:
        if not quant.not_converted:
            return quant.expert_format
        flags = {}
        for l in range(n_layers):
            for e in range(n_experts):
                for name in arch.expert_names:
                    m = f"model.layers.{l}.{arch.moe_prefix}.experts.{e}.{name}"
                    flags.setdefault(quant.fp8(m), m)
        if len(flags) > 1:
            raise CheckpointError(
                f"config.json quantization_config modules_to_not_convert leaves {flags[False]!r} "
                f"unquantized but not {flags[True]!r}: routed experts are all quantized or none")
        return quant.expert_format if True in flags else "plain"
    if quant.in_block is not None and not any(".experts." in n for n in quant.in_block):
        return "plain"
    return quant.expert_format


def _architecture(hf: Mapping) -> str:
    if not isinstance(hf, Mapping):
        raise CheckpointError(f"config.json holds a {type(hf).__name__}, not an object of "
                              "fields (name: value)")
    names = hf.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    for name in names:
        if name in ARCHITECTURES:
            return name
    if not names and hf.get("model_type") is None:
        raise CheckpointError(f"config.json names no architecture (no 'architectures'); "
                              f"supported: {', '.join(ARCHITECTURES)}")
    raise CheckpointError(
        f"unknown architecture {names or hf.get('model_type')!r}; supported: "
        f"{', '.join(ARCHITECTURES)}")


# The type each numeric or switch field of config.json must have where it is given (null takes
# the default): checked before any arithmetic on them, so that the error names the field.
_TYPED_FIELDS = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_experts", "num_local_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
                     "max_position_embeddings"), "an integer"),
    **dict.fromkeys(("rms_norm_eps", "rope_theta"), "a number"),
    **dict.fromkeys(("norm_topk_prob", "tie_word_embeddings", "attention_bias",
                     "use_sliding_window"), "true or false"),
}


def _has_type(value, expected: str) -> bool:
    if expected == "true or false":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (expected == "a number" and isinstance(value, float))


def _unknown_fields(fields: Mapping, unknown: list, what: str, whose: str,
                    advice: str = "") -> CheckpointError:
    """The error for config.json `fields` (its top level or its quantization_config) holding
    `unknown` keys: the first 8 named with their values."""
    shown = ", ".join(f"{k}={fields[k]!r}" for k in unknown[:8])
    return CheckpointError(
        f"config.json {what} {shown} are not {whose} this loader knows; it refuses what it "
        f"cannot tell has no effect (see docs/CHECKPOINTS.md){advice}")


def _refuse(field: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"config.json {field}={value!r}: {why}")


class _Fields:
    """Reads config.json for one architecture: required fields, spellings, refusals."""

    def __init__(self, hf: Mapping, arch: str):
        self.hf, self.arch = hf, arch
        unknown = sorted(k for k in hf if k not in IGNORED_FIELDS
                         and arch not in FIELDS.get(k, {}))
        if unknown:
            raise _unknown_fields(hf, unknown, "field(s)", f"fields of {arch}",
                                  ". If they do not change the model's math, remove them from "
                                  "config.json")
        for k, expected in _TYPED_FIELDS.items():
            if hf.get(k) is not None and not _has_type(hf[k], expected):
                raise _refuse(k, hf[k], f"expected {expected}")

    def get(self, key: str, default=None):
        value = self.hf.get(key)
        return default if value is None else value

    def need(self, key: str):
        if self.hf.get(key) is None:
            raise CheckpointError(f"config.json has no {key!r}, which {self.arch} needs")
        return self.hf[key]

    def only(self, key: str, allowed, why: str):
        """Refuses `key` unless it is absent or one of `allowed`."""
        if key in self.hf and self.hf[key] not in allowed:
            raise _refuse(key, self.hf[key], why)

    def one_of(self, *keys: str, required: bool = True):
        """The value of whichever spelling is given; refused if two spellings disagree."""
        given = {k: self.hf[k] for k in keys if self.hf.get(k) is not None}
        if len({json.dumps(v, sort_keys=True) for v in given.values()}) > 1:
            raise CheckpointError(f"config.json spellings disagree: {given}")
        if not given:
            if required:
                raise CheckpointError(f"config.json has none of {keys}, which {self.arch} needs")
            return None
        return next(iter(given.values()))


def _rope(f: _Fields, max_position: int) -> tuple[float, RopeScaling | None, int]:
    """(theta, scaling, longest context) from both spellings: transformers 4's rope_theta and
    rope_scaling, transformers 5's rope_parameters (rope_theta, rope_type and scaling keys)."""
    params = dict(f.get("rope_parameters", {}))
    legacy = dict(f.get("rope_scaling", {}))
    for name, d in (("rope_parameters", params), ("rope_scaling", legacy)):
        nested = [k for k, v in d.items() if isinstance(v, dict)]
        if nested:
            raise _refuse(name, f.hf[name], f"RoPE parameters per layer type ({nested}) are not "
                                            "implemented")
    merged = {**params}
    for key, value in legacy.items():
        if key in merged and merged[key] != value:
            raise CheckpointError(f"config.json rope_scaling[{key!r}]={value!r} and "
                                  f"rope_parameters[{key!r}]={merged[key]!r} disagree")
        merged[key] = value
    thetas = {v for v in (f.hf.get("rope_theta"), merged.pop("rope_theta", None)) if v is not None}
    if len(thetas) > 1:
        raise CheckpointError(f"config.json gives two RoPE bases: rope_theta="
                              f"{f.hf.get('rope_theta')!r} and rope_parameters' {sorted(thetas)}")
    theta = float(thetas.pop()) if thetas else ARCHITECTURES[f.arch].rope_theta
    types = {v for v in (merged.pop("rope_type", None), merged.pop("type", None)) if v is not None}
    if len(types) > 1:
        raise CheckpointError(f"config.json RoPE type and rope_type disagree: {sorted(types)}")
    rope_type = types.pop() if types else "default"
    partial = merged.pop("partial_rotary_factor", f.hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _refuse("partial_rotary_factor", partial, "partial rotary embeddings are not "
                                                        "implemented")
    if rope_type not in _ROPE_KEYS:
        raise _refuse("rope_type", rope_type, f"RoPE scaling {rope_type!r} is not implemented; "
                                              f"implemented: {', '.join(_ROPE_KEYS)}")
    extra = sorted(set(merged) - _ROPE_KEYS[rope_type])
    if extra:
        raise CheckpointError(f"config.json RoPE parameters {extra} are not read by rope_type "
                              f"{rope_type!r} (it reads {sorted(_ROPE_KEYS[rope_type])})")
    if rope_type == "default":
        return theta, None, max_position
    factor = merged.get("factor")
    try:
        if rope_type == "yarn":
            original = int(merged.get("original_max_position_embeddings") or max_position)
            if factor is None:  # transformers 5: the ratio of the two lengths
                factor = max_position / original
            scaling = RopeScaling(
                "yarn", float(factor), original, merged.get("attention_factor"),
                merged.get("beta_fast"), merged.get("beta_slow"), merged.get("mscale"),
                merged.get("mscale_all_dim"), bool(merged.get("truncate", True)))
            return theta, scaling, max(max_position, int(factor * original))
        if factor is None:
            raise CheckpointError(f"config.json {rope_type} RoPE scaling has no 'factor'")
        # dynamic: the default frequencies up to max_position_embeddings, the longest context.
        original = max_position if rope_type == "dynamic" else None
        return theta, RopeScaling(rope_type, float(factor), original), max_position
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"config.json RoPE scaling {merged | {'rope_type': rope_type}}: "
                              f"{e}") from None


def _sliding_window(f: _Fields) -> int | None:
    if f.arch == _QWEN3:
        if not f.get("use_sliding_window", False):
            return None  # transformers drops sliding_window and max_window_layers then
        if f.get("max_window_layers", 0) != 0:
            raise _refuse("max_window_layers", f.hf["max_window_layers"],
                          "with use_sliding_window, transformers 4.51 windowed only the layers "
                          "from max_window_layers on and later versions every layer; only 0 "
                          "(every layer) is unambiguous")
        # transformers' default window when the key is absent; an explicit null is no window.
        return f.hf["sliding_window"] if "sliding_window" in f.hf else 4096
    if f.arch == _OLMOE:
        f.only("sliding_window", (None,), "transformers' OLMoE applies a window only in some "
                                          "attention kernels; not implemented")
        return None
    return f.get("sliding_window")


def config_from_hf(hf: Mapping, *, param_dtype: str | None = None) -> ModelConfig:
    """Builds a `ModelConfig` from a Hugging Face config.json dict.

    Every field is honoured, refused or known to have no effect (`FIELDS`, `IGNORED_FIELDS`,
    and `QUANT_FIELDS` inside quantization_config); both spellings of transformers 4 and 5 are
    read (rope_theta / rope_scaling and rope_parameters; num_experts and num_local_experts;
    torch_dtype and dtype). A quantized checkpoint's routed experts keep its format
    (`expert_format` "fp8" or "int4", `expert_block` its block or group).

    Args:
        hf: parsed config.json.
        param_dtype: overrides the checkpoint's dtype.

    Raises:
        CheckpointError: unknown architecture, a missing field, or a field or value this engine
            does not implement (named with its value).
    """
    arch = _architecture(hf)
    a = ARCHITECTURES[arch]
    f = _Fields(hf, arch)
    f.only("model_type", (a.model_type,), f"{arch} checkpoints have model_type {a.model_type!r}")
    f.only("hidden_act", ("silu", "swish"), "only SiLU-gated experts (silu, swish) are "
                                            "implemented")
    f.only("pruned_heads", ({}, None), "pruned attention heads are not implemented")
    f.only("is_encoder_decoder", (False,), "a decoder-only model has no encoder")
    f.only("add_cross_attention", (False,), "cross-attention is not implemented")
    f.only("attention_bias", (False, True) if arch != _MIXTRAL else (False,),
           "Mixtral has no attention biases")
    if arch == _QWEN3:
        f.only("mlp_only_layers", ([], None), "dense MLP layers in a Qwen3-MoE checkpoint are "
                                              "not implemented")
        f.only("decoder_sparse_step", (1,), "dense MLP layers in a Qwen3-MoE checkpoint are "
                                            "not implemented")
        inter = f.need("moe_intermediate_size")
    else:
        inter = f.need("intermediate_size")
    if arch == _MIXTRAL:
        f.only("norm_topk_prob", (True,), "Mixtral always renormalises its top-k weights")
    if arch == _OLMOE:
        f.only("clip_qkv", (None,), "clipping q/k/v is not implemented")
    n_experts = f.one_of("num_experts", "num_local_experts")
    dtype = param_dtype or str(f.one_of("dtype", "torch_dtype", required=False) or "bfloat16")
    if dtype not in _DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    heads = f.need("num_attention_heads")
    hidden = f.need("hidden_size")
    max_position = int(f.get("max_position_embeddings", a.max_position_embeddings))
    theta, scaling, longest = _rope(f, max_position)
    quant = _quantization(hf)
    n_layers = f.need("num_hidden_layers")
    expert_format = _expert_format(quant, a, n_layers, n_experts)
    try:
        return ModelConfig(
            name=str(f.get("_name_or_path") or f.get("model_type") or arch),
            vocab_size=f.need("vocab_size"),
            hidden_size=hidden,
            n_layers=n_layers,
            n_heads=heads,
            n_kv_heads=f.get("num_key_value_heads", heads),
            head_dim=f.get("head_dim", hidden // heads),
            n_experts=n_experts,
            top_k=f.need("num_experts_per_tok"),
            expert_intermediate=inter,
            norm_topk_prob=bool(f.get("norm_topk_prob", a.norm_topk_prob)),
            qk_norm=a.qk_norm,
            attention_bias=bool(f.get("attention_bias", False)),
            rope_theta=theta,
            rope_scaling=scaling,
            sliding_window=_sliding_window(f),
            rms_norm_eps=float(f.get("rms_norm_eps", a.rms_norm_eps)),
            tie_embeddings=bool(f.get("tie_word_embeddings", False)),
            max_seq_len=longest,
            param_dtype=dtype,
            expert_format=expert_format,
            expert_block=quant.block if expert_format != "plain" else 0,
            expert_zero_points=expert_format == "int4" and not quant.sym,
            expert_act_order=expert_format == "int4" and quant.act_order,
        )
    except ValueError as e:
        raise CheckpointError(f"config.json describes a model this engine cannot build: {e}"
                              ) from None


class HostExpertStore:
    """Routed experts in host memory: per MoE layer a C-contiguous [E, 3*H*I] blob array.

    Blob layout as in `strata_jax.experts`: concat(gate [H, I], up [H, I], down [I, H]) per expert.
    """

    def __init__(self, config: ModelConfig, blobs: Mapping[int, np.ndarray]):
        if config.expert_format != "plain":
            raise ValueError(
                f"HostExpertStore holds plain blobs, not {config.expert_format} experts: a "
                "quantized checkpoint's experts go straight into the engine's store "
                "(Engine(..., experts=ckpt.experts.as_mapping()))")
        self.config = config
        self._blobs = dict(blobs)

    @classmethod
    def empty(cls, config: ModelConfig) -> "HostExpertStore":
        """Allocates zeroed blobs for every MoE layer."""
        size = blob_size(config.hidden_size, config.expert_intermediate)
        return cls(config, {l: np.zeros((config.n_experts, size), config.dtype)
                            for l in config.moe_layers})

    @classmethod
    def from_weights(cls, config: ModelConfig, experts: Mapping[int, ExpertWeights]
                     ) -> "HostExpertStore":
        """Packs layer -> ExpertWeights (NumPy) into a store."""
        from strata_jax.experts import pack_expert_blobs_np

        return cls(config, {l: np.ascontiguousarray(pack_expert_blobs_np(
            ExpertWeights(*(np.asarray(a).astype(config.dtype) for a in w))))
            for l, w in experts.items()})

    @property
    def layers(self) -> tuple[int, ...]:
        """MoE layer indices held."""
        return tuple(sorted(self._blobs))

    @property
    def nbytes(self) -> int:
        """Total bytes of all blobs."""
        return sum(b.nbytes for b in self._blobs.values())

    def blobs(self, layer: int) -> np.ndarray:
        """[E, 3*H*I] blobs of `layer` (the stored array, not a copy)."""
        return self._blobs[layer]

    def layer(self, layer: int) -> ExpertWeights:
        """ExpertWeights views (no copy) into `layer`'s blobs."""
        return unpack_expert_blobs_np(self._blobs[layer], self.config.hidden_size,
                                      self.config.expert_intermediate)

    def as_mapping(self) -> dict[int, ExpertWeights]:
        """layer -> ExpertWeights views, for `build_model(..., experts=...)`."""
        return {l: self.layer(l) for l in self.layers}


# safetensors dtype names -> NumPy dtypes, for the tensors read here byte by byte (safe_open's NumPy
# reader has no float8 type).
_ST_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "BF16": np.dtype(ml_dtypes.bfloat16),
              "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
              "F64": np.dtype(np.float64), "I32": np.dtype(np.int32),
              "I64": np.dtype(np.int64), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
              "U8": np.dtype(np.uint8)}


def _st_header(path: str) -> tuple[int, dict]:
    """(offset of the data, header) of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return 8 + n, json.loads(f.read(n))


def _st_read(f, start: int, info: Mapping) -> np.ndarray:
    """One tensor of an open safetensors file (`info`: its header entry), read byte by byte."""
    if info["dtype"] not in _ST_DTYPES:
        raise CheckpointError(f"safetensors dtype {info['dtype']} is not read by this loader")
    dtype = _ST_DTYPES[info["dtype"]]
    lo, hi = info["data_offsets"]
    f.seek(start + lo)
    return np.fromfile(f, dtype=dtype, count=(hi - lo) // dtype.itemsize).reshape(info["shape"])


# Each plane of an expert format: (matrix, the Hugging Face tensor's suffix, transposed on load).
# fp8: `weight` [out, in] and `weight_scale_inv` [out / b, in / b], both transposed; GPTQ:
# `qweight` [in / 8, out] (its words' values rearranged into the format's group halves),
# `scales` [in / group, out], already [in, out], and with zero-points `qzeros` [in / group,
# out / 8] (its words unpacked along out, plus the v1 offset).
_PLANE_SOURCES = {
    "plain": {m: (m, "weight", True) for m in ExpertWeights._fields},
    "fp8": {**{m: (m, "weight", True) for m in ExpertWeights._fields},
            **{f"{m}_scale": (m, "weight_scale_inv", True) for m in ExpertWeights._fields}},
    "int4": {**{m: (m, "qweight", False) for m in ExpertWeights._fields},
             **{f"{m}_scale": (m, "scales", False) for m in ExpertWeights._fields},
             **{f"{m}_zero": (m, "qzeros", False) for m in ExpertWeights._fields},
             **{f"{m}_perm": (m, "g_idx", False) for m in ExpertWeights._fields}},
}


class CheckpointExperts(Mapping[str, np.ndarray]):
    """A checkpoint's routed experts, read from its safetensors files when asked for.

    name -> tensor in the model's layout, one per plane of the config's expert format
    (`model.expert_plane_names`): plain, "layers.3.mlp.gate": [E, H, I], "...up": [E, H, I],
    "...down": [E, I, H] in the parameter dtype; fp8 (`ModelConfig.expert_format`), each matrix
    in float8_e4m3fn and "...gate_scale" etc. float32 [E, ceil(in/b), ceil(out/b)] (the
    checkpoint's `weight` and `weight_scale_inv`, transposed); int4, GPTQ's `qweight` int32
    [in/8, out] words rearranged into the format's group halves, uint8 [E, in/2, out]
    (`formats.gptq_halves_np`, the same bytes), `scales` float16 [E, in/group, out] as
    they are, with zero-points `qzeros` unpacked, uint8 [E, in/group, out] (plus one in
    GPTQ v1, which stores them minus one), and with act-order each expert's rows sorted by
    its `g_idx` (stable; `qweight`'s values moved with their rows) and int32 [E, in] naming
    the input row each stored row is (`formats.g_idx_perm`).
    Read when asked for and
    not kept. `fill(name, out)` reads each expert's tensor straight into `out`, one expert at a
    time: how an engine's host store takes them (`as_mapping`, `strata_jax.weights`), so no
    copy of every expert exists outside the store. Each read opens the files it needs and
    closes them after: a held safetensors handle keeps every page it has read mapped in the
    process (its resident set would grow by the checkpoint's size).

    Made by `load_checkpoint`, which has checked every expert tensor's name, shape and (in a
    quantized checkpoint) dtype.
    """

    def __init__(self, config: ModelConfig, arch: _Arch, files: Mapping[str, str],
                 zero_offset: int = 0):
        from strata_jax.model import expert_plane_names  # deferred: keeps this module light

        self.config = config
        self._zero_offset = int(zero_offset)  # GPTQ v1's qzeros are stored minus one
        self.format = ExpertFormat.of(config)
        self._arch = arch
        self._files = dict(files)  # Hugging Face name -> the file that holds it
        self._headers: dict[str, tuple[int, dict]] = {}
        self._names = {n: (l, p) for l in config.moe_layers
                       for p, n in expert_plane_names(config, l).items()}

    @staticmethod
    def hf_names(config: ModelConfig, arch: _Arch, layer: int, field: str,
                 suffix: str = "weight") -> list[str]:
        """The Hugging Face names of `layer`'s `field` ("gate", "up", "down") tensors, one per
        expert: `<module>.<suffix>` (plain: `weight`, [out, in]: gate and up [I, H], down
        [H, I])."""
        hf = dict(zip(ExpertWeights._fields, arch.expert_names))[field]
        base = f"model.layers.{layer}.{arch.moe_prefix}.experts."
        return [f"{base}{e}.{hf}.{suffix}" for e in range(config.n_experts)]

    def _shape(self, plane: str) -> tuple[int, ...]:
        return (self.config.n_experts, *self.format.plane(plane).shape)

    def __getitem__(self, name: str) -> np.ndarray:
        _, plane = self._names[name]
        out = np.empty(self._shape(plane), self.format.plane(plane).dtype)
        self.fill(name, out)
        return out

    def __contains__(self, name) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def fill(self, name: str, out: np.ndarray) -> None:
        """Reads tensor `name` into `out` ([E, *plane shape]: plain [E, H, I], or [E, I, H] for
        down, cast to its dtype; a quantized plane in its own dtype), one expert at a time, each
        file opened once."""
        layer, plane = self._names[name]
        if tuple(out.shape) != self._shape(plane):
            raise ValueError(f"parameter {name!r} has shape {self._shape(plane)}; the array to "
                             f"fill has {tuple(out.shape)}")
        kind = self.format.kind
        field, suffix, transpose = _PLANE_SOURCES[kind][plane]
        want = self.format.plane(plane).dtype
        if kind != "plain" and np.dtype(out.dtype) != want:
            raise ValueError(f"parameter {name!r} is {want} (a {kind} plane: a cast would drop "
                             f"its scale); the array to fill is {np.dtype(out.dtype)}")
        by_file: dict[str, list[tuple[int, str]]] = {}
        for e, hf in enumerate(self.hf_names(self.config, self._arch, layer, field, suffix)):
            by_file.setdefault(self._files[hf], []).append((e, hf))
        for path, items in by_file.items():
            if kind == "plain":
                with safe_open(path, framework="numpy") as handle:
                    for e, hf in items:
                        out[e] = handle.get_tensor(hf).T  # [out, in] -> [in, out]
                continue
            if path not in self._headers:
                self._headers[path] = _st_header(path)
            start, header = self._headers[path]
            with open(path, "rb") as f:
                for e, hf in items:
                    value = _st_read(f, start, header[hf])
                    if kind == "int4" and suffix == "qweight":
                        out[e] = gptq_halves_np(value, self.format.block)
                        if self.format.act_order:  # the rows in group order
                            perm = self._perm(layer, field, e)
                            vals = int4_values_np(out[e], self.format.block)[perm]
                            out[e] = int4_halves_np(vals, self.format.block)
                    elif kind == "int4" and suffix == "g_idx":
                        out[e] = g_idx_perm(value, self.format.block)
                    elif kind == "int4" and suffix == "qzeros":
                        out[e] = _unpack_int4(value, axis=1) + self._zero_offset
                    else:
                        out[e] = value.T if transpose else value

    def _perm(self, layer: int, field: str, expert: int) -> np.ndarray:
        """An act-order expert matrix's stored row order, from its `g_idx`."""
        hf = self.hf_names(self.config, self._arch, layer, field, "g_idx")[expert]
        path = self._files[hf]
        if path not in self._headers:
            self._headers[path] = _st_header(path)
        start, header = self._headers[path]
        with open(path, "rb") as f:
            return g_idx_perm(_st_read(f, start, header[hf]), self.format.block)

    @property
    def layers(self) -> tuple[int, ...]:
        """MoE layer indices."""
        return tuple(self.config.moe_layers)

    @property
    def nbytes(self) -> int:
        """Bytes of every expert in its store format (what a host store of them holds)."""
        return self.config.expert_bytes_total

    def planes(self, layer: int) -> dict[str, np.ndarray]:
        """`layer`'s planes read now (new arrays): plane name -> [E, *shape]."""
        from strata_jax.model import expert_plane_names

        return {p: self[n] for p, n in expert_plane_names(self.config, layer).items()}

    def layer(self, layer: int) -> ExpertWeights:
        """`layer`'s experts read now (new arrays), in the parameter dtype: dequantized from a
        quantized format (`ExpertFormat.dequantize_np`)."""
        planes = self.planes(layer)
        if self.format.kind == "plain":
            return ExpertWeights(*(planes[m] for m in ExpertWeights._fields))
        return ExpertWeights(*(self.format.dequantize_np(planes, m)
                               for m in ExpertWeights._fields))

    def blobs(self, layer: int) -> np.ndarray:
        """`layer`'s experts read now into new blobs (`strata_jax.formats`): plain [E, 3*H*I]
        in the parameter dtype (`strata_jax.experts`), quantized [E, blob_bytes] uint8."""
        c = self.config
        if self.format.kind == "plain":
            out = np.empty((c.n_experts, blob_size(c.hidden_size, c.expert_intermediate)),
                           c.dtype)
            self.as_mapping()[layer].fill(
                unpack_expert_blobs_np(out, c.hidden_size, c.expert_intermediate))
            return out
        out = np.zeros((c.n_experts, self.format.blob_bytes), np.uint8)
        self.as_mapping()[layer].fill(self.format.split_np(out))
        return out

    def as_mapping(self) -> dict:
        """layer -> `weights.LazyExperts` over the format's planes (read when used), for
        `Engine(experts=...)` and `build_model(..., experts=...)`."""
        from strata_jax.model import expert_plane_names
        from strata_jax.weights import LazyExperts

        return {l: LazyExperts(self, expert_plane_names(self.config, l)) for l in self.layers}


@dataclasses.dataclass
class LoadedCheckpoint:
    """Result of `load_checkpoint`.

    Attributes:
        config: model config derived from config.json.
        params: flat name -> NumPy array for every non-expert parameter (model layout).
        experts: the routed experts, read from the files when used (`CheckpointExperts`).
    """

    config: ModelConfig
    params: dict[str, np.ndarray]
    experts: CheckpointExperts

    def build_model(self, *, resident_experts: bool = True):
        """The model with non-expert params on the device, and experts too when resident."""
        from strata_jax.model import build_model

        return build_model(self.config, self.params, experts=self.experts.as_mapping(),
                           resident_experts=resident_experts)


class _Tensors:
    """Name -> tensor over the shards of a safetensors directory (mmap via safe_open)."""

    def __init__(self, directory: str):
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(single):
            weight_map = None
        else:
            raise CheckpointError(
                f"{directory}: neither model.safetensors.index.json nor model.safetensors exists")
        self._directory = directory
        self._handles = {}
        self._headers: dict[str, tuple[int, dict]] = {}  # path -> _st_header, read when needed
        self._where: dict[str, str] = {}
        self._taken: set[str] = set()
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise CheckpointError(f"shard {path} listed in the index does not exist")
            handle = safe_open(path, framework="numpy")
            self._handles[name] = handle
            for key in handle.keys():
                self._where[key] = name

    def _check(self, name: str, shape: tuple[int, ...], dtype: str | None) -> str:
        """The tensor's safetensors dtype, after checking it exists, its shape and (`dtype`
        given) its dtype; a float8 tensor where none is expected is refused."""
        if name not in self._where:
            what = f"{dtype} " if dtype else ""
            raise CheckpointError(f"missing tensor {name!r} (expected {what}shape {shape})")
        piece = self._handles[self._where[name]].get_slice(name)
        actual = tuple(piece.get_shape())
        if actual != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {actual}, expected {tuple(shape)}")
        stored = piece.get_dtype()
        if dtype is not None and stored != dtype:
            raise CheckpointError(f"tensor {name!r} is {stored}, expected {dtype}")
        if dtype is None and stored.startswith("F8"):
            raise CheckpointError(
                f"tensor {name!r} is {stored} (float8), but config.json's quantization_config "
                "leaves it unquantized (no quantization_config, or modules_to_not_convert names "
                "it)")
        return stored

    def get(self, name: str, shape: tuple[int, ...], dtype: str | None = None) -> np.ndarray:
        """Tensor `name`, checked (shape; its safetensors dtype where `dtype` is given) and
        counted as read."""
        stored = self._check(name, shape, dtype)
        self._taken.add(name)
        if stored in _ST_DTYPES and stored.startswith("F8"):  # no NumPy float8 in safe_open
            path = os.path.join(self._directory, self._where[name])
            if path not in self._headers:
                self._headers[path] = _st_header(path)
            start, header = self._headers[path]
            with open(path, "rb") as f:
                return _st_read(f, start, header[name])
        return self._handles[self._where[name]].get_tensor(name)

    def path(self, name: str, shape: tuple[int, ...], dtype: str | None = None) -> str:
        """The file that holds tensor `name`, checked and counted as `get` does, without
        reading the tensor (`CheckpointExperts` reads it when it is used)."""
        self._check(name, shape, dtype)
        self._taken.add(name)
        return os.path.join(self._directory, self._where[name])

    def names(self) -> list[str]:
        """Every tensor name in the files."""
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def check_all_taken(self) -> None:
        """Refuses tensors no step of the load read: weights the model would silently drop."""
        unused = sorted(set(self._where) - self._taken)
        if unused:
            shown = ", ".join(repr(n) for n in unused[:5])
            more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
            raise CheckpointError(
                f"{len(unused)} tensor(s) in the checkpoint are not used by the model config.json "
                f"describes: {shown}{more}; a config field that should bring them in is missing, "
                "or the checkpoint is not the architecture it names")


def _layer_plan(config: ModelConfig, arch: _Arch, layer: int
                ) -> Iterator[tuple[str, str, tuple[int, ...], bool]]:
    """(our name, HF name, HF shape, transpose) for one layer's non-expert tensors."""
    c, hf, ours = config, f"model.layers.{layer}.", f"layers.{layer}."
    yield ours + "input_norm.weight", hf + "input_layernorm.weight", (c.hidden_size,), False
    yield ours + "post_attn_norm.weight", hf + "post_attention_layernorm.weight", (c.hidden_size,), False
    for proj, out_dim in (("q_proj", c.q_dim), ("k_proj", c.kv_dim), ("v_proj", c.kv_dim)):
        yield ours + f"attn.{proj}", hf + f"self_attn.{proj}.weight", (out_dim, c.hidden_size), True
    yield ours + "attn.o_proj", hf + "self_attn.o_proj.weight", (c.hidden_size, c.q_dim), True
    if c.attention_bias:
        for proj, out_dim in (("q", c.q_dim), ("k", c.kv_dim), ("v", c.kv_dim),
                              ("o", c.hidden_size)):
            yield ours + f"attn.{proj}_bias", hf + f"self_attn.{proj}_proj.bias", (out_dim,), False
    if c.qk_norm != "none":
        q_dim, k_dim = ((c.head_dim, c.head_dim) if c.qk_norm == "per_head" else (c.q_dim, c.kv_dim))
        yield ours + "attn.q_norm.weight", hf + "self_attn.q_norm.weight", (q_dim,), False
        yield ours + "attn.k_norm.weight", hf + "self_attn.k_norm.weight", (k_dim,), False
    yield (ours + "mlp.router", hf + f"{arch.moe_prefix}.{arch.router}.weight",
           (c.n_experts, c.hidden_size), True)


def _check_tied_head(tensors: _Tensors, embed: np.ndarray, c: ModelConfig) -> None:
    """With tie_word_embeddings an lm_head.weight in the files must equal the embedding (the
    model uses the embedding)."""
    head = tensors.get("lm_head.weight", (c.vocab_size, c.hidden_size)).astype(c.dtype)
    if not np.array_equal(head, embed):
        raise CheckpointError("config.json tie_word_embeddings=true, but lm_head.weight differs "
                              "from model.embed_tokens.weight")


def _check_rope_buffers(tensors: _Tensors, c: ModelConfig) -> None:
    """Rotary frequency buffers some checkpoints carry (`...rotary_emb.inv_freq`) must match
    the frequencies config.json gives (the model computes its own)."""
    inv_freq = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)[0]
    for name in tensors.names():
        if name.endswith("rotary_emb.inv_freq"):
            saved = tensors.get(name, inv_freq.shape).astype(np.float64)
            if not np.allclose(saved, inv_freq, rtol=1e-5, atol=0.0):
                raise CheckpointError(
                    f"tensor {name!r} holds RoPE frequencies that differ from config.json's "
                    f"(rope_theta={c.rope_theta}, rope_scaling={c.rope_scaling})")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _unpack_int4(words: np.ndarray, axis: int) -> np.ndarray:
    """GPTQ's packing undone: each int32 word holds eight 4-bit values, value j in bits
    4j..4j+3, consecutive along `axis` (qweight: the input dim, 0; qzeros: the output dim, 1)."""
    shifts = np.arange(INT4_PER_WORD, dtype=np.uint32) * 4
    u = np.moveaxis(words.view(np.uint32), axis, -1)[..., None]  # [..., n, 1]
    vals = ((u >> shifts) & 15).reshape(*u.shape[:-2], -1)  # [..., 8n]
    return np.moveaxis(vals, -1, axis).astype(np.int32)


def _gptq_shapes(quant: _Quant, module: str, k: int, n: int) -> dict[str, tuple[int, ...]]:
    """The GPTQ tensors of a linear of input width `k` and output width `n`: qweight, scales,
    qzeros, g_idx (refused where the widths do not suit the packing or the group)."""
    g = quant.block
    if k % g or k % INT4_PER_WORD or n % INT4_PER_WORD:
        raise CheckpointError(
            f"GPTQ linear {module!r} is [{n}, {k}] ([out, in]): its input width must be a "
            f"multiple of group_size={g} and of 8, its output width of 8 (the packed layout)")
    return {"qweight": (k // INT4_PER_WORD, n), "scales": (k // g, n),
            "qzeros": (k // g, n // INT4_PER_WORD), "g_idx": (k,)}


def _gptq_quantized(tensors: "_Tensors", quant: _Quant, module: str) -> bool:
    """Whether GPTQ linear `module` is quantized: it has a `qweight` (else a `weight`),
    cross-checked against modules_in_block_to_quantize where config.json gives it."""
    has = tensors.has(f"{module}.qweight")
    if quant.in_block is not None and module.startswith("model.layers."):
        rel = module.split(".", 3)[3]  # the name within the layer: "self_attn.q_proj"
        if (rel in quant.in_block) != has:
            said = "names" if rel in quant.in_block else "does not name"
            raise CheckpointError(
                f"config.json quantization_config modules_in_block_to_quantize {said} {rel!r}, "
                f"but the files hold {module}.{'qweight' if has else 'weight'}")
    return has


def _gptq_check(tensors: "_Tensors", quant: _Quant, module: str, k: int, n: int,
                biased: bool, expert: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Reads and checks a GPTQ linear's side tensors: `qzeros` (its shape; symmetric: every
    entry the implicit zero), `g_idx` (`_gptq_g_idx`), and a `bias` the model has no place for
    all zero (`biased`: the model reads the linear's bias itself). Returns (the zero-points
    as stored, unpacked [k / group, n]; each input row's group [k]). A routed `expert`'s
    act-order groups must hold group_size rows each (its rows are stored in group order)."""
    shapes = _gptq_shapes(quant, module, k, n)
    zeros = _unpack_int4(tensors.get(f"{module}.qzeros", shapes["qzeros"], "I32"), axis=1)
    bad = np.argwhere(zeros != quant.zero_stored) if quant.sym else np.zeros((0, 2), int)
    if bad.size:
        at = tuple(int(i) for i in bad[0])
        v1 = ", minus one in checkpoint_format gptq" if quant.zero_stored != INT4_ZERO else ""
        raise CheckpointError(
            f"tensor '{module}.qzeros' holds the zero-point {int(zeros[at])} at {list(at)}; "
            f"symmetric GPTQ (sym=true) stores {quant.zero_stored} everywhere (the zero "
            f"{INT4_ZERO}{v1}); a checkpoint with zero-points says sym=false in config.json "
            "quantization_config")
    rows = _gptq_g_idx(tensors, quant, module, k, n)
    bad = unequal_group(rows, quant.block) if expert and quant.act_order else None
    if bad is not None:
        raise CheckpointError(
            f"tensor '{module}.g_idx' puts {bad[1]} rows in group {bad[0]}, not "
            f"group_size={quant.block}: a routed expert's act-order groups are read in "
            "group order and must hold group_size rows each (as GPTQ makes them)")
    if not biased and tensors.has(f"{module}.bias"):
        bias = tensors.get(f"{module}.bias", (n,))
        if np.any(bias != 0):
            raise CheckpointError(f"tensor '{module}.bias' is not zero, and the model's "
                                  f"{module.rsplit('.', 1)[-1]} has no bias")
    return zeros, rows


def _gptq_g_idx(tensors: "_Tensors", quant: _Quant, module: str, k: int, n: int) -> np.ndarray:
    """Each input row's group, int [k], of GPTQ linear `module`: its `g_idx`, required with
    act-order (desc_act true; every entry a group, 0 .. k / group - 1), else where present
    k // group (k // group where absent)."""
    rows = np.arange(k) // quant.block
    name = f"{module}.g_idx"
    if not tensors.has(name):
        if quant.act_order:
            raise CheckpointError(
                f"tensor '{name}' is missing: with desc_act=true (act-order) each quantized "
                "linear names its rows' groups in g_idx")
        return rows
    g_idx = tensors.get(name, _gptq_shapes(quant, module, k, n)["g_idx"], "I32")
    if quant.act_order:
        bad = np.flatnonzero((g_idx < 0) | (g_idx >= k // quant.block))
        if bad.size:
            raise CheckpointError(
                f"tensor '{name}' names group {int(g_idx[bad[0]])} for row {int(bad[0])}; "
                f"a {k}-wide input in groups of {quant.block} has groups 0 .. "
                f"{k // quant.block - 1}")
        return g_idx
    if not np.array_equal(g_idx, rows):
        raise CheckpointError(
            f"tensor '{name}' is not k // group_size (group {quant.block}): a permuted g_idx "
            "is act-order, which config.json quantization_config says is off (desc_act=false)")
    return rows


def _linear(tensors: "_Tensors", quant: _Quant, module: str, shape: tuple[int, int],
            dtype: np.dtype, biased: bool) -> np.ndarray:
    """Linear `module` ([out, in] = `shape` in the files) in the model's [in, out] layout and
    the parameter dtype: a quantized one dequantized (one float32 product per value, one cast,
    as `formats.ExpertFormat.dequantize_np` does)."""
    n, k = shape
    if quant.method == _FP8:
        if not quant.fp8(module):
            return np.ascontiguousarray(tensors.get(f"{module}.weight", shape).T.astype(dtype))
        b = quant.block
        w = tensors.get(f"{module}.weight", shape, "F8_E4M3")
        s = tensors.get(f"{module}.weight_scale_inv", (_cdiv(n, b), _cdiv(k, b)), "F32")
        full = np.repeat(np.repeat(s, b, axis=0), b, axis=1)[:n, :k]
        return np.ascontiguousarray((w.astype(np.float32) * full).astype(dtype).T)
    if not _gptq_quantized(tensors, quant, module):
        return np.ascontiguousarray(tensors.get(f"{module}.weight", shape).T.astype(dtype))
    shapes = _gptq_shapes(quant, module, k, n)
    zeros, rows = _gptq_check(tensors, quant, module, k, n, biased)  # rows: each row's group
    q = _unpack_int4(tensors.get(f"{module}.qweight", shapes["qweight"], "I32"), axis=0)
    s = tensors.get(f"{module}.scales", shapes["scales"], "F16").astype(np.float32)
    zero = INT4_ZERO
    if not quant.sym:
        zero = (zeros + quant.zero_offset)[rows]
    return ((q - zero).astype(np.float32) * s[rows]).astype(dtype)


def _expert_files(tensors: "_Tensors", quant: _Quant | None, c: ModelConfig, arch: _Arch,
                  layer: int) -> dict[str, str]:
    """Checks `layer`'s routed expert tensors (names, shapes, dtypes; GPTQ's side tensors read
    and checked) and returns Hugging Face name -> file of those its `CheckpointExperts` reads."""
    files: dict[str, str] = {}
    fmt = ExpertFormat.of(c)
    for field in ExpertWeights._fields:
        k, n = fmt.matrix_shape(field)  # [in, out]
        weights = CheckpointExperts.hf_names(c, arch, layer, field)
        modules = [w[:-len(".weight")] for w in weights]
        if fmt.kind == "plain":
            for w, module in zip(weights, modules):
                if quant is not None and quant.method == _GPTQ and _gptq_quantized(
                        tensors, quant, module):
                    raise CheckpointError(
                        f"routed expert {module!r} is GPTQ-quantized (it has a qweight), but "
                        "modules_in_block_to_quantize names no routed expert")
                files[w] = tensors.path(w, (n, k))
        elif fmt.kind == "fp8":
            b = fmt.block
            for module in modules:
                files[f"{module}.weight"] = tensors.path(f"{module}.weight", (n, k), "F8_E4M3")
                files[f"{module}.weight_scale_inv"] = tensors.path(
                    f"{module}.weight_scale_inv", (_cdiv(n, b), _cdiv(k, b)), "F32")
        else:
            shapes = _gptq_shapes(quant, modules[0], k, n)
            for module in modules:
                if not _gptq_quantized(tensors, quant, module):
                    raise CheckpointError(
                        f"routed expert {module!r} has no qweight (a {module}.weight instead?): "
                        "a GPTQ checkpoint's routed experts are all quantized or none")
                side = (("qweight", "I32"), ("scales", "F16")) + (
                    () if quant.sym else (("qzeros", "I32"),)) + (
                    (("g_idx", "I32"),) if quant.act_order else ())
                for suffix, dt in side:
                    files[f"{module}.{suffix}"] = tensors.path(f"{module}.{suffix}",
                                                               shapes[suffix], dt)
                _gptq_check(tensors, quant, module, k, n, False, expert=True)
    return files


def load_checkpoint(directory: str, *, param_dtype: str | None = None,
                    progress: bool = True) -> LoadedCheckpoint:
    """Loads a Hugging Face safetensors checkpoint directory: the non-expert weights into host
    memory, the routed experts checked and left in the files until used (`CheckpointExperts`:
    an engine reads them straight into its host store, or onto the device, one tensor at a
    time).

    Args:
        directory: holds config.json and model.safetensors(.index.json) plus shards.
        param_dtype: cast everything to this dtype (default: the checkpoint's torch_dtype).
        progress: show a tqdm bar over layers.

    Returns:
        LoadedCheckpoint(config, params, experts); nothing is on the device yet.

    Raises:
        CheckpointError: missing config/files, unknown architecture, missing or misshaped tensor.
    """
    config_path = os.path.join(directory, "config.json")
    if not os.path.exists(config_path):
        raise CheckpointError(f"{config_path} does not exist")
    with open(config_path) as f:
        hf = json.load(f)
    config = config_from_hf(hf, param_dtype=param_dtype)
    arch = ARCHITECTURES[_architecture(hf)]
    quant = _quantization(hf)
    tensors = _Tensors(directory)
    dtype = config.dtype

    def take(hf_name: str, shape, transpose: bool) -> np.ndarray:
        if transpose and quant is not None:  # a linear, perhaps quantized: [in, out]
            module = hf_name[:-len(".weight")]
            return _linear(tensors, quant, module, shape, dtype,
                           config.attention_bias and ".self_attn." in module)
        value = tensors.get(hf_name, shape)
        value = value.T if transpose else value
        return np.ascontiguousarray(value.astype(dtype, copy=False))

    c = config
    params: dict[str, np.ndarray] = {
        "embed": take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), False),
        "final_norm.weight": take("model.norm.weight", (c.hidden_size,), False),
    }
    if not c.tie_embeddings:  # lm_head is never quantized (a quantized one is refused)
        params["lm_head"] = np.ascontiguousarray(tensors.get(
            "lm_head.weight", (c.vocab_size, c.hidden_size)).T.astype(dtype, copy=False))
    elif tensors.has("lm_head.weight"):
        _check_tied_head(tensors, params["embed"], c)
    _check_rope_buffers(tensors, c)
    # The experts are only checked here (names, shapes, dtypes: the file headers; GPTQ's small
    # qzeros and g_idx read) and read when used: an engine's host store takes them straight
    # from the files (CheckpointExperts), in their format.
    files: dict[str, str] = {}
    bar = tqdm(range(c.n_layers), desc="loading layers", unit="layer", disable=not progress)
    for layer in bar:
        for ours, hf_name, shape, transpose in _layer_plan(c, arch, layer):
            params[ours] = take(hf_name, shape, transpose)
        if layer in c.moe_layers:
            files.update(_expert_files(tensors, quant, c, arch, layer))
    tensors.check_all_taken()
    return LoadedCheckpoint(config, params, CheckpointExperts(
        config, arch, files, quant.zero_offset if quant is not None else 0))


def load_model(directory: str, *, resident_experts: bool = True, param_dtype: str | None = None,
               progress: bool = True):
    """Loads a checkpoint and builds the model.

    Returns:
        (model, LoadedCheckpoint); with `resident_experts=False` the experts stay on the host only.
    """
    ckpt = load_checkpoint(directory, param_dtype=param_dtype, progress=progress)
    return ckpt.build_model(resident_experts=resident_experts), ckpt


__all__: list[str] = [
    "ARCHITECTURES", "CheckpointError", "CheckpointExperts", "FIELDS", "HostExpertStore",
    "IGNORED_FIELDS", "LoadedCheckpoint", "QUANT_FIELDS", "config_from_hf", "fields_markdown",
    "load_checkpoint", "load_model", "quant_fields_markdown",
]
