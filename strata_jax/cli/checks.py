"""The refusals before any work: the resident and ring budgets and kernel choices that would do
nothing (`_check_budget`, `_check_stream_budget`, `_check_kernel_options`: prefill, profile and
info refuse the same ones in the same words) and
the memory plan of a prefill (`_check_plan`: the estimates of strata_jax/engine/memory.py
against the memory of the device it will run on), each a UsageError.
"""

from __future__ import annotations

from strata_jax.cli.common import UsageError, _Model
from strata_jax.devices import device_memory, gib, host_memory
from strata_jax.engine import memory
from strata_jax.stream import plan_stream


def _check_budget(args, model: _Model, backend: str) -> None:
    cfg = model.config
    _check_kernel_options(args, cfg)
    if not args.stream and (args.resident_gib is not None or args.resident_per_layer is not None
                            or args.profile):
        raise UsageError("--no-stream keeps every expert resident; --resident-gib, "
                         "--resident-per-layer and --profile apply to a streamed run")
    _check_stream_budget(args, cfg, "gpu" if backend == "cuda" else "cpu")


def _check_stream_budget(args, cfg, platform: str) -> None:
    """--ring-gib, --resident-per-layer and --resident-gib as `prefill`, `profile` and `info`
    all refuse them; a resident budget is checked against the memory of the `platform` device
    ("gpu" or "cpu": host RAM, the cpu backend's simulated device)."""
    if args.ring_gib <= 0:
        raise UsageError(f"--ring-gib {args.ring_gib}: the ring needs a positive budget")
    devices = getattr(args, "devices", 1)
    per = cfg.n_experts // devices if devices > 1 and cfg.n_experts % devices == 0 \
        else cfg.n_experts
    if args.resident_per_layer is not None and args.resident_per_layer > per:
        where = (f" on each of the {devices} devices (its slice)" if per != cfg.n_experts
                 else "")
        raise UsageError(f"--resident-per-layer {args.resident_per_layer} exceeds the "
                         f"{per} experts of a layer{where}; use 0..{per}")
    if args.resident_gib is not None:
        if args.resident_gib < 0:
            raise UsageError(f"--resident-gib {args.resident_gib}: a budget must be 0 or more")
        limit, what = device_memory(platform)
        if limit is not None and args.resident_gib * 2**30 > limit:
            raise UsageError(f"--resident-gib {args.resident_gib} is more than the device has "
                             f"({gib(limit)} of {what}); use a smaller budget")


def _check_kernel_options(args, cfg) -> None:
    """Kernel choices that would do nothing for this model are refused by name."""
    if args.delta_rule != "auto" and "linear_attention" not in getattr(cfg, "mixers", ()):
        raise UsageError(f"--delta-rule {args.delta_rule}: this model has no Gated DeltaNet "
                         "layers (Qwen3-Next / Qwen3.5-MoE hybrids have); leave it out")
    if args.quantized_matmul != "auto" and cfg.expert_format == "plain":
        raise UsageError(f"--quantized-matmul {args.quantized_matmul}: the experts are not "
                         "quantized (--quantize or a quantized checkpoint); leave it out")


def _check_plan(model: _Model, *, max_context: int, n_tokens: int, chunk: int | None,
                sub_chunk: int | None, backend: str, stream, devices: int = 1,
                dequantized: bool | None = None, dense_on: str = "device") -> None:
    """UsageError when the prefill cannot fit the memory of the device it will run on: its
    two KV caches and the activations of its smallest chunk (memory.chunk_memory, the
    estimate an Engine chooses its chunk by; `chunk`, else the smallest an automatic choice
    can take), `n_tokens` token ids and the weights that device holds. Checked before any
    weights exist or anything is allocated; arithmetic only.

    The device: the GPU (`backend` "cuda": its memory limit, none of this run's yet; the
    weights there are the dense ones and the residents, or every one with `stream` None;
    the ring is the native engine's own allocation, outside that limit) or the CPU (available
    host RAM; the weights there are all of them, and a streamed run's simulated ring).

    `devices` > 1 (expert parallel): each GPU holds the dense weights, the KV caches, the
    activations and 1/devices of the experts (every expert resident), or streamed its slice's
    residents (`plan_stream(devices=)`); the CPU's simulated devices share its RAM, so it
    holds `devices` copies of all but the experts (streamed: the host store once, each
    device's residents and simulated ring).

    `dequantized`: whether quantized experts are read by the dequantize path (a layer in the
    parameter dtype a chunk); None counts that layer for any quantized format. `dense_on`:
    --dense (on the GPU "host" counts the dense copies in flight).
    """

    cfg = model.config
    platform = "gpu" if backend == "cuda" else "cpu"
    if platform == "gpu":
        have, what = device_memory("gpu")
    else:
        have, what = host_memory()[1], "host RAM"
    if have is None:
        return

    plan = None
    if stream is not None:
        try:
            plan = plan_stream(cfg, stream, check_ring_budget=False)
        except ValueError as e:
            raise UsageError(str(e).splitlines()[0]) from None
    weights = memory.weight_bytes(cfg, plan, platform, dense_on)
    copies = 1
    if devices > 1:
        if cfg.n_experts % devices:
            raise UsageError(f"--devices {devices}: the {cfg.n_experts} experts of a layer do "
                             f"not split evenly over {devices} devices; use a count that "
                             f"divides {cfg.n_experts}")
        dense = memory.param_bytes(cfg, resident_experts=False)
        copies = devices if platform == "cpu" else 1
        if stream is None:
            weights = copies * dense + cfg.expert_bytes_total // (1 if copies > 1 else devices)
        else:
            try:
                local = plan_stream(cfg, stream, check_ring_budget=False, devices=devices)
            except ValueError as e:
                raise UsageError(str(e).splitlines()[0]) from None
            weights = (dense + local.resident_bytes if platform == "gpu" else
                       copies * dense + cfg.expert_bytes_total
                       + devices * (local.resident_bytes + local.ring_bytes))

    def need(context: int) -> tuple[int, int, int, int, int]:
        """(bytes in all, activations, KV caches, their capacity, chunk) for `context`."""
        total, act, kv, cap, c = memory.prefill_bytes(
            cfg, weights, context, max_context=max_context, n_tokens=n_tokens, chunk=chunk,
            sub_chunk=sub_chunk, platform=platform, streamed=stream is not None,
            dequantized=dequantized)
        return total + (copies - 1) * (total - weights), act, kv, cap, c

    total, act, kv, cap, c = need(max_context)
    if total <= have:
        return
    lo = memory.most_that_fits(lambda context: need(context)[0] <= have, max_context)
    way = (f"use fewer tokens or a smaller --max-context (about {lo} positions fit)" if lo else
           "not one position fits beside the weights; use a smaller model"
           + (" or fewer resident experts" if stream is not None and platform == "gpu" else ""))
    if platform == "gpu" and dense_on == "device" and devices == 1:
        on_host = memory.weight_bytes(cfg, plan, platform, "host")
        if total - weights + on_host <= have:
            way = (f"--dense host fits (the dense weights in host memory, {gib(on_host)} of "
                   f"weights on the device at a time); or {way}")
    raise UsageError(
        f"this prefill needs about {gib(total)} of {what} and {gib(have)} is available: "
        f"KV cache {gib(kv)} (2 copies of {cap} positions: a context of {max_context} and "
        f"a chunk's slack), activations of a {c}-token chunk {gib(act)}, token ids "
        f"{gib(n_tokens * memory.TOKEN_ID_BYTES)}, weights {gib(weights)}; {way}")
