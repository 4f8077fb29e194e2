"""The decoder stack shared by the grouped-query-attention MoE families (Qwen3-MoE, Mixtral,
OLMoE): embedding, pre-norm decoder layers (attention, then an MoE or dense MLP), final norm and
LM head, batch 1, prefill with a KV cache; read chunk-major (`MoETransformer.__call__`) or
layer-major (`MoETransformer.layer_major`).

Layers are a Python loop over an `nnx.List` with static layer indices (not `lax.scan`), so a
streaming source can issue a per-layer FFI call with the layer index as a static attribute.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from strata_jax.config import ModelConfig
from strata_jax.experts import ExpertSource, ExpertWeights
from strata_jax.formats import BIASES, MATRICES, expert_format, expert_weights_of
from strata_jax.kernels import Kernels
from strata_jax.layers.gqa import Attention
from strata_jax.layers.mlp import MLP
from strata_jax.layers.moe import MoE, experts_in_parts, release_experts, source_parts
from strata_jax.layers.norms import RMSNorm
from strata_jax.layers.params import normal
from strata_jax.models.hf_config import TensorNames

# Scoring (`MoETransformer.score_rows`): the float32 [rows, V] logits of one block of rows
# stay within this, rows a power of two from 16 to SCORE_MAX_ROWS.
SCORE_BLOCK_BYTES = 512 * 2**20
SCORE_MAX_ROWS = 2048


class KVCache(NamedTuple):
    """Per-layer key/value cache.

    Attributes:
        keys: one [S, KVH, D] array per layer (S = capacity), RoPE already applied.
        values: one [S, KVH, D] array per layer.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]

    @property
    def capacity(self) -> int:
        """Positions the cache can hold."""
        return self.keys[0].shape[0]

    def valid(self, position: int) -> "KVCache":
        """The cache's first `position` positions: what a session holds (past them lie the
        padded writes' slack)."""
        return KVCache(tuple(k[:position] for k in self.keys),
                       tuple(v[:position] for v in self.values))


def check_capacity(config: ModelConfig, capacity: int, slack: int = 0) -> None:
    """Refuses a cache capacity that is not positive or exceeds `config.max_seq_len` +
    `slack` (positions an engine's padded writes may use)."""
    if not 0 < capacity <= config.max_seq_len + slack:
        raise ValueError(
            f"cache capacity {capacity} must be within 1..max_seq_len={config.max_seq_len}")


def init_cache(config: ModelConfig, capacity: int, dtype=None, *, slack: int = 0) -> KVCache:
    """Returns a zero KV cache of `capacity` positions in the parameter dtype (or `dtype`).

    slack: positions allowed past `config.max_seq_len`, where an engine's padded writes land.

    Raises:
        ValueError: capacity is not positive or exceeds `config.max_seq_len` + `slack`.
    """
    check_capacity(config, capacity, slack)
    dtype = dtype or config.dtype
    shape = (capacity, config.n_kv_heads, config.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers))
    return KVCache(zeros, tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)))


def cache_shapes(config: ModelConfig, capacity: int) -> KVCache:
    """`KVCache` of `jax.ShapeDtypeStruct`s, for `jax.eval_shape` (allocates nothing)."""
    spec = jax.ShapeDtypeStruct((capacity, config.n_kv_heads, config.head_dim), config.dtype)
    return KVCache((spec,) * config.n_layers, (spec,) * config.n_layers)


def cache_bytes(config: ModelConfig, capacity: int) -> int:
    """Bytes of one KV cache (keys and values of every layer) of `capacity` positions."""
    c = config
    return 2 * c.n_layers * capacity * c.n_kv_heads * c.head_dim * np.dtype(c.dtype).itemsize


def score_block_rows(vocab_size: int, rows: int) -> int:
    """Rows per block of the scoring head: the most, a power of two from 16 up to
    SCORE_MAX_ROWS, whose float32 [rows, vocab_size] logits fit SCORE_BLOCK_BYTES; at most
    `rows` (the rows to score)."""
    block = 16
    while block * 2 <= SCORE_MAX_ROWS and block * 2 * vocab_size * 4 <= SCORE_BLOCK_BYTES:
        block *= 2
    return max(1, min(block, int(rows)))


def _layer_boundary(x, k, v):
    """Ends a layer, in both read orders: its output and its cache writes are done before the
    next layer starts. Left to itself XLA put every layer's cache write after the last layer,
    where a streamed chunk's tail waits for them. The
    same boundary in both orders keeps their fusions, so their bits, alike."""
    return jax.lax.optimization_barrier((x, k, v))


def _after(x, prev):
    """x, usable only once `prev` (the previous sub-chunk's output) is: a layer-major layer's
    sub-chunks then run one after another, each its own matmuls. Left to itself XLA may merge
    the sub-chunks' independent matmuls with the same weights (their projections, a dense
    MLP) into one over every sub-chunk's rows, a temporary of the whole prompt that the memory
    plan does not count. An identity on the values."""
    return x if prev is None else lax.optimization_barrier((x, prev))[0]


def feed_forward(config: ModelConfig, layer: int, rngs, resident_experts: bool,
                 kernels: Kernels) -> nnx.Module:
    """Layer `layer`'s block after its mixer: the MoE where the config has one, else the dense
    MLP."""
    if layer in config.moe_layers:
        return MoE(config, layer, rngs=rngs, resident_experts=resident_experts, kernels=kernels)
    return MLP(config.hidden_size, config.dense_intermediate, config.dtype, rngs=rngs)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)) with an MoE or dense MLP."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs,
                 resident_experts: bool = True, kernels: Kernels = Kernels()):
        c, dt = config, config.dtype
        self.layer = layer
        self.is_moe = layer in c.moe_layers
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dt, rngs)
        self.attn = self.attention(c, layer, rngs, kernels)
        self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dt, rngs)
        self.mlp = feed_forward(c, layer, rngs, resident_experts, kernels)

    @staticmethod
    def attention(config: ModelConfig, layer: int, rngs, kernels: Kernels) -> nnx.Module:
        """The layer's attention (a subclass gives its own kind)."""
        return Attention(config, rngs=rngs, kernels=kernels, layer=layer)

    def attention_block(self, x, cache_k, cache_v, start, positions, valid=None):
        """x + attn(norm(x)), writing the block's keys/values into the cache at `start`
        (`valid`: the real rows, for a mixer with state; attention needs no mask: padding sits
        after every real row)."""
        h, cache_k, cache_v = self.attn(self.input_norm(x), cache_k, cache_v, start, positions)
        return x + h, cache_k, cache_v

    def __call__(self, x, cache_k, cache_v, start, positions, expert_source, valid=None):
        with jax.named_scope(f"layer_{self.layer}"):
            x, cache_k, cache_v = self.attention_block(x, cache_k, cache_v, start, positions,
                                                       valid)
            counts = None
            if self.is_moe:
                h, counts = self.mlp(self.post_attn_norm(x), expert_source, valid)
            else:
                h = self.mlp(self.post_attn_norm(x))
            return x + h, cache_k, cache_v, counts


class MoETransformer(nnx.Module):
    """Decoder-only MoE transformer, batch size 1.

    Call it as `model(tokens, cache, start, expert_source=None)` inside your own jit, or use
    `forward` for validated inputs and a cached jit.

    A family whose layers differ (another mixer, other norms) subclasses it with its own
    `layer_class` and `norm`; the two read orders, the head and scoring are shared.
    """

    layer_class = DecoderLayer
    # Set inside a program that reads its dense weights from the host
    # (`engine.dense.DenseCalls`): each group is set in the model before it is read.
    dense_source = None

    @staticmethod
    def norm(config: ModelConfig, rngs):
        """The final norm."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype, rngs)

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None,
                 resident_experts: bool = True, kernels: Kernels = Kernels()):
        """Random-initialised model; `rngs=None` gives ShapeDtypeStruct leaves (see abstract_model).

        Real weights come from `build_model` (synthetic or checkpoint arrays) instead.
        kernels: the grouped matmul and attention its programs use (static).
        """
        c, dt = config, config.dtype
        self.config = config
        self.kernels = kernels
        self.embed = nnx.Param(normal(rngs, (c.vocab_size, c.hidden_size), dt, std=1.0))  # [V, H]
        self.layers = nnx.List([self.layer_class(c, i, rngs=rngs,
                                                 resident_experts=resident_experts,
                                                 kernels=kernels)
                                for i in range(c.n_layers)])
        self.final_norm = self.norm(c, rngs)
        self.lm_head = (None if c.tie_embeddings
                        else nnx.Param(normal(rngs, (c.hidden_size, c.vocab_size), dt)))  # [H, V]

    def __call__(self, tokens: jax.Array, cache: KVCache, start,
                 expert_source: ExpertSource | None = None, n_valid=None,
                 last_logits: bool = False, targets=None):
        """Runs one chunk.

        Args:
            tokens: int32 [T], ids within the vocabulary (not checked here: see `forward`).
            cache: KVCache with capacity >= start + T (padding included: a write past the end
                would be clamped by `lax.dynamic_update_slice` onto earlier positions).
            start: position of tokens[0]; a Python int 0 marks the first chunk (no cache read),
                anything else (int or int32 scalar) attends to cached positions 0..start-1.
            expert_source: supplies each MoE layer's expert weights; None = resident params.
            n_valid: None, or an int32 scalar: only tokens[:n_valid] are real and the rest is
                padding (see `route`). Padding is not counted, routes to no expert, and no real
                token attends to it (it sits after them); its keys/values are written at
                positions start+n_valid.. of the cache, which a later chunk overwrites.
            last_logits: return only the logits of the last real position, float32 [V].
            targets: None, or int32 [T] token ids: the first output is then (logits,
                (log-probabilities float32 [T] of each row's target, each row's most likely
                token int32 [T])), `score_rows`.

        Returns:
            (logits float32 [T, V] or [V], updated KVCache, counts int32 [n_moe_layers, E]).
        """
        t = tokens.shape[0]
        if self.dense_source is not None:
            self.dense_source.embed(self, tokens)
        x = jnp.take(self.embed[...], tokens, axis=0)  # [T, H]
        positions, start, valid = self._positions(t, start, n_valid)
        keys, values, counts = [], [], []
        for i, layer in enumerate(self.layers):
            if self.dense_source is not None:  # the layer's own weights from the host
                x = self.dense_source.enter(self, i, x)
            x, k, v, layer_counts = layer(x, cache.keys[i], cache.values[i], start, positions,
                                          expert_source, valid)
            if i + 1 < len(self.layers):
                x, k, v = _layer_boundary(x, k, v)
            keys.append(k)
            values.append(v)
            if layer_counts is not None:
                counts.append(layer_counts)
        return self._finish(x, n_valid, last_logits, targets), \
            cache._replace(keys=tuple(keys), values=tuple(values)), \
            self._stack_counts(counts)

    def layer_major(self, tokens: jax.Array, cache: KVCache, start,
                    expert_source: ExpertSource | None, sub_chunk: int, n_valid=None,
                    last_logits: bool = False, expert_rows: int | None = None, targets=None):
        """Runs a whole prompt layer by layer: every layer reads all of it before the next layer.

        The prompt is cut into sub-chunks of `sub_chunk` tokens. In each layer every sub-chunk in
        turn runs the attention block (writing its keys/values, so later sub-chunks attend to
        them) and the router; then the layer's expert weights are fetched once, for the counts
        summed over the sub-chunks; then each sub-chunk's experts run with its own routing. So
        an expert source sees one publish/fetch per layer per prompt, as if the prompt were one
        chunk, and each streamed expert crosses the link at most once per prompt.

        The router and the experts run on `expert_rows` rows at a time (consecutive sub-chunks
        joined): a grouped matmul over more rows keeps its tiles fuller, at the memory of that
        many rows' expert activations. Routing is row by row, so the choices and counts are the
        same for any grouping.

        The per-sub-chunk math is `__call__`'s (the same attention, router, grouped matmuls and
        combine); only the order differs, so with `sub_chunk` equal to the chunk size it matches
        chunk-major within the model's numerics (tests/test_engine.py states the measured gap).

        Args:
            tokens: int32 [P] with P a multiple of `sub_chunk` (pad with any valid id).
            cache, start, expert_source, n_valid, last_logits, targets: as in `__call__`.
            sub_chunk: tokens per compute sub-chunk (static).
            expert_rows: rows per router/expert call, a multiple of `sub_chunk` (static);
                None: `sub_chunk`.

        Returns:
            (logits float32 [P, V] or [V], updated KVCache, counts int32 [n_moe_layers, E]
            summed over the sub-chunks).
        """
        p = tokens.shape[0]
        if sub_chunk < 1 or p % sub_chunk:
            raise ValueError(f"layer_major: {p} tokens are not a whole number of sub-chunks of "
                             f"{sub_chunk}; pad the prompt to a multiple of sub_chunk")
        n_sub = p // sub_chunk
        rows = sub_chunk if expert_rows is None else expert_rows
        if rows < sub_chunk or rows % sub_chunk:
            raise ValueError(f"layer_major: expert_rows={expert_rows} is not a multiple of "
                             f"sub_chunk={sub_chunk}")
        per = rows // sub_chunk  # sub-chunks per router/expert call
        groups = [(a, min(a + per, n_sub)) for a in range(0, n_sub, per)]

        def join(parts):
            if parts[0] is None:
                return None
            return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)

        if self.dense_source is not None:
            self.dense_source.embed(self, tokens)
        x = jnp.take(self.embed[...], tokens, axis=0)  # [P, H]
        positions, start, valid = self._positions(p, start, n_valid)
        def cut(a, j):
            return None if a is None else a[j * sub_chunk:(j + 1) * sub_chunk]

        xs = [cut(x, j) for j in range(n_sub)]  # n_sub x [S, H]
        pos = [cut(positions, j) for j in range(n_sub)]
        val = [cut(valid, j) for j in range(n_sub)]
        # Sub-chunk j starts at start + j*S; the very first one of a fresh cache keeps the static
        # 0 (causal self-attention, as chunk-major's first chunk).
        starts = [start if j == 0 else start + j * sub_chunk for j in range(n_sub)]
        keys, values, counts = [], [], []
        for i, layer in enumerate(self.layers):
            if self.dense_source is not None:
                xs = self.dense_source.enter(self, i, xs)
            k, v = cache.keys[i], cache.values[i]
            with jax.named_scope(f"layer_{layer.layer}"):
                for j in range(n_sub):
                    xs[j], k, v = layer.attention_block(_after(xs[j], xs[j - 1] if j else None),
                                                        k, v, starts[j], pos[j], val[j])
                if layer.is_moe:
                    normed = [layer.post_attn_norm(join(xs[a:b])) for a, b in groups]
                    gval = [join(val[a:b]) for a, b in groups]
                    routings = [layer.mlp.route_tokens(h, v) for h, v in zip(normed, gval)]
                    total = routings[0].counts
                    for r in routings[1:]:
                        total = total + r.counts
                    parts = source_parts(expert_source, layer.layer)
                    if parts is not None:  # part by part, each over every row group
                        ys = experts_in_parts(layer.mlp, expert_source, parts, normed,
                                              routings, gval, total)
                    else:
                        w = layer.mlp.fetch_weights(total, expert_source)
                        ys = [layer.mlp.apply_experts(h, r, w, v)
                              for h, r, v in zip(normed, routings, gval)]
                        ys = release_experts(expert_source, layer.layer, ys)
                    ys = [y[(j - a) * sub_chunk:(j - a + 1) * sub_chunk]
                          for (a, b), y in zip(groups, ys) for j in range(a, b)]
                    xs = [xj + y for xj, y in zip(xs, ys)]
                    counts.append(total)
                else:
                    for j in range(n_sub):
                        xj = _after(xs[j], xs[j - 1] if j else None)
                        xs[j] = xj + layer.mlp(layer.post_attn_norm(xj))
            if i + 1 < len(self.layers):
                xs, k, v = _layer_boundary(xs, k, v)
            keys.append(k)
            values.append(v)
        x = xs[0] if n_sub == 1 else jnp.concatenate(xs, axis=0)
        return self._finish(x, n_valid, last_logits, targets), \
            cache._replace(keys=tuple(keys), values=tuple(values)), \
            self._stack_counts(counts)

    # -- shared pieces of both orders --

    @staticmethod
    def _positions(t: int, start, n_valid):
        positions = jnp.arange(t, dtype=jnp.int32) + jnp.asarray(start, jnp.int32)  # [T]
        if not isinstance(start, int):
            start = jnp.asarray(start, jnp.int32)
        valid = None
        if n_valid is not None:
            valid = jnp.arange(t, dtype=jnp.int32) < jnp.asarray(n_valid, jnp.int32)  # [T]
        return positions, start, valid

    def _finish(self, x, n_valid, last_logits: bool, targets=None):
        """Final norm and LM head: all positions [T, V], or the last real one [V]; with
        `targets`, (that, `score_rows(x, targets)`)."""
        if self.dense_source is not None:
            self.dense_source.head(self, x)
        scores = None if targets is None else self.score_rows(x, targets)
        if last_logits:
            last = x.shape[0] - 1 if n_valid is None else jnp.asarray(n_valid, jnp.int32) - 1
            x = lax.dynamic_slice_in_dim(x, last, 1, axis=0)  # [1, H]
        x = self.final_norm(x)
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]  # [H, V]
        logits = jnp.dot(x, head, preferred_element_type=jnp.float32)  # [T, V]
        logits = logits[0] if last_logits else logits
        return logits if scores is None else (logits, scores)

    def score_rows(self, x: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        """For final hidden states x [T, H] (before the final norm): (log p(targets[t]) under
        row t's logits, float32 [T]; row t's most likely token, int32 [T], the lowest id among
        equal largest logits), never a [T, V] array.

        The rows go through the final norm and the LM head in blocks of `score_block_rows`
        rows (a `lax.map`): the head's matmul takes the parameter dtype and accumulates in
        float32, as the last position's logits do, and each block's [rows, V] float32 logits
        give logit[target] - logsumexp(logits) and their argmax. x is padded with zero rows to
        whole blocks (finite through the norm; their values are dropped).
        """
        t, h = x.shape
        block = score_block_rows(self.config.vocab_size, t)
        n = -(-t // block)
        if n * block != t:
            x = jnp.pad(x, ((0, n * block - t), (0, 0)))
            targets = jnp.pad(targets, (0, n * block - t))
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]  # [H, V]

        def one(args):
            xb, tb = args  # [block, H], [block]
            logits = jnp.dot(self.final_norm(xb), head,
                             preferred_element_type=jnp.float32)  # [block, V]
            picked = jnp.take_along_axis(logits, tb[:, None], axis=1)[:, 0]
            top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return picked - jax.nn.logsumexp(logits, axis=-1), top

        blocks = (x.reshape(n, block, h), targets.astype(jnp.int32).reshape(n, block))
        with jax.named_scope("score"):
            lp, top = lax.map(one, blocks)
            return lp.reshape(-1)[:t], top.reshape(-1)[:t]

    def _stack_counts(self, counts):
        if counts:
            return jnp.stack(counts)
        return jnp.zeros((0, self.config.n_experts), jnp.int32)


# ---- construction from arrays ---------------------------------------------------------------------


def abstract_model(config: ModelConfig, *, resident_experts: bool = True,
                   kernels: Kernels = Kernels()) -> MoETransformer:
    """The model with `jax.ShapeDtypeStruct` leaves: allocates nothing."""
    return MoETransformer(config, rngs=None, resident_experts=resident_experts, kernels=kernels)


def _get(variable):
    return variable.get_value() if hasattr(variable, "get_value") else variable.value


def param_shapes(config: ModelConfig, *, resident_experts: bool = True
                 ) -> dict[str, jax.ShapeDtypeStruct]:
    """Flat parameter names ("layers.3.mlp.gate", ...) to shape/dtype, in model order."""
    return flat_shapes(abstract_model(config, resident_experts=resident_experts))


def flat_shapes(abstract: nnx.Module) -> dict[str, jax.ShapeDtypeStruct]:
    """An abstract model's flat parameter names to shape/dtype, in model order."""
    _, state = nnx.split(abstract)
    return {".".join(map(str, path)): _get(v) for path, v in nnx.to_flat_state(state)}


def expert_plane_names(config: ModelConfig, layer: int) -> dict[str, str]:
    """Plane name -> flat name of layer `layer`'s routed expert parameters, in blob order:
    gate, up, down in the plain format; each matrix and its `<matrix>_scale` in a quantized
    one (`strata_jax.formats.ExpertFormat.of(config)`)."""
    return {p.name: f"layers.{layer}.mlp.{p.name}" for p in expert_format(config).planes}


def expert_param_names(config: ModelConfig, layer: int) -> ExpertWeights:
    """Flat names of layer `layer`'s routed expert parameters (gate, up, down; with
    `expert_bias` a BiasedExpertWeights with their biases' too) in the plain format; a
    quantized format's are `expert_plane_names`."""
    if config.expert_format != "plain":
        raise ValueError(f"expert_param_names: {config.name}'s experts are "
                         f"{config.expert_format}; their names are expert_plane_names'")
    return expert_weights_of(**{n: f"layers.{layer}.mlp.{n}"
                                for n in MATRICES + (BIASES if config.expert_bias else ())})


def build_model(config: ModelConfig, params: Mapping[str, np.ndarray | jax.Array], *,
                experts: Mapping[int, ExpertWeights] | None = None,
                resident_experts: bool = True, kernels: Kernels = Kernels(),
                on_host: Callable[[tuple], np.ndarray | None] | None = None) -> MoETransformer:
    """Builds the model from flat arrays without initialising random weights first.

    Args:
        config: model config.
        params: flat name -> array (names as in `param_shapes`); cast to the parameter dtype.
        experts: optional layer -> ExpertWeights (plain format) or a mapping plane name ->
            [E, ...] array (any format, e.g. `weights.LazyExperts`) for routed experts not
            present in `params` (e.g. a host expert store); used only when `resident_experts`.
        resident_experts: put routed experts on the device; False leaves them out (a streaming
            source then supplies them).
        kernels: the grouped matmul and attention the model's programs use (`Kernels`).
        on_host: a parameter (its nnx path) for which this gives a host array (its shape
            and dtype: `engine.dense.HostDense.destination`) is written there, and its leaf is
            that array.

    Raises:
        KeyError: a parameter is missing (named).
        ValueError: a parameter has the wrong shape (name and both shapes).
    """
    return fill_model(abstract_model(config, resident_experts=resident_experts,
                                     kernels=kernels), config, params, experts, on_host)


def fill_model(abstract: nnx.Module, config: ModelConfig,
               params: Mapping[str, np.ndarray | jax.Array],
               experts: Mapping[int, ExpertWeights] | None = None,
               on_host: Callable[[tuple], np.ndarray | None] | None = None) -> nnx.Module:
    """`abstract` (a model with `jax.ShapeDtypeStruct` leaves) with its leaves taken from
    `params` (and routed experts from `experts`), as `build_model` describes."""
    graphdef, state = nnx.split(abstract)
    planes = {p.name for p in expert_format(config).planes}
    filled = []
    for path, variable in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        spec = _get(variable)
        value = params.get(name)
        # Only a routed expert's own leaf (layers.N.mlp.gate/up/down and a quantized format's
        # scales), never the shared expert's leaves of the same names (layers.N.mlp.shared.gate).
        if (value is None and experts is not None and len(path) == 4 and path[2] == "mlp"
                and path[-1] in planes):
            layer = int(path[1])
            if layer in experts:
                w = experts[layer]
                value = getattr(w, path[-1]) if isinstance(w, tuple) else w[path[-1]]
        if value is None:
            raise KeyError(f"missing parameter {name!r} (expected shape {tuple(spec.shape)})")
        if tuple(value.shape) != tuple(spec.shape):
            raise ValueError(
                f"parameter {name!r} has shape {tuple(value.shape)}, expected {tuple(spec.shape)}")
        dest = on_host(path) if on_host is not None else None
        if dest is not None:  # written (cast) into host memory, which the leaf then is
            dest[...] = np.asarray(value)
            value = dest
        else:
            value = jnp.asarray(value, dtype=spec.dtype)
        filled.append((path, variable.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


# ---- validated, jitted entry point ------------------------------------------------------------------


@nnx.jit(static_argnames=("expert_source", "first_chunk"))
def _forward_jit(model, tokens, cache, start, expert_source, first_chunk):
    return model(tokens, cache, 0 if first_chunk else start, expert_source)


def validate_inputs(config: ModelConfig, tokens, cache_capacity: int, start: int) -> np.ndarray:
    """Checks a chunk on the host before any device work.

    Returns:
        tokens as int32 numpy [T].

    Raises:
        ValueError: empty prompt, wrong rank, non-integer ids, ids outside [0, vocab), negative
            start, or start + T past the cache capacity or max_seq_len.
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D array [T], got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("empty prompt: tokens has length 0")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integer ids, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= config.vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} outside the vocabulary [0, {config.vocab_size})")
    start = int(start)
    if start < 0:
        raise ValueError(f"start position must be >= 0, got {start}")
    end = start + arr.size
    if end > config.max_seq_len:
        raise ValueError(
            f"prompt past max context: positions {start}..{end - 1} exceed "
            f"max_seq_len={config.max_seq_len}")
    if end > cache_capacity:
        raise ValueError(
            f"prompt past the KV cache: positions {start}..{end - 1} exceed capacity {cache_capacity}")
    return arr.astype(np.int32)


def forward(model: MoETransformer, tokens, cache: KVCache, start: int = 0,
            expert_source: ExpertSource | None = None):
    """Validated, jitted forward of one chunk.

    Args:
        model: the model.
        tokens: int [T] token ids (host or device array with concrete values).
        cache: KV cache.
        start: position of tokens[0].
        expert_source: hashable ExpertSource (a static jit argument) or None for resident experts.

    Returns:
        (logits float32 [T, V], updated KVCache, counts int32 [n_moe_layers, E]).
    """
    arr = validate_inputs(model.config, tokens, cache.capacity, start)
    return _forward_jit(model, jnp.asarray(arr), cache, jnp.int32(start), expert_source,
                        int(start) == 0)


# ---- checkpoint tensor names ----------------------------------------------------------------------


def attention_tensors(config: ModelConfig, layer: int, names: TensorNames
                      ) -> Iterator[tuple[str, str, tuple[int, ...], bool]]:
    """(our name, Hugging Face name, Hugging Face shape, transposed) of one layer's two norms
    and its grouped-query attention (projections, the biases `attention_biases` names, the
    sinks where the config has them, q/k norms), as the GQA families name them."""
    c, hf, ours = config, names.layer(layer), f"layers.{layer}."
    yield ours + "input_norm.weight", hf + "input_layernorm.weight", (c.hidden_size,), False
    yield ours + "post_attn_norm.weight", hf + "post_attention_layernorm.weight", (c.hidden_size,), False
    for proj, out_dim in (("q_proj", c.q_dim), ("k_proj", c.kv_dim), ("v_proj", c.kv_dim)):
        yield ours + f"attn.{proj}", hf + f"self_attn.{proj}.weight", (out_dim, c.hidden_size), True
    yield ours + "attn.o_proj", hf + "self_attn.o_proj.weight", (c.hidden_size, c.q_dim), True
    for proj, out_dim in (("q", c.q_dim), ("k", c.kv_dim), ("v", c.kv_dim), ("o", c.hidden_size)):
        if proj in c.attention_biases:
            yield ours + f"attn.{proj}_bias", hf + f"self_attn.{proj}_proj.bias", (out_dim,), False
    if c.attention_sinks:
        yield ours + "attn.sinks", hf + "self_attn.sinks", (c.n_heads,), False
    if c.qk_norm != "none":
        q_dim, k_dim = ((c.head_dim, c.head_dim) if c.qk_norm == "per_head" else (c.q_dim, c.kv_dim))
        yield ours + "attn.q_norm.weight", hf + "self_attn.q_norm.weight", (q_dim,), False
        yield ours + "attn.k_norm.weight", hf + "self_attn.k_norm.weight", (k_dim,), False


def layer_tensors(config: ModelConfig, layer: int, names: TensorNames
                  ) -> Iterator[tuple[str, str, tuple[int, ...], bool]]:
    """(our name, Hugging Face name, Hugging Face shape, transposed) of one layer's non-expert
    tensors, as the GQA MoE families name them (`names`: where their router is)."""
    c, hf = config, names.layer(layer)
    yield from attention_tensors(c, layer, names)
    yield (f"layers.{layer}.mlp.router", f"{hf}{names.moe_prefix}.{names.router}.weight",
           (c.n_experts, c.hidden_size), True)


def sigmoid_moe_tensors(c: ModelConfig, layer: int, names: TensorNames) -> Iterator[tuple]:
    """The loader's entries of a DeepSeek-style MLP block (DeepSeek-V3, GLM-4.5): the dense
    MLP of a first dense layer, or the MoE's router (never quantized: transformers' FP8
    converts only nn.Linear modules; read as stored and transposed), its selection bias
    `e_score_correction_bias` (held in float32) and the shared experts as one MLP."""
    hf, mine = names.layer(layer) + f"{names.moe_prefix}.", f"layers.{layer}.mlp."
    h = c.hidden_size
    projections = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
    if layer not in c.moe_layers:
        i = c.dense_intermediate
        for ours, proj in projections:
            shape = (h, i) if ours == "down" else (i, h)
            yield mine + ours, hf + f"{proj}.weight", shape, True
        return
    gate = hf + f"{names.router}."
    yield (mine + "router", (gate + "weight",), ((c.n_experts, h),), False,
           lambda a: a[0].T)
    yield mine + "selection_bias", gate + "e_score_correction_bias", (c.n_experts,), False
    si = c.shared_expert_intermediate
    if si:
        for ours, proj in projections:
            shape = (h, si) if ours == "down" else (si, h)
            yield mine + f"shared.{ours}", hf + f"shared_experts.{proj}.weight", shape, True
