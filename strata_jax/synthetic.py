"""Synthetic weights with a routing-skew knob.

Guards against benchmarks that only ever see uniform routing: a real model leaves many experts of a
chunk unrouted (the reference engine saw ~40% of a 512-expert top-10 layer unrouted at ~1,000
tokens), and that is exactly what the routed stream saves. The skew knob reproduces it.

Skew mechanism: router column e (the logit weights of expert e) is drawn N(0, 1/H) and multiplied
by exp(s * z_e), with z_e ~ N(0, 1) standardised over the layer's experts (a lognormal law of
strength s). Router inputs are RMS-normalised, so logit e has spread proportional to its column
norm; experts with small norms almost never reach the top k, large ones often do. s = 0 gives
uniform routing: every expert is chosen with the same probability. The weights of chosen experts
(softmax or sigmoid of the logits) stay well defined for any s.

Calibration (`unrouted_fraction`, isotropic Gaussian router inputs, 1,000 tokens, 512 experts
top-10, seed-averaged): s = 0 leaves ~0% unrouted; s = SKEW_40_PERCENT_512_TOP10 leaves ~40%.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Mapping

import ml_dtypes
import numpy as np

from strata_jax.config import ModelConfig
from strata_jax.experts import ExpertWeights
from strata_jax.formats import BiasedExpertWeights, expert_weights_of
from strata_jax.models import build_model, expert_param_names, param_shapes

# Skew that leaves ~40% of a 512-expert top-10 layer unrouted at 1,000 tokens (see module doc).
SKEW_40_PERCENT_512_TOP10 = 0.52


def router_scales(n_experts: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """Per-expert router column multipliers exp(skew * z), z standardised N(0, 1): [E] float64."""
    z = rng.standard_normal(n_experts)
    if n_experts > 1:
        z = (z - z.mean()) / (z.std() or 1.0)
    return np.exp(skew * z)


def _router(config: ModelConfig, skew: float, rng: np.random.Generator) -> np.ndarray:
    h, e = config.hidden_size, config.n_experts
    w = rng.standard_normal((h, e), dtype=np.float32) / np.sqrt(h)
    return (w * router_scales(e, skew, rng)[None, :]).astype(np.float32)  # [H, E]


def _dense_value(config: ModelConfig, name: str, shape: tuple, rng: np.random.Generator,
                 routing_skew: float) -> np.ndarray:
    """One non-expert parameter's draw (before the cast to its dtype), as `init_synthetic`
    makes it."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "router":
        return _router(config, routing_skew, rng)
    return _from_normals(config, leaf, rng.standard_normal(shape, dtype=np.float32))


def _from_normals(config: ModelConfig, leaf: str, z: np.ndarray) -> np.ndarray:
    """A non-router parameter from its standard normal draws z (float32, its shape)."""
    if leaf == "selection_bias":
        return 0.02 * z
    if leaf == "weight":  # norms: near one so a wrong norm weight shows up in tests
        return 1.0 + 0.1 * z
    if leaf == "centred_weight":  # zero-centred norms: the scale is 1 + this
        return 0.1 * z
    if leaf == "A_log":  # Gated DeltaNet decay rates A in about [1, 16] (log stored)
        return np.log(1.0 + 15.0 / (1.0 + np.exp(-z)))
    if leaf == "dt_bias":
        return 0.5 * z
    if leaf == "conv":  # taps [K, C]: fan-in K
        return z / np.sqrt(z.shape[0])
    if leaf == "embed":
        return z
    if leaf in ("q_bias", "k_bias", "v_bias", "o_bias"):  # attention biases
        return 0.2 * z
    if leaf == "sinks":  # attention sink logits [N]: N(0, 4), a sizable share of some rows
        return 2.0 * z
    if leaf == "router_bias":  # [E], of the routing logits' order: it changes choices
        return 0.5 * z
    if leaf in ("gate_bias", "up_bias", "down_bias"):  # expert biases [E, I] / [E, H]
        return 0.2 * z
    value = z / np.sqrt(z.shape[-2])  # fan-in
    if leaf in ("o_proj", "down"):
        value *= _residual_scale(config)
    return value


def _residual_scale(config: ModelConfig) -> float:
    return 1.0 / np.sqrt(2.0 * config.n_layers)


class SyntheticParams(Mapping[str, np.ndarray]):
    """`init_synthetic`'s weights, each tensor made when asked for: the same bits.

    The draws come from one generator in `param_shapes` order, as `init_synthetic`'s do. The
    generator's state before each tensor is recorded as the draws pass it, so a tensor asked for
    again (another engine's host store) is drawn again from its own state, and one asked for
    out of order is found by drawing the tensors before it (routed experts drawn and dropped:
    ask in order, as `weights.LazyExperts.fill` and `build_model` do). Non-expert tensors are
    kept once made (read-only arrays: attention, norms, routers, embeddings, a few per cent of
    an MoE model); routed experts are not. `fill(name, out)` draws a tensor straight into
    `out`, expert by expert, which is how an engine's host store takes them: no copy of the
    experts exists outside it (`strata_jax.weights`).

    Args:
        config: model config.
        seed: RNG seed; same seed, same weights.
        routing_skew: router skew strength s >= 0 (see the module docstring).
        tile: None: `init_synthetic`'s weights. An int t: other weights, for benchmarks, whose
            timing does not depend on the values, made fast: each routed expert tensor repeats
            t experts (expert e is expert e % t), each drawn by a generator of its own (seeded
            by the seed, the tensor and the expert) on a thread of its own, then copied; every
            other tensor is drawn by generators of its own (seeded by the seed, the tensor and
            a block of its values), its blocks on threads. A full-size model's experts are then
            mostly copies, and any tensor can be made alone.

        keep_dense: keep each non-expert tensor once made (the default). False: drop it once
            returned and draw it again from its recorded state if asked again (the same bits),
            for one engine of a model whose dense weights would not fit in host RAM beside its
            expert store.

    A lock serialises the draws of calls from several threads.
    """

    def __init__(self, config: ModelConfig, seed: int = 0, routing_skew: float = 0.0, *,
                 tile: int | None = None, keep_dense: bool = True):

        if config.expert_format != "plain":
            raise ValueError(
                f"SyntheticParams draws plain experts, not {config.expert_format}: draw them for "
                "config.replace(expert_format='plain', expert_block=0) and quantize them as the "
                "engine takes them with strata_jax.weights.QuantizedParams(params, config)")
        if routing_skew < 0:
            raise ValueError(f"routing_skew must be >= 0, got {routing_skew}")
        if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
            raise ValueError(f"tile={tile!r}: must be a positive int (or None)")
        self.config = config
        self.seed = seed
        self.routing_skew = routing_skew
        self.tile = tile
        self.keep_dense = bool(keep_dense)
        self._specs = param_shapes(config)
        self._names = list(self._specs)
        self._order = {n: i for i, n in enumerate(self._names)}
        self._experts = frozenset(n for l in config.moe_layers
                                  for n in expert_param_names(config, l))
        # The tensors one generator draws in order (with a tile, every tensor has generators
        # of its own: none).
        self._seq = self._names if tile is None else []
        self._index = {n: i for i, n in enumerate(self._seq)}
        self._states = [np.random.default_rng(seed).bit_generator.state]  # before _seq[i]
        self._kept: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> np.ndarray:
        spec = self._specs[name]
        if name not in self._experts:
            with self._lock:
                return self._dense(name)
        out = np.empty(tuple(spec.shape), spec.dtype)
        self.fill(name, out)
        return out

    def __contains__(self, name) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor (what `dict(self)` would hold)."""
        return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
                   for s in self._specs.values())

    def is_expert(self, name: str) -> bool:
        """Whether `name` is a routed expert tensor (made on each access, never kept)."""
        return name in self._experts

    def draw_order(self, name: str) -> int:
        """Where `name` comes in the draws (asking in this order draws each tensor once)."""
        return self._order[name]

    def fill(self, name: str, out: np.ndarray) -> None:
        """Writes tensor `name` into `out` (an array or a view of its shape; cast to its dtype).

        Raises:
            KeyError: no such parameter.
            ValueError: `out` has another shape.
        """
        spec = self._specs[name]
        if tuple(out.shape) != tuple(spec.shape):
            raise ValueError(f"parameter {name!r} has shape {tuple(spec.shape)}; the array to "
                             f"fill has {tuple(out.shape)}")
        with self._lock:
            if name not in self._experts:
                out[...] = self._dense(name)
                return
            if self.tile is not None:
                self._fill_tiled(name, out)
                return
            i = self._index[name]
            self._advance(i)
            rng = self._rng(i)
            self._draw_experts(name, rng, out)
            if len(self._states) == i + 1:
                self._states.append(rng.bit_generator.state)

    def _dense(self, name: str) -> np.ndarray:
        """The kept non-expert tensor `name`, drawn first where it was not yet."""
        kept = self._kept.get(name)
        if kept is None and self.tile is not None:
            kept = self._dense_tiled(name)
            if self.keep_dense:
                self._kept[name] = kept
        elif kept is None:
            i = self._index[name]
            self._advance(i)
            kept = self._kept.get(name)
            if kept is None:  # not drawn yet, or drawn and dropped (keep_dense=False)
                rng = self._rng(i)
                kept = self._keep(name, rng)
                if len(self._states) == i + 1:
                    self._states.append(rng.bit_generator.state)
        return kept

    def _dense_tiled(self, name: str) -> np.ndarray:
        """`tile` mode's non-expert tensor `name`: its standard normals drawn in blocks of
        _DENSE_BLOCK values, each by a generator of its own (seeded by the seed, the tensor and
        the block) on a thread of its own; a router, by one generator of its own."""
        spec = self._specs[name]
        shape, leaf = tuple(spec.shape), name.rsplit(".", 1)[-1]
        key = [self.seed, self._order[name]]
        if leaf == "router":
            value = _router(self.config, self.routing_skew, np.random.default_rng(key))
        else:
            size = int(np.prod(shape))
            z = np.empty(size, np.float32)

            def draw(b: int) -> None:
                at = b * _DENSE_BLOCK
                np.random.default_rng(key + [b]).standard_normal(
                    out=z[at:at + _DENSE_BLOCK], dtype=np.float32)

            blocks = -(-size // _DENSE_BLOCK)
            with ThreadPoolExecutor(max(1, min(blocks, os.cpu_count() or 1))) as pool:
                list(pool.map(draw, range(blocks)))
            value = _from_normals(self.config, leaf, z.reshape(shape))
        value = value.astype(spec.dtype)
        value.flags.writeable = False
        return value

    def _rng(self, i: int) -> np.random.Generator:
        rng = np.random.Generator(np.random.PCG64())
        rng.bit_generator.state = self._states[i]
        return rng

    def _advance(self, i: int) -> None:
        """Draws the tensors before `i` whose states are not recorded yet (keeping the
        non-expert ones, dropping the experts), so that the state before `i` is known."""
        while len(self._states) <= i:
            j = len(self._states) - 1
            rng = self._rng(j)
            name = self._seq[j]
            if name in self._experts:
                self._draw_experts(name, rng, None)
            else:
                self._keep(name, rng)
            self._states.append(rng.bit_generator.state)

    def _keep(self, name: str, rng: np.random.Generator) -> np.ndarray:
        spec = self._specs[name]
        value = _dense_value(self.config, name, tuple(spec.shape), rng, self.routing_skew)
        value = value.astype(spec.dtype)
        value.flags.writeable = False
        if self.keep_dense:
            self._kept[name] = value
        return value

    def _draw_experts(self, name: str, rng: np.random.Generator, out: np.ndarray | None) -> None:
        """Draws a routed expert tensor [E, A, B] expert by expert into `out` (None: draws and
        drops, for the generator's state after it). The same numbers as one draw of the whole
        tensor (the generator's sequence does not depend on how a draw is split) and the same
        arithmetic per element (`_dense_value`'s last case)."""
        shape = tuple(self._specs[name].shape)
        scale = np.sqrt(shape[-2])  # fan-in
        down = name.endswith(".down")
        draw = np.empty(shape[1:], np.float32)
        value = np.empty(shape[1:], np.float64) if out is not None else None
        for e in range(shape[0]):
            rng.standard_normal(dtype=np.float32, out=draw)
            if out is None:
                continue
            np.divide(draw, scale, out=value)  # float32 / float64 in float64, as one draw does
            if down:
                value *= _residual_scale(self.config)
            out[e] = value

    def tile_of(self, name: str) -> np.ndarray:
        """Experts 0..t-1 ([t, ...], t = min(tile, E)) of routed expert tensor `name`, drawn
        alone: the same bits as those rows of `self[name]`, of which every expert e is expert
        e % t. Only with `tile`.

        Raises:
            ValueError: no `tile`, or `name` is not a routed expert tensor.
        """
        if self.tile is None or name not in self._experts:
            raise ValueError(f"tile_of({name!r}): only a routed expert tensor of tiled weights "
                             "(SyntheticParams(tile=t)) has a tile")
        shape = tuple(self._specs[name].shape)
        out = np.empty((min(self.tile, shape[0]), *shape[1:]), self._specs[name].dtype)
        with self._lock:
            self._fill_tiled(name, out, copy=False)
        return out

    def _fill_tiled(self, name: str, out: np.ndarray, copy: bool = True) -> None:
        """`tile` experts of tensor `name`, each drawn by its own generator on a thread of its
        own into `out`, then copied over the rest (expert e = expert e % tile; `copy=False`:
        `out` holds the tile only). Every step runs without the GIL: the draws and float32
        arithmetic, the cast to bfloat16 by integer rounding (`_bfloat16_bits`), the copies as
        unsigned integers."""
        shape = tuple(self._specs[name].shape)
        n = min(self.tile, shape[0])
        scale = np.float32(1.0 / np.sqrt(shape[-2])
                           * (_residual_scale(self.config) if name.endswith(".down") else 1.0))
        raw = out.view(np.dtype(f"u{out.dtype.itemsize}"))  # bit copies

        def draw(k: int) -> None:
            rng = np.random.default_rng([self.seed, self._order[name], k])
            x = rng.standard_normal(shape[1:], dtype=np.float32)
            x *= scale
            if out.dtype == _BFLOAT16:
                _bfloat16_bits(x, raw[k])
            else:
                out[k] = x

        def copy_rest(k: int) -> None:
            raw[n + k::n] = raw[k]

        with ThreadPoolExecutor(max(1, min(n, os.cpu_count() or 1))) as pool:
            list(pool.map(draw, range(n)))
            if copy:
                list(pool.map(copy_rest, range(n)))


_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_DENSE_BLOCK = 1 << 22  # values per generator of a tiled model's dense tensor


def _bfloat16_bits(x: np.ndarray, out: np.ndarray) -> None:
    """float32 `x` rounded to the nearest bfloat16 (ties to even; finite values) as uint16
    bits into `out`, in integer NumPy operations (which release the GIL, unlike a cast to
    ml_dtypes' bfloat16)."""
    bits = x.view(np.uint32)
    rounded = (bits >> 16) & 1
    rounded += 0x7FFF
    rounded += bits
    rounded >>= 16
    out[...] = rounded


def init_synthetic(config: ModelConfig, seed: int = 0, routing_skew: float = 0.0, *,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray]:
    """Random weights for every parameter of `config`, including all routed experts.

    Uses NumPy's generator in float32 then casts to the parameter dtype, which is fast for scaled
    models on the CPU. Residual-branch outputs (o_proj, down projections) are scaled by
    1/sqrt(2 * n_layers) so activations stay O(1) through depth. `SyntheticParams` makes the
    same tensors one at a time, when asked for (what a full-size model needs: its experts then
    go straight into an engine's host store).

    Args:
        config: model config.
        seed: RNG seed; same seed, same weights.
        routing_skew: router skew strength s >= 0 (see the module docstring).
        progress: called as progress(done_bytes, total_bytes) after each parameter (for a
            progress bar; full-size presets take minutes). The weights do not depend on it.

    Returns:
        flat name -> NumPy array in the parameter dtype (names as in `models.param_shapes`; the
        DeepSeek selection bias stays float32).
    """
    params = SyntheticParams(config, seed, routing_skew)
    total = params.nbytes
    out: dict[str, np.ndarray] = {}
    done = 0
    for name in params:
        value = params[name]
        value.flags.writeable = True  # the caller's own: `params` goes with this call
        out[name] = value
        done += value.nbytes
        if progress is not None:
            progress(done, total)
    return out


def split_experts(config: ModelConfig, params: dict[str, np.ndarray]
                  ) -> tuple[dict[str, np.ndarray], dict[int, ExpertWeights]]:
    """Splits routed experts out of a flat dict: (non-expert params, layer -> ExpertWeights)."""
    dense = dict(params)
    experts = {}
    for layer in config.moe_layers:
        prefix = f"layers.{layer}.mlp."
        experts[layer] = expert_weights_of(**{n: dense.pop(prefix + n)
                                              for n in BiasedExpertWeights._fields
                                              if prefix + n in dense})
    return dense, experts


def synthetic_model(config: ModelConfig, seed: int = 0, routing_skew: float = 0.0):
    """A `MoETransformer` with `init_synthetic` weights, all experts resident."""

    return build_model(config, init_synthetic(config, seed, routing_skew))


def unrouted_fraction(config: ModelConfig, skew: float, n_tokens: int, seed: int = 0,
                      n_trials: int = 4) -> float:
    """Fraction of a layer's experts that no token routes to, for calibrating `routing_skew`.

    Draws router weights as `init_synthetic` does and isotropic N(0, 1) router inputs (what an
    RMS-normalised hidden state looks like to a random router), chooses the top k per token by the
    config's scores (selection bias and group limits are left out: they shift choices little for
    synthetic weights), and averages over `n_trials` layers.

    Returns:
        Mean fraction of experts with zero tokens, in [0, 1].
    """
    rng = np.random.default_rng(seed)
    fractions = []
    for _ in range(n_trials):
        router = _router(config, skew, rng)
        x = rng.standard_normal((n_tokens, config.hidden_size), dtype=np.float32)
        logits = x @ router  # [T, E]; softmax and sigmoid are monotone: rank by logits
        top = np.argpartition(-logits, config.top_k - 1, axis=1)[:, : config.top_k]
        routed = np.zeros(config.n_experts, bool)
        routed[top.ravel()] = True
        fractions.append(1.0 - routed.mean())
    return float(np.mean(fractions))
