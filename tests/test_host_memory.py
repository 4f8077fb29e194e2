"""Issue 20, host memory: a model's experts are held once, in the engine's host store (or on the
device), never also in a weights dict; the lazy weights give the old eager path's bits.

The peak tests run in a subprocess each (a fresh process's peak resident memory, VmHWM, reset
after a warm-up): `python tests/test_host_memory.py CASE DIR` prints its figures as JSON.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from strata_jax.models import get_preset
from strata_jax.experts import ExpertWeights, pack_expert_blobs_np, unpack_expert_blobs_np
from strata_jax.models import expert_param_names
from strata_jax.synthetic import SyntheticParams, init_synthetic
from strata_jax.testing import hf_tensors, write_hf_checkpoint
from strata_jax.weights import LazyExperts, ParamsView

TINY = get_preset("qwen3-30b-a3b").scaled(n_experts=8, top_k=2)
ARCH = ("Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj"))


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).tobytes()


# ---- the lazy weights are the eager ones ---------------------------------------------------------


@pytest.mark.parametrize("preset,dtype", [("qwen3-30b-a3b", None), ("deepseek-v3", None),
                                          ("olmoe-1b-7b", "float32")])
def test_synthetic_params_are_init_synthetic(preset, dtype):
    """Every tensor of SyntheticParams has init_synthetic's bits: asked for in order, in
    reverse (drawing the ones before it), again, or filled into a host store's strided view."""
    c = get_preset(preset).scaled(**({"param_dtype": dtype} if dtype else {}))
    want = init_synthetic(c, 7, 0.4)
    lazy = SyntheticParams(c, 7, 0.4)
    assert list(lazy) == list(want) and len(lazy) == len(want)
    assert "layers.1.mlp.gate" in lazy and "nope" not in lazy
    for name in reversed(list(want)):
        assert lazy[name].dtype == want[name].dtype and _bits(lazy[name]) == _bits(want[name]), name
    layer = c.moe_layers[-1]
    names = expert_param_names(c, layer)
    again = SyntheticParams(c, 7, 0.4)  # a fresh one, filled layer by layer as a store is
    store = np.zeros((c.n_experts, 3 * c.hidden_size * c.expert_intermediate), c.dtype)
    for l in c.moe_layers:
        LazyExperts(again, expert_param_names(c, l)).fill(
            unpack_expert_blobs_np(store, c.hidden_size, c.expert_intermediate))
    old = pack_expert_blobs_np(ExpertWeights(*(want[n] for n in names)))  # the old packing
    assert _bits(store) == _bits(old)
    assert _bits(lazy[names.down]) == _bits(want[names.down])  # drawn again, same bits


def test_tiled_synthetic_params():
    c = get_preset("qwen3-30b-a3b").scaled(n_experts=16)
    a, b = SyntheticParams(c, 3, tile=4), SyntheticParams(c, 3, tile=4)
    gate = a["layers.0.mlp.gate"]
    assert _bits(gate) == _bits(b["layers.0.mlp.gate"])  # deterministic
    assert np.isfinite(gate.astype(np.float32)).all()
    assert all(_bits(gate[e]) == _bits(gate[e % 4]) for e in range(16))
    assert len({_bits(gate[e]) for e in range(4)}) == 4
    assert _bits(a["layers.1.mlp.gate"]) != _bits(gate)
    ref = init_synthetic(c, 3)["layers.0.mlp.gate"].astype(np.float32)
    assert abs(float(gate.astype(np.float32).std()) / float(ref.std()) - 1) < 0.05  # same law
    with pytest.raises(ValueError, match="tile=0"):
        SyntheticParams(c, tile=0)


def test_params_view_and_lazy_experts_make_nothing_up_front():
    made = []

    class Counting(dict):
        def __getitem__(self, name):
            made.append(name)
            return dict.__getitem__(self, name)

    params = Counting(a=np.zeros(2), b=np.ones(3), g=np.zeros((2, 3, 4)), u=np.ones((2, 3, 4)),
                      d=np.ones((2, 4, 3)))
    view = ParamsView(params, {"g", "u", "d"})
    taken = []
    lazy = LazyExperts(params, ExpertWeights("g", "u", "d"), on_taken=lambda: taken.append(1))
    assert made == [] and list(view) == ["a", "b"] and "g" not in view and "a" in view
    out = ExpertWeights(np.empty((2, 3, 4)), np.empty((2, 3, 4)), np.empty((2, 4, 3)))
    lazy.fill(out)
    assert made == ["g", "u", "d"] and taken == [1] and (out.down == 1).all()
    with pytest.raises(ValueError, match="'g' has shape"):
        LazyExperts(params, ExpertWeights("g", "u", "d")).fill(
            ExpertWeights(np.empty((3, 3, 4)), out.up, out.down))


def test_engine_store_holds_the_old_packing():
    """A streamed engine made from SyntheticParams holds init_synthetic's experts, packed as the
    old path packed them, in its host store and residents; made from the dict, the same."""
    from strata_jax.engine import Engine
    from strata_jax.stream import StreamConfig

    c = TINY
    eager = init_synthetic(c, 2, 0.5)
    for params in (SyntheticParams(c, 2, 0.5), eager):
        with Engine(c, params, StreamConfig(resident_per_layer=3), max_context=32,
                    chunk_size=16) as eng:
            s = eng.streamer
            for l in c.moe_layers:
                old = pack_expert_blobs_np(ExpertWeights(
                    *(eager[n] for n in expert_param_names(c, l))))
                assert _bits(s._stores[l]) == _bits(old)
                assert _bits(s.resident_blobs[l]) == _bits(old[s.resident[l]])


def test_a_store_past_host_ram_is_refused(monkeypatch):
    """The host store is checked against the available host RAM before anything is allocated
    or drawn: a HostMemoryError with the figures and the way out."""
    from strata_jax import devices as memory
    from strata_jax.engine import Engine
    from strata_jax.stream import StreamConfig

    drawn = []

    class Watched(SyntheticParams):
        def fill(self, name, out):
            drawn.append(name)
            super().fill(name, out)

    monkeypatch.setattr(memory, "host_memory", lambda: (2**30, TINY.expert_bytes_total // 2))
    with pytest.raises(memory.HostMemoryError, match=r"the host store of .* \(2 MoE layers x 8 "
                       r"experts x .* MiB\) with the simulated device's ring and resident "
                       r"experts needs .* GiB of host RAM and 0\.00 GiB is available; free "
                       r"host memory, or stream a smaller model"):
        Engine(TINY, Watched(TINY), StreamConfig(), max_context=32, chunk_size=16)
    assert drawn == []


# ---- checkpoints: experts read from the files when used ------------------------------------------


def _write_checkpoint(path, c, params, *, shards=2):
    """A Hugging Face safetensors checkpoint of `params` (Qwen3-MoE names, [out, in])."""
    preset = "qwen3-30b-a3b"
    write_hf_checkpoint(path, c, preset, hf_tensors(c, params, preset), shards=shards)


def test_checkpoint_experts_are_read_when_used(tmp_path):
    from strata_jax.checkpoint import CheckpointExperts, load_checkpoint

    c = TINY.replace(param_dtype="float32")
    params = init_synthetic(c, 5)
    _write_checkpoint(tmp_path, c, params)
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    assert isinstance(ckpt.experts, CheckpointExperts)
    assert not any(".mlp." + f in k for k in ckpt.params for f in ("gate", "up", "down"))
    assert ckpt.experts.nbytes == c.expert_bytes_total
    names = expert_param_names(c, 1)
    assert _bits(ckpt.experts[names.up]) == _bits(params[names.up])
    old = pack_expert_blobs_np(ExpertWeights(*(params[n] for n in names)))
    assert _bits(ckpt.experts.blobs(1)) == _bits(old)
    # Into a bfloat16 store (param_dtype overrides): the cast the old loader's blobs made.
    bf = load_checkpoint(str(tmp_path), param_dtype="bfloat16", progress=False)
    blobs = bf.experts.blobs(0)
    assert blobs.dtype == bf.config.dtype
    assert _bits(blobs) == _bits(pack_expert_blobs_np(ExpertWeights(
        *(params[n] for n in expert_param_names(c, 0)))).astype(bf.config.dtype))


@pytest.mark.slow
def test_lazy_weights_give_the_eager_paths_outputs(tmp_path):
    """Logits and KV cache, bit for bit: all resident from init_synthetic's dict and from
    SyntheticParams, and routed-streamed from a checkpoint of the same weights whose experts
    are read into the store (the stores' bytes: test_engine_store_holds_the_old_packing)."""
    from strata_jax.checkpoint import load_checkpoint
    from strata_jax.engine import Engine
    from strata_jax.stream import StreamConfig

    c = TINY.replace(param_dtype="float32")
    eager = init_synthetic(c, 4, 1.0)
    _write_checkpoint(tmp_path, c, eager)
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    tokens = np.arange(40) * 7 % c.vocab_size
    hashes = {}
    for kind, params, stream, experts in (
            ("eager", eager, None, None), ("lazy", SyntheticParams(c, 4, 1.0), None, None),
            ("checkpoint", ckpt.params, StreamConfig(resident_per_layer=2),
             ckpt.experts.as_mapping())):
        with Engine(c, params, stream, max_context=64, chunk_size=16, experts=experts,
                    device="cpu" if stream is None else None) as eng:
            r = eng.prefill(tokens)
            hashes[kind] = (r.logits_sha256(), r.kv_sha256())
    assert len(set(hashes.values())) == 1, hashes


# ---- peak host memory, in a subprocess each ------------------------------------------------------



def _big(case: str):
    """Experts of about 400 MB in 32 MoE layers of 32 experts (12 MiB a layer), so one layer's
    tensors in flight are a few per cent of the store; the checkpoint's in float32."""
    dtype, width = ("float32", 128) if case == "checkpoint" else ("bfloat16", 256)
    return get_preset("qwen3-30b-a3b").scaled(
        n_layers=32, n_experts=32, top_k=4, hidden_size=256, expert_intermediate=width,
        vocab_size=512, param_dtype=dtype)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _child(case: str, directory: str) -> dict:
    """Builds one engine of the BIG model from `case`'s weights; returns its memory figures."""
    import gc

    from strata_jax.engine import memory
    from strata_jax.checkpoint import load_checkpoint
    from strata_jax.engine import Engine
    from strata_jax.stream import StreamConfig, plan_stream

    c = _big(case)
    stream = None if case == "resident" else StreamConfig(routed=True)
    # Warm-up: the JAX CPU client, the native library, a small engine's allocations.
    with Engine(TINY, SyntheticParams(TINY), stream, max_context=32, chunk_size=16,
                device="cpu" if stream is None else None):
        pass
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    baseline = _status("VmRSS")
    experts = None
    if case == "checkpoint":
        ckpt = load_checkpoint(directory, progress=False)
        params, experts = ckpt.params, ckpt.experts.as_mapping()
    elif case == "eager":
        params = init_synthetic(c, 0)
    else:
        params = SyntheticParams(c, 0)
    eng = Engine(c, params, stream, max_context=32, chunk_size=16, experts=experts,
                 device="cpu" if stream is None else None)
    plan = plan_stream(c, eng.streamer.stream) if stream is not None else None
    return {"baseline": baseline, "peak": _status("VmHWM"), "experts": c.expert_bytes_total,
            "dense": memory.param_bytes(c, resident_experts=False),
            "ring": plan.ring_bytes if plan else 0}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["streamed", "resident", "checkpoint", "eager"])
def test_peak_host_memory(case, tmp_path):
    """Peak resident host memory of making an engine, over a baseline measured in the same
    process after a warm-up: within 1.1x the experts' bytes (plus the dense weights, twice:
    the lazy mapping's copy and the simulated device's, and the simulated device's ring: host
    memory only because the device is simulated) from SyntheticParams, all resident or
    streamed, and from a checkpoint's files. The old eager path (a dict of every weight, then
    the store) takes about twice the experts: the measurement sees it."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("/proc/self/clear_refs is not writable here: VmHWM cannot be reset")
    if case == "checkpoint":
        c = _big(case)
        _write_checkpoint(tmp_path, c, SyntheticParams(c, 0, tile=4), shards=3)
    out = subprocess.run([sys.executable, __file__, case, str(tmp_path)], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    extra = m["peak"] - m["baseline"]
    allowed = 1.1 * m["experts"] + 2 * m["dense"] + m["ring"]
    print(case, {k: round(v / 2**20, 1) for k, v in m.items()}, "extra MiB",
          round(extra / 2**20, 1), "allowed MiB", round(allowed / 2**20, 1))
    if case == "eager":
        assert extra > 1.8 * m["experts"], m
    else:
        assert m["experts"] > 300e6 and extra <= allowed, m


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], sys.argv[2])))
