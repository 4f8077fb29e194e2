"""Qwen3-Next and Qwen3.5-MoE checkpoints written by Hugging Face transformers itself, loaded by
strata_jax and compared with transformers' own model run in float64 (an independent
implementation of the published formulas): the float32 logits at every position, read whole, in
chunks, by the engine (resident, streamed, routed, layer-major) and across a follow-up turn.

The reference is transformers in float64, not in float32: the chunkwise delta rule amplifies
float32 rounding (transformers' float32 model and this one each land up to ~1e-4 from the
float64 logits at a few positions, on either side), so two float32 runs are compared through
the float64 one.

Opt-in: needs torch and transformers >= 5 (skipped without them) and is marked slow:
`python -m pytest -q -m slow tests/test_hybrid_parity.py`.
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5MoeForCausalLM"):
    pytest.skip("transformers without Qwen3.5-MoE", allow_module_level=True)

from strata_jax.checkpoint import load_checkpoint, load_model  # noqa: E402
from strata_jax.engine import Engine  # noqa: E402
from strata_jax.models import forward, init_cache  # noqa: E402
from strata_jax.stream import StreamConfig, StreamTuning  # noqa: E402
from strata_jax.testing import assert_close  # noqa: E402

pytestmark = pytest.mark.slow

T, FIRST = 150, 90  # a prompt past two DeltaNet blocks of 64; a follow-up turn after FIRST
TEXT = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=32,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            moe_intermediate_size=16, shared_expert_intermediate_size=16,
            num_experts_per_tok=2, num_experts=8, max_position_embeddings=256,
            tie_word_embeddings=False)
CASES = {
    "qwen3-next": lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **TEXT, norm_topk_prob=True)),
    "qwen3-next-interval2": lambda: transformers.Qwen3NextForCausalLM(
        transformers.Qwen3NextConfig(**TEXT, full_attention_interval=2,
                                     rope_parameters={"rope_type": "default",
                                                      "rope_theta": 1e6,
                                                      "partial_rotary_factor": 0.5})),
    "qwen3.5-moe": lambda: transformers.Qwen3_5MoeForCausalLM(
        transformers.Qwen3_5MoeTextConfig(**TEXT)),
    "qwen3.5-moe-multimodal": lambda: transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(
            text_config=dict(TEXT, rope_parameters={
                "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0], "mrope_interleaved": True}),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                               out_hidden_size=32))),
}


def randomise(model, seed):
    """Weights of O(1) effect: projections by fan-in, zero-centred norms near zero, the gated
    norm near one, decay rates as transformers draws them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("norm.weight"):
                p.copy_(0.1 * noise)
            elif name.endswith("A_log"):
                p.copy_(torch.log(1.0 + 15.0 * torch.rand(p.shape, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Case -> (directory, tokens, float64 logits [T, V])."""
    done = {}

    def get(case):
        if case not in done:
            torch.manual_seed(0)
            hf = CASES[case]()
            hf.config._experts_implementation = "eager"  # float64 runs the loop over experts
            hf = hf.float().eval()
            randomise(hf, 1)
            path = tmp_path_factory.mktemp(case)
            hf.save_pretrained(path)
            toks = np.random.default_rng(2).integers(0, TEXT["vocab_size"], T)
            with torch.no_grad():
                logits = hf.double()(input_ids=torch.tensor(toks[None], dtype=torch.long)).logits
            done[case] = (path, toks.astype(np.int32), logits[0].numpy())
        return done[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(written, case):
    path, toks, logits = written(case)
    model, ckpt = load_model(str(path), progress=False)
    c = ckpt.config
    whole, _, _ = forward(model, toks, init_cache(c, 256))
    assert_close(whole, logits, np.float32, err_msg=f"{case}: one chunk")
    cache, parts, at = init_cache(c, 256), [], 0
    for n in (FIRST, 37, T - FIRST - 37):  # chunks cutting DeltaNet blocks anywhere
        out, cache, _ = forward(model, toks[at:at + n], cache, start=at)
        parts.append(np.asarray(out))
        at += n
    assert_close(np.concatenate(parts), logits, np.float32, err_msg=f"{case}: three chunks")


ARMS = {
    "resident": (None, {}),
    "stream-all": (StreamConfig(routed=False, tuning=StreamTuning(stream_floor=32)), {}),
    "routed": (StreamConfig(routed=True, tuning=StreamTuning(stream_floor=4096)), {}),
    "layer-major": (StreamConfig(routed=True), {"order": "layer-major"}),
}


@pytest.mark.parametrize("arm", list(ARMS))
@pytest.mark.parametrize("case", ["qwen3-next", "qwen3.5-moe-multimodal"])
def test_engine_turns_match_transformers(written, case, arm):
    """A prompt in chunks of 32 (padded last chunks), then a follow-up turn from the session:
    each turn's last logits are transformers' at that position."""
    path, toks, logits = written(case)
    ckpt = load_checkpoint(str(path), progress=False)
    stream, kw = ARMS[arm]
    with Engine(ckpt.config, ckpt.params, stream, experts=ckpt.experts.as_mapping(),
                max_context=256, chunk_size=32) as eng:
        first = eng.prefill(toks[:FIRST], **kw)
        assert_close(first.logits, logits[FIRST - 1], np.float32, err_msg=f"{case} {arm}: turn 1")
        second = eng.prefill(toks[FIRST:], first.session, **kw)
        assert_close(second.logits, logits[-1], np.float32, err_msg=f"{case} {arm}: turn 2")
