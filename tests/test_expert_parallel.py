"""Expert parallelism over a jax.sharding.Mesh (strata_jax/parallel.py, Engine(mesh=),
`--devices`): each MoE layer's experts split over an "expert" axis, every expert resident.

Several CPU devices exist only when XLA is told so before JAX starts its backend, so the tests on
2 and 4 simulated devices run in a child process (`_child`); the rest of the suite keeps one
device. Against the one-device engine the outputs agree within the tolerance table (a token's
expert outputs are summed over devices, then over its k choices' partial sums, so the float32
order differs); within one mesh the arms (chunked or one chunk, synced or not, layer-major,
two turns) give the same bits wherever the one-device engine's do. Measured on the CPU backend
(jax 0.10.2): on 2 and 4 devices the bfloat16 logits and KV cache came out the same bits as the
one-device engine's, float32 logits within 1e-6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from strata_jax import parallel
from strata_jax.models import get_preset
from strata_jax.engine import Engine
from strata_jax.layers.moe import permute
from strata_jax.stream import StreamConfig
from strata_jax.synthetic import init_synthetic

TINY = get_preset("qwen3-30b-a3b").scaled(n_layers=2, n_experts=8, top_k=2, hidden_size=32,
                                          expert_intermediate=16, param_dtype="float32")


def _child(code: str, devices: int, timeout: int = 300) -> dict:
    """Runs `code` in a child Python with `devices` simulated CPU devices; returns the JSON
    object it prints last."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                         + f" --xla_force_host_platform_device_count={devices}").strip()}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- one device: the helpers and the refusals ----------------------------------------------------


def test_expert_ranges_and_rows_per_device():
    assert [parallel.expert_range(8, 4, d) for d in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    counts = np.arange(16).reshape(2, 8)  # [layers, E]
    np.testing.assert_array_equal(parallel.device_rows(counts, 2), [[6, 22], [38, 54]])
    with pytest.raises(ValueError, match="8 experts do not split over 3 devices"):
        parallel.device_rows(counts, 3)


def test_local_routing_keeps_the_one_device_order():
    # 5 tokens, top-2 of 8 experts; the last token is padding (sentinel 8, weight 0).
    ids = np.array([[3, 0], [7, 3], [1, 4], [5, 2], [8, 8]], np.int32)
    weights = np.array([[.6, .4], [.7, .3], [.5, .5], [.9, .1], [0, 0]], np.float32)
    counts = np.bincount(ids[ids < 8], minlength=8).astype(np.int32)
    _, order = permute(np.zeros((5, 1), np.float32), ids)
    order = np.asarray(order)
    for d in range(2):
        lo, hi = parallel.expert_range(8, 2, d)
        lids, lw, lc = (np.asarray(a) for a in parallel.local_routing(ids, weights, counts, 4, d))
        mine = (ids >= lo) & (ids < hi)
        np.testing.assert_array_equal(lids, np.where(mine, ids - lo, 4))
        np.testing.assert_array_equal(lw, np.where(mine, weights, 0))
        np.testing.assert_array_equal(lc, counts[lo:hi])
        # The device's sorted copies are the one-device sorted order's copies of its experts.
        _, local_order = permute(np.zeros((5, 1), np.float32), lids)
        n = int(lc.sum())
        flat = ids.reshape(-1)
        np.testing.assert_array_equal(np.asarray(local_order)[:n],
                                      order[(flat[order] >= lo) & (flat[order] < hi)])


def test_bad_meshes_are_refused():
    have = len(jax.devices())
    with pytest.raises(ValueError, match=f"devices={have + 1}: JAX sees {have} "):
        parallel.expert_mesh(have + 1)
    if jax.devices()[0].platform == "cpu":
        with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
            parallel.expert_mesh(have + 1)
    with pytest.raises(ValueError, match="at least 1 device"):
        parallel.expert_mesh(0)
    with pytest.raises(ValueError, match="at least 1 device"):
        parallel.expert_mesh([])
    d = jax.devices()[0]
    with pytest.raises(ValueError, match="listed twice"):
        parallel.expert_mesh([d, d])
    with pytest.raises(TypeError, match="a count, a sequence of jax.Device or None"):
        parallel.expert_mesh("cpu")
    with pytest.raises(TypeError, match="not a jax.Device"):
        parallel.expert_mesh(["cpu:0"])
    with pytest.raises(TypeError, match="must be a jax.sharding.Mesh"):
        parallel.check_mesh("expert", 8)
    other = jax.sharding.Mesh(np.asarray([d], dtype=object), ("data",))
    with pytest.raises(ValueError, match="no 'expert' axis"):
        parallel.check_mesh(other, 8)
    assert parallel.check_mesh(parallel.expert_mesh(1), 8) == 1


def test_engine_refuses_a_mesh_with_a_device():
    params = init_synthetic(TINY, seed=1)
    with pytest.raises(ValueError, match="device=cpu:0 and mesh= both say where"):
        Engine(TINY, params, StreamConfig(backend="cpu"), max_context=64, mesh=1, device="cpu")
    with pytest.raises(ValueError, match="device=cpu:0 and mesh= both say where"):
        Engine(TINY, params, None, max_context=64, mesh=1, device="cpu")
    with pytest.raises(ValueError, match=f"devices={len(jax.devices()) + 1}: JAX sees"):
        Engine(TINY, params, None, max_context=64, mesh=len(jax.devices()) + 1)
    with pytest.raises(TypeError, match="must be a count"):
        Engine(TINY, params, None, max_context=64, mesh="expert")


def test_cli_refuses_missing_devices_and_uneven_splits(capsys):
    from strata_jax.cli import main

    base = ["prefill", "--preset", "qwen3-30b-a3b", "--scale", "tiny", "--tokens", "20", "-q"]
    n = len(jax.devices("cpu"))
    # Streamed or resident, N devices must be there (JAX started with this process's count).
    for extra in ([], ["--no-stream"]):
        assert main(base + extra + ["--backend", "cpu", "--devices", str(n + 1)]) == 2
        assert f"--devices {n + 1}: JAX sees {n} cpu device" in capsys.readouterr().err
    assert main(base + ["--backend", "cpu", "--devices", "1", "--resident-per-layer",
                        "33"]) == 2
    assert "exceeds the 32 experts of a layer" in capsys.readouterr().err
    assert main(["info", "--preset", "qwen3-30b-a3b", "--scale", "tiny", "--no-measure",
                 "--devices", "3", "-q"]) == 2
    assert "devices=3 does not divide the 32 experts" in capsys.readouterr().err


def test_memory_plan_per_device():
    from strata_jax.engine.memory import memory_plan, param_bytes

    cfg = get_preset("qwen3-235b-a22b")
    one = memory_plan(cfg, max_context=4096, device_bytes=80 * 2**30)
    eight = memory_plan(cfg, max_context=4096, device_bytes=80 * 2**30, devices=8)
    assert one["devices"] == 1 and eight["devices"] == 8
    d = eight["per_device"]
    assert d["experts_per_layer"] == cfg.n_experts // 8
    assert d["expert_bytes"] * 8 == cfg.expert_bytes_total
    assert d["device_bytes_all_resident"] == (param_bytes(cfg, resident_experts=False)
                                              + one["kv_bytes"] + d["expert_bytes"])
    assert (one["per_device"]["fits_all_resident"], d["fits_all_resident"]) == (False, True)
    # Streamed: each device's own plan over its slice (the budgets are per device).
    four = memory_plan(cfg, max_context=4096, device_bytes=80 * 2**30, devices=8,
                       resident_per_layer=4)
    d = four["per_device"]
    assert d["expert_slices"][:2] == [[0, 16], [16, 32]] and len(d["expert_slices"]) == 8
    assert d["resident_per_layer"] == 4
    assert d["resident_bytes"] == 4 * len(cfg.moe_layers) * four["expert_bytes"]
    assert d["ring_slots"] == 2 * 16 and d["ring_frames"] == 2
    assert d["device_bytes_streamed"] == (four["dense_bytes"] + four["kv_bytes"]
                                          + d["resident_bytes"] + d["ring_bytes"])
    assert d["fits_streamed"]
    with pytest.raises(ValueError, match="devices=3 does not divide the 128 experts"):
        memory_plan(cfg, max_context=4096, devices=3)


# ---- several simulated devices (child processes) -------------------------------------------------

_SETUP = """
    import json
    import jax, numpy as np
    from strata_jax import parallel
    from strata_jax.models import get_preset
    from strata_jax.engine import Engine
    from strata_jax.reference import reference_forward
    from strata_jax.synthetic import init_synthetic
    from strata_jax.testing import assert_close
    F32 = get_preset("qwen3-30b-a3b").scaled(n_layers=2, n_experts=8, top_k=2, hidden_size=32,
                                             expert_intermediate=16, param_dtype="float32")
"""


@pytest.mark.slow
def test_two_devices_match_the_float64_reference():
    # The default run's check on a mesh: one prefill (two chunks, a padded one) on 2 devices,
    # each holding its half of every layer's experts, against the float64 reference.
    out = _child(_SETUP + """
    params = init_synthetic(F32, seed=1)
    toks = np.arange(40) * 7 % F32.vocab_size
    with Engine(F32, params, None, max_context=64, chunk_size=32, mesh=2) as eng:
        r = eng.prefill(toks)
        again = eng.prefill(toks)
        assert (again.logits_sha256(), again.kv_sha256()) == (r.logits_sha256(), r.kv_sha256())
        shards = {}
        gate = eng._state_leaves[[i for i, l in enumerate(eng._state_leaves)
                                  if l.shape == (8, 32, 16)][0]]
        for s in gate.addressable_shards:
            shards[s.device.id] = [s.index[0].start or 0, s.index[0].stop or 8]
    want, counts = reference_forward(F32, params, toks)
    assert_close(r.logits, want[-1], np.float32)
    np.testing.assert_array_equal(r.counts, counts)
    try:
        parallel.check_mesh(parallel.expert_mesh(2), 7)
    except ValueError as e:
        uneven = str(e)
    print(json.dumps(dict(shards=shards, devices=r.devices, rows=r.per_device()["rows"],
                          total=int(counts.sum()), uneven=uneven)))
    """, devices=2)
    assert out["shards"] == {"0": [0, 4], "1": [4, 8]}
    assert out["devices"] == 2 and sum(out["rows"]) == out["total"] == 2 * 40 * 2
    assert out["uneven"].startswith("7 experts per layer do not split evenly over the 2 devices")


@pytest.mark.slow  # a child with 2 devices, 9 engines
def test_quantized_experts_on_two_devices():
    # fp8, int4 and int4 with zero-points and act-order (its row permutation split with its
    # experts): on 2 devices resident and routed-streamed read the same bits, within the
    # tolerance table of one device's read and of the float64 forward of the same planes.
    out = _child(_SETUP + """
    from strata_jax.stream import StreamConfig, StreamTuning
    from strata_jax.weights import QuantizedParams
    plain = F32.replace(param_dtype="bfloat16")
    params = init_synthetic(plain, seed=2)
    toks = np.random.default_rng(3).integers(0, plain.vocab_size, 40)
    report = {}
    for name, kw in (("fp8", dict(expert_format="fp8")), ("int4", dict(expert_format="int4")),
                     ("int4-zp-act", dict(expert_format="int4", expert_zero_points=True,
                                          expert_act_order=True))):
        cfg = plain.replace(expert_block=16, **kw)
        qp = QuantizedParams(params, cfg)
        got = {}
        for arm, mesh, stream in (("one", None, None), ("mesh", 2, None),
                                  ("mesh routed", 2, StreamConfig(routed=True, tuning=StreamTuning(
                                      stream_floor=1)))):
            with Engine(cfg, qp, stream, max_context=64, chunk_size=32, mesh=mesh) as eng:
                r = eng.prefill(toks)
                got[arm] = (r.logits_sha256(), r.kv_sha256(), np.asarray(r.logits))
                if stream is not None:
                    assert r.totals()["bytes"] == r.totals()["copied"] * cfg.expert_bytes > 0
        assert got["mesh"][:2] == got["mesh routed"][:2], name
        assert_close(got["mesh"][2], got["one"][2], cfg.dtype, err_msg=name)
        want, _ = reference_forward(cfg, {n: qp[n] for n in qp}, toks)
        assert_close(got["mesh"][2], want[-1], cfg.dtype, err_msg=name)
        report[name] = got["mesh"][:2] == got["one"][:2]
    print(json.dumps(report))
    """, devices=2)
    assert set(out) == {"fp8", "int4", "int4-zp-act"}


@pytest.mark.slow  # a child with 4 devices, 4 engines (the default run: test_two_devices_...)
def test_arms_on_a_mesh_are_identical_and_match_one_device():
    out = _child(_SETUP + """
    import itertools
    from strata_jax.engine import sha256_of
    res = {}
    # float32 on 2 devices (scores too), bfloat16 on 4.
    for dtype, meshes in (("float32", (None, 2)), ("bfloat16", (None, 4))):
        cfg = F32.replace(param_dtype=dtype)
        params = init_synthetic(cfg, seed=1, routing_skew=1.0)
        toks = np.random.default_rng(5).integers(0, cfg.vocab_size, 70)
        for mesh in meshes:
            with Engine(cfg, params, None, max_context=160, chunk_size=64, sub_chunk=32,
                        mesh=mesh) as eng:
                arms = dict(
                    chunked=eng.prefill(toks, chunk_size=32),
                    again=eng.prefill(toks, chunk_size=32),
                    unsynced=eng.prefill(toks, chunk_size=32, sync_chunks=False),
                    one_chunk=eng.prefill(toks[:64]),
                    layer_major=eng.prefill(toks, order="layer-major"))
                first = eng.prefill(toks[:40], chunk_size=32)
                arms["two_turns"] = eng.prefill(toks[40:], first.session, chunk_size=32)
                score = eng.score(toks, chunk_size=32) if dtype == "float32" else None
                res[dtype, mesh] = dict(
                    hashes={k: (r.logits_sha256(), r.kv_sha256()) for k, r in arms.items()},
                    logits=np.asarray(arms["chunked"].logits),
                    kv=[np.asarray(a) for a in arms["chunked"].session.valid_cache().keys],
                    scores=None if score is None else score.logprobs,
                    counts=arms["chunked"].counts,
                    one_chunk=np.asarray(arms["one_chunk"].logits),
                    rows=arms["chunked"].per_device()["rows"])
    report = {}
    for (dtype, mesh), r in res.items():
        base = res[dtype, None]
        # The same bits wherever the one-device engine gives the same bits.
        same = {(a, b): base["hashes"][a] == base["hashes"][b]
                for a, b in itertools.combinations(sorted(r["hashes"]), 2)}
        for (a, b), equal in same.items():
            if equal:
                assert r["hashes"][a] == r["hashes"][b], (dtype, mesh, a, b)
        assert r["hashes"]["chunked"] == r["hashes"]["again"] == r["hashes"]["unsynced"]
        if mesh is None:
            continue
        np.testing.assert_array_equal(r["counts"], base["counts"])
        assert_close(r["logits"], base["logits"], dtype, err_msg=f"{dtype} mesh {mesh}")
        assert_close(r["one_chunk"], base["one_chunk"], dtype, err_msg=f"{dtype} mesh {mesh}")
        for x, y in zip(r["kv"], base["kv"]):
            assert_close(x, y, dtype, err_msg=f"{dtype} mesh {mesh} keys")
        if r["scores"] is not None:
            assert_close(r["scores"], base["scores"], dtype, err_msg=f"{dtype} mesh {mesh} scores")
        assert sum(r["rows"]) == int(base["counts"].sum()) and len(r["rows"]) == mesh
        report[f"{dtype} {mesh}"] = dict(
            identical_pairs=sum(same.values()), pairs=len(same),
            logits_bits_equal=bool(np.array_equal(r["logits"], base["logits"])),
            max_diff=float(np.abs(r["logits"].astype(np.float64) - base["logits"]).max()))
    print(json.dumps(report))
    """, devices=4, timeout=600)
    # Both dtypes ran on both meshes, and some arms were the same bits on one device (so the
    # identity above was asserted, not skipped).
    assert sorted(out) == ["bfloat16 4", "float32 2"]
    assert all(v["identical_pairs"] >= 1 for v in out.values()), out


@pytest.mark.slow  # a child with 2 devices running the command line
def test_cli_prefill_on_two_devices():
    out = _child("""
    import contextlib, io, json
    from strata_jax.cli import main
    res = {}
    for devices in ("1", "2"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["prefill", "--preset", "qwen3-30b-a3b", "--scale", "tiny", "--tokens",
                         "100", "--no-stream", "--devices", devices, "--json", "-q"]) == 0
        res[devices] = json.loads(buf.getvalue())
    print(json.dumps(res))
    """, devices=2)
    one, two = out["1"], out["2"]
    assert (one["devices"], two["devices"]) == (1, 2)
    assert (one["read"], two["read"], two["arm"]) == (100, 100, "resident")
    # Token copies summed over the 2 MoE layers of 100 tokens, top-8.
    assert one["per_device"]["rows"] == [2 * 100 * 8]
    assert len(two["per_device"]["rows"]) == 2 and sum(two["per_device"]["rows"]) == 2 * 100 * 8


def test_only_the_moe_layers_routed_experts_are_split():
    # DeepSeek-V3's shape: a dense first layer (its MLP has gate/up/down too) and shared
    # experts (layers.N.mlp.shared.gate ...): both stay replicated; fp8 scales split with
    # their experts.
    from flax import nnx

    from strata_jax.models import abstract_model

    cfg = get_preset("deepseek-v3").scaled(n_layers=3, n_experts=16, top_k=2, hidden_size=64,
                                           expert_intermediate=32)
    for c in (cfg, cfg.replace(expert_format="fp8", expert_block=32)):
        _, state = nnx.split(abstract_model(c))
        shardings = parallel.state_shardings(state, c, parallel.expert_mesh(1))
        split = sorted(".".join(map(str, path)) for path, s in nnx.to_flat_state(shardings)
                       if s.spec == jax.sharding.PartitionSpec("expert"))
        planes = ["down", "gate", "up"] if c.expert_format == "plain" else [
            "down", "down_scale", "gate", "gate_scale", "up", "up_scale"]
        assert c.dense_layers == (0,)
        assert split == [f"layers.{l}.mlp.{p}" for l in c.moe_layers for p in planes]


@pytest.mark.gpu
def test_two_gpus_match_one_gpu_and_the_float64_reference():
    from strata_jax.reference import reference_forward
    from strata_jax.testing import assert_close

    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip(f"needs 2 GPUs, JAX sees {len(gpus)}")
    cfg = TINY.replace(param_dtype="bfloat16")
    params = init_synthetic(cfg, seed=1)
    toks = np.arange(40) * 7 % cfg.vocab_size
    with Engine(cfg, params, None, max_context=64, chunk_size=32, device=gpus[0]) as eng:
        one = eng.prefill(toks)
    with Engine(cfg, params, None, max_context=64, chunk_size=32,
                mesh=parallel.expert_mesh(gpus[:2])) as eng:
        two = eng.prefill(toks)
        again = eng.prefill(toks)
    want, counts = reference_forward(cfg, params, toks)
    np.testing.assert_array_equal(two.counts, counts)
    assert_close(two.logits, want[-1], cfg.dtype)
    assert_close(two.logits, one.logits, cfg.dtype)
    assert (two.logits_sha256(), two.kv_sha256()) == (again.logits_sha256(), again.kv_sha256())
