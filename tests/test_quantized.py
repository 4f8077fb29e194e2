"""Quantized experts (issue 21), the model side: a model whose routed experts are fp8, int4 or mxfp4
planes (`ModelConfig.expert_format`) dequantizes them before the expert math, against the
float64 reference of the published formulas; `QuantizedParams` quantizes plain weights as
they are asked for; the CLI's --quantize; refusals. The stream's side (the same bits in every
arm) is in tests/test_stream_engine.py."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

from strata_jax import cli
from strata_jax.models import get_preset
from strata_jax.engine import Engine
from strata_jax.formats import ExpertFormat
from strata_jax.models import expert_param_names, expert_plane_names, param_shapes
from strata_jax.reference import _dequantized, reference_forward
from strata_jax.synthetic import SyntheticParams
from strata_jax.testing import assert_close
from strata_jax.weights import QuantizedParams

PLAIN = get_preset("qwen3-30b-a3b").scaled(n_experts=8, top_k=2, expert_intermediate=32)
FORMATS = {"fp8": PLAIN.replace(expert_format="fp8", expert_block=16),
           "int4": PLAIN.replace(expert_format="int4", expert_block=16),
           # int4 with a zero-point plane per matrix (asymmetric GPTQ)
           "int4-zp": PLAIN.replace(expert_format="int4", expert_block=16,
                                    expert_zero_points=True),
           # and with act-order (GPTQ desc_act): rows stored in group order, a permutation plane
           "int4-zp-act": PLAIN.replace(expert_format="int4", expert_block=16,
                                        expert_zero_points=True, expert_act_order=True)}
# mxfp4 reads its inputs in packs of 64: its model has experts 64 wide (PLAIN's are 32), and
# plain weights of its own.
PLAIN_64 = PLAIN.replace(expert_intermediate=64)
WIDE = {"mxfp4": PLAIN_64.replace(expert_format="mxfp4")}


def _tokens(n: int, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, PLAIN.vocab_size, n)


@pytest.fixture(scope="module")
def plain_params():
    return SyntheticParams(PLAIN, 3, 1.0)


def _quantized(kind, plain_params):
    """(config, QuantizedParams) of format `kind` (FORMATS, or WIDE over PLAIN_64's weights)."""
    if kind in WIDE:
        return WIDE[kind], QuantizedParams(SyntheticParams(PLAIN_64, 3, 1.0), WIDE[kind])
    return FORMATS[kind], QuantizedParams(plain_params, FORMATS[kind])


# int4-zp-act reads both side planes (zero-points and group indices): int4-zp alone in the
# slow run.
@pytest.mark.parametrize("kind", [pytest.param("fp8", marks=pytest.mark.slow), "int4",
                                  pytest.param("int4-zp", marks=pytest.mark.slow),
                                  "int4-zp-act", pytest.param("mxfp4", marks=pytest.mark.slow)])
def test_quantized_model_matches_float64_reference(plain_params, kind):
    # The resident engine's logits at every position against the float64 forward of the
    # dequantized planes, within the parameter dtype's tolerance.
    cfg, params = _quantized(kind, plain_params)
    toks = _tokens(24)
    with Engine(cfg, params, max_context=32, chunk_size=16) as eng:
        got = eng.prefill(toks)
    want, _ = reference_forward(cfg, {n: params[n] for n in params}, toks)
    assert_close(np.asarray(got.logits), want[-1], cfg.dtype)


def test_quantized_logits_report_accuracy_against_the_plain_model(plain_params):
    # The cost of quantizing, reported: the float64 forwards of the plain and the quantized
    # weights on one prompt. fp8 (3 mantissa bits, 16x16 blocks) stays nearer the plain model
    # than int4 (16 levels per group, symmetric or with zero-points); all pick mostly the same
    # top token.
    toks = _tokens(32, seed=9)
    plain, _ = reference_forward(PLAIN, dict(plain_params), toks)
    report = {}
    for kind, cfg in FORMATS.items():
        params = QuantizedParams(plain_params, cfg)
        got, _ = reference_forward(cfg, {n: params[n] for n in params}, toks)
        assert np.isfinite(got).all()
        diff = np.abs(got - plain)
        report[kind] = (diff.max(), diff.mean(),
                        float(np.mean(got.argmax(-1) == plain.argmax(-1))))
    print("quantized vs plain (max |dlogit|, mean |dlogit|, top-1 agreement):", report)
    assert report["fp8"][1] < min(report["int4"][1], report["int4-zp"][1])
    assert report["fp8"][2] >= 0.75 and min(report["int4"][2], report["int4-zp"][2]) >= 0.5


@pytest.mark.parametrize("kind", ["fp8", "int4", "int4-zp", "int4-zp-act", "mxfp4"])
def test_reference_dequantization_equals_the_formats(kind):
    # Two implementations of the dequantization: the reference's float64 formulas and the
    # format's float32 products (what the device runs) agree to float32 rounding.
    cfg = {**FORMATS, **WIDE}[kind]
    fmt = ExpertFormat.of(cfg)
    rng = np.random.default_rng(0)
    w = {m: rng.standard_normal((3, *fmt.matrix_shape(m))).astype(np.float32) * 0.05
         for m in ("gate", "up", "down")}
    planes = {}
    for m, x in w.items():
        planes.update(fmt.quantize_matrix_np(m, x))
    params = {f"p.{k}": v for k, v in planes.items()}
    for m, x in w.items():
        ref = _dequantized(cfg, params, "p.", m)
        assert ref.dtype == np.float64 and np.isfinite(ref).all()
        np.testing.assert_allclose(fmt.dequantize_np(planes, m, np.float32), ref, rtol=2**-23,
                                   atol=0)
        # and the quantization is near the original (the format's own resolution; mxfp4's
        # scale is at most amax / 4, a value within it or, past 6 scales, 2 of them)
        step = {"fp8": 2**-3, "mxfp4": 1 / 2}.get(kind, 1 / 7.5)
        assert np.abs(ref - x).max() <= step * np.abs(x).max()


def test_quantized_params_serve_every_plane_once(plain_params):
    cfg = FORMATS["int4"]
    q = QuantizedParams(plain_params, cfg)
    shapes = param_shapes(cfg)
    assert set(q) == set(shapes) and len(q) == len(shapes)
    for n, spec in shapes.items():
        v = q[n]
        assert (tuple(v.shape), v.dtype) == (tuple(spec.shape), spec.dtype), n
    assert not q._pending  # each matrix's other plane was taken and dropped
    names = expert_plane_names(cfg, 1)
    assert list(names) == ["gate", "gate_scale", "up", "up_scale", "down", "down_scale"]
    fmt = ExpertFormat.of(cfg)
    want = fmt.quantize_matrix_np("up", plain_params[names["up"]])
    out = np.empty_like(want["up_scale"])
    q.fill(names["up_scale"], out)
    np.testing.assert_array_equal(out, want["up_scale"])
    np.testing.assert_array_equal(q[names["up"]], want["up"])


def test_quantized_params_of_tiled_weights_quantize_the_tile_once():
    # Where expert e repeats expert e % t, the planes repeat too: the same bytes as
    # quantizing every expert.
    base = SyntheticParams(PLAIN, 0, tile=3)
    cfg = FORMATS["fp8"]
    q = QuantizedParams(base, cfg)
    names = expert_plane_names(cfg, 1)
    full = ExpertFormat.of(cfg).quantize_matrix_np("down", base[names["down"]])
    np.testing.assert_array_equal(q[names["down"]].view(np.uint8), full["down"].view(np.uint8))
    np.testing.assert_array_equal(q[names["down_scale"]], full["down_scale"])


def test_quantized_formats_refuse_what_they_do_not_implement(plain_params):
    with pytest.raises(ValueError, match="expert_format='fp4'"):
        PLAIN.replace(expert_format="fp4")
    with pytest.raises(ValueError, match="expert_block must be an int >= 0"):
        PLAIN.replace(expert_format="fp8", expert_block=-1)
    with pytest.raises(ValueError, match="multiple of the group 128.*expert_block"):
        PLAIN.replace(expert_format="int4")
    with pytest.raises(ValueError, match="expert_plane_names"):
        expert_param_names(FORMATS["fp8"], 1)
    with pytest.raises(ValueError, match="QuantizedParams: config.expert_format is 'plain'"):
        QuantizedParams(plain_params, PLAIN)
    with pytest.raises(ValueError, match="SyntheticParams draws plain experts, not int4.*"
                                         "QuantizedParams"):
        SyntheticParams(FORMATS["int4"], 0)
    from flax import nnx

    from strata_jax.models import MoETransformer

    with pytest.raises(ValueError, match="random initialisation of fp8 experts"):
        MoETransformer(FORMATS["fp8"], rngs=nnx.Rngs(0))


def _cli(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


MODEL = ["--preset", "qwen3-30b-a3b", "--scale", "tiny", "--experts", "8", "--top-k", "2"]


# The default run: the CLI reading a quantized checkpoint (test_quantized_checkpoint).
@pytest.mark.slow
def test_cli_quantize_reads_a_quantized_model():
    rc, out, err = _cli(["prefill", *MODEL, "--quantize", "int4", "--no-stream", "--tokens",
                         "32", "--json", "-q"])
    assert rc == 0, err
    d = json.loads(out)
    m = d["model"]
    assert (m["hidden"], m["expert_width"]) == (64, 32)
    # the largest of 128, 64, 32, ... dividing both widths
    assert (m["expert_format"], m["expert_block"]) == ("int4", 32)
    assert d["quantized_matmul"] == "dequantize"  # the CPU has no fused kernel for "auto"
    rc, out, err = _cli(["prefill", *MODEL, "--quantize", "fp8", "--no-stream", "--tokens",
                         "32", "--quantized-matmul", "fused"])
    assert rc == 0, err
    assert "expert" in out.splitlines()[0]
    # Off Hopper "fused" has no kernel to take: the experts are dequantized first, and said so.
    assert out.splitlines()[0].endswith(
        "; experts dequantized a layer at a time before the matmuls"), out
    rc, out, err = _cli(["prefill", *MODEL, "--no-stream", "--tokens", "32"])
    assert rc == 0 and "experts read by" not in out and "dequantized" not in out
    fmt = ExpertFormat.make("int4", 64, 32, np.float32, block=32)
    assert m["expert_bytes"] == fmt.blob_bytes < 3 * 64 * 32 * 2 / 3
    rc, _, err = _cli(["prefill", *MODEL, "--quant-block", "16", "--no-stream"])
    assert rc == 2 and "--quant-block applies with --quantize" in err
    rc, _, err = _cli(["prefill", *MODEL, "--quantize", "int4", "--quant-block", "7",
                       "--no-stream"])
    assert rc == 2 and "--quantize int4" in err and "multiple of 8" in err


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int4-zp", "int4-act"])
def test_cli_quantize_int4_with_zero_points_or_act_order(name):
    # int4-zp (a zero-point plane) and int4-act (a group-index plane): streamed over the
    # simulated link and resident with the same bits; the side planes add their bytes to an
    # expert's
    fmt = ExpertFormat.make("int4", 64, 32, np.float32, block=32)
    got = []
    for extra in (["--no-stream"], []):
        rc, out, err = _cli(["prefill", *MODEL, "--quantize", name, "--tokens", "32",
                             "--json", "-q", *extra])
        assert rc == 0, err
        d = json.loads(out)
        m = d["model"]
        assert (m["expert_format"], m["expert_zero_points"], m["expert_act_order"]) == (
            "int4", name == "int4-zp", name == "int4-act")
        got.append((d["logits_sha256"], d["kv_sha256"]))
    assert got[0] == got[1]
    if name == "int4-zp":  # a zero-point byte per group and column: gate and up [64/32, 32],
        extra_bytes = 2 * 2 * 32 + 64  # down [32/32, 64]
    else:  # an int32 group index per input row: gate and up 64, down 32
        extra_bytes = 4 * (2 * 64 + 32)
    assert m["expert_bytes"] == fmt.blob_bytes + extra_bytes


def test_tail_pieces_follow_the_kernel_that_reads_the_format(plain_params):
    # The quantized kernels visit only the experts with rows, so the last layer runs in pieces
    # from 1,024 tokens; a format dequantized first dequantizes the whole layer in every piece
    # (from 16,384). An explicit tail_from holds for every kernel.
    import strata_jax.stream.streamer as stream_module
    from strata_jax.kernels.grouped import is_hopper
    from strata_jax.kernels.quantized import resolve_format
    from strata_jax.stream import StreamConfig, StreamTuning

    cfg = FORMATS["fp8"]
    fmt = ExpertFormat.of(cfg)
    assert resolve_format("dequantize", fmt) == "dequantize"
    assert resolve_format(None, ExpertFormat.of(cfg.replace(expert_format="plain"))) is None
    if not is_hopper():
        assert resolve_format(None, fmt) == "dequantize"
    lengths = (512, 1024, 4096, 8192, 16384)
    with Engine(cfg, QuantizedParams(plain_params, cfg), StreamConfig(routed=True, backend="cpu"),
                max_context=64, chunk_size=64) as eng:
        streamer = eng.streamer
        assert streamer.tuning.tail_from is None
        for path, want in (("mosaic", [1, 4, 4, 4, 4]),
                           ("dequantize", [1, 1, 1, 1, 4])):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(stream_module, "resolve_format", lambda *_, path=path: path)
                mp.setattr(stream_module, "resolve_implementation", lambda _: "lax")
                assert [streamer.tail_pieces(0, n) for n in lengths] == want, path
                assert streamer.tail_pieces(1, 8192) == 1  # routed-only: whole layers
                mp.setattr(streamer, "tuning", StreamTuning(tail_from=4096))
                assert [streamer.tail_pieces(0, n) for n in lengths] == [1, 1, 4, 4, 4], path


def test_the_chunk_plan_counts_a_dequantized_layer_only_on_the_dequantize_path(plain_params):
    # A fused kernel never writes the layer out in the parameter dtype, so an engine whose
    # quantized experts take one plans no room for it; the module's chunk_bytes (the CLI's
    # check before an engine exists) counts it for any quantized format.
    import strata_jax.engine.engine as engine_module
    from strata_jax.engine.memory import chunk_bytes

    cfg = FORMATS["int4"]
    layer = cfg.n_experts * cfg.expert_params * np.dtype(cfg.dtype).itemsize
    with Engine(cfg, QuantizedParams(plain_params, cfg), None, max_context=64,
                chunk_size=64) as eng:
        on_cpu = eng.chunk_bytes(64)  # the CPU dequantizes
        assert on_cpu == chunk_bytes(cfg, 64, eng.capacity, platform=eng.device.platform,
                                     attention=eng.kernels.attention)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(engine_module, "resolve_format", lambda *_: "mosaic")
            assert eng.chunk_bytes(64) == on_cpu - layer
    plain = cfg.replace(expert_format="plain")
    assert (chunk_bytes(plain, 64, 128) == chunk_bytes(plain, 64, 128, dequantized=False)
            == chunk_bytes(cfg, 64, 128, dequantized=True) - layer)
    # The CLI's plan check (prefill_bytes) takes the same choice: CHUNK_HEADROOM x the layer.
    from strata_jax.engine.memory import CHUNK_HEADROOM, prefill_bytes

    kw = dict(max_context=64, n_tokens=64, chunk=64, sub_chunk=None, platform="cpu",
              streamed=False)
    counted = prefill_bytes(cfg, 0, 64, **kw)[1]
    assert counted == prefill_bytes(cfg, 0, 64, dequantized=True, **kw)[1]
    fused = prefill_bytes(cfg, 0, 64, dequantized=False, **kw)[1]
    assert abs(counted - fused - CHUNK_HEADROOM * layer) <= 1  # each side rounded down


@pytest.mark.parametrize("kind,every", [
    ("fp8", False), pytest.param("fp8", True, marks=pytest.mark.slow),
    pytest.param("int4", True, marks=pytest.mark.slow),
    # int4-zp-act streams the zero-point plane too: int4-zp alone in the slow run
    pytest.param("int4-zp", False, marks=pytest.mark.slow),
    pytest.param("int4-zp", True, marks=pytest.mark.slow),
    ("int4-zp-act", False), pytest.param("int4-zp-act", True, marks=pytest.mark.slow),
    # mxfp4 (all-uint8 planes) streams as test_stream_formats checks in the default run
    pytest.param("mxfp4", False, marks=pytest.mark.slow),
    pytest.param("mxfp4", True, marks=pytest.mark.slow)])
def test_quantized_experts_give_the_same_bits_in_every_arm(plain_params, kind, every):
    # For a given format: resident, stream-all and routed (packed and frames rings, the last
    # layer in pieces) read the same logits and KV cache, in chunks and on a follow-up turn;
    # the streamed arms copy the format's bytes. The default run reads resident and routed
    # (frames, pieces; act-order int4 also each layer in parts) in one chunk, without the
    # follow-up.
    from strata_jax.stream import StreamConfig, StreamTuning

    cfg, params = _quantized(kind, plain_params)
    toks, more = _tokens(40), _tokens(12, seed=6)
    arms = {"resident": None}
    for layout in ("packed", "frames"):
        tuning = StreamTuning(layout=layout, tail_pieces=2, tail_from=16, stream_floor=1)
        for routed in (False, True):
            if every or (routed and layout == "frames"):
                arms[f"{'routed' if routed else 'stream-all'} {layout}"] = StreamConfig(
                    routed=routed, backend="cpu", tuning=tuning)
    if every or kind == "int4-zp-act":  # each layer in two parts (the act-order rows too)
        arms["routed in parts"] = StreamConfig(
            routed=True, backend="cpu", tuning=StreamTuning(parts=2, stream_floor=1))
    got = {}
    for arm, stream in arms.items():
        with Engine(cfg, params, stream, max_context=64, chunk_size=16 if every else 64) as eng:
            r = eng.prefill(toks)
            got[arm] = (r.logits_sha256(), r.kv_sha256())
            if every:
                r2 = eng.prefill(more, session=r.session)
                got[arm] += (r2.logits_sha256(), r2.kv_sha256())
            if stream is not None:
                tot = r.totals()
                assert tot["bytes"] == tot["copied"] * cfg.expert_bytes > 0
    assert len(set(got.values())) == 1, got


@pytest.mark.gpu
def test_act_order_experts_stream_on_the_gpu_with_the_resident_bits(plain_params):
    # int4 with zero-points and act-order (12 planes a blob: rows in group order and their
    # permutation) through the CUDA engine: resident, routed (frames ring, the last layer in
    # pieces) and stream-all (packed) read the same bits, each matmul's inputs gathered into
    # the stored order and the matrix dequantized on the device; the logits are the float64
    # forward's.
    from strata_jax.stream import StreamConfig, StreamTuning

    cfg = FORMATS["int4-zp-act"]
    params = QuantizedParams(plain_params, cfg)
    toks = _tokens(40)
    arms = {"resident": None,
            "routed": StreamConfig(routed=True, tuning=StreamTuning(
                layout="frames", tail_pieces=2, tail_from=16, stream_floor=1)),
            "stream-all": StreamConfig(routed=False, tuning=StreamTuning(layout="packed"))}
    got = {}
    for arm, stream in arms.items():
        with Engine(cfg, params, stream, max_context=64, chunk_size=64) as eng:
            r = eng.prefill(toks)
            got[arm] = (r.logits_sha256(), r.kv_sha256())
            logits = np.asarray(r.logits)
            if stream is not None:
                assert eng.streamer.backend == "cuda"
                tot = r.totals()
                assert tot["bytes"] == tot["copied"] * cfg.expert_bytes > 0
    assert len(set(got.values())) == 1, got
    want, _ = reference_forward(cfg, {n: params[n] for n in params}, toks)
    assert_close(logits, want[-1], cfg.dtype)
