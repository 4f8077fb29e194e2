"""Parameter helpers the layers share: initialisers that can build an abstract model, and the
matmul every projection uses.

`rngs=None` gives `jax.ShapeDtypeStruct` leaves instead of arrays: a full-size preset's
abstract model then builds in milliseconds (`models.decoder.abstract_model`), tracing no
random initialiser.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

INIT_STD = 0.02


def normal(rngs: nnx.Rngs | None, shape, dtype, std=INIT_STD):
    """A normal(0, std) initialiser, or a ShapeDtypeStruct when `rngs` is None."""
    if rngs is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def filled(rngs: nnx.Rngs | None, shape, dtype, value: float):
    """A constant initialiser, or a ShapeDtypeStruct when `rngs` is None."""
    if rngs is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jnp.full(shape, value, dtype)


def dot(x, w, bias=None):
    """x @ w (+ bias) accumulated in float32, result in x.dtype."""
    y = jnp.dot(x, w, preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def value(param):
    """A parameter's array, or None for an absent one."""
    return None if param is None else param[...]
