"""Reading safetensors checkpoints: a directory's shards by tensor name, each tensor checked
(name, shape, dtype) before it is read, float8 tensors read byte by byte (safe_open's NumPy reader
has none), and every tensor the load did not read reported.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Mapping

import ml_dtypes  # also registers bfloat16 with NumPy so safe_open can return BF16 tensors
import numpy as np
from safetensors import SafetensorError, safe_open

from strata_jax.models.hf_config import CheckpointError


# safetensors dtype names -> NumPy dtypes, for the tensors read here byte by byte (safe_open's NumPy
# reader has no float8 type).
ST_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "BF16": np.dtype(ml_dtypes.bfloat16),
              "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
              "F64": np.dtype(np.float64), "I32": np.dtype(np.int32),
              "I64": np.dtype(np.int64), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
              "U8": np.dtype(np.uint8)}


def st_header(path: str) -> tuple[int, dict]:
    """(offset of the data, header) of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return 8 + n, json.loads(f.read(n))


def st_read(f, start: int, info: Mapping) -> np.ndarray:
    """One tensor of an open safetensors file (`info`: its header entry), read byte by byte."""
    if info["dtype"] not in ST_DTYPES:
        raise CheckpointError(f"safetensors dtype {info['dtype']} is not read by this loader")
    dtype = ST_DTYPES[info["dtype"]]
    lo, hi = info["data_offsets"]
    f.seek(start + lo)
    return np.fromfile(f, dtype=dtype, count=(hi - lo) // dtype.itemsize).reshape(info["shape"])


# Each plane of an expert format: (matrix, the Hugging Face tensor's suffix, transposed on load).
# fp8: `weight` [out, in] and `weight_scale_inv` [out / b, in / b], both transposed; GPTQ:
# `qweight` [in / 8, out] (its words' values rearranged into the format's group halves),
# `scales` [in / group, out], already [in, out], and with zero-points `qzeros` [in / group,


_REFETCH = "download it again (an interrupted or failed download leaves such a file)"
_MAX_HEADER = 100_000_000  # the largest header safetensors reads


def check_file(path: str) -> None:
    """CheckpointError naming `path` and what is wrong unless it is a whole safetensors file:
    the 8-byte length of its header, a JSON header of that length, then exactly the data its
    tensors' offsets cover. Reads the header only.

    Empty, cut inside its header, cut inside its data (or longer than its tensors), or not a
    safetensors file at all: each is refused with the way out (download the file again), where
    safe_open would raise SafetensorError ("incomplete metadata", "header too small")."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(9)
            n = struct.unpack("<Q", prefix[:8])[0] if size >= 8 else 0
            raw = f.read(n - 1) if size >= 8 and 0 < n <= size - 8 else b""
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    if size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes), not a safetensors file; {_REFETCH}")
    if size < 8:
        raise CheckpointError(f"{path} is truncated: {size} bytes, cut inside the 8-byte length "
                              f"that starts a safetensors file; {_REFETCH}")
    if n == 0 or n > size - 8:
        # A header's JSON that starts (or a file that ends right after its length), of a size
        # safetensors allows (100 MB): cut inside the header; else not safetensors at all.
        if n <= _MAX_HEADER and prefix[8:9] in (b"{", b""):
            raise CheckpointError(f"{path} is truncated: cut inside its header ({size - 8} of "
                                  f"its {n} header bytes present); {_REFETCH}")
        raise CheckpointError(f"{path} is not a safetensors file (its first 8 bytes give a "
                              f"header of {n} bytes in a file of {size}); {_REFETCH}")
    try:
        header = json.loads(prefix[8:9] + raw)
        if not isinstance(header, dict):
            raise TypeError(f"a JSON {type(header).__name__}, not an object")
        end = max((int(v["data_offsets"][1]) for k, v in header.items()
                   if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise CheckpointError(f"{path} is not a safetensors file (its header is not the JSON "
                              f"object of tensors safetensors writes: {e}); {_REFETCH}") from None
    expected = 8 + n + end
    if size < expected:
        raise CheckpointError(f"{path} is truncated: cut inside its data ({size} of the "
                              f"{expected} bytes its header describes); {_REFETCH}")
    if size > expected:
        raise CheckpointError(f"{path} is not a whole safetensors file: {size - expected} bytes "
                              f"past the {expected} its header describes; {_REFETCH}")


def shard_files(directory: str) -> list[str]:
    """The safetensors files of a checkpoint directory (the index's shards, else
    model.safetensors), each checked whole (`check_file`); CheckpointError where one is
    missing or broken, or the index cannot be read."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except OSError as e:
            raise CheckpointError(f"cannot read {index}: {e.strerror or e}") from None
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (a JSON object with a "
                                  f"'weight_map' of tensor names to files: {e!r}); download "
                                  "it again") from None
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(
            f"{directory}: neither model.safetensors.index.json nor model.safetensors exists")
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise CheckpointError(f"shard {path} listed in the index does not exist")
        check_file(path)
    return files


class Tensors:
    """Name -> tensor over the shards of a safetensors directory (mmap via safe_open)."""

    def __init__(self, directory: str):
        files = shard_files(directory)
        self._directory = directory
        self._handles = {}
        self._headers: dict[str, tuple[int, dict]] = {}  # path -> _st_header, read when needed
        self._where: dict[str, str] = {}
        self._taken: set[str] = set()
        for name in files:
            path = os.path.join(directory, name)
            try:
                handle = safe_open(path, framework="numpy")
            except SafetensorError as e:  # what check_file does not catch, still one line
                raise CheckpointError(f"{path}: safetensors cannot open it ({e}); "
                                      f"{_REFETCH}") from None
            self._handles[name] = handle
            for key in handle.keys():
                self._where[key] = name

    def _check(self, name: str, shape: tuple[int, ...], dtype: str | None) -> str:
        """The tensor's safetensors dtype, after checking it exists, its shape and (`dtype`
        given) its dtype; a float8 tensor where none is expected is refused."""
        if name not in self._where:
            what = f"{dtype} " if dtype else ""
            raise CheckpointError(f"missing tensor {name!r} (expected {what}shape {shape})")
        piece = self._handles[self._where[name]].get_slice(name)
        actual = tuple(piece.get_shape())
        if actual != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {actual}, expected {tuple(shape)}")
        stored = piece.get_dtype()
        if dtype is not None and stored != dtype:
            raise CheckpointError(f"tensor {name!r} is {stored}, expected {dtype}")
        if dtype is None and stored.startswith("F8"):
            raise CheckpointError(
                f"tensor {name!r} is {stored} (float8), but config.json's quantization_config "
                "leaves it unquantized (no quantization_config, or modules_to_not_convert names "
                "it)")
        return stored

    def get(self, name: str, shape: tuple[int, ...], dtype: str | None = None) -> np.ndarray:
        """Tensor `name`, checked (shape; its safetensors dtype where `dtype` is given) and
        counted as read."""
        stored = self._check(name, shape, dtype)
        self._taken.add(name)
        if stored in ST_DTYPES and stored.startswith("F8"):  # no NumPy float8 in safe_open
            path = os.path.join(self._directory, self._where[name])
            if path not in self._headers:
                self._headers[path] = st_header(path)
            start, header = self._headers[path]
            with open(path, "rb") as f:
                return st_read(f, start, header[name])
        return self._handles[self._where[name]].get_tensor(name)

    def path(self, name: str, shape: tuple[int, ...], dtype: str | None = None) -> str:
        """The file that holds tensor `name`, checked and counted as `get` does, without
        reading the tensor (`CheckpointExperts` reads it when it is used)."""
        self._check(name, shape, dtype)
        self._taken.add(name)
        return os.path.join(self._directory, self._where[name])

    def names(self) -> list[str]:
        """Every tensor name in the files."""
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def skip(self, prefix: str) -> int:
        """Marks every tensor under `prefix` as read (a part of the checkpoint the model does
        not use, by name); returns how many there are."""
        names = [n for n in self._where if n.startswith(prefix)]
        self._taken.update(names)
        return len(names)

    def check_all_taken(self) -> None:
        """Refuses tensors no step of the load read: weights the model would silently drop."""
        unused = sorted(set(self._where) - self._taken)
        if unused:
            shown = ", ".join(repr(n) for n in unused[:5])
            more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
            raise CheckpointError(
                f"{len(unused)} tensor(s) in the checkpoint are not used by the model config.json "
                f"describes: {shown}{more}; a config field that should bring them in is missing, "
                "or the checkpoint is not the architecture it names")
