"""gpt-oss checkpoints written by Hugging Face transformers itself (`GptOssForCausalLM`), plain
and with MXFP4 experts in the published layout, loaded by strata_jax and compared with
transformers' own float32 model: the logits at every position of a prompt longer than the
sliding window, read whole, in chunks, and by the engine (resident, streamed, routed,
layer-major) across a follow-up turn; the MXFP4 experts' weights against transformers' own
conversion of the same blocks, bit for bit.

Opt-in: needs torch and transformers >= 5 with gpt-oss (skipped without them) and is marked
slow: `python -m pytest -q -m slow tests/test_gpt_oss_parity.py`.
"""

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "GptOssForCausalLM"):
    pytest.skip("transformers without gpt-oss", allow_module_level=True)

from safetensors.torch import load_file, save_file  # noqa: E402

from strata_jax.checkpoint import load_checkpoint, load_model  # noqa: E402
from strata_jax.engine import Engine  # noqa: E402
from strata_jax.formats import (ExpertFormat, mxfp4_quantize_np,  # noqa: E402
                                mxfp4_to_blocks_np)
from strata_jax.models import forward, init_cache  # noqa: E402
from strata_jax.stream import StreamConfig, StreamTuning  # noqa: E402
from strata_jax.testing import assert_close  # noqa: E402

pytestmark = pytest.mark.slow

T, FIRST, CAPACITY = 60, 37, 128
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
              num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
              tie_word_embeddings=False)
CASES = {
    # The published kind: every bias, sinks, alternating windows of 8 (the prompt is 60), YaRN
    # x32 not truncated (transformers' default), a clamp the random products reach.
    "published": dict(swiglu_limit=1.0),
    # No attention biases, plain RoPE, full attention in the first layer, another alpha.
    "plain-rope": dict(attention_bias=False, swiglu_limit=2.0, swiglu_alpha=1.2,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                       layer_types=["full_attention", "sliding_attention",
                                    "sliding_attention", "full_attention"]),
}
MXFP4_KEEP = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
              "lm_head"]


def randomise(model, seed):
    """Weights of O(1) effect (transformers' own init leaves the logits near zero), sinks
    large enough to take a share of each row, router biases that change choices."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("sinks"):
                p.copy_(2.0 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif name.endswith(("gate_up_proj", "down_proj")):  # [E, in, out]
                p.copy_(noise / math.sqrt(p.shape[-2]))
            else:  # [out, in] linears and the router
                p.copy_(noise / math.sqrt(p.shape[-1]))


def _mxfp4(path):
    """The checkpoint at `path` rewritten as the release stores it: each layer's gate_up_proj
    and down_proj as MXFP4 `_blocks` / `_scales` (round to nearest, the OCP rule)."""
    t = load_file(str(path / "model.safetensors"))
    for name in [n for n in t if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        q, s = mxfp4_quantize_np(t.pop(name).numpy())  # [E, in, out]
        blocks, scales = mxfp4_to_blocks_np(q, s)
        t[name + "_blocks"], t[name + "_scales"] = map(torch.from_numpy, (blocks, scales))
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_KEEP}
    (path / "config.json").write_text(json.dumps(cfg))


def _logits(hf, toks):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(toks[None], dtype=torch.long)).logits[0].numpy()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(case, mxfp4) -> (directory, tokens, transformers' float32 logits [T, V], its model)."""
    done = {}

    def get(case, mxfp4=False):
        if (case, mxfp4) not in done:
            torch.manual_seed(0)
            hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(
                **COMMON, **CASES[case], attn_implementation="eager"))
            hf.config._experts_implementation = "eager"
            hf = hf.float().eval()
            randomise(hf, 1)
            path = tmp_path_factory.mktemp(f"{case}-mxfp4" if mxfp4 else case)
            hf.save_pretrained(path)
            toks = np.random.default_rng(2).integers(0, COMMON["vocab_size"], T)
            if mxfp4:  # transformers' own read of the MXFP4 files, dequantized to float32
                _mxfp4(path)
                hf = transformers.GptOssForCausalLM.from_pretrained(
                    path, quantization_config=transformers.Mxfp4Config(dequantize=True),
                    dtype=torch.float32, attn_implementation="eager").eval()
                hf.config._experts_implementation = "eager"
            done[case, mxfp4] = (path, toks.astype(np.int32), _logits(hf, toks), hf)
        return done[case, mxfp4]

    return get


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16-layout", "mxfp4"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(written, case, mxfp4):
    path, toks, logits, _ = written(case, mxfp4)
    model, ckpt = load_model(str(path), progress=False)
    c = ckpt.config
    assert c.expert_format == ("mxfp4" if mxfp4 else "plain") and c.attention_sinks
    assert c.window_of(0) == (8 if case == "published" else None)
    whole, _, _ = forward(model, toks, init_cache(c, CAPACITY))
    assert_close(whole, logits, np.float32, err_msg=f"{case}: one chunk")
    cache, parts, at = init_cache(c, CAPACITY), [], 0
    for n in (FIRST, 11, T - FIRST - 11):
        out, cache, _ = forward(model, toks[at:at + n], cache, start=at)
        parts.append(np.asarray(out))
        at += n
    assert_close(np.concatenate(parts), logits, np.float32, err_msg=f"{case}: three chunks")


def test_mxfp4_experts_are_transformers_conversion_bit_for_bit(written):
    """The published MXFP4 layout read into the format's planes and dequantized to float32 is
    exactly what transformers' own conversion of the same blocks gives (gate the even
    outputs of gate_up_proj, up the odd)."""
    path, _, _, hf = written("published", True)
    ckpt = load_checkpoint(str(path), progress=False)
    fmt = ExpertFormat.of(ckpt.config)
    for layer in ckpt.config.moe_layers:
        planes = ckpt.experts.planes(layer)
        ours = {m: fmt.dequantize_np(planes, m, np.float32) for m in ("gate", "up", "down")}
        theirs = hf.model.layers[layer].mlp.experts
        gate_up = theirs.gate_up_proj.detach().numpy()
        for got, want in ((ours["gate"], gate_up[..., 0::2]), (ours["up"], gate_up[..., 1::2]),
                          (ours["down"], theirs.down_proj.detach().numpy())):
            assert got.tobytes() == np.ascontiguousarray(want).tobytes()


ARMS = {
    "resident": (None, {}),
    "stream-all": (StreamConfig(routed=False, tuning=StreamTuning(stream_floor=16)), {}),
    "routed": (StreamConfig(routed=True, tuning=StreamTuning(stream_floor=4096)), {}),
    "layer-major": (StreamConfig(routed=True), {"order": "layer-major"}),
}


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16-layout", "mxfp4"])
@pytest.mark.parametrize("arm", list(ARMS))
def test_engine_turns_match_transformers(written, arm, mxfp4):
    """A prompt in chunks of 16 (past the window; a padded last chunk), then a follow-up turn
    from the session: each turn's last logits are transformers' at that position."""
    path, toks, logits, _ = written("published", mxfp4)
    ckpt = load_checkpoint(str(path), progress=False)
    stream, kw = ARMS[arm]
    with Engine(ckpt.config, ckpt.params, stream, experts=ckpt.experts.as_mapping(),
                max_context=CAPACITY, chunk_size=16) as eng:
        first = eng.prefill(toks[:FIRST], **kw)
        assert_close(first.logits, logits[FIRST - 1], np.float32, err_msg=f"{arm}: turn 1")
        second = eng.prefill(toks[FIRST:], first.session, **kw)
        assert_close(second.logits, logits[-1], np.float32, err_msg=f"{arm}: turn 2")
