"""Loading Hugging Face safetensors checkpoints of MoE models.

Guards against putting every expert on the device (a 235B model's experts do not fit) and against
silent mis-mapping: every tensor is looked up by its exact Hugging Face name and checked against the
expected shape; a missing or misshaped tensor, or an unknown architecture, is a `CheckpointError`
naming it before anything reaches the device.

Non-expert weights come back as a flat dict of NumPy arrays (model layout: projections as
[in, out]); routed experts go to a `HostExpertStore`, one contiguous blob per expert in host
memory, which the model can put on the device (`build_model(..., experts=store.as_mapping())`) or a
streaming engine can copy from.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator, Mapping

import ml_dtypes  # noqa: F401 - registers bfloat16 with NumPy so safe_open can return BF16 tensors
import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

from strata_jax.config import ModelConfig, _DTYPES
from strata_jax.experts import ExpertWeights, blob_size, unpack_expert_blobs_np


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: missing/misshaped tensor, unknown architecture, bad files."""


@dataclasses.dataclass(frozen=True)
class _Arch:
    moe_prefix: str  # "mlp" or "block_sparse_moe"
    router: str  # router tensor under the MoE prefix
    expert_names: tuple[str, str, str]  # gate, up, down under experts.{e}.
    qk_norm: str


ARCHITECTURES: dict[str, _Arch] = {
    "Qwen3MoeForCausalLM": _Arch("mlp", "gate", ("gate_proj", "up_proj", "down_proj"), "per_head"),
    "MixtralForCausalLM": _Arch("block_sparse_moe", "gate", ("w1", "w3", "w2"), "none"),
    "OlmoeForCausalLM": _Arch("mlp", "gate", ("gate_proj", "up_proj", "down_proj"), "full"),
}


def _architecture(hf: Mapping) -> str:
    names = hf.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise CheckpointError(
        f"unknown architecture {names or hf.get('model_type')!r}; supported: "
        f"{', '.join(ARCHITECTURES)}")


def config_from_hf(hf: Mapping, *, param_dtype: str | None = None) -> ModelConfig:
    """Builds a `ModelConfig` from a Hugging Face config.json dict.

    Args:
        hf: parsed config.json.
        param_dtype: overrides the checkpoint's torch_dtype.

    Raises:
        CheckpointError: unknown architecture or a layout this model does not express.
    """
    arch = _architecture(hf)
    if arch == "Qwen3MoeForCausalLM":
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise CheckpointError(
                "Qwen3-MoE checkpoints with dense layers (mlp_only_layers / decoder_sparse_step != 1)"
                " are not supported")
        n_experts, inter = hf["num_experts"], hf["moe_intermediate_size"]
    elif arch == "MixtralForCausalLM":
        n_experts, inter = hf["num_local_experts"], hf["intermediate_size"]
    else:
        if hf.get("clip_qkv") is not None:
            raise CheckpointError(f"OLMoE clip_qkv={hf['clip_qkv']} is not supported")
        n_experts, inter = hf["num_experts"], hf["intermediate_size"]
    dtype = param_dtype or str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
    if dtype not in _DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    heads = hf["num_attention_heads"]
    return ModelConfig(
        name=str(hf.get("_name_or_path") or hf.get("model_type") or arch),
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        n_experts=n_experts,
        top_k=hf["num_experts_per_tok"],
        expert_intermediate=inter,
        # Mixtral has no norm_topk_prob key: its softmax-then-renormalise is norm_topk_prob=True.
        norm_topk_prob=bool(hf.get("norm_topk_prob", arch == "MixtralForCausalLM")),
        qk_norm=ARCHITECTURES[arch].qk_norm,
        rope_theta=float(hf.get("rope_theta", 10_000.0)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=hf.get("max_position_embeddings", 32_768),
        param_dtype=dtype,
    )


class HostExpertStore:
    """Routed experts in host memory: per MoE layer a C-contiguous [E, 3*H*I] blob array.

    Blob layout as in `strata_jax.experts`: concat(gate [H, I], up [H, I], down [I, H]) per expert.
    """

    def __init__(self, config: ModelConfig, blobs: Mapping[int, np.ndarray]):
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


@dataclasses.dataclass
class LoadedCheckpoint:
    """Result of `load_checkpoint`.

    Attributes:
        config: model config derived from config.json.
        params: flat name -> NumPy array for every non-expert parameter (model layout).
        experts: host-side routed experts.
    """

    config: ModelConfig
    params: dict[str, np.ndarray]
    experts: HostExpertStore

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
        self._handles = {}
        self._where: dict[str, str] = {}
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise CheckpointError(f"shard {path} listed in the index does not exist")
            handle = safe_open(path, framework="numpy")
            self._handles[name] = handle
            for key in handle.keys():
                self._where[key] = name

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"missing tensor {name!r} (expected shape {shape})")
        handle = self._handles[self._where[name]]
        actual = tuple(handle.get_slice(name).get_shape())
        if actual != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {actual}, expected {tuple(shape)}")
        return handle.get_tensor(name)


def _layer_plan(config: ModelConfig, arch: _Arch, layer: int
                ) -> Iterator[tuple[str, str, tuple[int, ...], bool]]:
    """(our name, HF name, HF shape, transpose) for one layer's non-expert tensors."""
    c, hf, ours = config, f"model.layers.{layer}.", f"layers.{layer}."
    yield ours + "input_norm.weight", hf + "input_layernorm.weight", (c.hidden_size,), False
    yield ours + "post_attn_norm.weight", hf + "post_attention_layernorm.weight", (c.hidden_size,), False
    for proj, out_dim in (("q_proj", c.q_dim), ("k_proj", c.kv_dim), ("v_proj", c.kv_dim)):
        yield ours + f"attn.{proj}", hf + f"self_attn.{proj}.weight", (out_dim, c.hidden_size), True
    yield ours + "attn.o_proj", hf + "self_attn.o_proj.weight", (c.hidden_size, c.q_dim), True
    if c.qk_norm != "none":
        q_dim, k_dim = ((c.head_dim, c.head_dim) if c.qk_norm == "per_head" else (c.q_dim, c.kv_dim))
        yield ours + "attn.q_norm.weight", hf + "self_attn.q_norm.weight", (q_dim,), False
        yield ours + "attn.k_norm.weight", hf + "self_attn.k_norm.weight", (k_dim,), False
    yield (ours + "mlp.router", hf + f"{arch.moe_prefix}.{arch.router}.weight",
           (c.n_experts, c.hidden_size), True)


def load_checkpoint(directory: str, *, param_dtype: str | None = None,
                    progress: bool = True) -> LoadedCheckpoint:
    """Loads a Hugging Face safetensors checkpoint directory into host memory.

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
    tensors = _Tensors(directory)
    dtype = config.dtype

    def take(hf_name: str, shape, transpose: bool) -> np.ndarray:
        value = tensors.get(hf_name, shape)
        value = value.T if transpose else value
        return np.ascontiguousarray(value.astype(dtype, copy=False))

    c = config
    params: dict[str, np.ndarray] = {
        "embed": take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), False),
        "final_norm.weight": take("model.norm.weight", (c.hidden_size,), False),
    }
    if not c.tie_embeddings:
        params["lm_head"] = take("lm_head.weight", (c.vocab_size, c.hidden_size), True)
    store = HostExpertStore.empty(config)
    hi = c.hidden_size * c.expert_intermediate
    bar = tqdm(range(c.n_layers), desc="loading layers", unit="layer", disable=not progress)
    for layer in bar:
        for ours, hf_name, shape, transpose in _layer_plan(c, arch, layer):
            params[ours] = take(hf_name, shape, transpose)
        blobs = store.blobs(layer)
        base = f"model.layers.{layer}.{arch.moe_prefix}.experts."
        gate_name, up_name, down_name = arch.expert_names
        for e in range(c.n_experts):
            # HF stores [out, in]: gate/up [I, H] -> [H, I], down [H, I] -> [I, H].
            blobs[e, :hi] = tensors.get(f"{base}{e}.{gate_name}.weight",
                                        (c.expert_intermediate, c.hidden_size)).T.ravel()
            blobs[e, hi:2 * hi] = tensors.get(f"{base}{e}.{up_name}.weight",
                                              (c.expert_intermediate, c.hidden_size)).T.ravel()
            blobs[e, 2 * hi:] = tensors.get(f"{base}{e}.{down_name}.weight",
                                            (c.hidden_size, c.expert_intermediate)).T.ravel()
    return LoadedCheckpoint(config, params, store)


def load_model(directory: str, *, resident_experts: bool = True, param_dtype: str | None = None,
               progress: bool = True):
    """Loads a checkpoint and builds the model.

    Returns:
        (model, LoadedCheckpoint); with `resident_experts=False` the experts stay on the host only.
    """
    ckpt = load_checkpoint(directory, param_dtype=param_dtype, progress=progress)
    return ckpt.build_model(resident_experts=resident_experts), ckpt


__all__: list[str] = [
    "ARCHITECTURES", "CheckpointError", "HostExpertStore", "LoadedCheckpoint", "config_from_hf",
    "load_checkpoint", "load_model",
]
