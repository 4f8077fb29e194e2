"""A checkpoint's routed experts, read from its files when used: name -> tensor in the model's
layout, one per plane of the config's expert format, straight into an engine's host store or onto
the device (`CheckpointExperts`), and the checks of each MoE layer's expert tensors at load time
(GPTQ's side tensors included).
"""

from __future__ import annotations

import re
from typing import Iterator, Mapping

import numpy as np

from strata_jax.config import ModelConfig
from safetensors import safe_open

from strata_jax.checkpoint.safetensors import Tensors, st_header, st_read
from strata_jax.experts import blob_size, unpack_expert_blobs_np
from strata_jax.formats import (BIASES, INT4_PER_WORD, INT4_ZERO, MATRICES, ExpertFormat,
                                ExpertWeights, expert_weights_of, g_idx_perm,
                                mxfp4_from_blocks_np,
                                gptq_halves_np, int4_halves_np, int4_values_np, unequal_group)
from strata_jax.models import expert_plane_names
from strata_jax.models.hf_config import GPTQ, CheckpointError, Quant, TensorNames
from strata_jax.weights import LazyExperts


# Each plane of an expert format: (matrix, the Hugging Face tensor's suffix, transposed on load).
# fp8: `weight` [out, in] and `weight_scale_inv` [out / b, in / b], both transposed; GPTQ:
# `qweight` [in / 8, out] (its words' values rearranged into the format's group halves),
# `scales` [in / group, out], already [in, out], and with zero-points `qzeros` [in / group,
# out / 8] (its words unpacked along out, plus the v1 offset).
_PLANE_SOURCES = {
    "plain": {m: (m, "weight", True) for m in MATRICES},
    "fp8": {**{m: (m, "weight", True) for m in MATRICES},
            **{f"{m}_scale": (m, "weight_scale_inv", True) for m in MATRICES}},
    "int4": {**{m: (m, "qweight", False) for m in MATRICES},
             **{f"{m}_scale": (m, "scales", False) for m in MATRICES},
             **{f"{m}_zero": (m, "qzeros", False) for m in MATRICES},
             **{f"{m}_perm": (m, "g_idx", False) for m in MATRICES}},
}


# A fused layout's planes (`TensorNames.fused`, gpt-oss): plane -> (the layer's tensor, by its
# suffix on the matrix's module; what one expert's [...] of it gives the plane). gate and up
# are the even and odd outputs of gate_up_proj ([in, out] as stored: [H, 2I]; its MXFP4 blocks
# and scales [out, ...]: rows); down_proj is [I, H].
def _even(a):
    return a[..., 0::2]


def _odd(a):
    return a[..., 1::2]


def _fused_sources(kind: str) -> dict:
    gate_up, down = (0, 2)  # indices into TensorNames.expert_names
    out = {"gate_bias": (gate_up, "_bias", _even), "up_bias": (gate_up, "_bias", _odd),
           "down_bias": (down, "_bias", None)}
    if kind == "mxfp4":
        def values(pick):  # the codes alone: the scales are their own plane
            def make(blocks):
                rows = pick(blocks)
                return mxfp4_from_blocks_np(rows, np.zeros(rows.shape[:-1], np.uint8))[0]
            return make

        def scales(pick):
            return lambda s: np.ascontiguousarray(pick(s).T)

        rows_even = lambda a: a[0::2]  # noqa: E731 - the [out, ...] rows of gate
        rows_odd = lambda a: a[1::2]  # noqa: E731
        every = lambda a: a  # noqa: E731
        return out | {"gate": (gate_up, "_blocks", values(rows_even)),
                      "up": (gate_up, "_blocks", values(rows_odd)),
                      "down": (down, "_blocks", values(every)),
                      "gate_scale": (gate_up, "_scales", scales(rows_even)),
                      "up_scale": (gate_up, "_scales", scales(rows_odd)),
                      "down_scale": (down, "_scales", scales(every))}
    if kind != "plain":
        raise CheckpointError(f"fused expert tensors (gpt-oss) in the {kind} format are not "
                              "read: they are stored plain or as MXFP4")
    return out | {"gate": (gate_up, "", _even), "up": (gate_up, "", _odd), "down": (down, "", None)}


class CheckpointExperts(Mapping[str, np.ndarray]):
    """A checkpoint's routed experts, read from its safetensors files when asked for.

    name -> tensor in the model's layout, one per plane of the config's expert format
    (`models.expert_plane_names`): plain, "layers.3.mlp.gate": [E, H, I], "...up": [E, H, I],
    "...down": [E, I, H] in the parameter dtype; fp8 (`ModelConfig.expert_format`), each matrix
    in float8_e4m3fn and "...gate_scale" etc. float32 [E, ceil(in/b), ceil(out/b)] (the
    checkpoint's `weight` and `weight_scale_inv`, transposed); int4, GPTQ's `qweight` int32
    [in/8, out] words rearranged into the format's group halves, uint8 [E, in/2, out]
    (`formats.gptq_halves_np`, the same bytes), `scales` float16 [E, in/group, out] as
    they are, with zero-points `qzeros` unpacked, uint8 [E, in/group, out] (plus one in
    GPTQ v1, which stores them minus one), and with act-order each expert's rows sorted by
    its `g_idx` (stable; `qweight`'s values moved with their rows) and int32 [E, in] naming
    the input row each stored row is (`formats.g_idx_perm`).
    Read when asked for and
    not kept. `fill(name, out)` reads each expert's tensor straight into `out`, one expert at a
    time: how an engine's host store takes them (`as_mapping`, `strata_jax.weights`), so no
    copy of every expert exists outside the store. Each read opens the files it needs and
    closes them after: a held safetensors handle keeps every page it has read mapped in the
    process (its resident set would grow by the checkpoint's size).

    Made by `load_checkpoint`, which has checked every expert tensor's name, shape and (in a
    quantized checkpoint) dtype.
    """

    def __init__(self, config: ModelConfig, arch: TensorNames, files: Mapping[str, str],
                 zero_offset: int = 0):
        self.config = config
        self._zero_offset = int(zero_offset)  # GPTQ v1's qzeros are stored minus one
        self.format = ExpertFormat.of(config)
        self._arch = arch
        self._files = dict(files)  # Hugging Face name -> the file that holds it
        self._headers: dict[str, tuple[int, dict]] = {}
        self._names = {n: (l, p) for l in config.moe_layers
                       for p, n in expert_plane_names(config, l).items()}

    @staticmethod
    def hf_names(config: ModelConfig, arch: TensorNames, layer: int, field: str,
                 suffix: str = "weight") -> list[str]:
        """The Hugging Face names of `layer`'s `field` ("gate", "up", "down") tensors, one per
        expert: `<module>.<suffix>` (plain: `weight`, [out, in]: gate and up [I, H], down
        [H, I])."""
        hf = dict(zip(MATRICES, arch.expert_names))[field]
        base = f"{arch.layer(layer)}{arch.moe_prefix}.experts."
        return [f"{base}{e}.{hf}.{suffix}" for e in range(config.n_experts)]

    def _shape(self, plane: str) -> tuple[int, ...]:
        return (self.config.n_experts, *self.format.plane(plane).shape)

    def __getitem__(self, name: str) -> np.ndarray:
        _, plane = self._names[name]
        out = np.empty(self._shape(plane), self.format.plane(plane).dtype)
        self.fill(name, out)
        return out

    def __contains__(self, name) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def fill(self, name: str, out: np.ndarray) -> None:
        """Reads tensor `name` into `out` ([E, *plane shape]: plain [E, H, I], or [E, I, H] for
        down, cast to its dtype; a quantized plane in its own dtype), one expert at a time, each
        file opened once."""
        layer, plane = self._names[name]
        if tuple(out.shape) != self._shape(plane):
            raise ValueError(f"parameter {name!r} has shape {self._shape(plane)}; the array to "
                             f"fill has {tuple(out.shape)}")
        if self._arch.fused:
            self._fill_fused(layer, plane, out)
            return
        kind = self.format.kind
        field, suffix, transpose = _PLANE_SOURCES[kind][plane]
        want = self.format.plane(plane).dtype
        if kind != "plain" and np.dtype(out.dtype) != want:
            raise ValueError(f"parameter {name!r} is {want} (a {kind} plane: a cast would drop "
                             f"its scale); the array to fill is {np.dtype(out.dtype)}")
        by_file: dict[str, list[tuple[int, str]]] = {}
        for e, hf in enumerate(self.hf_names(self.config, self._arch, layer, field, suffix)):
            by_file.setdefault(self._files[hf], []).append((e, hf))
        for path, items in by_file.items():
            if kind == "plain":
                with safe_open(path, framework="numpy") as handle:
                    for e, hf in items:
                        out[e] = handle.get_tensor(hf).T  # [out, in] -> [in, out]
                continue
            start, header = self._header(path)
            with open(path, "rb") as f:
                for e, hf in items:
                    value = st_read(f, start, header[hf])
                    if kind == "int4" and suffix == "qweight":
                        out[e] = gptq_halves_np(value, self.format.block)
                        if self.format.act_order:  # the rows in group order
                            perm = self._perm(layer, field, e)
                            vals = int4_values_np(out[e], self.format.block)[perm]
                            out[e] = int4_halves_np(vals, self.format.block)
                    elif kind == "int4" and suffix == "g_idx":
                        out[e] = g_idx_perm(value, self.format.block)
                    elif kind == "int4" and suffix == "qzeros":
                        out[e] = _unpack_int4(value, axis=1) + self._zero_offset
                    else:
                        out[e] = value.T if transpose else value

    def _fill_fused(self, layer: int, plane: str, out: np.ndarray) -> None:
        """`fill` of a fused layout (`TensorNames.fused`): each expert's slice of the layer's
        tensor read alone (the experts lead: one contiguous byte range each) and made the
        plane (`_fused_sources`)."""
        matrix, suffix, make = _fused_sources(self.format.kind)[plane]
        hf = fused_name(self._arch, layer, matrix, suffix)
        path = self._files[hf]
        start, header = self._header(path)
        info = header[hf]
        per = (info["data_offsets"][1] - info["data_offsets"][0]) // info["shape"][0]
        with open(path, "rb") as f:
            for e in range(self.config.n_experts):
                lo = info["data_offsets"][0] + e * per
                value = st_read(f, start, {**info, "shape": info["shape"][1:],
                                           "data_offsets": [lo, lo + per]})
                out[e] = value if make is None else make(value)

    def _header(self, path: str) -> tuple[int, dict]:
        """`st_header(path)`, read once per file."""
        if path not in self._headers:
            self._headers[path] = st_header(path)
        return self._headers[path]

    def _perm(self, layer: int, field: str, expert: int) -> np.ndarray:
        """An act-order expert matrix's stored row order, from its `g_idx`."""
        hf = self.hf_names(self.config, self._arch, layer, field, "g_idx")[expert]
        path = self._files[hf]
        start, header = self._header(path)
        with open(path, "rb") as f:
            return g_idx_perm(st_read(f, start, header[hf]), self.format.block)

    @property
    def layers(self) -> tuple[int, ...]:
        """MoE layer indices."""
        return tuple(self.config.moe_layers)

    @property
    def nbytes(self) -> int:
        """Bytes of every expert in its store format (what a host store of them holds)."""
        return self.config.expert_bytes_total

    def planes(self, layer: int) -> dict[str, np.ndarray]:
        """`layer`'s planes read now (new arrays): plane name -> [E, *shape]."""
        return {p: self[n] for p, n in expert_plane_names(self.config, layer).items()}

    def layer(self, layer: int) -> ExpertWeights:
        """`layer`'s experts read now (new arrays), in the parameter dtype: dequantized from a
        quantized format (`ExpertFormat.dequantize_np`)."""
        planes = self.planes(layer)
        if self.format.kind == "plain":
            return expert_weights_of(**planes)
        return expert_weights_of(**{m: self.format.dequantize_np(planes, m) for m in MATRICES},
                                 **{b: planes[b] for b in BIASES if b in planes})

    def blobs(self, layer: int) -> np.ndarray:
        """`layer`'s experts read now into new blobs (`strata_jax.formats`): plain [E, 3*H*I]
        in the parameter dtype (`strata_jax.experts`), quantized [E, blob_bytes] uint8."""
        c = self.config
        if self.format.kind == "plain":
            out = np.empty((c.n_experts, blob_size(c.hidden_size, c.expert_intermediate)),
                           c.dtype)
            self.as_mapping()[layer].fill(
                unpack_expert_blobs_np(out, c.hidden_size, c.expert_intermediate))
            return out
        out = np.zeros((c.n_experts, self.format.blob_bytes), np.uint8)
        self.as_mapping()[layer].fill(self.format.split_np(out))
        return out

    def as_mapping(self) -> dict:
        """layer -> `weights.LazyExperts` over the format's planes (read when used), for
        `Engine(experts=...)` and `build_model(..., experts=...)`."""
        return {l: LazyExperts(self, expert_plane_names(self.config, l)) for l in self.layers}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _unpack_int4(words: np.ndarray, axis: int) -> np.ndarray:
    """GPTQ's packing undone: each int32 word holds eight 4-bit values, value j in bits
    4j..4j+3, consecutive along `axis` (qweight: the input dim, 0; qzeros: the output dim, 1)."""
    shifts = np.arange(INT4_PER_WORD, dtype=np.uint32) * 4
    u = np.moveaxis(words.view(np.uint32), axis, -1)[..., None]  # [..., n, 1]
    vals = ((u >> shifts) & 15).reshape(*u.shape[:-2], -1)  # [..., 8n]
    return np.moveaxis(vals, -1, axis).astype(np.int32)


def _gptq_shapes(quant: Quant, module: str, k: int, n: int) -> dict[str, tuple[int, ...]]:
    """The GPTQ tensors of a linear of input width `k` and output width `n`: qweight, scales,
    qzeros, g_idx (refused where the widths do not suit the packing or the group)."""
    g = quant.block
    if k % g or k % INT4_PER_WORD or n % INT4_PER_WORD:
        raise CheckpointError(
            f"GPTQ linear {module!r} is [{n}, {k}] ([out, in]): its input width must be a "
            f"multiple of group_size={g} and of 8, its output width of 8 (the packed layout)")
    return {"qweight": (k // INT4_PER_WORD, n), "scales": (k // g, n),
            "qzeros": (k // g, n // INT4_PER_WORD), "g_idx": (k,)}


_WITHIN_LAYER = re.compile(r"(?:.*\.)?layers\.\d+\.(.*)")


def _gptq_quantized(tensors: Tensors, quant: Quant, module: str) -> bool:
    """Whether GPTQ linear `module` is quantized: it has a `qweight` (else a `weight`),
    cross-checked against modules_in_block_to_quantize where config.json gives it."""
    has = tensors.has(f"{module}.qweight")
    within = _WITHIN_LAYER.match(module)
    if quant.in_block is not None and within:
        rel = within.group(1)  # the name within the layer: "self_attn.q_proj"
        if (rel in quant.in_block) != has:
            said = "names" if rel in quant.in_block else "does not name"
            raise CheckpointError(
                f"config.json quantization_config modules_in_block_to_quantize {said} {rel!r}, "
                f"but the files hold {module}.{'qweight' if has else 'weight'}")
    return has


def _gptq_check(tensors: Tensors, quant: Quant, module: str, k: int, n: int,
                biased: bool, expert: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Reads and checks a GPTQ linear's side tensors: `qzeros` (its shape; symmetric: every
    entry the implicit zero), `g_idx` (`_gptq_g_idx`), and a `bias` the model has no place for
    all zero (`biased`: the model reads the linear's bias itself). Returns (the zero-points
    as stored, unpacked [k / group, n]; each input row's group [k]). A routed `expert`'s
    act-order groups must hold group_size rows each (its rows are stored in group order)."""
    shapes = _gptq_shapes(quant, module, k, n)
    zeros = _unpack_int4(tensors.get(f"{module}.qzeros", shapes["qzeros"], "I32"), axis=1)
    bad = np.argwhere(zeros != quant.zero_stored) if quant.sym else np.zeros((0, 2), int)
    if bad.size:
        at = tuple(int(i) for i in bad[0])
        v1 = ", minus one in checkpoint_format gptq" if quant.zero_stored != INT4_ZERO else ""
        raise CheckpointError(
            f"tensor '{module}.qzeros' holds the zero-point {int(zeros[at])} at {list(at)}; "
            f"symmetric GPTQ (sym=true) stores {quant.zero_stored} everywhere (the zero "
            f"{INT4_ZERO}{v1}); a checkpoint with zero-points says sym=false in config.json "
            "quantization_config")
    rows = _gptq_g_idx(tensors, quant, module, k, n)
    bad = unequal_group(rows, quant.block) if expert and quant.act_order else None
    if bad is not None:
        raise CheckpointError(
            f"tensor '{module}.g_idx' puts {bad[1]} rows in group {bad[0]}, not "
            f"group_size={quant.block}: a routed expert's act-order groups are read in "
            "group order and must hold group_size rows each (as GPTQ makes them)")
    if not biased and tensors.has(f"{module}.bias"):
        bias = tensors.get(f"{module}.bias", (n,))
        if np.any(bias != 0):
            raise CheckpointError(f"tensor '{module}.bias' is not zero, and the model's "
                                  f"{module.rsplit('.', 1)[-1]} has no bias")
    return zeros, rows


def _gptq_g_idx(tensors: Tensors, quant: Quant, module: str, k: int, n: int) -> np.ndarray:
    """Each input row's group, int [k], of GPTQ linear `module`: its `g_idx`, required with
    act-order (desc_act true; every entry a group, 0 .. k / group - 1), else where present
    k // group (k // group where absent)."""
    rows = np.arange(k) // quant.block
    name = f"{module}.g_idx"
    if not tensors.has(name):
        if quant.act_order:
            raise CheckpointError(
                f"tensor '{name}' is missing: with desc_act=true (act-order) each quantized "
                "linear names its rows' groups in g_idx")
        return rows
    g_idx = tensors.get(name, _gptq_shapes(quant, module, k, n)["g_idx"], "I32")
    if quant.act_order:
        bad = np.flatnonzero((g_idx < 0) | (g_idx >= k // quant.block))
        if bad.size:
            raise CheckpointError(
                f"tensor '{name}' names group {int(g_idx[bad[0]])} for row {int(bad[0])}; "
                f"a {k}-wide input in groups of {quant.block} has groups 0 .. "
                f"{k // quant.block - 1}")
        return g_idx
    if not np.array_equal(g_idx, rows):
        raise CheckpointError(
            f"tensor '{name}' is not k // group_size (group {quant.block}): a permuted g_idx "
            "is act-order, which config.json quantization_config says is off (desc_act=false)")
    return rows


def fused_name(arch: TensorNames, layer: int, matrix: int, suffix: str = "") -> str:
    """The Hugging Face name of a fused layout's tensor: matrix 0 gate_up (1 the same), 2 down,
    with `suffix` ("", "_bias", "_blocks", "_scales")."""
    return (f"{arch.layer(layer)}{arch.moe_prefix}.experts.{arch.expert_names[matrix]}"
            f"{suffix}")


def fused_expert_files(tensors: Tensors, c: ModelConfig, arch: TensorNames,
                       layer: int) -> dict[str, str]:
    """`expert_files` of a fused layout (gpt-oss): gate_up and down as one tensor each with
    the experts leading, plain ([E, H, 2I], [E, I, H]) or MXFP4 (`_blocks` [E, out, in/32,
    16] and `_scales` [E, out, in/32] uint8), and their biases ([E, 2I], [E, H]) where the
    model has them; a bias in the files the model has no place for must be zero."""
    fmt = ExpertFormat.of(c)
    e, h, i = c.n_experts, c.hidden_size, c.expert_intermediate
    files = {}
    for matrix, (k, n) in ((0, (h, 2 * i)), (2, (i, h))):
        if fmt.kind == "mxfp4":
            names = {"_blocks": ((e, n, k // 32, 16), "U8"), "_scales": ((e, n, k // 32), "U8")}
        else:
            names = {"": ((e, k, n), None)}
        for suffix, (shape, dt) in names.items():
            name = fused_name(arch, layer, matrix, suffix)
            files[name] = tensors.path(name, shape, dt)
        bias = fused_name(arch, layer, matrix, "_bias")
        if c.expert_bias:
            files[bias] = tensors.path(bias, (e, n))
        elif tensors.has(bias) and np.any(tensors.get(bias, (e, n)) != 0):
            raise CheckpointError(f"tensor {bias!r} is not zero, and the model's experts have "
                                  "no bias")
    return files


def expert_files(tensors: Tensors, quant: Quant | None, c: ModelConfig, arch: TensorNames,
                  layer: int) -> dict[str, str]:
    """Checks `layer`'s routed expert tensors (names, shapes, dtypes; GPTQ's side tensors read
    and checked) and returns Hugging Face name -> file of those its `CheckpointExperts` reads."""
    if arch.fused:
        return fused_expert_files(tensors, c, arch, layer)
    files: dict[str, str] = {}
    fmt = ExpertFormat.of(c)
    for field in MATRICES:
        k, n = fmt.matrix_shape(field)  # [in, out]
        weights = CheckpointExperts.hf_names(c, arch, layer, field)
        modules = [w[:-len(".weight")] for w in weights]
        if fmt.kind == "plain":
            for w, module in zip(weights, modules):
                if quant is not None and quant.method == GPTQ and _gptq_quantized(
                        tensors, quant, module):
                    raise CheckpointError(
                        f"routed expert {module!r} is GPTQ-quantized (it has a qweight), but "
                        "modules_in_block_to_quantize names no routed expert")
                files[w] = tensors.path(w, (n, k))
        elif fmt.kind == "fp8":
            b = fmt.block
            for module in modules:
                files[f"{module}.weight"] = tensors.path(f"{module}.weight", (n, k), "F8_E4M3")
                files[f"{module}.weight_scale_inv"] = tensors.path(
                    f"{module}.weight_scale_inv", (_cdiv(n, b), _cdiv(k, b)), "F32")
        else:
            shapes = _gptq_shapes(quant, modules[0], k, n)
            for module in modules:
                if not _gptq_quantized(tensors, quant, module):
                    raise CheckpointError(
                        f"routed expert {module!r} has no qweight (a {module}.weight instead?): "
                        "a GPTQ checkpoint's routed experts are all quantized or none")
                side = (("qweight", "I32"), ("scales", "F16")) + (
                    () if quant.sym else (("qzeros", "I32"),)) + (
                    (("g_idx", "I32"),) if quant.act_order else ())
                for suffix, dt in side:
                    files[f"{module}.{suffix}"] = tensors.path(f"{module}.{suffix}",
                                                               shapes[suffix], dt)
                _gptq_check(tensors, quant, module, k, n, False, expert=True)
    return files
