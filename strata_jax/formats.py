"""Expert formats: an expert's bytes described as data.

An `ExpertFormat` lists the planes of one routed expert's blob (the contiguous row one copy
moves), each a `Plane` with a name, a storage dtype and a per-expert shape; scales are planes of
their own. Everything that packs, splits or counts an expert's bytes reads the format instead of
assuming "three equal planes of one dtype".

Formats (H = hidden_size, I = expert_intermediate; every matrix in the model's orientation,
[in, out]: gate and up [H, I], down [I, H]):

    plain  (name: the dtype's, e.g. "bfloat16")   today's blob, byte for byte:
        gate [H, I], up [H, I], down [I, H] in the parameter dtype, back to back.
    fp8    e4m3 weights with 128 x 128 block scales (the scheme of Qwen/Qwen3-30B-A3B-FP8):
        per matrix m of shape [K, N]: m float8_e4m3fn [K, N], then m_scale float32
        [ceil(K/128), ceil(N/128)], the checkpoint's `weight_scale_inv` (a multiplier):
        w[k, n] = float(m[k, n]) * m_scale[k // 128, n // 128]. The checkpoint stores
        `weight` [N, K] ([out, in]) and `weight_scale_inv` [ceil(N/128), ceil(K/128)]; both
        are transposed into this orientation on load (a transposed block grid is a block grid).
    int4   GPTQ's values and scales, group G = 128 along the input dim, the 4-bit
        values in group halves: per matrix m of shape [K, N]: m uint8 [K/2, N], byte row r of
        group g (rows g*G/2 .. g*G/2 + G/2 - 1) holding input row g*G + r in its low nibble
        and g*G + G/2 + r in its high one, then m_scale float16 [K/G, N] (GPTQ `scales`):
        w[k, n] = (q[k, n] - 8) * m_scale[k // G, n]. The bytes are GPTQ `qweight`'s (int32
        [K/8, N], row 8r + j in bits 4j..4j+3 of word [r, n]) rearranged within each group
        (`gptq_halves_np`, on load): a group's byte tile is what the fused Mosaic kernel
        reads a k step (a 16-row tile of words has no layout it can unpack).
        GPTQ's [in, out] is already the model's orientation. Symmetric (GPTQ `sym: true`) has
        the implicit zero 8. With zero-points (asymmetric GPTQ, `ModelConfig.expert_zero_points`)
        each matrix has a third plane, m_zero uint8 [K/G, N], one zero-point per group and
        column (GPTQ `qzeros`, int32 [K/G, N/8], eight 4-bit zeros per word along N, unpacked
        on load; GPTQ's v1 checkpoints store them minus one, so 0..16 once read):
        w[k, n] = (q[k, n] - m_zero[k // G, n]) * m_scale[k // G, n]. With act-order (GPTQ
        `desc_act: true`, `ModelConfig.expert_act_order`) a row's group is the checkpoint's
        `g_idx`, not k // G: the rows are stored sorted by group (stable), so that each group's
        rows are contiguous as above, and a last plane per matrix, m_perm int32 [K], names the
        input row each stored row is: w[m_perm[i], n] = (q[i, n] - z[i // G, n]) *
        m_scale[i // G, n] (z: 8 or m_zero). x @ w is then x[:, m_perm] @ (the stored rows):
        the expert math gathers each row's inputs by its expert's m_perm and reads the rest
        as plain int4 (GPTQ's groups hold G rows each; `act_order_perm`).
    mxfp4  OCP Microscaling FP4 (gpt-oss's experts; `strata_jax.mxfp4`): per matrix m of shape
        [K, N], K a multiple of 64: m uint8 [K/2, N], e2m1 codes in pack halves (byte row r of
        pack p holds input p*64 + r in its low nibble and p*64 + 32 + r in its high one:
        `int4_halves_np(codes, 64)`), then m_scale uint8 [K/32, N], one e8m0 exponent s per 32
        inputs: w[k, n] = FP4_VALUES[code] * 2**(m_scale[k // 32, n] - 127). The checkpoints'
        `_blocks` [N, K/32, 16] and `_scales` [N, K/32] convert with `mxfp4_from_blocks_np`.

Plane order in a blob: each matrix's weight plane followed by its scale plane (and int4's
zero-point and row-permutation planes), matrices in the order gate, up, down; then, with expert
biases (`ModelConfig.expert_bias`, gpt-oss), gate_bias [I], up_bias [I] and down_bias [H] in the
parameter dtype, whatever the format: a bias streams with its expert's weights. Each plane
starts at a multiple of its dtype's size (padding zero bytes where needed; the plain format
never needs any).

Quantizing (`quantize_np`) is round-to-nearest with the block/group scale from the amax (int4
with zero-points: from the group's min and max, GPTQ's asymmetric grid; with act-order each
matrix's rows grouped in descending order of their largest magnitude, a stand-in for GPTQ's
order, which needs calibration data; mxfp4: the OCP MX rule, `mxfp4_quantize_np`); it makes
the layout of those checkpoints, not their values (GPTQ's calibrated rounding is not redone).
Dequantizing: `dequantize_np` (NumPy reference) and `dequantize` (JAX, what the device runs)
compute each value as one float32 product and one cast to the output dtype, so the two agree
bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from strata_jax.mxfp4 import (  # noqa: F401 - the conversions re-exported for the checkpoints
    FP4_VALUES, MXFP4_GROUP, MXFP4_PACK, check_mxfp4_block, check_mxfp4_plane, check_mxfp4_width,
    mxfp4_dequantize, mxfp4_dequantize_np, mxfp4_from_blocks_np, mxfp4_quantize_np,
    mxfp4_to_blocks_np
)
from strata_jax.gptq import (  # noqa: F401 - GPTQ's layouts re-exported for the checkpoints
    INT4_PER_WORD, act_order_g_idx, act_order_perm, g_idx_perm, gptq_halves_np, perm_g_idx,
    unequal_group
)
from strata_jax.nibbles import int4_halves_np, int4_values_np

if TYPE_CHECKING:
    from strata_jax.config import ModelConfig

class ExpertWeights(NamedTuple):
    """One MoE layer's routed SwiGLU experts (jax or numpy arrays).

    Attributes:
        gate: [E, H, I] gate projection.
        up: [E, H, I] up projection.
        down: [E, I, H] down projection.
    """

    gate: jax.Array
    up: jax.Array
    down: jax.Array


class BiasedExpertWeights(NamedTuple):
    """`ExpertWeights` of experts whose products add biases (`ModelConfig.expert_bias`,
    gpt-oss): gate, up, down as there, and gate_bias [E, I], up_bias [E, I], down_bias [E, H]."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array
    gate_bias: jax.Array
    up_bias: jax.Array
    down_bias: jax.Array


def expert_weights_of(**fields) -> ExpertWeights | BiasedExpertWeights:
    """The ExpertWeights of `fields` (gate, up, down), or BiasedExpertWeights where they hold
    the biases too."""
    if "gate_bias" in fields:
        return BiasedExpertWeights(**fields)
    return ExpertWeights(**fields)


EXPERT_FORMATS = ("plain", "fp8", "int4", "mxfp4")  # ModelConfig.expert_format
MATRICES = ("gate", "up", "down")  # the expert matrices, in blob order
BIASES = tuple(f"{m}_bias" for m in MATRICES)  # their bias planes (`ExpertFormat.bias`)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128  # the FP8 checkpoints' weight_block_size [128, 128]
INT4_GROUP = 128  # GPTQ group_size
INT4_ZERO = 8  # the implicit zero-point of symmetric GPTQ
KINDS = EXPERT_FORMATS  # ("plain", "fp8", "int4", "mxfp4")
# What a plain model's experts can be quantized to on load (`--quantize`): int4-zp is int4 with
# zero-points (GPTQ's asymmetric grid), int4-act int4 with act-order group indices.
QUANTIZE_CHOICES = ("fp8", "int4", "int4-zp", "int4-act", "mxfp4")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "scale", "zero", "perm"],
                   meta_fields=["kind", "block", "shape", "dtype"])
@dataclasses.dataclass(frozen=True)
class QuantizedMatrix:
    """One matrix of a layer's experts in a quantized format (`strata_jax.formats`).

    Attributes:
        q: fp8: float8_e4m3fn [E, K, N]; int4, mxfp4: uint8 [E, K/2, N] (each group's, or
            pack's, values in two nibble halves, `formats.int4_halves_np`).
        scale: fp8: float32 [E, ceil(K/b), ceil(N/b)]; int4: float16 [E, K/b, N]; mxfp4:
            uint8 e8m0 exponents [E, K/32, N].
        kind: "fp8", "int4" or "mxfp4".
        block: fp8's scale block side, int4's group, mxfp4's scale group 32 (b).
        shape: (K, N), the matrix's [in, out] shape.
        dtype: the dtype the expert math reads (`dequantize` gives it).
        zero: int4 with zero-points: uint8 [E, K/b, N], each group and column's zero-point
            (w = (q - zero) * scale); None: symmetric, the implicit 8 (and fp8).
        perm: int4 with act-order: int32 [E, K], the input row each stored row is (the rows
            stored in group order, `formats`): x @ w = x[:, perm] @ (the stored rows), which
            `grouped_matmul` reads as a plain int4 matrix (`in_stored_order`); None:
            stored row k is input row k.
    """

    q: jax.Array
    scale: jax.Array
    kind: str
    block: int
    shape: tuple[int, int]
    dtype: np.dtype
    zero: jax.Array | None = None
    perm: jax.Array | None = None

    def dequantize(self, dtype=None) -> jax.Array:
        """[E, K, N] in `dtype` (default `self.dtype`): each value one float32 product and one
        cast, as `ExpertFormat.dequantize` (which calls this); with `perm`, in input order."""
        return dequantize_matrix(self.kind, self.block, self.shape, self.q, self.scale,
                                 dtype or self.dtype, self.zero, self.perm)

    def stored(self) -> "QuantizedMatrix":
        """The matrix of the stored rows (without `perm`): what x[:, perm] multiplies."""
        return dataclasses.replace(self, perm=None)



def dequantize_matrix(kind: str, block: int, shape: tuple[int, int], q: jax.Array,
                      scale: jax.Array, dtype, zero: jax.Array | None = None,
                      perm: jax.Array | None = None) -> jax.Array:
    """A quantized matrix's values in `dtype`: fp8 float(q) * scale[k // b, n // b]; int4
    (nibble - z) * scale[k // b, n], z the implicit 8 or `zero`[k // b, n], and with act-order
    stored row k put at input row `perm`[k]; mxfp4 `mxfp4.mxfp4_dequantize`; one float32
    product and one cast each."""
    k, n = shape
    if kind == "mxfp4":
        return mxfp4_dequantize(q, scale, shape, dtype)
    s = scale.astype(jnp.float32)
    if kind == "fp8":
        s = jnp.repeat(jnp.repeat(s, block, axis=-2), block, axis=-1)[..., :k, :n]
        return (q.astype(jnp.float32) * s).astype(dtype)
    if kind != "int4":
        raise ValueError(f"quantized matrix kind {kind!r}: expected one of {KINDS[1:]}")
    check_int4_plane(q, shape, block)
    lead = q.shape[:-2]
    # [..., group, half, row of the half, column]: one elementwise fusion (shift, mask, product,
    # cast) with the group's scale broadcast, no concatenation of the halves.
    b = q.astype(jnp.int32).reshape(*lead, k // block, 1, block // 2, n)
    shift = jnp.asarray([0, 4], jnp.int32).reshape(2, 1, 1)
    z = (INT4_ZERO if zero is None
         else zero.astype(jnp.int32).reshape(*lead, k // block, 1, 1, n))
    vals = ((b >> shift) & 15) - z
    s = s.reshape(*lead, k // block, 1, 1, n)
    w = (vals.astype(jnp.float32) * s).astype(dtype).reshape(*lead, k, n)
    if perm is None:
        return w
    inverse = jnp.argsort(perm.astype(jnp.int32), axis=-1)  # input row r is stored row inv[r]
    return jnp.take_along_axis(w, inverse[..., :, None], axis=-2)


def check_int4_plane(q, shape: tuple[int, int], block: int) -> None:
    """A ValueError unless `q` is an int4 plane as the formats make it: uint8 [..., K/2, N],
    each group's values in two nibble halves (not GPTQ's int32 words)."""
    k, n = shape
    if np.dtype(q.dtype) != np.uint8 or tuple(q.shape[-2:]) != (k // 2, n):
        raise ValueError(
            f"int4 plane {np.dtype(q.dtype).name} {tuple(q.shape)}: expected uint8 "
            f"[..., {k // 2}, {n}] (each group of {block} values in two nibble halves); "
            "GPTQ's int32 words convert with strata_jax.formats.gptq_halves_np")


def dense(w):
    """`w` (a matrix or an ExpertWeights of them) with every QuantizedMatrix dequantized."""
    if isinstance(w, QuantizedMatrix):
        return w.dequantize()
    if isinstance(w, tuple) and hasattr(w, "_fields"):
        return type(w)(*(dense(a) for a in w))
    return w


def quantized_config(config: "ModelConfig", name: str, block: int) -> "ModelConfig":
    """`config` with its routed experts in quantize format `name` (`QUANTIZE_CHOICES`) with
    scale block / group `block`."""
    if name not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize {name!r}: expected one of {'|'.join(QUANTIZE_CHOICES)}")
    kind, *options = name.split("-")
    return config.replace(expert_format=kind, expert_block=block,
                          expert_zero_points="zp" in options,
                          expert_act_order="act" in options)


@dataclasses.dataclass(frozen=True)
class Plane:
    """One plane of an expert blob.

    Attributes:
        name: "gate", "up", "down" (weights), "<matrix>_scale" (scales), "<matrix>_zero"
            (int4's zero-points), "<matrix>_perm" (int4's act-order row permutation) or
            "<matrix>_bias" (the product's bias).
        dtype: Storage dtype.
        shape: Per-expert shape (a layer's plane is [E, *shape]).
    """

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    @property
    def size(self) -> int:
        """Elements per expert."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes per expert."""
        return self.size * self.dtype.itemsize


PLANE_SUFFIXES = ("_scale", "_zero", "_perm", "_bias")  # a matrix's side planes


def plane_matrix(name: str) -> str:
    """The matrix ("gate", "up", "down") plane `name` belongs to."""
    for suffix in PLANE_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


def _matrix_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """Each matrix's [in, out] shape in the model's orientation."""
    return {"gate": (hidden, intermediate), "up": (hidden, intermediate),
            "down": (intermediate, hidden)}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class ExpertFormat:
    """How one routed expert's bytes are laid out: its planes, in blob order.

    Attributes:
        name: "bfloat16" / "float32" / ... (plain, named after its dtype), "fp8", "int4",
            "int4-zp" (with zero-points), "int4-act" (act-order), "int4-zp-act" or "mxfp4".
        kind: "plain", "fp8", "int4" or "mxfp4".
        planes: The planes, in blob order.
        dtype: The dtype the expert math reads (what `dequantize` gives).
        hidden: H.
        intermediate: I.
        block: fp8: the scale block's side (128); int4: the group (128); mxfp4: the scale
            group (32, its only one); plain: 0.
    """

    name: str
    kind: str
    planes: tuple[Plane, ...]
    dtype: np.dtype
    hidden: int
    intermediate: int
    block: int = 0

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def of(cls, config: "ModelConfig", kind: str | None = None) -> "ExpertFormat":
        """The format `kind` ("plain": in the config's dtype; "fp8"; "int4"; "mxfp4"; default the
        config's `expert_format`) of the config's routed experts, with its `expert_block` and
        (int4) `expert_zero_points` and `expert_act_order`; with `expert_bias` each
        matrix's bias plane after them (`with_biases`)."""
        kind = kind or config.expert_format
        fmt = cls.make(kind, config.hidden_size, config.expert_intermediate, config.dtype,
                       block=config.expert_block or None,
                       zero_points=kind == "int4" and bool(config.expert_zero_points),
                       act_order=kind == "int4" and bool(config.expert_act_order))
        return fmt.with_biases() if config.expert_bias else fmt

    def with_biases(self) -> "ExpertFormat":
        """This format with the experts' biases after its planes: gate_bias [I], up_bias [I],
        down_bias [H] in the dtype the expert math reads (named "<name>+bias")."""
        if self.bias:
            return self
        h, i = self.hidden, self.intermediate
        planes = tuple(Plane(b, self.dtype, (w,)) for b, w in zip(BIASES, (i, i, h)))
        return dataclasses.replace(self, name=f"{self.name}+bias", planes=self.planes + planes)

    @classmethod
    def make(cls, kind: str, hidden: int, intermediate: int, dtype,
             block: int | None = None, zero_points: bool = False,
             act_order: bool = False) -> "ExpertFormat":
        """The format `kind` for experts of width H = `hidden`, I = `intermediate`, read by the
        expert math in `dtype`; `block`: fp8's scale block side or int4's group (default 128;
        mxfp4: 32 or None, its one group);
        `zero_points`: int4 with a zero-point plane per matrix; `act_order`: int4 with a
        group-index plane per matrix."""
        if zero_points and kind != "int4":
            raise ValueError(f"zero-points are an int4 format's; the {kind!r} format has none")
        if act_order and kind != "int4":
            raise ValueError(f"act-order group indices are an int4 format's; the {kind!r} "
                             "format has none")
        if kind == "int4":
            return cls.int4(hidden, intermediate, dtype, group=block or INT4_GROUP,
                            zero_points=zero_points, act_order=act_order)
        if kind == "plain":
            return cls.plain(hidden, intermediate, dtype)
        if kind == "fp8":
            return cls.fp8(hidden, intermediate, dtype, block=block or FP8_BLOCK)
        if kind == "mxfp4":
            check_mxfp4_block(block)
            return cls.mxfp4(hidden, intermediate, dtype)
        raise ValueError(f"expert format {kind!r} is not implemented; choose one of {KINDS}")

    @classmethod
    def plain(cls, hidden: int, intermediate: int, dtype) -> "ExpertFormat":
        """Today's blob: gate [H, I], up [H, I], down [I, H] in `dtype`, back to back."""
        dtype = np.dtype(dtype)
        planes = tuple(Plane(m, dtype, s) for m, s in _matrix_shapes(hidden, intermediate).items())
        return cls(dtype.name, "plain", planes, dtype, int(hidden), int(intermediate))

    @classmethod
    def fp8(cls, hidden: int, intermediate: int, dtype,
            block: int = FP8_BLOCK) -> "ExpertFormat":
        """e4m3 weights, float32 scales per `block` x `block` block (ceil at the edges)."""
        if block < 1:
            raise ValueError(f"fp8 block={block} must be >= 1")
        planes = []
        for m, (k, n) in _matrix_shapes(hidden, intermediate).items():
            planes += [Plane(m, ml_dtypes.float8_e4m3fn, (k, n)),
                       Plane(f"{m}_scale", np.float32, (_cdiv(k, block), _cdiv(n, block)))]
        return cls("fp8", "fp8", tuple(planes), np.dtype(dtype), int(hidden), int(intermediate),
                   int(block))

    @classmethod
    def int4(cls, hidden: int, intermediate: int, dtype, group: int = INT4_GROUP,
             zero_points: bool = False, act_order: bool = False) -> "ExpertFormat":
        """int4 with GPTQ's values and float16 scales per `group` inputs, the values of each
        group in two nibble halves of a [group/2, N] byte tile; symmetric (the implicit zero
        8), or with `zero_points` a uint8 zero-point per group and column; with `act_order`
        the rows sorted by GPTQ's `g_idx` and an int32 plane naming each stored row's input
        row."""
        if group < 1 or group % INT4_PER_WORD:
            raise ValueError(f"int4 group={group} must be a positive multiple of {INT4_PER_WORD}")
        planes = []
        for m, (k, n) in _matrix_shapes(hidden, intermediate).items():
            if k % group:
                raise ValueError(
                    f"int4 experts need the {m} matrix's input width {k} to be a multiple of "
                    f"the group {group} (GPTQ's grouping); pick a group that divides {k} "
                    "(ModelConfig.expert_block)")
            planes += [Plane(m, np.uint8, (k // 2, n)),
                       Plane(f"{m}_scale", np.float16, (k // group, n))]
            if zero_points:
                planes.append(Plane(f"{m}_zero", np.uint8, (k // group, n)))
            if act_order:
                planes.append(Plane(f"{m}_perm", np.int32, (k,)))
        name = "int4" + ("-zp" if zero_points else "") + ("-act" if act_order else "")
        return cls(name, "int4", tuple(planes), np.dtype(dtype), int(hidden), int(intermediate),
                   int(group))

    @classmethod
    def mxfp4(cls, hidden: int, intermediate: int, dtype) -> "ExpertFormat":
        """OCP MXFP4 (`strata_jax.mxfp4`): e2m1 codes in pack halves of 64 inputs and a uint8
        e8m0 exponent per 32 inputs and column."""
        planes = []
        for m, (k, n) in _matrix_shapes(hidden, intermediate).items():
            check_mxfp4_width(m, k)
            planes += [Plane(m, np.uint8, (k // 2, n)),
                       Plane(f"{m}_scale", np.uint8, (k // MXFP4_GROUP, n))]
        return cls("mxfp4", "mxfp4", tuple(planes), np.dtype(dtype), int(hidden),
                   int(intermediate), MXFP4_GROUP)

    # ---- layout --------------------------------------------------------------------------------

    @functools.cached_property
    def zero_points(self) -> bool:
        """Whether each matrix has a zero-point plane (int4 with zero-points)."""
        return any(p.name.endswith("_zero") for p in self.planes)

    @functools.cached_property
    def bias(self) -> bool:
        """Whether each matrix has a bias plane (`with_biases`)."""
        return any(p.name in BIASES for p in self.planes)

    @functools.cached_property
    def act_order(self) -> bool:
        """Whether each matrix has a row-permutation plane (int4 with act-order)."""
        return any(p.name.endswith("_perm") for p in self.planes)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """Each plane's byte offset within a blob (each at a multiple of its dtype's size)."""
        out, at = [], 0
        for p in self.planes:
            at = _cdiv(at, p.dtype.itemsize) * p.dtype.itemsize
            out.append(at)
            at += p.nbytes
        return tuple(out)

    @functools.cached_property
    def blob_bytes(self) -> int:
        """Bytes of one expert's blob (one ring slot, one host-store row)."""
        last = self.planes[-1]
        return self.offsets[-1] + last.nbytes

    @functools.cached_property
    def uniform(self) -> np.dtype | None:
        """The one dtype of every plane where a blob is an array of it with no padding (the
        plain format), else None."""
        dts = {p.dtype for p in self.planes}
        return self.planes[0].dtype if len(dts) == 1 else None

    @functools.cached_property
    def blob_elems(self) -> int:
        """Elements of a blob in the `uniform` dtype (plain formats only)."""
        if self.uniform is None:
            raise ValueError(f"the {self.name} format's planes have several dtypes: count bytes")
        return self.blob_bytes // self.uniform.itemsize

    def plane(self, name: str) -> Plane:
        """The plane called `name`."""
        for p in self.planes:
            if p.name == name:
                return p
        raise KeyError(f"the {self.name} format has no plane {name!r}; it has "
                       f"{[p.name for p in self.planes]}")

    def offset(self, name: str) -> int:
        """Byte offset of plane `name` within a blob."""
        return self.offsets[self.planes.index(self.plane(name))]

    def matrix_shape(self, matrix: str) -> tuple[int, int]:
        """The dequantized [in, out] shape of `matrix` ("gate", "up", "down")."""
        return _matrix_shapes(self.hidden, self.intermediate)[matrix]

    # ---- split and pack ------------------------------------------------------------------------

    def _check_blobs(self, shape, dtype) -> None:
        dtype = np.dtype(dtype)
        if self.uniform is not None and dtype == self.uniform:
            width, unit = self.blob_elems, f"{self.uniform.name} elements"
        elif dtype == np.uint8:
            width, unit = self.blob_bytes, "bytes"
        else:
            raise ValueError(f"{self.name} expert blobs of dtype {dtype}: expected uint8 bytes"
                             + (f" or {self.uniform.name}" if self.uniform is not None else ""))
        if len(shape) != 2 or shape[1] != width:
            raise ValueError(
                f"expert blobs have shape {tuple(shape)}, expected [E, {width}] ({unit}) for the "
                f"{self.name} format with hidden={self.hidden}, intermediate={self.intermediate}")

    def _uniform_planes(self, blobs):
        """The planes of [E, blob_elems] blobs in the format's one dtype (NumPy views or JAX
        slices): element offsets, no bitcast."""
        n, it = blobs.shape[0], self.uniform.itemsize
        return {p.name: blobs[:, o // it:o // it + p.size].reshape(n, *p.shape)
                for p, o in zip(self.planes, self.offsets)}

    def split_np(self, blobs: np.ndarray) -> dict[str, np.ndarray]:
        """Views (no copy) of each plane, [E, *shape] in its dtype, of NumPy blobs: [E,
        blob_bytes] uint8, or for a plain format [E, blob_elems] in its dtype."""
        self._check_blobs(blobs.shape, blobs.dtype)
        n = blobs.shape[0]
        if self.uniform is not None and blobs.dtype == self.uniform:
            return self._uniform_planes(blobs)
        return {p.name: blobs[:, o:o + p.nbytes].view(p.dtype).reshape(n, *p.shape)
                for p, o in zip(self.planes, self.offsets)}

    def split(self, blobs: jax.Array) -> dict[str, jax.Array]:
        """`split_np` for JAX arrays (slices, reshapes and bitcasts; jit-friendly)."""
        self._check_blobs(blobs.shape, blobs.dtype)
        n = blobs.shape[0]
        if self.uniform is not None and blobs.dtype == self.uniform:
            return self._uniform_planes(blobs)
        out = {}
        for p, o in zip(self.planes, self.offsets):
            raw = blobs[:, o:o + p.nbytes]
            if p.dtype.itemsize > 1:
                raw = raw.reshape(n, p.size, p.dtype.itemsize)
            out[p.name] = jax.lax.bitcast_convert_type(raw, p.dtype).reshape(n, *p.shape)
        return out

    def pack_np(self, planes: Mapping[str, np.ndarray]) -> np.ndarray:
        """New C-contiguous blobs of per-plane arrays ([E, *shape] each): [E, blob_elems] in
        the dtype for a plain format (today's `pack_expert_blobs_np`), else [E, blob_bytes]
        uint8 (padding zero)."""
        arrays = self._planes_in(planes)
        n = arrays[0].shape[0]
        if self.uniform is not None:
            return np.concatenate([a.reshape(n, -1) for a in arrays], axis=1)
        out = np.zeros((n, self.blob_bytes), np.uint8)
        for split, a in zip(self.split_np(out).values(), arrays):
            split[...] = a
        return out

    def pack(self, planes: Mapping[str, jax.Array]) -> jax.Array:
        """`pack_np` for JAX arrays of a plain format (today's `pack_expert_blobs`)."""
        if self.uniform is None:
            raise ValueError(f"pack packs plain formats; pack {self.name} blobs with pack_np")
        arrays = self._planes_in(planes)
        n = arrays[0].shape[0]
        return jnp.concatenate([a.reshape(n, -1) for a in arrays], axis=1)

    def _planes_in(self, planes: Mapping[str, np.ndarray]) -> list:
        missing = [p.name for p in self.planes if p.name not in planes]
        extra = sorted(set(planes) - {p.name for p in self.planes})
        if missing or extra:
            raise ValueError(f"{self.name} planes: missing {missing}, not in the format {extra}")
        arrays = [planes[p.name] for p in self.planes]
        n = arrays[0].shape[0]
        for p, a in zip(self.planes, arrays):
            if tuple(a.shape) != (n, *p.shape) or np.dtype(a.dtype) != p.dtype:
                raise ValueError(f"{self.name} plane {p.name} is {np.dtype(a.dtype)} "
                                 f"{tuple(a.shape)}; expected {p.dtype} {(n, *p.shape)}")
        return arrays

    # ---- quantize and dequantize ---------------------------------------------------------------

    def quantize_np(self, w: ExpertWeights) -> dict[str, np.ndarray]:
        """The planes ([E, *shape] each) of experts `w` (gate/up [E, H, I], down [E, I, H],
        any float dtype): cast (plain) or round-to-nearest quantized (fp8, int4, mxfp4); a
        format with biases casts `w`'s (a BiasedExpertWeights)."""
        out = {}
        for m in MATRICES:
            out.update(self.quantize_matrix_np(m, getattr(w, m)))
        for b in BIASES if self.bias else ():
            if getattr(w, b, None) is None:
                raise ValueError(f"the {self.name} format holds the experts' biases; the "
                                 f"ExpertWeights have no {b}")
            out[b] = np.asarray(getattr(w, b)).astype(self.dtype)
        return out

    def quantize_matrix_np(self, matrix: str, x) -> dict[str, np.ndarray]:
        """The planes of one matrix ("gate", "up", "down") of experts x [E, in, out]: {matrix}
        (plain: cast) or {matrix, matrix_scale} (fp8, int4, mxfp4: round to nearest), and int4's
        {matrix}_zero with zero-points and {matrix}_perm with act-order (`act_order_perm`)."""
        x = np.asarray(x)
        if x.ndim != 3 or x.shape[1:] != self.matrix_shape(matrix):
            raise ValueError(f"expert {matrix} has shape {x.shape}; expected "
                             f"[E, {', '.join(map(str, self.matrix_shape(matrix)))}]")
        if self.kind == "plain":
            return {matrix: x.astype(self.dtype)}
        if self.kind == "mxfp4":
            q, scale = mxfp4_quantize_np(x)
            return {matrix: q, f"{matrix}_scale": scale}
        out = {}
        if self.act_order:  # the rows in group order, then quantized as plain int4
            out[f"{matrix}_perm"] = perm = act_order_perm(x, self.block)
            x = np.take_along_axis(x, perm[:, :, None], axis=1)
        if self.zero_points:
            q, scale, zero = _int4_quantize_zero_np(x, self.block)
            return {matrix: q, f"{matrix}_scale": scale, f"{matrix}_zero": zero} | out
        quantize = _fp8_quantize_np if self.kind == "fp8" else _int4_quantize_np
        q, scale = quantize(x, self.block)
        return {matrix: q, f"{matrix}_scale": scale} | out

    def dequantize_np(self, planes: Mapping[str, np.ndarray], matrix: str,
                      dtype=None) -> np.ndarray:
        """NumPy reference: `matrix` ([E, in, out]) in `dtype` (default the format's) from
        its planes: each value one float32 product (fp8, int4, mxfp4) cast to `dtype`."""
        dtype = np.dtype(dtype or self.dtype)
        q = np.asarray(planes[matrix])
        if self.kind == "plain":
            return q.astype(dtype)
        if self.kind == "mxfp4":
            return mxfp4_dequantize_np(q, planes[f"{matrix}_scale"], dtype)
        s = np.asarray(planes[f"{matrix}_scale"]).astype(np.float32)
        k, n = self.matrix_shape(matrix)
        if self.kind == "fp8":
            s = np.repeat(np.repeat(s, self.block, axis=-2), self.block, axis=-1)[..., :k, :n]
            return (q.astype(np.float32) * s).astype(dtype)
        rows = np.arange(k) // self.block  # each stored row's group
        zero = (_rows_of(np.asarray(planes[f"{matrix}_zero"]).astype(np.int32), rows)
                if self.zero_points else INT4_ZERO)
        vals = int4_values_np(q, self.block).astype(np.int32) - zero  # [E, K, N]
        w = (vals.astype(np.float32) * _rows_of(s, rows)).astype(dtype)
        if self.act_order:  # stored row i is input row perm[i]
            out = np.empty_like(w)
            np.put_along_axis(out, np.asarray(planes[f"{matrix}_perm"])[..., None], w, axis=-2)
            return out
        return w

    def dequantize(self, planes: Mapping[str, jax.Array], matrix: str, dtype=None) -> jax.Array:
        """JAX `dequantize_np` (what the device runs before a bf16 grouped matmul): the same
        float32 products and cast, so the same bits."""
        dtype = np.dtype(dtype or self.dtype)
        q = planes[matrix]
        if self.kind == "plain":  # the planes are the weights: no op where the dtype is theirs
            return q if q.dtype == dtype else q.astype(dtype)
        return self.matrix(planes, matrix, dtype).dequantize()

    def matrix(self, planes: Mapping[str, jax.Array], matrix: str, dtype=None):
        """One matrix of a quantized format's planes as a `QuantizedMatrix` (not dequantized:
        the grouped matmul reads it, `strata_jax.kernels.grouped`)."""
        if self.kind == "plain":
            raise ValueError(f"{self.name} is a plain format: its planes are the weights")
        return QuantizedMatrix(planes[matrix], planes[f"{matrix}_scale"], self.kind, self.block,
                               self.matrix_shape(matrix), np.dtype(dtype or self.dtype),
                               planes[f"{matrix}_zero"] if self.zero_points else None,
                               planes[f"{matrix}_perm"] if self.act_order else None)

    def expert_weights(self, planes: Mapping[str, jax.Array], dtype=None) -> ExpertWeights:
        """The ExpertWeights (JAX) of a layer's planes, dequantized; for a plain format in its
        own dtype the planes themselves (no op); the biases as held."""
        return expert_weights_of(**{m: self.dequantize(planes, m, dtype) for m in MATRICES},
                                 **self._biases(planes))

    def _biases(self, planes: Mapping[str, jax.Array]) -> dict:
        """The bias planes of a layer's planes by name (none without biases)."""
        return {b: planes[b] for b in BIASES} if self.bias else {}

    def expert_matrices(self, planes: Mapping[str, jax.Array], dtype=None) -> ExpertWeights:
        """What the expert math reads from a layer's planes: for a quantized format one
        `QuantizedMatrix` per matrix (the grouped matmul dequantizes it, or reads it in a
        fused kernel: `Kernels.quantized_matmul`); for a plain format `expert_weights`."""
        if self.kind == "plain":
            return self.expert_weights(planes, dtype)
        return expert_weights_of(**{m: self.matrix(planes, m, dtype) for m in MATRICES},
                                 **self._biases(planes))


def _rows_of(grid: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """A per-group plane [E, K/G, N] at each row's group `rows` [K]: [E, K, N]."""
    return grid[:, rows, :]


def _fp8_quantize_np(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """[E, K, N] -> (float8_e4m3fn [E, K, N], float32 scales [E, ceil(K/b), ceil(N/b)]):
    scale = amax(block) / 448 (1 for an all-zero block), q = e4m3(x / scale), nearest."""
    e, k, n = x.shape
    kb, nb = _cdiv(k, block), _cdiv(n, block)
    a = np.zeros((e, kb * block, nb * block), np.float32)
    a[:, :k, :n] = np.abs(x)
    amax = a.reshape(e, kb, block, nb, block).max(axis=(2, 4))  # [E, Kb, Nb]
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1)).astype(np.float32)
    full = np.repeat(np.repeat(scale, block, axis=1), block, axis=2)[:, :k, :n]
    y = np.clip(x.astype(np.float32) / full, -FP8_MAX, FP8_MAX)  # f32 rounding may pass 448
    return y.astype(ml_dtypes.float8_e4m3fn), scale


def _float16_scale_up(want: np.ndarray) -> np.ndarray:
    """Float64 group scales `want` as float16, each rounded up (so no value passes the grid's
    end), 1 where `want` is 0 (an all-zero group); a ValueError where one is not finite or
    past float16's range."""
    if not np.all(np.isfinite(want)) or want.max(initial=0) > np.finfo(np.float16).max:
        raise ValueError("int4 quantization: a weight is too large (or not finite) for a "
                         "float16 group scale")
    scale = want.astype(np.float16)
    low = scale.astype(np.float64) < want  # rounded down: one float16 step up
    scale[low] = np.nextafter(scale[low], np.float16(np.inf))
    scale[want == 0] = 1
    return scale


def _int4_quantize_np(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """[E, K, N] -> (uint8 [E, K/2, N] values in group halves, float16 scales [E, K/group, N]):
    scale = amax(group) / 7.5 rounded up to a float16 (1 for an all-zero group), so |x| /
    scale <= 7.5; q = clip(round(x / scale) + 8, 0, 15), ties to even."""
    e, k, n = x.shape
    amax = np.abs(x.astype(np.float32)).reshape(e, k // group, group, n).max(axis=2)
    scale = _float16_scale_up(amax.astype(np.float64) / 7.5)
    full = np.repeat(scale.astype(np.float32), group, axis=1)  # [E, K, N]
    q = np.clip(np.round(x.astype(np.float32) / full) + INT4_ZERO, 0, 15).astype(np.uint8)
    return int4_halves_np(q, group), scale


def _int4_quantize_zero_np(x: np.ndarray, group: int
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[E, K, N] -> (uint8 [E, K/2, N] values in group halves, float16 scales [E, K/group, N],
    uint8 zero-points [E, K/group, N]): GPTQ's asymmetric grid over [min(lo, 0), max(hi, 0)]
    of each group, scale = (hi - lo) / 15 rounded up to a float16 (1 for an all-zero group),
    z = clip(round(-lo / scale), 0, 15), q = clip(round(x / scale) + z, 0, 15), ties to even."""
    e, k, n = x.shape
    g = x.astype(np.float32).reshape(e, k // group, group, n)
    lo = np.minimum(g.min(axis=2), 0).astype(np.float64)
    hi = np.maximum(g.max(axis=2), 0).astype(np.float64)
    empty = hi == lo
    scale = _float16_scale_up((hi - lo) / 15)
    zero = np.clip(np.round(-lo / scale.astype(np.float64)), 0, 15)
    zero[empty] = INT4_ZERO
    zero = zero.astype(np.uint8)
    full = np.repeat(scale.astype(np.float32), group, axis=1)  # [E, K, N]
    q = np.clip(np.round(x.astype(np.float32) / full) + np.repeat(zero, group, axis=1), 0, 15)
    return int4_halves_np(q.astype(np.uint8), group), scale, zero


@functools.lru_cache(maxsize=64)
def expert_format(config: "ModelConfig") -> ExpertFormat:
    """The routed experts' `ExpertFormat` of `config` (cached per config)."""
    return ExpertFormat.of(config)
