"""The hybrid decoder stack of Qwen3-Next and Qwen3.5-MoE: Gated DeltaNet linear attention in
most layers, gated full attention in the others (`HybridConfig.mixers`), an MoE with a gated
shared expert after each, zero-centred RMSNorms.

The model is the shared decoder's (`models.decoder.MoETransformer`: both read orders, the head,
scoring) with its own layer. Its cache (`HybridCache`) holds, per layer, an attention layer's
keys and values or a linear layer's conv window and recurrent state: a chunk hands them to the
next, a `Session` keeps them for a follow-up turn, and `valid(position)` trims only the
attention layers' (a recurrent state has no positions to trim: it is the state after the last
real token, padding leaves it untouched).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.config import ModelConfig
from strata_jax.kernels import Kernels
from strata_jax.layers.deltanet import DELTA_BLOCK, GatedDeltaNet
from strata_jax.layers.gqa import Attention
from strata_jax.layers.norms import RMSNorm
from strata_jax.models.decoder import (DecoderLayer, MoETransformer, check_capacity,
                                       expert_param_names, expert_plane_names, feed_forward,
                                       fill_model, flat_shapes, validate_inputs)

__all__ = ["HybridConfig", "HybridCache", "HybridTransformer", "MIXERS", "abstract_model",
           "build_model", "param_shapes", "init_cache", "cache_shapes", "cache_bytes",
           "validate_inputs", "expert_plane_names", "expert_param_names", "mixer_bytes"]

LINEAR, FULL = "linear_attention", "full_attention"
MIXERS = (LINEAR, FULL)


@dataclasses.dataclass(frozen=True)
class HybridConfig(ModelConfig):
    """A `ModelConfig` with Gated DeltaNet layers (Qwen3-Next, Qwen3.5-MoE).

    Attributes (besides `ModelConfig`'s, whose attention fields describe the full-attention
    layers):
        mixers: each layer's token mixer, "linear_attention" (Gated DeltaNet) or
            "full_attention" (gated attention), one per layer.
        linear_k_heads, linear_v_heads: the DeltaNet's query/key and value heads.
        linear_k_dim, linear_v_dim: their widths.
        conv_kernel: taps of the DeltaNet's causal conv1d.
    """

    mixers: tuple[str, ...] = ()
    linear_k_heads: int = 16
    linear_v_heads: int = 32
    linear_k_dim: int = 128
    linear_v_dim: int = 128
    conv_kernel: int = 4

    def __post_init__(self):
        super().__post_init__()
        self._check_per_layer("mixers", MIXERS)
        self._check_positive("linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim",
                             "conv_kernel")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel={self.conv_kernel}: a causal conv needs 2 or more "
                             "taps")
        if self.linear_v_heads % self.linear_k_heads:
            raise ValueError(f"linear_v_heads={self.linear_v_heads} is not a multiple of "
                             f"linear_k_heads={self.linear_k_heads}")
        if self.layer_types is not None or self.sliding_window is not None:
            raise ValueError("a hybrid model's attention layers have no sliding window "
                             "(layer_types / sliding_window)")

    def replace(self, **changes) -> "HybridConfig":
        """`ModelConfig.replace`; a new `n_layers` without `mixers` repeats the layer kinds
        from the first layer (the first n of the published pattern)."""
        if "n_layers" in changes and "mixers" not in changes:
            changes["mixers"] = tuple(self.mixers[i % self.n_layers]
                                      for i in range(changes["n_layers"]))
        return super().replace(**changes)

    def scaled(self, *, n_layers: int | None = None, **kw) -> "HybridConfig":
        """`ModelConfig.scaled`, 4 layers by default; the layer kinds repeat the original's from
        its first layer (Qwen3-Next's three DeltaNet layers then one attention layer; fewer
        layers than that keep an attention layer last), the
        DeltaNet shrinks to 2 key and 4 value heads of 16 (the ratio of value to key heads
        kept up to 2), and the rotary part keeps its fraction of a head."""
        return super().scaled(n_layers=n_layers or 4, **kw)

    def _scaled_fields(self, **fields) -> dict:
        fields = super()._scaled_fields(**fields)
        depth = fields["n_layers"]
        ratio = min(self.linear_v_heads // self.linear_k_heads, 2)
        mixers = tuple(self.mixers[i % self.n_layers] for i in range(depth))
        if FULL in self.mixers and FULL not in mixers:  # fewer layers than the pattern's period
            mixers = mixers[:-1] + (FULL,)
        return {**fields, "mixers": mixers,
                "linear_k_heads": 2, "linear_v_heads": 2 * ratio, "linear_k_dim": 16,
                "linear_v_dim": 16}

    def is_linear(self, layer: int) -> bool:
        """Whether layer `layer` is a Gated DeltaNet layer."""
        return self.mixers[layer] == LINEAR

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the DeltaNet's conv: q, k and v."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim


@jax.tree_util.register_pytree_node_class
class HybridCache:
    """Per-layer state of a hybrid model.

    Attributes:
        keys: per layer, an attention layer's keys [S, KVH, D] (RoPE applied) or a linear
            layer's conv window [K-1, C] (the inputs of the last K-1 positions).
        values: per layer, an attention layer's values [S, KVH, D] or a linear layer's
            recurrent state float32 [Hv, dk, dv].
        linear: per layer, whether it is a linear layer (static).
        capacity: positions the attention layers hold (static).
    """

    def __init__(self, keys, values, linear: tuple[bool, ...], capacity: int):
        self.keys, self.values = tuple(keys), tuple(values)
        self.linear, self.capacity = tuple(linear), int(capacity)

    def tree_flatten(self):
        return (self.keys, self.values), (self.linear, self.capacity)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], children[1], *aux)

    def _replace(self, *, keys=None, values=None) -> "HybridCache":
        return HybridCache(self.keys if keys is None else keys,
                           self.values if values is None else values, self.linear, self.capacity)

    def valid(self, position: int) -> "HybridCache":
        """The attention layers' first `position` positions and every linear layer's state:
        what a session holds."""
        trim = lambda a, lin: a if lin else a[:position]  # noqa: E731
        return HybridCache([trim(k, lin) for k, lin in zip(self.keys, self.linear)],
                           [trim(v, lin) for v, lin in zip(self.values, self.linear)],
                           self.linear, min(position, self.capacity))

    def __repr__(self) -> str:
        return (f"HybridCache({sum(self.linear)} linear + {len(self.linear) - sum(self.linear)} "
                f"attention layers, capacity={self.capacity})")


class HybridLayer(DecoderLayer):
    """Pre-norm block with a Gated DeltaNet or a gated attention mixer, then the MoE (or a
    dense MLP), zero-centred norms."""

    def __init__(self, config: HybridConfig, layer: int, *, rngs: nnx.Rngs,
                 resident_experts: bool = True, kernels: Kernels = Kernels()):
        c, dt = config, config.dtype
        self.layer = layer
        self.is_moe = layer in c.moe_layers
        self.linear = c.is_linear(layer)
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dt, rngs, centred=True)
        if self.linear:
            self.linear_attn = GatedDeltaNet(
                c.hidden_size, c.linear_k_heads, c.linear_v_heads, c.linear_k_dim,
                c.linear_v_dim, c.conv_kernel, c.rms_norm_eps, dt, rngs=rngs,
                delta_rule=kernels.delta_rule)
        else:
            self.attn = Attention(c, rngs=rngs, kernels=kernels, layer=layer, output_gate=True,
                                  centred_norms=True)
        self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dt, rngs, centred=True)
        self.mlp = feed_forward(c, layer, rngs, resident_experts, kernels)

    def attention_block(self, x, cache_k, cache_v, start, positions, valid=None):
        """x + mixer(norm(x)): an attention layer writes its keys/values at `start`; a linear
        layer continues from its conv window and state (cache_k, cache_v) and returns the
        next ones."""
        if not self.linear:
            return super().attention_block(x, cache_k, cache_v, start, positions, valid)
        h, window, state = self.linear_attn(self.input_norm(x), cache_k, cache_v, valid)
        return x + h, window, state


class HybridTransformer(MoETransformer):
    """The hybrid model, batch size 1 (see `MoETransformer` for the calls)."""

    layer_class = HybridLayer

    @staticmethod
    def norm(config: ModelConfig, rngs):
        return RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype, rngs, centred=True)


def abstract_model(config: HybridConfig, *, resident_experts: bool = True,
                   kernels: Kernels = Kernels()) -> HybridTransformer:
    """The model with `jax.ShapeDtypeStruct` leaves: allocates nothing."""
    return HybridTransformer(config, rngs=None, resident_experts=resident_experts,
                             kernels=kernels)


def param_shapes(config: HybridConfig, *, resident_experts: bool = True
                 ) -> dict[str, jax.ShapeDtypeStruct]:
    """Flat parameter names to shape/dtype, in model order."""
    return flat_shapes(abstract_model(config, resident_experts=resident_experts))


def build_model(config: HybridConfig, params, *, experts=None, resident_experts: bool = True,
                kernels: Kernels = Kernels(), on_host=None) -> HybridTransformer:
    """The model from flat arrays (as `models.decoder.build_model`)."""
    return fill_model(abstract_model(config, resident_experts=resident_experts,
                                     kernels=kernels), config, params, experts, on_host)


def _layer_specs(config: HybridConfig, capacity: int, dtype) -> Iterator[tuple]:
    c = config
    for layer in range(c.n_layers):
        if c.is_linear(layer):
            yield (jax.ShapeDtypeStruct((c.conv_kernel - 1, c.linear_conv_dim), dtype),
                   jax.ShapeDtypeStruct((c.linear_v_heads, c.linear_k_dim, c.linear_v_dim),
                                        jnp.float32))
        else:
            kv = jax.ShapeDtypeStruct((capacity, c.n_kv_heads, c.head_dim), dtype)
            yield kv, kv


def cache_shapes(config: HybridConfig, capacity: int) -> HybridCache:
    """`HybridCache` of `jax.ShapeDtypeStruct`s (allocates nothing)."""
    specs = list(_layer_specs(config, capacity, config.dtype))
    return HybridCache([k for k, _ in specs], [v for _, v in specs],
                       [config.is_linear(i) for i in range(config.n_layers)], capacity)


def init_cache(config: HybridConfig, capacity: int, dtype=None, *, slack: int = 0
               ) -> HybridCache:
    """A zero cache of `capacity` positions: zero states are the start of a prompt.

    Raises:
        ValueError: capacity is not positive or exceeds `config.max_seq_len` + `slack`.
    """
    check_capacity(config, capacity, slack)
    specs = list(_layer_specs(config, capacity, dtype or config.dtype))
    zeros = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
    return HybridCache([zeros(k) for k, _ in specs], [zeros(v) for _, v in specs],
                       [config.is_linear(i) for i in range(config.n_layers)], capacity)


# The delta rule's float32 temporaries, in arrays of [T, Hv, max(dk, dv)]: XLA's CPU buffer
# assignment of the scan's path (`gated_delta_rule`) holds 9.5 (tests/test_hybrid.py checks the
# bound); its GPU one up to 8.0 (Qwen3-Next's layer from 1K to 32K compiled for Hopper,
# `benchmarks.compile_check`), the Pallas kernels' fewer.
DELTA_TEMPORARIES = 10


def mixer_bytes(config: HybridConfig, queries: int) -> int:
    """Working memory of one chunk's Gated DeltaNet layer on `queries` tokens (padded to whole
    blocks), beyond its input and output: the projections ([T, 2Kd + 2Vd + 2Hv] in the
    parameter dtype), q, k, v in float32 (the conv's output in the parameter dtype too), the
    delta rule's temporaries (`DELTA_TEMPORARIES`) and its float32 output. The engine's memory
    plan takes the larger of this and the attention layers' working memory (`engine.memory`)."""
    c = config
    t = -(-queries // DELTA_BLOCK) * DELTA_BLOCK
    it = np.dtype(c.dtype).itemsize
    kd, vd = c.linear_k_heads * c.linear_k_dim, c.linear_v_heads * c.linear_v_dim
    proj = t * (2 * kd + 2 * vd + 2 * c.linear_v_heads) * it
    qkv = t * (2 * kd + vd) * (4 + it)
    rule = (DELTA_TEMPORARIES + 1) * t * c.linear_v_heads * max(c.linear_k_dim,
                                                                c.linear_v_dim) * 4
    return int(proj + qkv + rule)


def cache_bytes(config: HybridConfig, capacity: int) -> int:
    """Bytes of one cache of `capacity` positions: the attention layers' keys and values, the
    linear layers' conv windows and recurrent states."""
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
               for pair in _layer_specs(config, capacity, config.dtype) for s in pair)
