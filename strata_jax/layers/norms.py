"""Normalisation layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from strata_jax.layers.params import filled


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, computed in float32."""

    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs | None = None):
        self.weight = nnx.Param(filled(rngs, (dim,), dtype, 1.0))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)
