"""Loading Hugging Face safetensors checkpoints of MoE models.

Guards against putting every expert on the device (a 235B model's experts do not fit) and against
silent mis-mapping: every tensor is looked up by its exact Hugging Face name (its family's
`layer_tensors` and `tensors`) and checked against the expected shape; a missing or misshaped
tensor, or an unknown architecture, is a `CheckpointError` naming it before anything reaches the
device. And against a model that is silently another one: every config.json field is honoured,
refused with its value, or known to have no effect on the logits (`models.config_from_hf`), and a
tensor in the files that the load does not read is an error.

Quantized checkpoints (FP8 block-scaled as Qwen3-30B-A3B-FP8, 4-bit GPTQ as
Qwen3-30B-A3B-GPTQ-Int4; `QUANT_FIELDS`): the routed experts keep the checkpoint's format
(`ModelConfig.expert_format`, `strata_jax.formats`), every other quantized linear is dequantized
to the parameter dtype on load.

Non-expert weights come back as a flat dict of NumPy arrays (model layout: projections as
[in, out]); routed experts as a `CheckpointExperts`, checked but left in the files until used:
a streaming engine reads them straight into its host store (`Engine(..., experts=
ckpt.experts.as_mapping())`), a resident model onto the device, one tensor at a time, so host RAM
never holds them twice.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

import numpy as np
from tqdm.auto import tqdm

from strata_jax.checkpoint.experts import (CheckpointExperts, _cdiv, _gptq_check,
                                           _gptq_quantized, _gptq_shapes, _unpack_int4,
                                           expert_files)
from strata_jax.checkpoint.safetensors import Tensors
from strata_jax.config import ModelConfig
from strata_jax.formats import INT4_ZERO
from strata_jax.layers.rope import rope_frequencies
from strata_jax.models import build_model, config_from_hf, family_of, param_shapes
from strata_jax.models.hf_config import FP8, MXFP4, CheckpointError, Quant, quantization
from strata_jax.text import Tokenizer, tokenizer_path


@dataclasses.dataclass
class LoadedCheckpoint:
    """Result of `load_checkpoint`.

    Attributes:
        config: model config derived from config.json.
        params: flat name -> NumPy array for every non-expert parameter (model layout).
        experts: the routed experts, read from the files when used (`CheckpointExperts`).
        directory: where it was read from.
        skipped: tensor name prefix -> (tensors skipped, why) of the parts of the checkpoint
            the model does not use (`Family.skipped`: a vision tower, multi-token prediction).
        tokenizer: the directory's tokenizer.json bound to the model's vocabulary (a
            `strata_jax.Tokenizer`, read when first asked for: `text.TokenizerError` naming
            the file where it cannot be read), None where the directory has none.
    """

    config: ModelConfig
    params: dict[str, np.ndarray]
    experts: CheckpointExperts
    directory: str | None = None
    skipped: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer | None:
        path = tokenizer_path(self.directory) if self.directory is not None else None
        return None if path is None else Tokenizer.from_file(path, self.config.vocab_size)

    def build_model(self, *, resident_experts: bool = True):
        """The model with non-expert params on the device, and experts too when resident."""
        return build_model(self.config, self.params, experts=self.experts.as_mapping(),
                           resident_experts=resident_experts)


def _check_tied_head(tensors: Tensors, embed: np.ndarray, c: ModelConfig) -> None:
    """With tie_word_embeddings an lm_head.weight in the files must equal the embedding (the
    model uses the embedding)."""
    head = tensors.get("lm_head.weight", (c.vocab_size, c.hidden_size)).astype(c.dtype)
    if not np.array_equal(head, embed):
        raise CheckpointError("config.json tie_word_embeddings=true, but lm_head.weight differs "
                              "from model.embed_tokens.weight")


def _check_rope_buffers(tensors: Tensors, c: ModelConfig) -> None:
    """Rotary frequency buffers some checkpoints carry (`...rotary_emb.inv_freq`) must match
    the frequencies config.json gives (the model computes its own)."""
    inv_freq = rope_frequencies(c.rotated_dims, c.rope_theta, c.rope_scaling)[0]
    for name in tensors.names():
        if name.endswith("rotary_emb.inv_freq"):
            saved = tensors.get(name, inv_freq.shape).astype(np.float64)
            if not np.allclose(saved, inv_freq, rtol=1e-5, atol=0.0):
                raise CheckpointError(
                    f"tensor {name!r} holds RoPE frequencies that differ from config.json's "
                    f"(rope_theta={c.rope_theta}, rope_scaling={c.rope_scaling})")


def _biased(c: ModelConfig, module: str) -> bool:
    """Whether the model reads linear `module`'s bias itself: an attention projection that
    `ModelConfig.attention_biases` names."""
    parent, leaf = module.split(".")[-2:]
    return parent == "self_attn" and leaf.removesuffix("_proj") in c.attention_biases


def _linear(tensors: Tensors, quant: Quant, module: str, shape: tuple[int, int],
            dtype: np.dtype, biased: bool) -> np.ndarray:
    """Linear `module` ([out, in] = `shape` in the files) in the model's [in, out] layout and
    the parameter dtype: a quantized one dequantized (one float32 product per value, one cast,
    as `formats.ExpertFormat.dequantize_np` does)."""
    n, k = shape
    if quant.method == MXFP4:  # only the routed experts are MXFP4 (fused, read on their own)
        if tensors.has(f"{module}_blocks") or tensors.has(f"{module}.weight_blocks"):
            raise CheckpointError(f"linear {module!r} is MXFP4-quantized in the files; only "
                                  "the routed experts' MXFP4 is read")
        return np.ascontiguousarray(tensors.get(f"{module}.weight", shape).T.astype(dtype))
    if quant.method == FP8:
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
    family = family_of(hf)
    quant = quantization(hf)
    tensors = Tensors(directory)
    # Each parameter in its model dtype: the config's, or float32 where the model keeps one
    # (a sigmoid router's selection bias).
    dtypes = {name: np.dtype(spec.dtype) for name, spec in
              param_shapes(config, resident_experts=False).items()}

    def take(hf_name: str, shape, transpose: bool, ours: str) -> np.ndarray:
        dtype = dtypes.get(ours, config.dtype)
        if transpose and quant is not None:  # a linear, perhaps quantized: [in, out]
            module = hf_name[:-len(".weight")]
            return _linear(tensors, quant, module, shape, dtype, _biased(config, module))
        value = tensors.get(hf_name, shape)
        value = value.T if transpose else value
        return np.ascontiguousarray(value.astype(dtype, copy=False))

    c, prefix = config, family.tensors.model_prefix
    params: dict[str, np.ndarray] = {
        "embed": take(f"{prefix}embed_tokens.weight", (c.vocab_size, c.hidden_size), False,
                      "embed"),
        family.final_norm: take(f"{prefix}norm.weight", (c.hidden_size,), False,
                                family.final_norm),
    }
    if not c.tie_embeddings:  # lm_head is never quantized (a quantized one is refused)
        params["lm_head"] = np.ascontiguousarray(tensors.get(
            "lm_head.weight", (c.vocab_size, c.hidden_size)).T.astype(c.dtype, copy=False))
    elif tensors.has("lm_head.weight"):
        _check_tied_head(tensors, params["embed"], c)
    _check_rope_buffers(tensors, c)
    # The experts are only checked here (names, shapes, dtypes: the file headers; GPTQ's small
    # qzeros and g_idx read) and read when used: an engine's host store takes them straight
    # from the files (CheckpointExperts), in their format.
    files: dict[str, str] = {}
    bar = tqdm(range(c.n_layers), desc="loading layers", unit="layer", disable=not progress)
    for layer in bar:
        for item in family.layer_tensors(c, layer):
            if len(item) == 5:  # several tensors make one of ours
                ours, names, shapes, transpose, combine = item
                params[ours] = np.ascontiguousarray(combine(
                    [take(n, s, transpose, ours) for n, s in zip(names, shapes)]))
            else:
                ours, hf_name, shape, transpose = item
                params[ours] = take(hf_name, shape, transpose, ours)
        if layer in c.moe_layers:
            files.update(expert_files(tensors, quant, c, family.tensors, layer))
    skipped = {}
    for skip_prefix, why in family.skipped_for(c, hf).items():
        n = tensors.skip(skip_prefix)
        if n:
            skipped[skip_prefix] = (n, why)
            if progress:
                print(f"skipped {n} tensor(s) under {skip_prefix!r}: {why}", file=sys.stderr)
    tensors.check_all_taken()
    return LoadedCheckpoint(config, params, CheckpointExperts(
        config, family.tensors, files, quant.zero_offset if quant is not None else 0), directory,
        skipped)


def load_model(directory: str, *, resident_experts: bool = True, param_dtype: str | None = None,
               progress: bool = True):
    """Loads a checkpoint and builds the model.

    Returns:
        (model, LoadedCheckpoint); with `resident_experts=False` the experts stay on the host only.
    """
    ckpt = load_checkpoint(directory, param_dtype=param_dtype, progress=progress)
    return ckpt.build_model(resident_experts=resident_experts), ckpt
