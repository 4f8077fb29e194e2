"""Text in: a checkpoint's tokenizer.json (made here by `tokenizers` itself, a WordLevel model
trained on a few sentences) encodes `--prompt TEXT`, `--prompt-file F --prompt-format text` and
`Engine.prefill(str)` / `Engine.score(str)` to the ids that give the same bits; the command shows
the next tokens and score's costliest tokens as text; text without a tokenizer is refused (one
line, exit 2, saying to pass ids), and so is a bad tokenizer.json (naming the file).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers
from test_cli import run, run_json
from tokenizers import models, pre_tokenizers, trainers

from strata_jax import Engine, Tokenizer, cli
from strata_jax.checkpoint import load_checkpoint
from strata_jax.synthetic import init_synthetic
from strata_jax.testing import hf_tensors, write_hf_checkpoint
from strata_jax.text import TokenizerError

SENTENCES = ["the cat sat on the mat", "a dog ran to the cat", "the mat was red and the dog sat"]
TEXT = "the dog sat on the red mat and the cat ran"


def make_tokenizer(words=None) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(words or SENTENCES,
                            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    return tok


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint (vocab 512) with its tokenizer.json."""
    path = tmp_path_factory.mktemp("ckpt")
    cfg = cli.model_config("qwen3-30b-a3b", "tiny", experts=8, top_k=2, expert_width=24,
                           dtype="float32")
    write_hf_checkpoint(path, cfg, "qwen3-30b-a3b",
                        hf_tensors(cfg, init_synthetic(cfg, 0, 0.0), "qwen3-30b-a3b"))
    make_tokenizer().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def bare_dir(ckpt_dir, tmp_path_factory):
    """The same checkpoint without a tokenizer.json."""
    path = tmp_path_factory.mktemp("bare")
    for f in ckpt_dir.iterdir():
        if f.name != "tokenizer.json":
            (path / f.name).write_bytes(f.read_bytes())
    return path


def ids_of(text: str) -> np.ndarray:
    return np.asarray(make_tokenizer().encode(text).ids, np.int32)


# ---- the Tokenizer ------------------------------------------------------------------------------


def test_tokenizer_encodes_decodes_and_refuses_ids_past_the_vocabulary(ckpt_dir, tmp_path):
    tok = Tokenizer.from_checkpoint(str(ckpt_dir))
    assert tok.vocab_size == 512  # config.json's, not the tokenizer's own size
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32 and np.array_equal(ids, ids_of(TEXT))
    assert tok.decode(ids) == TEXT and tok.pieces(ids[:2]) == ["the", "dog"]
    with pytest.raises(TokenizerError, match=r"outside the model's vocabulary \[0, 512\)"):
        tok.decode([3, 600])
    # A tokenizer larger than the model: text past the model's ids is refused.
    words = [" ".join(f"w{i}" for i in range(600))]
    path = tmp_path / "big.json"
    make_tokenizer(words).save(str(path))
    big = Tokenizer.from_file(str(path), vocab_size=512)
    assert big.encode("w1 w2").size == 2
    with pytest.raises(TokenizerError, match=r"outside the model's vocabulary \[0, 512\)"):
        big.encode("w1 " + max(words[0].split(), key=lambda w: big.tokenizer.token_to_id(w)))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match=str(bad)):
        Tokenizer.from_file(str(bad))
    with pytest.raises(TokenizerError, match="no tokenizer.json; pass token ids"):
        Tokenizer.from_checkpoint(str(tmp_path / "nothing"))


# ---- the Python API -----------------------------------------------------------------------------


def test_engine_takes_text_with_a_tokenizer_and_refuses_it_without(ckpt_dir, bare_dir, tmp_path):
    ckpt = load_checkpoint(str(ckpt_dir), progress=False)
    assert isinstance(ckpt.tokenizer, Tokenizer) and ckpt.tokenizer.vocab_size == 512
    ids = ids_of(TEXT)
    kw = {"experts": ckpt.experts.as_mapping(), "max_context": 64, "chunk_size": 64}
    with Engine(ckpt.config, ckpt.params, None, tokenizer=ckpt.tokenizer, **kw) as engine:
        a, b = engine.prefill(TEXT), engine.prefill(ids)
        assert np.array_equal(np.asarray(a.logits), np.asarray(b.logits))
        assert a.kv_sha256() == b.kv_sha256()
        s, t = engine.score(TEXT), engine.score(ids)
        assert np.array_equal(s.logprobs, t.logprobs) and s.scored == ids.size - 1
    with Engine(ckpt.config, ckpt.params, None, **kw) as engine:
        with pytest.raises(TypeError, match="pass token ids, or make the Engine with tokenizer="):
            engine.prefill(TEXT)
        with pytest.raises(TypeError, match="needs a tokenizer"):
            engine.score(TEXT)
    with pytest.raises(TypeError, match="strata_jax.Tokenizer"):
        Engine(ckpt.config, ckpt.params, None, tokenizer=make_tokenizer(), **kw)
    assert load_checkpoint(str(bare_dir), progress=False).tokenizer is None
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in bare_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "tokenizer.json").write_text("{}")
    loaded = load_checkpoint(str(broken), progress=False)  # the weights still load
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        _ = loaded.tokenizer


# ---- the command line ---------------------------------------------------------------------------


def test_prefill_text_gives_the_ids_bits_and_shows_next_tokens_as_text(ckpt_dir, tmp_path):
    ids = ids_of(TEXT)
    id_file = tmp_path / "ids.txt"
    id_file.write_text(" ".join(map(str, ids)))
    base = ["prefill", "--checkpoint", str(ckpt_dir), "--chunk", "64"]
    by_text = run_json([*base, "--prompt", TEXT])
    by_ids = run_json([*base, "--prompt-file", str(id_file)])
    assert by_text["tokens"] == ids.size
    assert (by_text["logits_sha256"], by_text["kv_sha256"]) == (by_ids["logits_sha256"],
                                                                by_ids["kv_sha256"])
    tok = Tokenizer.from_checkpoint(str(ckpt_dir))
    top = by_text["next_tokens"]
    assert len(top) == 5 and top == by_ids["next_tokens"]  # ids in: text shown all the same
    assert [t["text"] for t in top] == tok.pieces([t["id"] for t in top])
    assert all(t["logprob"] <= 0 for t in top)
    assert top[0]["logprob"] >= top[-1]["logprob"]
    rc, out, err = run([*base, "--prompt", TEXT, "-q"])
    assert rc == 0, err
    assert f"{ids.size} tokens of text from --prompt ({len(TEXT)} characters" in out
    line = next(l for l in out.splitlines() if l.startswith("next tokens: "))
    assert f"{top[0]['id']} {top[0]['text']!r} (p {np.exp(top[0]['logprob']):.3f})" in line


def test_score_text_file_shows_the_costliest_tokens(ckpt_dir, tmp_path):
    text_file = tmp_path / "prompt.txt"
    text_file.write_text(TEXT + "\n")
    ids = ids_of(TEXT)
    d = run_json(["score", "--checkpoint", str(ckpt_dir), "--chunk", "64", "--no-stream",
                  "--prompt-file", str(text_file), "--prompt-format", "text"])
    nll = -np.asarray(d["logprobs"], np.float64)
    worst = d["costliest"]
    assert [c["position"] for c in worst] == [int(i) + 1 for i in np.argsort(-nll,
                                                                           kind="stable")[:5]]
    assert [c["id"] for c in worst] == [int(ids[c["position"]]) for c in worst]
    assert [c["text"] for c in worst] == [TEXT.split()[c["position"]] for c in worst]
    assert [c["nll"] for c in worst] == pytest.approx(sorted(nll, reverse=True)[:5])
    rc, out, err = run(["score", "--checkpoint", str(ckpt_dir), "--chunk", "64", "--no-stream",
                        "-q", "--prompt", TEXT])
    assert rc == 0, err
    line = next(l for l in out.splitlines() if l.startswith("costliest tokens: "))
    c = worst[0]
    assert line.startswith(f"costliest tokens: position {c['position']}: {c['id']} "
                           f"{c['text']!r} (NLL {c['nll']:.3f})")


def _one_line_refusal(argv, words, command="prefill"):
    rc, out, err = run([command, *argv])
    assert (rc, out) == (2, ""), err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, lines
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize("command", ["prefill", "score"])
def test_text_without_a_tokenizer_is_one_line_saying_to_pass_ids(command, ckpt_dir, bare_dir,
                                                                 tmp_path):
    preset = ["--preset", "qwen3-30b-a3b", "--scale", "tiny"]
    _one_line_refusal([*preset, "--prompt", TEXT],
                      ["--preset model", "has none", "pass token ids"], command)
    _one_line_refusal(["--checkpoint", str(bare_dir), "--prompt", TEXT],
                      ["has no tokenizer.json", "pass token ids"], command)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in bare_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "tokenizer.json").write_text("{not json")
    _one_line_refusal(["--checkpoint", str(broken), "--prompt", TEXT],
                      [str(broken / "tokenizer.json"), "not a readable tokenizer.json",
                       "pass token ids"], command)


def test_prompt_forms_that_contradict_are_refused(ckpt_dir, tmp_path):
    ck = ["--checkpoint", str(ckpt_dir)]
    npy = tmp_path / "ids.npy"
    np.save(npy, np.arange(4))
    words = tmp_path / "words.txt"
    words.write_text(TEXT)
    big = tmp_path / "big"
    big.mkdir()
    for f in ckpt_dir.iterdir():
        (big / f.name).write_bytes(f.read_bytes())
    make_tokenizer([" ".join(f"w{i}" for i in range(600))]).save(str(big / "tokenizer.json"))
    last = max(json.loads((big / "tokenizer.json").read_text())["model"]["vocab"].items(),
               key=lambda kv: kv[1])[0]
    _one_line_refusal([*ck, "--prompt-format", "text"], ["applies to --prompt-file"])
    _one_line_refusal([*ck, "--prompt-file", str(npy), "--prompt-format", "text"],
                      [".npy array of token ids", "drop --prompt-format text"])
    _one_line_refusal([*ck, "--prompt-file", str(words)],
                      ["'the'", "not an integer", "--prompt-format text"])
    _one_line_refusal([*ck, "--prompt", TEXT, "--tokens", "8"], ["not allowed with"])
    _one_line_refusal([*ck, "--prompt", ""], ["encodes to no tokens"])
    _one_line_refusal(["--checkpoint", str(big), "--prompt", f"w1 {last}"],
                      ["--prompt", "outside the model's vocabulary [0, 512)"])
