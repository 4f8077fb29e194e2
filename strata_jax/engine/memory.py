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

The memory there is comes from `strata_jax.devices`. The engine chooses its chunk by
`chunk_memory` against `devices.free_memory` (`Engine.memory_available`); the command line
(strata_jax/cli/) refuses a prefill that cannot fit before any work (`cli/checks.py`, from these
estimates) and prints `memory_plan` (`strata-jax info`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from strata_jax.config import ModelConfig
from strata_jax.devices import size
from strata_jax.engine.dense import host_in_flight_bytes
from strata_jax.layers.attention import attention_bytes, attention_path
from strata_jax.models import cache_bytes, model_module, param_shapes
from strata_jax.parallel import expert_slices
from strata_jax.stream import StreamConfig, plan_stream

__all__ = ["CHUNK_HEADROOM", "TOKEN_ID_BYTES", "MIN_BUCKET", "kv_cache_bytes", "chunk_bytes",
           "chunk_candidates", "chunk_memory", "expert_bytes", "attention_working_bytes",
           "layer_major_bytes",
           "param_bytes", "weight_bytes", "prefill_bytes",
           "most_that_fits", "memory_plan"]

# The smallest chunk an engine takes, and its smallest compile bucket (engine.compile_buckets).
MIN_BUCKET = 16
# Activation estimates leave this factor of headroom for XLA's own temporaries.
CHUNK_HEADROOM = 2.0
# Host and device bytes per prompt token: the caller's int64 ids, validate_inputs' int32 copy
# and the chunks' int32 ids (`Engine._chunk_ids`, staged with a streamed engine's stream).
TOKEN_ID_BYTES = 16


# ---- a prefill ----------------------------------------------------------------------------------


def kv_cache_bytes(config: ModelConfig, capacity: int) -> int:
    """Bytes of one cache of the model (keys and values of every layer, for the decoder stack)
    of `capacity` positions (`models.cache_bytes`)."""
    return cache_bytes(config, capacity)


def expert_bytes(config: ModelConfig, tokens: int, parts: int = 1) -> int:
    """Activation bytes of one router/expert call on `tokens` rows: the router's logits and
    scores ([T, E] float32), the experts' sorted inputs and outputs ([T*k, H]) and their
    gate/up activations ([T*k, I], float32 and the parameter dtype); a layer in `parts` parts
    (StreamTuning.parts) also the sorted outputs so far ([T*k, H]) beside a part's."""
    c = config
    it = np.dtype(c.dtype).itemsize
    rows = tokens * c.top_k
    sorted_rows = 2 if parts == 1 else 3
    return int(tokens * c.n_experts * 8
               + rows * (sorted_rows * c.hidden_size * it
                         + 2 * c.expert_intermediate * (4 + it)))


def attention_working_bytes(config: ModelConfig, queries: int, capacity: int, *, first: bool,
                            platform: str = "cpu", attention: str = "auto") -> int:
    """Working memory of one chunk's attention (`layers.attention.attention_bytes`) on the path
    `attention_path` takes for `queries` tokens: over their own keys (`first`) or over a cache
    of `capacity` positions, with the `attention` path requested (`Kernels.attention`). The
    most of any layer's: layers with a sliding window (`ModelConfig.window_of`) run other
    parts than full ones; attention sinks add their merge's [T, N, D] and [T, N] float32; a
    model module's `mixer_bytes` (a hybrid's DeltaNet layers) counts where it is the larger."""
    c = config
    path = attention_path(c.dtype, c.head_dim, c.n_heads, queries, capacity, first=first,
                          platform=platform, impl=attention)
    module = model_module(c)
    own = getattr(module, "attention_bytes", None)  # a model with its own attention
    if own is not None:
        return own(c, queries, capacity, first=first, fused=path == "cudnn")
    windows = {None} if first else {c.window_of(i) for i in range(c.n_layers)}
    attn = max(attention_bytes(path, np.dtype(c.dtype).itemsize, c.n_heads, queries,
                               queries if first else capacity, c.head_dim, window=w,
                               sinks=c.attention_sinks)
               for w in windows)
    mixers = getattr(module, "mixer_bytes", None)  # other token mixers (a hybrid's DeltaNet)
    return attn if mixers is None else max(attn, mixers(c, queries))


def chunk_bytes(config: ModelConfig, chunk: int, capacity: int, *, first: bool = False,
                platform: str = "cpu", streamed: bool = False, attention: str = "auto",
                dequantized: bool | None = None, parts: int = 1) -> int:
    """Estimated activation bytes of one chunk of `chunk` tokens against a cache of
    `capacity` positions on a `platform` device with the `attention` path requested
    (`Kernels.attention`): the hidden states (input, residual, normalised, [T, H] each), the
    q/k/v projections and attention output in float32 and the parameter dtype, the chunk's
    attention on that path (`layers.attention.attention_bytes`), the router's logits and
    routing, the experts' sorted inputs and outputs ([T*k, H]) and their gate/up activations
    ([T*k, I], float32 and the parameter dtype); `streamed` adds one layer's expert weights
    (the packed ring's outputs). `dequantized`: whether the expert math
    writes a quantized layer out in the parameter dtype before its grouped matmuls (the
    "dequantize" path; a fused kernel does not), adding one layer's experts in that dtype;
    None: for any quantized format (where the path is not known yet). `parts`: each layer's
    experts in that many parts (StreamTuning.parts), the weights fetched and dequantized a
    part at a time."""
    c = config
    it = np.dtype(c.dtype).itemsize
    qkv = chunk * (2 * c.n_heads + 2 * c.n_kv_heads) * c.head_dim * (4 + it)
    attn = attention_working_bytes(c, chunk, capacity, first=first, platform=platform,
                                   attention=attention)
    hidden = 4 * chunk * c.hidden_size * it
    routing = chunk * c.top_k * 8
    per = c.n_experts // parts
    fetched = per * c.expert_bytes if streamed else 0
    if dequantized is None:
        dequantized = c.expert_format != "plain"
    layer = per * c.expert_params * it if dequantized else 0
    return int(qkv + attn + hidden + routing + expert_bytes(c, chunk, parts) + fetched + layer)


def layer_major_bytes(config: ModelConfig, padded: int, sub_chunk: int, capacity: int,
                      expert_rows: int, *, platform: str, attention: str = "auto",
                      parts: int = 1) -> int:
    """Estimated activation bytes of a layer-major read of a prompt padded to `padded` tokens,
    in sub-chunks of `sub_chunk`, over a KV cache of `capacity` positions, whose router and
    experts run on `expert_rows` rows at a time.

    What layer-major holds beyond chunk-major's shared state (weights, KV cache, ring):
      whole prompt, live across a layer's fetch: the hidden states before and after the
        attention block and the normalised router input (3 x [P, H] in the parameter dtype),
        the routing (ids and weights, [P, k] int32 + float32) and positions;
      one sub-chunk's attention against the cache on the path it runs
        (`layers.attention.attention_bytes`: fused, no [N, S, C] scores; XLA, scores and
        probabilities; blocked, one key block's);
      one router/expert call's rows R: the router's logits and scores ([R, E] float32),
        the experts' sorted inputs and outputs ([R*k, H]) and the gate/up activations
        ([R*k, I], float32 and parameter dtype) (`expert_bytes` of a whole layer);
      with the layer in `parts` parts, every call's sorted outputs so far ([P*k, H] in all:
        each part adds its rows to every call's before the next part comes).
    P = padded prompt, S = sub-chunk, C = cache capacity, N = query heads.
    """
    c = config
    it = np.dtype(c.dtype).itemsize
    prompt = padded * (3 * c.hidden_size * it + c.top_k * 8 + 8)
    if parts > 1:
        prompt += padded * c.top_k * c.hidden_size * it
    attn = attention_working_bytes(c, sub_chunk, capacity, first=False, platform=platform,
                                   attention=attention)
    return int(prompt + attn + expert_bytes(c, expert_rows))


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


def choose_chunk(config: ModelConfig, max_context: int, sub_chunk: int | None, have: int,
                 what: str, **kw) -> tuple[int, str]:
    """(chunk, why): the largest chunk (max_context, else a power of two below it, at least
    16) whose activations (CHUNK_HEADROOM x `chunk_bytes`, a later chunk's) and two KV caches
    of the resulting capacity (a session's and the one a chunk writes) fit `have` bytes
    (`what`: where they come from); `kw`: `chunk_memory`'s. `Engine(chunk_size=None)`."""
    candidates = chunk_candidates(max_context)
    for chunk in candidates:
        activations, kv, _ = chunk_memory(config, chunk, max_context, sub_chunk, **kw)
        need = activations + kv
        if need <= have:
            return chunk, (f"auto: {chunk} tokens, about {need / 2**30:.2f} GiB of activations "
                           f"and KV cache within {have / 2**30:.2f} GiB ({what})")
    chunk = candidates[-1]
    return chunk, (f"auto: {chunk} tokens, the smallest chunk; {what} is only "
                   f"{have / 2**30:.2f} GiB")


def chunk_memory(config: ModelConfig, chunk: int, max_context: int,
                 sub_chunk: int | None = None, *, platform: str = "cpu",
                 streamed: bool = False, headroom: float = CHUNK_HEADROOM,
                 attention: str = "auto", dequantized: bool | None = None, parts: int = 1
                 ) -> tuple[int, int, int]:
    """(activations, KV caches, capacity) of a prefill in chunks of `chunk` tokens: what
    `Engine._choose_chunk` compares with the memory it has. Activations: `headroom` x the
    larger `chunk_bytes` of a first and a later chunk; KV caches: two of the capacity (a
    session's and the one a chunk writes), max_context + max(chunk, sub_chunk) positions."""
    capacity = int(max_context) + max(int(chunk), int(sub_chunk or chunk))
    kw = {"platform": platform, "streamed": streamed, "attention": attention,
          "dequantized": dequantized, "parts": parts}
    activations = headroom * max(chunk_bytes(config, chunk, capacity, **kw),
                                 chunk_bytes(config, chunk, capacity, first=True, **kw))
    return int(activations), 2 * kv_cache_bytes(config, capacity), capacity


def param_bytes(config: ModelConfig, **kw) -> int:
    """Bytes of the model's parameters (`model.param_shapes(config, **kw)`), from shapes only."""
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
               for s in param_shapes(config, **kw).values())


def dense_device_bytes(config: ModelConfig, dense_on: str = "device") -> int:
    """The dense weights' (all but the routed experts') bytes on the device: all of them, or
    with `dense_on` "host" the copies in flight (`engine.dense.host_in_flight_bytes`)."""
    if dense_on == "host":
        return host_in_flight_bytes(config, param_shapes(config, resident_experts=False))
    return param_bytes(config, resident_experts=False)


def weight_bytes(config: ModelConfig, plan=None, platform: str = "cpu",
                 dense_on: str = "device") -> int:
    """Bytes of the weights a prefill's `platform` device holds: every parameter when nothing
    streams (`plan` None); streamed by `plan` (stream.plan_stream), on the GPU the dense
    weights and the residents (the ring is the native engine's own allocation), on the CPU
    every parameter and the simulated ring. On the GPU the dense weights are
    `dense_device_bytes(config, dense_on)`."""
    dense = (dense_device_bytes(config, dense_on) if platform == "gpu"
             else param_bytes(config, resident_experts=False))
    if plan is None:
        return dense + config.expert_bytes_total
    if platform == "gpu":
        return dense + plan.resident_bytes
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
    return (f"the streamed plan takes {size(extra)} more than every expert resident: a "
            f"streamed engine reads each layer from a ring frame of all {E} of its experts, "
            f"its residents copied in, so the ring ({size(plan.ring_bytes)}) comes on top of "
            f"{per} of {E} experts per layer resident; --no-stream (every expert resident) "
            f"needs less, or {way} to stay within it")


def memory_plan(config, *, max_context: int, resident_gib: float | None = None,
                resident_per_layer: int | None = None, ring_gib: float = 4.0,
                device_bytes: int | None = None, devices: int = 1,
                dense_on: str = "device") -> dict:
    """Bytes on the device and the host for a model streamed with a resident budget.

    The host store (every expert, pinned host RAM) is `host_store_bytes`. The residents and the
    ring are `stream.plan_stream`'s, the plan a NativeStreamer follows, without a profile: a
    resident budget in GiB is spread evenly over the MoE layers (lowest ids), the ring holds two
    layer frames (a layer's experts each) when `ring_gib` allows and at least one; below one,
    frames of each layer's parts (`ring_parts`: the fewest of which two frames fit). A ring
    budget below one expert, which an engine refuses, is reported here as
    `ring_fits_budget: False` with a one-frame ring. Activations and compiler workspace are not
    counted. The ring is whole layer frames (residents copied in) whatever the residents, so
    with nearly every expert resident the streamed plan takes more than every expert
    resident; `streamed_note` then says so and why (else it is None).

    `dense_on`: "device", or "host" (`Engine(dense="host")`): the device then holds only the
    dense copies in flight (`dense_device_bytes`).

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
    if devices < 1 or config.n_experts % devices:
        raise ValueError(f"devices={devices} does not divide the {config.n_experts} experts "
                         f"of a layer; use a device count that divides {config.n_experts}")

    n_moe = len(config.moe_layers)
    dense_all = param_bytes(config, resident_experts=False)
    dense = dense_device_bytes(config, dense_on)
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
        "dense_bytes": dense_all,
        "dense": dense_on,
        "dense_device_bytes": dense,
        "kv_bytes": kv,
        "kv_values_per_position": (kv_cache_bytes(config, 2) - kv_cache_bytes(config, 1))
        // np.dtype(config.dtype).itemsize,
        # A cache of latents (latent attention): the values per-head keys and values would take.
        "kv_values_per_position_per_head": getattr(model_module(config), "expanded_values",
                                                   lambda c: None)(config),
        "max_context": max_context,
        "resident_per_layer": per,
        "resident_bytes": plan.resident_bytes,
        "streamed_per_layer": plan.max_streamed_per_layer,
        "ring_slots": plan.ring,
        "ring_frames": plan.frames,
        "ring_parts": plan.parts,
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
