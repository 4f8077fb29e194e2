"""Hugging Face safetensors checkpoints: `load_checkpoint` reads a directory's config.json (through
its family, `strata_jax.models`) and its weights, the routed experts left in the files until
an engine reads them (`CheckpointExperts`).
"""

from strata_jax.checkpoint.experts import CheckpointExperts
from strata_jax.checkpoint.loader import LoadedCheckpoint, load_checkpoint, load_model
from strata_jax.models import (FAMILIES, FIELDS, IGNORED_FIELDS, QUANT_FIELDS, CheckpointError,
                               config_from_hf, fields_markdown, quant_fields_markdown)

__all__ = [
    "FAMILIES", "CheckpointError", "CheckpointExperts", "FIELDS", "IGNORED_FIELDS",
    "LoadedCheckpoint", "QUANT_FIELDS", "config_from_hf", "fields_markdown", "load_checkpoint",
    "load_model", "quant_fields_markdown",
]
