"""Checkpoints written by Hugging Face transformers itself, loaded by strata_jax and compared with
transformers' own float32 model: the logits at every position and every layer's KV cache.

Opt-in: needs torch and transformers (skipped without them) and is marked slow:
`python -m pytest -q -m slow tests/test_transformers_parity.py`. Each case is written once in the
spelling the installed transformers uses and once rewritten into the other one (transformers 4:
rope_theta / rope_scaling / torch_dtype; transformers 5: rope_parameters / dtype /
num_local_experts for Qwen3-MoE), and read whole and in two chunks.
"""

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from strata_jax.models import decoder as M  # noqa: E402
from strata_jax.checkpoint import CheckpointError, load_model  # noqa: E402
from strata_jax.testing import assert_close  # noqa: E402

pytestmark = pytest.mark.slow

V5 = int(transformers.__version__.split(".")[0]) >= 5
T, SPLIT, CAPACITY = 40, 24, 48
COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_experts_per_tok=2,
              max_position_embeddings=64, tie_word_embeddings=False)
ARCHS = {
    "qwen3": ("Qwen3MoeConfig", dict(num_experts=4, moe_intermediate_size=16,
                                     norm_topk_prob=True, rms_norm_eps=1e-6)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, intermediate_size=16)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, intermediate_size=16)),
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
LINEAR = {"rope_type": "linear", "factor": 2.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
# (arch, RoPE scaling, other config fields)
CASES = [
    ("qwen3", None, {}),
    ("qwen3", YARN, {}),
    ("qwen3", LINEAR, {}),
    ("qwen3", YARN, {"attention_bias": True}),
    ("qwen3", None, {"use_sliding_window": True, "sliding_window": 8}),
    ("mixtral", None, {}),
    ("mixtral", YARN, {}),
    ("mixtral", LINEAR, {}),
    ("mixtral", DYNAMIC, {}),
    ("mixtral", None, {"sliding_window": 8}),
    ("olmoe", None, {}),
    ("olmoe", None, {"attention_bias": True}),
    ("olmoe", YARN, {"attention_bias": True}),
]


def hf_config(arch, scaling, fields):
    name, own = ARCHS[arch]
    kw = dict(COMMON, **own, **fields)
    theta = 1e6 if arch == "mixtral" else 1e4
    if V5:
        kw["rope_parameters"] = dict(scaling or {"rope_type": "default"}, rope_theta=theta)
    else:
        kw.update(rope_theta=theta, rope_scaling=dict(scaling) if scaling else None)
    return getattr(transformers, name)(**kw)


def randomise(model, seed):
    """Weights of O(1) effect (transformers' own init, std 0.02, leaves the logits near zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # [..., out, in] projections, routers and fused expert tensors
                p.copy_(noise / math.sqrt(p.shape[-1]))


def respell(path, arch):
    """Rewrites config.json into the other transformers major version's spelling."""
    cfg = json.loads((path / "config.json").read_text())
    if "rope_parameters" in cfg:  # 5 -> 4
        rope = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = rope.pop("rope_theta")
        kind = rope.get("rope_type", "default")
        cfg["rope_scaling"] = None if kind == "default" else {**rope, "type": kind}
        if "dtype" in cfg:
            cfg["torch_dtype"] = cfg.pop("dtype")
        if arch == "qwen3" and "num_local_experts" in cfg:
            cfg["num_experts"] = cfg.pop("num_local_experts")
        cfg["transformers_version"] = "4.57.1"
    else:  # 4 -> 5
        scaling = cfg.pop("rope_scaling", None) or {}
        scaling = {k: v for k, v in scaling.items() if k != "type"}
        cfg["rope_parameters"] = {"rope_type": "default", **scaling,
                                  "rope_theta": cfg.pop("rope_theta")}
        if "torch_dtype" in cfg:
            cfg["dtype"] = cfg.pop("torch_dtype")
        if arch == "qwen3":
            cfg["num_local_experts"] = cfg.pop("num_experts")
        cfg["transformers_version"] = "5.0.0"
    (path / "config.json").write_text(json.dumps(cfg))
    return cfg


def hf_kv(out, layer):
    """transformers' cached keys/values of `layer` as [T, KVH, D] NumPy arrays."""
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = out.past_key_values
    if hasattr(cache, "layers"):
        k, v = cache.layers[layer].keys, cache.layers[layer].values
    else:
        k, v = cache[layer]
    return k[0].transpose(0, 1).numpy(), v[0].transpose(0, 1).numpy()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Case index -> (directory, tokens, logits [T, V], [(keys, values)] per layer)."""
    done = {}

    def get(i):
        if i not in done:
            arch, scaling, fields = CASES[i]
            torch.manual_seed(i)
            hf = transformers.AutoModelForCausalLM.from_config(
                hf_config(arch, scaling, fields), attn_implementation="eager").float().eval()
            randomise(hf, i)
            path = tmp_path_factory.mktemp(f"case{i}")
            hf.save_pretrained(path)
            toks = np.random.default_rng(i).integers(0, COMMON["vocab_size"], T)
            with torch.no_grad():
                out = hf(torch.tensor(toks[None], dtype=torch.long), use_cache=True)
            kv = [hf_kv(out, l) for l in range(COMMON["num_hidden_layers"])]
            done[i] = (path, toks.astype(np.int32), out.logits[0].numpy(), kv)
        return done[i]

    return get


def _check(model, config, toks, logits, kv, err):
    cache = M.init_cache(config, CAPACITY)
    whole, whole_cache, _ = M.forward(model, toks, cache)
    assert_close(whole, logits, np.float32, err_msg=f"{err}: logits")
    first, cache, _ = M.forward(model, toks[:SPLIT], cache)
    second, cache, _ = M.forward(model, toks[SPLIT:], cache, start=SPLIT)
    assert_close(np.concatenate([first, second]), logits, np.float32,
                 err_msg=f"{err}: logits in two chunks")
    for l, (k, v) in enumerate(kv):
        n = k.shape[0]  # T, or the last positions a sliding-window cache of transformers keeps
        for got in (whole_cache, cache):
            assert_close(np.asarray(got.keys[l][T - n:T]), k, np.float32,
                         err_msg=f"{err}: keys {l}")
            assert_close(np.asarray(got.values[l][T - n:T]), v, np.float32,
                         err_msg=f"{err}: values {l}")


@pytest.mark.parametrize("spelling", ["as written", "respelled"])
@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{a}-{(s or {}).get('rope_type', 'default')}"
                              + "".join(f"-{k}" for k in f) for a, s, f in CASES])
def test_matches_transformers(written, case, spelling, tmp_path):
    arch, _, _ = CASES[case]
    path, toks, logits, kv = written(case)
    if spelling == "respelled":
        import shutil

        shutil.copytree(path, tmp_path, dirs_exist_ok=True)
        path = tmp_path
        cfg = respell(path, arch)
    else:
        cfg = json.loads((path / "config.json").read_text())
    if cfg.get("use_sliding_window") and cfg.get("max_window_layers"):
        # transformers 4.51 wrote max_window_layers and windowed only the layers from it on;
        # later versions window every layer: the loader refuses the ambiguity.
        with pytest.raises(CheckpointError, match="max_window_layers"):
            load_model(str(path), progress=False)
        return
    model, ckpt = load_model(str(path), progress=False)
    _check(model, ckpt.config, toks, logits, kv, f"{CASES[case]} {spelling}")


def test_refuses_what_transformers_writes_but_strata_does_not_implement(tmp_path):
    """A transformers-written checkpoint with a field the engine does not implement is refused
    with the field named (OLMoE's clip_qkv)."""
    cfg = hf_config("olmoe", None, {"clip_qkv": 0.5})
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    hf.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="clip_qkv=0.5"):
        load_model(str(tmp_path), progress=False)
