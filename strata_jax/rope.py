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

import dataclasses
import math

import numpy as np

ROPE_TYPES = ("linear", "dynamic", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling of a checkpoint (Hugging Face `rope_scaling` / `rope_parameters`).

    Attributes:
        rope_type: "linear", "dynamic" or "yarn" (see the module docstring); no scaling is
            `ModelConfig.rope_scaling=None`.
        factor: context extension factor (> 0).
        original_max_position_embeddings: dynamic: the length up to which the default
            frequencies hold (and the longest context accepted); yarn: the pre-training context
            whose rotation counts place the ramp.
        attention_factor: yarn: multiplier of cos and sin; None: from factor (and mscale).
        beta_fast: yarn: rotations that bound the extrapolated (high-frequency) end; None: 32.
        beta_slow: yarn: rotations that bound the interpolated (low-frequency) end; None: 1.
        mscale: yarn: numerator weight of the default attention_factor (with mscale_all_dim).
        mscale_all_dim: yarn: denominator weight of the default attention_factor.
        truncate: yarn: round the ramp bounds outwards to whole indices.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r}: implemented are {ROPE_TYPES} "
                             f"(and no scaling, rope_scaling=None)")
        if not isinstance(self.factor, (int, float)) or not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be a positive number, got {self.factor!r}")
        if self.rope_type in ("dynamic", "yarn"):
            orig = self.original_max_position_embeddings
            if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
                raise ValueError(f"{self.rope_type} RoPE scaling needs a positive int "
                                 f"original_max_position_embeddings, got {orig!r}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"attention_factor must be positive, got {self.attention_factor!r}")

    @property
    def yarn_attention_factor(self) -> float:
        """YaRN's cos/sin multiplier: attention_factor, or its default from factor and mscale."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)


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


__all__: list[str] = ["ROPE_TYPES", "RopeScaling", "rope_frequencies"]
