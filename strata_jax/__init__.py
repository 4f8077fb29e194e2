"""strata_jax: prefill prompts through MoE models whose experts stream from pinned host RAM."""

from .config import ModelConfig, get_preset  # noqa: F401

__version__ = "0.1.0"
