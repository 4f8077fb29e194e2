"""The family registry: config.json names a family by `architectures`; a config's type names the
module that builds its model, and the engine reaches a family's model only through it."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from strata_jax import models
from strata_jax.config import ModelConfig
from strata_jax.models import FAMILIES, PRESETS, decoder, family_of, model_module
from strata_jax.models.hf_config import CheckpointError


def test_every_family_is_registered_by_its_architecture():
    assert set(FAMILIES) == {"Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM",
                             "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM",
                             "Qwen3_5MoeForConditionalGeneration", "DeepseekV3ForCausalLM",
                             "Glm4MoeForCausalLM", "GptOssForCausalLM"}
    for arch, family in FAMILIES.items():
        assert family.architecture == arch
        assert family_of({"architectures": [arch]}) is family
        assert set(family.presets) <= set(PRESETS)
        # Every field a family lists is one the loader treats (honoured, refused or no effect).
        for status in family.fields.values():
            assert status.split()[0].rstrip(":") in ("honoured", "refused", "no"), status
    with pytest.raises(CheckpointError, match="unknown architecture.*supported: Qwen3Moe"):
        family_of({"architectures": ["LlamaForCausalLM"]})


def test_a_config_type_names_the_module_that_builds_its_model(monkeypatch):
    cfg = PRESETS["qwen3-30b-a3b"]().scaled()
    assert model_module(cfg) is decoder

    @dataclasses.dataclass(frozen=True)
    class OtherConfig(ModelConfig):
        pass

    other = OtherConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    assert model_module(other) is decoder  # a subclass inherits its base's model
    calls = []
    stand_in = types.SimpleNamespace(
        init_cache=lambda c, n, dtype, slack: calls.append(("init_cache", n)) or "cache",
        cache_bytes=lambda c, n: calls.append(("cache_bytes", n)) or 7)
    monkeypatch.setitem(models.MODELS, OtherConfig, stand_in)
    assert models.init_cache(other, 16) == "cache"
    assert models.cache_bytes(other, 16) == 7
    assert calls == [("init_cache", 16), ("cache_bytes", 16)]
    assert models.cache_bytes(cfg, 16) == 2 * cfg.n_layers * 16 * cfg.n_kv_heads * \
        cfg.head_dim * np.dtype(cfg.dtype).itemsize  # the decoder's, unchanged
    monkeypatch.delitem(models.MODELS, ModelConfig)
    with pytest.raises(TypeError, match="no model is registered for ModelConfig"):
        model_module(cfg)
