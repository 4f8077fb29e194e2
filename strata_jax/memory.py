"""The memory plan: the bytes a prefill and a streamed model take, and the memory there is.

Estimates are arithmetic on shapes only (no device work, nothing allocated):

    kv_cache_bytes, chunk_bytes,   a KV cache; one chunk's activations; the chunk sizes an
    chunk_candidates, chunk_memory automatic choice tries; a chunked prefill's activations (with
                                   CHUNK_HEADROOM) and KV caches
    expert_bytes                   one router/expert call's activations (a chunk's, or a
                                   layer-major group's: Engine.layer_major_bytes)
    attention_working_bytes        one chunk's (or layer-major sub-chunk's) attention
    param_bytes, weight_bytes      a model's parameters; the weights a prefill's device holds
    prefill_bytes, most_that_fits  a whole prefill on its device; the largest context that fits
    memory_plan                    a model streamed with a resident budget: host store,
                                   residents, ring, KV cache, what fits on the device

The memory there is: `host_memory` (the one reader of /proc/meminfo), `memory_stats` (a JAX
device's, where it reports them), `device_memory` (the size of the device a stream backend or a
resident arm uses), `free_memory` (what a computation on a device may still take) and
`check_host_bytes` (new host memory against the available RAM: a `HostMemoryError` with the
figures; a streamed engine checks its host store so before allocating it).

Who uses it: the engine chooses its chunk by `chunk_memory` against `free_memory`
(`Engine.memory_available`) and re-exports the estimates (`strata_jax.engine.chunk_memory`
still works); a `NativeStreamer` checks a resident budget against `device_memory`; the command
line (strata_jax/cli/) refuses a prefill that cannot fit before any work (`cli/checks.py`,
from these estimates) and prints `memory_plan` (`strata-jax info`).
"""

from __future__ import annotations

import os
from typing import Callable

import jax
import numpy as np

from .attention import attention_bytes, attention_path
from .config import ModelConfig

__all__ = ["CHUNK_HEADROOM", "TOKEN_ID_BYTES", "MIN_BUCKET", "kv_cache_bytes", "chunk_bytes",
           "chunk_candidates", "chunk_memory", "expert_bytes", "attention_working_bytes",
           "param_bytes", "weight_bytes", "prefill_bytes",
           "most_that_fits", "memory_plan", "host_memory", "memory_stats", "device_memory",
           "free_memory", "HostMemoryError", "check_host_bytes"]

# The smallest chunk an engine takes, and its smallest compile bucket (engine.compile_buckets).
MIN_BUCKET = 16
# Activation estimates leave this factor of headroom for XLA's own temporaries.
CHUNK_HEADROOM = 2.0
# Host and device bytes per prompt token: the caller's int64 ids, validate_inputs' int32 copy
# and the chunks' int32 ids (`Engine._chunk_ids`, staged with a streamed engine's stream).
TOKEN_ID_BYTES = 16


# ---- a prefill ----------------------------------------------------------------------------------


def kv_cache_bytes(config: ModelConfig, capacity: int) -> int:
    """Bytes of one KV cache (keys and values of every layer) of `capacity` positions."""
    c = config
    return 2 * c.n_layers * capacity * c.n_kv_heads * c.head_dim * np.dtype(c.dtype).itemsize


def expert_bytes(config: ModelConfig, tokens: int) -> int:
    """Activation bytes of one router/expert call on `tokens` rows: the router's logits and
    scores ([T, E] float32), the experts' sorted inputs and outputs ([T*k, H]) and their
    gate/up activations ([T*k, I], float32 and the parameter dtype)."""
    c = config
    it = np.dtype(c.dtype).itemsize
    rows = tokens * c.top_k
    return int(tokens * c.n_experts * 8
               + rows * (2 * c.hidden_size * it + 2 * c.expert_intermediate * (4 + it)))


def attention_working_bytes(config: ModelConfig, queries: int, capacity: int, *, first: bool,
                            platform: str = "cpu", attention: str = "auto") -> int:
    """Working memory of one chunk's attention (`attention.attention_bytes`) on the path
    `attention_path` takes for `queries` tokens: over their own keys (`first`) or over a cache
    of `capacity` positions, with the `attention` path requested (`Kernels.attention`). The
    most of any layer's: layers with a sliding window (`ModelConfig.window_of`) run other
    parts than full ones."""
    c = config
    path = attention_path(c.dtype, c.head_dim, c.n_heads, queries, capacity, first=first,
                          platform=platform, impl=attention)
    windows = {None} if first else {c.window_of(i) for i in range(c.n_layers)}
    return max(attention_bytes(path, np.dtype(c.dtype).itemsize, c.n_heads, queries,
                               queries if first else capacity, c.head_dim, window=w)
               for w in windows)


def chunk_bytes(config: ModelConfig, chunk: int, capacity: int, *, first: bool = False,
                platform: str = "cpu", streamed: bool = False, attention: str = "auto",
                dequantized: bool | None = None) -> int:
    """Estimated activation bytes of one chunk of `chunk` tokens against a cache of
    `capacity` positions on a `platform` device with the `attention` path requested
    (`Kernels.attention`; `Engine.chunk_bytes` says what is counted); `streamed` adds one
    layer's expert weights (the packed ring's outputs). `dequantized`: whether the expert math
    writes a quantized layer out in the parameter dtype before its grouped matmuls (the
    "dequantize" path; a fused kernel does not), adding one layer's experts in that dtype;
    None: for any quantized format (where the path is not known yet)."""
    c = config
    it = np.dtype(c.dtype).itemsize
    qkv = chunk * (2 * c.n_heads + 2 * c.n_kv_heads) * c.head_dim * (4 + it)
    attn = attention_working_bytes(c, chunk, capacity, first=first, platform=platform,
                                   attention=attention)
    hidden = 4 * chunk * c.hidden_size * it
    routing = chunk * c.top_k * 8
    fetched = c.n_experts * c.expert_bytes if streamed else 0
    if dequantized is None:
        dequantized = c.expert_format != "plain"
    layer = c.n_experts * c.expert_params * it if dequantized else 0
    return int(qkv + attn + hidden + routing + expert_bytes(c, chunk) + fetched + layer)


def chunk_candidates(max_context: int) -> list[int]:
    """The chunk sizes an automatic choice tries, largest first: max_context, then the powers
    of two below it down to MIN_BUCKET (the last is the smallest chunk an engine can pick)."""
    out = [int(max_context)]
    b = 1 << max(max_context - 1, 1).bit_length()
    while b > MIN_BUCKET:
        b //= 2
        if b < max_context:
            out.append(b)
    return out


def chunk_memory(config: ModelConfig, chunk: int, max_context: int,
                 sub_chunk: int | None = None, *, platform: str = "cpu",
                 streamed: bool = False, headroom: float = CHUNK_HEADROOM,
                 attention: str = "auto", dequantized: bool | None = None
                 ) -> tuple[int, int, int]:
    """(activations, KV caches, capacity) of a prefill in chunks of `chunk` tokens: what
    `Engine._choose_chunk` compares with the memory it has. Activations: `headroom` x the
    larger `chunk_bytes` of a first and a later chunk; KV caches: two of the capacity (a
    session's and the one a chunk writes), max_context + max(chunk, sub_chunk) positions."""
    capacity = int(max_context) + max(int(chunk), int(sub_chunk or chunk))
    kw = {"platform": platform, "streamed": streamed, "attention": attention,
          "dequantized": dequantized}
    activations = headroom * max(chunk_bytes(config, chunk, capacity, **kw),
                                 chunk_bytes(config, chunk, capacity, first=True, **kw))
    return int(activations), 2 * kv_cache_bytes(config, capacity), capacity


def param_bytes(config: ModelConfig, **kw) -> int:
    """Bytes of the model's parameters (`model.param_shapes(config, **kw)`), from shapes only."""
    from .model import param_shapes

    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
               for s in param_shapes(config, **kw).values())


def weight_bytes(config: ModelConfig, plan=None, platform: str = "cpu") -> int:
    """Bytes of the weights a prefill's `platform` device holds: every parameter when nothing
    streams (`plan` None); streamed by `plan` (stream.plan_stream), on the GPU the dense
    weights and the residents (the ring is the native engine's own allocation), on the CPU
    every parameter and the simulated ring."""
    if plan is None:
        return param_bytes(config)
    if platform == "gpu":
        return param_bytes(config, resident_experts=False) + plan.resident_bytes
    return param_bytes(config) + plan.ring_bytes


def prefill_bytes(config: ModelConfig, weights: int, context: int, *, max_context: int,
                  n_tokens: int, chunk: int | None, sub_chunk: int | None, platform: str,
                  streamed: bool, dequantized: bool | None = None
                  ) -> tuple[int, int, int, int, int]:
    """(bytes in all, activations, KV caches, their capacity, chunk) of a prefill of
    `n_tokens` tokens (of a `max_context` prompt: fewer token ids in a smaller `context`) in a
    KV cache of `context` positions, beside `weights` bytes (`weight_bytes`), on a `platform`
    device: `chunk_memory` of `chunk`, else of the smallest chunk an automatic choice can
    take, and TOKEN_ID_BYTES per token (`dequantized`: as `chunk_bytes`')."""
    c = chunk or chunk_candidates(context)[-1]
    act, kv, cap = chunk_memory(config, c, context, sub_chunk, platform=platform,
                                streamed=streamed, dequantized=dequantized)
    ids = TOKEN_ID_BYTES * n_tokens * context // max_context  # fewer tokens in less
    return weights + act + kv + ids, act, kv, cap, c


def most_that_fits(fits: Callable[[int], bool], hi: int) -> int:
    """The largest n below `hi` with fits(n), by bisection: fits(0) is taken to hold, fits(hi)
    not to, and `fits` to turn false once and stay false (more positions, more bytes)."""
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ---- a streamed model ---------------------------------------------------------------------------


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def _streamed_note(config, plan, extra: int, ring_streaming: int) -> str | None:
    """Why a streamed plan takes `extra` > 0 bytes more than every expert resident, or None.

    A streamed engine reads every MoE layer from a ring frame of all n_experts slots, its
    resident experts copied in (stream.plan_stream), so the ring is a real cost on top of the
    residents: once they hold nearly every expert, the streamed plan passes the all-resident
    one. `ring_streaming`: the ring's bytes while something streams (the plan with no
    residents), from which the most residents per layer that stay within it follow.
    """
    if extra <= 0:
        return None
    E, n_moe = config.n_experts, len(config.moe_layers)
    per = max((len(plan.resident[l]) for l in config.moe_layers), default=0)
    frames = max(1, ring_streaming // max(E * plan.blob_bytes, 1))
    # n_moe * keep + frames * E <= n_moe * E experts: the residents and ring within all of them.
    keep = max(0, E * (n_moe - frames) // n_moe) if n_moe else 0
    way = (f"keep at most {keep} per layer resident" if keep else "stream every expert")
    return (f"the streamed plan takes {_size(extra)} more than every expert resident: a "
            f"streamed engine reads each layer from a ring frame of all {E} of its experts, "
            f"its residents copied in, so the ring ({_size(plan.ring_bytes)}) comes on top of "
            f"{per} of {E} experts per layer resident; --no-stream (every expert resident) "
            f"needs less, or {way} to stay within it")


def memory_plan(config, *, max_context: int, resident_gib: float | None = None,
                resident_per_layer: int | None = None, ring_gib: float = 4.0,
                device_bytes: int | None = None, devices: int = 1) -> dict:
    """Bytes on the device and the host for a model streamed with a resident budget.

    The host store (every expert, pinned host RAM) is `host_store_bytes`. The residents and the
    ring are `stream.plan_stream`'s, the plan a NativeStreamer follows, without a profile: a
    resident budget in GiB is spread evenly over the MoE layers (lowest ids), the ring holds two
    layer frames (a layer's experts each) when `ring_gib` allows and at least one. A ring budget
    below one frame, which an engine refuses, is reported here as `ring_fits_budget: False`
    with a one-frame ring. Activations and compiler workspace are not
    counted. The ring is whole layer frames (residents copied in) whatever the residents, so
    with nearly every expert resident the streamed plan takes more than every expert
    resident; `streamed_note` then says so and why (else it is None).

    `devices` > 1: expert parallelism (`Engine(mesh=)`): `per_device` holds what each of them
    needs, the dense weights and the KV cache replicated and 1/devices of the experts
    (`experts_per_layer`, `expert_slices`, `expert_bytes`, `device_bytes_all_resident` and,
    with `device_bytes`, `fits_all_resident`); streamed, each device's own plan over its
    slice (`plan_stream(devices=)`: the budgets are per device) with its residents and ring
    (`resident_per_layer`, `resident_bytes`, `ring_slots`, `ring_frames`, `ring_bytes`,
    `device_bytes_streamed`, with `device_bytes` `fits_streamed`); the host store is one
    (every expert once, each device's engine copying from its slice).

    Raises:
        ValueError: what plan_stream refuses (a negative budget, more residents per layer than
            a layer has experts); a device count below 1 or not dividing the experts.
    """
    from .parallel import expert_slices
    from .stream import StreamConfig, plan_stream  # not at the top: the stream imports this

    if devices < 1 or config.n_experts % devices:
        raise ValueError(f"devices={devices} does not divide the {config.n_experts} experts "
                         f"of a layer; use a device count that divides {config.n_experts}")

    n_moe = len(config.moe_layers)
    dense = param_bytes(config, resident_experts=False)
    kv = kv_cache_bytes(config, max_context)
    stream = StreamConfig(ring_budget_gib=ring_gib, resident_budget_gib=resident_gib,
                          resident_per_layer=resident_per_layer or 0)
    plan = plan_stream(config, stream, check_ring_budget=False)
    # Every expert streamed: the largest ring, what the resident experts must leave room for.
    ring_none = plan_stream(config, StreamConfig(ring_budget_gib=ring_gib),
                            check_ring_budget=False).ring_bytes
    per = max((len(plan.resident[l]) for l in config.moe_layers), default=0)
    streamed_plan = dense + kv + plan.resident_bytes + plan.ring_bytes
    resident_all = dense + kv + config.expert_bytes_total
    out = {
        "expert_bytes": plan.blob_bytes,
        "expert_bytes_per_layer": config.expert_bytes_per_layer,
        "expert_bytes_total": config.expert_bytes_total,
        "moe_layers": n_moe,
        "dense_bytes": dense,
        "kv_bytes": kv,
        "max_context": max_context,
        "resident_per_layer": per,
        "resident_bytes": plan.resident_bytes,
        "streamed_per_layer": plan.max_streamed_per_layer,
        "ring_slots": plan.ring,
        "ring_frames": plan.frames,
        "ring_bytes": plan.ring_bytes,
        "ring_fits_budget": plan.ring_fits_budget,
        "device_bytes_streamed": streamed_plan,
        "device_bytes_all_resident": resident_all,
        "streamed_note": _streamed_note(config, plan, streamed_plan - resident_all, ring_none),
        "device_memory": device_bytes,
        "host_store_bytes": config.expert_bytes_total,
    }
    if device_bytes is not None:
        out["fits_streamed"] = bool(plan.ring_fits_budget and streamed_plan <= device_bytes)
        out["fits_all_resident"] = bool(resident_all <= device_bytes)
        out["max_resident_gib"] = max(0.0, (device_bytes - dense - kv - ring_none) / 2**30)
    out["devices"] = devices
    per_device = dense + kv + config.expert_bytes_total // devices
    per = config.n_experts // devices
    # Without a profile every device's plan has the same shape: device 0's stands for all.
    local = plan_stream(config, stream, check_ring_budget=False, devices=devices)
    streamed_dev = dense + kv + local.resident_bytes + local.ring_bytes
    out["per_device"] = {"experts_per_layer": per,
                         "expert_slices": [list(s) for s in expert_slices(config.n_experts,
                                                                          devices)],
                         "expert_bytes": config.expert_bytes_total // devices,
                         "device_bytes_all_resident": per_device,
                         "resident_per_layer": max((len(local.resident[l])
                                                    for l in config.moe_layers), default=0),
                         "resident_bytes": local.resident_bytes,
                         "ring_slots": local.ring,
                         "ring_frames": local.frames,
                         "ring_bytes": local.ring_bytes,
                         "ring_fits_budget": local.ring_fits_budget,
                         "device_bytes_streamed": streamed_dev}
    if device_bytes is not None:
        out["per_device"]["fits_all_resident"] = bool(per_device <= device_bytes)
        out["per_device"]["fits_streamed"] = bool(local.ring_fits_budget
                                                  and streamed_dev <= device_bytes)
    return out


# ---- the memory there is ------------------------------------------------------------------------


def host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of host RAM from /proc/meminfo (MemTotal, MemAvailable), each
    None where unknown. The one reader of /proc/meminfo (the engine's and the CLI's)."""
    found = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found.get("MemTotal"), found.get("MemAvailable")


class HostMemoryError(MemoryError):
    """Host RAM cannot hold what an engine or a command would allocate; the message has the
    figures and the way out."""


def check_host_bytes(need: int, what: str, way: str) -> None:
    """Refuses `need` bytes of new host memory (`what`: what they are) past the available
    host RAM (MemAvailable); nothing where that is unknown.

    Raises:
        HostMemoryError: "{what} needs N GiB of host RAM and M GiB is available; {way}".
    """
    available = host_memory()[1]
    if available is not None and need > available:
        raise HostMemoryError(f"{what} needs {_gib(need)} of host RAM and {_gib(available)} is "
                              f"available; {way}")


def _host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo, else free physical pages."""
    available = host_memory()[1]
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 2**63 - 1


def memory_stats(device) -> dict:
    """`device.memory_stats()` (bytes_limit, bytes_in_use, ...), {} where the backend reports
    none: the one query of a JAX device's memory (the engine's, the stream's and the CLI's)."""
    try:
        return device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without stats raise or return None
        return {}


def device_memory(platform: str, index: int = 0) -> tuple[int | None, str]:
    """(bytes, what) of the device a stream backend or the resident arm uses: "gpu", the
    memory limit of JAX's GPU `index` (None where it reports none or there is no such GPU);
    else host RAM, the cpu backend's simulated device (None where unknown)."""
    if platform == "gpu":
        try:
            device = jax.devices("gpu")[index]
        except (RuntimeError, IndexError):  # no GPU, or not that many
            return None, "GPU memory"
        limit = memory_stats(device).get("bytes_limit")
        return (int(limit) if limit else None), "GPU memory"
    total, _ = host_memory()
    return total, "host RAM (the cpu backend's simulated device)"


def free_memory(device, limit: int | None = None,
                limit_what: str = "the limit") -> tuple[int, str]:
    """(bytes, what) a computation on `device` may take: its free memory (bytes_limit less
    bytes_in_use) where it reports them, else available host RAM; `limit` (named
    `limit_what`), where given, caps the first and replaces the second."""
    stats = memory_stats(device)
    if stats.get("bytes_limit"):
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        what = f"free memory of {device.device_kind}"
        if limit is not None and limit < free:
            return int(limit), limit_what
        return free, what
    if limit is not None:
        return int(limit), limit_what
    return _host_available_bytes(), "available host RAM"
