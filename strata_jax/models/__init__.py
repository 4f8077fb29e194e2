"""Model families: one module per family, and the registry from a checkpoint's `architectures`
name to its family.

A family module owns its config.json mapping (`Family.fields`, `Family.config_from_hf`), its
tensor names (`Family.tensors`, `Family.layer_tensors`), its presets, and how its blocks compose
(the shared decoder stack of `models.decoder` for the grouped-query-attention MoE families).
The engine, the stream and the native library read a `ModelConfig` and never name a family.
Adding a family is a module here and a line in `FAMILIES`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable, Mapping

from strata_jax.config import ModelConfig
from strata_jax.models import (decoder, deepseek_v3, glm4_moe, gpt_oss, hybrid, mixtral, mla,
                               olmoe, qwen3_moe, qwen3_next)
from strata_jax.models.decoder import KVCache, MoETransformer, forward
from strata_jax.models.hf_config import (IGNORED_FIELDS, NO_EFFECT, QUANT_FIELDS,
                                         CheckpointError, Family, HFFields, quant_fields_markdown,
                                         quantization)

__all__ = [
    "FAMILIES", "PRESETS", "get_preset", "family_of", "config_from_hf", "fields_markdown",
    "quant_fields_markdown", "FIELDS", "IGNORED_FIELDS", "QUANT_FIELDS", "CheckpointError",
    "Family", "KVCache", "MoETransformer", "abstract_model", "build_model", "cache_bytes",
    "cache_shapes", "expert_param_names", "expert_plane_names", "forward", "init_cache",
    "model_module", "param_shapes", "validate_inputs",
]

FAMILIES: dict[str, Family] = {
    f.architecture: f for f in (qwen3_moe.FAMILY, *qwen3_next.FAMILIES, mixtral.FAMILY,
                                olmoe.FAMILY, deepseek_v3.FAMILY, glm4_moe.FAMILY,
                                gpt_oss.FAMILY)
}

PRESETS: dict[str, Callable[[], ModelConfig]] = {
    **qwen3_moe.FAMILY.presets,
    **qwen3_next.FAMILY.presets,
    **qwen3_next.TEXT35.presets,
    **mixtral.FAMILY.presets,
    **olmoe.FAMILY.presets,
    **deepseek_v3.FAMILY.presets,
    **glm4_moe.FAMILY.presets,
    **gpt_oss.FAMILY.presets,
}

# The module that builds a config's model, by config type: the shared decoder stack, the
# hybrid stack of Gated DeltaNet and attention layers (`HybridConfig`, whose cache also holds
# recurrent state), or the latent-attention stack (`MLAConfig`, whose cache holds latents;
# its module also gives its attention's working memory, `attention_bytes`). A family whose blocks hold other state adds its config subclass and its
# module here, with the functions below, and the engine reads it through them without naming
# it. A cache type has `valid(position)` (what a session keeps).
MODELS: dict[type, ModuleType] = {ModelConfig: decoder, hybrid.HybridConfig: hybrid,
                                  mla.MLAConfig: mla}


def model_module(config: ModelConfig) -> ModuleType:
    """The module that builds `config`'s model (`MODELS`, by the config's type)."""
    for cls in type(config).__mro__:
        if cls in MODELS:
            return MODELS[cls]
    raise TypeError(f"no model is registered for {type(config).__name__} (strata_jax.models."
                    "MODELS)")


def build_model(config: ModelConfig, params, **kwargs):
    """The model of `config` from flat arrays (`decoder.build_model` for the decoder stack)."""
    return model_module(config).build_model(config, params, **kwargs)


def abstract_model(config: ModelConfig, **kwargs):
    """The model with `jax.ShapeDtypeStruct` leaves: allocates nothing."""
    return model_module(config).abstract_model(config, **kwargs)


def param_shapes(config: ModelConfig, **kwargs):
    """Flat parameter names to shape/dtype, in model order."""
    return model_module(config).param_shapes(config, **kwargs)


def init_cache(config: ModelConfig, capacity: int, dtype=None, *, slack: int = 0):
    """A zero cache of `capacity` positions (`slack` of them past max_seq_len allowed)."""
    return model_module(config).init_cache(config, capacity, dtype, slack=slack)


def cache_shapes(config: ModelConfig, capacity: int):
    """The cache of `capacity` positions as `jax.ShapeDtypeStruct`s."""
    return model_module(config).cache_shapes(config, capacity)


def cache_bytes(config: ModelConfig, capacity: int) -> int:
    """Bytes of one cache of `capacity` positions."""
    return model_module(config).cache_bytes(config, capacity)


def validate_inputs(config: ModelConfig, tokens, cache_capacity: int, start: int):
    """A chunk's token ids checked on the host, before any device work (int32 numpy [T])."""
    return model_module(config).validate_inputs(config, tokens, cache_capacity, start)


def expert_plane_names(config: ModelConfig, layer: int) -> dict[str, str]:
    """Plane name -> flat parameter name of layer `layer`'s routed experts, in blob order."""
    return model_module(config).expert_plane_names(config, layer)


def expert_param_names(config: ModelConfig, layer: int):
    """Flat names of layer `layer`'s routed experts (gate, up, down) in the plain format."""
    return model_module(config).expert_param_names(config, layer)


# Field -> architecture -> how the loader treats it, over every family (docs/CHECKPOINTS.md).
FIELDS: dict[str, dict[str, str]] = {
    field: {f.architecture: f.fields[field] for f in FAMILIES.values() if field in f.fields}
    for field in dict.fromkeys(k for f in FAMILIES.values() for k in f.fields)
}


def get_preset(name: str) -> ModelConfig:
    """Returns the preset called `name`.

    Raises:
        ValueError: `name` is not a preset; the message lists the known names.
    """
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def family_of(hf: Mapping) -> Family:
    """The family a parsed config.json names in `architectures` (or, without one, its
    `model_type`).

    Raises:
        CheckpointError: no architecture, or one no family implements (the known ones listed).
    """
    if not isinstance(hf, Mapping):
        raise CheckpointError(f"config.json holds a {type(hf).__name__}, not an object of "
                              "fields (name: value)")
    names = hf.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    for name in names:
        if name in FAMILIES:
            return FAMILIES[name]
    if not names and hf.get("model_type") is None:
        raise CheckpointError(f"config.json names no architecture (no 'architectures'); "
                              f"supported: {', '.join(FAMILIES)}")
    raise CheckpointError(
        f"unknown architecture {names or hf.get('model_type')!r}; supported: "
        f"{', '.join(FAMILIES)}")


def config_from_hf(hf: Mapping, *, param_dtype: str | None = None) -> ModelConfig:
    """Builds a `ModelConfig` from a Hugging Face config.json dict.

    Every field is honoured, refused or known to have no effect (the family's `fields`,
    `IGNORED_FIELDS`, and `QUANT_FIELDS` inside quantization_config); both spellings of
    transformers 4 and 5 are read (rope_theta / rope_scaling and rope_parameters; num_experts
    and num_local_experts; torch_dtype and dtype). A quantized checkpoint's routed experts keep
    its format (`expert_format` "fp8" or "int4", `expert_block` its block or group).

    Args:
        hf: parsed config.json.
        param_dtype: overrides the checkpoint's dtype.

    Raises:
        CheckpointError: unknown architecture, a missing field, or a field or value this engine
            does not implement (named with its value).
    """
    family = family_of(hf)
    fields = HFFields(hf, family)
    return family.config_from_hf(fields, quantization(hf), param_dtype)


def fields_markdown() -> str:
    """The field table of docs/CHECKPOINTS.md: every family's `fields` and `IGNORED_FIELDS`."""
    families = list(FAMILIES.values())
    lines = ["| field | " + " | ".join(f.label for f in families) + " |",
             "|---|" + "---|" * len(families)]
    for field, per in FIELDS.items():
        cells = [per.get(f.architecture, "refused (not a field)") for f in families]
        lines.append(f"| `{field}` | " + " | ".join(cells) + " |")
    lines.append(f"| {', '.join(f'`{f}`' for f in sorted(IGNORED_FIELDS))} | "
                 + " | ".join([NO_EFFECT] * len(families)) + " |")
    return "\n".join(lines) + "\n"
