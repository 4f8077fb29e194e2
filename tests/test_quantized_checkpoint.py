"""Quantized Hugging Face checkpoints (FP8 block-scaled, GPTQ int4) written by hand in the
published layouts: the routed experts' planes, the dequantized linears, and every refusal."""

import pathlib

import ml_dtypes
import numpy as np
import pytest

from strata_jax.checkpoint import (CheckpointError, config_from_hf, load_checkpoint,
                                   quant_fields_markdown)
from strata_jax.models import get_preset
from strata_jax.experts import ExpertWeights
from strata_jax.formats import ExpertFormat, int4_values_np
from strata_jax.models import expert_plane_names
from strata_jax.synthetic import init_synthetic
from strata_jax.testing import (HF_ARCH, QWEN3_30B_A3B_HF_CONFIG, assert_close, hf_config,
                                hf_quantization_config, hf_quantize, hf_tensors,
                                write_hf_checkpoint)

QWEN = "qwen3-30b-a3b"


def small(preset=QWEN, inter=32):
    return get_preset(preset).scaled(param_dtype="float32", n_experts=4, top_k=2,
                                     expert_intermediate=inter)


def write(path, c, preset, method, block, *, keep=(), tensors=None, v2=False, sym=True,
          act_order=False, **quant_fields):
    """A quantized checkpoint of `c`'s synthetic params (GPTQ with zero-points where `sym` is
    False, with act-order's g_idx where `act_order`); returns (params, files' tensors)."""
    params = init_synthetic(c, 0)
    if tensors is None:
        tensors = hf_quantize(hf_tensors(c, params, preset), method, block, keep=keep, v2=v2,
                              sym=sym, act_order=act_order)
    if not sym:
        quant_fields["sym"] = False
    if act_order:
        quant_fields["desc_act"] = True
    q = hf_quantization_config(c, preset, method, block, keep=keep, **quant_fields)
    write_hf_checkpoint(path, c, preset, tensors, quantization_config=q)
    return params, tensors


def experts_of(params, layer):
    return ExpertWeights(*(params[f"layers.{layer}.mlp.{m}"] for m in ("gate", "up", "down")))


def expert_module(preset, layer, e, field):
    _, moe, names = HF_ARCH[preset]
    name = dict(zip(("gate", "up", "down"), names))[field]
    return f"model.layers.{layer}.{moe}.experts.{e}.{name}"


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def fp8_f64(w, s, block):
    """float64 dequantization of an FP8 checkpoint's [out, in] weight, as [in, out]."""
    n, k = w.shape
    full = np.repeat(np.repeat(s.astype(np.float64), block, 0), block, 1)[:n, :k]
    return (w.astype(np.float64) * full).T


def nibbles(words):
    """GPTQ qweight words [..., in/8, out] -> the 4-bit values [..., in, out] (row 8r + j in
    bits 4j..4j+3 of word r)."""
    shifts = np.arange(8, dtype=np.uint32)[:, None] * 4
    q = (words.view(np.uint32)[..., :, None, :] >> shifts) & 15
    return q.reshape(*words.shape[:-2], -1, words.shape[-1])


def gptq_zeros(t, module, v2):
    """A GPTQ linear's zero-points [in/group, out] as published: `qzeros` words [in/group,
    out/8], column 8c + j in bits 4j..4j+3 of word c, stored minus one in v1."""
    shifts = np.arange(8, dtype=np.uint32) * 4
    z = (t[f"{module}.qzeros"].view(np.uint32)[..., None] >> shifts) & 15
    return z.reshape(z.shape[0], -1).astype(np.float64) + (0 if v2 else 1)


def gptq_f64(t, module, group, zero=8):
    """float64 dequantization of a GPTQ checkpoint's linear, [in, out], as published: row k in
    group g_idx[k] (k // group where the files hold no g_idx); `zero` 8 (symmetric) or the
    zero-points [in/group, out]."""
    q = nibbles(t[f"{module}.qweight"]).astype(np.float64)
    rows = t.get(f"{module}.g_idx", np.arange(q.shape[0]) // group)
    if np.ndim(zero):
        zero = zero[rows]
    return (q - zero) * t[f"{module}.scales"].astype(np.float64)[rows]


# ---- FP8 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset,inter,block", [(QWEN, 32, 32), (QWEN, 24, 16),
                                                ("mixtral-8x7b", 32, 16),
                                                ("olmoe-1b-7b", 32, 32)])
def test_fp8_experts_are_the_planes_of_quantize_np(tmp_path, preset, inter, block):
    """Routed experts stay FP8: each plane equals `ExpertFormat.quantize_np`'s of the same
    weights (the same rounding), bit for bit; 24 wide with block 16 has partial edge blocks."""
    c = small(preset, inter)
    params, _ = write(tmp_path, c, preset, "fp8", block)
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    assert (ckpt.config.expert_format, ckpt.config.expert_block) == ("fp8", block)
    fmt = ExpertFormat.of(ckpt.config)
    assert ckpt.experts.nbytes == len(c.moe_layers) * c.n_experts * fmt.blob_bytes
    for layer in c.moe_layers:
        want = fmt.quantize_np(experts_of(params, layer))
        planes = ckpt.experts.planes(layer)
        assert set(planes) == set(want) == set(expert_plane_names(ckpt.config, layer))
        for name, plane in planes.items():
            assert plane.dtype == want[name].dtype and plane.shape == want[name].shape, name
            np.testing.assert_array_equal(bits(plane), bits(want[name]), err_msg=name)


def test_fp8_dequantized_weights_match_the_files_in_float64(tmp_path):
    """Experts dequantized (`CheckpointExperts.layer`) and the dequantized attention
    projections equal the float64 dequantization of the hand-written tensors; the unconverted
    router, norms, embedding and lm_head are the checkpoint's own values."""
    c, block = small(), 16
    params, t = write(tmp_path, c, QWEN, "fp8", block)
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    for layer in c.moe_layers:
        got = ckpt.experts.layer(layer)
        for field in ("gate", "up", "down"):
            for e in range(c.n_experts):
                m = expert_module(QWEN, layer, e, field)
                ref = fp8_f64(t[f"{m}.weight"], t[f"{m}.weight_scale_inv"], block)
                assert_close(getattr(got, field)[e], ref, np.float32, err_msg=m)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            m = f"model.layers.{layer}.self_attn.{proj}"
            assert t[f"{m}.weight"].dtype == ml_dtypes.float8_e4m3fn
            ref = fp8_f64(t[f"{m}.weight"], t[f"{m}.weight_scale_inv"], block)
            got_p = ckpt.params[f"layers.{layer}.attn.{proj}"]
            assert got_p.dtype == np.float32 and got_p.flags.c_contiguous
            assert_close(got_p, ref, np.float32, err_msg=m)
            assert not np.array_equal(got_p, params[f"layers.{layer}.attn.{proj}"])
        np.testing.assert_array_equal(ckpt.params[f"layers.{layer}.mlp.router"],
                                      params[f"layers.{layer}.mlp.router"])
    for name in ("lm_head", "embed", "final_norm.weight"):
        np.testing.assert_array_equal(ckpt.params[name], params[name])


def test_fp8_modules_to_not_convert_leaves_a_linear_plain(tmp_path):
    c = small()
    keep = ("model.layers.1.self_attn.o_proj",)
    params, t = write(tmp_path, c, QWEN, "fp8", 32, keep=keep)
    assert t["model.layers.1.self_attn.o_proj.weight"].dtype == np.float32
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    np.testing.assert_array_equal(ckpt.params["layers.1.attn.o_proj"],
                                  params["layers.1.attn.o_proj"])
    # The vLLM spelling reads the same.
    q = hf_quantization_config(c, QWEN, "fp8", 32, keep=keep)
    q["ignored_layers"] = q.pop("modules_to_not_convert")
    write_hf_checkpoint(tmp_path, c, QWEN, t, quantization_config=q)
    np.testing.assert_array_equal(load_checkpoint(str(tmp_path), progress=False)
                                  .params["layers.1.attn.o_proj"], params["layers.1.attn.o_proj"])


def test_experts_fill_a_store_directly(tmp_path):
    """`as_mapping()[l].fill` writes each plane into a uint8 blob store's views (how an engine's
    host store takes them); a float array for a quantized plane is refused (a cast would drop
    the scale)."""
    c = small()
    write(tmp_path, c, QWEN, "fp8", 16)
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    fmt = ExpertFormat.of(ckpt.config)
    store = np.zeros((c.n_experts, fmt.blob_bytes), np.uint8)
    lazy = ckpt.experts.as_mapping()[1]
    assert lazy.planes == tuple(p.name for p in fmt.planes)
    lazy.fill(fmt.split_np(store))
    np.testing.assert_array_equal(store, fmt.pack_np(ckpt.experts.planes(1)))
    np.testing.assert_array_equal(ckpt.experts.blobs(1), store)
    with pytest.raises(ValueError, match=r"layers.1.mlp.gate' is float8_e4m3fn .* float32"):
        ckpt.experts.fill("layers.1.mlp.gate", np.zeros((c.n_experts, 64, 32), np.float32))


# ---- GPTQ ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset,group,v2", [(QWEN, 32, False), (QWEN, 16, True),
                                             ("mixtral-8x7b", 32, False)])
def test_gptq_experts_are_the_files_and_dequantize_in_float64(tmp_path, preset, group, v2):
    """Routed experts stay int4: `qweight`'s values in the format's group halves (byte row r
    of group j: row j*g + r in the low nibble, j*g + g/2 + r in the high one) and `scales` as
    the files hold them (already [in, out]), stacked over experts; dequantized experts and
    attention projections equal the float64 dequantization of the files."""
    c = small(preset)
    fields = {"checkpoint_format": "gptq_v2"} if v2 else {}
    params, t = write(tmp_path, c, preset, "gptq", group, v2=v2, **fields)
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    assert (ckpt.config.expert_format, ckpt.config.expert_block) == ("int4", group)
    for layer in c.moe_layers:
        planes = ckpt.experts.planes(layer)
        got = ckpt.experts.layer(layer)
        for field in ("gate", "up", "down"):
            ms = [expert_module(preset, layer, e, field) for e in range(c.n_experts)]
            vals = nibbles(np.stack([t[f"{m}.qweight"] for m in ms])).astype(np.uint8)
            e, k, n = vals.shape
            v = vals.reshape(e, k // group, 2, group // 2, n)
            halves = (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(e, k // 2, n)
            assert planes[field].dtype == np.uint8
            np.testing.assert_array_equal(planes[field], halves)
            np.testing.assert_array_equal(planes[f"{field}_scale"],
                                          np.stack([t[f"{m}.scales"] for m in ms]))
            assert planes[f"{field}_scale"].dtype == np.float16
            for e, m in enumerate(ms):
                assert_close(getattr(got, field)[e], gptq_f64(t, m, group), np.float32, err_msg=m)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            m = f"model.layers.{layer}.self_attn.{proj}"
            assert_close(ckpt.params[f"layers.{layer}.attn.{proj}"], gptq_f64(t, m, group),
                         np.float32, err_msg=m)
        np.testing.assert_array_equal(ckpt.params[f"layers.{layer}.mlp.router"],
                                      params[f"layers.{layer}.mlp.router"])


@pytest.mark.parametrize("v2", [False, True])
def test_gptq_zero_points_are_a_plane_and_dequantize_in_float64(tmp_path, v2):
    """sym=false: the routed experts keep their zero-points as a plane of their own (`qzeros`
    unpacked along out, plus one in v1), and dequantized experts and attention projections
    equal the float64 dequantization (q - z) * scale of the files."""
    c, group = small(), 32
    fields = {"checkpoint_format": "gptq_v2"} if v2 else {}
    _, t = write(tmp_path, c, QWEN, "gptq", group, v2=v2, sym=False, **fields)
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    cfg = ckpt.config
    assert (cfg.expert_format, cfg.expert_block, cfg.expert_zero_points) == ("int4", group, True)
    fmt = ExpertFormat.of(cfg)
    assert fmt.name == "int4-zp" and ckpt.experts.nbytes == (
        len(c.moe_layers) * c.n_experts * fmt.blob_bytes)
    for layer in c.moe_layers:
        planes = ckpt.experts.planes(layer)
        assert set(planes) == set(expert_plane_names(cfg, layer))
        got = ckpt.experts.layer(layer)
        for field in ("gate", "up", "down"):
            ms = [expert_module(QWEN, layer, e, field) for e in range(c.n_experts)]
            zeros = np.stack([gptq_zeros(t, m, v2) for m in ms])
            assert planes[f"{field}_zero"].dtype == np.uint8
            np.testing.assert_array_equal(planes[f"{field}_zero"], zeros)
            assert (zeros != 8).mean() > 0.3, field  # the zero-points are not the implicit 8
            for e, m in enumerate(ms):
                want = gptq_f64(t, m, group, gptq_zeros(t, m, v2))
                assert_close(getattr(got, field)[e], want, np.float32, err_msg=m)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            m = f"model.layers.{layer}.self_attn.{proj}"
            assert_close(ckpt.params[f"layers.{layer}.attn.{proj}"],
                         gptq_f64(t, m, group, gptq_zeros(t, m, v2)), np.float32, err_msg=m)
    # A blob store filled from the files holds the same planes.
    store = np.zeros((c.n_experts, fmt.blob_bytes), np.uint8)
    ckpt.experts.as_mapping()[1].fill(fmt.split_np(store))
    np.testing.assert_array_equal(store, fmt.pack_np(ckpt.experts.planes(1)))


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_act_order_stores_expert_rows_in_group_order_and_dequantizes_in_float64(
        tmp_path, sym):
    """desc_act=true: each quantized linear's rows are in the groups its g_idx names (a
    permutation here, not k // group); the routed experts' rows are stored in group order
    (stable) beside the int32 plane naming each stored row's input row; dequantized experts
    and attention projections equal the float64 dequantization (q - z[g_idx]) *
    scale[g_idx] of the files."""
    c, group = small(inter=64), 32  # two groups along every input
    _, t = write(tmp_path, c, QWEN, "gptq", group, sym=sym, act_order=True)
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    cfg = ckpt.config
    assert (cfg.expert_format, cfg.expert_zero_points, cfg.expert_act_order) == (
        "int4", not sym, True)
    fmt = ExpertFormat.of(cfg)
    assert fmt.name == ("int4-act" if sym else "int4-zp-act")
    assert ckpt.experts.nbytes == len(c.moe_layers) * c.n_experts * fmt.blob_bytes
    for layer in c.moe_layers:
        planes = ckpt.experts.planes(layer)
        got = ckpt.experts.layer(layer)
        for field in ("gate", "up", "down"):
            ms = [expert_module(QWEN, layer, e, field) for e in range(c.n_experts)]
            g_idx = np.stack([t[f"{m}.g_idx"] for m in ms])
            k = g_idx.shape[1]
            assert (g_idx != np.arange(k) // group).mean() > 0.3, field  # act-order's groups
            perm = planes[f"{field}_perm"]
            assert perm.dtype == np.int32
            np.testing.assert_array_equal(perm, np.argsort(g_idx, axis=1, kind="stable"))
            # the stored values are the files' rows in that order
            stored = int4_values_np(planes[field], group)
            for e, m in enumerate(ms):
                np.testing.assert_array_equal(stored[e], nibbles(t[f"{m}.qweight"])[perm[e]])
            for e, m in enumerate(ms):
                zero = 8 if sym else gptq_zeros(t, m, False)
                assert_close(getattr(got, field)[e], gptq_f64(t, m, group, zero), np.float32,
                             err_msg=m)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            m = f"model.layers.{layer}.self_attn.{proj}"
            zero = 8 if sym else gptq_zeros(t, m, False)
            assert_close(ckpt.params[f"layers.{layer}.attn.{proj}"],
                         gptq_f64(t, m, group, zero), np.float32, err_msg=m)


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop(f"model.layers.1.mlp.experts.0.gate_proj.g_idx"),
     r"missing tensor 'model.layers.1.mlp.experts.0.gate_proj.g_idx' \(expected I32 shape "
     r"\(64,\)\)"),
    (lambda t: t.pop("model.layers.0.self_attn.q_proj.g_idx"),
     r"'model.layers.0.self_attn.q_proj.g_idx' is missing: with desc_act=true"),
    (lambda t: t["model.layers.1.mlp.experts.0.up_proj.g_idx"].__setitem__(3, 2),
     r"'model.layers.1.mlp.experts.0.up_proj.g_idx' names group 2 for row 3; a 64-wide input "
     r"in groups of 32 has groups 0 .. 1"),
    (lambda t: t["model.layers.0.self_attn.o_proj.g_idx"].__setitem__(0, -1),
     r"'model.layers.0.self_attn.o_proj.g_idx' names group -1 for row 0"),
    # a routed expert's groups are stored contiguous, so each must hold group_size rows
    (lambda t: (lambda g: g.__setitem__(int(np.flatnonzero(g == 1)[0]), 0))(
        t["model.layers.1.mlp.experts.0.gate_proj.g_idx"]),
     r"'model.layers.1.mlp.experts.0.gate_proj.g_idx' puts 33 rows in group 0, not "
     r"group_size=32: a routed expert's act-order groups")])
def test_gptq_act_order_refuses_a_missing_or_out_of_range_g_idx(tmp_path, edit, match):
    c = small()
    t = hf_quantize(hf_tensors(c, init_synthetic(c, 0), QWEN), "gptq", 32, act_order=True)
    edit(t)
    write(tmp_path, c, QWEN, "gptq", 32, tensors=t, desc_act=True)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(str(tmp_path), progress=False)


def test_gptq_plane_rounding_matches_quantize_np_where_the_scales_agree(tmp_path):
    """Where the checkpoint's float16 scale is the one `quantize_np` picks (2 amax / 15 rounded
    up), the 4-bit values are the same: the layouts agree, not only the dequantized values."""
    c = small()
    params, _ = write(tmp_path, c, QWEN, "gptq", 32)
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    fmt = ExpertFormat.of(ckpt.config)
    want = fmt.quantize_np(experts_of(params, 0))
    planes = ckpt.experts.planes(0)
    for field in ("gate", "up", "down"):
        same = planes[f"{field}_scale"] == want[f"{field}_scale"]  # [E, groups, out]
        assert same.mean() > 0.2, field  # the test compares something
        mask = np.repeat(same, 32, axis=1)  # [E, in, out]
        np.testing.assert_array_equal(int4_values_np(planes[field], 32)[mask],
                                      int4_values_np(want[field], 32)[mask], err_msg=field)


def test_gptq_zero_bias_and_modules_in_block(tmp_path):
    """A zero `bias` on a linear without one is read and dropped; modules_in_block_to_quantize
    is checked against the tensors."""
    c = small()
    params = init_synthetic(c, 0)
    t = hf_quantize(hf_tensors(c, params, QWEN), "gptq", 32)
    t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(c.q_dim, np.float16)
    names = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
             [f"mlp.experts.{e}.{p}" for e in range(c.n_experts)
              for p in ("gate_proj", "up_proj", "down_proj")]]
    write(tmp_path, c, QWEN, "gptq", 32, tensors=t, modules_in_block_to_quantize=names)
    load_checkpoint(str(tmp_path), progress=False)
    write(tmp_path, c, QWEN, "gptq", 32, tensors=t,
          modules_in_block_to_quantize=names[:1] + names[2:])
    with pytest.raises(CheckpointError, match=r"modules_in_block_to_quantize does not name "
                                              r"'self_attn.o_proj', but the files hold "
                                              r"model.layers.0.self_attn.o_proj.qweight"):
        load_checkpoint(str(tmp_path), progress=False)
    t["model.layers.0.self_attn.q_proj.bias"] = np.ones(c.q_dim, np.float16)
    write(tmp_path, c, QWEN, "gptq", 32, tensors=t)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.q_proj.bias' is not "
                                              r"zero"):
        load_checkpoint(str(tmp_path), progress=False)


# ---- refusals -----------------------------------------------------------------------------------

CONFIG_REFUSED = [
    ("fp8", {"activation_scheme": "static"}, r"activation_scheme='static'"),
    ("fp8", {"fmt": "e5m2"}, r"fmt='e5m2'"),
    ("fp8", {"weight_block_size": [128, 64]}, r"weight_block_size=\[128, 64\]: non-square"),
    ("fp8", {"weight_block_size": None}, r"weight_block_size=None: per-tensor"),
    ("fp8", {"ignored_layers": ["lm_head"]}, r"modules_to_not_convert and ignored_layers disagree"),
    ("fp8", {"kv_cache_scheme": "fp8"}, r"kv_cache_scheme='fp8' are not fp8 fields"),
    ("fp8", {"bits": 8}, r"bits=8 are not fp8 fields"),
    ("fp8", {"modules_to_not_convert": ["model.layers.1.mlp.experts.0.down_proj"]},
     r"leaves 'model.layers.1.mlp.experts.0.down_proj' unquantized but not"),
    ("gptq", {"bits": 8}, r"bits=8: only 4-bit"),
    ("gptq", {"desc_act": "yes"}, r"desc_act='yes': expected true or false"),
    ("gptq", {"sym": "no"}, r"sym='no': expected true or false"),
    ("gptq", {"checkpoint_format": "marlin"}, r"checkpoint_format='marlin'"),
    ("gptq", {"lm_head": True}, r"lm_head=True"),
    ("gptq", {"group_size": -1}, r"group_size=-1"),
    ("gptq", {"group_size": 48}, r"cannot build.*group 48"),
    ("gptq", {"dynamic": {"-:.*o_proj": {}}}, r"dynamic=.*per-module"),
    ("gptq", {"zero_point": True}, r"zero_point=True are not gptq fields"),
    ("gptq", {"quant_method": "awq"}, r"quant_method='awq'"),
]


@pytest.mark.parametrize("method,fields,match", CONFIG_REFUSED,
                         ids=[f"{m}-{'-'.join(f)}" for m, f, _ in CONFIG_REFUSED])
def test_quantization_fields_refused_by_name(method, fields, match):
    c = small()
    hf = hf_config(c, HF_ARCH[QWEN][0])
    hf["quantization_config"] = hf_quantization_config(c, QWEN, method, 32, **fields)
    with pytest.raises(CheckpointError, match=match):
        config_from_hf(hf)


E0 = expert_module(QWEN, 1, 2, "up")
Q0 = "model.layers.0.self_attn.q_proj"


def _set_zero(t, value):
    z = t[f"{E0}.qzeros"].copy().view(np.uint32)
    z[0, 0] = (z[0, 0] & ~np.uint32(0xF0)) | np.uint32(value << 4)
    t[f"{E0}.qzeros"] = z.view(np.int32)


TENSOR_REFUSED = [
    ("fp8", lambda t: t.pop(f"{E0}.weight_scale_inv"),
     rf"missing tensor '{E0}.weight_scale_inv' \(expected F32 shape \(1, 2\)\)"),
    ("fp8", lambda t: t.pop(f"{Q0}.weight_scale_inv"), rf"missing tensor '{Q0}.weight_scale_inv'"),
    ("fp8", lambda t: t.update({f"{E0}.weight_scale_inv": np.ones((2, 1), np.float32)}),
     rf"'{E0}.weight_scale_inv' has shape \(2, 1\), expected \(1, 2\)"),
    ("fp8", lambda t: t.update({f"{E0}.weight_scale_inv": np.ones((1, 2), np.float16)}),
     rf"'{E0}.weight_scale_inv' is F16, expected F32"),
    ("fp8", lambda t: t.update({f"{E0}.weight": t[f"{E0}.weight"].astype(np.float32)}),
     rf"'{E0}.weight' is F32, expected F8_E4M3"),
    ("fp8", lambda t: t.update({f"{Q0}.input_scale": np.ones((), np.float32)}),
     rf"not used .*'{Q0}.input_scale'"),
    ("fp8", lambda t: t.update({"model.layers.0.mlp.gate.weight": t[
        "model.layers.0.mlp.gate.weight"].astype(ml_dtypes.float8_e4m3fn)}),
     r"'model.layers.0.mlp.gate.weight' is F8_E4M3 \(float8\), but .* leaves it unquantized"),
    ("gptq", lambda t: _set_zero(t, 5),
     rf"'{E0}.qzeros' holds the zero-point 5 at \[0, 1\]; symmetric GPTQ"),
    ("gptq", lambda t: t.update({f"{E0}.g_idx": t[f"{E0}.g_idx"][::-1].copy()}),
     rf"'{E0}.g_idx' is not k // group_size"),
    ("gptq", lambda t: t.update({f"{Q0}.g_idx": np.roll(t[f"{Q0}.g_idx"], 1)}),
     rf"'{Q0}.g_idx' is not k // group_size"),
    ("gptq", lambda t: t.pop(f"{E0}.scales"), rf"missing tensor '{E0}.scales'"),
    ("gptq", lambda t: t.pop(f"{E0}.qzeros"), rf"missing tensor '{E0}.qzeros'"),
    ("gptq", lambda t: t.update({f"{E0}.scales": np.ones((4, 32), np.float16)}),
     rf"'{E0}.scales' has shape \(4, 32\), expected \(2, 32\)"),
    ("gptq", lambda t: t.update({f"{E0}.scales": t[f"{E0}.scales"].astype(np.float32)}),
     rf"'{E0}.scales' is F32, expected F16"),
    ("gptq", lambda t: t.update({f"{E0}.weight": np.zeros((32, 64), np.float32)}),
     rf"not used .*'{E0}.weight'"),
]


@pytest.mark.parametrize("method,edit,match", TENSOR_REFUSED,
                         ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(TENSOR_REFUSED)])
def test_bad_tensors_refused_by_name(tmp_path, method, edit, match):
    c = small()
    t = hf_quantize(hf_tensors(c, init_synthetic(c, 0), QWEN), method, 32)
    edit(t)
    write(tmp_path, c, QWEN, method, 32, tensors=t)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(str(tmp_path), progress=False)


def test_gptq_expert_without_qweight_refused(tmp_path):
    c = small()
    params = init_synthetic(c, 0)
    plain = hf_tensors(c, params, QWEN)
    t = hf_quantize(plain, "gptq", 32, keep=(E0,))
    write(tmp_path, c, QWEN, "gptq", 32, tensors=t)
    with pytest.raises(CheckpointError, match=rf"routed expert '{E0}' has no qweight"):
        load_checkpoint(str(tmp_path), progress=False)


def test_docs_show_the_quantization_table():
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "CHECKPOINTS.md").read_text()
    assert quant_fields_markdown() in doc, "docs/CHECKPOINTS.md: paste quant_fields_markdown()"


def test_config_from_real_quantized_keys():
    """quantization_config as Qwen3-30B-A3B-FP8 and -GPTQ-Int4 publish it: experts in fp8 /
    int4 with the 128 block, one byte / half a byte per weight plus their scales."""
    hf = dict(QWEN3_30B_A3B_HF_CONFIG)
    skip = ["lm_head"] + [f"model.layers.{l}.{n}" for l in range(48)
                          for n in ("input_layernorm", "mlp.gate", "post_attention_layernorm")]
    fp8 = config_from_hf({**hf, "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128], "modules_to_not_convert": skip}})
    gptq = config_from_hf({**hf, "torch_dtype": "float16", "quantization_config": {
        "bits": 4, "checkpoint_format": "gptq", "damp_percent": 0.01, "desc_act": False,
        "group_size": 128, "model_file_base_name": None, "model_name_or_path": None,
        "quant_method": "gptq", "static_groups": False, "sym": True, "true_sequential": True}})
    plain = config_from_hf(hf)
    assert (fp8.expert_format, fp8.expert_block) == ("fp8", 128)
    assert (gptq.expert_format, gptq.expert_block) == ("int4", 128)
    assert plain.expert_format == "plain"
    h, i = 2048, 768
    assert fp8.expert_bytes == 3 * (h * i + (h // 128) * (i // 128) * 4)
    assert gptq.expert_bytes == 3 * (h * i // 2 + (h // 128) * i * 2)


# ---- end to end ---------------------------------------------------------------------------------

@pytest.mark.parametrize("method,block,sym,act_order", [
    ("fp8", 32, True, False), ("gptq", 32, True, False),
    # zero-points alone: the slow run (the default run reads them with act-order)
    pytest.param("gptq", 32, False, False, marks=pytest.mark.slow),
    ("gptq", 32, False, True)])
def test_quantized_checkpoint_prefills_as_the_float64_reference(tmp_path, method, block, sym,
                                                                act_order):
    # A loaded FP8 / GPTQ checkpoint through the engine (experts resident, dequantized on the
    # device before the expert math): every position's logits against the float64 forward of
    # the same planes and dequantized linears.
    from strata_jax.engine import Engine
    from strata_jax.reference import reference_forward

    c = small()
    write(tmp_path, c, QWEN, method, block, sym=sym, act_order=act_order)
    ckpt = load_checkpoint(tmp_path)
    cfg = ckpt.config
    assert cfg.expert_format == ("fp8" if method == "fp8" else "int4")
    assert (cfg.expert_zero_points, cfg.expert_act_order) == (not sym, act_order)
    toks = np.random.default_rng(4).integers(0, cfg.vocab_size, 20)
    with Engine(cfg, ckpt.params, max_context=32, experts=ckpt.experts.as_mapping()) as eng:
        got = eng.prefill(toks)
    flat = dict(ckpt.params)
    for l in cfg.moe_layers:
        for plane, name in expert_plane_names(cfg, l).items():
            flat[name] = ckpt.experts[name]
    want, _ = reference_forward(cfg, flat, toks)
    assert_close(np.asarray(got.logits), want[-1], cfg.dtype)


def test_cli_reads_a_quantized_checkpoint_and_refuses_quantizing_it_again(tmp_path):
    import contextlib
    import io
    import json

    from strata_jax import cli

    write(tmp_path, small(), QWEN, "gptq", 32)

    def run(*argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(list(argv))
        return rc, out.getvalue(), err.getvalue()

    rc, out, err = run("prefill", "--checkpoint", str(tmp_path), "--no-stream", "--tokens", "16",
                       "--json", "-q")
    assert rc == 0, err
    m = json.loads(out)["model"]
    assert (m["expert_format"], m["expert_block"], m["expert_zero_points"]) == ("int4", 32, False)
    rc, _, err = run("prefill", "--checkpoint", str(tmp_path), "--quantize", "fp8", "--no-stream")
    assert rc == 2 and "already int4 (drop --quantize)" in err


@pytest.mark.slow
@pytest.mark.parametrize("act_order", [False, True])
def test_cli_streams_a_gptq_checkpoint_with_zero_points(tmp_path, act_order):
    # sym=false (and desc_act=true) through the CLI: routed over the simulated link and all
    # resident read the same bits, and the JSON says the experts carry zero-points (and
    # act-order group indices).
    import contextlib
    import io
    import json

    from strata_jax import cli

    write(tmp_path, small(), QWEN, "gptq", 32, sym=False, act_order=act_order)
    hashes = []
    for extra in ((), ("--no-stream",)):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(["prefill", "--checkpoint", str(tmp_path), "--tokens", "16", "--json",
                           "-q", *extra])
        assert rc == 0, err.getvalue()
        r = json.loads(out.getvalue())
        assert r["model"]["expert_zero_points"] is True
        assert r["model"]["expert_act_order"] is act_order
        hashes.append((r["logits_sha256"], r["kv_sha256"]))
    assert hashes[0] == hashes[1]
