"""Synthetic weights with a routing-skew knob.

Guards against benchmarks that only ever see uniform routing: a real model leaves many experts of a
chunk unrouted (the reference engine saw ~40% of a 512-expert top-10 layer unrouted at ~1,000
tokens), and that is exactly what the routed stream saves. The skew knob reproduces it.

Skew mechanism: router column e (the logit weights of expert e) is drawn N(0, 1/H) and multiplied
by exp(s * z_e), with z_e ~ N(0, 1) standardised over the layer's experts (a lognormal law of
strength s). Router inputs are RMS-normalised, so logit e has spread proportional to its column
norm; experts with small norms almost never reach the top k, large ones often do. s = 0 gives
uniform routing: every expert is chosen with the same probability. The weights of chosen experts
(softmax or sigmoid of the logits) stay well defined for any s.

Calibration (`unrouted_fraction`, isotropic Gaussian router inputs, 1,000 tokens, 512 experts
top-10, seed-averaged): s = 0 leaves ~0% unrouted; s = SKEW_40_PERCENT_512_TOP10 leaves ~40%.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from strata_jax.config import ModelConfig
from strata_jax.experts import ExpertWeights

# Skew that leaves ~40% of a 512-expert top-10 layer unrouted at 1,000 tokens (see module doc).
SKEW_40_PERCENT_512_TOP10 = 0.52


def router_scales(n_experts: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """Per-expert router column multipliers exp(skew * z), z standardised N(0, 1): [E] float64."""
    z = rng.standard_normal(n_experts)
    if n_experts > 1:
        z = (z - z.mean()) / (z.std() or 1.0)
    return np.exp(skew * z)


def _router(config: ModelConfig, skew: float, rng: np.random.Generator) -> np.ndarray:
    h, e = config.hidden_size, config.n_experts
    w = rng.standard_normal((h, e), dtype=np.float32) / np.sqrt(h)
    return (w * router_scales(e, skew, rng)[None, :]).astype(np.float32)  # [H, E]


def init_synthetic(config: ModelConfig, seed: int = 0, routing_skew: float = 0.0, *,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray]:
    """Random weights for every parameter of `config`, including all routed experts.

    Uses NumPy's generator in float32 then casts to the parameter dtype, which is fast for scaled
    models on the CPU. Residual-branch outputs (o_proj, down projections) are scaled by
    1/sqrt(2 * n_layers) so activations stay O(1) through depth.

    Args:
        config: model config.
        seed: RNG seed; same seed, same weights.
        routing_skew: router skew strength s >= 0 (see the module docstring).
        progress: called as progress(done_bytes, total_bytes) after each parameter (for a
            progress bar; full-size presets take minutes). The weights do not depend on it.

    Returns:
        flat name -> NumPy array in the parameter dtype (names as in `model.param_shapes`; the
        DeepSeek selection bias stays float32).
    """
    from strata_jax.model import param_shapes  # deferred: keeps this module light to import

    if routing_skew < 0:
        raise ValueError(f"routing_skew must be >= 0, got {routing_skew}")
    rng = np.random.default_rng(seed)
    residual_scale = 1.0 / np.sqrt(2.0 * config.n_layers)
    out: dict[str, np.ndarray] = {}
    shapes = param_shapes(config)
    total = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in shapes.values())
    done = 0
    for name, spec in shapes.items():
        shape, leaf = tuple(spec.shape), name.rsplit(".", 1)[-1]
        if leaf == "router":
            value = _router(config, routing_skew, rng)
        elif leaf == "selection_bias":
            value = 0.02 * rng.standard_normal(shape, dtype=np.float32)
        elif leaf == "weight":  # norms: near one so a wrong norm weight shows up in tests
            value = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        elif leaf == "embed":
            value = rng.standard_normal(shape, dtype=np.float32)
        elif leaf in ("q_bias", "k_bias", "v_bias", "o_bias"):  # attention biases
            value = 0.2 * rng.standard_normal(shape, dtype=np.float32)
        else:
            fan_in = shape[-2]
            value = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)
            if leaf in ("o_proj", "down"):
                value *= residual_scale
        out[name] = value.astype(spec.dtype)
        done += out[name].nbytes
        if progress is not None:
            progress(done, total)
    return out


def split_experts(config: ModelConfig, params: dict[str, np.ndarray]
                  ) -> tuple[dict[str, np.ndarray], dict[int, ExpertWeights]]:
    """Splits routed experts out of a flat dict: (non-expert params, layer -> ExpertWeights)."""
    dense = dict(params)
    experts = {}
    for layer in config.moe_layers:
        names = [f"layers.{layer}.mlp.{n}" for n in ExpertWeights._fields]
        experts[layer] = ExpertWeights(*(dense.pop(n) for n in names))
    return dense, experts


def synthetic_model(config: ModelConfig, seed: int = 0, routing_skew: float = 0.0):
    """A `MoETransformer` with `init_synthetic` weights, all experts resident."""
    from strata_jax.model import build_model

    return build_model(config, init_synthetic(config, seed, routing_skew))


def unrouted_fraction(config: ModelConfig, skew: float, n_tokens: int, seed: int = 0,
                      n_trials: int = 4) -> float:
    """Fraction of a layer's experts that no token routes to, for calibrating `routing_skew`.

    Draws router weights as `init_synthetic` does and isotropic N(0, 1) router inputs (what an
    RMS-normalised hidden state looks like to a random router), chooses the top k per token by the
    config's scores (selection bias and group limits are left out: they shift choices little for
    synthetic weights), and averages over `n_trials` layers.

    Returns:
        Mean fraction of experts with zero tokens, in [0, 1].
    """
    rng = np.random.default_rng(seed)
    fractions = []
    for _ in range(n_trials):
        router = _router(config, skew, rng)
        x = rng.standard_normal((n_tokens, config.hidden_size), dtype=np.float32)
        logits = x @ router  # [T, E]; softmax and sigmoid are monotone: rank by logits
        top = np.argpartition(-logits, config.top_k - 1, axis=1)[:, : config.top_k]
        routed = np.zeros(config.n_experts, bool)
        routed[top.ravel()] = True
        fractions.append(1.0 - routed.mean())
    return float(np.mean(fractions))
