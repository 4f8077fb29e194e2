"""MXFP4 experts (`strata_jax.mxfp4`, the "mxfp4" expert format): the e2m1 table and the pack
halves, the OCP MX quantizer's rounding and bound, JAX and NumPy dequantizing to the same bits,
the gpt-oss checkpoint layout converted both ways, refusals, the grouped matmul's reading; and,
opt-in (torch), transformers' own `convert_moe_packed_tensors` giving our bits.

Bounds follow from the format's definition, not the dtype tolerance table (the error is the
format's, not a computation's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from strata_jax import cli
from strata_jax.experts import ExpertWeights
from strata_jax.formats import (FP4_VALUES, MXFP4_GROUP, MXFP4_PACK, ExpertFormat,
                                QuantizedMatrix, int4_halves_np, int4_values_np,
                                mxfp4_from_blocks_np, mxfp4_to_blocks_np, quantized_config)
from strata_jax.kernels.common import check_operands
from strata_jax.kernels.grouped import grouped_matmul
from strata_jax.kernels.quantized import resolve_format, resolve_quantized
from strata_jax.models import get_preset
from strata_jax.mxfp4 import e8m0_np, fp4_codes_np, mxfp4_dequantize_np, mxfp4_quantize_np
from strata_jax.reference import dequantized64
from strata_jax.testing import assert_close
from test_quant_matmul import HOPPER, OTHER_GPU, SIZES, _x, quantized_reference

# The OCP MX e2m1 table, written out: nibble -> value.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
_BF16 = np.dtype(ml_dtypes.bfloat16)


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8).tobytes()


def _random_planes(e, k, n, seed=0, lo=2, hi=255):
    """Random codes in pack halves [e, k/2, n] and e8m0 exponents in [lo, hi) [e, k/32, n]."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (e, k // 2, n), dtype=np.uint8),
            rng.integers(lo, hi, (e, k // MXFP4_GROUP, n)).astype(np.uint8))


def _random_blocks(e, n, k, seed=0, lo=110, hi=136):
    """A gpt-oss tensor's `_blocks` uint8 [e, n, k/32, 16] and `_scales` [e, n, k/32]."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (e, n, k // MXFP4_GROUP, 16), dtype=np.uint8),
            rng.integers(lo, hi, (e, n, k // MXFP4_GROUP)).astype(np.uint8))


def test_the_table_and_the_pack_halves():
    # Hand-built checkpoint blocks: out row 0 holds chosen codes, out row 1 every code in
    # turn; the planes put input p*64 + r in the low nibble of byte row r of pack p and
    # p*64 + 32 + r in its high one, and dequantize to the table times 2^(s - 127).
    np.testing.assert_array_equal(FP4_VALUES, np.asarray(E2M1, np.float32))
    assert np.signbit(FP4_VALUES[8]) and (MXFP4_GROUP, MXFP4_PACK) == (32, 64)
    k, n = 128, 2
    blocks = np.zeros((1, n, k // 32, 16), np.uint8)
    scales = np.full((1, n, k // 32), 127, np.uint8)
    blocks[0, 0, 0, 0] = 0x71  # input 0: code 1 (0.5), input 1: code 7 (6)
    blocks[0, 0, 0, 15] = 0xF9  # input 30: code 9 (-0.5), input 31: code 15 (-6)
    blocks[0, 0, 1, 0] = 0x0A  # input 32: code 10 (-1)
    blocks[0, 0, 3, 2] = 0x50  # input 100: code 0, input 101: code 5 (3)
    scales[0, 0] = [127, 129, 120, 135]  # x1, x4, x2^-7, x2^8
    j = np.arange(16, dtype=np.uint8)
    blocks[0, 1, 2] = j | ((15 - j) << 4)  # inputs 64 + 2j: code j, 64 + 2j + 1: code 15 - j
    q, s = mxfp4_from_blocks_np(blocks, scales)
    assert (q.dtype, q.shape, s.dtype, s.shape) == (np.uint8, (1, k // 2, n), np.uint8,
                                                    (1, k // 32, n))
    np.testing.assert_array_equal(s[0, :, 0], [127, 129, 120, 135])
    assert q[0, 0, 0] == 1 | (10 << 4)  # inputs 0 and 32: byte row 0 of pack 0
    assert q[0, 1, 0] == 7 and q[0, 30, 0] == 9 and q[0, 31, 0] == 15
    assert q[0, 32 + 5, 0] == 5 << 4  # input 101 = 64 + 32 + 5: pack 1's high half, row 5
    np.testing.assert_array_equal(q, int4_halves_np(int4_values_np(q, 64), 64))
    w = mxfp4_dequantize_np(q, s, np.float32)[0]  # [K, N]
    want = np.zeros((k, n), np.float32)
    want[[0, 1, 30, 31, 32, 101], 0] = [0.5, 6, -0.5, -6, -4, 3 * 2.0 ** 8]
    want[64 + 2 * j, 1] = np.asarray(E2M1, np.float32)[j]
    want[64 + 2 * j + 1, 1] = np.asarray(E2M1, np.float32)[15 - j]
    np.testing.assert_array_equal(w, want)
    assert np.signbit(w[64 + 2 * 8, 1]) and not np.signbit(w[64, 1])  # code 8 is -0
    # the e8m0 exponents: exact powers of two, 0 the subnormal 2^-127, 255 NaN
    e = e8m0_np(np.arange(256, dtype=np.uint8))
    np.testing.assert_array_equal(e[1:255], np.ldexp(np.float32(1), np.arange(1, 255) - 127))
    assert e[0] == np.float32(2.0 ** -127) and np.isnan(e[255])


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    y = np.array([0, 0.2, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 5.01, 6, 7, 9, -0.1,
                  -0.75, -2.5, -5, -100], np.float32)
    want = [0, 0, 0, 0.5, 1, 1, 2, 2, 4, 4, 6, 6, 6, 6, 0, -1, -2, -4, -6]
    got = FP4_VALUES[fp4_codes_np(y)]
    np.testing.assert_array_equal(got, np.asarray(want, np.float32))
    assert not np.signbit(got[14])  # what rounds to zero is +0
    for c in range(16):  # every value is its own code (but -0, which is +0)
        assert fp4_codes_np(FP4_VALUES[c]) == (0 if c == 8 else c)


def test_quantize_round_trip_within_its_bound():
    """OCP MX: the scale is 2^(floor(log2 amax) - 2), so amax / scale is in [4, 8): every
    |x| / scale at most 6 rounds within half e2m1's spacing there (0.5 below 2, 1 below 4, 2
    up to 6), one past 6 saturates to 6; an all-zero group has s 127 and zeros."""
    e, h, i = 2, 128, 192
    fmt = ExpertFormat.mxfp4(h, i, np.float32)
    rng = np.random.default_rng(3)
    w = ExpertWeights(*(0.05 * rng.standard_normal((e, *fmt.matrix_shape(m)))
                        for m in ("gate", "up", "down")))
    w.gate[0, :32, 5] = 0  # an all-zero group
    w.up[1, 32:64, :] *= 1e-30  # groups far below the rest
    planes = fmt.split_np(fmt.pack_np(fmt.quantize_np(w)))
    for m in ("gate", "up", "down"):
        x = getattr(w, m).astype(np.float32).astype(np.float64)
        s = planes[f"{m}_scale"]
        scale = np.repeat(2.0 ** (s.astype(np.float64) - 127), 32, axis=1)
        amax = np.abs(x).reshape(e, -1, 32, x.shape[-1]).max(2).repeat(32, 1)
        nonzero = amax > 0
        ratio = amax[nonzero] / scale[nonzero]
        assert ratio.min() >= 4 and ratio.max() < 8, m
        got = fmt.dequantize_np(planes, m, np.float32).astype(np.float64)
        y = np.abs(x) / scale
        half_step = np.where(y < 2, 0.25, np.where(y < 4, 0.5, 1.0))
        bound = np.where(y <= 6, half_step, y - 6) * scale
        assert np.all(np.abs(got - x) <= bound), m
        assert np.abs(got - x).max() > 0  # it did quantize
        assert np.linalg.norm(got - x) / np.linalg.norm(x) < 0.15
    assert planes["gate_scale"][0, 0, 5] == 127
    assert np.all(fmt.dequantize_np(planes, "gate")[0, :32, 5] == 0)
    # Values the format holds exactly come back exactly, and quantizing its own output gives
    # the same planes.
    q, s = _random_planes(3, 128, 16, seed=4, lo=100, hi=150)
    exact = mxfp4_dequantize_np(q, s, np.float32)
    q2, s2 = mxfp4_quantize_np(exact)
    np.testing.assert_array_equal(mxfp4_dequantize_np(q2, s2, np.float32), exact)
    q3, s3 = mxfp4_quantize_np(mxfp4_dequantize_np(q2, s2, np.float32))
    np.testing.assert_array_equal(q3, q2)
    np.testing.assert_array_equal(s3, s2)
    with pytest.raises(ValueError, match="not finite"):
        mxfp4_quantize_np(np.full((1, 64, 2), np.inf, np.float32))


@pytest.mark.parametrize("dtype", [_BF16, np.dtype(np.float32)], ids=["bfloat16", "float32"])
def test_jax_dequantize_is_the_numpy_one(dtype):
    # Every code and every exponent from 2 to 254 (6 * 2^127 overflows to inf, in both):
    # the device's dequantization (the format's planes split from packed blobs, under jit)
    # is the NumPy reference's, bit for bit.
    e, h, i = 3, 128, 256
    fmt = ExpertFormat.make("mxfp4", h, i, dtype)
    planes = {}
    for j, m in enumerate(("gate", "up", "down")):
        k, n = fmt.matrix_shape(m)
        planes[m], planes[f"{m}_scale"] = _random_planes(e, k, n, seed=j)
    assert {int(v) for v in planes["down_scale"].ravel()} == set(range(2, 255))
    blobs = fmt.pack_np(planes)
    got = jax.jit(lambda b: fmt.expert_weights(fmt.split(b)))(jnp.asarray(blobs))
    for m in ("gate", "up", "down"):
        want = fmt.dequantize_np(planes, m)
        a = getattr(got, m)
        assert a.dtype == dtype and a.shape == (e, *fmt.matrix_shape(m)) == want.shape
        assert np.isinf(np.asarray(a, np.float32)).any() and not np.isnan(
            np.asarray(a, np.float32)).any()
        assert _bits(a) == _bits(want), m
    # quantized planes too (the realistic exponents)
    rng = np.random.default_rng(9)
    w = ExpertWeights(*(0.02 * rng.standard_normal((e, *fmt.matrix_shape(m)), np.float32)
                        for m in ("gate", "up", "down")))
    planes = fmt.quantize_np(w)
    got = jax.jit(fmt.expert_weights)({k: jnp.asarray(v) for k, v in planes.items()})
    for m in ("gate", "up", "down"):
        assert _bits(getattr(got, m)) == _bits(fmt.dequantize_np(planes, m)), m


def test_checkpoint_blocks_convert_both_ways_bit_exact():
    # gpt-oss's [E, out, in/32, 16] blocks and [E, out, in/32] scales <-> the format's [E,
    # in/2, out] and [E, in/32, out] planes, each way the other's inverse; the values are the
    # blocks' (input 2j of a block in byte j's low nibble, 2j + 1 in its high one).
    blocks, scales = _random_blocks(3, 48, 192, seed=1)
    q, s = mxfp4_from_blocks_np(blocks, scales)
    assert (q.shape, s.shape) == ((3, 96, 48), (3, 6, 48))
    assert q.flags.c_contiguous and s.flags.c_contiguous
    b2, s2 = mxfp4_to_blocks_np(q, s)
    assert b2.dtype == s2.dtype == np.uint8
    np.testing.assert_array_equal(b2, blocks)
    np.testing.assert_array_equal(s2, scales)
    q3, s3 = _random_planes(2, 128, 24, seed=2, lo=0, hi=256)
    q4, s4 = mxfp4_from_blocks_np(*mxfp4_to_blocks_np(q3, s3))
    np.testing.assert_array_equal(q4, q3)
    np.testing.assert_array_equal(s4, s3)
    # the values, by the checkpoint's own reading (w[out, 32g + 2j + h] = lut[nibble h of
    # byte j] * 2^(s - 127)), transposed
    lut = np.asarray(E2M1, np.float64)
    nib = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(3, 48, 192)
    want = lut[nib] * 2.0 ** (np.repeat(scales, 32, axis=-1).astype(np.float64) - 127)
    got = mxfp4_dequantize_np(q, s, np.float64)
    np.testing.assert_array_equal(got, np.swapaxes(want, 1, 2))
    # a 2-D tensor (one expert) converts the same
    np.testing.assert_array_equal(mxfp4_from_blocks_np(blocks[1], scales[1])[0], q[1])
    with pytest.raises(ValueError, match=r"expected uint8 \[\.\.\., N, K/32, 16\]"):
        mxfp4_from_blocks_np(blocks[..., :8], scales)
    with pytest.raises(ValueError, match="blocks' matrix's input width 96"):
        mxfp4_from_blocks_np(blocks[:, :, :3], scales[:, :, :3])
    with pytest.raises(ValueError, match=r"scale plane uint8 \(3, 5, 48\)"):
        mxfp4_to_blocks_np(q, s[:, :5])


def test_refusals_name_the_width_and_the_block():
    with pytest.raises(ValueError, match="down matrix's input width 96 to be a multiple of 64"):
        ExpertFormat.mxfp4(128, 96, np.float32)
    with pytest.raises(ValueError, match="gate matrix's input width 96"):
        ExpertFormat.make("mxfp4", 96, 128, np.float32)
    for block in (0, None, 32):
        assert ExpertFormat.make("mxfp4", 128, 64, np.float32, block=block).block == 32
    for block in (16, 64, 128):
        with pytest.raises(ValueError, match=f"mxfp4 block={block}: .*scale group is 32"):
            ExpertFormat.make("mxfp4", 128, 64, np.float32, block=block)
    with pytest.raises(ValueError, match="zero-points are an int4 format's"):
        ExpertFormat.make("mxfp4", 128, 64, np.float32, zero_points=True)
    c = get_preset("qwen3-30b-a3b").scaled(hidden_size=128, expert_intermediate=64)
    q = quantized_config(c, "mxfp4", 32)
    assert (q.expert_format, q.expert_block) == ("mxfp4", 32)
    assert ExpertFormat.of(q) == ExpertFormat.of(c.replace(expert_format="mxfp4"))
    with pytest.raises(ValueError, match="mxfp4 block=128"):
        c.replace(expert_format="mxfp4", expert_block=128)
    with pytest.raises(ValueError, match="input width 32"):
        c.replace(expert_format="mxfp4", expert_intermediate=32)
    with pytest.raises(ValueError, match="expert_zero_points=True with expert_format='mxfp4'"):
        c.replace(expert_format="mxfp4", expert_zero_points=True)
    # a plane that is not the format's (the checkpoint's blocks, or int32 words) is named
    blocks, _ = _random_blocks(2, 64, 128)
    w = QuantizedMatrix(jnp.asarray(blocks), jnp.zeros((2, 4, 64), jnp.uint8), "mxfp4", 32,
                        (128, 64), _BF16)
    with pytest.raises(ValueError, match="mxfp4 plane uint8 .*mxfp4_from_blocks_np"):
        w.dequantize()
    with pytest.raises(ValueError, match="mxfp4 plane"):
        check_operands("k", jnp.zeros((4, 128), jnp.bfloat16), w, jnp.zeros((2,), jnp.int32))
    # the format's size: 4 + 0.25 bits a weight
    fmt = ExpertFormat.of(get_preset("qwen3-30b-a3b"), "mxfp4")
    h, i = 2048, 768
    assert fmt.blob_bytes == 3 * (h * i // 2 + h * i // 32) == 2_506_752
    assert [(p.name, p.dtype, p.shape) for p in fmt.planes[:2]] == [
        ("gate", np.uint8, (h // 2, i)), ("gate_scale", np.uint8, (h // 32, i))]


def _cli(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_cli_quantize_mxfp4_takes_its_block_and_refuses_others():
    model = ["--preset", "qwen3-30b-a3b", "--scale", "tiny", "--experts", "8", "--top-k", "2"]
    rc, _, err = _cli(["prefill", *model, "--quantize", "mxfp4", "--no-stream"])
    assert rc == 2 and "--quantize mxfp4: " in err and "input width 32" in err, err
    rc, _, err = _cli(["prefill", *model, "--expert-width", "64", "--quantize", "mxfp4",
                       "--quant-block", "64", "--no-stream"])
    assert rc == 2 and "--quantize mxfp4: mxfp4 block=64" in err, err
    rc, out, err = _cli(["info", *model, "--expert-width", "64", "--quantize", "mxfp4"])
    assert rc == 0, err
    # 6,528 bytes an expert: gate and up 64 x 64, down 64 x 64, each 4.25 bits a weight
    assert "hidden 64, expert 6.4 KiB mxfp4, bfloat16" in out, out
    assert ExpertFormat.mxfp4(64, 64, _BF16).blob_bytes == 3 * (64 * 32 + 2 * 64) == 6528


def _matrix(e=5, k=256, n=128, seed=0, nan_experts=()):
    """A QuantizedMatrix of quantized random weights; `nan_experts`' scales 255 (NaN)."""
    fmt = ExpertFormat.mxfp4(k, n, _BF16)
    w = np.random.default_rng(seed).standard_normal((e, k, n)).astype(np.float32) * 0.05
    planes = {name: jnp.asarray(v) for name, v in fmt.quantize_matrix_np("gate", w).items()}
    for i in nan_experts:  # garbage in an unrouted expert's planes must reach no row
        planes["gate_scale"] = planes["gate_scale"].at[i].set(255)
    return fmt.matrix(planes, "gate")


def test_grouped_matmul_reads_a_dequantized_mxfp4_matrix():
    # dequantize dequantizes mxfp4 first on every device, auto and fused too off Hopper (on
    # Hopper they take the kernel, tests/test_mxfp4_mosaic.py): the bits of the dequantized
    # matrix through the bf16 grouped matmul, within bf16 rounding of the float64 reference;
    # an unrouted expert's NaN reaches no row, rows past the groups are 0.
    w = _matrix(nan_experts=(1, 4))
    assert w.kind == "mxfp4" and w.block == 32 and w.scale.dtype == jnp.uint8
    fmt = ExpertFormat.mxfp4(256, 128, _BF16)
    for impl in (None, "auto", "fused", "dequantize"):
        for device in (HOPPER, OTHER_GPU, None):
            if impl == "dequantize" or device is OTHER_GPU or (
                    device is None and jax.devices()[0].platform == "cpu"):
                assert resolve_quantized(impl, w, device) == "dequantize"
        assert resolve_format(impl, fmt, HOPPER) == ("dequantize" if impl == "dequantize"
                                                     else "mosaic")
    x = _x(sum(SIZES) + 7, 256)
    sizes = jnp.asarray(SIZES, jnp.int32)
    deq = w.dequantize()
    assert deq.dtype == jnp.bfloat16 and np.isnan(np.asarray(deq[1], np.float32)).all()
    want_bits = np.asarray(grouped_matmul(x, deq, sizes))
    want = quantized_reference(x, w, SIZES)
    for impl in (None, "fused", "dequantize"):
        if resolve_quantized(impl, w) != "dequantize":
            continue  # Hopper: tests/test_mxfp4_mosaic.py checks the kernel's bits
        got = np.asarray(jax.jit(lambda x, w, s, impl=impl: grouped_matmul(
            x, w, s, quantized=impl))(x, w, sizes))
        assert _bits(got) == _bits(want_bits), impl
        assert_close(got[:200].astype(np.float64), want[:200], jnp.bfloat16)
        assert (got[200:] == 0).all()
    assert check_operands("k", x, w, sizes) == (x.shape[0], 256, 128)
    other = dataclasses.replace(w, scale=w.scale + 1)  # the scales are read
    assert not np.array_equal(np.asarray(other.dequantize()), np.asarray(deq))


def test_reference_dequantization_is_the_formats_exactly():
    # The float64 reference's formula (e2m1 from the nibble's bits) and the format's float32
    # products agree exactly (the products are exact).
    q, s = _random_planes(2, 192, 40, seed=5, lo=100, hi=160)
    ref = dequantized64("mxfp4", 32, (192, 40), q, s)
    np.testing.assert_array_equal(ref, mxfp4_dequantize_np(q, s, np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_transformers_dequantizes_checkpoint_blocks_to_our_bits(dtype):
    # transformers' own conversion of gpt-oss's blocks and scales (integrations/mxfp4.py,
    # `convert_moe_packed_tensors`: lut[nibble] then ldexp, transposed to [E, in, out])
    # against the blocks converted to our planes and dequantized: the same bits.
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    fmt_dtype = _BF16 if dtype == "bfloat16" else np.dtype(np.float32)
    # realistic exponents, then every one from 2 to 254 (6 * 2^127 is inf in both)
    for lo, hi in ((110, 136), (2, 255)):
        blocks, scales = _random_blocks(4, 96, 256, seed=7, lo=lo, hi=hi)
        theirs = mx.convert_moe_packed_tensors(torch.from_numpy(blocks),
                                               torch.from_numpy(scales),
                                               dtype=getattr(torch, dtype))
        theirs = theirs.float().numpy()
        ours = mxfp4_dequantize_np(*mxfp4_from_blocks_np(blocks, scales), fmt_dtype)
        assert ours.shape == theirs.shape == (4, 256, 96)
        assert _bits(ours.astype(np.float32)) == _bits(theirs), (lo, hi)  # zeros' signs too
    q, s = mxfp4_from_blocks_np(blocks, scales)  # and JAX's, from the planes
    w = QuantizedMatrix(jnp.asarray(q), jnp.asarray(s), "mxfp4", 32, (256, 96), fmt_dtype)
    assert _bits(np.asarray(jax.jit(QuantizedMatrix.dequantize)(w), np.float32)) == _bits(theirs)
