"""The chunkwise gated delta rule in Pallas (Triton) kernels (`Kernels.delta_rule="pallas"`).

`layers.deltanet.gated_delta_rule` folds each block of C tokens into matmuls that need only the
state S before the block; what stays sequential is the state's walk over the blocks. Per block
i and value head, with T_i the block's UT transform (`ut_transform`), gam the log-decay from
the block's start (a cumulative sum within the block) and last_i its total:

    w_i = T_i (beta exp(gam) k),  u_i = T_i (beta v)     (every block in parallel)
    new_i = u_i - w_i S                                   (the block's new values)
    o_i   = exp(gam) q S + (q k^T * decay) new_i          (decay_ts = exp(gam_t - gam_s), s <= t)
    S     = exp(last_i) S + (k exp(last_i - gam))^T new_i

`delta_rule_chunk` runs this as two kernels over the tokens-first layout ([T, heads, d], key
heads read in place: no transposes, no repeated heads): `ut_transform` (a program per value head
and block: the block's triangular system inverted by doubling, then w and u) and the walk (a
program per value head and slice of state columns, holding its [dk, bv] part of the state in
registers: the columns are independent; each block's outputs computed as it passes).

Products ("bf16", a bf16/fp16 layer's on a GPU, `layers.deltanet.products_for`): bf16 operands
(q, k, w, u, the state and the new values rounded to bf16 for each product, as the public fla
kernels take them) with float32 sums, the state float32 across blocks, and the inverse at TF32
(tensor cores); or "float32" (Triton's "ieee": CUDA-core products, for float32 layers and
tests). Decays between two tokens of a block are differences of the block's cumulative sums:
where the sums reach hundreds their float32 rounding moves a decay by ~1e-5 of itself, inside
float32's tolerance of the float64 recurrence (tests) and far under bf16's rounding. The
launches are sized so no kernel spills registers on Hopper at the real head sizes
(`benchmarks.compile_check`). On the CPU the kernels run in Pallas' interpret mode (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from strata_jax.kernels import DELTA_RULES

__all__ = ["delta_rule_chunk", "ut_transform", "walk_blocks", "block_cumsums", "block_decays",
           "decay_sums", "doubling_step", "iotas", "pad_blocks", "operand_dtype", "KERNEL_BLOCKS",
           "TRANSFORM_WARPS", "WALK_COLUMNS", "WALK_WARPS", "WALK_STAGES", "AUTO_ON_GPU",
           "PRODUCTS"]

# The rule's products: "float32" (full float32) or "bf16" (bf16 operands, float32 sums).
PRODUCTS = ("float32", "bf16")

# What "auto" runs on a GPU, by the layer's products (`layers.deltanet.products_for`): the
# kernels for bf16 products (a bf16/fp16 layer's), the scan for float32 products, which the
# kernels run on CUDA cores (`hybrid_bench`, BENCHMARKS.md "Hybrid and latent attention").
AUTO_ON_GPU = {"bf16": "pallas", "float32": "xla"}

# The kernels' launch at dk = dv = 128 (Qwen3-Next's), each without spilled registers on
# Hopper (`benchmarks.compile_check`), by the products: tokens a block; the transform's warps
# (at 4, two programs an SM); the walk's state columns a program, warps and pipeline stages
# (32 value heads x 4 slices: 128 programs, one wave; two stages load a block while the one
# before is multiplied), the fastest of `hybrid_bench`'s launches. CUDA-core float32 products
# hold more registers: blocks and slices of 16, 8 warps, one stage.
KERNEL_BLOCKS = {"bf16": 64, "float32": 16}
TRANSFORM_WARPS = {"bf16": 4, "float32": 4}
WALK_COLUMNS, WALK_WARPS = {"bf16": 32, "float32": 16}, {"bf16": 4, "float32": 8}
WALK_STAGES = {"bf16": 2, "float32": 1}


def delta_rule_path(impl: str = "auto", platform: str | None = None,
                    products: str = "float32") -> str:
    """The rule's implementation: "xla" (the scan) or "pallas" (`delta_rule_chunk`); auto:
    `AUTO_ON_GPU` for the products on a GPU ("bf16": a bf16/fp16 layer's), "xla" elsewhere."""
    impl = (impl or "auto").lower()
    if impl not in DELTA_RULES:
        raise ValueError(f"delta rule {impl!r}: expected one of {'|'.join(DELTA_RULES)}")
    if products not in PRODUCTS:
        raise ValueError(f"delta rule products {products!r}: expected one of "
                         f"{'|'.join(PRODUCTS)}")
    if impl == "auto":
        platform = platform or jax.default_backend()
        return AUTO_ON_GPU[products] if platform == "gpu" else "xla"
    return impl


def operand_dtype(products: str):
    """The dtype the products' operands take: bf16 for "bf16", float32 for "float32"."""
    if products not in PRODUCTS:
        raise ValueError(f"delta rule products {products!r}: expected one of "
                         f"{'|'.join(PRODUCTS)}")
    return jnp.bfloat16 if products == "bf16" else jnp.float32


def iotas(c: int):
    """Row and column iotas [C, 1] and [1, C] of a C x C block: masks built from them broadcast
    (no [C, C] index arrays held, in a kernel's registers or XLA's buffers)."""
    return (lax.broadcasted_iota(jnp.int32, (c, 1), 0),
            lax.broadcasted_iota(jnp.int32, (1, c), 1))


def decay_sums(g, precision=lax.Precision.HIGHEST):
    """Log-decays g [..., C] of a block -> (sums [..., C, C], entry (i, j) the sum of g over
    (j, i], 0 where i <= j; gam [..., C], the sums over [0, i]). Each sum is taken over its own
    range, as a 0/1-mask matmul at `precision`: not gam_i - gam_j, which cancels (the scan's
    float32 products keep float32's rounding of each sum; the kernels' bf16 products do not
    need it: `block_decays`)."""
    r, col = iotas(g.shape[-1])
    ones = jnp.where(r > col, 1.0, 0.0)  # [t, j]: t > j
    upto = jnp.where(col <= r, g[..., None, :], 0.0)  # [i, t]: g_t for t <= i
    sums = jnp.matmul(upto, ones, precision=precision, preferred_element_type=jnp.float32)
    return sums, jnp.sum(upto, axis=-1)


def block_decays(gam_rows, gam_cols, mask):
    """exp(gam_rows[t] - gam_cols[s]) where `mask` [t, s] holds, 0 elsewhere: the decay from
    token s to token t of a block, from the block's cumulative log-decays."""
    return jnp.exp(jnp.where(mask, gam_rows[:, None] - gam_cols[None, :], -jnp.inf))


def doubling_step(x, low, r, c, b, dot):
    """One step of inverting unit-lower-triangular blocks I + L by doubling: x holds the inverses
    of the diagonal b x b blocks (I at b = 1); each pair [[A, 0], [B, D]] of them gets its
    lower-left block -D^-1 B A^-1 = -(x (L masked to the B blocks) x), giving the 2b x 2b
    ones. r, c: `iotas(C)`; b a power of two (an int or traced)."""
    pair_b = (r // (2 * b) == c // (2 * b)) & (r // b % 2 == 1) & (c // b % 2 == 0)
    return x - dot(dot(x, jnp.where(pair_b, low, 0.0)), x)


def pad_blocks(block: int, q, k, v, g, beta):
    """The rule's inputs ([T, H, d] and [T, Hv]) padded to whole blocks: (n blocks, q, k, v, g,
    beta). Padded rows get beta = 0, g = 0, which leave the state as it is."""
    t = q.shape[0]
    n = -(-t // block)
    pad = n * block - t
    if pad:
        q, k, v = (jnp.pad(a, ((0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, pad), (0, 0))) for a in (g, beta))
    return n, q, k, v, g, beta


def _check_sizes(who: str, **sizes) -> None:
    for name, size in sizes.items():
        if size < 16 or size & (size - 1):
            raise ValueError(f"{who}: {name}={size} must be a power of two >= 16")


def _dot_nt(a, b, precision):  # a @ b.T
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _dot_tn(a, b, precision):  # a.T @ b
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _transform_kernel(k_ref, v_ref, gam_ref, beta_ref, w_ref, u_ref, *, block: int, rep: int,
                      precision):
    h, i = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block, block)
    k = k_ref[rows, h // rep, :]  # [C, dk], the operands' dtype
    gam, beta = gam_ref[rows, h], beta_ref[rows, h]
    op = w_ref.dtype
    r, c = iotas(block)
    low = _dot_nt(k, k, precision) * beta[:, None] * block_decays(gam, gam, r > c)  # strict L
    # the inverse's operands are float32: at DEFAULT precision TF32 on tensor cores
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)
    x = jnp.where(r == c, 1.0, 0.0)
    b = 1
    while b < block:  # unrolled: log2 C steps
        x = doubling_step(x, low, r, c, b, dot)
        b *= 2
    x = x.astype(op)
    w_ref[rows, h, :] = dot(x, (k * (beta * jnp.exp(gam))[:, None]).astype(op)).astype(
        op)  # the keys reading the state
    u_ref[rows, h, :] = dot(x, (v_ref[rows, h, :].astype(jnp.float32) * beta[:, None]).astype(
        op)).astype(op)  # the new values


def _walk_kernel(q_ref, k_ref, w_ref, u_ref, gam_ref, last_ref, s0_ref, o_ref, s_ref, *,
                 n_blocks: int, block: int, bv: int, rep: int, precision):
    h, j = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * bv, bv)
    op = w_ref.dtype
    r, c = iotas(block)
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)

    def step(i, s):
        rows = pl.ds(i * block, block)
        q, k = q_ref[rows, h // rep, :], k_ref[rows, h // rep, :]
        gam, last = gam_ref[rows, h], last_ref[h, i]
        held = s.astype(op)
        new = u_ref[rows, h, cols].astype(jnp.float32) - dot(w_ref[rows, h, :], held)  # [C, bv]
        attn = _dot_nt(q, k, precision) * block_decays(gam, gam, r >= c)  # causal, decayed
        o_ref[rows, h, cols] = (jnp.exp(gam)[:, None] * dot(q, held) + dot(
            attn.astype(op), new.astype(op))).astype(o_ref.dtype)
        return s * jnp.exp(last) + _dot_tn(
            k, (new * jnp.exp(last - gam)[:, None]).astype(op), precision)

    s_ref[h, :, cols] = lax.fori_loop(0, n_blocks, step, s0_ref[h, :, cols])


def _launch(interpret, num_warps, num_stages):
    if interpret is None:
        interpret = jax.devices()[0].platform != "gpu"
    kw = {} if interpret else {
        "compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
    return interpret, kw


def _precision(products: str, who: str):
    """The kernels' dot precision: DEFAULT for bf16 products (bf16 operands on tensor cores;
    the inverse's float32 operands at TF32), HIGHEST for float32 (CUDA cores)."""
    if products not in PRODUCTS:
        raise ValueError(f"{who}: products={products!r}: expected {'|'.join(PRODUCTS)}")
    return lax.Precision.DEFAULT if products == "bf16" else lax.Precision.HIGHEST


def ut_transform(k, v, gam, beta, *, block: int, products: str = "float32",
                 interpret: bool | None = None, num_warps: int | None = None):
    """Each block's UT transform applied: T = (I + L)^-1 with L[t, s] = beta_t k_t.k_s
    exp(gam_t - gam_s) for t > s (0 elsewhere), inverted by doubling (2 log2 C matmuls of C x
    C, as `layers.deltanet.unit_lower_inverse`, unrolled), then w = T (beta exp(gam) k), the
    keys that read the state, and u = T (beta v), the new values before the state's part. A
    program per value head and block (`num_warps`, default `TRANSFORM_WARPS`); tokens-first,
    key heads read in place.

    Args:
        k: [n*C, Hk, dk] in the products' operand dtype (`operand_dtype`; value head h reads
            key head h // (Hv / Hk)); v: [n*C, Hv, dv], any float dtype (read as float32);
            gam: float32 [n*C, Hv], the log-decays summed from each block's start through
            each row; beta: float32 [n*C, Hv].

    Returns (w [n*C, Hv, dk], u [n*C, Hv, dv]) in the operand dtype."""
    rows, hk, dk = k.shape
    hv, dv = v.shape[1:]
    n = rows // block
    if rows != n * block or hv % hk:
        raise ValueError(f"ut_transform: {rows} rows are not whole blocks of {block}, or {hk} "
                         f"key heads do not divide {hv} value heads")
    precision = _precision(products, "ut_transform")
    _check_sizes("ut_transform", block=block)
    interpret, kw = _launch(interpret, num_warps or TRANSFORM_WARPS[products], 1)
    op = operand_dtype(products)
    return pl.pallas_call(
        functools.partial(_transform_kernel, block=block, rep=hv // hk, precision=precision),
        grid=(hv, n),
        out_shape=(jax.ShapeDtypeStruct((rows, hv, dk), op),
                   jax.ShapeDtypeStruct((rows, hv, dv), op)),
        interpret=interpret, name="ut_transform", **kw,
    )(k.astype(op), v, gam.astype(jnp.float32), beta.astype(jnp.float32))


def block_cumsums(g, block: int):
    """g [n*C, Hv] -> (gam [n*C, Hv], each row's log-decay summed from its block's start,
    float32; last [Hv, n], each block's total)."""
    rows, hv = g.shape
    gam = jnp.cumsum(g.astype(jnp.float32).reshape(rows // block, block, hv), axis=1)
    return gam.reshape(rows, hv), gam[:, -1, :].T


def delta_rule_chunk(q, k, v, g, beta, state, *, block: int | None = None,
                     products: str = "float32", transform_warps: int | None = None,
                     bv: int | None = None, interpret: bool | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     out_dtype=jnp.float32):
    """The whole chunkwise delta rule in two kernels over the tokens-first layout (the module
    docstring): `ut_transform` (w and u of every block, in parallel) and `walk_blocks` (a
    program per value head and slice of `bv` state columns: the outputs and the state).

    Args as `layers.deltanet.gated_delta_rule` (q, k [T, Hk, dk], v [T, Hv, dv], g, beta
    [T, Hv], state [Hv, dk, dv], T any length; padded rows get beta = 0, g = 0), and the launch:
    the block (default `KERNEL_BLOCKS` for the products), the transform's `transform_warps`,
    the walk's `bv`, `num_warps` and `num_stages` (defaults for the products:
    `TRANSFORM_WARPS`, `WALK_COLUMNS`, `WALK_WARPS`, `WALK_STAGES`). q and k are rounded to
    the operand dtype (bf16 products: bf16), v read as it is (the layer's bf16/fp16 too).
    Returns (o [T, Hv, dv] in `out_dtype`, the float32 sums cast as the kernel stores them;
    the float32 state after the last row)."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"delta_rule_chunk: {hk} key heads do not divide {hv} value heads")
    op = operand_dtype(products)  # refuses unknown products by name
    block = block or KERNEL_BLOCKS[products]
    bv = min(bv or WALK_COLUMNS[products], dv)
    # every size checked before any work (`ut_transform` and `walk_blocks` check theirs too)
    _check_sizes("delta_rule_chunk", block=block, dk=dk, dv=dv, bv=bv)
    f32 = jnp.float32
    n, q, k, v, g, beta = pad_blocks(block, q.astype(op), k.astype(op), v, g.astype(f32),
                                     beta.astype(f32))
    gam, last = block_cumsums(g, block)
    w, u = ut_transform(k, v, gam, beta, block=block, products=products,
                        interpret=interpret, num_warps=transform_warps)
    o, state = walk_blocks(q, k, w, u, gam, last, state, block=block, products=products,
                           bv=bv, interpret=interpret, num_warps=num_warps,
                           num_stages=num_stages, out_dtype=out_dtype)
    return o[:t], state


def walk_blocks(q, k, w, u, gam, last, state, *, block: int, products: str,
                bv: int | None = None, interpret: bool | None = None,
                num_warps: int | None = None, num_stages: int | None = None,
                out_dtype=jnp.float32):
    """The state's walk (`delta_rule_chunk`'s second kernel): q, k [n*C, Hk, dk], w [n*C, Hv,
    dk] and u [n*C, Hv, dv] from `ut_transform` (all in the operand dtype), gam [n*C, Hv] and
    last [Hv, n] (`block_cumsums`), state [Hv, dk, dv]. A program per value head and slice of
    `bv` state columns (default `WALK_COLUMNS`, `WALK_WARPS` and `WALK_STAGES` for the
    products); each block's outputs o = exp(gam) q S + (q k^T * decay) new as it passes.
    Returns (o [n*C, Hv, dv] in `out_dtype`, the float32 state after the last block)."""
    rows, hk, dk = q.shape
    hv, dv = u.shape[1:]
    n = rows // block
    precision = _precision(products, "walk_blocks")
    bv = min(bv or WALK_COLUMNS[products], dv)  # a slice wider than dv is dv
    _check_sizes("walk_blocks", bv=bv)
    interpret, kw = _launch(interpret, num_warps or WALK_WARPS[products],
                            num_stages or WALK_STAGES[products])
    f32 = jnp.float32
    return pl.pallas_call(
        functools.partial(_walk_kernel, n_blocks=n, block=block, bv=bv, rep=hv // hk,
                          precision=precision),
        grid=(hv, dv // bv),
        out_shape=(jax.ShapeDtypeStruct((rows, hv, dv), out_dtype),
                   jax.ShapeDtypeStruct((hv, dk, dv), f32)),
        interpret=interpret, name="delta_rule_walk", **kw,
    )(q, k, w, u, gam.astype(f32), last.astype(f32), state.astype(f32))
