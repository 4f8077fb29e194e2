"""The Triton grouped matmul over quantized planes (`strata_jax.quant_matmul`): its visits, its
numerics against the float64 reference, its rows in pieces, the choice between the kernels and
dequantize-then-matmul, and the model's arms reading it. On the CPU the kernel runs in Pallas'
interpret mode; the gpu-marked tests run it through Triton. The Mosaic fp8 kernel has
tests/test_quant_mosaic.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.formats import ExpertFormat
from strata_jax.grouped_matmul import grouped_matmul, piece_group_sizes, row_pieces
from strata_jax.kernels import Kernels
from strata_jax.quant_matmul import (TILES, QuantizedMatrix, Tiles, fused_grouped_matmul,
                                     fused_reference, fused_supports, group_metadata,
                                     resolve_format, resolve_quantized, tiles_for)
from strata_jax.testing import assert_close

SIZES = [50, 0, 130, 20, 0]  # an empty expert between two, one at the end


def _matrix(kind, e=5, k=256, n=128, block=128, seed=0, nan_experts=()):
    rng = np.random.default_rng(seed)
    fmt = ExpertFormat.make(kind, k, n, jnp.bfloat16, block=block)
    w = rng.standard_normal((e, k, n)).astype(np.float32) * 0.05
    planes = fmt.quantize_matrix_np("gate", w)
    q, s = planes["gate"], planes["gate_scale"].copy()
    for i in nan_experts:  # garbage in an unrouted expert's planes must not reach any row
        s[i] = np.nan
    return QuantizedMatrix(jnp.asarray(q), jnp.asarray(s), kind, block, (k, n),
                           np.dtype(jnp.bfloat16))


def _zero_matrix(e=5, k=256, n=128, block=128, seed=0, nan_experts=()):
    """An int4 matrix with a zero-point plane (asymmetric GPTQ's layout)."""
    rng = np.random.default_rng(seed)
    fmt = ExpertFormat.make("int4", k, n, jnp.bfloat16, block=block, zero_points=True)
    w = rng.standard_normal((e, k, n)).astype(np.float32) * 0.05 + 0.02
    p = fmt.quantize_matrix_np("gate", w)
    s = p["gate_scale"].copy()
    for i in nan_experts:  # garbage in an unrouted expert's planes must not reach any row
        s[i] = np.nan
    return QuantizedMatrix(jnp.asarray(p["gate"]), jnp.asarray(s), "int4", block,
                           (k, n), np.dtype(jnp.bfloat16), jnp.asarray(p["gate_zero"]))


def _x(m, k, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), jnp.bfloat16)


def test_visits_cover_every_row_of_every_group_once():
    for sizes, bm in (([50, 0, 130, 20, 0], 64), ([0, 0, 0], 16), ([7], 16),
                      ([64, 64, 1, 0, 63], 64), ([3, 200, 5], 32)):
        m = sum(sizes) + 9  # rows past the groups
        meta = np.asarray(jax.jit(group_metadata, static_argnums=(1, 2))(
            jnp.asarray(sizes, jnp.int32), m, bm))
        assert meta.shape == (4, -(-m // bm) + len(sizes) - 1)
        owner = np.full(m, -1)
        for g, tile, lo, hi in meta.T:
            if hi > lo:
                assert tile * bm <= lo < hi <= (tile + 1) * bm and sizes[g] > 0
                assert (owner[lo:hi] == -1).all()
                owner[lo:hi] = g
        want = np.concatenate([np.full(s, g) for g, s in enumerate(sizes)] + [np.full(9, -1)])
        np.testing.assert_array_equal(owner, want, err_msg=f"{sizes} {bm}")


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_fused_kernel_matches_the_float64_reference(kind):
    # Rows of an empty expert and rows past the groups: zeros; an unrouted expert's NaN
    # scales reach no row; every routed row within the bf16 tolerance of float64.
    w = _matrix(kind, nan_experts=(1, 4))
    x = _x(sum(SIZES) + 7, 256)
    sizes = jnp.asarray(SIZES, jnp.int32)
    for unpack in ("tile", "split") if kind == "int4" else ("tile",):
        tiles = dataclasses.replace(tiles_for(w), unpack=unpack)
        got = np.asarray(fused_grouped_matmul(x, w, sizes, tiles=tiles, interpret=True),
                         np.float64)
        assert_close(got, fused_reference(x, w, sizes), jnp.bfloat16)
        assert (got[sum(SIZES):] == 0).all()


@pytest.mark.parametrize("kind,unpack", [("fp8", "tile"), ("int4", "tile"), ("int4", "split")])
def test_triton_kernel_lowers_for_cuda(kind, unpack):
    # Pallas' lowering to Triton IR runs on the CPU: the kernel at Qwen3-30B-A3B's gate shape.
    w = _matrix(kind, e=8, k=2048, n=768)
    tiles = dataclasses.replace(tiles_for(w), unpack=unpack)
    f = jax.jit(lambda x, w, s: fused_grouped_matmul(x, w, s, tiles=tiles, interpret=False))
    triton = ("__gpu$xla.gpu.triton", "triton_kernel_call")  # jax 0.10's, earlier jax's
    jax.export.export(f, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(t) for t in triton])(
            _x(1024, 2048), w, jnp.full((8,), 128, jnp.int32))


# In the slow run: the gpu-marked kernel tests check pieces of both kinds through Triton.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_fused_rows_in_pieces_are_the_whole_matmuls_rows(kind):
    # A layer's last matmul in row pieces (tail_pieces) gives each row the bits the whole
    # matmul gives it; with 16-row tiles the pieces cut tiles other than the whole's.
    w = _matrix(kind)
    x = _x(sum(SIZES), 256)
    sizes = jnp.asarray(SIZES, jnp.int32)
    tiles = dataclasses.replace(TILES[kind], block_m=16)
    whole = np.asarray(fused_grouped_matmul(x, w, sizes, tiles=tiles, interpret=True))
    bounds = row_pieces(x.shape[0], 3, align=1)
    parts = [np.asarray(fused_grouped_matmul(x[a:b], w, piece_group_sizes(sizes, a, b),
                                             tiles=tiles, interpret=True))
             for a, b in zip(bounds, bounds[1:])]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_the_path_each_choice_takes():
    w8, w4 = _matrix("fp8"), _matrix("int4")
    assert resolve_quantized("dequantize", w8) == "dequantize"
    assert resolve_quantized("fused", w4) == "triton"
    if jax.devices()[0].platform == "cpu":
        assert resolve_quantized(None, w4) == "dequantize"  # auto: no fused kernel on CPU
        assert resolve_quantized(None, w8) == "dequantize"
        assert resolve_quantized("fused", w8) == "triton"
    # Groups of 64: no Mosaic kernel reads them; auto dequantizes (the Triton int4 kernel
    # loses to it), fused takes Triton.
    w64 = _matrix("int4", block=64)
    assert resolve_quantized(None, w64) == "dequantize"
    assert resolve_quantized("fused", w64) == "triton"
    with pytest.raises(ValueError, match="quantized matmul 'triton'"):
        resolve_quantized("triton", w8)
    with pytest.raises(ValueError, match="Kernels\\(quantized_matmul='x'\\)"):
        Kernels(quantized_matmul="x")
    # A matrix the kernel cannot tile (N not a multiple of 16) is dequantized instead.
    odd = dataclasses.replace(w8, shape=(256, 120))
    assert not fused_supports(odd, tiles_for(odd))
    assert resolve_quantized("fused", odd) == "dequantize"
    with pytest.raises(ValueError, match="cannot be tiled"):
        fused_grouped_matmul(_x(4, 256), w8, jnp.asarray([4, 0, 0, 0, 0], jnp.int32),
                             tiles=Tiles(block_n=256))
    with pytest.raises(ValueError, match="unpack"):
        Tiles(unpack="rows")
    # An int4 plane in GPTQ's int32 words (not the format's group halves) is refused by name.
    words = dataclasses.replace(_matrix("int4"), q=jnp.zeros((5, 32, 128), jnp.int32))
    for read in (lambda: words.dequantize(),
                 lambda: fused_grouped_matmul(_x(4, 256), words,
                                              jnp.asarray([4, 0, 0, 0, 0], jnp.int32))):
        with pytest.raises(ValueError, match="int4 plane int32 .*gptq_halves_np"):
            read()


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_grouped_matmul_reads_a_quantized_matrix_either_way(kind):
    # The same products within bf16 rounding whether the matrix is dequantized first or read
    # by the fused kernel; dequantize-then-matmul gives dequantize's bits exactly.
    w = _matrix(kind)
    x = _x(sum(SIZES), 256)
    sizes = jnp.asarray(SIZES, jnp.int32)
    deq = grouped_matmul(x, w, sizes, quantized="dequantize")
    np.testing.assert_array_equal(np.asarray(deq),
                                  np.asarray(grouped_matmul(x, w.dequantize(), sizes)))
    fused = grouped_matmul(x, w, sizes, quantized="fused")
    want = fused_reference(x, w, sizes)
    assert_close(np.asarray(fused, np.float64), want, jnp.bfloat16)
    assert_close(np.asarray(deq, np.float64), want, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_fused_kernel_on_the_gpu(kind):
    # Through Triton at a Qwen3-30B-A3B expert shape: the float64 reference's values, and a
    # layer in pieces gives the whole layer's bits.
    e, k, n = 8, 2048, 768
    w = _matrix(kind, e=e, k=k, n=n, nan_experts=(3,))
    sizes = jnp.asarray([300, 0, 1000, 0, 77, 129, 2, 500], jnp.int32)
    m = int(sizes.sum()) + 5
    x = _x(m, k)
    got = fused_grouped_matmul(x, w, sizes, interpret=False)
    assert_close(np.asarray(got, np.float64), fused_reference(x, w, sizes), jnp.bfloat16)
    bounds = row_pieces(m, 4)
    parts = [fused_grouped_matmul(x[a:b], w, piece_group_sizes(sizes, a, b), interpret=False)
             for a, b in zip(bounds, bounds[1:])]
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(parts)), np.asarray(got))


@pytest.mark.parametrize("kind,backend", [
    pytest.param("fp8", "cpu", marks=pytest.mark.slow),
    pytest.param("int4", "cpu", marks=pytest.mark.slow),
    pytest.param("fp8", "cuda", marks=pytest.mark.gpu),
    pytest.param("int4", "cuda", marks=pytest.mark.gpu)])
def test_model_arms_read_the_fused_kernel_alike(kind, backend):
    # With Kernels(quantized_matmul="fused") the resident, routed (frames ring, the last layer
    # in pieces) and stream-all (packed ring) arms give the same bits, and the logits stay
    # within the tolerance of the float64 forward of the same planes.
    from strata_jax.engine import Engine
    from strata_jax.reference import reference_forward
    from strata_jax.stream import StreamConfig, StreamTuning
    from strata_jax.synthetic import SyntheticParams
    from strata_jax.weights import QuantizedParams
    from test_quantized import FORMATS, PLAIN, _tokens

    cfg = FORMATS[kind]
    fmt = ExpertFormat.of(cfg)
    params = QuantizedParams(SyntheticParams(PLAIN, 3, 1.0), cfg)
    toks = _tokens(40)
    planes = {p.name: jnp.zeros((cfg.n_experts, *p.shape), p.dtype) for p in fmt.planes}
    assert all(resolve_quantized("fused", w) == "triton"
               for w in fmt.expert_matrices(planes))  # the kernel, not the fallback
    kernels = Kernels(quantized_matmul="fused")
    arms = {"resident": None}
    for arm, routed, layout in (("routed", True, "frames"), ("stream-all", False, "packed")):
        arms[arm] = StreamConfig(routed=routed, backend=backend, tuning=StreamTuning(
            layout=layout, tail_pieces=2, tail_from=16, stream_floor=1))
    got = {}
    for arm, stream in arms.items():
        with Engine(cfg, params, stream, max_context=64, chunk_size=64, kernels=kernels) as eng:
            r = eng.prefill(toks)
            got[arm] = (r.logits_sha256(), r.kv_sha256())
            logits = np.asarray(r.logits)
    assert len(set(got.values())) == 1, got
    want, _ = reference_forward(cfg, {n: params[n] for n in params}, toks)
    assert_close(logits, want[-1], cfg.dtype)


def test_zero_points_take_the_mosaic_kernel_or_dequantize():
    # An int4 matrix with zero-points: the Mosaic kernel reads it on Hopper when asked for
    # (fused; auto dequantizes), the Triton kernel does not (refused by name; fused then
    # dequantizes elsewhere), and grouped_matmul's rows equal the float64 reference of
    # (q - z) * scale.
    import types

    from strata_jax.quant_mosaic import MOSAIC_INT4_TILES, mosaic_int4_supports

    wz, w4 = _zero_matrix(), _matrix("int4")
    zeros = np.asarray(wz.zero)
    assert zeros.shape == (5, 2, 128) and len(np.unique(zeros)) > 1 and (zeros != 8).any()
    hopper = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200",
                                   compute_capability="9.0")
    for w in (w4, wz):
        assert resolve_quantized("fused", w, hopper) == "mosaic"
        assert resolve_quantized("dequantize", w, hopper) == "dequantize"
    assert resolve_quantized(None, w4, hopper) == "mosaic"
    assert resolve_quantized(None, wz, hopper) == "dequantize"
    for impl in (None, "fused", "dequantize"):
        assert resolve_quantized(impl, wz) == "dequantize", impl
    assert not fused_supports(wz, tiles_for(wz))
    assert mosaic_int4_supports(wz, MOSAIC_INT4_TILES)
    # the same planes read as symmetric would be another matrix: the zero plane is used
    _dequantized_rows_are_the_reference(wz, "zero-points", zero=None)


def _dequantized_rows_are_the_reference(w, refused: str, **without):
    """The Triton kernel refuses `w` naming `refused`; grouped_matmul's rows (dequantized
    first) are the float64 reference's, the rows past the groups zero; and `w` with its
    `without` fields replaced dequantizes to another matrix (those planes are read)."""
    sizes = jnp.asarray([40, 0, 17, 3, 0], jnp.int32)
    x = _x(64, w.shape[0])
    with pytest.raises(ValueError, match=f"{refused} .* use grouped_matmul"):
        fused_grouped_matmul(x, w, sizes)
    got = np.asarray(grouped_matmul(x, w, sizes)).astype(np.float64)
    want = fused_reference(x, w, np.asarray(sizes))
    assert np.isfinite(got).all()
    assert_close(got[:60], want[:60], jnp.bfloat16)
    assert (got[60:] == 0).all()
    other = dataclasses.replace(w, **without)
    assert not np.array_equal(np.asarray(other.dequantize()), np.asarray(w.dequantize()))


@pytest.mark.parametrize("zero_points", [False, True])
def test_act_order_matrices_are_read_in_stored_order(zero_points):
    # An int4 matrix with act-order (GPTQ desc_act) holds its rows in group order and a row
    # permutation: grouped_matmul reorders each row's inputs by its expert's permutation and
    # reads the stored rows as a plain int4 matrix, so the kernels read it as they read int4
    # (zero-points as zero-points are); every path's rows are the float64 reference's of the
    # matrix in input order, (q - z) * scale put back at perm's rows.
    import types

    from strata_jax.quant_matmul import in_stored_order
    from strata_jax.quant_mosaic import (MOSAIC_INT4_TILES, MosaicTiles,
                                         mosaic_int4_grouped_matmul, mosaic_int4_supports)

    e, k, n = 5, 256, 128
    fmt = ExpertFormat.make("int4", k, n, jnp.bfloat16, block=128, zero_points=zero_points,
                            act_order=True)
    w = np.random.default_rng(0).standard_normal((e, k, n)).astype(np.float32) * 0.05 + 0.02
    p = {name: jnp.asarray(v) for name, v in fmt.quantize_matrix_np("gate", w).items()}
    wa = fmt.matrix(p, "gate")
    perm = np.asarray(wa.perm)
    assert perm.shape == (e, k) and (perm != np.arange(k)).mean() > 0.3
    hopper = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200",
                                   compute_capability="9.0")
    auto = "dequantize" if zero_points else "mosaic"
    assert resolve_quantized(None, wa, hopper) == resolve_format(None, fmt, hopper) == auto
    assert resolve_quantized("fused", wa, hopper) == "mosaic"
    assert resolve_quantized(None, wa) == "dequantize"  # the CPU
    assert not fused_supports(wa) and fused_supports(wa.stored()) != zero_points
    assert not mosaic_int4_supports(wa, MOSAIC_INT4_TILES)
    assert mosaic_int4_supports(wa.stored(), MOSAIC_INT4_TILES)
    # the stored rows read in input order would be another matrix: the permutation is used
    _dequantized_rows_are_the_reference(wa, "zero-points" if zero_points else "an act-order "
                                        "matrix", perm=None)
    # the kernels on the reordered inputs (interpreted): the same rows of the reference
    sizes = jnp.asarray([40, 0, 17, 3, 0], jnp.int32)
    x = _x(64, k)
    want = fused_reference(x, wa, np.asarray(sizes))[:60]
    xs, stored = in_stored_order(x, wa, sizes)
    assert stored.perm is None and stored.q is wa.q
    again = in_stored_order(x, stored, sizes)  # a matrix without perm: as given
    assert again[0] is x and again[1] is stored
    np.testing.assert_array_equal(np.asarray(xs)[:40], np.asarray(x)[:40][:, perm[0]])
    np.testing.assert_array_equal(np.asarray(xs)[40:57], np.asarray(x)[40:57][:, perm[2]])
    # from the tokens (the model's form): row j is token rows[j], in the same gather
    tokens = _x(23, k)
    rows = jnp.asarray(np.random.default_rng(1).integers(0, 23, 64), jnp.int32)
    from_tokens, stored2 = in_stored_order(tokens, wa, sizes, rows)
    np.testing.assert_array_equal(np.asarray(from_tokens),
                                  np.asarray(in_stored_order(tokens[rows], wa, sizes)[0]))
    assert stored2.perm is None and stored2.q is wa.q
    np.testing.assert_array_equal(np.asarray(in_stored_order(tokens, stored, sizes, rows)[0]),
                                  np.asarray(tokens)[np.asarray(rows)])
    got = {"mosaic": mosaic_int4_grouped_matmul(xs, stored, sizes, interpret=True,
                                                tiles=MosaicTiles(64, 128, 128, 2, 1))}
    if not zero_points:  # the Triton kernel through grouped_matmul, which reorders
        got["triton"] = grouped_matmul(x, wa, sizes, quantized="fused")
    for name, out in got.items():
        out = np.asarray(out).astype(np.float64)
        assert_close(out[:60], want, jnp.bfloat16, err_msg=name)
        assert (out[60:] == 0).all(), name
