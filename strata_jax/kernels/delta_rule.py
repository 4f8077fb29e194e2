"""The sequential part of the chunkwise gated delta rule as one Pallas (Triton) kernel.

`layers.deltanet.gated_delta_rule` folds each block of C tokens into matmuls that need only the
state before the block; what stays sequential is the state's walk over the blocks: per block i
and value head,

    inter_i = qd_i @ S          (the block's queries reading the state, [C, dv])
    new_i   = u_i - w_i @ S     (the block's new values, [C, dv])
    S       = exp(last_i) S + kd_i^T @ new_i

As an XLA scan this is a loop of small batched matmuls and several kernels a block. Here one
program walks all blocks of one value head for one slice of `bv` state columns (the columns are
independent: a column of S only reads the same column of u and S), its [dk, bv] part of the state
in registers, so a block costs three small matmuls and no launch. float32 data and state; the
products as the layer asks (`layers.deltanet.products_for`): "tf32" on tensor cores (a bf16/fp16
layer), or "float32" (Triton's "ieee": CUDA-core products, for float32 layers and tests).

On the CPU the kernel runs in Pallas' interpret mode (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from strata_jax.kernels import DELTA_RULES

__all__ = ["delta_rule_carry", "delta_rule_path", "AUTO_ON_GPU"]

# What "auto" runs on a GPU for TF32 products (float32 products: the scan).
AUTO_ON_GPU = "pallas"


def delta_rule_path(impl: str = "auto", platform: str | None = None,
                    products: str = "float32") -> str:
    """The carry's implementation: "pallas" (the kernel) or "xla" (a scan); auto: on a GPU with
    TF32 products `AUTO_ON_GPU`, else the scan."""
    impl = (impl or "auto").lower()
    if impl not in DELTA_RULES:
        raise ValueError(f"delta rule {impl!r}: expected one of {'|'.join(DELTA_RULES)}")
    if impl == "auto":
        platform = platform or jax.default_backend()
        return AUTO_ON_GPU if platform == "gpu" and products == "tf32" else "xla"
    return impl


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
    for name, size in (("block", block), ("dk", dk), ("dv", dv), ("bv", bv)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"delta_rule_carry: {name}={size} must be a power of two >= 16")
    if rows != n * block or dv % bv:
        raise ValueError(f"delta_rule_carry: {rows} rows for {n} blocks of {block}, "
                         f"dv={dv} in slices of {bv}")
    if products not in ("float32", "tf32"):
        raise ValueError(f"delta_rule_carry: products={products!r}: expected float32|tf32")
    precision = lax.Precision.DEFAULT if products == "tf32" else lax.Precision.HIGHEST
    if interpret is None:
        interpret = jax.devices()[0].platform != "gpu"
    kw = {} if interpret else {
        "compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
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

