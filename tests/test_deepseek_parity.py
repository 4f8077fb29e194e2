"""DeepSeek-V3 checkpoints (multi-head latent attention) written by Hugging Face transformers
itself, loaded by strata_jax and compared with transformers' own float32 model: the logits at
every position, read whole and in chunks, by the engine (resident, streamed, routed,
layer-major) and across a follow-up turn.

Opt-in: needs torch and transformers >= 5 (skipped without them) and is marked slow:
`python -m pytest -q -m slow tests/test_deepseek_parity.py`.
"""

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip("transformers without DeepSeek-V3", allow_module_level=True)

from strata_jax.checkpoint import load_checkpoint, load_model  # noqa: E402
from strata_jax.engine import Engine  # noqa: E402
from strata_jax.layers import mla  # noqa: E402
from strata_jax.models import forward, init_cache  # noqa: E402
from strata_jax.stream import StreamConfig, StreamTuning  # noqa: E402
from strata_jax.testing import assert_close  # noqa: E402

pytestmark = pytest.mark.slow

T, FIRST = 80, 45  # a prompt, and a follow-up turn after FIRST tokens
BASE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=6, moe_intermediate_size=16, intermediate_size=24, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
            topk_group=1, routed_scaling_factor=2.5, max_position_embeddings=256,
            tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0}
CASES = {
    # queries through a low rank, YaRN with the softmax-scale correction, interleaved pairs
    "q-lora-yarn": dict(BASE, q_lora_rank=12, rope_parameters=YARN),
    # one q_proj, plain RoPE, half-split rotary dims, two shared experts
    "q-proj": dict(BASE, q_lora_rank=None, rope_interleave=False, n_shared_experts=2,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
}


def randomise(model, seed):
    """Weights of O(1) effect; a selection bias that changes the choice."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * noise)
            elif "inv_freq" in name:
                continue
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Case -> (directory, tokens, transformers' float32 logits [T, V])."""
    done = {}

    def get(case):
        if case not in done:
            torch.manual_seed(0)
            hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CASES[case]))
            hf.config._experts_implementation = "eager"
            hf = hf.float().eval()
            randomise(hf, 1)
            path = tmp_path_factory.mktemp(case)
            hf.save_pretrained(path)
            toks = np.random.default_rng(2).integers(0, BASE["vocab_size"], T)
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor(toks[None], dtype=torch.long)).logits
            done[case] = (path, toks.astype(np.int32), logits[0].numpy())
        return done[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(written, case, monkeypatch):
    path, toks, logits = written(case)
    model, ckpt = load_model(str(path), progress=False)
    c = ckpt.config
    assert c.q_lora_rank == (CASES[case]["q_lora_rank"] or 0)
    whole, _, _ = forward(model, toks, init_cache(c, 128))
    assert_close(whole, logits, np.float32, err_msg=f"{case}: one chunk")
    # Blocks of 16 positions: a later chunk's prefix spans several.
    monkeypatch.setattr(mla, "PREFIX_BLOCK_BYTES", 1)
    monkeypatch.setattr(mla, "PREFIX_MIN_BLOCK", 16)
    cache, parts, at = init_cache(c, 128), [], 0
    for n in (30, 1, T - 31):
        out, cache, _ = forward(model, toks[at:at + n], cache, start=at)
        parts.append(np.asarray(out))
        at += n
    assert_close(np.concatenate(parts), logits, np.float32, err_msg=f"{case}: three chunks")


def test_kimi_k2_model_type_reads_as_deepseek_v3(written, tmp_path):
    """Kimi-K2's config.json names the same class with model_type kimi_k2 and its original
    code's fields: read alike; a field of neither is refused by name."""
    path, toks, logits = written("q-lora-yarn")
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(model_type="kimi_k2", topk_method="noaux_tc", scoring_func="sigmoid",
               moe_layer_freq=1, ep_size=1, seq_aux=True, aux_loss_alpha=0.001,
               num_nextn_predict_layers=0,
               auto_map={"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, ckpt = load_model(str(tmp_path), progress=False)
    whole, _, _ = forward(model, toks, init_cache(ckpt.config, 128))
    assert_close(whole, logits, np.float32, err_msg="kimi_k2")
    cfg["moe_router_activation"] = "sigmoid"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="moe_router_activation"):
        load_model(str(tmp_path), progress=False)


ARMS = {
    "resident": (None, {}),
    "stream-all": (StreamConfig(routed=False, tuning=StreamTuning(stream_floor=16)), {}),
    "routed": (StreamConfig(routed=True, tuning=StreamTuning(stream_floor=4096)), {}),
    "layer-major": (StreamConfig(routed=True), {"order": "layer-major"}),
}


@pytest.mark.parametrize("arm", list(ARMS))
@pytest.mark.parametrize("case", list(CASES))
def test_engine_turns_match_transformers(written, case, arm):
    """A prompt in chunks of 16 (padded last chunks), then a follow-up turn from the session:
    each turn's last logits are transformers' at that position."""
    path, toks, logits = written(case)
    ckpt = load_checkpoint(str(path), progress=False)
    stream, kw = ARMS[arm]
    with Engine(ckpt.config, ckpt.params, stream, experts=ckpt.experts.as_mapping(),
                max_context=128, chunk_size=16) as eng:
        first = eng.prefill(toks[:FIRST], **kw)
        assert_close(first.logits, logits[FIRST - 1], np.float32, err_msg=f"{case} {arm}: turn 1")
        second = eng.prefill(toks[FIRST:], first.session, **kw)
        assert_close(second.logits, logits[-1], np.float32, err_msg=f"{case} {arm}: turn 2")
