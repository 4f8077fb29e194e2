"""How a compiled call's small per-call input (a chunk's token ids) should reach the device.

A jitted program with the engine's argument count (--args device arrays) and a fresh int32
input of --ids elements, called back to back; per way of passing the ids, the median time from
the call to its return (dispatch) and to the result being ready (the program is a few tiny
kernels, so this is the host's latency around it):

    numpy        the ids as a numpy array (the compiled call copies them; Engine does this)
    device_put   jax.device_put to the device first, inside the timing
    pinned_host  jax.device_put to the device's pinned host memory, inside the timing; the
                 program copies them to the device itself

    python -m strata_jax.benchmarks.dispatch_probe --json out/dispatch.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--args", type=int, default=80)
    ap.add_argument("--ids", type=int, default=6146)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    on_dev = jax.sharding.SingleDeviceSharding(dev)
    kinds = {m.kind for m in dev.addressable_memories()}
    pinned = (jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
              if "pinned_host" in kinds else None)
    state = [jax.device_put(jnp.full((256,), i, jnp.float32), on_dev) for i in range(args.args)]

    def body(state, ids):
        return sum(s[0] for s in state) + ids.astype(jnp.float32).sum()

    def body_host(state, ids):
        return body(state, jax.device_put(ids, on_dev))

    plain = jax.jit(body)
    host = jax.jit(body_host, out_shardings=on_dev)
    rng = np.random.default_rng(0)
    ways = {
        "numpy": lambda ids: plain(state, ids),
        "device_put": lambda ids: plain(state, jax.device_put(ids, on_dev)),
    }
    if pinned is not None:
        ways["pinned_host"] = lambda ids: host(state, jax.device_put(ids, pinned))
    out = {"machine": str(dev.device_kind), "jax": jax.__version__, "args": args.args,
           "ids": args.ids, "reps": args.reps, "ways": {}}
    for name, fn in ways.items():
        ids = rng.integers(0, 1000, args.ids).astype(np.int32)
        got = float(fn(ids))  # compile, and check the result
        ref = float(sum(range(args.args)) + ids.astype(np.float64).sum())
        if abs(got - ref) > 1e-3 * abs(ref):
            raise SystemExit(f"{name}: result {got} != {ref}")
        disp, ready = [], []
        for _ in range(args.reps):
            ids = rng.integers(0, 1000, args.ids).astype(np.int32)
            gc.collect()
            t0 = time.perf_counter()
            r = fn(ids)
            t1 = time.perf_counter()
            r.block_until_ready()
            t2 = time.perf_counter()
            disp.append((t1 - t0) * 1e3)
            ready.append((t2 - t0) * 1e3)
        out["ways"][name] = {"dispatch_ms": statistics.median(disp),
                             "ready_ms": statistics.median(ready),
                             "ready_p10_ms": sorted(ready)[len(ready) // 10],
                             "ready_p90_ms": sorted(ready)[9 * len(ready) // 10]}
        print(name, json.dumps(out["ways"][name]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
