"""Streamed experts on a mesh (issue 22): `Engine(cfg, params, StreamConfig(...), mesh=...)`.

One native engine per device (`StreamerGroup`), each chunk's program under `shard_map` over the
expert axis: each device's StreamedExperts begins the chunk, publishes its own experts' counts,
fetches its slice's planes and ends the chunk on its own engine; each MoE layer's partial
outputs are summed across the devices. Within one mesh, resident, stream-all and routed give
the same bits (logits, KV) in one chunk, in several and on a follow-up turn, in every layout;
against the one-device engine they agree within the tolerance table. A failure or a stop on
one device ends every device's walk, names the device, leaves no thread and a usable engine.

Simulated CPU devices need XLA's device count before JAX starts, so the checks run in a child
process (this file run as a script: `python tests/test_mesh_stream.py <scenario>`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

N_DEVICES = 2


def _child(scenario: str, backend: str = "cpu", timeout: float = 600,
           devices: int = N_DEVICES) -> dict:
    env = {**os.environ, "STRATA_TRACE": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), scenario, backend,
                           str(devices)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0 and f"ok {scenario}" in proc.stdout, (
        f"child {scenario} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n"
        f"{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-2])


@pytest.mark.slow
def test_streamed_mesh_matches_resident_and_survives_a_device_failure():
    # The default run's check: resident, stream-all and routed on 2 devices give the same bits
    # (two chunks, a follow-up turn), per-device stats sum to the chunk's, and an injected
    # failure on device 1 ends the prefill naming it, with the engine usable afterwards.
    out = _child("basic")
    assert out["arms"] == ["resident", "routed"]


@pytest.mark.slow  # four layouts and orders, float32 and bfloat16, one device and two
def test_streamed_mesh_layouts_orders_and_one_device():
    out = _child("full")
    assert out["checked"] >= 6, out


@pytest.mark.slow  # the command line on 2 devices: resident, routed and stream-all
def test_cli_streams_on_two_devices():
    out = _child("cli")
    assert out["arms"] == ["--no-stream", "--routed off", "--routed on"]


@pytest.mark.gpu
def test_streamed_mesh_on_two_gpus_matches_resident():
    import jax

    if len(jax.devices("gpu")) < N_DEVICES:
        pytest.skip(f"needs {N_DEVICES} GPUs")
    out = _child("full", "cuda")
    assert out["checked"] >= 6, out


@pytest.mark.gpu
def test_streamed_mesh_of_one_gpu_matches_resident():
    # The group path on CUDA with the one GPU a machine may have: the custom calls under
    # shard_map reach the group's engine by the device ordinal XLA gives them; resident,
    # stream-all (packed, frames, the tail in pieces) and routed give the same bits, chunked,
    # in one chunk and over two turns; a stop ends the prefill and the engine reads on.
    out = _child("light", "cuda", devices=1)
    assert out["checked"] >= 4, out


def test_plan_stream_per_device_is_each_engines_plan():
    # plan_stream(devices=G, device=d) is the plan of device d's engine of a group: its slice in
    # its own ids, the profile's columns of the slice, the budgets its own.
    import numpy as np

    from strata_jax.models import get_preset
    from strata_jax.profile import ExpertProfile
    from strata_jax.stream import NativeStreamer, StreamConfig, StreamTuning, plan_stream

    cfg = get_preset("qwen3-30b-a3b").scaled(n_layers=2, n_experts=8, top_k=2, hidden_size=32,
                                             expert_intermediate=16)
    counts = np.random.default_rng(3).integers(0, 50, (cfg.n_layers, cfg.n_experts))
    sc = StreamConfig(backend="cpu", resident_per_layer=1,
                      profile=ExpertProfile(counts, model=cfg.name, top_k=cfg.top_k),
                      tuning=StreamTuning(sim_bandwidth=0, sim_latency=0))
    for d, rng in enumerate(((0, 4), (4, 8))):
        plan = plan_stream(cfg, sc, devices=2, device=d)
        blobs = [np.zeros((cfg.n_experts, _blob(cfg)), np.uint8) if l in cfg.moe_layers
                 else None for l in range(cfg.n_layers)]
        with NativeStreamer(cfg, blobs, sc, expert_range=rng) as eng:
            assert eng.plan == plan, d
        lo = rng[0]
        for l in cfg.moe_layers:  # the slice's hottest expert, in local ids
            assert plan.resident[l] == (int(np.argmax(counts[l, lo:lo + 4])),), (d, l)
        assert plan.ring == 2 * 4
    assert plan_stream(cfg, sc, devices=1) == plan_stream(cfg, sc)
    with pytest.raises(ValueError, match="device=2: expected 0..1"):
        plan_stream(cfg, sc, devices=2, device=2)
    with pytest.raises(ValueError, match="8 experts per layer do not split evenly over 3"):
        plan_stream(cfg, sc, devices=3)
    with pytest.raises(ValueError, match="resident_per_layer"):
        plan_stream(cfg, StreamConfig(resident_per_layer=5), devices=2)


def _blob(cfg) -> int:
    from strata_jax.formats import ExpertFormat

    return ExpertFormat.of(cfg).blob_bytes


# -- the child process ------------------------------------------------------------------------


def _threads() -> int:
    from strata_jax.testing import library_threads

    return library_threads()


def _settled(expected: int) -> int:
    """The library's threads once they number `expected` (a joined thread may stay listed
    in /proc for a moment), else their count after two seconds."""
    from strata_jax.testing import library_threads_settled

    return library_threads_settled(expected)


def _main(scenario: str, backend: str) -> None:
    import jax

    platform = "gpu" if backend == "cuda" else "cpu"
    if platform == "cpu":
        jax.config.update("jax_num_cpu_devices", N_DEVICES)
    import numpy as np

    from strata_jax import parallel
    from strata_jax.models import get_preset
    from strata_jax.engine import Engine
    from strata_jax.kernels.grouped import resolve_implementation
    from strata_jax.stream import StreamConfig, StreamTuning
    from strata_jax.synthetic import init_synthetic
    from strata_jax.testing import assert_close

    no_threads = _threads()

    devices = jax.devices(platform)[:N_DEVICES]
    assert len(devices) == N_DEVICES, jax.devices()
    mesh = parallel.expert_mesh(devices)
    base = get_preset("qwen3-30b-a3b").scaled(n_layers=2, n_experts=16, top_k=2, hidden_size=32,
                                              expert_intermediate=16, param_dtype="bfloat16")

    def stream(routed: bool, **tuning) -> StreamConfig:
        sim = {"sim_bandwidth": 0, "sim_latency": 0} if backend == "cpu" else {}
        return StreamConfig(backend=backend, routed=routed, resident_per_layer=1,
                            tuning=StreamTuning(**{**sim, **tuning}))

    def run(eng, toks) -> dict:
        """Hashes of the arms: two chunks (also unsynced: each chunk dispatched while the one
        before runs), one chunk, two turns."""
        chunked = eng.prefill(toks, chunk_size=32)
        unsynced = eng.prefill(toks, chunk_size=32, sync_chunks=False)
        assert (unsynced.logits_sha256(), unsynced.kv_sha256()) == \
            (chunked.logits_sha256(), chunked.kv_sha256())
        one = eng.prefill(toks[:32])
        first = eng.prefill(toks[:20], chunk_size=16)
        second = eng.prefill(toks[20:], first.session, chunk_size=16)
        return {"chunked": (chunked.logits_sha256(), chunked.kv_sha256()),
                "one_chunk": (one.logits_sha256(), one.kv_sha256()),
                "two_turns": (second.logits_sha256(), second.kv_sha256()),
                "result": chunked}

    def check_stats(eng, r) -> None:
        g = eng.streamer
        for c in r.chunks:
            st = c.stats
            assert len(st.devices) == N_DEVICES
            for f in ("streamed", "copied", "skipped", "unrouted", "bytes"):
                assert np.array_equal(getattr(st, f), sum(getattr(d, f) for d in st.devices)), f
            for d, (lo, hi) in enumerate(g.slices):
                ds = st.devices[d]
                assert np.array_equal(ds.copied + ds.skipped, ds.streamed), d
                assert (ds.skipped <= ds.unrouted).all(), d
            assert c.to_dict()["per_device"] == st.device_totals()
        per = r.per_device()
        assert len(per["rows"]) == N_DEVICES and len(per["streamed"]) == N_DEVICES
        assert sum(d["copied"] for d in per["streamed"]) == r.totals()["copied"]

    report: dict = {}
    if scenario == "basic":
        params = init_synthetic(base, seed=1, routing_skew=1.0)
        toks = np.random.default_rng(5).integers(0, base.vocab_size, 8)
        hashes = {}
        steady = None
        # Kept short for the default run: one program per engine (one chunk, routed-only:
        # each device skips exactly its own unrouted experts). The slow scenario "full" runs
        # every arm, layout and order, in several chunks and turns.
        for arm, sc in (("resident", None), ("routed", stream(True, stream_floor=64))):
            with Engine(base, params, sc, max_context=64, chunk_size=32, mesh=mesh) as eng:
                assert eng.mode == arm and eng.n_devices == N_DEVICES
                r = eng.prefill(toks)
                hashes[arm] = {"chunked": (r.logits_sha256(), r.kv_sha256())}
                assert r.devices == N_DEVICES
                if sc is None:
                    continue
                check_stats(eng, r)
                st = r.chunks[0].stats
                assert st.mode == "routed-only" and (st.skipped == st.unrouted).all(), st
                assert st.unrouted.sum() > 0, st  # the skips were checked, not vacuous
                if arm == "routed":
                    # A failure on device 1 mid-prefill: every device's walk ends, the error
                    # names the device, no thread is left and the engine reads on.
                    steady = _threads()
                    layer = base.moe_layers[1]
                    eng.streamer.inject_fault(1, layer, "error")
                    try:
                        eng.prefill(toks)
                        raise AssertionError("the injected fault did not fail the prefill")
                    except Exception as e:  # noqa: BLE001 - XLA's error type
                        assert "device 1" in str(e), e
                    errors = eng.streamer.last_errors()
                    assert f"device 1: fetch, layer {layer}: injected fault" in errors[1], errors
                    assert not eng.streamer.walk_active() and _settled(steady) == steady
                    again = eng.prefill(toks)
                    assert (again.logits_sha256(), again.kv_sha256()) == hashes[arm]["chunked"]
        assert _settled(no_threads) == no_threads
        assert hashes["routed"] == hashes["resident"], hashes
        report["arms"] = sorted(hashes)
    elif scenario in ("full", "light"):
        light = scenario == "light"  # bfloat16, four arms, no layer-major or scores
        checked = 0
        for dtype in ("bfloat16",) if light else ("bfloat16", "float32"):
            cfg = base.replace(param_dtype=dtype)
            params = init_synthetic(cfg, seed=2, routing_skew=1.0)
            toks = np.random.default_rng(6).integers(0, cfg.vocab_size, 40)
            with Engine(cfg, params, None, max_context=64, chunk_size=32) as eng:
                one = eng.prefill(toks, chunk_size=32)
            arms = {"resident": None}
            for layout in ("packed", "frames"):
                arms[f"stream-all {layout}"] = stream(False, layout=layout, stream_floor=1)
                arms[f"routed {layout}"] = stream(True, layout=layout, stream_floor=1)
            # The last MoE layer in 2 row pieces on each device.
            arms["stream-all tail"] = stream(False, layout="packed", stream_floor=1,
                                             tail_pieces=2, tail_from=16)
            arms["routed-only"] = stream(True, stream_floor=64)
            if light:
                arms = {k: arms[k] for k in ("resident", "routed packed", "stream-all frames",
                                             "stream-all tail")}
            hashes, lm, scores = {}, {}, {}
            for arm, sc in arms.items():
                with Engine(cfg, params, sc, max_context=64, chunk_size=32, mesh=mesh) as eng:
                    got = run(eng, toks)
                    r = got.pop("result")
                    hashes[arm] = got
                    if not light:
                        lmr = eng.prefill(toks, order="layer-major")
                        lm[arm] = (lmr.logits_sha256(), lmr.kv_sha256())
                    if arm in ("resident", "routed packed", "stream-all tail") and not light:
                        s = eng.score(toks, chunk_size=32)
                        scores[arm] = (s.logprobs_sha256(), s.top1.tobytes(), s.top1_hits)
                    if sc is not None:
                        check_stats(eng, r)
                        if "tail" in arm and resolve_implementation(
                                eng.kernels.grouped_matmul) != "mosaic":
                            # (Mosaic takes no more pieces than a chunk's row tiles allow.)
                            assert r.chunks[0].stats.tail_pieces == 2, r.chunks[0].stats
                        if arm.startswith("routed"):
                            assert all(c.stats.skipped.sum() == c.stats.unrouted.sum()
                                       for c in r.chunks if c.stats.mode == "routed-only")
                    else:
                        np.testing.assert_array_equal(r.counts, one.counts)
                        assert_close(r.logits, one.logits, dtype, err_msg=f"{dtype} mesh")
                        kv1 = one.session.valid_cache()
                        for x, y in zip(r.session.valid_cache().keys, kv1.keys):
                            assert_close(x, y, dtype, err_msg=f"{dtype} keys")
                checked += 1
            for arm in arms:
                assert hashes[arm] == hashes["resident"], (dtype, arm)
                assert lm.get(arm) == lm.get("resident"), (dtype, arm)
            assert len(set(scores.values())) <= 1, (dtype, scores)
        # A stop on device 0 ends the prefill too; then the engine reads on.
        with Engine(base, init_synthetic(base, seed=1), stream(False),
                    max_context=64, chunk_size=32, mesh=mesh) as eng:
            good = eng.prefill(toks[:30])
            eng.streamer.inject_fault(0, base.moe_layers[0], "stop")
            try:
                eng.prefill(toks[:30])
                raise AssertionError("the injected stop did not fail the prefill")
            except Exception as e:  # noqa: BLE001
                assert "device 0" in str(e), e
            assert eng.prefill(toks[:30]).logits_sha256() == good.logits_sha256()
        assert _settled(no_threads) == no_threads
        report["checked"] = checked
    elif scenario == "cli":
        import contextlib
        import io

        from strata_jax.cli import main

        res = {}
        streamed = ["--resident-per-layer", "2", "--sim-bandwidth", "0", "--sim-latency", "0"]
        for extra in (["--no-stream"], ["--routed", "on", *streamed],
                      ["--routed", "off", *streamed]):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert main(["prefill", "--preset", "qwen3-30b-a3b", "--scale", "tiny",
                             "--tokens", "100", "--devices", str(N_DEVICES), "--backend",
                             backend, "--json", "-q", *extra]) == 0
            res[" ".join(extra[:2])] = json.loads(buf.getvalue())
        for k, r in res.items():
            assert r["devices"] == N_DEVICES and r["read"] == 100, (k, r)
        hashes = {k: (r["logits_sha256"], r["kv_sha256"]) for k, r in res.items()}
        assert len(set(hashes.values())) == 1, hashes
        per = res["--routed on"]["per_device"]
        assert len(per["streamed"]) == N_DEVICES
        assert sum(d["copied"] for d in per["streamed"]) == res["--routed on"]["copied"]
        report["arms"] = sorted(res)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    print(json.dumps(report))
    print(f"ok {scenario}")


if __name__ == "__main__":
    if len(sys.argv) > 3:
        N_DEVICES = int(sys.argv[3])
    _main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu")
