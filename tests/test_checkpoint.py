"""Loading Hugging Face safetensors layouts written by the test, compared with direct builds."""

import json
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from strata_jax import model as M
from strata_jax.checkpoint import CheckpointError, config_from_hf, load_checkpoint, load_model
from strata_jax.config import get_preset
from strata_jax.synthetic import init_synthetic

ARCH = {
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral-8x7b": ("MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2")),
    "olmoe-1b-7b": ("OlmoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
}


def hf_config(c, arch):
    cfg = dict(architectures=[arch], vocab_size=c.vocab_size, hidden_size=c.hidden_size,
               num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
               num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
               num_experts_per_tok=c.top_k, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
               tie_word_embeddings=c.tie_embeddings, max_position_embeddings=c.max_seq_len,
               torch_dtype=c.param_dtype)
    if arch == "MixtralForCausalLM":
        cfg.update(num_local_experts=c.n_experts, intermediate_size=c.expert_intermediate)
    elif arch == "Qwen3MoeForCausalLM":
        cfg.update(num_experts=c.n_experts, moe_intermediate_size=c.expert_intermediate,
                   norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        cfg.update(num_experts=c.n_experts, intermediate_size=c.expert_intermediate,
                   norm_topk_prob=c.norm_topk_prob, clip_qkv=None)
    return cfg


def hf_tensors(c, params, preset):
    """Our flat params in Hugging Face names and [out, in] layout, written out by hand."""
    _, moe, (g, u, d) = ARCH[preset]
    t = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm.weight"],
         "lm_head.weight": params["lm_head"].T}
    for l in range(c.n_layers):
        p, q = f"layers.{l}.", f"model.layers.{l}."
        t[q + "input_layernorm.weight"] = params[p + "input_norm.weight"]
        t[q + "post_attention_layernorm.weight"] = params[p + "post_attn_norm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[q + f"self_attn.{proj}.weight"] = params[p + f"attn.{proj}"].T
        if c.qk_norm != "none":
            t[q + "self_attn.q_norm.weight"] = params[p + "attn.q_norm.weight"]
            t[q + "self_attn.k_norm.weight"] = params[p + "attn.k_norm.weight"]
        t[q + f"{moe}.gate.weight"] = params[p + "mlp.router"].T
        for e in range(c.n_experts):
            t[q + f"{moe}.experts.{e}.{g}.weight"] = params[p + "mlp.gate"][e].T
            t[q + f"{moe}.experts.{e}.{u}.weight"] = params[p + "mlp.up"][e].T
            t[q + f"{moe}.experts.{e}.{d}.weight"] = params[p + "mlp.down"][e].T
    return {k: np.ascontiguousarray(v) for k, v in t.items()}


def write_checkpoint(path, c, preset, tensors, *, shards=2):
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(hf_config(c, ARCH[preset][0])))


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


def test_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(str(tmp_path), progress=False)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(small("mixtral-8x7b"),
                                                               "MixtralForCausalLM")))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(str(tmp_path), progress=False)


def test_config_from_real_hf_keys():
    # Keys as published for Qwen3-30B-A3B's config.json.
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
          "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
          "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
          "norm_topk_prob": True, "vocab_size": 151936, "rope_theta": 1000000.0,
          "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "max_position_embeddings": 40960,
          "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": []}
    c = config_from_hf(hf)
    assert c.expert_bytes_total == get_preset("qwen3-30b-a3b").expert_bytes_total
