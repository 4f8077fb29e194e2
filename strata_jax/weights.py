"""Weights that exist one tensor at a time: lazy parameter mappings, and how a store takes them.

Guards against holding the routed experts twice. A full Qwen3-30B-A3B has 58 GB of bf16 experts;
a dict of every weight and then the engine's host store need twice that in host RAM. A model's
parameters may instead be a `Mapping` whose tensors are made when asked for and not kept
(`synthetic.SyntheticParams` draws them, `checkpoint.CheckpointExperts` reads them from the
safetensors files): a streamed engine fills its host store from it layer by layer, one tensor at
a time, straight into the store's memory where the mapping can write there itself (its `fill`),
and a resident engine puts each tensor on the device as it comes. No copy of all the experts
exists outside the store (or the device).

    LazyExperts    one MoE layer's routed experts as three names of a mapping: `.gate`, `.up`,
                   `.down` make each when read (as ExpertWeights' fields read), `fill(out)`
                   writes them into a store's views
    fill_tensor    one tensor of a mapping into an array, through the mapping's `fill` if any
    ParamsView     a mapping less some names, each tensor taken from it when asked for

A lazy mapping answers `name in params` and iterates its names without making any tensor;
`params.items()` and `dict(params)` make every one (all of them at once).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Collection, Iterator, Mapping

import numpy as np

from strata_jax.experts import ExpertWeights
from strata_jax.formats import BIASES, MATRICES, expert_format, plane_matrix
from strata_jax.models import expert_plane_names

__all__ = ["LazyExperts", "ParamsView", "QuantizedParams", "fill_tensor"]


def fill_tensor(params: Mapping, name: str, out: np.ndarray) -> None:
    """Writes tensor `name` of `params` into `out` (cast to its dtype): by `params.fill(name,
    out)` where the mapping has one (it writes there without a whole copy of its own), else from
    `params[name]`.

    Raises:
        KeyError: `params` has no `name`.
        ValueError: the tensor's shape is not `out`'s (both named).
    """
    fill = getattr(params, "fill", None)
    if fill is not None:
        fill(name, out)
        return
    value = params[name]
    if tuple(np.shape(value)) != out.shape:
        raise ValueError(f"parameter {name!r} has shape {tuple(np.shape(value))}, expected "
                         f"{out.shape}")
    out[...] = np.asarray(value)


class LazyExperts:
    """One MoE layer's routed experts: the tensors `names` of `params` (plane name -> flat
    name: gate, up, down, and their scales in a quantized format), each made when asked for
    and not kept here.

    Reads as an ExpertWeights does (`.gate`, `.up`, `.down`), or by plane (`lazy["gate_scale"]`;
    `models.build_model` puts each on the device as it comes), and fills a host store's views
    (`fill`). `on_taken` is called once, when every plane has been read or filled (a progress
    count).
    """

    def __init__(self, params: Mapping, names: Mapping[str, str] | ExpertWeights,
                 on_taken: Callable[[], object] | None = None):
        self.params = params
        self.names = dict(names._asdict() if isinstance(names, tuple) else names)
        self._on_taken = on_taken
        self._taken: set[str] = set()

    @classmethod
    def of(cls, weights, on_taken: Callable[[], object] | None = None) -> "LazyExperts":
        """`weights` (a LazyExperts: the same tensors; an ExpertWeights, or anything whose
        `.gate`, `.up`, `.down` make the tensors when read) behind this interface, to count it
        with `on_taken`."""
        if isinstance(weights, LazyExperts):
            return cls(weights.params, weights.names, on_taken)
        fields = weights._fields if isinstance(weights, tuple) else MATRICES
        return cls(_Fields(weights, fields), {f: f for f in fields}, on_taken)

    @property
    def planes(self) -> tuple[str, ...]:
        """The plane names, in blob order."""
        return tuple(self.names)

    def _took(self, plane: str) -> None:
        self._taken.add(plane)
        if self._on_taken is not None and len(self._taken) == len(self.names):
            on_taken, self._on_taken = self._on_taken, None
            on_taken()

    def __getitem__(self, plane: str):
        """Plane `plane`'s [E, ...] tensor, made now."""
        value = self.params[self.names[plane]]
        self._took(plane)
        return value

    @property
    def gate(self):
        """[E, H, I], made now."""
        return self["gate"]

    @property
    def up(self):
        """[E, H, I], made now."""
        return self["up"]

    @property
    def down(self):
        """[E, I, H], made now."""
        return self["down"]

    def fill(self, out: Mapping[str, np.ndarray] | ExpertWeights) -> None:
        """Writes every plane into `out` (numpy views of a host store by plane name, e.g.
        gate [E, H, I], up [E, H, I], down [E, I, H]), one tensor at a time, in the order the
        mapping makes its tensors (`params.draw_order(name)` where it has one: a synthetic
        mapping draws in sequence)."""
        if isinstance(out, tuple):  # ExpertWeights (BiasedExpertWeights) of views
            out = out._asdict()
        if set(out) != set(self.names):
            raise ValueError(f"fill: the store's planes {sorted(out)} are not the layer's "
                             f"{sorted(self.names)}")
        planes = list(self.names)
        order = getattr(self.params, "draw_order", None)
        if order is not None:
            planes.sort(key=lambda f: order(self.names[f]))
        for plane in planes:
            fill_tensor(self.params, self.names[plane], out[plane])
            self._took(plane)


class _Fields(Mapping):
    """gate, up, down -> the attributes of an ExpertWeights-like object, read when asked for."""

    def __init__(self, weights, fields: tuple[str, ...] = MATRICES):
        self._weights, self._fields = weights, tuple(fields)

    def __getitem__(self, field: str):
        if field not in self._fields:
            raise KeyError(field)
        return getattr(self._weights, field)

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


class ParamsView(Mapping):
    """The tensors of `params` less the names in `drop`, each taken from `params` when asked
    for (none is made here)."""

    def __init__(self, params: Mapping, drop: Collection[str]):
        self._params = params
        self._drop = frozenset(drop)
        self._names = [k for k in params if k not in self._drop]

    def __getitem__(self, name: str):
        if name in self._drop:
            raise KeyError(name)
        return self._params[name]

    def __contains__(self, name) -> bool:
        return name not in self._drop and name in self._params

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class QuantizedParams(Mapping):
    """A model's weights with its routed experts quantized as they are asked for.

    `params` holds the weights of `config` with plain experts (a bf16 checkpoint, synthetic
    weights); this mapping serves the same names for `config` itself, whose `expert_format`
    is quantized: each MoE layer's `<matrix>` and `<matrix>_scale` planes
    (`models.expert_plane_names`) are `ExpertFormat.quantize_matrix_np` of the plain
    `<matrix>` tensor (round to nearest), made when either is asked for; the other plane is
    kept until asked for, then dropped. Every other tensor passes through. Where `params`
    repeats its experts (`SyntheticParams(tile=t)`: expert e is expert e % t), only the first
    t are quantized and their planes repeated.

    Args:
        params: the plain model's weights (a Mapping; `fill` and `draw_order` used where it
            has them).
        config: the model with a quantized `expert_format`.
        tile: expert e of `params`' expert tensors repeats expert e % tile (default: its
            `tile` attribute where it has one, else none).
    """

    def __init__(self, params: Mapping, config, *, tile: int | None = None):

        if config.expert_format == "plain":
            raise ValueError("QuantizedParams: config.expert_format is 'plain'; pass the "
                             "quantized config (config.replace(expert_format='fp8' or 'int4'))")
        self.params = params
        self.config = config
        self.format = expert_format(config)
        self._source: dict[str, tuple[str, str]] = {}  # plane name -> (plain name, matrix)
        self._planes_of: dict[str, list[str]] = {}  # plain name -> its planes' names
        for layer in config.moe_layers:
            for plane, name in expert_plane_names(config, layer).items():
                if plane in BIASES:  # a bias is the plain model's, as it is
                    continue
                matrix = plane_matrix(plane)
                src = f"layers.{layer}.mlp.{matrix}"
                self._source[name] = (src, matrix)
                self._planes_of.setdefault(src, []).append(name)
        self._pending: dict[str, np.ndarray] = {}
        self.tile = tile if tile is not None else getattr(params, "tile", None)
        if self.tile is not None and (isinstance(self.tile, bool) or self.tile < 1):
            raise ValueError(f"QuantizedParams: tile={self.tile!r} must be a positive int")

    def __getitem__(self, name: str):
        if name in self._source:
            value = self._plane(name)
            if value.shape[0] == self.config.n_experts:
                return value
            out = np.empty((self.config.n_experts, *value.shape[1:]), value.dtype)
            _repeat_into(value, out)
            return out
        if name in self._planes_of:
            raise KeyError(name)  # served as its planes
        return self.params[name]

    def __contains__(self, name) -> bool:
        return name in self._source or (name not in self._planes_of and name in self.params)

    def __iter__(self) -> Iterator[str]:
        for name in self.params:
            yield from self._planes_of.get(name, (name,))

    def __len__(self) -> int:
        return len(self.params) - len(self._planes_of) + len(self._source)

    def is_expert(self, name: str) -> bool:
        return name in self._source

    def draw_order(self, name: str) -> int:
        """The plain tensor's place in `params`' draws (both planes of a matrix share it)."""
        order = getattr(self.params, "draw_order", None)
        if order is None:
            return 0
        return order(self._source[name][0] if name in self._source else name)

    def fill(self, name: str, out: np.ndarray) -> None:
        """Writes tensor `name` into `out` (a plane: quantized now, or kept from its pair's)."""
        if name in self._source:
            value = self._plane(name)
            want = (self.config.n_experts, *value.shape[1:])
            if tuple(out.shape) != want:
                raise ValueError(f"parameter {name!r} has shape {want}; the array to fill has "
                                 f"{tuple(out.shape)}")
            _repeat_into(value, out)
            return
        fill_tensor(self.params, name, out)

    def _plane(self, name: str) -> np.ndarray:
        """Plane `name`: [E, ...], or [t, ...] where the experts repeat a tile of t."""
        kept = self._pending.pop(name, None)
        if kept is not None:
            return kept
        src, matrix = self._source[name]
        t = self.tile if self.tile is not None and self.tile < self.config.n_experts else None
        if t and hasattr(self.params, "tile_of"):
            x = self.params.tile_of(src)  # [t, in, out]: the tile alone
        else:
            x = self.params[src]  # [E, in, out], plain
            x = x[:t] if t else x
        planes = _quantize_experts(self.format, matrix, x)
        del x
        prefix = src.rsplit(".", 1)[0]
        out = None
        for plane, value in planes.items():
            flat = f"{prefix}.{plane}"
            if flat == name:
                out = value
            else:
                self._pending[flat] = value
        return out


def _repeat_into(value: np.ndarray, out: np.ndarray) -> None:
    """`out` [E, ...] filled with `value` [t, ...] repeated over the experts (expert e is
    value[e % t]; t = E: a copy)."""
    t, e = value.shape[0], out.shape[0]
    for k in range(0, e, t):
        out[k:k + t] = value[:e - k]


def _quantize_experts(fmt, matrix: str, x: np.ndarray) -> dict[str, np.ndarray]:
    """`fmt.quantize_matrix_np(matrix, x)` with x [E, in, out] split over experts on a thread
    each (each expert's scales are its own, so the same bits; NumPy's array work runs without
    the GIL)."""
    n = min(len(x), os.cpu_count() or 1)
    if n <= 1:
        return fmt.quantize_matrix_np(matrix, x)
    bounds = np.linspace(0, len(x), n + 1).astype(int)
    with ThreadPoolExecutor(n) as pool:
        parts = list(pool.map(lambda ab: fmt.quantize_matrix_np(matrix, x[ab[0]:ab[1]]),
                              zip(bounds[:-1], bounds[1:])))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
