"""A hybrid model's two token mixers at one prompt length: one Gated DeltaNet layer against one
gated full-attention layer of the same model (each with its input norm, as a layer reads it),
a first chunk of `--tokens` tokens and a later chunk of `--chunk` tokens over the rest.

Target (issue 46): the DeltaNet layer's prefill at 32K tokens at most half the attention
layer's. Weights are random (the time does not depend on them); bf16; medians of `--reps`.

    python -m strata_jax.benchmarks.hybrid_bench --tokens 32768 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time



def _time(fn, args, reps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def mixers(preset: str, tokens: int, chunk: int, reps: int, tiny: bool = False) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from strata_jax.models import get_preset, init_cache
    from strata_jax.models.hybrid import HybridLayer

    c = get_preset(preset)
    if tiny:
        c = c.scaled(n_experts=8, top_k=2)
    c = c.replace(n_layers=4, max_seq_len=max(c.max_seq_len, tokens))
    rows = []
    cache = init_cache(c, tokens)
    x = (0.5 * jax.random.normal(jax.random.key(0), (tokens, c.hidden_size))).astype(c.dtype)
    positions = jnp.arange(tokens, dtype=jnp.int32)
    for layer, kind in ((0, "gated-deltanet"), (3, "gated-attention")):
        block = HybridLayer(c, layer, rngs=nnx.Rngs(layer))
        graph, state = nnx.split(block)

        def first(state, x, k, v, graph=graph):
            m = nnx.merge(graph, state)
            return m.attention_block(x, k, v, 0, positions)

        def later(state, x, k, v, start, graph=graph):
            m = nnx.merge(graph, state)
            pos = jnp.arange(chunk, dtype=jnp.int32) + start
            return m.attention_block(x, k, v, start, pos)

        k, v = cache.keys[layer], cache.values[layer]
        ms = _time(jax.jit(first), (state, x, k, v), reps)
        start = jnp.int32(tokens - chunk)
        ms_later = _time(jax.jit(later), (state, x[:chunk], k, v, start), reps)
        rows.append({"mixer": kind, "layer": layer, "tokens": tokens, "first_chunk_ms": ms,
                     "chunk": chunk, "later_chunk_ms": ms_later})
        print(f"{kind:16s} {tokens} tokens, first chunk {ms:8.2f} ms; a {chunk}-token chunk "
              f"over {tokens - chunk}: {ms_later:8.2f} ms", flush=True)
    rows += delta_rule_blocks(c, tokens, reps)
    rows.append({"ratio_deltanet_over_attention": rows[0]["first_chunk_ms"]
                 / rows[1]["first_chunk_ms"]})
    print(f"DeltaNet / attention at {tokens}: {rows[-1]['ratio_deltanet_over_attention']:.3f}")
    return rows


def delta_rule_blocks(c, tokens: int, reps: int, blocks=(32, 64, 128)) -> list[dict]:
    """The chunkwise delta rule alone (float32, the layer's shapes) at several block sizes, and
    its parallel part (`block_terms`) and that part's triangular solve alone."""
    import jax
    import jax.numpy as jnp
    from jax.scipy.linalg import solve_triangular

    from strata_jax.layers.deltanet import block_terms, gated_delta_rule

    hv, dk, dv = c.linear_v_heads, c.linear_k_dim, c.linear_v_dim
    keys = jax.random.split(jax.random.key(1), 5)
    unit = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(keys[0], (tokens, hv, dk))) * dk ** -0.5
    k = unit(jax.random.normal(keys[1], (tokens, hv, dk)))
    v = jax.random.normal(keys[2], (tokens, hv, dv))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (tokens, hv)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (tokens, hv)))
    state = jnp.zeros((hv, dk, dv), jnp.float32)
    rows = []
    for b in blocks:
        fn = jax.jit(lambda *a, b=b: gated_delta_rule(*a, block=b))
        ms = _time(fn, (q, k, v, g, beta, state), reps)
        rows.append({"delta_rule_block": b, "tokens": tokens, "ms": ms})
        print(f"delta rule alone, blocks of {b:4d}: {ms:8.2f} ms", flush=True)
    for b in (64, 128):
        fn = jax.jit(lambda *a, b=b: block_terms(*a, block=b))
        ms = _time(fn, (q, k, v, g, beta), reps)
        system = jnp.tril(jax.random.normal(keys[0], (hv, tokens // b, b, b)) * 0.1, -1)
        rhs = jax.random.normal(keys[1], (hv, tokens // b, b, dk + dv))
        solve = jax.jit(lambda s, r: solve_triangular(s, r, lower=True, unit_diagonal=True))
        ms_solve = _time(solve, (system, rhs), reps)
        rows.append({"block_terms_block": b, "tokens": tokens, "ms": ms, "solve_ms": ms_solve})
        print(f"the parallel part alone, blocks of {b:4d}: {ms:8.2f} ms (its solve "
              f"{ms_solve:.2f} ms)", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-next-80b-a3b")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="scaled-down widths (CPU smoke run)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = mixers(a.preset, a.tokens, a.chunk, a.reps, a.tiny)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
