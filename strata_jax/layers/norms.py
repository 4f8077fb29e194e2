"""Normalisation layers: RMSNorm (a plain or a zero-centred weight) and the gated RMSNorm of a
Gated DeltaNet layer's output."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from strata_jax.layers.params import filled


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, computed in float32.

    centred: the weight is stored zero-centred (Qwen3-Next and Qwen3.5: the scale is 1 + w,
    added in float32, and the parameter is `centred_weight`); else the scale is `weight`.
    """

    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs | None = None, *,
                 centred: bool = False):
        self.eps = eps
        self.centred = centred
        if centred:
            self.centred_weight = nnx.Param(filled(rngs, (dim,), dtype, 0.0))
        else:
            self.weight = nnx.Param(filled(rngs, (dim,), dtype, 1.0))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.centred:
            return (xf * (1.0 + self.centred_weight[...].astype(jnp.float32))).astype(x.dtype)
        return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """RMSNorm of x gated by silu(z) (a Gated DeltaNet's output norm): the normalised x in
    x's dtype times `weight`, times silu(z) in float32, cast to x's dtype."""

    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs | None = None):
        self.weight = nnx.Param(filled(rngs, (dim,), dtype, 1.0))
        self.eps = eps

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        scaled = self.weight[...] * xf.astype(x.dtype)
        return (scaled.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
