"""Multi-head latent attention at one prompt length: a first chunk of `--tokens` tokens
(causal over its own keys, one fused call) against a later chunk of `--chunk` tokens over the
other `--tokens - --chunk` cached positions (its own keys, then the prefix expanded from the
latent cache block by block, each block a fused part, merged by log-sum-exp), with a static
start (a layer-major sub-chunk of a fresh prompt) and a traced one (a chunk-major later
chunk). Also the whole `LatentAttention` layer (projections included) for both.

Throughput counts the attention's own work: 2 x heads x (query, key) pairs x (Dq + Dv), the
causal part's pairs T(T+1)/2; the later chunk's time includes expanding its prefix. Target
(issue 47): the later chunk at least 0.6 of the first chunk's TFLOP/s. bf16, random weights,
medians of `--reps`.

    python -m strata_jax.benchmarks.mla_bench --tokens 32768 --chunk 8192 --json out.json
"""

from __future__ import annotations

import argparse
import sys

from strata_jax.benchmarks.common import median_ms, write_rows


def pairs(queries: int, prefix: int) -> int:
    """(query, key) pairs of a chunk of `queries` over `prefix` cached positions, causal."""
    return queries * prefix + queries * (queries + 1) // 2


def run(preset: str, tokens: int, chunk: int, reps: int, tiny: bool = False) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from strata_jax.layers.attention import attend_first, attention_path
    from strata_jax.layers.mla import LatentAttention
    from strata_jax.models import get_preset, init_cache

    c = get_preset(preset)
    if tiny:
        c = c.scaled(n_experts=8, top_k=2)
    c = c.replace(n_layers=1, n_dense_layers=0, max_seq_len=max(c.max_seq_len, tokens))
    prefix = tokens - chunk
    work = 2 * c.n_heads * (c.head_dim + c.v_head_dim)
    layer = LatentAttention(c, rngs=nnx.Rngs(0), layer=0)
    graph, state = nnx.split(layer)
    cache = init_cache(c, tokens)
    x = (0.5 * jax.random.normal(jax.random.key(0), (tokens, c.hidden_size))).astype(c.dtype)
    positions = jnp.arange(tokens, dtype=jnp.int32)

    def fill(state, x):  # the whole prompt's latents in the cache, as a first chunk leaves it
        m = nnx.merge(graph, state)
        return m(x, cache.keys[0], cache.values[0], 0, positions)[1:]

    latent, rotary = jax.jit(fill)(state, x)

    def attention_first(state, x):
        m = nnx.merge(graph, state)
        q = m._queries(x, positions)
        k, v = m.expand(latent, rotary, q.dtype)
        path = attention_path(q.dtype, c.head_dim, c.n_heads, tokens, tokens, first=True)
        return attend_first(q, k, v, path)

    def attention_later(state, x, start):
        m = nnx.merge(graph, state)
        pos = jnp.arange(chunk, dtype=jnp.int32) + start
        q = m._queries(x, pos)
        k, v = m.expand(jax.lax.dynamic_slice_in_dim(latent, start, chunk),
                        jax.lax.dynamic_slice_in_dim(rotary, start, chunk), q.dtype)
        path = attention_path(q.dtype, c.head_dim, c.n_heads, chunk, tokens, first=False)
        return m._over_cache(q, k, v, latent, rotary, start, path)

    def layer_first(state, x):
        return nnx.merge(graph, state)(x, cache.keys[0], cache.values[0], 0, positions)[0]

    def layer_later(state, x, start):
        pos = jnp.arange(chunk, dtype=jnp.int32) + start
        return nnx.merge(graph, state)(x, latent, rotary, start, pos)[0]

    rows = []
    first_ms = median_ms(jax.jit(attention_first), (state, x), reps)
    rows.append({"what": "attention, first chunk", "queries": tokens, "prefix": 0,
                 "ms": first_ms, "tflops": work * pairs(tokens, 0) / first_ms / 1e9})
    xc = x[prefix:]
    for kind, start, fn in (
            ("static start", prefix, jax.jit(lambda s, x: attention_later(s, x, prefix))),
            ("traced start", jnp.int32(prefix), jax.jit(attention_later))):
        args = (state, xc) if kind == "static start" else (state, xc, start)
        ms = median_ms(fn, args, reps)
        rows.append({"what": f"attention, later chunk ({kind})", "queries": chunk,
                     "prefix": prefix, "ms": ms, "tflops": work * pairs(chunk, prefix) / ms / 1e9})
    rows.append({"what": "layer, first chunk", "queries": tokens, "prefix": 0,
                 "ms": median_ms(jax.jit(layer_first), (state, x), reps)})
    rows.append({"what": "layer, later chunk (traced start)", "queries": chunk, "prefix": prefix,
                 "ms": median_ms(jax.jit(layer_later), (state, xc, jnp.int32(prefix)), reps)})
    for r in rows:
        tf = f", {r['tflops']:7.1f} TFLOP/s" if "tflops" in r else ""
        print(f"{r['what']:38s} {r['queries']:6d} over {r['prefix']:6d}: {r['ms']:9.2f} ms{tf}",
              flush=True)
    ratio = min(r["tflops"] for r in rows[1:3]) / rows[0]["tflops"]
    rows.append({"ratio_later_over_first_tflops": ratio})
    print(f"later chunk / first chunk TFLOP/s: {ratio:.3f}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="deepseek-v3")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="scaled-down widths (CPU smoke run)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not 0 < a.chunk < a.tokens:
        ap.error(f"--chunk {a.chunk} must be within 1..--tokens - 1 ({a.tokens - 1})")
    rows = run(a.preset, a.tokens, a.chunk, a.reps, a.tiny)
    write_rows(a.json, a, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
