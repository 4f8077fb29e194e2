"""`StreamedExperts`: the model's expert source inside a jitted chunk.

After each MoE layer's router it publishes the layer's per-expert counts and takes the layer's
expert weights from the stream (the ops of `strata_jax.stream.ops`), in pieces for the last
MoE layer of a long streamed chunk.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax

from strata_jax.config import ModelConfig
from strata_jax.experts import ExpertWeights
from strata_jax.formats import ExpertFormat
from strata_jax.kernels.grouped import row_pieces
from strata_jax.stream.config import _MODE_STREAM_PACKED, _STREAM_MODES
from strata_jax.stream.ops import begin, end, fetch, fetch_frame, publish, release


def frame_planes(fmt: ExpertFormat, views) -> dict[str, jax.Array]:
    """Plane name -> array of a ring frame's arrays `views` (in `fmt.planes` order): a plane
    DLPack cannot name (float8), viewed as unsigned ints of its width, bitcast back."""
    return {p.name: v if v.dtype == p.dtype else jax.lax.bitcast_convert_type(v, p.dtype)
            for p, v in zip(fmt.planes, views)}


class StreamedExperts:
    """The model's expert source inside one traced chunk.

    Made inside the jitted function: `begin` on construction (`ids`: the chunk's next `n_ids`
    staged token ids), then for each MoE layer `publish` (the router's counts), `fetch` (the
    layer's weights: in a frames chunk its ring frame, read in place where `frames` are
    given, else a copy of it; in a packed chunk fetch's own outputs, split from the copied
    blobs) and, after the layer's expert math, `release` (its frame may take a later layer);
    `finish` returns end_chunk's per-layer (copied, skipped).

    The stream moves the experts in the config's expert format (`fmt`, default
    `ExpertFormat.of(config)`): fetch gives the layer's planes, and the model gets them as
    `fmt.expert_matrices` of them (for fp8, int4, mxfp4 one QuantizedMatrix a matrix, which the
    grouped matmul reads; for a plain format the fetched arrays themselves, no op added).

    `tail_pieces` > 1 (a streamed chunk; StreamTuning.tail_pieces): the layer `tail_layer`
    (the last MoE layer) is fetched in that many pieces of its sorted rows, sized by
    `tail_shape` (`row_pieces`, `expert_weights_piece`), so that its expert math runs as its
    copies land and only the last piece's math follows the chunk's last copy.

    `parts` > 1 (`StreamPlan.parts`): each MoE layer's experts come in that many equal parts,
    part p of layer l the native engine's layer l * parts + p (its frame, its counts, its
    release): the layer asks for them with `expert_parts`, `expert_weights_part` and
    `release_part` (`layers.moe.experts_in_parts`), and every part's counts are published
    before the first part is fetched.

    `expert_axis` (several devices, `StreamerGroup`): the source runs under `shard_map` over
    that mesh axis, one device's engine per device (the group's id: each call reaches its
    device's engine); `config` is one device's (`StreamerGroup.local_config`, E/G experts),
    and each device publishes its own slice [d*E/G, (d+1)*E/G) of the model's counts.
    """

    def __init__(self, engine_id: int, mode: int, config: ModelConfig,
                 resident_blobs: dict[int, jax.Array], token: jax.Array, n_ids: int = 0,
                 frames: tuple[ExpertWeights | Mapping[str, jax.Array], ...] | None = None,
                 frame_of: dict[int, int] | None = None, *, tail_pieces: int = 1,
                 tail_shape: str = "equal", tail_layer: int | None = None,
                 fmt: ExpertFormat | None = None,
                 expert_axis: str | None = None, parts: int = 1):
        if frames is not None and frame_of is None:
            raise ValueError("frames need frame_of (NativeStreamer.frame_of)")
        if tail_pieces < 1:
            raise ValueError(f"tail_pieces={tail_pieces}: must be at least 1")
        if parts < 1 or config.n_experts % parts:
            raise ValueError(f"parts={parts} must be >= 1 and divide the {config.n_experts} "
                             "experts of a layer")
        if parts > 1 and (tail_pieces > 1 or expert_axis is not None):
            raise ValueError("a layer in parts runs neither tail pieces nor on a mesh")
        if tail_pieces > 1 and mode not in _STREAM_MODES:
            raise ValueError("tail_pieces > 1 needs a streamed chunk (a routed-only chunk "
                             "fetches each layer whole)")
        self.engine_id = engine_id
        self.config = config
        self.format = fmt or ExpertFormat.of(config)
        self.resident_blobs = resident_blobs
        # A packed chunk's layers come out of fetch; a frames chunk reads its frames.
        self.frames = None if mode == _MODE_STREAM_PACKED else frames
        self.frame_of = frame_of
        self.tail_pieces = tail_pieces
        self.tail_shape = tail_shape
        self.tail_layer = tail_layer
        self.expert_axis = expert_axis
        self.parts = parts
        self._so_far: dict[str, jax.Array] | None = None  # a layer's planes, piece by piece
        self.token, self.ids = begin(engine_id, mode, token, n_ids)

    def expert_weights(self, layer: int, counts: jax.Array,
                       resident: ExpertWeights | None) -> ExpertWeights:
        del resident  # the stream supplies every expert, resident ones from the cache
        if self.parts > 1:
            raise ValueError(f"layer {layer} streams in {self.parts} parts: take it with "
                             "expert_weights_part (layers.moe.experts_in_parts)")
        self._publish(layer, counts)
        with jax.named_scope(f"stream_fetch_{layer}"):
            return self._fetch(layer, 0, 1, (0, 0))

    def expert_parts(self, layer: int) -> tuple[tuple[int, int], ...] | None:
        """The expert ranges [lo, hi) of `layer`'s parts, or None where the layer comes
        whole."""
        if self.parts == 1:
            return None
        per = self.config.n_experts // self.parts
        return tuple((p * per, (p + 1) * per) for p in range(self.parts))

    def expert_weights_part(self, layer: int, counts: jax.Array, part: int) -> ExpertWeights:
        """The weights of part `part` of `layer` (experts `expert_parts(layer)[part]`,
        [E / parts, ...]): part 0 publishes every part's counts first. Parts come in order,
        each after the part before's `release_part` (the token orders the fetch after it)."""
        parts = self.expert_parts(layer)
        if parts is None or not 0 <= part < len(parts):
            raise ValueError(f"part {part} of layer {layer}: the layer has "
                             f"{self.parts} part(s)")
        if part == 0:
            for p, (lo, hi) in enumerate(parts):
                self._publish(self._native(layer, p), counts[lo:hi])
        with jax.named_scope(f"stream_fetch_{layer}_part_{part}"):
            return self._fetch(self._native(layer, part), 0, 1, (0, 0))

    def release_part(self, layer: int, part: int, outs):
        """`release` of part `part` of `layer`: its frame may take a later part."""
        return self.release(self._native(layer, part), outs)

    def _native(self, layer: int, part: int) -> int:
        """The native engine's layer of part `part` of `layer` (`StreamPlan.native_layer`)."""
        return layer * self.parts + part

    def _publish(self, layer: int, counts: jax.Array) -> None:
        """Publishes native layer `layer`'s counts (a MoE layer's, or one part's)."""
        with jax.named_scope(f"stream_publish_{layer}"):
            if self.expert_axis is not None:  # this device's experts' counts
                per = self.config.n_experts
                counts = jax.lax.dynamic_slice_in_dim(
                    counts, jax.lax.axis_index(self.expert_axis) * per, per)
            self.token = publish(self.engine_id, layer, self.token, counts)

    def row_pieces(self, layer: int, n_rows: int) -> tuple[int, ...] | None:
        """The static bounds of `layer`'s pieces over its `n_rows` sorted rows, or None where
        the layer is fetched whole."""
        if layer != self.tail_layer or self.tail_pieces <= 1:
            return None
        bounds = row_pieces(n_rows, self.tail_pieces, shape=self.tail_shape)
        return bounds if len(bounds) > 2 else None

    def expert_weights_piece(self, layer: int, counts: jax.Array, bounds: tuple[int, ...],
                             piece: int, after: jax.Array | None) -> ExpertWeights:
        """The layer's weights for piece `piece` of `bounds` (`row_pieces`): every expert with
        rows in the piece's range is there (and those of the pieces before). Pieces come in
        order; `after` (an output of the piece before's expert math) makes this piece's
        fetch, and its wait for the piece's copies, follow that math on XLA's stream."""
        if piece == 0:
            self._publish(layer, counts)
        elif after is None:
            raise ValueError(f"piece {piece} of layer {layer} needs `after`")
        with jax.named_scope(f"stream_fetch_{layer}_{piece}"):
            return self._fetch(layer, piece, len(bounds) - 1, (bounds[piece], bounds[piece + 1]),
                               after)

    def _fetch(self, layer: int, piece: int, pieces: int, rows: tuple[int, int],
               after: jax.Array | None = None) -> ExpertWeights:
        attrs = {"piece": piece, "pieces": pieces, "rows": rows}
        fmt = self.format
        if self.frames is None:
            planes, self.token = fetch(self.engine_id, layer, self.token,
                                       self.resident_blobs[layer],
                                       self.config.n_experts // self.parts, fmt,
                                       so_far=self._so_far if piece > 0 else None,
                                       after=after if piece > 0 else None, **attrs)
            self._so_far = planes if piece + 1 < pieces else None
            return self._weights(planes)
        if piece > 0:  # the frame is read in place: the order is all this needs
            _, self.token = jax.lax.optimization_barrier((after, self.token))
        tok = fetch_frame(self.engine_id, layer, self.token, self.resident_blobs[layer],
                          **attrs)
        frame = self.frames[self.frame_of[layer]]
        if isinstance(frame, ExpertWeights):
            frame = frame._asdict()
        # The frame is a program input: the barrier makes every read of it wait for fetch.
        views, self.token = jax.lax.optimization_barrier(
            (tuple(frame[p.name] for p in fmt.planes), tok))
        return self._weights(frame_planes(fmt, views))

    def _weights(self, planes: dict[str, jax.Array]) -> ExpertWeights:
        """The ExpertWeights the expert math reads (`fmt.expert_matrices`: a plain format's
        planes as they are, no op; a quantized format's as one QuantizedMatrix a matrix, as
        the resident layer gives them)."""
        return self.format.expert_matrices(planes, self.config.dtype)

    def release(self, layer: int, outs):
        """After the layer's expert math: `outs` (its outputs, any pytree of arrays) come back
        once all are computed and the layer's frame is released."""
        with jax.named_scope(f"stream_release_{layer}"):
            outs = jax.lax.optimization_barrier(outs)  # every output, before the release
            tok = release(self.engine_id, layer, self.token, jax.tree_util.tree_leaves(outs)[0])
            outs, self.token = jax.lax.optimization_barrier((outs, tok))
        return outs

    def finish(self) -> jax.Array:
        return end(self.engine_id, self.token, self.config.n_layers * self.parts)
