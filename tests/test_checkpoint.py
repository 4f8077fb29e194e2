"""Loading Hugging Face safetensors layouts written by the test, compared with direct builds."""

import json
import pathlib
import re
import struct

import jax
import ml_dtypes
import numpy as np
import pytest

from strata_jax.models import decoder as M
from strata_jax.checkpoint import (FIELDS, CheckpointError, config_from_hf, fields_markdown,
                                   load_checkpoint, load_model)
from strata_jax.models import get_preset
from strata_jax.config import RopeScaling
from strata_jax.layers.rope import rope_frequencies
from strata_jax.synthetic import init_synthetic
from strata_jax.testing import HF_ARCH as ARCH
from strata_jax.testing import QWEN3_30B_A3B_HF_CONFIG, hf_config, hf_tensors
from strata_jax.testing import write_hf_checkpoint as write_checkpoint

def small(preset):
    return get_preset(preset).scaled(param_dtype="float32", n_experts=8, top_k=2)


@pytest.mark.parametrize("preset", sorted(ARCH))
def test_load_matches_direct_build(tmp_path, preset):
    c = small(preset)
    params = init_synthetic(c, 0)
    write_checkpoint(tmp_path, c, preset, hf_tensors(c, params, preset))
    model, ckpt = load_model(str(tmp_path), progress=False)
    assert ckpt.config.n_experts == c.n_experts and ckpt.config.qk_norm == c.qk_norm
    assert ckpt.config.norm_topk_prob == c.norm_topk_prob
    assert not any(k.endswith((".mlp.gate", ".mlp.up", ".mlp.down")) for k in ckpt.params)
    assert ckpt.experts.nbytes == c.expert_bytes_total
    direct = M.build_model(ckpt.config, params)
    toks = np.arange(10, dtype=np.int32) * 7
    cache = M.init_cache(ckpt.config, 16)
    a = M.forward(model, toks, cache)
    b = M.forward(direct, toks, cache)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    # Host store views: no device copy involved.
    layer = ckpt.experts.layer(1)
    np.testing.assert_array_equal(layer.down, params["layers.1.mlp.down"])


def test_bfloat16_shards_and_lean_model(tmp_path):
    """A bf16 checkpoint (written byte by byte: safetensors.numpy has no bfloat16 writer)."""
    preset = "qwen3-30b-a3b"
    c = small(preset).replace(param_dtype="bfloat16")
    params = init_synthetic(c, 1)
    tensors = hf_tensors(c, params, preset)
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        raw = tensors[name].astype(ml_dtypes.bfloat16).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    head = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(c, ARCH[preset][0])))
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    assert ckpt.config.param_dtype == "bfloat16"
    assert ckpt.experts.blobs(0).dtype == ml_dtypes.bfloat16
    lean = ckpt.build_model(resident_experts=False)
    full = ckpt.build_model()

    class HostSource:
        def expert_weights(self, layer, counts, resident):
            return tuple(jax.numpy.asarray(a) for a in ckpt.experts.layer(layer))

    toks = np.arange(6, dtype=np.int32)
    cache = M.init_cache(c, 8)
    a = M.forward(full, toks, cache)
    b = M.forward(lean, toks, cache, expert_source=HostSource())
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.fixture
def qwen_dir(tmp_path):
    c = small("qwen3-30b-a3b")
    tensors = hf_tensors(c, init_synthetic(c, 0), "qwen3-30b-a3b")
    return tmp_path, c, tensors


def test_missing_tensor_named(qwen_dir):
    path, c, tensors = qwen_dir
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    write_checkpoint(path, c, "qwen3-30b-a3b", tensors)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.experts.5.up_proj"):
        load_checkpoint(str(path), progress=False)


def test_misshaped_tensor_named(qwen_dir):
    path, c, tensors = qwen_dir
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((3, 64), np.float32)
    write_checkpoint(path, c, "qwen3-30b-a3b", tensors)
    with pytest.raises(CheckpointError,
                       match=r"'model.layers.0.self_attn.k_proj.weight' has shape \(3, 64\), "
                             r"expected \(32, 64\)"):
        load_checkpoint(str(path), progress=False)


def test_unknown_architecture(qwen_dir):
    path, c, tensors = qwen_dir
    write_checkpoint(path, c, "qwen3-30b-a3b", tensors)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="LlamaForCausalLM.*Qwen3MoeForCausalLM.*Mixtral"):
        load_checkpoint(str(path), progress=False)


def test_config_that_is_not_an_object_or_names_no_architecture():
    with pytest.raises(CheckpointError, match=r"config.json holds a list, not an object"):
        config_from_hf([1, 2])
    with pytest.raises(CheckpointError, match=r"names no architecture \(no 'architectures'\)"):
        config_from_hf({"hidden_size": 64})
    qwen = hf_config(small("qwen3-30b-a3b"), QWEN)
    assert config_from_hf({**qwen, "architectures": QWEN}) == config_from_hf(qwen)  # a bare name


def test_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(str(tmp_path), progress=False)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(small("mixtral-8x7b"),
                                                               "MixtralForCausalLM")))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(str(tmp_path), progress=False)


# What an interrupted or failed download leaves in place of a shard (its whole bytes given),
# and the words the refusal names it with.
DAMAGED = {
    "empty": (lambda data, header_end: b"", r"is empty \(0 bytes\)"),
    "cut in its length": (lambda data, header_end: data[:5],
                          r"is truncated: 5 bytes, cut inside the 8-byte length"),
    "cut in its header": (lambda data, header_end: data[:header_end - 10],
                          r"is truncated: cut inside its header"),
    "cut in its data": (lambda data, header_end: data[:-3],
                        r"is truncated: cut inside its data \(\d+ of the \d+ bytes"),
    "bytes past its data": (lambda data, header_end: data + b"\0" * 4,
                            r"is not a whole safetensors file: 4 bytes past"),
    "an HTML page": (lambda data, header_end: b"<!DOCTYPE html><html>rate limited</html>",
                     r"is not a safetensors file"),
    "a header not JSON": (lambda data, header_end: struct.pack("<Q", 4) + b"{no}",
                          r"is not a safetensors file \(its header is not"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_shard_is_named_with_the_way_out(qwen_dir, damage):
    """A shard cut short, empty or not safetensors at all is a CheckpointError naming the file,
    what is wrong with it and the way out, not safetensors' own "incomplete metadata"."""
    path, c, tensors = qwen_dir
    write_checkpoint(path, c, "qwen3-30b-a3b", tensors)
    shard = path / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    cut, words = DAMAGED[damage]
    shard.write_bytes(cut(data, 8 + struct.unpack("<Q", data[:8])[0]))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(path), progress=False)
    message = str(e.value)
    assert message.startswith(f"{shard} "), message
    assert re.search(words, message), message
    assert message.endswith("download it again (an interrupted or failed download leaves such "
                            "a file)"), message
    shard.write_bytes(data)  # whole again: it loads
    assert load_checkpoint(str(path), progress=False).config.n_experts == c.n_experts


def test_an_index_that_is_not_json_is_named(qwen_dir):
    path, c, tensors = qwen_dir
    write_checkpoint(path, c, "qwen3-30b-a3b", tensors)
    (path / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json is not a "
                                              r"safetensors index"):
        load_checkpoint(str(path), progress=False)


def test_config_from_real_hf_keys():
    # Keys as published for Qwen3-30B-A3B's config.json.
    hf = dict(QWEN3_30B_A3B_HF_CONFIG)
    c = config_from_hf(hf)
    assert c.expert_bytes_total == get_preset("qwen3-30b-a3b").expert_bytes_total


# ---- config.json fields: honoured, refused, both spellings (issue 20) ---------------------------

QWEN = "Qwen3MoeForCausalLM"


def qwen_hf(**fields):
    """A Qwen3-MoE config.json as transformers 4 wrote it, with `fields` over it (None removes)."""
    cfg = hf_config(small("qwen3-30b-a3b"), QWEN)
    cfg.update(fields)
    return {k: v for k, v in cfg.items() if v is not None}


def test_transformers5_spelling_reads_rope_parameters_and_num_local_experts():
    # As transformers 5 writes it: rope_theta inside rope_parameters, num_local_experts, dtype.
    v4 = config_from_hf(qwen_hf(rope_theta=5e5))
    v5 = config_from_hf(qwen_hf(rope_theta=None, num_experts=None, torch_dtype=None,
                                num_local_experts=8, dtype="float32",
                                rope_parameters={"rope_theta": 5e5, "rope_type": "default"}))
    assert v5.rope_theta == 5e5 and v5.n_experts == 8 and v5.rope_scaling is None
    assert v5 == v4


def test_yarn_in_both_spellings():
    v4 = config_from_hf(qwen_hf(max_position_embeddings=40_960, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32_768}))
    v5 = config_from_hf(qwen_hf(rope_theta=None, max_position_embeddings=40_960,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                 "rope_theta": 1e6,
                                                 "original_max_position_embeddings": 32_768}))
    assert v4 == v5
    assert v4.rope_scaling == RopeScaling("yarn", 4.0, 32_768)
    assert v4.max_seq_len == 131_072  # factor x original, past max_position_embeddings
    # transformers 5: no factor means max_position_embeddings / original.
    implied = config_from_hf(qwen_hf(max_position_embeddings=8192, rope_scaling={
        "rope_type": "yarn", "original_max_position_embeddings": 2048}))
    assert implied.rope_scaling.factor == 4.0


def test_linear_and_dynamic_read():
    linear = config_from_hf(qwen_hf(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert linear.rope_scaling == RopeScaling("linear", 2.0)
    dynamic = config_from_hf(qwen_hf(max_position_embeddings=1024,
                                     rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert dynamic.rope_scaling == RopeScaling("dynamic", 2.0, 1024)
    assert dynamic.max_seq_len == 1024


def test_defaults_are_transformers_own():
    bare = {k: v for k, v in hf_config(small("mixtral-8x7b"), "MixtralForCausalLM").items()
            if k not in ("rope_theta", "rms_norm_eps", "max_position_embeddings")}
    c = config_from_hf(bare)
    assert (c.rope_theta, c.rms_norm_eps, c.max_seq_len) == (1e6, 1e-5, 131_072)
    assert c.norm_topk_prob
    q = config_from_hf(qwen_hf(rope_theta=None, norm_topk_prob=None, rms_norm_eps=None))
    assert (q.rope_theta, q.rms_norm_eps, q.norm_topk_prob) == (10_000.0, 1e-6, False)


def test_sliding_window_fields():
    assert config_from_hf(qwen_hf(use_sliding_window=False, sliding_window=4096,
                                  max_window_layers=28)).sliding_window is None
    assert config_from_hf(qwen_hf(use_sliding_window=True, sliding_window=16,
                                  max_window_layers=0)).sliding_window == 16
    assert config_from_hf(qwen_hf(use_sliding_window=True)).sliding_window == 4096
    explicit_null = {**qwen_hf(use_sliding_window=True), "sliding_window": None}
    assert config_from_hf(explicit_null).sliding_window is None
    mixtral = hf_config(small("mixtral-8x7b"), "MixtralForCausalLM")
    assert config_from_hf({**mixtral, "sliding_window": 32}).sliding_window == 32
    assert config_from_hf({**mixtral, "sliding_window": None}).sliding_window is None


REFUSED = [
    (QWEN, {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    (QWEN, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"rope_type='llama3'"),
    (QWEN, {"rope_scaling": {"rope_type": "longrope", "factor": 8.0}}, r"rope_type='longrope'"),
    (QWEN, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}},
     r"\['low_freq_factor'\] are not read by rope_type 'yarn'"),
    (QWEN, {"rope_scaling": {"rope_type": "linear"}}, r"linear RoPE scaling has no 'factor'"),
    (QWEN, {"rope_scaling": {"rope_type": "default", "factor": 2.0}}, r"\['factor'\]"),
    (QWEN, {"rope_parameters": {"rope_theta": 1e4}}, r"two RoPE bases"),
    (QWEN, {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
     r"per layer type"),
    (QWEN, {"rope_scaling": {"type": "yarn", "rope_type": "linear", "factor": 2.0}},
     r"disagree"),
    (QWEN, {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
    (QWEN, {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]"),
    (QWEN, {"decoder_sparse_step": 2}, r"decoder_sparse_step=2"),
    (QWEN, {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
     r"max_window_layers=1"),
    (QWEN, {"num_local_experts": 4}, r"spellings disagree.*num_experts.*num_local_experts"),
    (QWEN, {"num_experts": None}, r"none of \('num_experts', 'num_local_experts'\)"),
    (QWEN, {"vocab_size": None}, r"no 'vocab_size'"),
    (QWEN, {"model_type": "qwen2_moe"}, r"model_type='qwen2_moe'"),
    (QWEN, {"quantization_config": {"quant_method": "awq"}},
     r"quantization_config quant_method='awq'"),
    (QWEN, {"shared_expert_intermediate_size": 64, "foo": 1},
     r"foo=1, shared_expert_intermediate_size=64 are not fields"),
    (QWEN, {"clip_qkv": 8.0}, r"clip_qkv=8.0 are not fields"),
    (QWEN, {"num_attention_heads": 3}, r"cannot build.*n_heads=3"),
    ("OlmoeForCausalLM", {"clip_qkv": 8.0}, r"clip_qkv=8.0"),
    ("OlmoeForCausalLM", {"sliding_window": 16}, r"sliding_window=16"),
    ("MixtralForCausalLM", {"attention_bias": True}, r"attention_bias=True"),
    ("MixtralForCausalLM", {"norm_topk_prob": False}, r"norm_topk_prob=False"),
    # A field of the wrong type, named (not `//`'s TypeError, float()'s message, a string's
    # truthiness or a bool taken for 1).
    (QWEN, {"hidden_size": "64"}, r"hidden_size='64': expected an integer"),
    (QWEN, {"num_experts": True}, r"num_experts=True: expected an integer"),
    (QWEN, {"num_hidden_layers": 2.5}, r"num_hidden_layers=2.5: expected an integer"),
    (QWEN, {"rms_norm_eps": "1e-6"}, r"rms_norm_eps='1e-6': expected a number"),
    (QWEN, {"tie_word_embeddings": "false"}, r"tie_word_embeddings='false': expected true or"),
]


@pytest.mark.parametrize("arch,fields,match", REFUSED,
                         ids=[f"{a[:5]}-{'-'.join(f)}" for a, f, _ in REFUSED])
def test_refused_fields_are_named(arch, fields, match):
    preset = {a: p for p, (a, _, _) in ARCH.items()}[arch]
    cfg = hf_config(small(preset), arch)
    cfg.update(fields)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(CheckpointError, match=match):
        config_from_hf(cfg)


def test_docs_show_the_field_table():
    """docs/CHECKPOINTS.md holds the table the loader follows (`fields_markdown()`)."""
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "CHECKPOINTS.md").read_text()
    assert fields_markdown() in doc, "docs/CHECKPOINTS.md: paste fields_markdown()'s table"


def test_fields_of_one_architecture_are_refused_in_another():
    """A field FIELDS gives only some architectures is refused, named, by the others."""
    mixtral = hf_config(small("mixtral-8x7b"), "MixtralForCausalLM")
    for field, per in FIELDS.items():
        if "MixtralForCausalLM" not in per:
            with pytest.raises(CheckpointError, match=f"{field}=7 are not fields"):
                config_from_hf({**mixtral, field: 7})


def test_attention_bias_checkpoint_loads_every_bias(tmp_path):
    """q/k/v/o biases land under the model's names (their math: tests/test_hf_fields.py)."""
    preset = "olmoe-1b-7b"
    c = small(preset).replace(attention_bias=True)
    params = init_synthetic(c, 3)
    write_checkpoint(tmp_path, c, preset, hf_tensors(c, params, preset), attention_bias=True)
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    assert ckpt.config.attention_bias
    names = [f"layers.{l}.attn.{b}_bias" for l in range(c.n_layers) for b in "qkvo"]
    for name in names:
        np.testing.assert_array_equal(ckpt.params[name], params[name], err_msg=name)
    assert set(M.param_shapes(c)) - set(ckpt.params) == {
        f"layers.{l}.mlp.{w}" for l in c.moe_layers for w in ("gate", "up", "down")}


def test_unused_tensors_are_named(qwen_dir):
    path, c, tensors = qwen_dir
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(c.q_dim, np.float32)
    for e in range(6):  # a layer past num_hidden_layers
        tensors[f"model.layers.2.mlp.experts.{e}.up_proj.weight"] = np.zeros((8, 8), np.float32)
    write_checkpoint(path, c, "qwen3-30b-a3b", tensors)
    with pytest.raises(CheckpointError, match=r"7 tensor\(s\) .* not used .*'model.layers.0."
                                              r"self_attn.q_proj.bias'.* and 2 more"):
        load_checkpoint(str(path), progress=False)


def test_bias_tensors_missing_when_the_config_asks(qwen_dir):
    path, c, tensors = qwen_dir
    write_checkpoint(path, c, "qwen3-30b-a3b", tensors, attention_bias=True)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.0.self_attn.q_proj"
                                              r".bias'"):
        load_checkpoint(str(path), progress=False)


def test_tied_head_and_rope_buffers_checked(qwen_dir):
    path, c, tensors = qwen_dir
    c = c.replace(tie_embeddings=True)
    inv = rope_frequencies(c.head_dim, c.rope_theta)[0].astype(np.float32)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv
    write_checkpoint(path, c, "qwen3-30b-a3b", tensors)
    assert load_checkpoint(str(path), progress=False).config.tie_embeddings
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv / 2
    write_checkpoint(path, c, "qwen3-30b-a3b", tensors)
    with pytest.raises(CheckpointError, match="rotary_emb.inv_freq' holds RoPE frequencies"):
        load_checkpoint(str(path), progress=False)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    write_checkpoint(path, c, "qwen3-30b-a3b", tensors)
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_checkpoint(str(path), progress=False)
