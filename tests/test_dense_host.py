"""Engine(dense="host"): each decoder layer's own weights in host memory, copied in one layer
ahead (`strata_jax/engine/dense.py`). Every read is the same bits as with every weight on the
device: resident and streamed experts, chunks, a follow-up turn, layer-major; the device holds
no decoder layer's weights between prefills."""

from __future__ import annotations

import numpy as np
import pytest

from strata_jax.engine import Engine
from strata_jax.engine.dense import dense_layout, group_bytes
from strata_jax.models import expert_plane_names, get_preset, param_shapes
from strata_jax.stream import StreamConfig, StreamTuning
from strata_jax.synthetic import init_synthetic
from strata_jax.testing import arm_reads

CFG = get_preset("qwen3-30b-a3b").scaled(n_layers=3, n_experts=16, top_k=2, hidden_size=64,
                                         expert_intermediate=32, param_dtype="bfloat16")
ARMS = (("resident", None),
        ("routed", StreamConfig(routed=True, depth=4, backend="cpu",
                                tuning=StreamTuning(stream_floor=16))))


@pytest.fixture(scope="module")
def params():
    return init_synthetic(CFG, seed=3)


@pytest.mark.slow
def test_dense_on_host_reads_the_device_bits(params):
    """Chunks of 64 over 200 tokens, a follow-up turn and layer-major: the dense weights on the
    host read the bytes of everything on the device (streamed arms: the slow run)."""
    on_device = arm_reads(Engine, CFG, params, ARMS[:1], max_context=256, chunk_size=64)
    on_host = arm_reads(Engine, CFG, params, ARMS[:1], max_context=256, chunk_size=64,
                        dense="host")
    assert on_host == on_device


@pytest.mark.slow
def test_dense_on_host_every_arm(params):
    """Resident and routed (the native stream's CPU backend), both places of the dense weights:
    one set of bytes."""
    on_device = arm_reads(Engine, CFG, params, ARMS, max_context=256, chunk_size=64)
    on_host = arm_reads(Engine, CFG, params, ARMS, max_context=256, chunk_size=64,
                        dense="host")
    assert on_host == on_device and len(set(on_host.values())) == 1


def test_dense_on_host_leaves_layers_off_the_device(params):
    """The device state holds the routed experts only; each program copies the embedding,
    every layer's weights and the head in (one dense_fetch and one dense_wait each); the host
    block holds them at 256-byte offsets, grouped as the memory plan counts them; a chunk and a
    layer-major read have the device bits; close() lets the weights go."""
    from strata_jax.engine.results import chunk_ids

    eng = Engine(CFG, params, None, max_context=128, chunk_size=32, dense="host")
    try:
        on_device = sum(a.size * a.dtype.itemsize for a in eng._state_leaves)
        experts = {n for l in CFG.moe_layers for n in expert_plane_names(CFG, l).values()}
        assert on_device == sum(s.size * s.dtype.itemsize for n, s in param_shapes(CFG).items()
                                if n in experts)
        dense = eng._dense
        assert len(dense.groups) == CFG.n_layers + 2 and all(dense.groups)
        assert [p[0] for p, *_ in dense.groups[0]] == ["embed"]
        assert {p[0] for p, *_ in dense.groups[-1]} == {"final_norm", "lm_head"}
        assert all(addr % 256 == 0 for g in dense.groups for *_, addr in g)
        assert dense.group_bytes == group_bytes(*dense_layout(
            CFG, param_shapes(CFG, resident_experts=False))[:2])
        assert dense.in_flight_bytes == max(2 * max(dense.layer_bytes),
                                            max(dense.group_bytes[0], dense.group_bytes[-1])
                                            + max(dense.layer_bytes))
        ids = np.arange(32, dtype=np.int32)
        hlo = eng._jit.lower(eng._state_leaves, {}, chunk_ids(ids, 32, 0), None,
                             first=True, mode=0, sub=0, width=34).as_text()
        assert hlo.count("strata_dense_fetch") == CFG.n_layers + 2
        assert hlo.count("strata_dense_wait") == CFG.n_layers + 2
        reads = [eng.prefill(ids), eng.prefill(ids[:20], order="layer-major")]
    finally:
        eng.close()
    with Engine(CFG, params, None, max_context=128, chunk_size=32) as ref:
        want = [ref.prefill(ids), ref.prefill(ids[:20], order="layer-major")]
    assert [(r.logits_sha256(), r.kv_sha256()) for r in reads] == \
        [(r.logits_sha256(), r.kv_sha256()) for r in want]
    assert eng._state_leaves is None and eng._dense is None
    with pytest.raises(RuntimeError):
        eng.prefill(ids)


def test_dense_option_is_checked(params):
    with pytest.raises(ValueError, match="dense='hosted'.*'device'.*'host'"):
        Engine(CFG, params, None, max_context=64, dense="hosted")
    with pytest.raises(ValueError, match="dense='host' with a mesh is not implemented"):
        Engine(CFG, params, None, max_context=64, dense="host", mesh=1)


@pytest.mark.gpu
def test_cuda_dense_on_host_reads_the_device_bits(stream_arms):
    """On the GPU: pinned host blocks, the copy stream and its events; resident, stream-all
    and routed arms, with and without the dense weights on the host, all the same bits."""
    from strata_jax.kernels import Kernels

    cfg = get_preset("qwen3-30b-a3b").scaled(n_layers=3, n_experts=32, top_k=4, hidden_size=256,
                                             expert_intermediate=128, param_dtype="bfloat16")
    params = init_synthetic(cfg, seed=5, routing_skew=2.0)
    kw = dict(max_context=512, chunk_size=64, kernels=Kernels(grouped_matmul="tiled"))
    on_device = arm_reads(Engine, cfg, params, stream_arms(), **kw)
    on_host = arm_reads(Engine, cfg, params, stream_arms(), dense="host", **kw)
    assert len(set(on_device.values())) == 1
    assert on_host == on_device


FAMILIES = ["qwen3-next-80b-a3b", "deepseek-v3", "gpt-oss-20b", "glm-4.5-air"]


@pytest.mark.parametrize("preset", FAMILIES)
def test_dense_on_host_builds_every_family(preset):
    """Every family's engine takes dense="host": nothing but routed experts on the device, a
    host group for the embedding, each layer and the head."""
    cfg = get_preset(preset).scaled(n_experts=8, top_k=2, param_dtype="bfloat16")
    with Engine(cfg, init_synthetic(cfg, seed=4), None, max_context=64, chunk_size=32,
                dense="host") as eng:
        assert len(eng._dense.groups) == cfg.n_layers + 2 and all(eng._dense.groups)
        experts = {n for l in cfg.moe_layers for n in expert_plane_names(cfg, l).values()}
        assert sum(a.size * a.dtype.itemsize for a in eng._state_leaves) == sum(
            s.size * s.dtype.itemsize for n, s in param_shapes(cfg).items() if n in experts)


@pytest.mark.slow
@pytest.mark.parametrize("preset", FAMILIES[:3])
def test_dense_on_host_in_every_family(preset):
    """A hybrid (DeltaNet states in the cache), latent attention and gpt-oss (sinks, biases):
    two chunks and layer-major read the device bits with the dense weights on the host."""
    cfg = get_preset(preset).scaled(n_experts=8, top_k=2, param_dtype="bfloat16")
    params = init_synthetic(cfg, seed=4)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 40)
    out = []
    for dense in ("device", "host"):
        with Engine(cfg, params, None, max_context=64, chunk_size=32, dense=dense) as eng:
            a, b = eng.prefill(tokens), eng.prefill(tokens, order="layer-major")
            out.append((a.logits_sha256(), a.kv_sha256(), b.logits_sha256(), b.kv_sha256()))
    assert out[0] == out[1]
