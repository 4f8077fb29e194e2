"""MXFP4 (OCP Microscaling FP4): the numerics and byte layout of the "mxfp4" expert format
(`strata_jax.formats`), gpt-oss's routed experts.

A weight is a 4-bit e2m1 code (sign, two exponent bits, one mantissa bit; `FP4_VALUES`: 0, 0.5,
1, 1.5, 2, 3, 4, 6 and their negatives), and each `MXFP4_GROUP` = 32 consecutive inputs of a
column share one e8m0 scale, a biased power-of-two exponent s: w = FP4_VALUES[code] *
2**(s - 127) (s = 255 is NaN). 4.25 bits a weight.

Per matrix of shape [K, N] (the model's [in, out]; K a multiple of `MXFP4_PACK` = 64):
    m        uint8 [K/2, N], the codes in pack halves: byte row r of pack p holds input p*64 + r
             in its low nibble and p*64 + 32 + r in its high one (`int4_halves_np(codes, 64)`),
             so each nibble half of a pack's 32-row byte tile is exactly one scale group;
    m_scale  uint8 [K/32, N], the e8m0 exponents.
The published gpt-oss checkpoints hold `X_blocks` uint8 [E, out, in/32, 16] (byte j of a block
holding input 2j in its low nibble and 2j + 1 in its high one) and `X_scales` uint8 [E, out,
in/32], [out, in]; `mxfp4_from_blocks_np` and `mxfp4_to_blocks_np` convert, bit exact.

Dequantizing (NumPy `mxfp4_dequantize_np`, JAX `mxfp4_dequantize`) makes each value one float32
product FP4_VALUES[code] * 2**(s - 127), exact, and one cast to the output dtype: the two agree
bit for bit, and with transformers' `convert_moe_packed_tensors` (its lut times `ldexp`), for
every s from 2 to 254. Below that a product can be a float32 subnormal, which XLA flushes to
zero on the CPU (NumPy keeps it): weights under 2**-126, none in a real checkpoint.

Quantizing (`mxfp4_quantize_np`) is the OCP MX rule: the group's scale 2**(floor(log2 amax) - 2)
(2 = e2m1's largest exponent; an all-zero group takes s = 127), each x / scale rounded to the
nearest e2m1 value, ties to the even mantissa, magnitudes past 6 saturating to 6 (zero as +0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.nibbles import int4_halves_np, int4_values_np

__all__ = ["E8M0_BIAS", "FP4_VALUES", "MXFP4_GROUP", "MXFP4_PACK", "check_mxfp4_block",
           "check_mxfp4_plane", "check_mxfp4_width", "e8m0_np", "fp4_codes_np", "mxfp4_dequantize",
           "mxfp4_dequantize_np", "mxfp4_from_blocks_np", "mxfp4_quantize_np", "mxfp4_to_blocks_np"]

# e2m1 code -> value: bit 3 the sign, bits 2..1 the exponent, bit 0 the mantissa.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
MXFP4_GROUP = 32  # inputs per e8m0 scale (OCP MX block size)
MXFP4_PACK = 64  # inputs per byte tile: two scale groups, one in each nibble half
E8M0_BIAS = 127
_FP4_MAX = 6.0
_E2M1_EMAX = 2  # e2m1's largest exponent: the OCP MX scale is 2**(floor(log2 amax) - 2)
_BLOCK_BYTES = MXFP4_GROUP // 2  # a checkpoint block's bytes


def check_mxfp4_block(block: int | None) -> None:
    """A ValueError unless `block` (`ModelConfig.expert_block`, --quant-block) is mxfp4's:
    0 / None (the default) or 32."""
    if block not in (None, 0, MXFP4_GROUP):
        raise ValueError(f"mxfp4 block={block}: the format's scale group is {MXFP4_GROUP} "
                         f"inputs (OCP MX), the only one it has; give 0 or {MXFP4_GROUP}")


def check_mxfp4_width(matrix: str, k: int) -> None:
    """A ValueError unless input width `k` of `matrix` is whole packs of 64 inputs."""
    if k % MXFP4_PACK:
        raise ValueError(
            f"mxfp4 experts need the {matrix} matrix's input width {k} to be a multiple of "
            f"{MXFP4_PACK} (a byte tile holds two {MXFP4_GROUP}-input scale groups)")


def check_mxfp4_plane(q, shape: tuple[int, int]) -> None:
    """A ValueError unless `q` is an mxfp4 plane as the format makes it: uint8 [..., K/2, N],
    the codes in pack halves (not the checkpoint's [..., N, K/32, 16] blocks)."""
    k, n = shape
    if np.dtype(q.dtype) != np.uint8 or tuple(q.shape[-2:]) != (k // 2, n) or k % MXFP4_PACK:
        raise ValueError(
            f"mxfp4 plane {np.dtype(q.dtype).name} {tuple(q.shape)} of a [{k}, {n}] matrix: "
            f"expected uint8 [..., {k // 2}, {n}] (codes in pack halves of {MXFP4_PACK}, K a "
            "multiple of 64); checkpoint blocks convert with "
            "strata_jax.formats.mxfp4_from_blocks_np")


def _e8m0_bits(s, xp):
    """float32 bits of 2**(s - 127) for e8m0 exponents `s` (uint32): s << 23 for 1..254, the
    subnormal 2**-127 for 0, NaN for 255."""
    return xp.where(s == 0, xp.uint32(0x00400000),
                    xp.where(s == 255, xp.uint32(0x7FC00000), s << xp.uint32(23)))


def e8m0_np(s) -> np.ndarray:
    """float32 2**(s - 127) of e8m0 exponents `s` (uint8), exactly (255: NaN)."""
    bits = _e8m0_bits(np.asarray(s).astype(np.uint32), np)
    return np.ascontiguousarray(bits, np.uint32).view(np.float32)


def fp4_codes_np(y) -> np.ndarray:
    """The nearest e2m1 code (uint8, `FP4_VALUES`) of each float `y`: ties to the even
    mantissa, magnitudes past 6 saturating to 6, zero (and what rounds to it) +0."""
    a = np.minimum(np.abs(np.asarray(y, np.float32)), np.float32(_FP4_MAX))
    # e2m1's spacing: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; an even count of steps is an
    # even mantissa, so rounding the count half to even rounds ties to the even mantissa.
    step = np.where(a < 2, np.float32(0.5), np.where(a < 4, np.float32(1), np.float32(2)))
    mag = np.round(a / step) * step
    code = np.searchsorted(FP4_VALUES[:8], mag).astype(np.uint8)
    return np.where((np.asarray(y) < 0) & (code > 0), code | 8, code).astype(np.uint8)


def mxfp4_quantize_np(x) -> tuple[np.ndarray, np.ndarray]:
    """Weights x [..., K, N] (any float dtype) -> (codes in pack halves uint8 [..., K/2, N],
    e8m0 exponents uint8 [..., K/32, N]) by the OCP MX rule (module docstring)."""
    x = np.asarray(x, np.float32)
    *lead, k, n = x.shape
    check_mxfp4_width("quantized", k)
    if not np.all(np.isfinite(x)):
        raise ValueError("mxfp4 quantization: a weight is not finite")
    g = x.reshape(*lead, k // MXFP4_GROUP, MXFP4_GROUP, n)
    amax = np.abs(g).max(axis=-2)  # [..., K/32, N]
    _, e = np.frexp(amax)  # amax = f * 2**e, f in [0.5, 1): floor(log2 amax) = e - 1
    s = np.where(amax > 0, e - 1 - _E2M1_EMAX + E8M0_BIAS, E8M0_BIAS)
    s = np.clip(s, 0, 254).astype(np.int32)
    y = np.ldexp(g, (E8M0_BIAS - s)[..., None, :]).astype(np.float32)  # x / scale, exact
    codes = fp4_codes_np(y).reshape(*lead, k, n)
    return int4_halves_np(codes, MXFP4_PACK), s.astype(np.uint8)


def mxfp4_dequantize_np(q, scale, dtype) -> np.ndarray:
    """NumPy: the weights [..., K, N] in `dtype` of codes in pack halves q uint8 [..., K/2,
    N] and e8m0 exponents scale uint8 [..., K/32, N]: one float32 product and one cast each."""
    q = np.asarray(q)
    codes = int4_values_np(q, MXFP4_PACK)  # [..., K, N]
    s = np.repeat(e8m0_np(scale), MXFP4_GROUP, axis=-2)
    with np.errstate(over="ignore"):  # 6 * 2**127 is inf, as on the device
        return (FP4_VALUES[codes] * s).astype(dtype)


def mxfp4_dequantize(q: jax.Array, scale: jax.Array, shape: tuple[int, int],
                     dtype) -> jax.Array:
    """JAX `mxfp4_dequantize_np` of one matrix's planes ([..., K/2, N] and [..., K/32, N];
    `shape` (K, N)): the same float32 products and cast, in one elementwise fusion (each
    pack's two nibble halves by one broadcast shift, each half's scale broadcast)."""
    k, n = shape
    check_mxfp4_plane(q, shape)
    lead = q.shape[:-2]
    # [..., pack, half (= its scale group), row of the half, column]
    b = q.astype(jnp.uint32).reshape(*lead, k // MXFP4_PACK, 1, MXFP4_PACK // 2, n)
    shift = jnp.asarray([0, 4], jnp.uint32).reshape(2, 1, 1)
    codes = (b >> shift) & jnp.uint32(15)
    vals = jnp.asarray(FP4_VALUES)[codes.astype(jnp.int32)]
    bits = _e8m0_bits(scale.astype(jnp.uint32), jnp)
    s = jax.lax.bitcast_convert_type(bits, jnp.float32).reshape(*lead, k // MXFP4_PACK, 2, 1, n)
    return (vals * s).astype(dtype).reshape(*lead, k, n)


def mxfp4_from_blocks_np(blocks, scales) -> tuple[np.ndarray, np.ndarray]:
    """A checkpoint's MXFP4 tensor ([out, in]: `X_blocks` uint8 [..., N, K/32, 16], `X_scales`
    uint8 [..., N, K/32]) -> the format's planes ([in, out]: codes in pack halves uint8 [...,
    K/2, N], e8m0 exponents uint8 [..., K/32, N]): the same codes and exponents, moved.
    A ValueError where the shapes disagree or K is not a multiple of 64."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if (blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.ndim < 3
            or blocks.shape[-1] != _BLOCK_BYTES or blocks.shape[:-1] != scales.shape):
        raise ValueError(
            f"mxfp4 blocks {blocks.dtype} {blocks.shape} and scales {scales.dtype} "
            f"{scales.shape}: expected uint8 [..., N, K/32, {_BLOCK_BYTES}] and uint8 "
            "[..., N, K/32]")
    *lead, n, groups, _ = blocks.shape
    check_mxfp4_width("blocks'", groups * MXFP4_GROUP)
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1)  # [..., N, K/32, 16, 2]: 2j, 2j + 1
    codes = np.swapaxes(codes.reshape(*lead, n, groups * MXFP4_GROUP), -1, -2)  # [..., K, N]
    return (np.ascontiguousarray(int4_halves_np(codes, MXFP4_PACK)),
            np.ascontiguousarray(np.swapaxes(scales, -1, -2)))


def mxfp4_to_blocks_np(q, scale) -> tuple[np.ndarray, np.ndarray]:
    """`mxfp4_from_blocks_np` undone: the format's planes (uint8 [..., K/2, N], [..., K/32,
    N]) -> the checkpoint's (`X_blocks` uint8 [..., N, K/32, 16], `X_scales` [..., N, K/32]),
    e.g. to write a gpt-oss checkpoint."""
    q, scale = np.asarray(q), np.asarray(scale)
    *lead, k2, n = q.shape
    check_mxfp4_plane(q, (2 * k2, n))
    if scale.dtype != np.uint8 or scale.shape != (*lead, 2 * k2 // MXFP4_GROUP, n):
        raise ValueError(f"mxfp4 scale plane {scale.dtype} {scale.shape}: expected uint8 "
                         f"{(*lead, 2 * k2 // MXFP4_GROUP, n)}")
    codes = np.swapaxes(int4_values_np(q, MXFP4_PACK), -1, -2)  # [..., N, K]
    pairs = codes.reshape(*lead, n, 2 * k2 // MXFP4_GROUP, _BLOCK_BYTES, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return (np.ascontiguousarray(blocks, np.uint8),
            np.ascontiguousarray(np.swapaxes(scale, -1, -2)))
