"""Dense weights in pinned host memory (`Engine(dense="host")`).

Every weight but the routed experts (the embedding; each decoder layer's attention, norms,
router, shared experts or dense MLP; the final norm and LM head) lives in one host block (pinned
on a GPU), tensor after tensor at multiples of 256 bytes, in groups: the embedding, each layer,
the head. Inside a prefill program, layer i + 1's tensors are copied into buffers XLA allocates
for them while layer i computes (`dense_fetch`, on a copy stream of its own after the work XLA's
stream has queued), and XLA's stream waits for them before layer i reads them (`dense_wait`);
the embedding is copied before the first layer and the head after the last. So the device holds
two layers' dense weights at a time (the embedding or the head beside the first or last), and
each crosses the link once per chunk (chunk-major) or once per prompt (layer-major). The math
and its bits are the resident model's. The copy stream (one a device) and each key's two events
live for the process.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable

import jax
import numpy as np
from flax import nnx

from strata_jax import native
from strata_jax.config import ModelConfig
from strata_jax.devices import check_host_bytes
from strata_jax.formats import expert_format
from strata_jax.stream.ops import dense_fetch, dense_wait

DENSE_MODES = ("device", "host")
ALIGN = 256
_stores = itertools.count(1)


def check_dense(dense) -> str:
    if dense not in DENSE_MODES:
        raise ValueError(f"dense={dense!r}: expected 'device' (every weight on the device) or "
                         "'host' (every weight but the routed experts in pinned host memory, "
                         "each layer's copied to the device one layer ahead)")
    return dense


def host_leaf(config: ModelConfig) -> Callable[[tuple], bool]:
    """Whether a parameter (its nnx path) stays on the host with dense="host": any but a
    routed expert's planes."""
    planes = {p.name for p in expert_format(config).planes}
    moe = {str(l) for l in config.moe_layers}  # a dense layer's MLP has gate/up/down too

    def on_host(path: tuple) -> bool:
        return not (len(path) == 4 and path[0] == "layers" and str(path[1]) in moe
                    and path[2] == "mlp" and path[-1] in planes)
    return on_host


def _group(path: tuple, n_layers: int) -> int:
    """A host leaf's group: 0 the embedding, 1 + i layer i, n_layers + 1 the head."""
    if path[0] == "layers":
        return 1 + int(path[1])
    return 0 if path[0] == "embed" else n_layers + 1


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def dense_layout(config: ModelConfig, shapes: dict[str, jax.ShapeDtypeStruct]
                 ) -> tuple[list[tuple], list[list[int]], int]:
    """The host block's layout of `shapes` (flat parameter names to shapes, model order): the
    host leaves (`host_leaf`) as (path, shape, dtype, offset) at multiples of ALIGN, each group's
    entries (indices; the embedding, each layer, the head, which with tied embeddings reads the
    embedding too) and the block's bytes."""
    on_host = host_leaf(config)
    n_layers = config.n_layers
    placed, groups, offset = [], [[] for _ in range(n_layers + 2)], 0
    for name, spec in shapes.items():
        path = tuple(name.split("."))
        if on_host(path):
            groups[_group(path, n_layers)].append(len(placed))
            if config.tie_embeddings and path[0] == "embed":
                groups[n_layers + 1].append(len(placed))
            placed.append((path, tuple(spec.shape), np.dtype(spec.dtype), offset))
            offset += _padded(int(np.prod(spec.shape)) * np.dtype(spec.dtype).itemsize)
    return placed, groups, offset


def group_bytes(placed: list[tuple], groups: list[list[int]]) -> list[int]:
    """Each group's bytes in the block (`dense_layout`'s)."""
    return [sum(_padded(int(np.prod(placed[i][1])) * placed[i][2].itemsize) for i in g)
            for g in groups]


def in_flight_bytes(group_bytes: list[int]) -> int:
    """Device bytes a program's dense copies take at most (`group_bytes`: the embedding, each
    layer, the head): the two largest layers', or the embedding or head beside a layer."""
    layers = group_bytes[1:-1]
    two = sum(sorted(layers)[-2:])
    return max(two, max(group_bytes[0], group_bytes[-1]) + max(layers, default=0))


def host_in_flight_bytes(config: ModelConfig, shapes: dict[str, jax.ShapeDtypeStruct]) -> int:
    """The dense weights' device bytes with dense="host" (`in_flight_bytes` of `shapes`'s
    layout): what the memory plan counts for them."""
    placed, groups, _ = dense_layout(config, shapes)
    return in_flight_bytes(group_bytes(placed, groups))


def _variable_at(module, path: Iterable):
    node = module
    for p in path:
        node = node[int(p)] if isinstance(p, int) or str(p).isdigit() else getattr(node, p)
    return node


def _set(variable, value) -> None:
    if hasattr(variable, "set_value"):
        variable.set_value(value)
    else:
        variable.value = value


class HostDense:
    """The host block of a model's dense weights by group (`_group`), and the placeholders a
    program merges in their place. The model is built straight into the block (`destination`,
    `build_model(on_host=...)`: no second host copy), then `take` leaves the rest of its state
    for the device. Holds the memory until it goes."""

    def __init__(self, config: ModelConfig, shapes: dict[str, jax.ShapeDtypeStruct],
                 device: jax.Device):
        """`shapes`: the model's flat parameter names to shapes (`models.param_shapes`, with
        the engine's `resident_experts`); the host leaves among them (`host_leaf`) are laid
        out in model order."""
        n_layers = self.n_layers = config.n_layers
        if n_layers + 2 >= 1 << 16:
            raise ValueError(f"dense='host': {n_layers} layers; at most {(1 << 16) - 3}")
        native.register_targets()  # dense_fetch and dense_wait, for any engine
        self.key_base = next(_stores) << 16  # dense_fetch keys: key_base + group
        placed, groups, offset = dense_layout(config, shapes)
        self.nbytes = offset
        check_host_bytes(offset, "dense='host': the dense weights' host block",
                         "use dense='device', or free host memory")
        if device.platform == "gpu" and native.has_cuda():
            self._buffer = native.module().PinnedBuffer(max(offset, 1), device=device.id)
            host = self._buffer.array()
        else:  # the CPU reads plain host memory
            self._buffer = None
            host = np.empty(max(offset, 1) + ALIGN, np.uint8)
            skip = (-host.ctypes.data) % ALIGN
            host = host[skip:skip + max(offset, 1)]
        base = host.ctypes.data
        self._views: dict[str, np.ndarray] = {
            ".".join(path): host[off:off + int(np.prod(shape)) * dtype.itemsize]
            .view(dtype).reshape(shape) for path, shape, dtype, off in placed}
        # Each group: (path, shape, dtype, host address) per tensor.
        self.groups: list[list[tuple[tuple, tuple, np.dtype, int]]] = [
            [(*placed[i][:3], base + placed[i][3]) for i in g] for g in groups]
        self.group_bytes = group_bytes(placed, groups)
        self._host = host
        self._holders: list = []

    def destination(self, path: tuple) -> np.ndarray | None:
        """Where parameter `path` (an nnx path) lives in the host block, None for a device
        one: `build_model(on_host=...)` writes it there."""
        return self._views.get(".".join(map(str, path)))

    def take(self, state: nnx.State) -> nnx.State:
        """`state` without its host leaves (built into the block), which become shape-only
        placeholders (`placeholders`)."""
        keep, holders = [], []
        for path, variable in nnx.to_flat_state(state):
            view = self.destination(path)
            if view is None:
                keep.append((path, variable))
            else:
                holders.append((path, variable.replace(
                    jax.ShapeDtypeStruct(view.shape, view.dtype))))
        if len(holders) != len(self._views):
            raise ValueError(f"dense='host': the model has {len(holders)} of the "
                             f"{len(self._views)} host parameters planned")
        self._holders = holders
        self._views = {}  # the block is the program's now, through its addresses
        return nnx.from_flat_state(keep)

    def placeholders(self) -> nnx.State:
        """The host leaves' places in a program's model (shapes only), made afresh for each
        trace: a variable made outside a trace cannot be set inside it."""
        return nnx.from_flat_state([(p, v.replace(v.get_value() if hasattr(v, "get_value")
                                                  else v.value)) for p, v in self._holders])

    @property
    def layer_bytes(self) -> list[int]:
        return self.group_bytes[1:-1]

    @property
    def in_flight_bytes(self) -> int:
        return in_flight_bytes(self.group_bytes)

    def calls(self) -> "DenseCalls":
        """A traced program's fetches and waits (one per program trace)."""
        return DenseCalls(self)


class DenseCalls:
    """Inside one traced program: each group's tensors fetched and set in the model before
    they are read. The model calls `embed` before its first layer, `enter` before each layer
    (which also fetches the next layer's after the layer's input) and `head` after the last."""

    def __init__(self, dense: HostDense):
        self.dense = dense
        self.pending: dict[int, list] = {}

    def _fetch(self, group: int, after: jax.Array) -> list:
        entries = self.dense.groups[group]
        if not entries:
            return []
        return dense_fetch(self.dense.key_base + group, after,
                           [(shape, dtype) for _, shape, dtype, _ in entries],
                           tuple(addr for *_, addr in entries))

    def _set(self, model, group: int, arrays: list, after: jax.Array) -> None:
        if arrays:
            arrays = dense_wait(self.dense.key_base + group, arrays, after)
            for (path, *_), a in zip(self.dense.groups[group], arrays):
                _set(_variable_at(model, path), a)

    def embed(self, model, tokens: jax.Array) -> None:
        """The embedding (group 0) set in `model`, copied after `tokens`."""
        self._set(model, 0, self._fetch(0, tokens), tokens)

    def enter(self, model, layer: int, x):
        """Layer `layer`'s tensors set in `model`; the next layer's fetch issued after `x`
        (the layer's input), which is returned."""
        after = jax.tree_util.tree_leaves(x)[-1]
        if layer == 0:
            self.pending[1] = self._fetch(1, after)
        g = layer + 1
        nxt = self._fetch(g + 1, after) if layer + 1 < self.dense.n_layers else []
        self._set(model, g, self.pending.pop(g), nxt[0] if nxt else after)
        self.pending[g + 1] = nxt
        return x

    def head(self, model, x: jax.Array) -> None:
        """The final norm and LM head set in `model`, copied after `x` (the last layer's
        output)."""
        g = self.dense.n_layers + 1
        self._set(model, g, self._fetch(g, x), x)
