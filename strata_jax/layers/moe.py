"""The MoE block: router, permute, routed experts, unpermute and the shared expert, as small
functions under named scopes, and `MoE`, the layer that composes them.

Guards against two failures the streaming engine cannot tolerate: expert math that depends on the
weights of experts no token routes to (a streamed source leaves those rows zero), and an op
sequence that changes with the expert source (the streamed arm must match the resident arm bit for
bit). The only difference between arms is where `ExpertSource.expert_weights` gets its bytes.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from strata_jax.config import ModelConfig
from strata_jax.experts import ExpertSource, ExpertWeights, ResidentExperts
from strata_jax.formats import MATRICES, BiasedExpertWeights, QuantizedMatrix, expert_format
from strata_jax.kernels import Kernels
from strata_jax.kernels.grouped import grouped_matmul, piece_group_sizes
from strata_jax.kernels.quantized import in_stored_order
from strata_jax.layers.mlp import MLP
from strata_jax.layers.params import filled, normal


class Routing(NamedTuple):
    """Router output for one chunk.

    Attributes:
        expert_ids: int32 [T, k] chosen experts per token.
        weights: float32 [T, k] combination weights.
        counts: int32 [E] tokens routed to each expert.
    """

    expert_ids: jax.Array
    weights: jax.Array
    counts: jax.Array


def route(x: jax.Array, router: jax.Array, bias: jax.Array | None, config: ModelConfig,
          valid: jax.Array | None = None, logit_bias: jax.Array | None = None) -> Routing:
    """Chooses top-k experts per token and their weights.

    logit_bias: None, or [E] added to the logits (`ModelConfig.router_bias`, gpt-oss) before
    anything else; `bias` is the selection bias of sigmoid routers.

    Softmax routers take softmax(logits) in float32, keep the top k and optionally renormalise.
    Sigmoid routers (DeepSeek-V3) choose by sigmoid(logits) + selection bias (group-limited when
    n_groups > 1), weight by the unbiased sigmoid scores, renormalise and scale by routed_scaling.

    Padding: where `valid` (bool [T]) is False the token is padding. Its k choices become the
    sentinel expert id E (sorted after every real expert by `sort_order`) with weight 0, and the
    counts drop them, so padding never shows in the counts, the streamed fetch or the group sizes.
    """
    with jax.named_scope("routing"):
        c = config
        t = x.shape[0]
        logits = jnp.dot(x, router, preferred_element_type=jnp.float32)  # [T, E]
        if logit_bias is not None:
            logits = logits + logit_bias.astype(jnp.float32)[None, :]
        if c.router_scores == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
        choice = scores + bias.astype(jnp.float32)[None, :] if bias is not None else scores
        if c.n_groups > 1:
            grouped = choice.reshape(t, c.n_groups, c.n_experts // c.n_groups)  # [T, G, E/G]
            group_scores = lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
            _, keep = lax.top_k(group_scores, c.topk_groups)  # [T, topk_groups]
            group_mask = jnp.zeros((t, c.n_groups), bool).at[jnp.arange(t)[:, None], keep].set(True)
            # A dropped group's experts are never chosen (-inf, as DeepSeek's and transformers
            # 5's routers; a negative selection bias cannot bring one back).
            choice = jnp.where(group_mask[:, :, None], grouped, -jnp.inf).reshape(t, c.n_experts)
        _, expert_ids = lax.top_k(choice, c.top_k)  # [T, k]
        weights = jnp.take_along_axis(scores, expert_ids, axis=-1)  # [T, k]
        if c.norm_topk_prob:
            denom = weights.sum(-1, keepdims=True)
            if c.router_scores == "sigmoid":
                denom = denom + 1e-20
            weights = weights / denom
        weights = weights * c.routed_scaling
        expert_ids = expert_ids.astype(jnp.int32)
        if valid is not None:
            expert_ids = jnp.where(valid[:, None], expert_ids, jnp.int32(c.n_experts))
            weights = jnp.where(valid[:, None], weights, 0.0)
        # mode="drop": the padding sentinel E is out of range and is not counted.
        counts = jnp.zeros((c.n_experts,), jnp.int32).at[expert_ids.reshape(-1)].add(
            1, mode="drop")  # [E]
        return Routing(expert_ids, weights, counts)


def release_experts(expert_source, layer: int, outs):
    """After a layer's expert math: tells a source that has a `release` (the stream, whose
    fetched weights are a ring frame it reuses) that the layer's weights are done with, once
    every one of `outs` is computed; returns `outs`."""
    release = getattr(expert_source, "release", None)
    return outs if release is None else release(layer, outs)


def permute(x: jax.Array, expert_ids: jax.Array):
    """Sorts token copies by expert (the rows standalone: the model takes `sort_order` and
    gathers the rows inside `experts_swiglu`).

    Args:
        x: [T, H] tokens.
        expert_ids: int32 [T, k].

    Returns:
        (x_sorted [T*k, H], order int32 [T*k]) where x_sorted[j] = x[order[j] // k].
    """
    order = sort_order(expert_ids)
    with jax.named_scope("permute"):
        return x[order // expert_ids.shape[1]], order


def sort_order(expert_ids: jax.Array) -> jax.Array:
    """The token copies' order sorted by expert (stable): int32 [T*k] for expert_ids [T, k];
    copy j of the sorted order is token order[j] // k."""
    with jax.named_scope("permute"):
        return jnp.argsort(expert_ids.reshape(-1), stable=True).astype(jnp.int32)


class ExpertAct(NamedTuple):
    """The routed experts' activation (`ModelConfig.expert_act`): "silu", silu(g) * u; or
    "clamped_swiglu" (gpt-oss), g' = min(g, limit), u' = clip(u, -limit, limit),
    (u' + 1) * g' * sigmoid(alpha * g'). Static (part of the traced graph)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, config: ModelConfig) -> "ExpertAct":
        if config.expert_act == "silu":
            return cls()
        return cls(config.expert_act, float(config.swiglu_alpha), float(config.swiglu_limit))

    def __call__(self, g: jax.Array, u: jax.Array) -> jax.Array:
        """The activation of float32 gate and up products."""
        if self.kind == "silu":
            return jax.nn.silu(g) * u
        g = jnp.minimum(g, self.limit)
        u = jnp.clip(u, -self.limit, self.limit)
        return (u + 1.0) * (g * jax.nn.sigmoid(self.alpha * g))


def row_experts(counts: jax.Array, m: int) -> jax.Array:
    """The expert of each of `m` rows sorted by expert with group sizes `counts` [E]: int32
    [M], E for rows past the last group."""
    ends = jnp.cumsum(counts.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def _add_bias(y: jax.Array, bias: jax.Array, experts: jax.Array) -> jax.Array:
    """float32 y [M, N] plus each row's expert's bias (bias [E, N]); rows past the groups
    (expert E) get none: their outputs are dropped, and a streamed bias of an expert no row
    routes to is never read."""
    n_experts = bias.shape[0]
    rows = jnp.take(bias, jnp.minimum(experts, n_experts - 1), axis=0).astype(jnp.float32)
    return y + jnp.where((experts < n_experts)[:, None], rows, 0.0)


def experts_swiglu(x: jax.Array, rows: jax.Array, w: ExpertWeights, counts: jax.Array,
                   impl: str | None = None, quantized: str | None = None,
                   act: ExpertAct = ExpertAct(), tile_groups: int | None = None,
                   group_offset: int = 0) -> jax.Array:
    """SwiGLU of each token copy with its expert: grouped matmuls over rows sorted by expert.

    Args:
        x: [T, H] tokens.
        rows: int32 [M], the token of each sorted row (`sort_order`'s order // k, or a range
            of it): the matmuls' rows are x[rows].
        w: gate/up [E, H, I], down [E, I, H] (arrays, or `QuantizedMatrix`es of a quantized
            format); rows of experts with count 0 are never read.
        counts: int32 [E] group sizes.
        impl: the grouped matmul (`Kernels.grouped_matmul`); None: auto.
        quantized: how quantized matrices are read (`Kernels.quantized_matmul`); None: auto.
        act: the activation between the gate/up and down products (`ExpertAct`).
        tile_groups, group_offset: `w` and `counts` are experts group_offset.. of
            tile_groups (`grouped_matmul`: a part of a layer's experts, its rows with the bits
            of the whole layer's matmuls).

    Returns:
        [M, H] in x.dtype.

    With biases (`w` a BiasedExpertWeights), each product adds its row's expert's bias in float32
    (`row_experts`): gate and up before the activation, down before the cast to x.dtype.

    Gate's and up's inputs are gathered from x: x[rows] once, or for an act-order matrix
    (int4 with `perm`) its own rows with their columns in its stored order, in the same
    gather (`kernels.quantized.in_stored_order` with `rows`), so that no [M, H] copy is read
    again to reorder it.
    """
    mm = functools.partial(grouped_matmul, impl=impl, quantized=quantized,
                           tile_groups=tile_groups, group_offset=group_offset)

    def act_order(m):
        return isinstance(m, QuantizedMatrix) and m.perm is not None

    with jax.named_scope("experts"):
        x_sorted = None
        if not (act_order(w.gate) and act_order(w.up)):
            with jax.named_scope("permute"):
                x_sorted = x[rows]  # [M, H], shared by gate and up

        def inputs(m):
            return in_stored_order(x, m, counts, rows) if act_order(m) else (x_sorted, m)

        g = mm(*inputs(w.gate), counts)  # [M, I]
        u = mm(*inputs(w.up), counts)  # [M, I]
        g, u = g.astype(jnp.float32), u.astype(jnp.float32)
        if not isinstance(w, BiasedExpertWeights):
            return mm(act(g, u).astype(x.dtype), w.down, counts)  # [M, H]
        experts = row_experts(counts, rows.shape[0])
        g, u = _add_bias(g, w.gate_bias, experts), _add_bias(u, w.up_bias, experts)
        y = mm(act(g, u).astype(x.dtype), w.down, counts)  # [M, H]
        return _add_bias(y.astype(jnp.float32), w.down_bias, experts).astype(x.dtype)


def experts_swiglu_pieces(x: jax.Array, order: jax.Array, k: int, counts: jax.Array,
                          bounds: tuple[int, ...], weights_for_piece,
                          impl: str | None = None, quantized: str | None = None,
                          act: ExpertAct = ExpertAct()) -> jax.Array:
    """`experts_swiglu` over the sorted rows in pieces [bounds[p], bounds[p+1]), each with the
    weights `weights_for_piece(p, after)` gives (`after`: the piece before's output, None for
    piece 0), so a piece's math can start once its own experts are there. Each row keeps its
    expert (piece_group_sizes), so the rows come out as the whole layer's matmuls give them.

    Args:
        x: [T, H] tokens; order: int32 [T*k] from `sort_order`; counts: int32 [E].

    Returns:
        [T*k, H] in x.dtype, rows in sorted order.
    """
    ys = []
    after = None
    for p, (a, b) in enumerate(itertools.pairwise(bounds)):
        with jax.named_scope(f"experts_piece_{p}"):
            w = _in_dtype(weights_for_piece(p, after), x.dtype)
            # this piece's rows of the sorted copies: tokens order[a:b] // k
            after = experts_swiglu(x, order[a:b] // k, w, piece_group_sizes(counts, a, b),
                                   impl, quantized, act)
            ys.append(after)
    return jnp.concatenate(ys)


def _in_dtype(w: ExpertWeights, dtype) -> ExpertWeights:
    """The matrices of `w` in `dtype` (a QuantizedMatrix already reads as the model's dtype;
    biases stay as held: they are added in float32)."""
    matrices = {m: a if isinstance(a, QuantizedMatrix) else a.astype(dtype)
                for m, a in zip(MATRICES, w)}
    if isinstance(w, BiasedExpertWeights):
        return w._replace(**matrices)
    return ExpertWeights(**matrices)  # a source may return any (gate, up, down) tuple


def unpermute(y_sorted: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """Puts expert outputs back in token order and combines them with the routing weights.

    Args:
        y_sorted: [T*k, H] expert outputs in sorted order.
        order: int32 [T*k] from `sort_order`.
        weights: float32 [T, k].

    Returns:
        [T, H] in y_sorted.dtype, summed in float32.
    """
    with jax.named_scope("unpermute"):
        t, k = weights.shape
        n = order.shape[0]
        # Rows come back by a gather through the inverse permutation (a scatter of T*k int32s).
        # Scattering the [T*k, H] rows themselves would move H times the bytes (the layer's
        # slowest step after its grouped matmuls); the values are the same.
        inv = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32),
                                                      unique_indices=True)
        y = y_sorted[inv]  # [T*k, H], token-major: y[i] = y_sorted[j] where order[j] == i
        y = y.reshape(t, k, -1).astype(jnp.float32)  # [T, k, H]
        return jnp.einsum("tkh,tk->th", y, weights).astype(y_sorted.dtype)


class MoE(nnx.Module):
    """Routed SwiGLU experts with an optional shared expert.

    Steps for one chunk of T tokens:
      1. Router: logits = x @ router (+ its bias) [T, E] in float32 -> scores -> top-k experts
         and weights.
      2. Counts: tokens per expert, int32 [E], known before any expert runs.
      3. Source: weights = expert_source.expert_weights(layer, counts, resident) - the streaming
         seam; the returned rows of experts with count 0 are never read.
      4. Permute: copy each token k times and sort the copies by expert id (stable): order
         [T*k]; gate's and up's input rows are gathered from x by it (x[order // k], [T*k, H];
         an act-order matrix's with its columns in stored order, in the same gather).
      5. Experts: grouped matmuls gate and up [T*k, I] (plus their biases, where the experts
         have them), the activation (`ExpertAct`: silu(gate) * up, or gpt-oss's clamped
         SwiGLU), grouped matmul down [T*k, H] (plus its bias); zero-size groups compute
         nothing.
      6. Unpermute: gather back to token order [T, k, H], weighted sum over k in float32 -> [T, H].
      7. Shared expert (if any): dense SwiGLU of x, times sigmoid(x @ shared_gate) when gated,
         added to the routed output.
    The op sequence never depends on the source, so resident and streamed arms give the same bits.
    """

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs,
                 resident_experts: bool = True, kernels: Kernels = Kernels()):
        c, dt = config, config.dtype
        self.config = config
        self.kernels = kernels  # static: part of the graph jit keys on
        self.layer = layer
        self.router = nnx.Param(normal(rngs, (c.hidden_size, c.n_experts), dt))  # [H, E]
        self.selection_bias = (nnx.Param(filled(rngs, (c.n_experts,), jnp.float32, 0.0))
                               if c.selection_bias else None)  # [E]
        self.router_bias = (nnx.Param(normal(rngs, (c.n_experts,), dt))
                            if c.router_bias else None)  # [E]
        self.act = ExpertAct.of(c)  # static
        if not resident_experts:
            self.gate = self.up = self.down = None
        elif c.expert_format == "plain":
            e, h, i = c.n_experts, c.hidden_size, c.expert_intermediate
            self.gate = nnx.Param(normal(rngs, (e, h, i), dt))  # [E, H, I]
            self.up = nnx.Param(normal(rngs, (e, h, i), dt))  # [E, H, I]
            self.down = nnx.Param(normal(rngs, (e, i, h), dt))  # [E, I, H]
            if c.expert_bias:  # [E, I], [E, I], [E, H]
                self.gate_bias = nnx.Param(normal(rngs, (e, i), dt))
                self.up_bias = nnx.Param(normal(rngs, (e, i), dt))
                self.down_bias = nnx.Param(normal(rngs, (e, h), dt))
        else:
            # A quantized format's planes (gate, gate_scale, up, ...: [E, *plane shape] each
            # in its storage dtype), read by the expert math as one QuantizedMatrix per matrix.
            if rngs is not None:
                raise ValueError(
                    f"random initialisation of {c.expert_format} experts is not implemented: "
                    "build the model from weights (build_model, Engine) or quantize drawn "
                    "ones (strata_jax.weights.QuantizedParams)")
            for plane in expert_format(c).planes:
                setattr(self, plane.name, nnx.Param(
                    jax.ShapeDtypeStruct((c.n_experts, *plane.shape), plane.dtype)))
        self.shared = (MLP(c.hidden_size, c.shared_expert_intermediate, dt, rngs=rngs)
                       if c.shared_expert_intermediate else None)
        self.shared_gate = (nnx.Param(normal(rngs, (c.hidden_size, 1), dt))
                            if c.shared_expert_gate else None)  # [H, 1]
        # Static: None (one device), or a `strata_jax.parallel.ExpertParallel` that splits the
        # routed experts over a mesh (steps 4-6 on each device's own experts, then a psum).
        self.parallel = None

    def resident_weights(self) -> ExpertWeights | None:
        """The layer's own expert parameters, or None when built without them (a quantized
        format's as `QuantizedMatrix`es: `ExpertFormat.expert_matrices`)."""
        if self.gate is None:
            return None
        fmt = expert_format(self.config)  # plain: the params as they are, no op
        return fmt.expert_matrices({p.name: getattr(self, p.name)[...] for p in fmt.planes},
                                   self.config.dtype)

    def route_tokens(self, x: jax.Array, valid: jax.Array | None = None) -> Routing:
        """Steps 1-2: the router's choices for x [T, H] (padding, where `valid` is False, routes
        to the sentinel E and is not counted)."""
        bias = self.selection_bias[...] if self.selection_bias is not None else None
        logit_bias = self.router_bias[...] if self.router_bias is not None else None
        return route(x, self.router[...], bias, self.config, valid, logit_bias)

    def fetch_weights(self, counts: jax.Array,
                      expert_source: ExpertSource | None = None) -> ExpertWeights:
        """Step 3: the layer's expert weights from the source, for routing counts int32 [E]."""
        source = expert_source if expert_source is not None else ResidentExperts()
        return source.expert_weights(self.layer, counts, self.resident_weights())

    def apply_experts(self, x: jax.Array, routing: Routing, w: ExpertWeights | None,
                      valid: jax.Array | None = None, *, pieces=None) -> jax.Array:
        """Steps 4-7 for x [T, H] with its own `routing` and the fetched weights -> [T, H].

        `routing.counts` are the group sizes; they may sum to less than T*k (padding sorts last,
        as the sentinel E). Padded rows (where `valid` is False) come back as exact zeros, whatever
        a grouped-matmul implementation leaves in rows past its groups.

        pieces: None, or (bounds, weights_for_piece) to run step 5 in row pieces as the source
            supplies each piece's weights (`experts_swiglu_pieces`; `w` is then unused).
        """
        if self.parallel is not None:
            out = self.parallel.routed_experts(self, x, routing, w, pieces)
        elif pieces is None:
            order = sort_order(routing.expert_ids)
            y_sorted = experts_swiglu(x, order // routing.expert_ids.shape[1],
                                      _in_dtype(w, x.dtype), routing.counts,
                                      self.kernels.grouped_matmul,
                                      self.kernels.quantized_matmul, self.act)
        else:
            order = sort_order(routing.expert_ids)
            with jax.named_scope("experts"):
                y_sorted = experts_swiglu_pieces(x, order, routing.expert_ids.shape[1],
                                                 routing.counts, *pieces,
                                                 impl=self.kernels.grouped_matmul,
                                                 quantized=self.kernels.quantized_matmul,
                                                 act=self.act)
        if self.parallel is None:
            out = unpermute(y_sorted, order, routing.weights)
        return self._shared_and_padding(x, out, valid)

    def _shared_and_padding(self, x: jax.Array, out: jax.Array,
                            valid: jax.Array | None) -> jax.Array:
        """Step 7 and the padding mask: the routed output `out` [T, H] plus the shared
        expert, padded rows (where `valid` is False) exact zeros."""
        if self.shared is not None:
            with jax.named_scope("shared_expert"):
                shared = self.shared(x)
                if self.shared_gate is not None:
                    gate = jax.nn.sigmoid(
                        jnp.dot(x, self.shared_gate[...], preferred_element_type=jnp.float32))
                    shared = (gate * shared.astype(jnp.float32)).astype(x.dtype)
                out = out + shared
        if valid is not None:
            out = jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))
        return out

    def experts_part(self, x: jax.Array, routing: Routing, order: jax.Array,
                     w: ExpertWeights, lo: int, hi: int,
                     y_sorted: jax.Array | None) -> jax.Array:
        """Step 5 for the rows of experts lo..hi-1 only, with their weights `w` ([hi - lo,
        ...]; `expert_parts`): those rows lie together in the sorted order (from the
        experts' count before lo), so one grouped matmul of hi - lo groups takes them from
        there, tiled as the whole layer's (`tile_groups`), each row the bits the whole
        layer's matmul gives it. `order`: `sort_order` of the routing. Returns the sorted
        outputs so far [T*k, H]: `y_sorted` (None for the first part, lo = 0) with the
        part's outputs written from its first row on. Its rows past its groups (zeros) land
        on later parts' rows, which those parts write again in turn, or on the rows past
        every group (padding, zeros as the whole layer's); past T*k they are dropped."""
        m, k = order.shape[0], routing.expert_ids.shape[1]
        counts = routing.counts.astype(jnp.int32)
        begin = jnp.sum(jnp.where(jnp.arange(counts.shape[0]) < lo, counts, 0))
        with jax.named_scope(f"experts_part_{lo}"):
            # the part's rows first; the rest (past its groups) are never multiplied
            at = begin + jnp.arange(m, dtype=jnp.int32)
            rows = order[jnp.minimum(at, m - 1)] // k
            y = experts_swiglu(x, rows, _in_dtype(w, x.dtype), counts[lo:hi],
                               self.kernels.grouped_matmul, self.kernels.quantized_matmul,
                               self.act, tile_groups=self.config.n_experts, group_offset=lo)
            if y_sorted is None:
                if lo:
                    raise ValueError(f"experts_part: the first part starts at expert {lo}")
                return y  # begins at row 0
            return y_sorted.at[at].set(y, mode="drop", indices_are_sorted=True,
                                       unique_indices=True)

    def __call__(self, x: jax.Array, expert_source: ExpertSource | None = None,
                 valid: jax.Array | None = None):
        """x [T, H] -> ([T, H], counts int32 [E])."""
        routing = self.route_tokens(x, valid)
        parts = source_parts(expert_source, self.layer)
        if parts is not None:
            (out,) = experts_in_parts(self, expert_source, parts, [x], [routing], [valid],
                                      routing.counts)
            return out, routing.counts
        row_pieces = getattr(expert_source, "row_pieces", None)
        bounds = (row_pieces(self.layer, routing.expert_ids.size)
                  if row_pieces is not None else None)
        if bounds is None:
            w = self.fetch_weights(routing.counts, expert_source)
            out = self.apply_experts(x, routing, w, valid)
        else:
            def weights_for_piece(p, after):
                return expert_source.expert_weights_piece(self.layer, routing.counts, bounds, p,
                                                          after)

            out = self.apply_experts(x, routing, None, valid,
                                     pieces=(bounds, weights_for_piece))
        return release_experts(expert_source, self.layer, out), routing.counts


def source_parts(expert_source, layer: int) -> tuple[tuple[int, int], ...] | None:
    """The expert ranges of `layer`'s parts where its source gives the layer in parts
    (`stream.StreamedExperts.expert_parts`), else None."""
    parts = getattr(expert_source, "expert_parts", None)
    return None if parts is None else parts(layer)


# XLA options of a program whose layers run in parts (`experts_in_parts`). Every part gathers
# its rows of each row group from the same hidden states; XLA's GPU sibling multi-output fusion
# joins those gathers into one kernel per row group, which writes every part's rows (up to
# [R*k, H] each) at once, before the first part's weights arrive. The pass is off for such a
# program.
PARTS_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "multi_output_fusion"}


def experts_in_parts(moe: MoE, source, parts: tuple[tuple[int, int], ...],
                     xs: list[jax.Array], routings: list[Routing],
                     valids: list[jax.Array | None], counts: jax.Array) -> list[jax.Array]:
    """Steps 3-7 of `moe` for each of xs (one chunk, or a layer-major layer's row groups, each
    with its own routing and padding mask) with the layer's experts in `parts` (expert
    ranges [lo, hi)): part by part the source's weights (`expert_weights_part`, for the
    `counts` of all xs), every x's rows of the part's experts (`MoE.experts_part`), then the
    part's release, so a ring of a few parts' frames carries the layer. The rows, the combine
    and the shared expert are the whole layer's: the same bits as the layer whole. Returns
    each x's [T, H]."""
    if moe.parallel is not None:
        raise ValueError("a layer's experts in parts on a mesh are not implemented")
    orders = [sort_order(r.expert_ids) for r in routings]
    ys: list[jax.Array | None] = [None] * len(xs)
    for p, (lo, hi) in enumerate(parts):
        w = source.expert_weights_part(moe.layer, counts, p)
        ys = [moe.experts_part(x, r, o, w, lo, hi, y)
              for x, r, o, y in zip(xs, routings, orders, ys)]
        ys = source.release_part(moe.layer, p, ys)
    outs = [unpermute(y, o, r.weights) for y, o, r in zip(ys, orders, routings)]
    return [moe._shared_and_padding(x, out, v) for x, out, v in zip(xs, outs, valids)]
