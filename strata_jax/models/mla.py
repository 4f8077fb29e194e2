"""The decoder stack of the multi-head latent attention families (DeepSeek-V3, Kimi-K2):
MLA (`layers.mla.LatentAttention`) in every layer, then a dense MLP in the first
`n_dense_layers` and an MoE with shared experts after.

The model is the shared decoder's (`models.decoder.MoETransformer`: both read orders, the
head, scoring) with its own layer. Its cache is the decoder's `KVCache` holding, per layer,
the latents [S, R] as `keys` and the rotated shared keys [S, Dr] as `values`: R + Dr values a
position instead of 2 x heads x head size (`cache_bytes`); `valid(position)` trims both.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from strata_jax.config import ModelConfig
from strata_jax.kernels import Kernels
from strata_jax.layers.mla import LatentAttention, prefix_block
from strata_jax.models.decoder import (DecoderLayer, KVCache, MoETransformer, check_capacity,
                                       expert_param_names, expert_plane_names, fill_model,
                                       flat_shapes, validate_inputs)

__all__ = ["MLAConfig", "MLATransformer", "abstract_model", "build_model", "param_shapes",
           "init_cache", "cache_shapes", "cache_bytes", "validate_inputs",
           "expert_plane_names", "expert_param_names", "attention_bytes"]


@dataclasses.dataclass(frozen=True)
class MLAConfig(ModelConfig):
    """A `ModelConfig` with multi-head latent attention.

    `head_dim` is the query/key head size Dq = the part without position plus `qk_rope_dim`
    (DeepSeek-V3: 128 + 64); `n_kv_heads` equals `n_heads` (every head has its own key and
    value, expanded from the shared latent).

    Attributes (besides `ModelConfig`'s):
        q_lora_rank: the queries' low-rank width (q_a_proj, an RMSNorm, q_b_proj); 0: one
            q_proj.
        kv_lora_rank: the latent's width R (what the cache holds, with the rotary key).
        qk_rope_dim: the rotary part Dr of each query and of the one key all heads share.
        v_head_dim: each head's value size Dv (at most head_dim).
        rope_interleave: the rotary dims are stored as interleaved pairs (DeepSeek's layout).
    """

    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_rope_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = False

    def __post_init__(self):
        super().__post_init__()
        self._check_positive("kv_lora_rank", "qk_rope_dim", "v_head_dim")
        q = self.q_lora_rank
        if isinstance(q, bool) or not isinstance(q, (int, np.integer)) or q < 0:
            raise ValueError(f"q_lora_rank must be an int >= 0 (0: one q_proj), got {q!r}")
        if self.qk_rope_dim % 2 or self.qk_rope_dim >= self.head_dim:
            raise ValueError(f"qk_rope_dim={self.qk_rope_dim} must be even and below "
                             f"head_dim={self.head_dim} (the query/key head: the part without "
                             "position plus the rotary part)")
        if self.v_head_dim > self.head_dim:
            raise ValueError(f"v_head_dim={self.v_head_dim} exceeds the query/key head "
                             f"head_dim={self.head_dim}, which is not implemented")
        if self.n_kv_heads != self.n_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads}: latent attention expands a key "
                             f"and a value for each of the n_heads={self.n_heads} heads; set "
                             "n_kv_heads = n_heads")
        if not isinstance(self.rope_interleave, (bool, np.bool_)):
            raise ValueError(f"rope_interleave must be a bool, got {self.rope_interleave!r}")
        if (self.sliding_window is not None or self.layer_types is not None
                or self.qk_norm != "none" or self.attention_bias or self.rotary_dim
                or self.attention_sinks):
            raise ValueError("latent attention has no sliding window, q/k norm, attention "
                             "bias, sinks or rotary_dim (sliding_window, layer_types, qk_norm, "
                             "attention_bias, attention_sinks, rotary_dim: its rotary part is "
                             "qk_rope_dim)")

    @property
    def rotated_dims(self) -> int:
        """The dims RoPE rotates: the rotary part of each query and of the shared key."""
        return self.qk_rope_dim

    @property
    def qk_nope_dim(self) -> int:
        """Each query/key head's part without position, Dn."""
        return self.head_dim - self.qk_rope_dim

    @property
    def softmax_multiplier(self) -> float:
        """What the queries are multiplied by on top of head_dim^-1/2: YaRN's
        mscale(factor, mscale_all_dim)^2 where the RoPE scaling gives mscale_all_dim, else 1."""
        s = self.rope_scaling
        if s is None or s.rope_type != "yarn" or not s.mscale_all_dim or s.factor <= 1:
            return 1.0
        return (0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0) ** 2

    def scaled(self, **kw) -> "MLAConfig":
        """`ModelConfig.scaled` with a small latent: heads of 16 + 8 (values 16), latent 32,
        queries through a rank of 24 where the original has one; heads as KV heads."""
        return super().scaled(**kw)

    def _scaled_fields(self, **fields) -> dict:
        return {**fields, "n_kv_heads": fields["n_heads"], "head_dim": 24, "qk_rope_dim": 8,
                "rotary_dim": 0,
                "v_head_dim": 16, "kv_lora_rank": 32,
                "q_lora_rank": 24 if self.q_lora_rank else 0}


class MLALayer(DecoderLayer):
    """Pre-norm block: x + MLA(norm(x)), then + the MoE or dense MLP of norm(x)."""

    @staticmethod
    def attention(config: MLAConfig, layer: int, rngs, kernels: Kernels) -> LatentAttention:
        return LatentAttention(config, rngs=rngs, layer=layer, kernels=kernels)


class MLATransformer(MoETransformer):
    """The MLA model, batch size 1 (see `MoETransformer` for the calls)."""

    layer_class = MLALayer


def abstract_model(config: MLAConfig, *, resident_experts: bool = True,
                   kernels: Kernels = Kernels()) -> MLATransformer:
    """The model with `jax.ShapeDtypeStruct` leaves: allocates nothing."""
    return MLATransformer(config, rngs=None, resident_experts=resident_experts,
                          kernels=kernels)


def param_shapes(config: MLAConfig, *, resident_experts: bool = True
                 ) -> dict[str, jax.ShapeDtypeStruct]:
    """Flat parameter names to shape/dtype, in model order."""
    return flat_shapes(abstract_model(config, resident_experts=resident_experts))


def build_model(config: MLAConfig, params, *, experts=None, resident_experts: bool = True,
                kernels: Kernels = Kernels(), on_host=None) -> MLATransformer:
    """The model from flat arrays (as `models.decoder.build_model`)."""
    return fill_model(abstract_model(config, resident_experts=resident_experts,
                                     kernels=kernels), config, params, experts, on_host)


def cache_shapes(config: MLAConfig, capacity: int, dtype=None) -> KVCache:
    """The latent cache of `capacity` positions as `jax.ShapeDtypeStruct`s: per layer the
    latents [S, R] and the rotated shared keys [S, Dr]."""
    dt = dtype or config.dtype
    latent = jax.ShapeDtypeStruct((capacity, config.kv_lora_rank), dt)
    rotary = jax.ShapeDtypeStruct((capacity, config.qk_rope_dim), dt)
    return KVCache((latent,) * config.n_layers, (rotary,) * config.n_layers)


def init_cache(config: MLAConfig, capacity: int, dtype=None, *, slack: int = 0) -> KVCache:
    """A zero latent cache of `capacity` positions.

    Raises:
        ValueError: capacity is not positive or exceeds `config.max_seq_len` + `slack`.
    """
    check_capacity(config, capacity, slack)
    spec = cache_shapes(config, capacity, dtype)
    zeros = lambda s: jax.numpy.zeros(s.shape, s.dtype)  # noqa: E731
    return KVCache(tuple(map(zeros, spec.keys)), tuple(map(zeros, spec.values)))


def cache_bytes(config: MLAConfig, capacity: int) -> int:
    """Bytes of one latent cache of `capacity` positions: (R + Dr) values a position a
    layer."""
    c = config
    return (c.n_layers * capacity * (c.kv_lora_rank + c.qk_rope_dim)
            * np.dtype(c.dtype).itemsize)


def expanded_values(config: MLAConfig) -> int:
    """Values a position per-head keys and values would take over every layer (heads x (Dq +
    Dv) a layer): what the latent cache replaces (DeepSeek-V3: 2,498,560 against 35,136)."""
    return config.n_layers * config.n_heads * (config.head_dim + config.v_head_dim)


def attention_bytes(config: MLAConfig, queries: int, capacity: int, *, first: bool,
                    fused: bool) -> int:
    """Working memory of one chunk's MLA beyond its input and output: queries, the chunk's
    expanded keys and padded values, each part's output and statistics and the float32
    running merge; a later chunk also one expanded prefix block (the blocks are merged one at
    a time). On the XLA parts (not `fused`) the largest part's float32 scores and
    probabilities: [N, T, T] over its own keys, [N, T, block] over a prefix block."""
    c = config
    n, d, it = c.n_heads, c.head_dim, np.dtype(c.dtype).itemsize
    own = queries * n * (3 * d * it + 2 * (d * 4 + 4) + c.v_head_dim * 4)
    if first:
        return int(own + (0 if fused else n * queries * queries * (8 + it)))
    block = prefix_block(n, d, it, queries, capacity, fused)
    scores = 0 if fused else n * queries * max(block, queries) * (8 + it)
    return int(own + block * n * 2 * d * it + scores)
