"""The chunkwise gated delta rule in Pallas (Triton) kernels (`Kernels.delta_rule="pallas"`).

`layers.deltanet.gated_delta_rule` folds each block of C tokens into matmuls that need only the
state S before the block; what stays sequential is the state's walk over the blocks. Per block
i and value head, with T_i the block's UT transform (`ut_transform`), gam the decay from the
block's start and last_i its total:

    w_i = T_i (beta exp(gam) k),  u_i = T_i (beta v)     (every block in parallel)
    new_i   = u_i - w_i S                                 (the block's new values)
    inter_i = exp(gam) q S                                (its queries reading the state)
    S       = exp(last_i) S + (k exp(last_i - gam))^T new_i
    o_i     = inter_i + (q k^T * decay) new_i             (every block in parallel)

`delta_rule_chunk` runs this as three kernels over the tokens-first layout ([T, heads, d], key
heads read in place: no transposes, no repeated heads): `ut_transform` (a program per value head
and block: w, u, and the decays, among them the block's causal C x C decays from the sums it
takes for the transform), the walk (a program per value head and slice of state columns,
holding its [dk, bv] part of the state in registers: the columns are independent), and the
outputs (a program per value head and block, reading the transform's decays). The walk holds
only the state and a block's q, k, w and u; the launches are sized so no kernel spills
registers on Hopper at the real head sizes (`benchmarks.compile_check`).

float32 data and state (a bf16/fp16 layer's v read as it is and made float32, its outputs
stored in its dtype); the products as the layer asks (`layers.deltanet.products_for`): "tf32"
on tensor cores (a bf16/fp16 layer), or "float32" (Triton's "ieee": CUDA-core products, for
float32 layers and tests); the decays' sums float32-exact either way (`decay_sums`). On the
CPU the kernels run in Pallas' interpret mode (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from strata_jax.kernels import DELTA_RULES

__all__ = ["delta_rule_chunk", "ut_transform", "walk_blocks", "block_outputs", "delta_rule_path",
           "decay_sums", "doubling_step", "iotas", "pad_blocks", "tf32_parts", "KERNEL_BLOCKS",
           "WALK_COLUMNS", "WALK_WARPS", "WALK_STAGES", "AUTO_ON_GPU", "PRODUCTS"]

# The rule's products: "float32" (full float32) or "tf32" (tensor cores, float32 sums).
PRODUCTS = ("float32", "tf32")

# What "auto" runs on a GPU, by the layer's products (`layers.deltanet.products_for`): the
# kernels for TF32 products (a bf16/fp16 layer's), the scan for float32 products, which the
# kernels run on CUDA cores (`hybrid_bench`, BENCHMARKS.md "Hybrid and latent attention").
AUTO_ON_GPU = {"tf32": "pallas", "float32": "xla"}

# The kernels' launch at dk = dv = 128 (Qwen3-Next's), each without spilled registers on
# Hopper (`benchmarks.compile_check`): with TF32 products blocks of 64, the walk's state
# columns a program, warps and pipeline stages (32 value heads x 4 slices: 128 programs, one
# wave; two stages load a block's q, k, w and u while the one before is multiplied: the
# fastest of hybrid_bench's launches), the output kernel's columns a program (all: q k^T once
# a block) and warps, the transform's warps. CUDA-core float32 products (a float32 layer's)
# hold more registers: blocks and slices of 16, 8 warps, one stage (at 64 they spill).
KERNEL_BLOCKS = {"tf32": 64, "float32": 16}
WALK_COLUMNS, WALK_WARPS = {"tf32": 32, "float32": 16}, {"tf32": 4, "float32": 8}
WALK_STAGES = {"tf32": 2, "float32": 1}
OUTPUT_COLUMNS, OUTPUT_WARPS = 128, 4
TRANSFORM_WARPS = 8


def delta_rule_path(impl: str = "auto", platform: str | None = None,
                    products: str = "float32") -> str:
    """The rule's implementation: "xla" (the scan) or "pallas" (`delta_rule_chunk`); auto:
    `AUTO_ON_GPU` for the products on a GPU ("tf32": a bf16/fp16 layer's), "xla" elsewhere."""
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


def iotas(c: int):
    """Row and column iotas [C, 1] and [1, C] of a C x C block: masks built from them broadcast
    (no [C, C] index arrays held, in a kernel's registers or XLA's buffers)."""
    return (lax.broadcasted_iota(jnp.int32, (c, 1), 0),
            lax.broadcasted_iota(jnp.int32, (1, c), 1))


def decay_sums(g, precision=lax.Precision.HIGHEST):
    """Log-decays g [..., C] of a block -> (sums [..., C, C], entry (i, j) the sum of g over
    (j, i], 0 where i <= j; gam [..., C], the sums over [0, i]). Each sum is taken over its own
    range, as a 0/1-mask matmul: not gam_i - gam_j, which cancels (within a block of 64
    fast-decaying tokens gam reaches hundreds, and float32's difference of two such sums is off
    by ~1e-5 of them). In XLA over batches of blocks (one matmul at `precision`) and in the
    kernels over one (precision "split": `tf32_parts`, three TF32 matmuls whose products are
    exact: a float32 matmul spills a kernel's registers at C = 64)."""
    r, col = iotas(g.shape[-1])
    ones = jnp.where(r > col, 1.0, 0.0)  # [t, j]: t > j
    upto = jnp.where(col <= r, g[..., None, :], 0.0)  # [i, t]: g_t for t <= i
    if precision != "split":
        sums = jnp.matmul(upto, ones, precision=precision, preferred_element_type=jnp.float32)
    else:
        sums = None
        for part in tf32_parts(g):
            term = jnp.matmul(jnp.where(col <= r, part[..., None, :], 0.0), ones,
                              precision=lax.Precision.DEFAULT,
                              preferred_element_type=jnp.float32)
            sums = term if sums is None else sums + term
    return sums, jnp.sum(upto, axis=-1)


def tf32_parts(x):
    """float32 x as three float32 parts, each exact in TF32 (10 mantissa bits), summing to x
    exactly: each part keeps the top bits of what is left (a float32 has 24 significant
    bits). A product of a part with 0 or 1 is exact on tensor cores. (A remainder below
    float32's smallest normal flushes to zero: an error under 1.2e-38.)"""
    parts = []
    for _ in range(2):
        top = lax.bitcast_convert_type(
            lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(-8192), jnp.float32)
        parts.append(top)
        x = x - top
    return parts + [x]


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


def _transform_kernel(k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, d_ref, eg_ref, et_ref, el_ref,
                      *, block: int, rep: int, precision):
    h, i = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block, block)
    k = k_ref[rows, h // rep, :]  # [C, dk]
    beta = beta_ref[rows, h]
    r, c = iotas(block)
    sums, gam = decay_sums(g_ref[rows, h], "split")
    low = _dot_nt(k * beta[:, None], k, precision) * jnp.exp(
        jnp.where(r > c, sums, -jnp.inf))  # strictly lower L
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)
    x = jnp.where(r == c, 1.0, 0.0)
    b = 1
    while b < block:  # unrolled: log2 C steps
        x = doubling_step(x, low, r, c, b, dot)
        b *= 2
    eg = jnp.exp(gam)  # decay from the block's start
    w_ref[rows, h, :] = dot(x, k * (beta * eg)[:, None])  # the keys reading the state
    u_ref[rows, h, :] = dot(x, v_ref[rows, h, :].astype(jnp.float32) * beta[:, None])  # new values
    d_ref[rows, h, :] = jnp.exp(jnp.where(r >= c, sums, -jnp.inf))  # causal decays
    eg_ref[rows, h] = eg
    et_ref[rows, h] = jnp.exp(jnp.sum(jnp.where(r == block - 1, sums, 0.0), axis=0))  # to its end
    last = lax.broadcasted_iota(jnp.int32, (block,), 0) == block - 1
    el_ref[h, i] = jnp.exp(jnp.sum(jnp.where(last, gam, 0.0)))  # its total


def _walk_kernel(q_ref, k_ref, w_ref, u_ref, eg_ref, et_ref, el_ref, s0_ref, inter_ref,
                 new_ref, s_ref, *, n_blocks: int, block: int, bv: int, rep: int, precision):
    h, j = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * bv, bv)
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)

    def step(i, s):
        rows = pl.ds(i * block, block)
        new = u_ref[rows, h, cols] - dot(w_ref[rows, h, :], s)  # [C, bv]
        inter_ref[rows, h, cols] = eg_ref[rows, h][:, None] * dot(q_ref[rows, h // rep, :], s)
        new_ref[rows, h, cols] = new
        return s * el_ref[h, i] + _dot_tn(k_ref[rows, h // rep, :],
                                          new * et_ref[rows, h][:, None], precision)

    s_ref[h, :, cols] = lax.fori_loop(0, n_blocks, step, s0_ref[h, :, cols])


def _output_kernel(q_ref, k_ref, d_ref, inter_ref, new_ref, o_ref, *, block: int, bv: int,
                   rep: int, precision):
    h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, cols = pl.ds(i * block, block), pl.ds(j * bv, bv)
    attn = _dot_nt(q_ref[rows, h // rep, :], k_ref[rows, h // rep, :], precision) * d_ref[
        rows, h, :]  # causal within the block, decayed
    o_ref[rows, h, cols] = (inter_ref[rows, h, cols] + jnp.dot(
        attn, new_ref[rows, h, cols], precision=precision,
        preferred_element_type=jnp.float32)).astype(o_ref.dtype)


def _launch(interpret, num_warps, num_stages):
    if interpret is None:
        interpret = jax.devices()[0].platform != "gpu"
    kw = {} if interpret else {
        "compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
    return interpret, kw


def _precision(products: str, who: str):
    """The products' precision: TF32 (tensor cores) or full float32. (The decay sums are
    float32-exact either way: `decay_sums`' "split".)"""
    if products not in PRODUCTS:
        raise ValueError(f"{who}: products={products!r}: expected {'|'.join(PRODUCTS)}")
    return lax.Precision.DEFAULT if products == "tf32" else lax.Precision.HIGHEST


def ut_transform(k, v, g, beta, *, block: int, products: str = "float32",
                 interpret: bool | None = None, num_warps: int = 8):
    """Each block's UT transform applied: T = (I + L)^-1 with L[i, j] = beta_i k_i.k_j exp(g
    summed over (j, i]) for i > j (0 elsewhere), by doubling (2 log2 C matmuls of C x C, as
    `layers.deltanet.unit_lower_inverse`, unrolled); then w = T (beta exp(gam) k), the keys
    that read the state, and u = T (beta v), the new values before the state's part; and the
    block's causal decays exp(g summed over (j, i]), i >= j (0 above), from the same sums. A
    program per value head and block; tokens-first, key heads read in place.

    Args:
        k: float32 [n*C, Hk, dk] (value head h reads key head h // (Hv / Hk)); v: [n*C, Hv,
            dv], float32 or the layer's bf16/fp16 (made float32 as it is read); g: float32
            [n*C, Hv], the log-decays; beta: float32 [n*C, Hv].

    Returns (w [n*C, Hv, dk], u [n*C, Hv, dv], d [n*C, Hv, C] (row t: token t's row of its
    block's decays); [n*C, Hv] exp of each row's decay from its block's start (g summed over
    the block's rows up to it) and to its end (over the rows after it); [Hv, n] exp of each
    block's total), all float32."""
    rows, hk, dk = k.shape
    hv, dv = v.shape[1:]
    n = rows // block
    if rows != n * block or hv % hk:
        raise ValueError(f"ut_transform: {rows} rows are not whole blocks of {block}, or {hk} "
                         f"key heads do not divide {hv} value heads")
    precision = _precision(products, "ut_transform")
    interpret, kw = _launch(interpret, num_warps, 1)
    f32 = jnp.float32
    per_row = jax.ShapeDtypeStruct((rows, hv), f32)
    return pl.pallas_call(
        functools.partial(_transform_kernel, block=block, rep=hv // hk, precision=precision),
        grid=(hv, n),
        out_shape=(jax.ShapeDtypeStruct((rows, hv, dk), f32),
                   jax.ShapeDtypeStruct((rows, hv, dv), f32),
                   jax.ShapeDtypeStruct((rows, hv, block), f32), per_row, per_row,
                   jax.ShapeDtypeStruct((hv, n), f32)),
        interpret=interpret, name="ut_transform", **kw,
    )(k.astype(f32), v, g.astype(f32), beta.astype(f32))


def delta_rule_chunk(q, k, v, g, beta, state, *, block: int | None = None,
                     products: str = "float32", bv: int | None = None,
                     interpret: bool | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, out_columns: int = OUTPUT_COLUMNS,
                     out_dtype=jnp.float32):
    """The whole chunkwise delta rule in three kernels over the tokens-first layout (the
    module docstring): `ut_transform` (w, u and the decays of every block, its causal C x C
    ones d among them, in parallel), the walk (a program per value head and slice of `bv`
    state columns: inter, new and the state), the outputs o = inter + (q k^T * d) new (a
    program per value head, block and slice of `out_columns`; in float32 written over inter).

    Args as `layers.deltanet.gated_delta_rule` (q, k [T, Hk, dk], v [T, Hv, dv], g, beta
    [T, Hv], state [Hv, dk, dv], T any length; padded rows get beta = 0, g = 0), and the launch:
    the block (default `KERNEL_BLOCKS` for the products), the walk's `bv`, `num_warps` and
    `num_stages` (default `WALK_COLUMNS`, `WALK_WARPS`, `WALK_STAGES` for the products); the
    output kernel's column slice `out_columns`. v may be the layer's bf16/fp16 (read as
    float32). Returns (o [T, Hv, dv] in `out_dtype`, the float32 sums cast as the kernel
    stores them; the state after the last row)."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"delta_rule_chunk: {hk} key heads do not divide {hv} value heads")
    _precision(products, "delta_rule_chunk")  # refuses unknown products by name
    block = block or KERNEL_BLOCKS[products]
    bv, out_columns = min(bv or WALK_COLUMNS[products], dv), min(out_columns, dv)
    # every size checked before any work (`walk_blocks` and `block_outputs` check theirs too)
    _check_sizes("delta_rule_chunk", block=block, dk=dk, dv=dv, bv=bv, out_columns=out_columns)
    f32 = jnp.float32
    _, q, k, v, g, beta = pad_blocks(block, q.astype(f32), k.astype(f32), v, g.astype(f32),
                                     beta.astype(f32))
    w, u, d, eg, et, el = ut_transform(k, v, g, beta, block=block, products=products,
                                       interpret=interpret, num_warps=TRANSFORM_WARPS)
    inter, new, state = walk_blocks(q, k, w, u, eg, et, el, state, block=block,
                                    products=products, bv=bv, interpret=interpret,
                                    num_warps=num_warps, num_stages=num_stages)
    o = block_outputs(q, k, d, inter, new, block=block, products=products, bv=out_columns,
                      interpret=interpret, out_dtype=out_dtype)
    return o[:t], state


def walk_blocks(q, k, w, u, eg, et, el, state, *, block: int, products: str,
                bv: int | None = None, interpret: bool | None = None,
                num_warps: int | None = None, num_stages: int | None = None):
    """The state's walk (`delta_rule_chunk`'s second kernel): q, k [n*C, Hk, dk]; w [n*C, Hv,
    dk], u [n*C, Hv, dv], eg, et [n*C, Hv], el [Hv, n] from `ut_transform`; state [Hv, dk,
    dv]. A program per value head and slice of `bv` state columns (default `WALK_COLUMNS`,
    `WALK_WARPS` and `WALK_STAGES` for the products). Returns (inter, new [n*C, Hv, dv], the
    state after the last block), all float32."""
    rows, hk, dk = q.shape
    hv, dv = u.shape[1:]
    n = rows // block
    precision = _precision(products, "walk_blocks")
    bv = min(bv or WALK_COLUMNS[products], dv)  # a slice wider than dv is dv
    _check_sizes("walk_blocks", bv=bv)
    interpret, kw = _launch(interpret, num_warps or WALK_WARPS[products],
                            num_stages or WALK_STAGES[products])
    f32 = jnp.float32
    values = jax.ShapeDtypeStruct((rows, hv, dv), f32)
    return pl.pallas_call(
        functools.partial(_walk_kernel, n_blocks=n, block=block, bv=bv, rep=hv // hk,
                          precision=precision),
        grid=(hv, dv // bv),
        out_shape=(values, values, jax.ShapeDtypeStruct((hv, dk, dv), f32)),
        interpret=interpret, name="delta_rule_walk", **kw,
    )(q, k, w, u, eg, et, el, state.astype(f32))


def block_outputs(q, k, d, inter, new, *, block: int, products: str,
                  bv: int = OUTPUT_COLUMNS, interpret: bool | None = None,
                  num_warps: int = OUTPUT_WARPS, out_dtype=jnp.float32):
    """The outputs (`delta_rule_chunk`'s third kernel): o = inter + (q k^T * d) new per block,
    q, k [n*C, Hk, dk], d [n*C, Hv, C] each block's causal decays (`ut_transform`), inter and
    new [n*C, Hv, dv]. A program per value head, block and slice of `bv` columns. Returns o
    in `out_dtype` (float32: written over inter; the layer's bf16: its own, half the bytes,
    the float32 sums cast as XLA casts them)."""
    rows, hk, _ = q.shape
    hv, dv = new.shape[1:]
    precision = _precision(products, "block_outputs")
    bv = min(bv, dv)  # a slice wider than dv is dv
    _check_sizes("block_outputs", bv=bv)
    interpret, kw = _launch(interpret, num_warps, 1)
    return pl.pallas_call(
        functools.partial(_output_kernel, block=block, bv=bv, rep=hv // hk,
                          precision=precision),
        grid=(hv, rows // block, dv // bv),
        out_shape=jax.ShapeDtypeStruct((rows, hv, dv), out_dtype),
        # in float32 the outputs accumulate over `inter`
        input_output_aliases={3: 0} if jnp.dtype(out_dtype) == jnp.float32 else {},
        interpret=interpret, name="delta_rule_output", **kw,
    )(q, k, d, inter, new)
