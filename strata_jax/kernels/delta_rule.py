"""The chunkwise gated delta rule in Pallas (Triton) kernels.

`layers.deltanet.gated_delta_rule` folds each block of C tokens into matmuls that need only the
state before the block; what stays sequential is the state's walk over the blocks: per block i
and value head,

    inter_i = qd_i @ S          (the block's queries reading the state, [C, dv])
    new_i   = u_i - w_i @ S     (the block's new values, [C, dv])
    S       = exp(last_i) S + kd_i^T @ new_i

As an XLA scan this is a loop of small batched matmuls and several kernels a block.
`delta_rule_carry` ("pallas") walks it in one kernel: a program per value head and slice of `bv`
state columns (the columns are independent: a column of S only reads the same column of u and
S), its [dk, bv] part of the state in registers, so a block costs three small matmuls and no
launch. `delta_rule_chunk` ("fused") runs the whole rule in two kernels over the tokens-first
layout: `ut_inverse` (every block's UT transform, in parallel), then a walk that computes each
block's values, outputs and state update from q, k, v, the decays and the inverse, so nothing of
size [T, Hv, dk] is written between them.

float32 data and state; the products as the layer asks (`layers.deltanet.products_for`): "tf32"
on tensor cores (a bf16/fp16 layer), or "float32" (Triton's "ieee": CUDA-core products, for
float32 layers and tests). On the CPU the kernels run in Pallas' interpret mode (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from strata_jax.kernels import DELTA_RULES

__all__ = ["delta_rule_carry", "delta_rule_chunk", "ut_inverse", "delta_rule_path",
           "decay_sums", "doubling_step", "pad_blocks", "AUTO_ON_GPU", "PRODUCTS"]

# The rule's products: "float32" (full float32) or "tf32" (tensor cores, float32 sums).
PRODUCTS = ("float32", "tf32")

# What "auto" runs on a GPU: the scan, as measured (hybrid_bench); the kernels are the choice
# a user makes by name.
AUTO_ON_GPU = "xla"


def delta_rule_path(impl: str = "auto", platform: str | None = None) -> str:
    """The rule's implementation: "xla", "pallas" (the walk as one kernel) or "fused" (the
    whole rule as `delta_rule_chunk`); auto: `AUTO_ON_GPU` on a GPU, "xla" elsewhere."""
    impl = (impl or "auto").lower()
    if impl not in DELTA_RULES:
        raise ValueError(f"delta rule {impl!r}: expected one of {'|'.join(DELTA_RULES)}")
    if impl == "auto":
        platform = platform or jax.default_backend()
        return AUTO_ON_GPU if platform == "gpu" else "xla"
    return impl


def decay_sums(g, precision=lax.Precision.HIGHEST):
    """Log-decays g [..., C] of a block -> (sums [..., C, C], entry (i, j) the sum of g over
    (j, i], 0 where i <= j; gam [..., C], the sums over [0, i]). Each sum is taken over its own
    range, as one 0/1-mask matmul: not gam_i - gam_j, which cancels (within a block of 64
    fast-decaying tokens gam reaches hundreds, and float32's difference of two such sums is off
    by ~1e-5 of them). In XLA over batches of blocks and in the kernels over one."""
    c = g.shape[-1]
    r = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    upto = jnp.where(col <= r, g[..., None, :], 0.0)  # [i, t]: g_t for t <= i
    sums = jnp.matmul(upto, jnp.where(r > col, 1.0, 0.0), precision=precision,
                      preferred_element_type=jnp.float32)  # [i, j]: t > j too
    return sums, jnp.sum(upto, axis=-1)


def doubling_step(x, low, r, c, b, dot):
    """One step of inverting unit-lower-triangular blocks I + L by doubling: x holds the inverses
    of the diagonal b x b blocks (I at b = 1); each pair [[A, 0], [B, D]] of them gets its
    lower-left block -D^-1 B A^-1 = -(x (L masked to the B blocks) x), giving the 2b x 2b
    ones. r, c: row and column iotas of [C, C]; b a power of two (an int or traced)."""
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


def _kernel(w_ref, qd_ref, kd_ref, u_ref, decay_ref, s0_ref, inter_ref, new_ref, s_ref, *,
            n_blocks: int, block: int, bv: int, precision):
    h, j = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * bv, bv)
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)

    def step(i, s):
        rows = pl.ds(i * block, block)
        w = w_ref[h, rows, :]  # [C, dk]
        qd = qd_ref[h, rows, :]
        kd = kd_ref[h, rows, :]
        u = u_ref[h, rows, cols]  # [C, bv]
        inter_ref[h, rows, cols] = dot(qd, s)
        new = u - dot(w, s)
        new_ref[h, rows, cols] = new
        return s * decay_ref[h, i] + lax.dot_general(
            kd, new, (((0,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32)

    s_ref[h, :, cols] = lax.fori_loop(0, n_blocks, step, s0_ref[h, :, cols])


def delta_rule_carry(w, qd, kd, u, decay, state, *, block: int, products: str = "float32",
                     bv: int = 32, interpret: bool | None = None, num_warps: int = 4,
                     num_stages: int = 1):
    """The state's walk over the blocks (see the module docstring).

    Args:
        w, qd, kd: float32 [Hv, n*C, dk], block i in rows i*C..(i+1)*C-1.
        u: float32 [Hv, n*C, dv].
        decay: float32 [Hv, n], exp of each block's total log-decay.
        state: float32 [Hv, dk, dv], the state before the first block.
        block: C, a power of two >= 16; dk, dv and `bv` powers of two >= 16, bv dividing dv
            (a slice wider than dv is dv).
        products: "tf32" (tensor cores) or "float32" (full float32 products).
        bv, num_warps, num_stages: the program's state columns and Triton's launch options.

    Returns:
        (inter [Hv, n*C, dv], new [Hv, n*C, dv], the state after the last block).
    """
    hv, rows, dk = w.shape
    dv = u.shape[-1]
    n = decay.shape[1]
    bv = min(bv, dv)
    _check_sizes("delta_rule_carry", block=block, dk=dk, dv=dv, bv=bv)
    if rows != n * block or dv % bv:
        raise ValueError(f"delta_rule_carry: {rows} rows for {n} blocks of {block}, "
                         f"dv={dv} in slices of {bv}")
    precision, _ = _precision(products, "delta_rule_carry")
    interpret, kw = _launch(interpret, num_warps, num_stages)
    f32 = jnp.float32
    return pl.pallas_call(
        functools.partial(_kernel, n_blocks=n, block=block, bv=bv, precision=precision),
        grid=(hv, dv // bv),
        out_shape=(jax.ShapeDtypeStruct((hv, rows, dv), f32),
                   jax.ShapeDtypeStruct((hv, rows, dv), f32),
                   jax.ShapeDtypeStruct((hv, dk, dv), f32)),
        interpret=interpret, name="delta_rule_carry", **kw,
    )(w.astype(f32), qd.astype(f32), kd.astype(f32), u.astype(f32), decay.astype(f32),
      state.astype(f32))


def _dot_nt(a, b, precision):  # a @ b.T
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _dot_tn(a, b, precision):  # a.T @ b
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _inverse_kernel(k_ref, g_ref, beta_ref, t_ref, *, block: int, rep: int, precision, exact):
    h, i = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block, block)
    k = k_ref[rows, h // rep, :]  # [C, dk]
    beta = beta_ref[rows, h]
    r = lax.broadcasted_iota(jnp.int32, (block, block), 0)
    c = lax.broadcasted_iota(jnp.int32, (block, block), 1)
    sums, _ = decay_sums(g_ref[rows, h], exact)
    low = _dot_nt(k * beta[:, None], k, precision) * jnp.exp(
        jnp.where(r > c, sums, -jnp.inf))  # strictly lower L
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)
    x = jnp.where(r == c, 1.0, 0.0)
    b = 1
    while b < block:  # unrolled: log2 C steps
        x = doubling_step(x, low, r, c, b, dot)
        b *= 2
    t_ref[h, i, :, :] = x


def _chunk_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, t_ref, s0_ref, o_ref, s_ref, *,
                  n_blocks: int, block: int, bv: int, rep: int, precision, exact):
    h, j = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * bv, bv)
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)
    r = lax.broadcasted_iota(jnp.int32, (block, block), 0)
    c = lax.broadcasted_iota(jnp.int32, (block, block), 1)
    row = lax.broadcasted_iota(jnp.int32, (block,), 0)

    def step(i, s):
        rows = pl.ds(i * block, block)
        q = q_ref[rows, h // rep, :]  # [C, dk]
        k = k_ref[rows, h // rep, :]
        v = v_ref[rows, h, cols]  # [C, bv]
        beta = beta_ref[rows, h]
        sums, gam = decay_sums(g_ref[rows, h], exact)  # gam: decay from the start
        eg = jnp.exp(gam)
        last = jnp.sum(jnp.where(row == block - 1, gam, 0.0))  # the block's total decay
        to_end = jnp.sum(jnp.where(r == block - 1, sums, 0.0), axis=0)  # [C]: over (j, C-1]
        # new = T (beta (v - exp(gam) k S)): the UT transform's values less the state's part
        new = dot(t_ref[h, i, :, :], beta[:, None] * (v - eg[:, None] * dot(k, s)))
        attn = _dot_nt(q, k, precision) * jnp.exp(
            jnp.where(r >= c, sums, -jnp.inf))
        o_ref[rows, h, cols] = eg[:, None] * dot(q, s) + dot(attn, new)
        return s * jnp.exp(last) + _dot_tn(k, new * jnp.exp(to_end)[:, None], precision)

    s_ref[h, :, cols] = lax.fori_loop(0, n_blocks, step, s0_ref[h, :, cols])


def _launch(interpret, num_warps, num_stages):
    if interpret is None:
        interpret = jax.devices()[0].platform != "gpu"
    kw = {} if interpret else {
        "compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
    return interpret, kw


def _precision(products: str, who: str):
    """(the products' precision, the decay sums'): TF32, with the sums at TF32x3 (float32's
    accuracy on tensor cores); or both at full float32."""
    if products not in PRODUCTS:
        raise ValueError(f"{who}: products={products!r}: expected {'|'.join(PRODUCTS)}")
    if products == "tf32":
        return lax.Precision.DEFAULT, lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lax.Precision.HIGHEST, lax.Precision.HIGHEST


def ut_inverse(k, g, beta, *, block: int, products: str = "float32",
               interpret: bool | None = None, num_warps: int = 4):
    """Each block's UT transform: T = (I + L)^-1 with L[i, j] = beta_i k_i.k_j exp(g summed over
    (j, i]) for i > j (0 elsewhere), by doubling (2 log2 C matmuls of C x C, as
    `layers.deltanet.unit_lower_inverse`, unrolled); a program per head and block.

    Args:
        k: float32 [n*C, Hk, dk] (value head h reads key head h // (Hv / Hk)); g: float32
            [n*C, Hv], the log-decays; beta: float32 [n*C, Hv].

    Returns float32 [Hv, n, C, C]."""
    rows, hk, dk = k.shape
    hv = g.shape[1]
    n = rows // block
    if rows != n * block or hv % hk:
        raise ValueError(f"ut_inverse: {rows} rows are not whole blocks of {block}, or {hk} "
                         f"key heads do not divide {hv} value heads")
    precision, exact = _precision(products, "ut_inverse")
    interpret, kw = _launch(interpret, num_warps, 1)
    f32 = jnp.float32
    return pl.pallas_call(
        functools.partial(_inverse_kernel, block=block, rep=hv // hk, precision=precision,
                          exact=exact),
        grid=(hv, n), out_shape=jax.ShapeDtypeStruct((hv, n, block, block), f32),
        interpret=interpret, name="ut_inverse", **kw,
    )(k.astype(f32), g.astype(f32), beta.astype(f32))


def delta_rule_chunk(q, k, v, g, beta, state, *, block: int, products: str = "float32",
                     bv: int = 64, interpret: bool | None = None, num_warps: int = 8,
                     num_stages: int = 1):
    """The whole chunkwise delta rule in two kernels, in the tokens-first layout (no
    transposes): `ut_inverse` (every block in parallel), then one program per value head and
    slice of `bv` state columns walks the blocks, per block i (S the state before it)
        new_i = T_i (beta (v - exp(gam) k S))      (the block's new values)
        o_i   = exp(gam) q S + (q k^T * decay) new_i
        S     = exp(last_i) S + (k exp(last_i - gam))^T new_i.

    Args as `layers.deltanet.gated_delta_rule` (q, k [T, Hk, dk], v [T, Hv, dv], g, beta
    [T, Hv], state [Hv, dk, dv], T any length; padded rows get beta = 0, g = 0). Returns
    (o [T, Hv, dv], the state after the last row)."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"delta_rule_chunk: {hk} key heads do not divide {hv} value heads")
    bv = min(bv, dv)
    _check_sizes("delta_rule_chunk", block=block, dk=dk, dv=dv, bv=bv)
    precision, exact = _precision(products, "delta_rule_chunk")
    f32 = jnp.float32
    n, q, k, v, g, beta = pad_blocks(block, *(a.astype(f32) for a in (q, k, v, g, beta)))
    inverse = ut_inverse(k, g, beta, block=block, products=products, interpret=interpret)
    interpret, kw = _launch(interpret, num_warps, num_stages)
    o, state = pl.pallas_call(
        functools.partial(_chunk_kernel, n_blocks=n, block=block, bv=bv, rep=hv // hk,
                          precision=precision, exact=exact),
        grid=(hv, dv // bv),
        out_shape=(jax.ShapeDtypeStruct((n * block, hv, dv), f32),
                   jax.ShapeDtypeStruct((hv, dk, dv), f32)),
        interpret=interpret, name="delta_rule_chunk", **kw,
    )(q, k, v, g, beta, inverse, state.astype(f32))
    return o[:t], state
