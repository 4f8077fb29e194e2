"""Reading a Hugging Face config.json: every field honoured, refused with its value, or known to
have no effect on the logits.

Guards against a model that is silently another one. A family module (`strata_jax.models.<family>`)
lists how it treats each of its fields (`Family.fields`); a field it does not list, that is not in
`IGNORED_FIELDS`, is refused by name. The machinery here is shared by every family: the field
reader (`HFFields`: required fields, spellings, refusals, types), RoPE in both spellings
(transformers 4's rope_theta / rope_scaling, 5's rope_parameters), and quantization_config
(`QUANT_FIELDS`: block-scaled FP8 and 4-bit GPTQ checkpoints).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from typing import Callable, Mapping

from strata_jax.config import DTYPES, ModelConfig
from strata_jax.formats import INT4_ZERO, MXFP4_GROUP
from strata_jax.config import RopeScaling


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: missing/misshaped/unused tensor, unknown architecture, a
    config.json field this engine does not implement, bad files."""


@dataclasses.dataclass(frozen=True)
class TensorNames:
    """Where a family's checkpoint keeps each MoE layer's router and routed experts.

    Attributes:
        moe_prefix: the MoE block under `<model_prefix>layers.N.` ("mlp", "block_sparse_moe").
        router: the router's module under the MoE block ("gate").
        expert_names: gate, up and down's modules under `experts.E.`.
        model_prefix: where the decoder's tensors are ("model."; a multimodal checkpoint's
            text model "model.language_model.").
        fused: each layer's experts are one tensor per matrix with the experts leading
            (gpt-oss: `experts.gate_up_proj` [E, H, 2I], gate and up interleaved along the
            output, `experts.down_proj` [E, I, H], their biases and MXFP4 `_blocks` /
            `_scales`), read per expert; `expert_names` then names (gate_up, gate_up, down).
    """

    moe_prefix: str
    router: str
    expert_names: tuple[str, str, str]
    model_prefix: str = "model."
    fused: bool = False

    def layer(self, layer: int) -> str:
        """The Hugging Face prefix of layer `layer`'s tensors ("model.layers.3.")."""
        return f"{self.model_prefix}layers.{layer}."

    def expert(self, layer: int, expert: int, matrix: int) -> str:
        """The Hugging Face module of one routed expert's matrix (0 gate, 1 up, 2 down)."""
        return (f"{self.layer(layer)}{self.moe_prefix}.experts.{expert}."
                f"{self.expert_names[matrix]}")


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: how its checkpoints read and which presets it has.

    Attributes:
        architecture: the `architectures` name of its config.json ("Qwen3MoeForCausalLM").
        label: the name docs and messages use ("Qwen3-MoE").
        model_type: its config.json `model_type`.
        fields: config.json field -> how the loader treats it: "honoured ...", "refused unless
            ..." or "no effect ..." (docs/CHECKPOINTS.md shows them).
        tensors: where its MoE layers' tensors are (`TensorNames`).
        config_from_hf: reads a checked config.json (`HFFields`) into a `ModelConfig`.
        presets: preset name -> the published model's config.
        layer_tensors: (our name, Hugging Face name, Hugging Face shape, transposed) of one
            layer's non-expert tensors; or (our name, Hugging Face names, their shapes,
            transposed, combine): the tensors read (each transposed when asked) and
            `combine(list of arrays)` makes ours (a fused projection split or joined, a
            conv's taps reordered).
        skipped: tensor name prefix -> why the load skips the tensors under it (a multimodal
            checkpoint's vision tower, multi-token-prediction layers); the loader says so. Or
            a function of (the `ModelConfig`, config.json) giving that mapping (MTP layers
            numbered after the decoder's: `model.layers.<n_layers + i>.`).
        final_norm: our name of the final norm's weight.
    """

    architecture: str
    label: str
    model_type: str
    fields: Mapping[str, str]
    tensors: TensorNames
    config_from_hf: Callable[["HFFields", "Quant | None", str | None], ModelConfig]
    presets: Mapping[str, Callable[[], ModelConfig]]
    layer_tensors: Callable[[ModelConfig, int], object]
    skipped: Mapping[str, str] | Callable[[ModelConfig, Mapping], Mapping[str, str]] = \
        dataclasses.field(default_factory=dict)
    final_norm: str = "final_norm.weight"

    def skipped_for(self, config: ModelConfig, hf: Mapping) -> Mapping[str, str]:
        """`skipped` for one checkpoint (config.json `hf`, read as `config`)."""
        return self.skipped(config, hf) if callable(self.skipped) else self.skipped


HONOURED, NO_EFFECT = "honoured", "no effect"

# Fields every family reads the same way (`decoder_config`).
COMMON_FIELDS: dict[str, str] = {
    "architectures": "honoured: picks the architecture",
    "model_type": "refused unless it names the architecture",
    "vocab_size": HONOURED,
    "hidden_size": HONOURED,
    "num_hidden_layers": HONOURED,
    "num_attention_heads": HONOURED,
    "num_key_value_heads": HONOURED,
    "head_dim": HONOURED,
    "num_experts": "honoured (either spelling; refused if they differ)",
    "num_local_experts": "honoured (either spelling; refused if they differ)",
    "num_experts_per_tok": HONOURED,
    "hidden_act": "honoured: silu (swish); others refused",
    "rms_norm_eps": HONOURED,
    "tie_word_embeddings": HONOURED,
    "max_position_embeddings": "honoured: longest context (yarn: factor x original)",
    "rope_theta": "honoured (4.x spelling; refused if it differs from rope_parameters')",
    "rope_scaling": ("honoured: default, linear, dynamic (up to max_position_embeddings), yarn; "
                     "other types refused"),
    "rope_parameters": "honoured (5.x spelling): as rope_theta and rope_scaling",
    "partial_rotary_factor": "refused unless 1",
    "dtype": "honoured: parameter dtype (param_dtype= overrides)",
    "torch_dtype": "honoured: parameter dtype (4.x spelling)",
    "quantization_config": ("honoured: fp8 (block-scaled e4m3) and gptq (4-bit; symmetric or "
                            "with zero-points, with or without act-order); its own fields in "
                            "the next table"),
    "pruned_heads": "refused unless empty",
    "is_encoder_decoder": "refused unless false",
    "add_cross_attention": "refused unless false",
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


# ---- quantization_config: the FP8 and GPTQ checkpoints, in one place -----------------------------

FP8, GPTQ, MXFP4 = "fp8", "gptq", "mxfp4"

# quantization_config field -> quant_method -> how the loader treats it (as `Family.fields`). Routed experts
# keep the checkpoint's format in the engine's store (`strata_jax.formats`: ModelConfig
# expert_format "fp8" / "int4", expert_block the block or group); every other quantized linear is
# dequantized to the parameter dtype on load (one float32 product, then one cast), since only the
# routed experts stream. docs/CHECKPOINTS.md shows this table.
QUANT_FIELDS: dict[str, dict[str, str]] = {
    "quant_method": {FP8: "honoured: fp8 (experts stored as fp8)",
                     GPTQ: "honoured: gptq (experts stored as int4)",
                     MXFP4: "honoured: mxfp4 (routed experts stored as mxfp4; gpt-oss)"},
    "fmt": {FP8: "refused unless e4m3 (float8_e4m3fn weights)"},
    "weight_block_size": {FP8: "honoured: a square block [b, b] of float32 `weight_scale_inv` "
                                "(experts: expert_block = b); non-square and absent (per-tensor "
                                "scales) refused"},
    "activation_scheme": {FP8: "honoured: dynamic, as weight-only quantization (activations stay "
                                "in the parameter dtype; FP8 kernels would round them to e4m3 per "
                                "token group: a deliberate difference); static refused"},
    "modules_to_not_convert": {
        FP8: "honoured: the linears it names (whole dotted components, e.g. "
             "`model.layers.0.mlp.gate`) stay unquantized; lm_head always does",
        MXFP4: "honoured: patterns (`*` any run of characters) of what stays unquantized; "
               "only the routed experts are read as MXFP4 (`_blocks`, `_scales`), and a "
               "pattern naming them makes them plain"},
    "ignored_layers": {FP8: "honoured: as modules_to_not_convert (vLLM's spelling; refused if "
                             "both are given and differ)"},
    "bits": {GPTQ: "refused unless 4"},
    "group_size": {GPTQ: "honoured: the scales' group along the input dim (experts: "
                          "expert_block); -1 (one group per column) refused"},
    "sym": {GPTQ: "honoured: true (every `qzeros` entry must hold the implicit zero 8) or "
                   "false (zero-points: the routed experts keep them as a plane of their own, "
                   "`expert_zero_points`; other quantized linears are dequantized with them)"},
    "desc_act": {GPTQ: "honoured: true (act-order: every quantized linear's `g_idx` names each "
                        "input row's group; the routed experts' rows are stored in group order "
                        "beside a plane naming each one's input row, `expert_act_order`, and "
                        "their groups must hold group_size rows each; other linears are "
                        "dequantized with it) or false (a `g_idx` other than k // group is "
                        "refused)"},
    "checkpoint_format": {GPTQ: "honoured: gptq (v1, qzeros stored minus one: the zero 8 as "
                                 "7) and gptq_v2 (stored as is: 8); marlin and others refused"},
    "pack_dtype": {GPTQ: "refused unless int32"},
    "lm_head": {GPTQ: "refused unless false (a quantized lm_head is not implemented)"},
    "dynamic": {GPTQ: "refused unless empty (per-module bits or groups)"},
    "is_marlin_format": {GPTQ: "refused unless false"},
    "modules_in_block_to_quantize": {GPTQ: "honoured: checked against the tensors (a linear "
                                            "with `qweight` is quantized, one with `weight` not)"},
    **{k: {GPTQ: "no effect (how the weights were calibrated, or which kernel runs them)"}
       for k in ("damp_percent", "damp_auto_increment", "true_sequential", "static_groups",
                 "model_name_or_path", "model_file_base_name", "quantizer", "meta", "dataset",
                 "tokenizer", "use_exllama", "exllama_config", "use_cuda_fp16",
                 "max_input_length", "cache_block_outputs", "batch_size", "backend",
                 "module_name_preceding_first_block", "block_name_to_quantize")},
}


def quant_fields_markdown() -> str:
    """The quantization_config table of docs/CHECKPOINTS.md, from `QUANT_FIELDS`."""
    lines = ["| field | fp8 | gptq | mxfp4 |", "|---|---|---|---|"]
    for field, per in QUANT_FIELDS.items():
        cells = [per.get(m, "refused (not a field)") for m in (FP8, GPTQ, MXFP4)]
        lines.append(f"| `{field}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class Quant:
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
        return {FP8: "fp8", GPTQ: "int4", MXFP4: "mxfp4"}[self.method]

    def mxfp4_kept(self, module: str) -> bool:
        """mxfp4: whether modules_to_not_convert keeps `module` unquantized (a pattern, `*`
        any run of characters, matching it or a dotted prefix of it)."""
        parts = module.split(".")
        return any(fnmatch.fnmatchcase(".".join(parts[:j]), pattern)
                   for pattern in self.not_converted for j in range(1, len(parts) + 1))

    def fp8(self, module: str) -> bool:
        """fp8: whether linear `module` (a Hugging Face module name) is quantized per the config:
        not lm_head, and no entry of modules_to_not_convert is a run of its dotted components."""
        if module == "lm_head":
            return False
        parts = module.split(".")
        return not any(".".join(parts[i:j]) in self.not_converted
                       for i in range(len(parts)) for j in range(i + 1, len(parts) + 1))


def quant_refuse(field: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"config.json quantization_config {field}={value!r}: {why}")


def quantization(hf: Mapping) -> Quant | None:
    """config.json's quantization_config read (`QUANT_FIELDS`), or None for a plain checkpoint."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise refuse("quantization_config", q, "expected an object of fields")
    method = q.get("quant_method")
    if method not in (FP8, GPTQ, MXFP4):
        raise quant_refuse("quant_method", method, "implemented: fp8 (block-scaled e4m3, as "
                            "Qwen3-30B-A3B-FP8), gptq (4-bit, as Qwen3-30B-A3B-GPTQ-Int4) and "
                            "mxfp4 (gpt-oss's experts)")
    unknown = sorted(k for k in q if method not in QUANT_FIELDS.get(k, {}))
    if unknown:
        raise unknown_fields(q, unknown, "quantization_config field(s)", f"{method} fields")

    def only(key, allowed, why, default=None):
        value = q.get(key, default)
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise quant_refuse(key, value, why)
        return value

    def size(key, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise quant_refuse(key, q.get(key), "expected a positive integer")
        return value

    if method == MXFP4:
        keep = q.get("modules_to_not_convert", [])
        if not isinstance(keep, (list, tuple)) or not all(isinstance(v, str) for v in keep):
            raise quant_refuse("modules_to_not_convert", keep, "expected a list of module names")
        return Quant(MXFP4, MXFP4_GROUP, frozenset(keep))
    if method == FP8:
        only("fmt", ("e4m3",), "only e4m3 (float8_e4m3fn) weights are implemented", "e4m3")
        only("activation_scheme", ("dynamic",), "static activation scales are not "
             "implemented (dynamic is read as weight-only)", "dynamic")
        block = q.get("weight_block_size")
        if block is None:
            raise quant_refuse("weight_block_size", block, "per-tensor FP8 scales are not "
                                "implemented; expected a square block such as [128, 128]")
        if not isinstance(block, (list, tuple)) or len(block) != 2:
            raise quant_refuse("weight_block_size", block, "expected [b, b]")
        side = size("weight_block_size", block[0])
        if size("weight_block_size", block[1]) != side:
            raise quant_refuse("weight_block_size", block, "non-square scale blocks are not "
                                "implemented")
        lists = {}
        for key in ("modules_to_not_convert", "ignored_layers"):
            value = q.get(key)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise quant_refuse(key, value, "expected a list of module names")
            lists[key] = frozenset(value)
        if len(set(lists.values())) > 1:
            raise CheckpointError("config.json quantization_config modules_to_not_convert and "
                                  "ignored_layers disagree")
        return Quant(FP8, side, next(iter(lists.values()), frozenset()))
    if isinstance(q.get("bits"), bool) or q.get("bits") != 4:
        raise quant_refuse("bits", q.get("bits"), "only 4-bit GPTQ is implemented")
    group = q.get("group_size")
    if group == -1:
        raise quant_refuse("group_size", group, "one group per input column is not implemented")
    group = size("group_size", group)
    sym = only("sym", (True, False), "expected true or false", True)
    act_order = only("desc_act", (True, False), "expected true or false", False)
    fmt = only("checkpoint_format", ("gptq", "gptq_v2"), "implemented: gptq (v1) and gptq_v2",
               "gptq")
    only("pack_dtype", ("int32",), "only int32 packing is implemented", "int32")
    only("lm_head", (False,), "a quantized lm_head is not implemented", False)
    only("is_marlin_format", (False,), "Marlin's repacked layout is not implemented", False)
    if q.get("dynamic") not in (None, {}):
        raise quant_refuse("dynamic", q["dynamic"], "per-module overrides are not implemented")
    in_block = q.get("modules_in_block_to_quantize")
    if in_block is not None:
        flat = [n for part in in_block for n in ([part] if isinstance(part, str) else part)]
        if not all(isinstance(n, str) for n in flat):
            raise quant_refuse("modules_in_block_to_quantize", in_block,
                                "expected lists of module names")
        in_block = frozenset(flat)
    zero = INT4_ZERO - 1 if fmt == "gptq" else INT4_ZERO
    return Quant(GPTQ, group, zero_stored=zero, in_block=in_block, sym=sym,
                  act_order=act_order)


def expert_format_of(quant: Quant | None, tensors: TensorNames, moe_layers: range,
                     n_experts: int) -> str:
    """The routed experts' store format (of the MoE layers `moe_layers`): the checkpoint's,
    unless the config leaves every routed expert unquantized ("plain"); some quantized and some
    not is refused (one store format)."""
    if quant is None:
        return "plain"
    if quant.method == MXFP4:
        kept = {quant.mxfp4_kept(f"{tensors.layer(l)}{tensors.moe_prefix}.experts")
                for l in moe_layers}
        if len(kept) > 1:
            raise CheckpointError("config.json quantization_config modules_to_not_convert keeps "
                                  "some layers' routed experts unquantized and not others: "
                                  "routed experts are all quantized or none")
        return "plain" if kept == {True} else quant.expert_format
    if quant.method == FP8:
        if not quant.not_converted:
            return quant.expert_format
        flags = {}
        for l in moe_layers:
            for e in range(n_experts):
                for matrix in range(3):
                    m = tensors.expert(l, e, matrix)
                    flags.setdefault(quant.fp8(m), m)
        if len(flags) > 1:
            raise CheckpointError(
                f"config.json quantization_config modules_to_not_convert leaves {flags[False]!r} "
                f"unquantized but not {flags[True]!r}: routed experts are all quantized or none")
        return quant.expert_format if True in flags else "plain"
    if quant.in_block is not None and not any(".experts." in n for n in quant.in_block):
        return "plain"
    return quant.expert_format


_TYPED_FIELDS = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_experts", "num_local_experts",
                     "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
                     "max_position_embeddings", "n_routed_experts", "n_shared_experts",
                     "first_k_dense_replace", "n_group", "topk_group",
                     "num_nextn_predict_layers", "num_mtp_layers"), "an integer"),
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "routed_scaling_factor"), "a number"),
    **dict.fromkeys(("norm_topk_prob", "tie_word_embeddings", "attention_bias",
                     "use_sliding_window", "use_qk_norm"), "true or false"),
}


def _has_type(value, expected: str) -> bool:
    if expected == "true or false":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (expected == "a number" and isinstance(value, float))


def unknown_fields(fields: Mapping, unknown: list, what: str, whose: str,
                    advice: str = "") -> CheckpointError:
    """The error for config.json `fields` (its top level or its quantization_config) holding
    `unknown` keys: the first 8 named with their values."""
    shown = ", ".join(f"{k}={fields[k]!r}" for k in unknown[:8])
    return CheckpointError(
        f"config.json {what} {shown} are not {whose} this loader knows; it refuses what it "
        f"cannot tell has no effect (see docs/CHECKPOINTS.md){advice}")


def refuse(field: str, value, why: str) -> CheckpointError:
    return CheckpointError(f"config.json {field}={value!r}: {why}")


class HFFields:
    """Reads config.json for one family: required fields, spellings, refusals."""

    def __init__(self, hf: Mapping, family: Family):
        self.hf, self.family, self.arch = hf, family, family.architecture
        unknown = sorted(k for k in hf if k not in IGNORED_FIELDS and k not in family.fields)
        if unknown:
            raise unknown_fields(hf, unknown, "field(s)", f"fields of {self.arch}",
                                  ". If they do not change the model's math, remove them from "
                                  "config.json")
        for k, expected in _TYPED_FIELDS.items():
            if hf.get(k) is not None and not _has_type(hf[k], expected):
                raise refuse(k, hf[k], f"expected {expected}")

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
            raise refuse(key, self.hf[key], why)

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


def read_rope(f: HFFields, max_position: int, default_theta: float, *,
              partial: bool = False, no_effect: tuple[str, ...] = (),
              partial_default: float = 1.0):
    """(theta, scaling, longest context) from both spellings: transformers 4's rope_theta and
    rope_scaling, transformers 5's rope_parameters (rope_theta, rope_type and scaling keys).

    partial: a family with partial rotary embeddings: returns (theta, scaling, longest,
        partial_rotary_factor), the factor from rope_parameters or the top level
        (`partial_default`, transformers' for the family, when absent); without it a factor
        other than 1 is refused.
    no_effect: rope parameter keys the family's field table says have no effect (Qwen3.5's
        mrope_section for text): read past, any value.
    """
    params = dict(f.get("rope_parameters", {}))
    legacy = dict(f.get("rope_scaling", {}))
    for name, d in (("rope_parameters", params), ("rope_scaling", legacy)):
        nested = [k for k, v in d.items() if isinstance(v, dict)]
        if nested:
            raise refuse(name, f.hf[name], f"RoPE parameters per layer type ({nested}) are not "
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
    theta = float(thetas.pop()) if thetas else default_theta
    types = {v for v in (merged.pop("rope_type", None), merged.pop("type", None)) if v is not None}
    if len(types) > 1:
        raise CheckpointError(f"config.json RoPE type and rope_type disagree: {sorted(types)}")
    rope_type = types.pop() if types else "default"
    for key in no_effect:
        merged.pop(key, None)
    factor = merged.pop("partial_rotary_factor", f.hf.get("partial_rotary_factor"))
    if factor is None:
        factor = partial_default
    if not partial and factor != 1:
        raise refuse("partial_rotary_factor", factor, "partial rotary embeddings are not "
                                                       "implemented for this architecture")
    theta, scaling, longest = _rope_scaling(merged, rope_type, theta, max_position)
    return (theta, scaling, longest, float(factor)) if partial else (theta, scaling, longest)


def rotary_dim(head_dim: int, partial: float) -> int:
    """`ModelConfig.rotary_dim` of a head of `head_dim` with `partial_rotary_factor` `partial`
    (transformers: int(head_dim x factor) dims rotate); 0 when every dim does.

    Raises:
        CheckpointError: the factor gives an odd number of dims, or none.
    """
    rotary = int(head_dim * partial)
    if rotary % 2 or rotary <= 0 or rotary > head_dim:
        raise refuse("partial_rotary_factor", partial,
                     f"rotates {head_dim} x {partial} = {head_dim * partial} dims of each head; "
                     f"an even number within 2..{head_dim} is needed")
    return 0 if rotary == head_dim else rotary


def _rope_scaling(merged: dict, rope_type: str, theta: float, max_position: int
                  ) -> tuple[float, RopeScaling | None, int]:
    if rope_type not in _ROPE_KEYS:
        raise refuse("rope_type", rope_type, f"RoPE scaling {rope_type!r} is not implemented; "
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


def decoder_config(f: HFFields, quant: Quant | None, param_dtype: str | None, *,
                   intermediate: int, norm_topk_prob: bool, qk_norm: str,
                   sliding_window: int | None, rope_theta: float, rms_norm_eps: float,
                   max_position_embeddings: int, rope=None, config_class=ModelConfig,
                   expert_keys: tuple[str, ...] = ("num_experts", "num_local_experts"),
                   any_model_type: bool = False,
                   **extra) -> ModelConfig:
    """The `ModelConfig` of a grouped-query-attention MoE checkpoint from the fields every such
    family reads alike (`COMMON_FIELDS`); the family gives what it reads its own way and the
    defaults transformers uses where config.json leaves a field out.

    rope: (theta, scaling, longest context) the family read itself (`read_rope`); None: read
    here. expert_keys: the spellings of the routed experts' count (GLM-4.5, DeepSeek-V3:
    n_routed_experts). any_model_type: the family reads any model_type on its architecture
    (its fields decide). config_class and extra: a family's config subclass and its own
    fields, or values it reads its own way (they replace the ones read here).

    Raises:
        CheckpointError: a missing field, or a field or value this engine does not implement.
    """
    family = f.family
    if not any_model_type:
        f.only("model_type", (family.model_type,),
               f"{family.architecture} checkpoints have model_type {family.model_type!r}")
    f.only("hidden_act", ("silu", "swish"), "only SiLU-gated experts (silu, swish) are "
                                            "implemented")
    f.only("pruned_heads", ({}, None), "pruned attention heads are not implemented")
    f.only("is_encoder_decoder", (False,), "a decoder-only model has no encoder")
    f.only("add_cross_attention", (False,), "cross-attention is not implemented")
    n_experts = f.one_of(*expert_keys)
    dtype = param_dtype or str(f.one_of("dtype", "torch_dtype", required=False) or "bfloat16")
    if dtype not in DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    heads = f.need("num_attention_heads")
    hidden = f.need("hidden_size")
    max_position = int(f.get("max_position_embeddings", max_position_embeddings))
    theta, scaling, longest = rope or read_rope(f, max_position, rope_theta)
    n_layers = f.need("num_hidden_layers")
    moe_layers = range(extra.get("n_dense_layers", 0), n_layers)
    expert_format = expert_format_of(quant, family.tensors, moe_layers, n_experts)
    try:
        return config_class(**{**dict(
            name=str(f.get("_name_or_path") or f.get("model_type") or family.architecture),
            vocab_size=f.need("vocab_size"),
            hidden_size=hidden,
            n_layers=n_layers,
            n_heads=heads,
            n_kv_heads=f.get("num_key_value_heads", heads),
            head_dim=f.get("head_dim", hidden // heads),
            n_experts=n_experts,
            top_k=f.need("num_experts_per_tok"),
            expert_intermediate=intermediate,
            norm_topk_prob=bool(norm_topk_prob),
            qk_norm=qk_norm,
            attention_bias=bool(f.get("attention_bias", False)),
            rope_theta=theta,
            rope_scaling=scaling,
            sliding_window=sliding_window,
            rms_norm_eps=float(f.get("rms_norm_eps", rms_norm_eps)),
            tie_embeddings=bool(f.get("tie_word_embeddings", False)),
            max_seq_len=longest,
            param_dtype=dtype,
            expert_format=expert_format,
            expert_block=quant.block if expert_format != "plain" else 0,
            expert_zero_points=expert_format == "int4" and not quant.sym,
            expert_act_order=expert_format == "int4" and quant.act_order,
        ), **extra})
    except ValueError as e:
        raise CheckpointError(f"config.json describes a model this engine cannot build: {e}"
                              ) from None


MTP_WHY = "a multi-token-prediction layer (speculative decoding; a prefill does not use it)"


def deepseek_style_skips(names: TensorNames, config: ModelConfig, hf: Mapping
                         ) -> dict[str, str]:
    """What a DeepSeek-style checkpoint (DeepSeek-V3, GLM-4.5) holds that a prefill does not
    read, by name: its multi-token-prediction layers, numbered after the decoder's
    (`num_nextn_predict_layers`, transformers' `num_mtp_layers`; absent: transformers'
    default 1), and with n_shared_experts 0 the empty shared-expert tensors transformers
    writes."""
    n = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers"))
    out = {names.layer(config.n_layers + i): MTP_WHY for i in range(1 if n is None else int(n))}
    if not config.shared_expert_intermediate:
        out.update({f"{names.layer(l)}{names.moe_prefix}.shared_experts.": "n_shared_experts=0: "
                    "the shared expert's empty tensors" for l in config.moe_layers})
    return out
