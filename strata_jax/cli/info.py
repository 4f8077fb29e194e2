"""`strata-jax info`: JAX's devices, the native library, the measured link bandwidth and a
model's memory plan (memory.memory_plan).
"""

from __future__ import annotations

import json

import jax

from strata_jax import native
from strata_jax.cli.checks import _check_stream_budget
from strata_jax.cli.common import UsageError, _jsonable, _Log, _Model
from strata_jax.devices import device_memory, gib, host_memory, memory_stats, size
from strata_jax.engine import memory


def cmd_info(args, log: _Log) -> int:

    out: dict = {"jax": {"version": jax.__version__, "backend": jax.default_backend()}}
    devices = []
    for d in jax.devices():
        devices.append({"id": d.id, "platform": d.platform, "kind": d.device_kind,
                        "memory_bytes": memory_stats(d).get("bytes_limit")})
    out["devices"] = devices
    try:
        has_cuda = native.has_cuda()
        out["native"] = {"built": True, "cuda": has_cuda}
    except ImportError as e:
        has_cuda = False
        out["native"] = {"built": False, "cuda": False, "error": str(e).splitlines()[0]}
    has_gpu = any(d["platform"] == "gpu" for d in devices)
    link = {"pinned_gbps": None}
    if args.no_measure:
        link["note"] = "not measured: --no-measure"
    elif not (has_gpu and has_cuda):
        link["note"] = ("not measured: no CUDA device" if not has_gpu else
                        "not measured: the native library has no CUDA backend")
    else:
        log("measuring pinned host-to-device bandwidth (256 MiB x 10)")
        try:
            link["pinned_gbps"] = native.measure_h2d(256 * 2**20, 10, pinned=True)
            link["note"] = "pinned host to device, 256 MiB copies, median of 10"
        except RuntimeError as e:
            link["note"] = f"not measured: {str(e).splitlines()[0]}"
    out["link"] = link
    host_total, host_avail = host_memory()
    out["host"] = {"memory_bytes": host_total, "available_bytes": host_avail}

    model = _Model(args)
    if model.config is not None:
        cfg = model.config
        max_context = args.max_context or min(cfg.max_seq_len, 32_768)
        model.fit_context(max_context)
        cfg = model.config
        if max_context > cfg.max_seq_len:
            raise UsageError(f"--max-context {max_context} passes the model's maximum context "
                             f"({cfg.max_seq_len}); use at most {cfg.max_seq_len}")
        platform = "gpu" if has_gpu else "cpu"
        _check_stream_budget(args, cfg, platform)  # what prefill refuses, in its words
        device_bytes, device_what = device_memory(platform)
        try:
            plan = memory.memory_plan(cfg, max_context=max_context,
                                      resident_gib=args.resident_gib,
                                      resident_per_layer=args.resident_per_layer,
                                      ring_gib=args.ring_gib, device_bytes=device_bytes,
                                      devices=args.devices, dense_on=args.dense)
        except ValueError as e:
            raise UsageError(str(e).splitlines()[0]) from None
        plan["device"] = device_what
        plan["model"] = model.summary()
        out["plan"] = plan

    if args.json:
        print(json.dumps(_jsonable(out), sort_keys=True))
        return 0
    print(f"jax {out['jax']['version']}, default backend {out['jax']['backend']}")
    for d in devices:
        mem = gib(d["memory_bytes"]) if d["memory_bytes"] else "memory not reported"
        print(f"  device {d['platform']}:{d['id']} {d['kind']}, {mem}")
    if host_total:
        print(f"  host RAM {gib(host_total)} ({gib(host_avail or 0)} available)")
    nat = out["native"]
    print("native library: " + ("not built: " + nat["error"] if not nat["built"] else
                                "built with CUDA" if nat["cuda"] else "built without CUDA (cpu backend only)"))
    print("link: " + (f"{link['pinned_gbps']:.1f} GB/s ({link['note']})"
                      if link["pinned_gbps"] else link["note"]))
    if "plan" in out:
        p = out["plan"]
        per_head = p.get("kv_values_per_position_per_head")
        print(f"memory plan for {model.describe()[6:]}:")
        print(f"  experts: {size(p['expert_bytes'])} each, {size(p['expert_bytes_per_layer'])} "
              f"per layer, {size(p['expert_bytes_total'])} in all ({p['moe_layers']} MoE layers)"
              " — kept in host RAM")
        print(f"  dense weights {size(p['dense_bytes'])}"
              + ("" if p["dense"] == "device" else
                 f" in host memory, {size(p['dense_device_bytes'])} on the device at a time")
              + f"; KV cache {size(p['kv_bytes'])} for "
              f"{p['max_context']} positions ({p['kv_values_per_position']:,} values a "
              "position over all layers"
              + ("" if per_head is None else
                 f": latents, {per_head / p['kv_values_per_position']:.1f}x fewer than "
                 f"per-head keys and values' {per_head:,}")
              + ")")
        print(f"  resident {p['resident_per_layer']} experts per layer "
              f"({size(p['resident_bytes'])}); {p['streamed_per_layer']} streamed per layer "
              f"through a ring of {p['ring_slots']} slots ({p['ring_frames']} "
              + ("layer " if p["ring_parts"] == 1 else "part ")
              + f"frame{'s' if p['ring_frames'] != 1 else ''}, {size(p['ring_bytes'])}"
              + ("" if p["ring_parts"] == 1 else
                 f"; each layer in {p['ring_parts']} parts of "
                 f"{p['ring_slots'] // p['ring_frames']} experts")
              + ")"
              + ("" if p["ring_fits_budget"] else
                 f" — MORE than --ring-gib {args.ring_gib}: raise it or keep more resident"))
        dev = p["device_memory"]
        print(f"  on the device: {size(p['device_bytes_streamed'])} streamed, "
              f"{size(p['device_bytes_all_resident'])} with every expert resident "
              "(activations not counted)")
        if p["streamed_note"]:
            print(f"  note: {p['streamed_note']}")
        if dev is not None:
            print(f"  {p['device']}: {size(dev)}: streamed plan "
                  f"{'fits' if p['fits_streamed'] else 'does NOT fit'}; all resident "
                  f"{'fits' if p['fits_all_resident'] else 'does not fit'}; up to about "
                  f"{p['max_resident_gib']:.1f} GiB of resident experts fit beside the rest")
        else:
            print(f"  {p['device']}: size unknown")
        if p["devices"] > 1:
            d = p["per_device"]
            fits = ("" if "fits_all_resident" not in d else
                    ": fits" if d["fits_all_resident"] else ": does NOT fit")
            print(f"  over {p['devices']} devices, every expert resident: "
                  f"{d['experts_per_layer']} experts per layer each "
                  f"({size(d['expert_bytes'])} of experts), {size(d['device_bytes_all_resident'])} per "
                  f"device with the dense weights and KV cache replicated{fits}")
            fits = ("" if "fits_streamed" not in d else
                    ": fits" if d["fits_streamed"] else ": does NOT fit")
            print(f"  over {p['devices']} devices, streamed: each device its slice's "
                  f"{d['resident_per_layer']} resident experts per layer "
                  f"({size(d['resident_bytes'])}) and a ring of {d['ring_slots']} slots "
                  f"({d['ring_frames']} frame{'s' if d['ring_frames'] != 1 else ''}, "
                  f"{size(d['ring_bytes'])}), {size(d['device_bytes_streamed'])} per device"
                  f"{fits}; slices {', '.join(f'{lo}..{hi - 1}' for lo, hi in d['expert_slices'])}")
        if host_total:
            fits = p["host_store_bytes"] <= host_total
            print(f"  host store: {size(p['host_store_bytes'])} of experts in {gib(host_total)} "
                  f"of host RAM: {'fits' if fits else 'does NOT fit'}")
    return 0
