"""Expert profiles: per-(layer, expert) routing counts recorded from prefills.

A profile says which experts a workload routes to most. `StreamConfig(profile=...)` uses it to
order each layer's stream list hottest first (so the copies issued before a layer's routing lands
are the likeliest to be needed) and, with `resident_budget_gib`, to keep the hottest experts of the
whole model resident on the device.

The failure this guards against: a profile recorded on one model silently steering another (a
wrong shape would order or pin the wrong experts), and a file whose meaning drifts. Loading checks
the format, the version and, given a config, the model's shape; errors say what was found and what
was expected.

File format (`.npz`, written by `ExpertProfile.save`, read with `numpy.load(path,
allow_pickle=False)`; nothing in it needs pickle):

    counts  int64 [n_layers, n_experts]: tokens routed to expert e of model layer l, summed over
            the recorded prefills (valid tokens only; each token counts once in each of its top_k
            experts). Rows of dense layers are all zero.
    meta    0-d unicode array holding one JSON object:
            {"format": "strata-expert-profile", "version": 1, "model": <config name>,
             "n_layers": L, "n_experts": E, "top_k": k, "tokens": <tokens recorded>}

docs/PROFILE.md describes the same format with an example.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from strata_jax.config import ModelConfig

__all__ = ["ExpertProfile", "FORMAT", "VERSION"]

FORMAT = "strata-expert-profile"
VERSION = 1


def _check_count_values(counts: np.ndarray, what: str) -> None:
    """Counts are integers and none is negative."""
    if counts.size and not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"{what} must be integers, got dtype {counts.dtype}")
    if counts.size and counts.min() < 0:
        raise ValueError(f"{what} must be >= 0; found a negative count")


class ExpertProfile:
    """Routing counts per (model layer, expert), with the model they were recorded on.

    Attributes:
        counts: int64 [n_layers, n_experts]; dense layers are all-zero rows.
        model: the config name the counts were recorded on.
        n_layers, n_experts, top_k: that model's shape.
        tokens: tokens recorded (each counted once per MoE layer in each of its top_k experts).

    `record` and `merge` add to this profile in place and return it.
    """

    def __init__(self, counts, *, model: str, top_k: int, tokens: int = 0):
        counts = np.asarray(counts)
        if counts.ndim != 2:
            raise ValueError(f"profile counts must be 2-D [n_layers, n_experts], got shape "
                             f"{counts.shape}")
        _check_count_values(counts, "profile counts")
        if int(top_k) < 1 or int(tokens) < 0:
            raise ValueError(f"profile top_k={top_k} must be >= 1 and tokens={tokens} >= 0")
        self.counts = counts.astype(np.int64, copy=True)
        self.model = str(model)
        self.top_k = int(top_k)
        self.tokens = int(tokens)

    # -- shape -----------------------------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return int(self.counts.shape[0])

    @property
    def n_experts(self) -> int:
        return int(self.counts.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_layers, self.n_experts)

    @classmethod
    def empty(cls, config: "ModelConfig") -> "ExpertProfile":
        """An all-zero profile for `config`."""
        return cls(np.zeros((config.n_layers, config.n_experts), np.int64), model=config.name,
                   top_k=config.top_k, tokens=0)

    def check(self, config: "ModelConfig") -> "ExpertProfile":
        """Raises ValueError unless this profile fits `config`'s shape; returns self.

        The shape (layers, experts) must match; top_k too. A different model name with the same
        shape is accepted (a checkpoint's name may differ from the preset it was profiled as).
        """
        want = (config.n_layers, config.n_experts)
        if self.shape != want or self.top_k != config.top_k:
            raise ValueError(
                f"expert profile has shape {self.shape} (top-{self.top_k}, model {self.model!r}); "
                f"this model {config.name!r} needs {want} (top-{config.top_k}): it was recorded "
                "on another model. Record a profile on this model (`strata-jax profile`) or "
                "leave it out.")
        dense = [l for l in range(config.n_layers) if l not in config.moe_layers]
        if dense and self.counts[dense].any():
            raise ValueError(
                f"expert profile has counts in layers {dense}, which are dense in {config.name!r}: "
                "it was recorded on another model")
        return self

    # -- recording -------------------------------------------------------------------------------

    def record(self, counts, tokens: int | None = None) -> "ExpertProfile":
        """Adds one prefill's routing counts.

        Args:
            counts: int [n_moe_layers, n_experts] as the model returns them (MoE layers in order),
                or int [n_layers, n_experts], or a PrefillResult (its `counts` and `read`).
            tokens: tokens behind the counts; default: the result's `read`, else the first MoE
                layer's count total / top_k (every token routes to top_k experts per layer).

        Returns:
            self.
        """
        if hasattr(counts, "counts") and hasattr(counts, "read"):  # a PrefillResult
            tokens = counts.read if tokens is None else tokens
            counts = counts.counts
        c = np.asarray(counts)
        if c.ndim != 2 or c.shape[1] != self.n_experts:
            raise ValueError(f"routing counts of shape {c.shape} do not fit a profile of "
                             f"{self.shape} (model {self.model!r})")
        _check_count_values(c, "routing counts")
        c = c.astype(np.int64)
        if c.shape[0] == self.n_layers:
            full = c
        else:
            # MoE layers are the last rows of a model (dense layers come first): fill from the end.
            n_moe = c.shape[0]
            if n_moe > self.n_layers:
                raise ValueError(f"{n_moe} layers of routing counts for a {self.n_layers}-layer "
                                 f"profile (model {self.model!r})")
            full = np.zeros(self.shape, np.int64)
            full[self.n_layers - n_moe:] = c
        if tokens is None:
            moe_rows = full[full.any(axis=1)]
            tokens = int(moe_rows[0].sum()) // self.top_k if len(moe_rows) else 0
        self.counts += full
        self.tokens += int(tokens)
        return self

    def merge(self, other: "ExpertProfile") -> "ExpertProfile":
        """Adds `other`'s counts and tokens to this profile (same model shape); returns self."""
        if not isinstance(other, ExpertProfile):
            raise TypeError(f"merge takes an ExpertProfile, got {type(other).__name__}")
        if other.shape != self.shape or other.top_k != self.top_k:
            raise ValueError(
                f"cannot merge a profile of shape {other.shape} (top-{other.top_k}, model "
                f"{other.model!r}) into one of {self.shape} (top-{self.top_k}, model "
                f"{self.model!r}): they were recorded on different models")
        self.counts += other.counts
        self.tokens += other.tokens
        return self

    # -- use -------------------------------------------------------------------------------------

    def order(self, layer: int) -> list[int]:
        """Expert ids of model layer `layer`, hottest first; ties by the lower id."""
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} outside 0..{self.n_layers - 1}")
        return [int(e) for e in np.argsort(-self.counts[layer], kind="stable")]

    def resident_set(self, config: "ModelConfig", budget_gib: float,
                     blob_bytes: int) -> list[list[int]]:
        """The experts to keep resident under a device-memory budget.

        The hottest (layer, expert) pairs of the whole model (ties: lower layer, then lower id) fill
        `budget_gib` GiB in experts of `blob_bytes` bytes each.

        Returns:
            Per model layer, the sorted resident expert ids (empty for dense layers).
        """
        self.check(config)
        if budget_gib < 0:
            raise ValueError(f"resident budget {budget_gib} GiB must be >= 0")
        if blob_bytes < 1:
            raise ValueError(f"blob_bytes={blob_bytes} must be >= 1")
        n = int(budget_gib * 2**30) // int(blob_bytes)
        moe = list(config.moe_layers)
        flat = sorted((-int(self.counts[l, e]), l, e) for l in moe for e in range(self.n_experts))
        out: list[list[int]] = [[] for _ in range(self.n_layers)]
        for _, l, e in flat[:n]:
            out[l].append(int(e))
        for ids in out:
            ids.sort()
        return out

    # -- files -----------------------------------------------------------------------------------

    def meta(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "model": self.model,
                "n_layers": self.n_layers, "n_experts": self.n_experts, "top_k": self.top_k,
                "tokens": self.tokens}

    def save(self, path) -> str:
        """Writes the profile to `path` exactly (no suffix added), atomically; returns the path."""
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".npz", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, counts=self.counts, meta=np.array(json.dumps(self.meta())))
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return path

    @classmethod
    def load(cls, path, config: "ModelConfig | None" = None) -> "ExpertProfile":
        """Reads a profile written by `save`.

        Args:
            path: the file.
            config: when given, the profile must fit this model (see `check`).

        Raises:
            ValueError: not a profile file, an unknown format or version, inconsistent contents,
                or (with `config`) a profile recorded on another model.
        """
        path = os.fspath(path)
        written_by = "written by `strata-jax profile` or ExpertProfile.save"
        try:
            z = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise
        except (ValueError, OSError, EOFError, zipfile.BadZipFile):
            # np.load's own message (e.g. "contains pickled data ... allow_pickle") is about
            # numpy files in general, not about what this file should be.
            raise ValueError(f"{path}: not an expert profile {written_by} (not an .npz "
                             "archive)") from None
        if not hasattr(z, "files"):  # a single .npy array
            raise ValueError(f"{path}: not an expert profile {written_by} (a .npy array, not "
                             "an .npz archive)")
        try:
            with z:
                names = set(z.files)
                if not {"counts", "meta"} <= names:
                    raise ValueError(f"{path}: not an expert profile (arrays {sorted(names)}; "
                                     "expected 'counts' and 'meta')")
                counts = z["counts"]
                meta_arr = z["meta"]
        except ValueError as e:
            if "expert profile" in str(e):
                raise
            raise ValueError(f"{path}: not an expert profile {written_by} ('counts' or 'meta' "
                             "is not a plain array)") from None
        except (OSError, EOFError, zipfile.BadZipFile):
            raise ValueError(f"{path}: not an expert profile {written_by} (a damaged .npz "
                             "archive)") from None
        if meta_arr.shape != () or meta_arr.dtype.kind != "U":
            raise ValueError(f"{path}: 'meta' must be a 0-d string holding JSON")
        try:
            meta = json.loads(str(meta_arr))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: 'meta' is not JSON ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else meta
            raise ValueError(f"{path}: format {found!r} is not {FORMAT!r}; not an expert profile")
        if meta.get("version") != VERSION:
            raise ValueError(f"{path}: expert profile version {meta.get('version')!r} is not "
                             f"supported (this strata_jax reads version {VERSION}); re-record it")
        keys = ("model", "n_layers", "n_experts", "top_k", "tokens")
        missing = [k for k in keys if k not in meta]
        if missing:
            raise ValueError(f"{path}: profile meta lacks {missing}")
        if counts.shape != (meta["n_layers"], meta["n_experts"]):
            raise ValueError(f"{path}: counts have shape {counts.shape} but meta says "
                             f"({meta['n_layers']}, {meta['n_experts']})")
        if counts.dtype != np.int64:
            raise ValueError(f"{path}: counts have dtype {counts.dtype}; expected int64")
        profile = cls(counts, model=meta["model"], top_k=meta["top_k"], tokens=meta["tokens"])
        if config is not None:
            profile.check(config)
        return profile

    def __repr__(self) -> str:
        return (f"ExpertProfile(model={self.model!r}, shape={self.shape}, top_k={self.top_k}, "
                f"tokens={self.tokens})")

    def __eq__(self, other) -> bool:
        return (isinstance(other, ExpertProfile) and self.meta() == other.meta()
                and np.array_equal(self.counts, other.counts))

    __hash__ = None  # mutable
