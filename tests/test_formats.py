"""Expert formats (strata_jax.formats): today's blob as data, and the fp8 / int4 layouts.

The quantized round trips are checked against bounds that follow from each format's definition
(not the dtype tolerance table: the error is the format's, not a computation's).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from strata_jax.models import get_preset
from strata_jax.experts import ExpertWeights, pack_expert_blobs_np, unpack_expert_blobs_np
from strata_jax.formats import (ExpertFormat, Plane, gptq_halves_np, int4_halves_np,
                                int4_values_np)

_BF16 = np.dtype(ml_dtypes.bfloat16)


def _bits(a) -> bytes:
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.uint8).tobytes()


def _experts(e, h, i, dtype=np.float64, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return ExpertWeights(*((scale * rng.standard_normal(s)).astype(dtype)
                           for s in ((e, h, i), (e, h, i), (e, i, h))))


def _old_pack(w: ExpertWeights) -> np.ndarray:
    """The packing before formats existed: concat(gate, up, down) raveled per expert."""
    e = w.gate.shape[0]
    return np.concatenate([np.asarray(a).reshape(e, -1) for a in (w.gate, w.up, w.down)], axis=1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_plain_format_is_todays_blob(dtype):
    c = get_preset("qwen3-30b-a3b").scaled(hidden_size=24, expert_intermediate=10, n_experts=4,
                                           param_dtype=dtype)
    fmt = ExpertFormat.of(c)
    assert fmt.kind == "plain" and fmt.name == dtype and fmt.uniform == c.dtype
    h, i = c.hidden_size, c.expert_intermediate
    assert [(p.name, p.dtype, p.shape) for p in fmt.planes] == [
        ("gate", c.dtype, (h, i)), ("up", c.dtype, (h, i)), ("down", c.dtype, (i, h))]
    it = c.dtype.itemsize
    assert fmt.offsets == (0, h * i * it, 2 * h * i * it)
    assert fmt.blob_bytes == 3 * h * i * it == c.expert_bytes
    w = _experts(c.n_experts, h, i, c.dtype, seed=1)
    old = _old_pack(w)
    # Read with the format, as bytes and as elements: the very tensors, bit for bit.
    for planes in (fmt.split_np(old), fmt.split_np(old.view(np.uint8))):
        for m in ("gate", "up", "down"):
            assert _bits(planes[m]) == _bits(getattr(w, m))
    jplanes = jax.jit(fmt.split)(jnp.asarray(old.view(np.uint8)))
    assert all(_bits(jplanes[m]) == _bits(getattr(w, m)) for m in ("gate", "up", "down"))
    # The packing now reads the format: the same bytes as the old code.
    assert _bits(fmt.pack_np(w._asdict())) == _bits(old)
    assert _bits(pack_expert_blobs_np(w)) == _bits(old)
    assert _bits(fmt.pack({k: jnp.asarray(v) for k, v in w._asdict().items()})) == _bits(old)
    views = unpack_expert_blobs_np(old, h, i)
    assert np.shares_memory(views.down, old)  # still views, no copy
    with pytest.raises(ValueError, match=r"expected \[E, 720\]"):
        fmt.split_np(old[:, :-1])


def test_formats_of_qwen3_30b_a3b():
    c = get_preset("qwen3-30b-a3b")
    h, i = c.hidden_size, c.expert_intermediate  # 2048, 768
    plain, fp8, int4 = (ExpertFormat.of(c, k) for k in ("plain", "fp8", "int4"))
    assert plain.name == "bfloat16" and plain.blob_bytes == 3 * h * i * 2 == 9_437_184
    assert [(p.name, p.dtype, p.shape) for p in fp8.planes] == [
        ("gate", np.dtype(ml_dtypes.float8_e4m3fn), (h, i)),
        ("gate_scale", np.dtype(np.float32), (h // 128, i // 128)),
        ("up", np.dtype(ml_dtypes.float8_e4m3fn), (h, i)),
        ("up_scale", np.dtype(np.float32), (h // 128, i // 128)),
        ("down", np.dtype(ml_dtypes.float8_e4m3fn), (i, h)),
        ("down_scale", np.dtype(np.float32), (i // 128, h // 128))]
    assert fp8.blob_bytes == 3 * (h * i + 16 * 6 * 4) == 4_719_744
    assert [(p.name, p.dtype, p.shape) for p in int4.planes] == [
        ("gate", np.dtype(np.uint8), (h // 2, i)),
        ("gate_scale", np.dtype(np.float16), (h // 128, i)),
        ("up", np.dtype(np.uint8), (h // 2, i)),
        ("up_scale", np.dtype(np.float16), (h // 128, i)),
        ("down", np.dtype(np.uint8), (i // 2, h)),
        ("down_scale", np.dtype(np.float16), (i // 128, h))]
    assert int4.blob_bytes == 3 * (h * i // 2 + 16 * i * 2) == 2_433_024
    # fp8: half of bf16 plus its scales; int4: a quarter plus its scales.
    assert fp8.blob_bytes == plain.blob_bytes // 2 + 3 * 16 * 6 * 4
    assert int4.blob_bytes == plain.blob_bytes // 4 + 3 * 16 * i * 2
    assert 0.500 < fp8.blob_bytes / plain.blob_bytes < 0.501
    assert 0.25 < int4.blob_bytes / plain.blob_bytes < 0.26
    for fmt in (fp8, int4):  # planes back to back, each aligned to its dtype
        for p, o in zip(fmt.planes, fmt.offsets):
            assert o % p.dtype.itemsize == 0
        assert fmt.offsets[1:] == tuple(np.cumsum([p.nbytes for p in fmt.planes])[:-1])


def test_bad_formats_are_refused():
    with pytest.raises(ValueError, match="'nf4' is not implemented"):
        ExpertFormat.make("nf4", 256, 128, np.float32)
    with pytest.raises(ValueError, match="down matrix's input width 96"):
        ExpertFormat.int4(256, 96, np.float32)
    with pytest.raises(ValueError, match="multiple of 8"):
        ExpertFormat.int4(256, 128, np.float32, group=12)
    fmt = ExpertFormat.fp8(256, 128, np.float32)
    planes = fmt.quantize_np(_experts(1, 256, 128))
    planes["gate_scale"] = planes["gate_scale"].astype(np.float16)
    with pytest.raises(ValueError, match="plane gate_scale is float16"):
        fmt.pack_np(planes)
    with pytest.raises(KeyError, match="no plane 'qzeros'"):
        fmt.plane("qzeros")


def _round_trip(fmt, w):
    """Quantize, pack, split the packed bytes (NumPy and JAX), dequantize: (planes, numpy
    float32 matrices)."""
    blobs = fmt.pack_np(fmt.quantize_np(w))
    assert blobs.shape == (w.gate.shape[0], fmt.blob_bytes) and blobs.dtype == np.uint8
    planes = fmt.split_np(blobs)
    jplanes = jax.jit(fmt.split)(jnp.asarray(blobs))
    for name, a in planes.items():
        assert jplanes[name].dtype == a.dtype and _bits(jplanes[name]) == _bits(a)
    return planes, {m: fmt.dequantize_np(planes, m, np.float32) for m in ("gate", "up", "down")}


def test_fp8_round_trip_within_its_bound():
    """Block-scaled e4m3: scale s = amax(block) / 448; e4m3 keeps 3 mantissa bits, so a
    normal value rounds within 2^-4 of itself and a subnormal one (|x/s| < 2^-6) within half
    its spacing 2^-9 (times s); float32's own roundings add a few 2^-24."""
    e, h, i, b = 2, 256, 160, 128  # 160: a partial block at the edge
    fmt = ExpertFormat.fp8(h, i, np.float32, block=b)
    w = _experts(e, h, i, scale=0.02)
    w = w._replace(up=w.up * np.where(np.arange(h) < 128, 1e-3, 1.0)[:, None])  # mixed blocks
    planes, got = _round_trip(fmt, w)
    for m in ("gate", "up", "down"):
        x = getattr(w, m)
        k, n = fmt.matrix_shape(m)
        s = np.repeat(np.repeat(planes[f"{m}_scale"], b, 1), b, 2)[:, :k, :n].astype(np.float64)
        err = np.abs(got[m].astype(np.float64) - x)
        assert np.all(np.isfinite(got[m]))
        assert np.all(err <= np.abs(x) * (2**-4 + 2**-20) + s * 2**-10), m
        assert err.max() > 0  # it did quantize
        rel = np.linalg.norm(err) / np.linalg.norm(x)
        assert rel < 2**-4  # typical error far below the worst case


def test_int4_round_trip_within_its_bound():
    """Symmetric group-wise int4 (GPTQ's values): the float16 scale s >= amax(group) / 7.5, so
    every |x| / s <= 7.5 and q - 8 = round(x / s) in [-8, 7] lands within s / 2 of x / s."""
    e, h, i, g = 2, 256, 128, 64
    fmt = ExpertFormat.int4(h, i, np.float32, group=g)
    w = _experts(e, h, i, scale=0.02, seed=3)
    w = w._replace(gate=w.gate.copy())
    w.gate[0, :g, :] = 0  # an all-zero group
    planes, got = _round_trip(fmt, w)
    for m in ("gate", "up", "down"):
        x = getattr(w, m)
        s = np.repeat(planes[f"{m}_scale"].astype(np.float64), g, axis=1)
        amax = np.abs(x).reshape(e, -1, g, x.shape[-1]).max(2).repeat(g, 1)
        assert np.all(s * 7.5 >= amax * (1 - 2**-23))  # amax of the float32-rounded x
        err = np.abs(got[m].astype(np.float64) - x)
        assert np.all(err <= s / 2 + np.abs(x) * 2**-22), m
        assert err.max() > 0
    assert np.all(got["gate"][0, :g] == 0)
    # The group halves: byte row r of group j holds row j*g + r in its low nibble and
    # j*g + g/2 + r in its high one.
    b = planes["down"].reshape(e, i // g, g // 2, h).astype(np.int64)
    q = np.concatenate([b % 16, b // 16], axis=2).reshape(e, i, h).astype(np.float64) - 8
    np.testing.assert_array_equal(q * np.repeat(planes["down_scale"], g, 1), got["down"])


@pytest.mark.parametrize("zero_points", [False, True])
def test_int4_act_order_stores_rows_in_group_order(zero_points):
    """Act-order (GPTQ desc_act): a row-order plane per matrix after its other planes; the
    rows are stored in group order (the largest-magnitude rows first), each stored group of
    rows gets its own scale, the plane names each stored row's input row, and the round
    trip's error is within s / 2 of each row's own group's scale, back in input order."""
    from strata_jax.formats import g_idx_perm, perm_g_idx

    e, h, i, g = 2, 256, 128, 64
    fmt = ExpertFormat.int4(h, i, np.float32, group=g, zero_points=zero_points, act_order=True)
    assert fmt.act_order and fmt.name == ("int4-zp-act" if zero_points else "int4-act")
    side = ["_scale", "_zero", "_perm"] if zero_points else ["_scale", "_perm"]
    assert [p.name for p in fmt.planes] == [m + sfx for m in ("gate", "up", "down")
                                            for sfx in ["", *side]]
    assert fmt.plane("down_perm") == Plane("down_perm", np.int32, (i,))
    plain = ExpertFormat.int4(h, i, np.float32, group=g, zero_points=zero_points)
    assert fmt.blob_bytes == plain.blob_bytes + 4 * (2 * h + i)
    w = _experts(e, h, i, scale=0.02, seed=3)
    planes, got = _round_trip(fmt, w)
    for m in ("gate", "up", "down"):
        x, perm = getattr(w, m), planes[f"{m}_perm"]
        k = x.shape[1]
        assert perm.dtype == np.int32 and perm.shape == (e, k)
        for p in perm:  # a permutation, not the identity
            np.testing.assert_array_equal(np.sort(p), np.arange(k))
            assert (p != np.arange(k)).mean() > 0.3
        amax = np.take_along_axis(np.abs(x).max(axis=2), perm, axis=1)  # in stored order
        assert np.all(amax[:, :g].min(axis=1) >= amax[:, g:2 * g].max(axis=1))
        rows = perm_g_idx(perm, g)  # each input row's group
        np.testing.assert_array_equal(g_idx_perm(rows, g), perm)
        s = np.take_along_axis(planes[f"{m}_scale"].astype(np.float64), rows[:, :, None], 1)
        err = np.abs(got[m].astype(np.float64) - x)
        assert np.all(err <= s / 2 + np.abs(x) * 2**-22), m
    with pytest.raises(ValueError, match="group 0 holds 63 rows, not 64"):
        g_idx_perm(np.r_[np.zeros(63), np.ones(65), np.full(128, 2), np.full(128, 3)]
                   .astype(np.int32), g)
    with pytest.raises(ValueError, match="groups outside 0 .. 3"):
        g_idx_perm(np.full(256, 4, np.int32), g)
    with pytest.raises(ValueError, match="act-order group indices are an int4 format's"):
        ExpertFormat.make("fp8", h, i, np.float32, act_order=True)
    c = get_preset("qwen3-30b-a3b").scaled(hidden_size=256, expert_intermediate=128)
    for name in ("expert_act_order", "expert_zero_points"):
        with pytest.raises(ValueError, match=f"{name}=True with expert_format='fp8'"):
            c.replace(expert_format="fp8", **{name: True})
        with pytest.raises(ValueError, match=f"{name} must be a bool, got 'yes'"):
            c.replace(expert_format="int4", expert_block=64, **{name: "yes"})
    from strata_jax.formats import quantized_config

    q = quantized_config(c, "int4-act", 64)
    assert (q.expert_format, q.expert_zero_points, q.expert_act_order) == ("int4", False, True)
    assert ExpertFormat.of(q).name == "int4-act"


def test_int4_halves_are_gptq_words_rearranged():
    # GPTQ's qweight (row 8r + j in bits 4j..4j+3 of word r) and the format's group halves
    # hold the same values: each group's first half in the low nibbles of its byte rows, its
    # second half in the high nibbles; `int4_values_np` undoes either packing's values.
    rng = np.random.default_rng(5)
    e, k, n, g = 2, 256, 24, 128
    vals = rng.integers(0, 16, (e, k, n), dtype=np.uint8)
    words = np.bitwise_or.reduce(vals.reshape(e, k // 8, 8, n).astype(np.uint32)
                                 << (4 * np.arange(8, dtype=np.uint32))[:, None], axis=2)
    words = words.view(np.int32)
    halves = gptq_halves_np(words, g)
    assert halves.dtype == np.uint8 and halves.shape == (e, k // 2, n)
    np.testing.assert_array_equal(halves, int4_halves_np(vals, g))
    for j in range(k // g):
        rows = halves[:, j * g // 2:(j + 1) * g // 2]
        np.testing.assert_array_equal(rows & 15, vals[:, j * g:j * g + g // 2])
        np.testing.assert_array_equal(rows >> 4, vals[:, j * g + g // 2:(j + 1) * g])
    np.testing.assert_array_equal(int4_values_np(halves, g), vals)
    np.testing.assert_array_equal(int4_values_np(gptq_halves_np(words[0], g), g), vals[0])
    with pytest.raises(ValueError, match="not whole groups of 128"):
        int4_halves_np(vals[:, :64], g)
    with pytest.raises(ValueError, match="not whole groups of 128"):
        int4_values_np(halves[:, :32], g)


@pytest.mark.parametrize("kind", ["plain", "fp8", "int4", "int4-act"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_jax_dequantize_is_the_numpy_one(kind, dtype):
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    e, h, i = 2, 128, 192
    fmt = ExpertFormat.make(kind.removesuffix("-act"), h, i, dtype, block=64,
                            act_order=kind.endswith("-act"))
    w = _experts(e, h, i, scale=0.05, seed=7)
    planes = fmt.split_np(fmt.pack_np(fmt.quantize_np(w)))
    got = jax.jit(fmt.expert_weights)({k: jnp.asarray(v) for k, v in planes.items()})
    for m in ("gate", "up", "down"):
        want = fmt.dequantize_np(planes, m)
        a = getattr(got, m)
        assert a.dtype == dtype and a.shape == (e, *fmt.matrix_shape(m))
        assert np.all(np.isfinite(np.asarray(a).astype(np.float32)))
        assert _bits(a) == _bits(want), (kind, m)


def test_plane_is_hashable_data():
    a = Plane("gate", "float32", (2, 3))
    assert a == Plane("gate", np.float32, [2, 3]) and hash(a) == hash(Plane("gate", np.float32,
                                                                           (2, 3)))
    assert a.nbytes == 24
    assert ExpertFormat.plain(4, 8, _BF16) == ExpertFormat.plain(4, 8, _BF16)
