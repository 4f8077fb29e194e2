"""The dense SwiGLU MLP: dense layers and shared experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.layers.params import dot, normal


class MLP(nnx.Module):
    """SwiGLU MLP: down(silu(x @ gate) * (x @ up)). Used for dense layers and shared experts."""

    def __init__(self, hidden: int, intermediate: int, dtype, *, rngs: nnx.Rngs):
        self.gate = nnx.Param(normal(rngs, (hidden, intermediate), dtype))  # [H, I]
        self.up = nnx.Param(normal(rngs, (hidden, intermediate), dtype))  # [H, I]
        self.down = nnx.Param(normal(rngs, (intermediate, hidden), dtype))  # [I, H]

    def __call__(self, x):
        g = jnp.dot(x, self.gate[...], preferred_element_type=jnp.float32)
        u = jnp.dot(x, self.up[...], preferred_element_type=jnp.float32)
        h = (jax.nn.silu(g) * u).astype(x.dtype)  # [T, I]
        return dot(h, self.down[...])  # [T, H]
