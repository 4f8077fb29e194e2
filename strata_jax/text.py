"""Text in and out: a checkpoint's own `tokenizer.json` read by Hugging Face `tokenizers`.

`Tokenizer.from_checkpoint(dir)` (or `from_file(path)`) encodes text to the model's token ids
and decodes ids back, refusing ids outside the model's vocabulary; `prompt_ids` is what
`Engine.prefill` / `Engine.score` do with a prompt (a str is encoded, ids pass through; a
follow-up turn's text without the special tokens, which the first turn already has).
"""

from __future__ import annotations

import json
import os

import numpy as np
import tokenizers

__all__ = ["TOKENIZER_FILE", "Tokenizer", "TokenizerError", "model_tokenizer", "prompt_ids",
           "tokenizer_path"]

TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer that cannot be read, or text or ids it cannot take for this model."""


def tokenizer_path(directory: str) -> str | None:
    """`directory`'s tokenizer.json, None where it has none."""
    path = os.path.join(directory, TOKENIZER_FILE)
    return path if os.path.isfile(path) else None


class Tokenizer:
    """A Hugging Face `tokenizers.Tokenizer` bound to a model's vocabulary.

    Args:
        tokenizer: the `tokenizers.Tokenizer`.
        vocab_size: the model's vocabulary (ids it has embeddings for); None: the tokenizer's
            own size.
        path: where it was read from (named in errors).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int | None = None,
                 path: str | None = None):
        self.tokenizer = tokenizer
        self.path = path
        self.vocab_size = int(vocab_size if vocab_size is not None
                              else tokenizer.get_vocab_size(with_added_tokens=True))

    @classmethod
    def from_file(cls, path: str, vocab_size: int | None = None) -> Tokenizer:
        """Reads a tokenizer.json; TokenizerError (naming the file) where it cannot."""
        if not os.path.isfile(path):
            raise TokenizerError(f"{path} does not exist")
        try:
            return cls(tokenizers.Tokenizer.from_file(path), vocab_size, path)
        except Exception as e:  # noqa: BLE001 (tokenizers raises bare Exceptions)
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise TokenizerError(f"{path} is not a readable tokenizer.json ({first})") from None

    @classmethod
    def from_checkpoint(cls, directory: str, vocab_size: int | None = None) -> Tokenizer:
        """The tokenizer.json of a Hugging Face checkpoint directory, bound to config.json's
        vocab_size (or `vocab_size`); TokenizerError where the directory has none."""
        path = tokenizer_path(directory)
        if path is None:
            raise TokenizerError(f"checkpoint {directory!r} has no {TOKENIZER_FILE}; pass "
                                 "token ids instead of text")
        if vocab_size is None:
            try:
                with open(os.path.join(directory, "config.json")) as f:
                    vocab_size = json.load(f).get("vocab_size")
            except (OSError, ValueError, AttributeError):
                vocab_size = None
        return cls.from_file(path, vocab_size if isinstance(vocab_size, int) else None)

    def with_vocab(self, vocab_size: int) -> Tokenizer:
        """This tokenizer bound to a model of `vocab_size` ids."""
        return self if vocab_size == self.vocab_size else Tokenizer(self.tokenizer, vocab_size,
                                                                    self.path)

    def _name(self) -> str:
        return f"tokenizer {self.path}" if self.path else "the tokenizer"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
        """int32 token ids of `text` (with the tokenizer's special tokens, as transformers'
        `tokenizer(text)`); TokenizerError where an id is past the model's vocabulary."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids,
                         np.int64)
        bad = np.flatnonzero(ids >= self.vocab_size)
        if bad.size:
            raise TokenizerError(
                f"{self._name()} encodes the text to id {int(ids[bad[0]])} (token {bad[0]}), "
                f"outside the model's vocabulary [0, {self.vocab_size}): the tokenizer is not "
                "this model's")
        return ids.astype(np.int32)

    def _check_ids(self, ids) -> list[int]:
        ids = np.asarray(ids).reshape(-1)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"decode takes integer token ids, got {ids.dtype}")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            raise TokenizerError(f"token id {int(ids[bad[0]])} is outside the model's "
                                 f"vocabulary [0, {self.vocab_size})")
        return [int(i) for i in ids]

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        """The text of `ids` (ids the tokenizer has no token for decode to nothing)."""
        return self.tokenizer.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def pieces(self, ids) -> list[str]:
        """Each id's own text (decoded alone), for showing single tokens."""
        return [self.tokenizer.decode([i], skip_special_tokens=False)
                for i in self._check_ids(ids)]


def model_tokenizer(tokenizer: Tokenizer | None, vocab_size: int) -> Tokenizer | None:
    """`tokenizer` bound to a model of `vocab_size` ids (None stays None)."""
    if tokenizer is None:
        return None
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError("tokenizer must be a strata_jax.Tokenizer (Tokenizer.from_checkpoint(dir) "
                        f"or load_checkpoint(dir).tokenizer), got {type(tokenizer).__name__}")
    return tokenizer.with_vocab(vocab_size)


def prompt_ids(prompt, tokenizer: Tokenizer | None, *, continuation: bool = False):
    """A prompt as token ids: a str encoded by `tokenizer`, anything else as given. A
    `continuation` (a follow-up turn, after a session's positions) is encoded without the
    tokenizer's special tokens (a BOS belongs at the start of the sequence, not mid-way)."""
    if not isinstance(prompt, str):
        return prompt
    if tokenizer is None:
        raise TypeError("a text prompt needs a tokenizer: pass token ids, or make the Engine "
                        "with tokenizer=Tokenizer.from_checkpoint(dir) (or "
                        "load_checkpoint(dir).tokenizer)")
    return tokenizer.encode(prompt, add_special_tokens=not continuation)
