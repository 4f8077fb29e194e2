"""Text in: a checkpoint's tokenizer.json (made here by `tokenizers` itself, a WordLevel model
trained on a few sentences) encodes `--prompt TEXT`, `--prompt-file F --prompt-format text`,
prefill's follow-up turn (`--follow-up-prompt`, `--follow-up-file`), profile's prompts and
`Engine.prefill(str)` / `Engine.score(str)` (first turn or follow-up) to the ids that give the
same bits; a follow-up turn's text is encoded without the special tokens (one BOS, at the
start); the command shows the next tokens (both turns'), score's costliest tokens and profile's
prompts as text; text without a tokenizer is refused (one line, exit 2, saying to pass ids), and
so is a bad tokenizer.json (naming the file), empty text and a follow-up given two ways.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers
from test_cli import run, run_json
from tokenizers import models, pre_tokenizers, processors, trainers

from strata_jax import Engine, Tokenizer, cli
from strata_jax.checkpoint import load_checkpoint
from strata_jax.synthetic import init_synthetic
from strata_jax.testing import hf_tensors, write_hf_checkpoint
from strata_jax.profile import ExpertProfile
from strata_jax.text import TokenizerError, prompt_ids

SENTENCES = ["the cat sat on the mat", "a dog ran to the cat", "the mat was red and the dog sat"]
TEXT = "the dog sat on the red mat and the cat ran"
MORE = "a cat sat on the dog"  # a follow-up turn


def make_tokenizer(words=None, bos: bool = False) -> tokenizers.Tokenizer:
    """A WordLevel tokenizer of `words`' words; `bos`: one that puts [BOS] before a text, as
    Llama's and Mixtral's tokenizer.json do."""
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["[UNK]", "[BOS]"] if bos else ["[UNK]"]
    tok.train_from_iterator(words or SENTENCES, trainers.WordLevelTrainer(special_tokens=special))
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="[BOS] $A", special_tokens=[("[BOS]", tok.token_to_id("[BOS]"))])
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
    with Engine(ckpt.config, ckpt.params, None, **kw) as engine:  # a follow-up turn as well
        first = engine.prefill(ids)
        with pytest.raises(TypeError, match="needs a tokenizer"):
            engine.prefill(MORE, first.session)
    assert load_checkpoint(str(bare_dir), progress=False).tokenizer is None
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in bare_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "tokenizer.json").write_text("{}")
    loaded = load_checkpoint(str(broken), progress=False)  # the weights still load
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        _ = loaded.tokenizer


def test_a_follow_up_turn_takes_text_without_the_special_tokens(ckpt_dir):
    ckpt = load_checkpoint(str(ckpt_dir), progress=False)
    tok = Tokenizer(make_tokenizer(bos=True), 512)
    bos = tok.tokenizer.token_to_id("[BOS]")
    first, more = tok.encode(TEXT), tok.encode(MORE, add_special_tokens=False)
    assert first[0] == bos and bos not in more and more.size == len(MORE.split())
    assert np.array_equal(prompt_ids(MORE, tok, continuation=True), more)
    assert np.array_equal(prompt_ids(MORE, tok), np.concatenate([[bos], more]))
    kw = {"experts": ckpt.experts.as_mapping(), "max_context": 64, "chunk_size": 64}
    with Engine(ckpt.config, ckpt.params, None, tokenizer=tok, **kw) as engine:
        a = engine.prefill(TEXT)
        assert a.read == first.size  # the first turn with its BOS
        by_text, by_ids = engine.prefill(MORE, a.session), engine.prefill(more, a.session)
        assert by_text.read == more.size and by_text.reused == first.size
        assert np.array_equal(np.asarray(by_text.logits), np.asarray(by_ids.logits))
        assert by_text.kv_sha256() == by_ids.kv_sha256()
        # The two turns read as the one sequence of both texts (other chunks: other sums).
        whole = engine.prefill(np.concatenate([first, more]))
        np.testing.assert_allclose(np.asarray(whole.logits), np.asarray(by_text.logits),
                                   rtol=1e-5, atol=1e-5)
        s = engine.score(MORE, a.session)
        assert s.scored == more.size - 1


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


@pytest.mark.slow
def test_follow_up_text_gives_the_ids_bits_and_shows_its_next_tokens(ckpt_dir, tmp_path):
    ids, more = ids_of(TEXT), ids_of(MORE)
    id_file, more_ids, more_text, text_file = (tmp_path / n for n in (
        "ids.txt", "more_ids.txt", "more.txt", "prompt.txt"))
    id_file.write_text(" ".join(map(str, ids)))
    more_ids.write_text(",".join(map(str, more)))
    more_text.write_text(MORE + "\n")
    text_file.write_text(TEXT)
    base = ["prefill", "--checkpoint", str(ckpt_dir), "--chunk", "64"]
    runs = [run_json([*base, "--prompt", TEXT, "--follow-up-prompt", MORE]),
            run_json([*base, "--prompt-file", str(id_file), "--follow-up-file", str(more_ids)]),
            run_json([*base, "--prompt-file", str(text_file), "--prompt-format", "text",
                      "--follow-up-file", str(more_text)]),
            run_json([*base, "--prompt", TEXT, "--follow-up-file", str(more_ids)])]
    tok = Tokenizer.from_checkpoint(str(ckpt_dir))
    for d in runs:
        f = d["follow_up"]
        assert (f["tokens"], f["reused"], f["read"]) == (ids.size + more.size, ids.size,
                                                         more.size)
        assert (f["logits_sha256"], f["kv_sha256"]) == (runs[0]["follow_up"]["logits_sha256"],
                                                        runs[0]["follow_up"]["kv_sha256"])
        top = f["next_tokens"]
        assert top == runs[0]["follow_up"]["next_tokens"] and len(top) == 5
        assert [t["text"] for t in top] == tok.pieces([t["id"] for t in top])
    assert runs[0]["follow_up"]["logits_sha256"] != runs[0]["logits_sha256"]
    # Random ids stay possible after a text prompt.
    d = run_json([*base, "--prompt", TEXT, "--follow-up", "3"])
    assert d["follow_up"]["read"] == 3 and d["follow_up"]["next_tokens"][0]["text"] is not None
    rc, out, err = run([*base, "--prompt", TEXT, "--follow-up-prompt", MORE, "-q"])
    assert rc == 0, err
    assert (f"follow-up prompt: {more.size} tokens of text from --follow-up-prompt "
            f"({len(MORE)} characters") in out
    line = next(l for l in out.splitlines() if l.startswith("follow-up next tokens: "))
    t = runs[0]["follow_up"]["next_tokens"][0]
    assert line.startswith(f"follow-up next tokens: {t['id']} {t['text']!r} (p ")


def test_follow_up_refusals_name_the_options_and_the_way_out(ckpt_dir, bare_dir, tmp_path):
    ck = ["--checkpoint", str(ckpt_dir), "--prompt", TEXT]
    _one_line_refusal([*ck, "--follow-up", "4", "--follow-up-prompt", MORE],
                      ["--follow-up 4 and --follow-up-prompt", "give one"])
    ids = tmp_path / "more.txt"
    ids.write_text("1 2 3")
    _one_line_refusal([*ck, "--follow-up", "4", "--follow-up-file", str(ids)],
                      ["--follow-up 4 and --follow-up-file", "give one"])
    _one_line_refusal([*ck, "--follow-up-prompt", MORE, "--follow-up-file", str(ids)],
                      ["--follow-up-file", "not allowed with", "--follow-up-prompt"])
    _one_line_refusal([*ck, "--follow-up-prompt", "  "], ["--follow-up-prompt",
                                                          "encodes to no tokens"])
    _one_line_refusal(["--preset", "qwen3-30b-a3b", "--scale", "tiny", "--follow-up-prompt", MORE],
                      ["--follow-up-prompt needs a tokenizer", "--preset model",
                       "--follow-up-file FILE of ids, or --follow-up N"])
    _one_line_refusal(["--checkpoint", str(bare_dir), "--follow-up-prompt", MORE],
                      ["has no tokenizer.json", "--follow-up-file FILE of ids"])
    _one_line_refusal(["--checkpoint", str(bare_dir), "--follow-up-file", str(ids),
                       "--prompt-format", "text"],
                      ["--prompt-format text (--follow-up-file)", "has no tokenizer.json"])


def test_profile_takes_text_and_shows_its_prompts_as_text(ckpt_dir, tmp_path):
    ids, more = ids_of(TEXT), ids_of(MORE)
    files = []
    for name, values in (("a.txt", ids), ("b.npy", more)):
        path = tmp_path / name
        if name.endswith(".npy"):
            np.save(path, values)
        else:
            path.write_text(" ".join(map(str, values)))
        files += ["--prompt-file", str(path)]
    text_file = tmp_path / "more.txt"
    text_file.write_text(MORE)
    base = ["profile", "--checkpoint", str(ckpt_dir), "--chunk", "64", "--no-stream"]
    by_text = run_json([*base, "--prompt", TEXT, "--prompt", MORE, "--out",
                        str(tmp_path / "t.npz")])
    by_ids = run_json([*base, *files, "--out", str(tmp_path / "i.npz")])
    by_file = run_json([*base, "--prompt-file", str(text_file), "--prompt-format", "text",
                        "--out", str(tmp_path / "f.npz")])
    assert by_text["prompts"] == by_ids["prompts"] == 2
    assert by_text["tokens"] == by_ids["tokens"] == ids.size + more.size
    assert np.array_equal(ExpertProfile.load(str(tmp_path / "t.npz")).counts,
                          ExpertProfile.load(str(tmp_path / "i.npz")).counts)
    words = TEXT.split()
    for d in (by_text, by_ids):  # ids in: text shown all the same
        first = d["inputs"][0]
        assert (first["tokens"], first["head"]) == (ids.size, [int(i) for i in ids[:8]])
        assert first["head_text"] == " ".join(words[:8])
        assert d["inputs"][1]["head_text"] == MORE
    assert by_text["inputs"][0]["source"].startswith(f"{ids.size} tokens of text from "
                                                      "--prompt #1")
    assert by_file["inputs"] == [{"tokens": more.size, "head": [int(i) for i in more],
                                  "head_text": MORE, "source": by_file["inputs"][0]["source"]}]
    assert str(text_file) in by_file["inputs"][0]["source"]
    rc, out, err = run([*base, "--prompt", TEXT, "--out", str(tmp_path / "r.npz"), "-q"])
    assert rc == 0, err
    line = next(l for l in out.splitlines() if l.startswith("prompt 1: "))
    assert line.endswith(f"first tokens: {ids[0]} 'the', {ids[1]} 'dog', " + ", ".join(
        f"{i} {w!r}" for i, w in zip(ids[2:8], words[2:8])) + ", ...")


def test_profile_refuses_text_it_cannot_encode(ckpt_dir, bare_dir, tmp_path):
    out = ["--out", str(tmp_path / "p.npz")]
    _one_line_refusal(["--preset", "qwen3-30b-a3b", "--scale", "tiny", "--prompt", TEXT, *out],
                      ["--preset model", "has none", "pass token ids"], "profile")
    _one_line_refusal(["--checkpoint", str(bare_dir), "--prompt", TEXT, *out],
                      ["has no tokenizer.json", "pass token ids"], "profile")
    _one_line_refusal(["--checkpoint", str(ckpt_dir), "--prompt", TEXT, "--prompt", "", *out],
                      ["--prompt #2", "encodes to no tokens"], "profile")
    _one_line_refusal(["--checkpoint", str(ckpt_dir), "--prompt-format", "text", *out],
                      ["applies to --prompt-file"], "profile")
    _one_line_refusal(["--checkpoint", str(ckpt_dir), "--prompt", TEXT, "--tokens", "8", *out],
                      ["not allowed with"], "profile")
    assert not (tmp_path / "p.npz").exists()
