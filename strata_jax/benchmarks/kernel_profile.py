"""Where a hybrid layer's device time goes, kernel by kernel: each case one jitted call traced
by the profiler, its GPU kernels' durations summed by name.

Cases (Qwen3-Next's shapes by default, bf16, experts resident): the Gated DeltaNet mixer
(layer 0) and the gated attention mixer (layer 3) over a first chunk of `--tokens` and over a
`--chunk` at the end of that prompt (its cache the prefix), and the MoE block (routing, the
grouped matmuls, the shared expert, the combine) at each of `--moe-tokens`. What a prompt cut
into chunks costs over one chunk, per layer kind, is what the later chunks add:
chunks x later - first.

    python -m strata_jax.benchmarks.kernel_profile --tokens 32768 --chunk 8192 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

from strata_jax.benchmarks.common import write_rows


def kernel_totals(fn, args, top: int = 25) -> dict:
    """fn(*args) run twice (compile, warm), then once under `jax.profiler.trace`: the call's
    wall ms, the GPU kernels' summed ms, and the `top` kernel names by summed time (ms, count)."""
    import jax

    from strata_jax.benchmarks.timeline import _events

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory(prefix="strata-profile-") as d:
        with jax.profiler.trace(d):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            wall = (time.perf_counter() - t0) * 1e3
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        events = _events(files[0]) if files else []
    # kernels are the events of the device planes' stream lines ("Stream #..."); the
    # planes' op and module lines repeat them by HLO name
    kernels: dict = {}
    lines: dict = {}
    for plane, line, name, _, dur in events:
        if plane.startswith("/device:"):
            lines[line] = lines.get(line, 0) + dur / 1e6
            if line.startswith("Stream"):
                t, n = kernels.get(name, (0, 0))
                kernels[name] = (t + dur, n + 1)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    hlo = fn.lower(*args).compile().as_text()
    fusions = {name: fusion_summary(hlo, name) for name, _ in ranked[:top]}
    return {"wall_ms": wall, "kernels_ms": sum(t for t, _ in kernels.values()) / 1e6,
            "lines_ms": lines,
            "top": [[name[:100], t / 1e6, n] for name, (t, n) in ranked[:top]],
            "fusions": {name: f for name, f in fusions.items() if f}}


def fusion_summary(hlo: str, kernel: str) -> str | None:
    """What XLA fused into the kernel named `kernel` (the profiler's "fusion_12" is the HLO's
    "fusion.12"), from the compiled module's text: its output shape, its operands and the count
    of each op in its computation; None where `kernel` is no fusion of `hlo`."""
    name = re.escape(re.sub(r"_(\d+)$", r".\1", kernel))
    m = re.search(rf"^\s*(?:ROOT )?%{name} = (\S+) fusion\((.*?)\), kind=\w+, "
                  rf"calls=%([\w.-]+)", hlo, re.M)
    if not m:
        return None
    operands = re.findall(r"%([\w.-]+)", m.group(2))
    body = re.search(rf"^%{re.escape(m.group(3))} .*?\{{\n(.*?)\n\}}", hlo, re.M | re.S)
    ops = collections.Counter(re.findall(r"= \S+ ([a-z][\w-]*)\(", body.group(1) if body
                                         else ""))
    ops.pop("parameter", None)
    return (f"{m.group(1).split('{')[0]} <- {', '.join(operands)}; "
            + ", ".join(f"{op} x{n}" for op, n in ops.most_common(8)))


def profile(preset: str, tokens: int, chunk: int, moe_tokens, tiny: bool = False) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from strata_jax.models import get_preset, init_cache
    from strata_jax.models.hybrid import HybridLayer

    c = get_preset(preset)
    if tiny:
        c = c.scaled(n_experts=8, top_k=2)
    c = c.replace(n_layers=4, max_seq_len=max(c.max_seq_len, tokens))
    cache = init_cache(c, tokens)
    x = (0.5 * jax.random.normal(jax.random.key(0), (tokens, c.hidden_size))).astype(c.dtype)
    rows = []

    def report(row):
        rows.append(row)
        print(f"{row['case']}: wall {row['wall_ms']:.2f} ms, kernels {row['kernels_ms']:.2f} ms",
              flush=True)
        for name, ms, n in row["top"][:12]:
            print(f"    {ms:8.3f} ms  x{n:<5d} {name}", flush=True)
            if name in row["fusions"]:
                print(f"                        {row['fusions'][name][:200]}", flush=True)

    for layer, kind in ((0, "deltanet"), (3, "attention")):
        block = HybridLayer(c, layer, rngs=nnx.Rngs(layer))
        graph, state = nnx.split(block)
        k, v = cache.keys[layer], cache.values[layer]

        def run(state, x, k, v, start, graph=graph):
            pos = jnp.arange(x.shape[0], dtype=jnp.int32) + start
            return nnx.merge(graph, state).attention_block(x, k, v, start, pos)

        fn = jax.jit(run)
        report(dict(case=f"{kind} first {tokens}", tokens=tokens,
                    **kernel_totals(fn, (state, x, k, v, jnp.int32(0)))))
        report(dict(case=f"{kind} {chunk} over {tokens - chunk}", tokens=chunk,
                    **kernel_totals(fn, (state, x[:chunk], k, v, jnp.int32(tokens - chunk)))))
        if kind == "deltanet":
            mlp_graph, mlp_state = nnx.split(block.mlp)
        del block, state
    moe = jax.jit(lambda s, x: nnx.merge(mlp_graph, s)(x))
    for t in moe_tokens:
        xt = jnp.tile(x, (-(-t // tokens), 1))[:t]
        report(dict(case=f"moe {t}", tokens=t, **kernel_totals(moe, (mlp_state, xt))))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-next-80b-a3b")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--moe-tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--tiny", action="store_true", help="scaled-down widths (CPU smoke run)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = profile(a.preset, a.tokens, a.chunk, a.moe_tokens, a.tiny)
    write_rows(a.json, a, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
