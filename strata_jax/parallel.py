"""Expert parallelism over a `jax.sharding.Mesh`: each MoE layer's routed experts split across
the devices of an "expert" axis, everything else replicated.

Guards against an expert-parallel layer that routes differently from the one-device model
(every device runs the same router on the same replicated tokens, so each sees the same
choices and counts) and against a mesh the math cannot split (experts not divisible by the
axis, axes it does not use, devices of several platforms): those are refused by name.

Layout: device d of the expert axis (G devices) holds experts [E*d/G, E*(d+1)/G) of every MoE
layer (a contiguous slice: `expert_range`); the dense weights, the router, the shared expert,
the tokens and the KV cache are replicated. In each MoE layer (`ExpertParallel.routed_experts`,
under `shard_map`) a device keeps the token copies routed to its own experts (the others go to
a sentinel past its experts, sorted last, weight 0), runs the model's own sort, grouped
matmuls and weighted combine on them, and the float32 partial outputs [T, H] are summed across
the axis (`psum`) before the cast to the parameter dtype. The shared expert and the padding
mask follow once, replicated, as on one device. docs/DESIGN.md ("Several devices") says why a
psum and not an all-to-all, and what that costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from strata_jax.formats import expert_format
from strata_jax.layers.moe import (_in_dtype, experts_swiglu, experts_swiglu_pieces, sort_order,
                                   unpermute)

EXPERT_AXIS = "expert"

try:  # jax >= 0.6 has jax.shard_map; older releases only jax.experimental.shard_map
    _shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - depends on the installed jax
    from jax.experimental.shard_map import shard_map as _shard_map


def shard_map(f, *, mesh: Mesh, in_specs, out_specs, check: bool = True):
    """`jax.shard_map` (or `jax.experimental.shard_map.shard_map` where only that exists).
    check=False: no check that the outputs given out_specs P() are the same on every device
    (a streamed chunk's outputs flow from its custom calls, which the check cannot see
    through; each device's copy of them is the same by construction)."""
    if check:
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    try:
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                          check_vma=False)
    except TypeError:  # pragma: no cover - older releases name it check_rep
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                          check_rep=False)


# ---- the mesh -----------------------------------------------------------------------------------


def expert_mesh(devices=None, *, axis: str = EXPERT_AXIS) -> Mesh:
    """A one-axis mesh named `axis` over `devices`.

    Args:
        devices: a count N (the first N of JAX's default backend's devices, every process's),
            a sequence of jax.Device, or None (every device of the default backend).
        axis: the axis name.

    Raises:
        ValueError: a count below 1 or past the devices there are (with how to get simulated
            CPU devices), an empty or repeated device list, devices of several platforms.
        TypeError: anything else.
    """
    if devices is None:
        found = jax.devices()
    elif isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        n = int(devices)
        have = jax.devices()
        if n < 1:
            raise ValueError(f"devices={n}: an expert mesh needs at least 1 device")
        if n > len(have):
            raise ValueError(
                f"devices={n}: JAX sees {len(have)} {have[0].platform} device"
                f"{'s' if len(have) != 1 else ''}; use at most {len(have)}"
                + (" (for simulated CPU devices set XLA_FLAGS=--xla_force_host_platform_"
                   f"device_count={n}, or jax.config.update('jax_num_cpu_devices', {n}), "
                   "before JAX starts)" if have[0].platform == "cpu" else ""))
        found = have[:n]
    elif isinstance(devices, Sequence) and not isinstance(devices, str):
        found = list(devices)
        if not found:
            raise ValueError("devices=[]: an expert mesh needs at least 1 device")
        bad = [d for d in found if not isinstance(d, jax.Device)]
        if bad:
            raise TypeError(f"devices: {bad[0]!r} is not a jax.Device")
        if len(set(found)) != len(found):
            raise ValueError(f"devices: a device is listed twice ({_names(found)}); list each once")
    else:
        raise TypeError(f"devices must be a count, a sequence of jax.Device or None, got "
                        f"{type(devices).__name__}")
    return Mesh(np.asarray(found, dtype=object), (axis,))


def _names(devices) -> str:
    return ", ".join(f"{d.platform}:{d.id}" for d in devices)


def check_mesh(mesh, n_experts: int, *, axis: str = EXPERT_AXIS) -> int:
    """Checks that `mesh` can split `n_experts` experts along `axis`; returns the axis size G.

    Raises:
        TypeError: not a jax.sharding.Mesh.
        ValueError: no axis named `axis`; another axis of size > 1 (only the expert axis is
            used: tokens and dense weights are replicated); devices of several platforms;
            `n_experts` not a multiple of G.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (strata_jax.parallel.expert_mesh "
                        f"makes one), got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh has axes {tuple(mesh.axis_names)} but no {axis!r} axis, "
                         f"which the experts split along; make it with axis name {axis!r} "
                         "(strata_jax.parallel.expert_mesh)")
    others = {a: s for a, s in mesh.shape.items() if a != axis and s != 1}
    if others:
        raise ValueError(f"the mesh's axes {others} have more than one device: only the "
                         f"{axis!r} axis is implemented (tokens, attention and dense weights "
                         "are replicated); use a mesh with the expert axis alone")
    platforms = {d.platform for d in mesh.devices.flat}
    if len(platforms) != 1:
        raise ValueError(f"the mesh mixes platforms {sorted(platforms)}; use devices of one")
    g = int(mesh.shape[axis])
    if n_experts % g:
        fits = [d for d in range(1, g + 1) if n_experts % d == 0]
        raise ValueError(f"{n_experts} experts per layer do not split evenly over the {g} "
                         f"devices of the {axis!r} axis; use a device count that divides "
                         f"{n_experts} (at most {g}: {', '.join(map(str, fits))})")
    return g


def expert_slices(n_experts: int, n_devices: int) -> tuple[tuple[int, int], ...]:
    """Device d's experts of every MoE layer, [E*d/G, E*(d+1)/G), for d in 0..G-1.

    Raises:
        ValueError: G is not a positive int, or E is not a multiple of G (every device holds
            as many experts, so one program's shapes serve them all).
    """
    if isinstance(n_devices, bool) or not isinstance(n_devices, (int, np.integer)) \
            or n_devices < 1:
        raise ValueError(f"{n_devices!r} devices: expected a positive int")
    if n_experts % n_devices:
        divisors = [g for g in range(1, n_experts + 1) if n_experts % g == 0]
        raise ValueError(
            f"{n_experts} experts per layer do not split evenly over {n_devices} devices: "
            f"each device holds an equal slice of every layer; use a device count that "
            f"divides {n_experts} ({', '.join(map(str, divisors))})")
    per = n_experts // n_devices
    return tuple((d * per, (d + 1) * per) for d in range(n_devices))


def expert_range(n_experts: int, devices: int, index: int) -> tuple[int, int]:
    """The experts [lo, hi) that device `index` of `devices` holds (`expert_slices`)."""
    return expert_slices(n_experts, devices)[index]


def replicated(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
    """Every device of the mesh holds the whole array."""
    return NamedSharding(mesh, P(), memory_kind=memory_kind)


def expert_sharded(mesh: Mesh, axis: str = EXPERT_AXIS) -> NamedSharding:
    """An [E, ...] array split along its first axis over the mesh's `axis`."""
    return NamedSharding(mesh, P(axis))


def device_rows(counts, devices: int) -> np.ndarray:
    """Token copies each device's experts read, from routing counts [..., E] (an
    engine's `PrefillResult.counts`): [..., G], summed over each device's expert slice."""
    counts = np.asarray(counts)
    e = counts.shape[-1]
    if e % devices:
        raise ValueError(f"{e} experts do not split over {devices} devices")
    return counts.reshape(*counts.shape[:-1], devices, e // devices).sum(-1)


# ---- the expert-parallel layer -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How an MoE layer splits its routed experts: over `axis` of `mesh` (static, hashable:
    part of every compiled program). Set as `MoE.parallel`; `routed_experts` is then the
    layer's steps 4-6."""

    mesh: Mesh
    axis: str = EXPERT_AXIS
    # True: the layer is already traced once per device (the whole chunk runs under
    # `shard_map`, as a streamed engine's does: each device's stream calls reach its own
    # engine), so `routed_experts` gets the device's own [E/G, ...] weights and sums its
    # partial output across the axis itself; False: the layer makes its own shard_map.
    manual: bool = False

    @property
    def size(self) -> int:
        return int(self.mesh.shape[self.axis])

    def routed_experts(self, moe, x: jax.Array, routing, w, pieces=None) -> jax.Array:
        """Steps 4-6 of `moe` (model.MoE) for x [T, H] with its routing and the layer's expert
        weights `w` (ExpertWeights of [E, ...] arrays split over the axis; with `manual`, the
        device's own [E/G, ...]), on every device's own experts; returns the combined [T, H]
        in x.dtype, replicated. `pieces` (a streamed tail's row pieces, `MoE.apply_experts`)
        only with `manual`: each device runs its sorted rows in those pieces.

        Each device maps the routing to its slice (`local_routing`), runs the model's
        `sort_order`, `experts_swiglu` and the float32 weighted combine of `unpermute` on it,
        and the partial outputs are summed across the axis (float32 `psum`), then cast. Summed over devices
        instead of over one device's k choices, a token's output may differ from the one-device
        model's in the last bits (the tolerance table bounds it).
        """
        n_experts = moe.config.n_experts
        check_mesh(self.mesh, n_experts, axis=self.axis)
        per = n_experts // self.size
        impl, quantized = moe.kernels.grouped_matmul, moe.kernels.quantized_matmul
        axis = self.axis
        k = routing.expert_ids.shape[1]

        def local(x, expert_ids, weights, counts, w):
            ids, wts, cnt = local_routing(expert_ids, weights, counts, per,
                                          lax.axis_index(axis))
            if pieces is None:
                order = sort_order(ids)
                y_sorted = experts_swiglu(x, order // k, _in_dtype(w, x.dtype), cnt, impl,
                                            quantized, moe.act)
            else:
                # The device's sorted rows: its own copies first (its slice's groups), the
                # other devices' after them (the sentinel, no group). Each piece readies the
                # device's experts with rows in the piece's range, as on one device.
                bounds, weights_for_piece = pieces
                order = sort_order(ids)
                with jax.named_scope("experts"):
                    y_sorted = experts_swiglu_pieces(x, order, k, cnt, bounds,
                                                       weights_for_piece, impl=impl,
                                                       quantized=quantized, act=moe.act)
            partial = unpermute(y_sorted.astype(jnp.float32), order, wts)  # [T, H] float32
            with jax.named_scope("combine"):
                return lax.psum(partial, axis)

        if self.manual:
            with jax.named_scope("expert_parallel"):
                out = local(x, routing.expert_ids, routing.weights, routing.counts, w)
            return out.astype(x.dtype)
        if pieces is not None:
            raise NotImplementedError(
                "row pieces on a mesh run only where the whole chunk is traced per device "
                "(ExpertParallel(manual=True), a streamed engine's); this layer makes its own "
                "shard_map")
        spec_w = jax.tree.map(lambda _: P(axis), w)  # every plane split along its experts
        with jax.named_scope("expert_parallel"):
            out = shard_map(local, mesh=self.mesh,
                            in_specs=(P(), P(), P(), P(), spec_w), out_specs=P())(
                x, routing.expert_ids, routing.weights, routing.counts, w)
        return out.astype(x.dtype)


def local_routing(expert_ids: jax.Array, weights: jax.Array, counts: jax.Array, per: int,
                  index) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One device's view of a layer's routing: device `index` holds experts
    [index*per, (index+1)*per).

    Returns:
        (ids int32 [T, k]: a copy's expert within the slice, `per` (a sentinel sorted after
        them) for copies of other devices' experts and for padding; weights float32 [T, k], 0
        for those copies; counts int32 [per], the slice's group sizes).

    The stable sort by these ids keeps the slice's copies in the one-device sorted order,
    which is why the device's rows are the one-device model's rows of its experts.
    """
    base = index * per
    rel = expert_ids - base
    mine = (rel >= 0) & (rel < per)
    ids = jnp.where(mine, rel, jnp.int32(per)).astype(jnp.int32)
    return ids, jnp.where(mine, weights, 0.0), lax.dynamic_slice_in_dim(counts, base, per)


# ---- placing a model on the mesh -----------------------------------------------------------------


def is_routed_expert_leaf(path: tuple, planes, moe_layers) -> bool:
    """Whether a flat model path ("layers", N, "mlp", plane) is a routed expert's parameter:
    N an MoE layer (a dense layer's MLP has gate/up/down too), never the shared expert's
    ("layers", N, "mlp", "shared", ...)."""
    return (len(path) == 4 and path[0] == "layers" and path[2] == "mlp" and path[3] in planes
            and int(path[1]) in moe_layers)


def set_parallel(model, parallel: ExpertParallel | None) -> None:
    """Makes every MoE layer of `model` (model.MoETransformer) split its routed experts by
    `parallel` (None: one device)."""
    for layer in model.layers:
        if layer.is_moe:
            layer.mlp.parallel = parallel


def state_shardings(state, config, mesh: Mesh, *, axis: str = EXPERT_AXIS):
    """The shardings of a model's nnx state on `mesh`: the MoE layers' routed expert planes
    split over `axis`, everything else replicated."""
    planes = {p.name for p in expert_format(config).planes}
    moe = set(config.moe_layers)
    split, rep = expert_sharded(mesh, axis), replicated(mesh)
    flat = [(path, split if is_routed_expert_leaf(tuple(str(p) for p in path), planes, moe)
             else rep)
            for path, _ in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


class ShardedExperts:
    """A layer's expert planes (read by plane name: `weights.LazyExperts` or a dict of [E, ...]
    arrays) put on the mesh one plane at a time as `models.build_model` reads them, split along
    the expert axis: no device holds more than its slice."""

    def __init__(self, planes, mesh: Mesh, axis: str = EXPERT_AXIS):
        self._planes, self._sharding = planes, expert_sharded(mesh, axis)

    def __getitem__(self, name):
        return jax.device_put(np.asarray(self._planes[name]), self._sharding)
