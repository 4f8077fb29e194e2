"""Hugging Face config fields in the model: RoPE scaling (linear, dynamic, yarn) and attention
biases, against the float64 NumPy reference and against the formulas themselves."""

import math

import numpy as np
import pytest

from strata_jax.models import decoder as M
from strata_jax.models import get_preset
from strata_jax.reference import _rope, _rope_inv_freq, reference_forward
from strata_jax.config import RopeScaling
from strata_jax.layers.rope import rope, rope_frequencies
from strata_jax.synthetic import init_synthetic
from strata_jax.testing import assert_close

YARN = RopeScaling("yarn", 4.0, 64)
SCALINGS = {
    "none": None,
    "linear": RopeScaling("linear", 2.0),
    "dynamic": RopeScaling("dynamic", 2.0, 4096),
    "yarn": YARN,
    "yarn-mscale": RopeScaling("yarn", 8.0, 64, mscale=0.7, mscale_all_dim=0.5, beta_fast=16,
                               beta_slow=2, truncate=False),
    "yarn-attention-factor": RopeScaling("yarn", 4.0, 64, attention_factor=1.3),
}


def small(name="qwen3-30b-a3b", **kw):
    return get_preset(name).scaled(param_dtype="float32", n_experts=8, top_k=2).replace(**kw)


def test_default_frequencies_are_the_rope_formula():
    inv, factor = rope_frequencies(8, 10_000.0)
    np.testing.assert_allclose(inv, [1.0, 10_000 ** -0.25, 10_000 ** -0.5, 10_000 ** -0.75],
                               rtol=1e-15)
    assert factor == 1.0


def test_linear_divides_every_frequency():
    plain, _ = rope_frequencies(16, 1e6)
    inv, factor = rope_frequencies(16, 1e6, RopeScaling("linear", 4.0))
    np.testing.assert_allclose(inv, plain / 4.0, rtol=1e-15)
    assert factor == 1.0


def test_dynamic_is_plain_rope_within_its_context():
    plain, _ = rope_frequencies(16, 1e6)
    inv, factor = rope_frequencies(16, 1e6, RopeScaling("dynamic", 4.0, 1024))
    np.testing.assert_array_equal(inv, plain)
    assert factor == 1.0


def test_dynamic_refuses_a_longer_context():
    with pytest.raises(ValueError, match="dynamic RoPE scaling.*depend on the prompt's length"):
        small(max_seq_len=2048).replace(rope_scaling=RopeScaling("dynamic", 2.0, 1024))


def test_yarn_ramp_and_attention_factor():
    # D = 64, theta = 10,000, L = 4096: a frequency i turns L * theta^(-2i/D) / (2 pi) times over
    # L positions; beta_fast = 32 turns at i = 64 ln(4096 / (64 pi)) / (2 ln 1e4) = 10.5 (floor
    # 10), beta_slow = 1 at i = 64 ln(4096 / (2 pi)) / (2 ln 1e4) = 22.5 (ceil 23).
    d, theta, s = 64, 10_000.0, RopeScaling("yarn", 8.0, 4096)
    plain, _ = rope_frequencies(d, theta)
    inv, factor = rope_frequencies(d, theta, s)
    np.testing.assert_array_equal(inv[:11], plain[:11])  # i <= 10: extrapolated (unchanged)
    np.testing.assert_allclose(inv[23:], plain[23:] / 8.0, rtol=1e-15)  # interpolated
    i = 15  # on the ramp: (15 - 10) / (23 - 10) of the way to interpolation
    g = 5 / 13
    np.testing.assert_allclose(inv[i], (1 - g) * plain[i] + g * plain[i] / 8.0, rtol=1e-15)
    assert factor == pytest.approx(0.1 * math.log(8.0) + 1.0, rel=1e-15)
    m = RopeScaling("yarn", 8.0, 4096, mscale=0.7, mscale_all_dim=0.5)
    assert m.yarn_attention_factor == pytest.approx(
        (0.1 * 0.7 * math.log(8) + 1) / (0.1 * 0.5 * math.log(8) + 1), rel=1e-15)
    assert RopeScaling("yarn", 8.0, 4096, attention_factor=1.5).yarn_attention_factor == 1.5


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_frequencies_match_the_reference(kind):
    c = small(rope_scaling=SCALINGS[kind])
    inv, factor = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
    ref_inv, ref_factor = _rope_inv_freq(c)
    np.testing.assert_allclose(inv, ref_inv, rtol=1e-13)
    assert factor == pytest.approx(ref_factor, rel=1e-13)


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_rope_matches_the_reference(kind):
    c = small(rope_scaling=SCALINGS[kind])
    rng = np.random.default_rng(0)
    positions = np.array([0, 1, 7, 100, 1000, 3000], np.int32)
    for x in (np.ones((6, 2, c.head_dim), np.float32),
              rng.standard_normal((6, 2, c.head_dim)).astype(np.float32)):
        got = rope(x, positions, c.rope_theta, c.rope_scaling)
        # float32 angles of positions up to 3,000: ~3e-4 absolute error at the fastest frequency.
        np.testing.assert_allclose(np.asarray(got), _rope(x.astype(np.float64), positions, c),
                                   rtol=0, atol=2e-3, err_msg=kind)


_BUILT = {}


def built(config):
    if config not in _BUILT:
        params = init_synthetic(config, 0)
        _BUILT[config] = (M.build_model(config, params), params)
    return _BUILT[config]


@pytest.mark.slow  # test_yarn_chunked_matches_reference keeps biases and yarn in the fast run
@pytest.mark.parametrize("name,kw", [
    ("qwen3-30b-a3b", dict(attention_bias=True)),
    ("olmoe-1b-7b", dict(attention_bias=True)),
    ("qwen3-30b-a3b", dict(rope_scaling=YARN)),
    ("mixtral-8x7b", dict(rope_scaling=RopeScaling("linear", 4.0))),
    ("olmoe-1b-7b", dict(attention_bias=True, rope_scaling=RopeScaling("yarn", 2.0, 32))),
])
def test_model_matches_reference(name, kw):
    c = small(name, **kw)
    model, params = built(c)
    toks = np.random.default_rng(1).integers(0, c.vocab_size, 40).astype(np.int32)
    logits, _, _ = M.forward(model, toks, M.init_cache(c, 48))
    ref, _ = reference_forward(c, params, toks)
    assert_close(logits, ref, np.float32, err_msg=f"{name} {kw}")


def test_biases_change_the_output():
    """The synthetic biases are large enough that a model ignoring them fails the tolerance."""
    c = small(attention_bias=True, rope_scaling=YARN)
    params = init_synthetic(c, 0)
    assert sum(k.endswith(("q_bias", "k_bias", "v_bias", "o_bias")) for k in params) == 4 * 2
    zeroed = {k: (np.zeros_like(v) if k.endswith("_bias") else v) for k, v in params.items()}
    toks = np.arange(12, dtype=np.int32)
    a, _ = reference_forward(c, params, toks)
    b, _ = reference_forward(c, zeroed, toks)
    assert np.abs(a - b).max() > 1e-2


def test_yarn_chunked_matches_reference():
    """Later chunks rotate at their own positions: two chunks equal one whole sequence."""
    c = small(attention_bias=True, rope_scaling=YARN)
    model, params = built(c)
    toks = np.random.default_rng(2).integers(0, c.vocab_size, 40).astype(np.int32)
    cache = M.init_cache(c, 48)
    first, cache, _ = M.forward(model, toks[:24], cache)
    second, _, _ = M.forward(model, toks[24:], cache, start=24)
    ref, _ = reference_forward(c, params, toks)
    assert_close(np.concatenate([first, second]), ref, np.float32)
