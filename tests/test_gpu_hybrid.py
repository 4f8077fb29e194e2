"""The hybrid Qwen model (Gated DeltaNet + gated attention) on a CUDA GPU through the real
stream: padded chunks, a follow-up turn and a layer-major read, byte-identical across the
resident, stream-all and routed arms, with the kernels "auto" picks (Mosaic grouped matmul,
cuDNN attention and the Pallas delta rule on Hopper) and with the delta rule's scan; the delta
rule's kernels against the float64 recurrence. Run with STRATA_REQUIRE_GPU=1 on the GPU
machine."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("delta_rule", ["auto", "xla"])
def test_cuda_hybrid_turns_and_layer_major_identical(delta_rule, stream_arms):
    from strata_jax.engine import Engine
    from strata_jax.kernels import Kernels
    from strata_jax.kernels.delta_rule import delta_rule_path
    from strata_jax.models import get_preset
    from strata_jax.synthetic import init_synthetic
    from strata_jax.testing import arm_reads

    assert delta_rule_path("auto", products="bf16") == "pallas"  # what a bf16 layer runs here
    cfg = get_preset("qwen3-next-80b-a3b").scaled(n_experts=32, top_k=4, hidden_size=256,
                                                  head_dim=64, expert_intermediate=128,
                                                  param_dtype="bfloat16")
    out = arm_reads(Engine, cfg, init_synthetic(cfg, seed=5, routing_skew=2.0), stream_arms(),
                    max_context=1024, chunk_size=64, kernels=Kernels(delta_rule=delta_rule))
    assert out["stream-all"] == out["resident"]
    assert out["routed"] == out["resident"]


def test_cuda_delta_rule_kernel_matches_the_float64_recurrence():
    """One float32 Gated DeltaNet layer on the GPU through each delta-rule implementation (the
    scan, the Pallas kernels; float32 products), each against the
    token-by-token float64 recurrence: a 300-token prompt in one call, then in two calls (the
    window and state handed on). The layer's projections run at float32 too (XLA's default
    on a GPU takes float32 matmuls at TF32, which is not the float32 row of the table)."""
    import jax

    from strata_jax.kernels import Kernels
    from strata_jax.models import build_model, get_preset, init_cache
    from strata_jax.reference import reference_deltanet
    from strata_jax.synthetic import init_synthetic
    from strata_jax.testing import assert_close

    cfg = get_preset("qwen3-next-80b-a3b").scaled(n_experts=8, top_k=2, param_dtype="float32")
    params = init_synthetic(cfg, seed=1)
    x = np.random.default_rng(3).standard_normal((300, cfg.hidden_size)).astype(np.float32)
    ref, _, ref_state = reference_deltanet(cfg, params, "layers.0.linear_attn.", x)
    zeros = init_cache(cfg, 8)
    for carry in ("pallas", "xla"):
        layer = build_model(cfg, params, kernels=Kernels(delta_rule=carry)).layers[0].linear_attn
        with jax.default_matmul_precision("float32"):
            out, _, state = layer(x, zeros.keys[0], zeros.values[0])
            a, w, s = layer(x[:130], zeros.keys[0], zeros.values[0])
            b, _, s = layer(x[130:], w, s)
        assert_close(out, ref, np.float32, err_msg=f"{carry}: one call")
        assert_close(state, ref_state, np.float32, err_msg=f"{carry}: the state")
        assert_close(np.concatenate([a, b]), ref, np.float32, err_msg=f"{carry}: two calls")


def test_cuda_bf16_delta_rule_matches_the_float64_recurrence():
    """The delta rule with bf16 products (what a bf16 layer on the GPU runs through the
    kernels: `products_for`): the Pallas kernels and the scan with bf16 operands, against the
    token-by-token float64 recurrence at the real head sizes (dk = dv = 128): 300 tokens from a
    random state in blocks of 64 (the last padded), bf16's row of the tolerance table; and
    the kernels within float16's row of the scan at the same products (the same roundings,
    summed in another order)."""
    import jax.numpy as jnp

    from strata_jax.layers.deltanet import gated_delta_rule, products_for
    from strata_jax.reference import reference_delta_rule
    from strata_jax.testing import assert_close, delta_rule_inputs

    assert products_for(jnp.bfloat16, "pallas") == "bf16"
    inputs = delta_rule_inputs(300, 4, 128, 128, seed=11, decay_shift=-2.0, state_scale=0.1)
    ref, ref_state = reference_delta_rule(*inputs)
    args = [jnp.asarray(a, jnp.float32) for a in inputs]
    got = {}
    for carry in ("pallas", "xla"):
        got[carry] = gated_delta_rule(*args, carry=carry, products="bf16")
        assert_close(got[carry][0], ref, jnp.bfloat16, err_msg=f"{carry}: outputs")
        assert_close(got[carry][1], ref_state, jnp.bfloat16, err_msg=f"{carry}: the state")
    assert_close(got["pallas"][0], got["xla"][0], np.float16, err_msg="kernels vs scan")
