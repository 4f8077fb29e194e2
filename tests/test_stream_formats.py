"""Quantized expert formats through the native engine (CPU backend, simulated link): issue 21.

The engine reads an expert's layout as data (its plane table): fp8, int4 and mxfp4 blobs, six
planes of unequal sizes (and dtypes), stream like the plain one. Every plane fetch returns must be
the host store's bytes (streamed, resident or routed-only; frames or packed ring; whole or in
pieces), unrouted rows that were not copied zero, and the weights the model reads the format's
dequantization of those planes, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_jax.models import get_preset
from strata_jax.experts import ExpertWeights
from strata_jax.formats import ExpertFormat
from strata_jax.formats import dense
from strata_jax.stream import StreamConfig, StreamTuning

BASE = get_preset("qwen3-30b-a3b").scaled(n_layers=2, n_experts=8, top_k=2, hidden_size=32,
                                          expert_intermediate=16, param_dtype="bfloat16")
# fp8 with 16 x 16 blocks: 8-byte scale planes, so planes sit at offsets that are not multiples
# of 16 (the CUDA split's byte path) and the planes are unequal (no single strided copy).
# mxfp4 (uint8 codes and uint8 exponents: planes of 2,048 and 128 bytes) reads its inputs in
# packs of 64: its model is 64 wide.
CONFIGS = {"fp8": BASE.replace(expert_format="fp8", expert_block=16),
           "int4": BASE.replace(expert_format="int4", expert_block=8),
           "mxfp4": BASE.replace(hidden_size=64, expert_intermediate=64, expert_format="mxfp4")}
E = BASE.n_experts
# Router counts per MoE layer: experts 1, 3, 4 and 7 (layer 0) and 0, 2, 5 (layer 1) get no row.
COUNTS = {0: np.array([3, 0, 2, 0, 0, 1, 4, 2], np.int32),
          1: np.array([0, 2, 0, 5, 1, 0, 3, 1], np.int32)}
RESIDENT = 2
SLOW = {"sim_bandwidth": 20e6, "sim_latency": 200e-6}  # routing lands before most copies


def _planes(config, seed: int) -> dict[int, dict[str, np.ndarray]]:
    """Per MoE layer the format's planes of random experts (quantize_np)."""
    fmt = ExpertFormat.of(config)
    rng = np.random.default_rng(seed)
    out = {}
    for l in config.moe_layers:
        w = ExpertWeights(*(rng.standard_normal((E, *fmt.matrix_shape(m)), np.float32)
                            for m in ("gate", "up", "down")))
        out[l] = fmt.quantize_np(w)
    return out


def _experts(config, planes):
    """Each layer in another of the forms NativeStreamer takes: a Mapping of planes, uint8
    blobs, or an object with fill(views) (weights.LazyExperts)."""
    from strata_jax.weights import LazyExperts

    fmt = ExpertFormat.of(config)
    forms = [lambda p: dict(p), fmt.pack_np,
             lambda p: LazyExperts({f"x.{k}": v for k, v in p.items()},
                                   {k: f"x.{k}" for k in p})]
    shift = 0 if config.expert_format == "fp8" else 1
    return [forms[(l + shift) % 3](planes[l]) for l in range(config.n_layers)]


def _bytes(a) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(a))
    return a.reshape(a.shape[0], -1).view(np.uint8)


def _streamer(config, planes, routed: bool, backend: str = "cpu", **tuning):
    from strata_jax import stream as S

    return S.NativeStreamer(config, _experts(config, planes), StreamConfig(
        routed=routed, depth=1, resident_per_layer=RESIDENT, backend=backend,
        tuning=StreamTuning(stream_floor=1, **{**SLOW, **tuning})))


# The CUDA backend too (pinned store, device ring, strided copies per plane, the split kernel),
# on the GPU machine.
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _chunk(eng, fmt, mode: int, pieces: int = 1):
    """One chunk driven by hand: begin, then per MoE layer publish (COUNTS), fetch (whole or
    in `pieces`) and release, then end. Returns (stats [L, 2], {layer: {plane: array}})."""
    import jax
    import jax.numpy as jnp

    from strata_jax import stream as S

    def run():
        tok, _ = S.begin(eng.id, mode, jnp.zeros((), jnp.int32))
        out = {}
        for l in eng.moe_layers:
            counts = jnp.asarray(COUNTS[l])
            tok = S.publish(eng.id, l, tok, counts)
            n_rows = int(COUNTS[l].sum())
            planes = None
            for p in range(pieces):
                planes, tok = S.fetch(eng.id, l, tok, eng.resident_blobs[l], E, fmt, piece=p,
                                      pieces=pieces,
                                      rows=(p * n_rows // pieces, (p + 1) * n_rows // pieces),
                                      so_far=planes if p else None, after=tok if p else None)
            tok = S.release(eng.id, l, tok, planes[fmt.planes[0].name])
            out[l] = planes
        return S.end(eng.id, tok, eng.config.n_layers), out

    stats, out = jax.jit(run)()
    return np.asarray(stats), out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["fp8", "int4", "mxfp4"])
@pytest.mark.parametrize("routed", [False, True])
def test_quantized_planes_stream_byte_for_byte(kind, routed, backend):
    config = CONFIGS[kind]
    fmt = ExpertFormat.of(config)
    planes = _planes(config, seed=1)
    eng = _streamer(config, planes, routed, backend)
    try:
        assert eng.blob_bytes == fmt.blob_bytes
        # fp8 and int4 mix dtypes; mxfp4's planes are all uint8: a blob is an array of them
        assert eng.blob_elems == (fmt.blob_bytes if kind == "mxfp4" else None)
        for l in config.moe_layers:
            # The host store holds the format's blobs, whichever form the layer came in, and
            # the residents are uint8 rows of it.
            np.testing.assert_array_equal(eng._stores[l], fmt.pack_np(planes[l]))
            res = eng.resident_blobs[l]
            assert res.dtype == np.uint8 and res.shape == (RESIDENT, fmt.blob_bytes)
            np.testing.assert_array_equal(np.asarray(res), eng._stores[l][eng.resident[l]])
        # (mode, pieces): frames, packed, frames and packed in pieces, routed-only.
        for mode, pieces in ((0, 1), (2, 1), (0, 3), (2, 3), (1, 1)):
            stats, out = _chunk(eng, fmt, mode, pieces)
            what = f"{kind} routed={routed} mode={mode} pieces={pieces}"
            for l in config.moe_layers:
                assert set(out[l]) == {p.name for p in fmt.planes}
                resident = set(eng.resident[l])
                routed_rows = set(np.flatnonzero(COUNTS[l])) | resident
                zeroed = set()
                for p in fmt.planes:
                    got, want = out[l][p.name], planes[l][p.name]
                    assert got.dtype == p.dtype and got.shape == (E, *p.shape), what
                    g, w = _bytes(got), _bytes(want)
                    for e in range(E):
                        if e in routed_rows or (mode != 1 and not routed):
                            np.testing.assert_array_equal(g[e], w[e],
                                                          err_msg=f"{what} {p.name} {e}")
                        elif not np.array_equal(g[e], w[e]):  # skipped: zero
                            assert not g[e].any(), f"{what} {p.name} expert {e}"
                            zeroed.add(e)
                if mode == 1:  # routed-only: exactly the routed experts copied
                    assert zeroed == set(range(E)) - routed_rows, what
                    assert stats[l, 1] == len(zeroed), what
                else:  # what the walk skipped is what fetch zeroed, never a routed expert
                    assert stats[l, 1] == len(zeroed) and not zeroed & routed_rows, what
                    assert stats[l, 0] + stats[l, 1] == E - RESIDENT, what
            if routed and mode != 1 and backend == "cpu":
                assert stats[:, 1].sum() > 0  # the slow link let the walk skip some
        assert not eng.walk_active()
    finally:
        eng.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["fp8", "int4", "mxfp4"])
def test_model_reads_the_dequantized_planes(kind, backend):
    # What StreamedExperts hands the expert math: fmt.expert_weights of the fetched planes in the
    # parameter dtype, the NumPy reference's bits, whole and in pieces (the tail layer), packed
    # and through the frames; residents and streamed experts alike.
    import jax
    import jax.numpy as jnp

    from strata_jax.stream.source import StreamedExperts

    config = CONFIGS[kind]
    fmt = ExpertFormat.of(config)
    planes = _planes(config, seed=2)
    eng = _streamer(config, planes, routed=False, backend=backend)
    last = max(config.moe_layers)
    want = {l: [fmt.dequantize_np(planes[l], m, config.dtype) for m in ("gate", "up", "down")]
            for l in config.moe_layers}
    try:
        # Packed; frames copied out by fetch (frames=None); frames read in place where the
        # backend has views of them (CUDA).
        arms = [(2, None), (0, None)] + ([(0, eng.frames)] if backend == "cuda" else [])
        for mode, frames in arms:
            if frames is not None:  # the ring's planes, float8 ones as uint8
                assert isinstance(frames[0], dict) and set(frames[0]) == set(planes[0])

            def run(frames, mode=mode):
                src = StreamedExperts(eng.id, mode, config, eng.resident_blobs,
                                      jnp.zeros((), jnp.int32), frames=frames,
                                      frame_of=eng.frame_of, tail_pieces=2, tail_layer=last)
                assert src.format == fmt
                got = {}
                for l in config.moe_layers:
                    counts = jnp.asarray(COUNTS[l])
                    bounds = src.row_pieces(l, int(COUNTS[l].sum()))
                    if bounds is None:
                        w = dense(src.expert_weights(l, counts, None))
                    else:
                        w, after = None, None
                        for p in range(len(bounds) - 1):
                            w = dense(src.expert_weights_piece(l, counts, bounds, p, after))
                            after = w.gate.sum()
                            got[f"{l}:{p}"] = w
                    got[f"{l}"] = w
                    src.release(l, w.gate.sum())
                return src.finish(), got

            stats, got = jax.jit(run)(frames)
            assert f"{last}:1" in got  # the tail layer ran in pieces
            for key, w in got.items():
                l = int(key.split(":")[0])
                for m, a, b in zip(("gate", "up", "down"), w, want[l]):
                    assert a.dtype == config.dtype
                    if key.endswith(":0"):
                        continue  # an early piece: only its experts are there yet
                    np.testing.assert_array_equal(_bytes(a), _bytes(b), err_msg=f"{m} {key}")
            assert np.asarray(stats)[list(config.moe_layers), 0].sum() == len(eng.stream_list)

        # A frames chunk whose model reads the frames in place (CUDA): a frame is a dict of
        # planes, float8 ones as uint8 (DLPack has no float8), bitcast and dequantized after the
        # barrier. Here the "frames" are arrays of the planes themselves.
        frames = tuple({p.name: jnp.asarray(planes[l][p.name].view(np.uint8)
                                            if p.dtype.kind == "V" else planes[l][p.name])
                        for p in fmt.planes} for l in config.moe_layers)

        def read(frames):
            src = StreamedExperts(eng.id, 0, config, eng.resident_blobs,
                                  jnp.zeros((), jnp.int32), frames=frames,
                                  frame_of={l: i for i, l in enumerate(config.moe_layers)})
            got = {}
            for l in config.moe_layers:
                got[l] = dense(src.expert_weights(l, jnp.asarray(COUNTS[l]), None))
                src.release(l, got[l].gate.sum())
            return src.finish(), got

        _, got = jax.jit(read)(frames)
        for l in config.moe_layers:
            for m, a, b in zip(("gate", "up", "down"), got[l], want[l]):
                np.testing.assert_array_equal(_bytes(a), _bytes(b), err_msg=f"frame {m} {l}")
    finally:
        eng.close()


def test_plain_model_reads_the_fetched_arrays_themselves():
    # For the plain format StreamedExperts adds no op: the weights are fetch's outputs.
    import jax
    import jax.numpy as jnp

    from strata_jax.stream.source import StreamedExperts
    from strata_jax.synthetic import init_synthetic, split_experts

    _, experts = split_experts(BASE, init_synthetic(BASE, seed=3))
    from strata_jax import stream as S

    eng = S.NativeStreamer(BASE, [experts.get(l) for l in range(BASE.n_layers)],
                           StreamConfig(tuning=StreamTuning(stream_floor=1, layout="packed")))
    try:
        assert eng.resident_blobs[0].dtype == np.uint8

        def run():
            src = StreamedExperts(eng.id, 2, BASE, eng.resident_blobs, jnp.zeros((), jnp.int32))
            w = src.expert_weights(0, jnp.asarray(COUNTS[0]), None)
            return tuple(w)

        jaxpr = jax.make_jaxpr(run)().jaxpr
        fetch = [e for e in jaxpr.eqns if e.primitive.name == "strata_stream_call"
                 and e.params["target"] == "strata_fetch"]
        assert len(fetch) == 1
        assert list(jaxpr.outvars) == list(fetch[0].outvars[:3])
    finally:
        eng.close()


def test_plane_table_is_validated():
    from strata_jax import native

    mod = native.module()

    def make(offsets, sizes, blob=100):
        o = mod.EngineOptions()
        o.n_layers, o.n_experts, o.routed, o.blob_bytes, o.ring = 1, 2, False, blob, 2
        o.plane_offsets, o.plane_bytes = offsets, sizes
        return mod.Streamer(o)

    cases = [
        (([0, 10], [10]), r"2 plane offsets for 1 plane sizes"),
        (([], []), r"plane table of 0 planes: an expert blob has 1 to 16"),
        ((list(range(17)), [1] * 17), r"plane table of 17 planes"),
        (([0, 5], [10, 10]), r"plane 1 starts at byte 5, inside plane 0 \(which ends at 10\)"),
        (([20, 10], [5, 5]), r"plane 1 starts at byte 10, inside plane 0"),
        (([-1], [10]), r"plane 0 starts at byte -1, before the blob"),
        (([0, 95], [10, 10]), r"plane 1 \(bytes 95..105\) passes the end of the 100-byte blob"),
        (([0, 10], [10, 0]), r"plane 1 has 0 bytes"),
    ]
    for (offsets, sizes), pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            make(offsets, sizes)
    s = make([0, 36, 40], [32, 4, 60])  # gaps are allowed (a dtype's alignment)
    try:
        planes, frames = s.frames()  # before prepare: no ring yet
        assert len(planes) == 3 and frames == 1
    finally:
        s.close()


def test_fetch_outputs_must_match_the_plane_table():
    # A fetch whose outputs are another format's is refused with the plane it got wrong.
    import jax
    import jax.numpy as jnp

    from strata_jax import stream as S

    config = CONFIGS["fp8"]
    planes = _planes(config, seed=4)
    eng = _streamer(config, planes, routed=False)
    fp8 = ExpertFormat.of(config)
    other = {"plain": ExpertFormat.of(config, "plain"),
             "fp8 of another block": ExpertFormat.make("fp8", 32, 16, config.dtype, block=8)}
    want = {"plain": r"3 outputs; the plane table has 6 planes",
            "fp8 of another block": r"plane 1 output of 256 bytes; expected 64 \(8 experts x "
                                    r"8 bytes\)"}
    try:
        for name, fmt in other.items():
            def run(fmt=fmt):
                tok, _ = S.begin(eng.id, 2, jnp.zeros((), jnp.int32))
                tok = S.publish(eng.id, 0, tok, jnp.asarray(COUNTS[0]))
                w, tok = S.fetch(eng.id, 0, tok, eng.resident_blobs[0], E, fmt)
                return S.end(eng.id, tok, config.n_layers), w

            with pytest.raises(Exception, match=want[name]):
                jax.block_until_ready(jax.jit(run)())
            assert not eng.walk_active()
        stats, _ = _chunk(eng, fp8, 2)  # the engine is whole after the failures
        assert stats[list(config.moe_layers), 0].sum() == len(eng.stream_list)
    finally:
        eng.close()


def test_experts_in_a_form_the_format_does_not_take_are_refused():
    from strata_jax import stream as S

    config = CONFIGS["int4"]
    fmt = ExpertFormat.of(config)
    planes = _planes(config, seed=5)
    w = ExpertWeights(*(np.zeros((E, *fmt.matrix_shape(m)), np.float32)
                        for m in ("gate", "up", "down")))
    wrong_dtype = {**planes[1], "gate_scale": planes[1]["gate_scale"].astype(np.float32)}
    cases = [(w, TypeError, "quantize them with ExpertFormat.quantize_np"),
             ({k: v for k, v in planes[1].items() if k != "up"}, ValueError, r"missing \['up'\]"),
             (wrong_dtype, ValueError, ("gate_scale is float32; the int4 format stores it "
                                        "as float16")),
             (np.zeros((E, fmt.blob_bytes), np.float16), ValueError,
              rf"blobs are float16 \({E}, {fmt.blob_bytes}\); expected uint8")]
    for bad, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            S.NativeStreamer(config, [planes[0], bad], StreamConfig())
