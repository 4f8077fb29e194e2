"""Several devices, one native engine each (issue 22): `StreamerGroup` on simulated CPU devices.

Device d of G holds the contiguous slice [E*d/G, E*(d+1)/G) of every MoE layer's experts, with
its own host store, ring, simulated link, issuer and route gate. Under `jax.shard_map` over an
"expert" mesh, one custom call runs once per device and must reach that device's engine (the
device ordinal of XLA's FFI call context): fetch gives each device exactly its own experts'
bytes, routed-only skips exactly each device's unrouted experts, the stats come per device
and summed, and a failure or a stop on one device ends every device's walk, leaving no thread
and a usable group.

Simulated devices need XLA's host device count before JAX starts its backend, so the sharded
checks run in a child process (this file run as a script: `python
tests/test_multi_device_stream.py <scenario>`), leaving the rest of the suite on one device.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

N_DEVICES = 2


def _child(scenario: str, backend: str = "cpu",
           timeout: float = 300) -> subprocess.CompletedProcess:
    # The parent may hold most of a GPU's memory (XLA preallocates): the child takes what
    # it needs.
    env = {**os.environ, "STRATA_TRACE": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), scenario, backend],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0 and f"ok {scenario}" in proc.stdout, (
        f"child {scenario} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n"
        f"{proc.stderr[-6000:]}")
    return proc


@pytest.mark.slow
def test_each_device_reaches_its_own_engine_on_a_mesh():
    # Fetch, skips, stats per device and summed, trace lines, a program on a device the group
    # lacks, and one failure (each device's own cause) that ends both walks.
    proc = _child("basic")
    # Each device's trace line names its device; the group's summed line follows both.
    err = proc.stderr
    for d in range(N_DEVICES):
        assert f"cpu simulated link, device {d}): ring entries" in err, err[-3000:]
    assert f"{N_DEVICES} devices summed: ring entries" in err, err[-3000:]


@pytest.mark.gpu
def test_each_gpu_reaches_its_own_engine_on_a_mesh():
    # The same checks with the CUDA backend, one engine per GPU (the first two GPUs).
    import jax

    if len(jax.devices("gpu")) < N_DEVICES:
        pytest.skip(f"needs {N_DEVICES} GPUs")
    proc = _child("basic", "cuda")
    for d in range(N_DEVICES):
        assert f"cuda device {d}, " in proc.stderr, proc.stderr[-3000:]
    assert f"{N_DEVICES} devices summed: ring entries" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_failures_and_stops_on_one_device_end_every_walk():
    _child("failures")


def test_bad_groups_are_refused_with_the_way_out():
    from strata_jax.models import get_preset
    from strata_jax.stream import StreamConfig, StreamerGroup, expert_slices
    from strata_jax.stream.group import group_devices

    assert expert_slices(16, 4) == ((0, 4), (4, 8), (8, 12), (12, 16))
    with pytest.raises(ValueError, match=r"16 experts per layer do not split evenly over 3 "
                                         r"devices.*\(1, 2, 4, 8, 16\)"):
        expert_slices(16, 3)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="expected a positive int"):
            expert_slices(16, bad)
    import jax

    n = len(jax.devices("cpu"))
    with pytest.raises(ValueError, match=rf"devices={n + 3}, but JAX has {n} cpu device.*"
                                         rf"xla_force_host_platform_device_count={n + 3}"):
        group_devices(n + 3, "cpu")
    d0 = jax.devices("cpu")[0]
    with pytest.raises(ValueError, match="given twice"):
        group_devices([d0, d0], "cpu")
    with pytest.raises(ValueError, match="not a jax.Device"):
        group_devices(["cpu:0"], "cpu")
    with pytest.raises(ValueError, match="at least one device"):
        group_devices([], "cpu")
    cfg = get_preset("qwen3-30b-a3b").scaled(n_layers=2, n_experts=6, top_k=2, hidden_size=32,
                                             expert_intermediate=16)
    # The split is checked first: no engine is made for an uneven one.
    with pytest.raises(ValueError, match="6 experts per layer do not split evenly over 4"):
        StreamerGroup(cfg, [None] * cfg.n_layers, StreamConfig(backend="cpu"), devices=4)


def test_an_engine_over_an_expert_range_refuses_a_bad_range():
    from strata_jax.models import get_preset
    from strata_jax.stream import NativeStreamer, StreamConfig

    cfg = get_preset("qwen3-30b-a3b").scaled(n_layers=2, n_experts=8, top_k=2, hidden_size=32,
                                             expert_intermediate=16)
    for rng in ((4, 4), (6, 9), (-1, 2), "ab", (1,)):
        with pytest.raises(ValueError, match="expert_range"):
            NativeStreamer(cfg, [None] * cfg.n_layers, StreamConfig(backend="cpu"),
                           expert_range=rng)


def test_an_engine_over_an_expert_range_holds_and_plans_its_slice():
    # One device's engine of a group, on the one CPU device: its store holds exactly its slice
    # of every layer, in every form the experts come in; its plan is the slice's (residents per
    # device, the stream hottest first by the profile's columns of the slice).
    import dataclasses

    import numpy as np

    from strata_jax.models import get_preset
    from strata_jax.formats import ExpertFormat
    from strata_jax.profile import ExpertProfile
    from strata_jax.stream import NativeStreamer, StreamConfig, StreamTuning, plan_stream
    from strata_jax.stream.plan import local_config
    from strata_jax.synthetic import init_synthetic, split_experts

    cfg = get_preset("qwen3-30b-a3b").scaled(n_layers=2, n_experts=8, top_k=2, hidden_size=32,
                                             expert_intermediate=16, param_dtype="bfloat16")
    _, experts = split_experts(cfg, init_synthetic(cfg, seed=1))
    fmt = ExpertFormat.of(cfg)
    counts = np.random.default_rng(2).integers(0, 100, (cfg.n_layers, cfg.n_experts))
    prof = ExpertProfile(counts, model=cfg.name, top_k=cfg.top_k)
    sc = StreamConfig(backend="cpu", resident_per_layer=1, profile=prof,
                      tuning=StreamTuning(sim_bandwidth=0, sim_latency=0))
    lo, hi = 4, 8
    blobs = {l: np.ascontiguousarray(fmt.pack_np(experts[l]._asdict())).view(np.uint8)
             for l in cfg.moe_layers}
    forms = {
        "ExpertWeights": [experts.get(l) for l in range(cfg.n_layers)],
        "blobs": [blobs.get(l) for l in range(cfg.n_layers)],
        "planes": [experts[l]._asdict() if l in experts else None
                   for l in range(cfg.n_layers)],
    }
    for form, given in forms.items():
        with NativeStreamer(cfg, given, sc, expert_range=(lo, hi)) as eng:
            assert eng.config.n_experts == hi - lo and eng.full_config is cfg, form
            for l in cfg.moe_layers:
                assert np.array_equal(eng._stores[l], blobs[l][lo:hi]), (form, l)
                # The stream and the residents: the slice's own, hottest first.
                order = sorted(range(hi - lo), key=lambda e: (-counts[l, lo + e], e))
                assert eng.resident[l] == [order[0]], (form, l)
                assert [e for ll, e in eng.stream_list if ll == l] == order[1:], (form, l)
            want = plan_stream(local_config(cfg, lo, hi),
                               dataclasses.replace(sc, profile=counts[:, lo:hi]))
            assert eng.plan == want
            assert eng.ring == 2 * (hi - lo)


# -- the child process ------------------------------------------------------------------------


def _main(scenario: str, backend: str) -> None:
    import jax

    platform = "gpu" if backend == "cuda" else "cpu"
    if platform == "cpu":
        jax.config.update("jax_num_cpu_devices", N_DEVICES)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from strata_jax import stream as S
    from strata_jax.models import get_preset
    from strata_jax.stream.backend import device_ordinal
    from strata_jax.synthetic import init_synthetic, split_experts

    devices = jax.devices(platform)[:N_DEVICES]
    assert len(devices) == N_DEVICES, jax.devices()
    cfg = get_preset("qwen3-30b-a3b").scaled(n_layers=3, n_experts=16, top_k=2, hidden_size=64,
                                             expert_intermediate=32, param_dtype="bfloat16")
    _, experts = split_experts(cfg, init_synthetic(cfg, seed=3))
    per_layer = [experts.get(l) for l in range(cfg.n_layers)]
    layers = list(cfg.moe_layers)
    mesh = Mesh(np.array(devices), ("expert",))
    E, L = cfg.n_experts, cfg.n_layers

    from strata_jax.testing import library_threads as threads, settled

    def group(routed=True, resident=2, trace=False, **tuning):
        tuning = {"sim_bandwidth": 0, "sim_latency": 0, **tuning}
        return S.StreamerGroup(cfg, per_layer,
                               S.StreamConfig(routed=routed, resident_per_layer=resident,
                                              trace=trace, backend=backend,
                                              tuning=S.StreamTuning(**tuning)),
                               devices=devices)

    def program(g, mode):
        """One chunk by hand on every device: begin, then per MoE layer publish (the device's
        own experts' counts), fetch, release; end. Returns (stats [G*L, 2], planes per layer,
        whole [E, ...] across the devices)."""
        El = g.n_local_experts

        def body(res, counts):
            tok, _ = S.begin(g.id, mode, jnp.zeros((), jnp.int32))
            planes = []
            for i, l in enumerate(layers):
                tok = S.publish(g.id, l, tok, counts[i])
                w, tok = S.fetch(g.id, l, tok, res[l], El, g.format)
                planes.append(w)
                tok = S.release(g.id, l, tok, w["gate"].sum())
            return S.end(g.id, tok, L), planes

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("expert"), P(None, "expert")),
                                  out_specs=P("expert")))
        res = g.sharded_resident_blobs(mesh)
        return lambda counts: f(res, jnp.asarray(counts, jnp.int32))

    def counts_with_idle(seed):
        c = np.random.default_rng(seed).integers(1, 4, (len(layers), E)).astype(np.int32)
        c[np.random.default_rng(seed + 1).random(c.shape) < 0.4] = 0
        return c

    def check_chunk(g, run, counts, mode):
        stats, planes = run(counts)
        stats = np.asarray(stats).reshape(N_DEVICES, L, 2)
        resident = np.zeros((L, E), bool)
        for d, (lo, _) in enumerate(g.slices):
            for l in layers:
                resident[l, [lo + e for e in g[d].resident[l]]] = True
        for i, l in enumerate(layers):
            for plane in ("gate", "up", "down"):
                got = np.asarray(planes[i][plane]).view(np.uint16)  # [E, ...] over the devices
                want = np.asarray(getattr(experts[l], plane)).view(np.uint16)
                keep = (counts[i] > 0) | resident[l]  # what any token reads, or a resident
                assert np.array_equal(got[keep], want[keep]), (mode, l, plane)
                if mode == 1:  # routed-only: every unrouted streamed row is zeroed
                    assert not got[~keep].any(), (l, plane)
        st = g.make_stats(32, stats, counts)
        for d, (lo, hi) in enumerate(g.slices):
            ds = st.devices[d]
            idle = counts[:, lo:hi] == 0
            streamed = g[d].streamed_mask[layers]
            assert np.array_equal(ds.streamed[layers], streamed.sum(1))
            assert np.array_equal(ds.unrouted[layers], (idle & streamed).sum(1))
            assert np.array_equal(ds.copied + ds.skipped, ds.streamed), d
            if mode == 1:  # routed-only: exactly this device's unrouted experts
                assert np.array_equal(ds.skipped, ds.unrouted), (d, ds)
            elif not g.stream.routed:
                assert not ds.skipped.any()
            assert (ds.skipped <= ds.unrouted).all()
        for f in ("streamed", "copied", "skipped", "unrouted", "bytes"):
            assert np.array_equal(getattr(st.summed, f),
                                  sum(getattr(s, f) for s in st.devices)), f
        assert st.totals()["streamed"] == sum(len(s.stream_list) for s in g.streamers)
        return st

    base = threads()
    if scenario == "failures" and backend != "cpu":
        raise SystemExit("the failures scenario times the simulated link: cpu only")
    if scenario == "basic":
        with group(routed=True, trace=True) as g:
            assert g.slices == ((0, 8), (8, 16)) and len(set(g.ordinals)) == N_DEVICES
            g.check_mesh(mesh)
            # Each device keeps its own slice's lowest ids resident, as local ids.
            assert all(g[d].resident[l] == [0, 1] for d in range(2) for l in layers)
            for mode in (1, 2, 0):  # routed-only, packed stream, frames stream
                run = program(g, mode)
                for seed in (0, 1):
                    check_chunk(g, run, counts_with_idle(seed + 10 * mode), mode)
                assert not g.walk_active() and g.last_errors() == ("", "")
            # A chunk begun from the host on every device (prestart), adopted by each
            # device's begin_chunk.
            run = program(g, 2)
            for m in g.streamers:
                m.handle.prestart(2)
            assert g.hold() > 0
            check_chunk(g, run, counts_with_idle(7), 2)
            assert g.hold() == 0 and not g.walk_active()
            # Staged ids: each device's begin_chunk writes the next ones staged with it.
            ids = np.arange(-3, 9, dtype=np.int32)

            def take(token):
                tok, got = S.begin(g.id, 1, token, 4)
                return S.end(g.id, tok, L), got

            take = jax.jit(jax.shard_map(take, mesh=mesh, in_specs=P(), out_specs=P("expert")))
            g.stage_ids(ids)
            for i in range(3):
                got = np.asarray(take(jnp.zeros((), jnp.int32))[1]).reshape(N_DEVICES, 4)
                assert (got == ids[4 * i:4 * i + 4]).all(), (i, got)
            g.clear_ids()
            steady = threads()  # each engine's parked issuer and its link's worker
            assert steady > base
            # A failure on device 1: both devices' chunks end in error, each with its own
            # cause; no walk or extra thread is left and the next chunk is whole.
            run = program(g, 2)
            g.inject_fault(1, layers[1], "error")
            try:
                run(counts_with_idle(5))[0].block_until_ready()
                raise AssertionError("the injected fault did not fail the chunk")
            except Exception as e:  # noqa: BLE001 - XLA's error type
                assert "injected fault" in str(e) or "the walk was stopped" in str(e), e
            errors = g.last_errors()
            assert f"device 1: fetch, layer {layers[1]}: injected fault" in errors[1], errors
            assert not g.walk_active() and settled(threads, steady) == steady
            check_chunk(g, run, counts_with_idle(6), 2)
            assert g.last_errors() == ("", "")
            # A failure reaches a device that has not begun the chunk yet: device 0 runs
            # the chunk alone and fails; device 1's chunk, run after, fails at its first
            # fetch, naming device 0's cause. Then both serve chunks again.
            El = g.n_local_experts

            def alone(res, counts):
                tok, _ = S.begin(g.id, 2, jnp.zeros((), jnp.int32))
                for i, l in enumerate(layers):
                    tok = S.publish(g.id, l, tok, counts[i])
                    w, tok = S.fetch(g.id, l, tok, res[l], El, g.format)
                    tok = S.release(g.id, l, tok, w["gate"].sum())
                return S.end(g.id, tok, L)

            alone = jax.jit(alone)
            counts = counts_with_idle(8)
            g.inject_fault(0, layers[1], "error")
            for d, want in ((0, f"device 0: fetch, layer {layers[1]}: injected fault"),
                            (1, f"device 1: fetch, layer {layers[0]}: the walk was stopped: "
                                f"device 0: fetch, layer {layers[1]}: injected fault")):
                dev = devices[d]
                lo, hi = g.slices[d]
                try:
                    alone(g[d].resident_blobs,
                          jax.device_put(counts[:, lo:hi], dev)).block_until_ready()
                    raise AssertionError(f"device {d}'s chunk ran")
                except Exception as e:  # noqa: BLE001
                    assert want in str(e), (d, e)
                assert g.last_errors()[d] == want, g.last_errors()
            check_chunk(g, run, counts_with_idle(9), 2)
        assert settled(threads, base) == base
        # A group's calls reach only its devices: a program on another device is refused.
        with S.StreamerGroup(cfg, per_layer, S.StreamConfig(backend=backend, routed=True),
                             devices=[devices[1]]) as g1:
            def on_device_0(token):
                tok, _ = S.begin(g1.id, 1, token)
                return S.end(g1.id, tok, L)
            token = jax.device_put(np.zeros((), np.int32), devices[0])
            try:
                jax.jit(on_device_0)(token).block_until_ready()
                raise AssertionError("a call on a device outside the group ran")
            except Exception as e:  # noqa: BLE001
                want = (f"has no engine on device ordinal {device_ordinal(devices[0])} (its "
                        f"devices: {g1.ordinals[0]})")
                assert want in str(e), e
    elif scenario == "failures":
        # A slow link (each copy ~20 ms): a chunk's walk takes ~0.5 s per device unless
        # stopped. A failure, or a stop, at one device's second layer stops the other's walk
        # mid-chunk: both chunks end early, each device naming its cause.
        slow = dict(sim_bandwidth=0, sim_latency=20e-3)
        with group(routed=False, resident=0, layout="packed", stream_floor=1, **slow) as g:
            run = program(g, 2)
            counts = counts_with_idle(3)
            check_chunk(g, run, counts, 2)  # compiles
            t = time.perf_counter()
            check_chunk(g, run, counts, 2)
            whole = time.perf_counter() - t
            steady = threads()
            for kind, where in (("error", "injected fault"), ("stop", "the walk was stopped")):
                for d in range(N_DEVICES):
                    g.inject_fault(d, layers[1], kind)
                    t = time.perf_counter()
                    try:
                        run(counts)[0].block_until_ready()
                        raise AssertionError(f"{kind} on device {d} did not fail the chunk")
                    except Exception as e:  # noqa: BLE001
                        assert f"device {d}: fetch, layer {layers[1]}: {where}" in str(e) \
                            or f"the walk was stopped: device {d}: " in str(e), e
                    took = time.perf_counter() - t
                    print(f"{kind} on device {d}: {took:.3f} s against {whole:.3f} s")
                    errors = g.last_errors()
                    other = 1 - d
                    assert f"device {d}: fetch, layer {layers[1]}: {where}" in errors[d], errors
                    # The other device's walk was stopped by this one's failure, mid-chunk.
                    assert errors[other].startswith(f"device {other}: fetch, layer "), errors
                    assert (f"the walk was stopped: device {d}: fetch, layer {layers[1]}: "
                            f"{where}" in errors[other]), errors
                    assert took < 0.75 * whole, (kind, d, took, whole)
                    assert not g.walk_active() and settled(threads, steady) == steady
                    check_chunk(g, run, counts, 2)
            # A cancel (a prefill that raised in the caller) fails every device's queued chunk
            # until it is lifted; then the group serves chunks again.
            g.cancel()
            try:
                run(counts)[0].block_until_ready()
                raise AssertionError("a cancelled group ran a chunk")
            except Exception as e:  # noqa: BLE001
                assert "cancelled" in str(e), e
            g.abort()
            g.cancel(False)
            check_chunk(g, run, counts, 2)
        assert settled(threads, base) == base
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    print(f"ok {scenario}")


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu")
