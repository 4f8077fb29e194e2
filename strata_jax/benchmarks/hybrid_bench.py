"""A hybrid model's two token mixers at one prompt length: one Gated DeltaNet layer against one
gated full-attention layer of the same model (each with its input norm, as a layer reads it),
a first chunk of `--tokens` tokens and a later chunk of `--chunk` tokens over the rest; the
DeltaNet layer's projections alone, and the delta rule's variants and pieces.

Target (issue 46): the DeltaNet layer's prefill at 32K tokens at most half the attention
layer's. Weights are random (the time does not depend on them); bf16; medians of `--reps`.

    python -m strata_jax.benchmarks.hybrid_bench --tokens 32768 --json out.json
"""

from __future__ import annotations

import argparse
import sys

from strata_jax.benchmarks.common import median_ms, write_rows

# The Pallas rule's launches timed in blocks of 64 at Qwen3-Next's head sizes (`compile_check`
# says which spill): the walk's (state columns, warps, stages), the transform's warps.
PALLAS_LAUNCHES = ((16, 4, 1), (16, 4, 2), (32, 4, 1), (32, 4, 2), (32, 8, 2), (64, 8, 2))
TRANSFORM_LAUNCHES = (4, 8)


def mixers(preset: str, tokens: int, chunk: int, reps: int, tiny: bool = False,
           rule: bool = True) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from strata_jax.models import get_preset, init_cache
    from strata_jax.kernels import Kernels
    from strata_jax.models.hybrid import HybridLayer

    c = get_preset(preset)
    if tiny:
        c = c.scaled(n_experts=8, top_k=2)
    c = c.replace(n_layers=4, max_seq_len=max(c.max_seq_len, tokens))
    rows = []
    cache = init_cache(c, tokens)
    x = (0.5 * jax.random.normal(jax.random.key(0), (tokens, c.hidden_size))).astype(c.dtype)
    positions = jnp.arange(tokens, dtype=jnp.int32)
    for layer, kind, kernels in ((3, "gated-attention", Kernels()),
                                 (0, "gated-deltanet (scan)", Kernels(delta_rule="xla")),
                                 (0, "gated-deltanet (pallas)", Kernels(delta_rule="pallas"))):
        block = HybridLayer(c, layer, rngs=nnx.Rngs(layer), kernels=kernels)
        graph, state = nnx.split(block)

        def first(state, x, k, v, graph=graph):
            m = nnx.merge(graph, state)
            return m.attention_block(x, k, v, 0, positions)

        def later(state, x, k, v, start, graph=graph):
            m = nnx.merge(graph, state)
            pos = jnp.arange(chunk, dtype=jnp.int32) + start
            return m.attention_block(x, k, v, start, pos)

        k, v = cache.keys[layer], cache.values[layer]
        ms = median_ms(jax.jit(first), (state, x, k, v), reps)
        start = jnp.int32(tokens - chunk)
        ms_later = median_ms(jax.jit(later), (state, x[:chunk], k, v, start), reps)
        rows.append({"mixer": kind, "delta_rule": kernels.delta_rule, "layer": layer,
                     "tokens": tokens, "first_chunk_ms": ms,
                     "chunk": chunk, "later_chunk_ms": ms_later})
        print(f"{kind:29s} {tokens} tokens, first chunk {ms:8.2f} ms; a {chunk}-token chunk "
              f"over {tokens - chunk}: {ms_later:8.2f} ms", flush=True)
    attention = rows[0]["first_chunk_ms"]
    for row in rows[1:]:
        row["over_attention"] = row["first_chunk_ms"] / attention
        print(f"{row['mixer']} / attention at {tokens}: {row['over_attention']:.3f}")
    rows.append(_projections(block.linear_attn, x, tokens, reps))  # the loop's last: DeltaNet
    if rule:
        rows += delta_rule_blocks(c, tokens, reps)
    return rows


def _projections(net, x, tokens: int, reps: int) -> dict:
    """The Gated DeltaNet layer's three projections alone (in_proj, in_gates, out_proj, as the
    layer multiplies them): what the layer spends outside the rule, its conv and its norms."""
    import jax
    import jax.numpy as jnp

    from strata_jax.layers.params import dot

    o = jnp.ones((tokens, net.v_heads * net.v_dim), x.dtype)
    fn = jax.jit(lambda x, o, w_in, w_gates, w_out: (dot(x, w_in), dot(x, w_gates),
                                                     dot(o, w_out)))
    ms = median_ms(fn, (x, o, net.in_proj[...], net.in_gates[...], net.out_proj[...]), reps)
    print(f"gated-deltanet's projections alone, {tokens} tokens: {ms:8.2f} ms", flush=True)
    return {"deltanet_projections_ms": ms, "tokens": tokens}


def delta_rule_blocks(c, tokens: int, reps: int, kernels_only: bool = False) -> list[dict]:
    """The chunkwise delta rule alone (the layer's shapes): the scan and the Pallas kernels
    with float32 products; on a GPU with bf16 products (a bf16 layer's kernels) the scan, and
    the kernels in blocks of 32 and 64; the scan's parallel part and its transform
    (`_scan_parts`); each of the two kernels alone; the kernels at `PALLAS_LAUNCHES` and
    `TRANSFORM_LAUNCHES`. `kernels_only`: the last two alone."""
    import jax
    import jax.numpy as jnp

    from strata_jax.kernels.delta_rule import (block_cumsums, operand_dtype, ut_transform,
                                               walk_blocks)
    from strata_jax.layers.deltanet import gated_delta_rule
    from strata_jax.testing import delta_rule_inputs

    hv, dk, dv = c.linear_v_heads, c.linear_k_dim, c.linear_v_dim
    q, k, v, g, beta, state = (jnp.asarray(a, jnp.float32) for a in delta_rule_inputs(
        tokens, hv, dk, dv, seed=1, state_scale=0.0))
    rows = []
    gpu = jax.default_backend() == "gpu"
    products_here = ("float32", "bf16") if gpu else ("float32",)  # bf16 kernels: a GPU's
    cases = [] if kernels_only else [("float32", "xla", 64, 1), ("float32", "pallas", 64, None)]
    if gpu and not kernels_only:  # the scan's loop walking 1, 4 or 16 blocks a step
        cases += [("float32", "xla", 64, 4), ("float32", "xla", 64, 16), ("bf16", "xla", 64, 1),
                  ("bf16", "pallas", 32, None), ("bf16", "pallas", 64, None)]
    for products, carry, b, unroll in cases:
        fn = jax.jit(lambda *a, b=b, carry=carry, products=products, unroll=unroll:
                     gated_delta_rule(*a, block=b, carry=carry, products=products, unroll=unroll))
        ms = median_ms(fn, (q, k, v, g, beta, state), reps)
        rows.append({"delta_rule_block": b, "products": products, "carry": carry,
                     "unroll": unroll, "tokens": tokens, "ms": ms})
        steps = f", {unroll:2d} blocks a step" if unroll else ""
        print(f"delta rule alone, blocks of {b:4d}, {products:7s} products, {carry:6s}{steps}: "
              f"{ms:8.2f} ms", flush=True)
    b = 64
    for products in () if kernels_only else products_here:
        rows.append(_scan_parts(c, q, k, v, g, beta, b, products, tokens, reps))
    gam, last = block_cumsums(g, b)
    for products in products_here:
        op = operand_dtype(products)
        qo, ko, vo = (a.astype(op) for a in (q, k, v))
        fn = jax.jit(lambda *a, products=products: ut_transform(*a, block=b, products=products))
        ms = median_ms(fn, (ko, vo, gam, beta), reps)
        w, u = fn(ko, vo, gam, beta)
        walk = jax.jit(lambda *a, products=products: walk_blocks(
            *a, block=b, products=products, out_dtype=op))
        ms_walk = median_ms(walk, (qo, ko, w, u, gam, last, state), reps)
        rows.append({"ut_transform_block": b, "products": products, "tokens": tokens, "ms": ms,
                     "walk_ms": ms_walk})
        print(f"the Pallas kernels alone, blocks of {b}, {products:7s}: UT transform {ms:.2f} "
              f"ms, walk with the outputs {ms_walk:.2f} ms", flush=True)
    if gpu:
        rows += _launches((q, k, v.astype(jnp.bfloat16), g, beta, state), b, tokens, reps)
    return rows


def _scan_parts(c, q, k, v, g, beta, b, products, tokens, reps) -> dict:
    """The scan's parallel part (`block_terms`) and its transform alone (the inverse by
    doubling, then a matmul; against a triangular solve of the dk + dv columns)."""
    import jax
    import jax.numpy as jnp
    from jax.scipy.linalg import solve_triangular

    from strata_jax.layers.deltanet import _mm, block_terms, unit_lower_inverse

    hv, dk, dv = c.linear_v_heads, c.linear_k_dim, c.linear_v_dim
    keys = jax.random.split(jax.random.key(1), 2)
    system = jnp.eye(b) + jnp.tril(jax.random.normal(keys[0], (hv, tokens // b, b, b)) * 0.1, -1)
    rhs = jax.random.normal(keys[1], (hv, tokens // b, b, dk + dv))
    solve = lambda s, r: solve_triangular(s, r, lower=True, unit_diagonal=True)  # noqa: E731
    ms_columns = median_ms(jax.jit(solve), (system, rhs), reps)
    fn = jax.jit(lambda *a: block_terms(*a, block=b, products=products))
    ms = median_ms(fn, (q, k, v, g, beta), reps)
    inverse = jax.jit(lambda s, r: _mm(unit_lower_inverse(s), r, products))
    ms_inverse = median_ms(inverse, (system, rhs), reps)
    print(f"the parallel part alone, blocks of {b}, {products:7s}: {ms:8.2f} ms (its "
          f"transform {ms_inverse:.2f} ms; solved for the {dk + dv} columns "
          f"{ms_columns:.2f} ms)", flush=True)
    return {"block_terms_block": b, "products": products, "tokens": tokens, "ms": ms,
            "solve_inverse_ms": ms_inverse, "solve_columns_ms": ms_columns}


def _launches(args, block, tokens, reps) -> list[dict]:
    """`delta_rule_chunk` with bf16 products timed at each walk launch (bv, warps, stages) of
    `PALLAS_LAUNCHES` and each of the transform's `TRANSFORM_LAUNCHES` (the other kernel at its
    default); a launch Triton refuses is printed and skipped."""
    import jax
    import jax.numpy as jnp

    from strata_jax.kernels.delta_rule import delta_rule_chunk

    rows = []
    for tw, (bv, warps, stages) in ([(None, launch) for launch in PALLAS_LAUNCHES]
                                    + [(w, (None, None, None)) for w in TRANSFORM_LAUNCHES]):
        fn = jax.jit(lambda *a, tw=tw, bv=bv, warps=warps, stages=stages: delta_rule_chunk(
            *a, block=block, products="bf16", transform_warps=tw, bv=bv, num_warps=warps,
            num_stages=stages, out_dtype=jnp.bfloat16))
        what = (f"the transform at {tw} warps" if tw else
                f"{bv} columns, {warps} warps, {stages} stages")
        try:
            ms = median_ms(fn, args, reps)
        except Exception as e:  # a launch shape Triton refuses: recorded, not fatal
            print(f"the Pallas rule, {what}: failed: {str(e)[:200]}", flush=True)
            continue
        rows.append({"pallas_block": block, "products": "bf16", "transform_warps": tw,
                     "bv": bv, "num_warps": warps,
                     "num_stages": stages, "tokens": tokens, "ms": ms})
        print(f"the Pallas rule (bf16), blocks of {block}, {what}: {ms:8.2f} ms", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-next-80b-a3b")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="scaled-down widths (CPU smoke run)")
    ap.add_argument("--kernels-only", action="store_true",
                    help="the Pallas rule's kernels and launches alone (no mixers, no scan)")
    ap.add_argument("--mixers-only", action="store_true",
                    help="the two mixers and the projections (not the rule alone)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.kernels_only:
        from strata_jax.models import get_preset  # jax loads only once the arguments parse

        rows = delta_rule_blocks(get_preset(a.preset), a.tokens, a.reps, kernels_only=True)
    else:
        rows = mixers(a.preset, a.tokens, a.chunk, a.reps, a.tiny, rule=not a.mixers_only)
    write_rows(a.json, a, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
