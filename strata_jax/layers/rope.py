"""Rotary position embedding frequencies, with the context-extension scalings checkpoints carry.

Guards against a long-context checkpoint running on the wrong frequencies: a YaRN model read as
plain RoPE gives plausible logits that are wrong. The frequencies are computed once on the host
in float64 from the static config (the model bakes them in as float32 constants), following the
published formulas as Hugging Face transformers applies them (`modeling_rope_utils`):

- default: inv_freq[i] = theta^(-2i/D), i = 0..D/2-1.
- linear (position interpolation): inv_freq / factor.
- dynamic (dynamic NTK): the frequencies depend on the longest position of the call past
  `original_max_position_embeddings` (so a chunked prompt would see other frequencies than a
  whole one); up to that length they are the default ones. Only that range is implemented: a
  model with dynamic scaling accepts at most `original_max_position_embeddings` positions.
- yarn (YaRN, Peng et al. 2023, arXiv:2309.00071): each frequency blends interpolation
  (inv_freq / factor) and extrapolation (inv_freq) by a linear ramp over the frequency index,
  between the indices where a frequency turns `beta_fast` and `beta_slow` times over
  `original_max_position_embeddings` positions; cos and sin are multiplied by `attention_factor`
  (default 0.1 ln(factor) + 1, or the ratio of the two mscale terms when `mscale` and
  `mscale_all_dim` are both given).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.config import RopeScaling

def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None
                     ) -> tuple[np.ndarray, float]:
    """Inverse frequencies and the cos/sin multiplier of a rotary embedding.

    Args:
        head_dim: rotated width D (even).
        theta: RoPE base.
        scaling: None for plain RoPE.

    Returns:
        (inv_freq float64 [D/2], attention_factor): angle i of position p is p * inv_freq[i];
        cos and sin are multiplied by attention_factor (1.0 except for yarn).
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim  # [D/2]
    inv_freq = 1.0 / theta ** exponents
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    # yarn. Frequency index where a frequency turns `rotations` times over the original context:
    # solving L * theta^(-2i/D) = 2 pi rotations for i.
    original = scaling.original_max_position_embeddings

    def index_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index_of(scaling.beta_fast or 32), index_of(scaling.beta_slow or 1)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    # ramp 0 (fast-turning, low index): extrapolate (keep inv_freq); ramp 1: interpolate.
    inv_freq = inv_freq * (1.0 - ramp) + inv_freq / scaling.factor * ramp
    return inv_freq, scaling.yarn_attention_factor


__all__: list[str] = ["RopeScaling", "rope", "rope_frequencies"]


def rope(x: jax.Array, positions: jax.Array, theta: float,
         scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary embedding, half-split (Hugging Face `rotate_half`) convention.

    Args:
        x: [T, heads, D].
        positions: int32 [T].
        theta: RoPE base.
        scaling: the config's RoPE scaling (`RopeScaling`), None for plain RoPE.

    Returns:
        [T, heads, D] in x.dtype.
    """
    d = x.shape[-1]
    inv, factor = rope_frequencies(d, theta, scaling)  # host float64, static
    inv_freq = jnp.asarray(inv, jnp.float32)  # [D/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.cos(angles)[:, None, :]  # [T, 1, D/2]
    sin = jnp.sin(angles)[:, None, :]
    if factor != 1.0:  # YaRN's attention factor: q.k scales by its square
        cos, sin = cos * factor, sin * factor
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
