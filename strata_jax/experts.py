"""Expert weights, the expert-source seam and blob packing.

The seam is where streaming plugs in: an MoE layer asks its `ExpertSource` for the layer's expert
weights after routing and before the grouped matmul, and uses exactly what comes back. The resident
source returns the layer's own parameters; a streaming source returns an XLA buffer filled by FFI
copies. Because experts with no routed token are never read by the grouped matmul, a source may
leave their rows zero (or garbage) without changing any output bit.

Blob layout (one contiguous row per expert, so one copy moves one expert):
    blob[e] = concat(gate[e].ravel(), up[e].ravel(), down[e].ravel())
with gate/up as [H, I] and down as [I, H], row-major, in the parameter dtype: the plain
`strata_jax.formats.ExpertFormat`, which the packing and splitting here read.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax
import numpy as np

from strata_jax.formats import BiasedExpertWeights, ExpertFormat, ExpertWeights

__all__ = ["ExpertWeights", "BiasedExpertWeights", "ExpertSource", "ResidentExperts", "blob_size",
           "pack_expert_blobs", "unpack_expert_blobs", "pack_expert_blobs_np", "unpack_expert_blobs_np"]




@runtime_checkable
class ExpertSource(Protocol):
    """Supplies an MoE layer's expert weights for one forward chunk."""

    def expert_weights(self, layer: int, counts: jax.Array,
                       resident: ExpertWeights | None) -> ExpertWeights:
        """Returns the weights the layer must use.

        Args:
            layer: Model layer index (a static Python int).
            counts: int32 [E] tokens routed to each expert in this chunk, computed by the router
                before the experts run. Rows of experts with count 0 are never read.
            resident: The layer's own expert parameters, or None when the model was built without
                resident experts.

        Returns:
            ExpertWeights with shapes gate/up [E, H, I], down [E, I, H] in the parameter dtype.

        A source may also have `release(layer, outs) -> outs`, called with the layer's expert
        outputs once its expert math is traced: the weights it returned are then no longer read
        (the stream reuses the memory they are in). The model returns `outs` as given back.

        And, to run a layer's expert math in pieces as its weights arrive, both of
        `row_pieces(layer, n_rows) -> bounds | None` (static bounds (0, ..., n_rows) over the
        layer's rows sorted by expert id, or None for the whole layer) and
        `expert_weights_piece(layer, counts, bounds, piece, after) -> ExpertWeights` (the
        weights of every expert with rows in piece `piece`, called for the pieces in order,
        `after` an output of the piece before's math, None for piece 0). Each piece's rows
        give the same bits as the whole layer's matmul (grouped_matmul.piece_group_sizes).
        """
        ...


class ResidentExperts:
    """The default source: every expert is resident; returns the layer's own parameters."""

    def expert_weights(self, layer: int, counts: jax.Array,
                       resident: ExpertWeights | None) -> ExpertWeights:
        del counts
        if resident is None:
            raise ValueError(
                f"layer {layer} has no resident expert weights (model built without experts); "
                "pass an expert_source that supplies them")
        return resident

    def __hash__(self):
        return hash(ResidentExperts)

    def __eq__(self, other):
        return isinstance(other, ResidentExperts)


def blob_size(hidden: int, intermediate: int) -> int:
    """Elements of one expert blob: gate [H, I] + up [H, I] + down [I, H]."""
    return 3 * hidden * intermediate


def _plain(dtype, hidden: int, intermediate: int):
    """The plain blob layout as an `ExpertFormat`."""
    return ExpertFormat.plain(hidden, intermediate, dtype)


def _plain_of(w: ExpertWeights):
    """The plain format of weights `w` (with bias planes where `w` has biases)."""
    fmt = _plain(w.gate.dtype, w.gate.shape[1], w.gate.shape[2])
    return fmt.with_biases() if isinstance(w, BiasedExpertWeights) else fmt


def pack_expert_blobs(w: ExpertWeights | BiasedExpertWeights) -> jax.Array:
    """Packs [E, H, I] / [E, H, I] / [E, I, H] expert weights into blobs.

    Args:
        w: ExpertWeights of jax arrays, all of one dtype.

    Returns:
        [E, 3*H*I] array in the weights' dtype, row e = concat(gate[e], up[e], down[e]) raveled
        (the plain `strata_jax.formats.ExpertFormat`), then the biases where `w` has them.
    """
    return _plain_of(w).pack(w._asdict())  # [E, 3*H*I (+ 2*I + H with biases)]


def unpack_expert_blobs(blobs: jax.Array, hidden: int, intermediate: int) -> ExpertWeights:
    """Inverse of `pack_expert_blobs`: pure reshape and slice, jit-friendly.

    Args:
        blobs: [E, 3*H*I] packed experts.
        hidden: H.
        intermediate: I.

    Returns:
        ExpertWeights (gate [E, H, I], up [E, H, I], down [E, I, H]).
    """
    _check_blob_shape(blobs.shape, hidden, intermediate)
    return ExpertWeights(**_plain(blobs.dtype, hidden, intermediate).split(blobs))


def pack_expert_blobs_np(w: ExpertWeights) -> np.ndarray:
    """NumPy `pack_expert_blobs` for host stores; returns a new C-contiguous [E, 3*H*I] array."""
    w = type(w)(*(np.asarray(a) for a in w))
    return _plain_of(w).pack_np(w._asdict())


def unpack_expert_blobs_np(blobs: np.ndarray, hidden: int, intermediate: int) -> ExpertWeights:
    """NumPy `unpack_expert_blobs`; returns views into `blobs` (no copy)."""
    _check_blob_shape(blobs.shape, hidden, intermediate)
    return ExpertWeights(**_plain(blobs.dtype, hidden, intermediate).split_np(blobs))


def _check_blob_shape(shape, hidden: int, intermediate: int) -> None:
    if len(shape) != 2 or shape[1] != blob_size(hidden, intermediate):
        raise ValueError(
            f"expert blobs have shape {tuple(shape)}, expected [E, {blob_size(hidden, intermediate)}]"
            f" for hidden={hidden}, intermediate={intermediate}")
