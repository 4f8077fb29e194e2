"""How long the host takes to return from a compiled call once the device's work is done.

A jitted program runs --ms of matmuls, then a host callback stamps the host's clock (the callback
runs once the device reached it), then one tiny op gives the output. Per way of waiting for the
output, the median time from the stamp to the wait's return over --reps calls:

    block      out.block_until_ready()
    numpy      numpy.asarray(out)
    spin       while not out.is_ready(): pass   (then numpy.asarray)
    pinned     the output placed in the device's pinned host memory by the program, numpy.asarray

each with the engine's argument count (--args small device arrays, kept though unused) and
with one argument. With --schedules the whole probe runs again in a child process per CUDA
context schedule (TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE: spin, yield, blocking_sync; unset is
CUDA's automatic choice), which must be set before the backend starts.

    python -m strata_jax.benchmarks.wake_probe --schedules --json out/wake.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SCHEDULES = ("spin", "yield", "blocking_sync")
WAITS = ("block", "numpy", "spin", "pinned")


def probe(ms: float, n_args: int, reps: int, n: int = 4096) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import io_callback

    dev = jax.devices()[0]
    on_dev = jax.sharding.SingleDeviceSharding(dev)
    kinds = {m.kind for m in dev.addressable_memories()}
    pinned = (jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
              if "pinned_host" in kinds else None)
    stamps: list[float] = []

    def stamp(v):
        stamps.append(time.perf_counter())
        return v

    x = jax.device_put(jnp.ones((n, n), jnp.bfloat16) * 0.01, on_dev)

    def make(iters: int, out_sharding):
        def body(x, *state):
            y = jax.lax.fori_loop(0, iters, lambda i, y: jnp.tanh(y @ x), x)
            s = io_callback(stamp, jax.ShapeDtypeStruct((), jnp.float32),
                            y[0, 0].astype(jnp.float32))
            return s + 1.0
        return jax.jit(body, keep_unused=True, out_shardings=out_sharding)

    # iterations for about `ms` of device time, from one timed run
    f1 = make(1, on_dev)
    np.asarray(f1(x))
    t = time.perf_counter()
    np.asarray(f1(x))
    one = max((time.perf_counter() - t) * 1e3, 1e-3)
    iters = max(1, int(ms / one))
    out = {"iters": iters, "one_iter_ms": one, "rows": []}
    for args in sorted({1, n_args}):
        state = [jax.device_put(jnp.full((256,), i, jnp.float32), on_dev)
                 for i in range(args - 1)]
        fns = {"dev": make(iters, on_dev)}
        if pinned is not None:
            fns["pinned"] = make(iters, pinned)
        for w in WAITS:
            f = fns.get("pinned" if w == "pinned" else "dev")
            if f is None:  # no pinned host memory on this device
                continue
            np.asarray(f(x, *state))  # compile and warm
            lat, wall = [], []
            for _ in range(reps):
                stamps.clear()
                t0 = time.perf_counter()
                r = f(x, *state)
                if w == "block":
                    r.block_until_ready()
                elif w == "spin":
                    while not r.is_ready():
                        pass
                    np.asarray(r)
                else:
                    np.asarray(r)
                t1 = time.perf_counter()
                lat.append((t1 - stamps[-1]) * 1e3)
                wall.append((t1 - t0) * 1e3)
            out["rows"].append({"args": args, "wait": w,
                                "after_device_ms": statistics.median(lat),
                                "after_device_min_ms": min(lat),
                                "after_device_max_ms": max(lat),
                                "wall_ms": statistics.median(wall)})
            r = out["rows"][-1]
            print(f"  args {args:4d} {w:7s} after device: median {r['after_device_ms']:.3f} ms "
                  f"(min {r['after_device_min_ms']:.3f}, max {r['after_device_max_ms']:.3f}); "
                  f"wall {r['wall_ms']:.2f} ms", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", type=float, default=20.0, help="device work a call (about)")
    ap.add_argument("--args", type=int, default=300)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--size", type=int, default=4096, help="the matmuls' square size")
    ap.add_argument("--schedules", action="store_true",
                    help="also each CUDA context schedule, in a child process each")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    sched = os.environ.get("TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE", "auto")
    print(f"schedule {sched}:", flush=True)
    results = {sched: probe(args.ms, args.args, args.reps, args.size)}
    if args.schedules:
        for s in SCHEDULES:
            cmd = [sys.executable, "-m", "strata_jax.benchmarks.wake_probe", "--ms", str(args.ms),
                   "--args", str(args.args), "--reps", str(args.reps), "--size",
                   str(args.size), "--json", "-"]
            env = dict(os.environ, TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE=s)
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            sys.stdout.write(p.stdout.split("\n@@JSON@@\n")[0] + "\n")
            if p.returncode != 0:
                sys.stdout.write(p.stderr[-2000:])
                continue
            results.update(json.loads(p.stdout.split("\n@@JSON@@\n")[1]))
    if args.json == "-":
        print("\n@@JSON@@\n" + json.dumps(results))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
