"""The stream's JAX ops: the XLA FFI custom calls a jitted chunk makes.

begin (begin_chunk), publish, fetch / fetch_piece, fetch_frame, release and end (end_chunk)
are one JAX primitive, threaded by a token so XLA keeps their order; the native library
registers the same targets for "cpu" (simulated link) and "CUDA". dense_fetch and dense_wait
(a layer's own weights from pinned host memory, `engine/dense.py`) are the same primitive,
ordered by their operands.
"""

from __future__ import annotations

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from strata_jax import native
from strata_jax.formats import ExpertFormat


# The four calls are one primitive whose custom call carries has_side_effect in the HLO, so XLA
# never removes, merges, duplicates or reorders them (they are also token-chained), but whose
# jaxpr carries no JAX effect. `jax.ffi.ffi_call(has_side_effect=True)` would add an unordered
# effect, and a jitted function with one never takes JAX's C++ dispatch path: every prefill
# call would pay the Python dispatch path (milliseconds, measured) before the device starts.
_stream_call_p = jex_core.Primitive("strata_stream_call")
_stream_call_p.multiple_results = True


try:
    _ShapedArray = jax.core.ShapedArray
except AttributeError:  # moved out of jax.core in some releases
    from jax._src.core import ShapedArray as _ShapedArray


def _stream_call_abstract(*operands, target, results, aliases=(), **attrs):
    del operands, target, aliases, attrs
    return [_ShapedArray(shape, dtype) for shape, dtype in results]


def _stream_call_eager(*operands, target, **params):
    raise RuntimeError(f"{target} runs only inside a jitted prefill (Engine.prefill), not eagerly")


def _stream_call_lowering(ctx, *operands, target, results, aliases=(), **attrs):
    """`aliases`: (operand, result) pairs that share a buffer (fetch_piece's outputs)."""
    del results
    extra = {"operand_output_aliases": dict(aliases)} if aliases else {}
    # A tuple attribute (dense_fetch's addresses) is an int64 array attribute.
    attrs = {k: np.asarray(v, np.int64) if isinstance(v, tuple) else v for k, v in attrs.items()}
    return jax.ffi.ffi_lowering(target, has_side_effect=True, **extra)(ctx, *operands, **attrs)


_stream_call_p.def_abstract_eval(_stream_call_abstract)
_stream_call_p.def_impl(_stream_call_eager)
mlir.register_lowering(_stream_call_p, _stream_call_lowering)


def _call(target: str, results, *operands, aliases=(), **attrs):
    results = tuple((tuple(shape), np.dtype(dtype)) for shape, dtype in results)
    return _stream_call_p.bind(*operands, target=native.TARGETS[target], results=results,
                               aliases=tuple(aliases), **attrs)


# Each call's attributes are one struct of the native handlers (ffi/src/handlers.hpp), decoded
# by name: a call carries exactly its struct's attributes, with these names and integer widths.
def _begin_attrs(engine_id: int, mode: int) -> dict:
    """BeginAttrs (begin_chunk)."""
    return {"engine": np.int64(engine_id), "mode": np.int32(mode)}


def _layer_attrs(engine_id: int, layer: int) -> dict:
    """LayerAttrs (publish, release)."""
    return {"engine": np.int64(engine_id), "layer": np.int32(layer)}


def _fetch_attrs(engine_id: int, layer: int, piece: int, pieces: int,
                 rows: tuple[int, int]) -> dict:
    """FetchAttrs (fetch, fetch_piece, fetch_frame): the layer and the piece of it."""
    return {**_layer_attrs(engine_id, layer), "piece": np.int32(piece),
            "pieces": np.int32(pieces), "row_begin": np.int64(rows[0]),
            "row_end": np.int64(rows[1])}


def _end_attrs(engine_id: int) -> dict:
    """EndAttrs (end_chunk)."""
    return {"engine": np.int64(engine_id)}


def begin(engine_id: int, mode: int, token: jax.Array,
          n_ids: int = 0) -> tuple[jax.Array, jax.Array]:
    """begin_chunk: (token, ids), ids being int32 [n_ids], the next `n_ids` of the ids staged
    with the engine (`NativeStreamer.stage_ids`), written on the device as kernel arguments."""
    tok, ids = _call("begin", [((), jnp.int32), ((n_ids,), jnp.int32)], token,
                     **_begin_attrs(engine_id, mode))
    return tok, ids


def publish(engine_id: int, layer: int, token: jax.Array, counts: jax.Array) -> jax.Array:
    (tok,) = _call("publish", [((), jnp.int32)], token, counts.astype(jnp.int32),
                   **_layer_attrs(engine_id, layer))
    return tok


def fetch(engine_id: int, layer: int, token: jax.Array, resident: jax.Array, n_experts: int,
          fmt: ExpertFormat, *, piece: int = 0, pieces: int = 1,
          rows: tuple[int, int] = (0, 0), so_far: dict[str, jax.Array] | None = None,
          after: jax.Array | None = None) -> tuple[dict[str, jax.Array], jax.Array]:
    """The layer's expert planes, {plane name: [E, *plane.shape] in the plane's dtype} for
    every plane of `fmt` (the engine's plane table): fetch splits each blob into its planes as
    it copies it, so the model reads them with no further copy. `resident`: the layer's
    resident blobs, uint8 [R, blob_bytes] (`NativeStreamer.resident_blobs`).

    In pieces (`piece` of `pieces`, `rows` the piece's sorted rows [begin, end)): each call
    readies the experts with rows in its range (and those before); piece 0 makes the outputs,
    each later piece adds its experts to the outputs of the piece before (`so_far`, whose
    buffers it writes in place: fetch_piece aliases every plane) after that piece's math
    (`after`, one of its outputs)."""
    shapes = [((n_experts, *p.shape), p.dtype) for p in fmt.planes] + [((), jnp.int32)]
    attrs = _fetch_attrs(engine_id, layer, piece, pieces, rows)
    if so_far is None:
        *planes, tok = _call("fetch", shapes, token, resident, **attrs)
    else:
        if after is None:
            raise ValueError("fetch: a later piece needs `after` (the piece before's output)")
        missing = [p.name for p in fmt.planes if p.name not in so_far]
        if missing:
            raise ValueError(f"fetch: the planes so far lack {missing} of the {fmt.name} format")
        *planes, tok = _call("fetch_piece", shapes, token, resident,
                             *(so_far[p.name] for p in fmt.planes), after,
                             aliases=tuple((2 + i, i) for i in range(len(fmt.planes))),
                             **attrs)
    return {p.name: a for p, a in zip(fmt.planes, planes)}, tok


def fetch_frame(engine_id: int, layer: int, token: jax.Array, resident: jax.Array, *,
                piece: int = 0, pieces: int = 1, rows: tuple[int, int] = (0, 0)) -> jax.Array:
    """fetch_frame: readies the layer's ring frame (residents copied in, skipped rows zeroed,
    its copies waited for on XLA's stream); the model then reads the frame in place. In pieces
    (`fetch`), only the copies of the experts with rows in the piece's range are waited for."""
    (tok,) = _call("fetch_frame", [((), jnp.int32)], token, resident,
                   **_fetch_attrs(engine_id, layer, piece, pieces, rows))
    return tok


def release(engine_id: int, layer: int, token: jax.Array, after: jax.Array) -> jax.Array:
    """release: the layer's expert math (`after`, one of its outputs) is done with its frame,
    which the walk may then fill with a later layer."""
    (tok,) = _call("release", [((), jnp.int32)], token, after,
                   **_layer_attrs(engine_id, layer))
    return tok


def end(engine_id: int, token: jax.Array, n_layers: int) -> jax.Array:
    (stats,) = _call("end", [((n_layers, 2), jnp.int32)], token, **_end_attrs(engine_id))
    return stats


def dense_fetch(key: int, after: jax.Array, shapes, addresses: tuple[int, ...]) -> list[jax.Array]:
    """Arrays of `shapes` ((shape, dtype) pairs) copied from the host addresses (pinned memory
    that outlives the program), after `after`; on CUDA the copies run on a stream of their own
    until `dense_wait(key, ...)`, which every reader must follow."""
    if len(shapes) != len(addresses) or not shapes:
        raise ValueError(f"dense_fetch: {len(shapes)} arrays, {len(addresses)} addresses: one "
                         "address per array, at least one")
    return list(_call("dense_fetch", shapes, after, key=np.int64(key),
                      src=tuple(int(a) for a in addresses)))


def dense_wait(key: int, arrays: list[jax.Array], after: jax.Array) -> list[jax.Array]:
    """`arrays` (dense_fetch's of `key`) once their copies landed, after `after`."""
    shapes = [(a.shape, a.dtype) for a in arrays]
    return list(_call("dense_wait", shapes, *arrays, after, key=np.int64(key),
                      aliases=tuple((i, i) for i in range(len(arrays)))))
