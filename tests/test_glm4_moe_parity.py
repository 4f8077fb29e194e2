"""GLM-4.5 checkpoints written by Hugging Face transformers itself (`Glm4MoeForCausalLM`),
loaded by strata_jax and compared with transformers' own float32 model: the logits at every
position, read whole, in chunks, and by the engine (resident, streamed, routed, layer-major)
across a follow-up turn.

Opt-in: needs torch and transformers >= 5 with GLM-4.5 (skipped without them) and is marked
slow: `python -m pytest -q -m slow tests/test_glm4_moe_parity.py`.
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Glm4MoeForCausalLM"):
    pytest.skip("transformers without GLM-4.5", allow_module_level=True)

from strata_jax.checkpoint import load_checkpoint, load_model  # noqa: E402
from strata_jax.engine import Engine  # noqa: E402
from strata_jax.models import forward, init_cache  # noqa: E402
from strata_jax.stream import StreamConfig, StreamTuning  # noqa: E402
from strata_jax.testing import assert_close  # noqa: E402

pytestmark = pytest.mark.slow

T, FIRST, CAPACITY = 60, 37, 128
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
              first_k_dense_replace=1, max_position_embeddings=256, tie_word_embeddings=False)
CASES = {
    # Every GLM-4.5 feature on: q/k norms, q/k/v biases, 2 groups of which 1 is kept, the
    # routed weights scaled by 2.5, half of each head rotated (transformers' default).
    "qk-norm-bias-groups": dict(use_qk_norm=True, attention_bias=True, n_group=2, topk_group=1,
                                routed_scaling_factor=2.5),
    # GLM-4.5-Air's kind: no q/k norms; no biases, two shared experts, a quarter rotated.
    "plain-quarter-rotary": dict(use_qk_norm=False, attention_bias=False, n_shared_experts=2,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                  "partial_rotary_factor": 0.25}),
}


def randomise(model, seed):
    """Weights of O(1) effect (transformers' own init, std 0.02, leaves the logits near zero)
    and selection biases that change choices."""
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
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g, dtype=torch.float32))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Case -> (directory, tokens, float32 logits [T, V])."""
    done = {}

    def get(case):
        if case not in done:
            torch.manual_seed(0)
            hf = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
                **COMMON, **CASES[case], attn_implementation="eager"))
            hf.config._experts_implementation = "eager"
            hf = hf.float().eval()
            randomise(hf, 1)
            path = tmp_path_factory.mktemp(case)
            hf.save_pretrained(path)
            toks = np.random.default_rng(2).integers(0, COMMON["vocab_size"], T)
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor(toks[None], dtype=torch.long)).logits
            done[case] = (path, toks.astype(np.int32), logits[0].numpy())
        return done[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(written, case):
    path, toks, logits = written(case)
    model, ckpt = load_model(str(path), progress=False)
    c = ckpt.config
    assert c.rotary_dim == (8 if case.startswith("qk") else 4) and c.n_dense_layers == 1
    assert np.abs(ckpt.params["layers.1.mlp.selection_bias"]).max() > 0.1
    whole, _, _ = forward(model, toks, init_cache(c, CAPACITY))
    assert_close(whole, logits, np.float32, err_msg=f"{case}: one chunk")
    cache, parts, at = init_cache(c, CAPACITY), [], 0
    for n in (FIRST, 11, T - FIRST - 11):
        out, cache, _ = forward(model, toks[at:at + n], cache, start=at)
        parts.append(np.asarray(out))
        at += n
    assert_close(np.concatenate(parts), logits, np.float32, err_msg=f"{case}: three chunks")


ARMS = {
    "resident": (None, {}),
    "stream-all": (StreamConfig(routed=False, tuning=StreamTuning(stream_floor=16)), {}),
    "routed": (StreamConfig(routed=True, tuning=StreamTuning(stream_floor=4096)), {}),
    "layer-major": (StreamConfig(routed=True), {"order": "layer-major"}),
}


@pytest.mark.parametrize("arm", list(ARMS))
def test_engine_turns_match_transformers(written, arm):
    """A prompt in chunks of 16 (a padded last chunk), then a follow-up turn from the session:
    each turn's last logits are transformers' at that position."""
    case = "qk-norm-bias-groups"
    path, toks, logits = written(case)
    ckpt = load_checkpoint(str(path), progress=False)
    stream, kw = ARMS[arm]
    with Engine(ckpt.config, ckpt.params, stream, experts=ckpt.experts.as_mapping(),
                max_context=CAPACITY, chunk_size=16) as eng:
        first = eng.prefill(toks[:FIRST], **kw)
        assert_close(first.logits, logits[FIRST - 1], np.float32, err_msg=f"{arm}: turn 1")
        second = eng.prefill(toks[FIRST:], first.session, **kw)
        assert_close(second.logits, logits[-1], np.float32, err_msg=f"{arm}: turn 2")
