"""Gated DeltaNet (Yang, Kautz and Hatamizadeh 2024, arXiv:2412.06464) as a layer: the linear
attention of Qwen3-Next and Qwen3.5's hybrid layers, prefilled in chunks.

Per value head the layer keeps a recurrent state S [dk, dv] and, per token t,
    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T,   o_t = S_t^T q_t,
with q and k L2-normalised (q also scaled by dk^-1/2), beta_t = sigmoid(b_t) and the log-decay
g_t = -exp(A_log) softplus(a_t + dt_bias). Before it, q, k and v pass a depthwise causal conv1d
(`conv_kernel` taps, SiLU) whose window of the last inputs is state too; after it, a gated
RMSNorm (by z) and the output projection.

The delta rule runs chunkwise-parallel (`gated_delta_rule`): the prompt is cut into blocks of
`DELTA_BLOCK` tokens; within a block the rule's updates are folded into matmuls (the UT
transform: each block's unit-lower-triangular system inverted by doubling, then matmuls; no
LAPACK or cuBLAS triangular solve), and the state walks across the blocks, three small matmuls
a block, as a scan; or the whole rule runs in two Pallas kernels (`kernels.delta_rule`,
`Kernels.delta_rule`). No step is per token. The scan sums the decays between two tokens of a
block over their own range (`decay_sums`); the kernels difference cumulative sums.

Products: a float32 layer takes every product of the rule at full float32 (`HIGHEST`); a
bf16/fp16 layer on a GPU, through the Pallas kernels, takes them with bf16 operands (the layer's
own precision: its q, k, v and outputs are bf16), its state and sums staying float32 and the
inverse at TF32 (`products_for`, `kernels.delta_rule`).

Padding: rows where `valid` is False get beta = 0 and g = 0, which leave the state as it was,
and the conv window is read at the last real token, so a padded chunk hands the next one the
state of its real tokens only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from strata_jax.kernels.delta_rule import (PRODUCTS, decay_sums, delta_rule_chunk,
                                           delta_rule_path, doubling_step, iotas, pad_blocks)
from strata_jax.layers.norms import GatedRMSNorm
from strata_jax.layers.params import dot, filled, normal

__all__ = ["DELTA_BLOCK", "SCAN_UNROLL", "PRODUCTS", "GatedDeltaNet", "gated_delta_rule",
           "block_terms", "causal_conv", "decay_sums", "l2_normalize", "products_for",
           "unit_lower_inverse"]

# Tokens per block of the chunkwise delta rule (the UT transform's triangular systems).
DELTA_BLOCK = 64
# Blocks a step of the scan's while loop walks (`lax.scan`'s unroll): on a GPU each step of
# XLA's loop is a round trip through the host, so a step taking several blocks takes fewer.
SCAN_UNROLL = 1
_HIGHEST = lax.Precision.HIGHEST


def products_for(dtype, carry: str = "xla", platform: str | None = None) -> str:
    """The delta rule's products for a layer whose activations are `dtype`, run by `carry`
    (`kernels.delta_rule.delta_rule_path`): "bf16" for the Pallas kernels in a bf16/fp16 layer
    on a GPU; "float32" otherwise (the scan keeps the float32 products it was measured with)."""
    platform = platform or jax.default_backend()
    fast = platform == "gpu" and jnp.dtype(dtype).itemsize < 4 and carry == "pallas"
    return "bf16" if fast else "float32"


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis (float32 in, float32 out)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(x: jax.Array, window: jax.Array, taps: jax.Array, n_valid=None):
    """Depthwise causal conv1d with SiLU over a chunk, continuing from the previous window.

    Args:
        x: [T, C] the chunk's inputs.
        window: [K-1, C] the inputs of the K-1 positions before the chunk (zeros at the start).
        taps: [K, C]; out[t] = sum_j taps[j] * input[t - (K-1) + j], so taps[K-1] weighs the
            current token.
        n_valid: None (every row real) or an int32 scalar: the window handed on ends at the
            last real row.

    Returns:
        (silu(conv) [T, C] in x.dtype, the next window [K-1, C] in window.dtype).
    """
    t, kk = x.shape[0], taps.shape[0]
    full = jnp.concatenate([window.astype(x.dtype), x], axis=0)  # [K-1+T, C]
    ff = full.astype(jnp.float32)
    tf = taps.astype(jnp.float32)
    out = sum(ff[j:j + t] * tf[j] for j in range(kk))
    end = t if n_valid is None else jnp.asarray(n_valid, jnp.int32)
    nxt = lax.dynamic_slice_in_dim(full, end, kk - 1, axis=0)  # rows end..end+K-2 = last K-1 real
    return jax.nn.silu(out).astype(x.dtype), nxt.astype(window.dtype)


@functools.partial(jax.jit, static_argnames=("block", "carry", "products", "unroll",
                                             "out_dtype"))
def gated_delta_rule(q, k, v, g, beta, state, block: int | None = None, carry: str = "auto",
                     products: str = "float32", unroll: int | None = None,
                     out_dtype=jnp.float32):
    """The gated delta rule over a chunk, chunkwise-parallel.

    Args:
        q, k: float32 [T, Hk, dk] (normalised; q scaled), Hk dividing Hv: value head h reads
            query/key head h // (Hv / Hk).
        v: [T, Hv, dv], float32 or the layer's dtype (read as float32).
        g: float32 [T, Hv] log-decays (<= 0); beta: float32 [T, Hv] in [0, 1].
        state: float32 [Hv, dk, dv], the state before the chunk.
        block: tokens per block (default: `DELTA_BLOCK` for the scan; the kernels'
            `kernels.delta_rule.KERNEL_BLOCKS` for their products).
        carry: the implementation (`Kernels.delta_rule`): "xla" (a scan walks the state),
            "pallas" (`kernels.delta_rule.delta_rule_chunk`) or "auto" (`delta_rule_path`).
        products: "float32" or "bf16" (`products_for`; the scan's inverse stays float32).
        unroll: blocks a step of the scan walks (default `SCAN_UNROLL`; the scan's only).
        out_dtype: o's dtype (the float32 sums cast once; the kernels store it so).

    Returns:
        (o [T, Hv, dv] in out_dtype, the float32 state after the chunk's last row).
    """
    carry = delta_rule_path(carry, products=products)  # refuses unknown products by name
    if carry == "pallas":
        return delta_rule_chunk(q, k, v, g, beta, state, block=block, products=products,
                                out_dtype=out_dtype)
    v = v.astype(jnp.float32)
    block = block or DELTA_BLOCK
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"delta rule: {hk} key heads do not divide {hv} value heads")
    if hv > hk:
        q, k = (jnp.repeat(a, hv // hk, axis=1) for a in (q, k))
    n, q, k, v, g, beta = pad_blocks(block, q, k, v, g, beta)

    w, qd, kd, u, attn, last = block_terms(q, k, v, g, beta, block, products)
    inter, v_new, state = _carry_scan(w, qd, kd, u, last, state, products,
                                      unroll or SCAN_UNROLL)
    o = inter + _mm(attn, v_new, products)
    o = jnp.moveaxis(o, 0, 2).reshape(n * block, hv, dv)[:t]
    return o.astype(out_dtype), state


def block_terms(q, k, v, g, beta, block: int, products: str = "float32"):
    """The parallel part of the chunkwise rule: per block of `block` tokens (T a multiple of
    it), the UT transform and the products that need no state. The transform inverts each
    block's unit-lower system (`unit_lower_inverse`: matmuls, no triangular solve) and
    multiplies the block's values and keys by it.

    Returns (w, qd, kd [Hv, n, C, dk]; u [Hv, n, C, dv]; attn [Hv, n, C, C] (causal within the
    block, decayed); last [Hv, n] (each block's total log-decay)): the block's keys reading
    the state, its queries and keys decayed from the block's start and to its end, its new
    values before the state's part."""
    t, hv, _ = q.shape
    n = t // block
    dv = v.shape[-1]

    def blocks(a):  # [n*C, Hv, ...] -> [Hv, n, C, ...]
        a = a.reshape(n, block, hv, *a.shape[2:])
        return jnp.moveaxis(a, 2, 0)

    q, k, v, g, beta = (blocks(a) for a in (q, k, v, g, beta))
    gam = jnp.cumsum(g, axis=-1)  # [Hv, n, C] log-decay from the block's start
    lower = jnp.tril(jnp.ones((block, block), bool))
    diff, _ = decay_sums(g)  # [Hv, n, C, C]: gam_i - gam_j, summed over (j, i] only
    decay = jnp.exp(jnp.where(lower, diff, -jnp.inf))  # exp(gam_i - gam_j), i >= j; else 0
    kb = k * beta[..., None]
    vb = v * beta[..., None]
    kkt = _mm(kb, jnp.swapaxes(k, -1, -2), products) * decay  # [Hv, n, C, C]
    strict = jnp.tril(jnp.ones((block, block), bool), -1)
    system = jnp.where(strict, kkt, 0.0) + jnp.eye(block, dtype=jnp.float32)
    inverse = unit_lower_inverse(system)
    rhs = jnp.concatenate([vb, kb * jnp.exp(gam)[..., None]], axis=-1)  # [Hv, n, C, dv+dk]
    solved = _mm(inverse, rhs, products)
    u, w = solved[..., :dv], solved[..., dv:]  # new values; decayed keys reading the state
    attn = _mm(q, jnp.swapaxes(k, -1, -2), products) * decay  # [Hv, n, C, C], causal
    qd = q * jnp.exp(gam)[..., None]
    last = gam[..., -1]  # [Hv, n]
    kd = k * jnp.exp(diff[..., -1, :])[..., None]  # keys decayed to the block's end
    return w, qd, kd, u, attn, last


def unit_lower_inverse(system):
    """The inverse of unit-lower-triangular matrices `system` [..., C, C] (C a power of two)
    by doubling, matmuls only: the inverse of [[A, 0], [B, D]] is [[A^-1, 0], [-D^-1 B A^-1,
    D^-1]]. X starts as I (the 1 x 1 diagonal blocks' inverses); at block size b, X holds the
    b x b diagonal blocks' inverses and X - X (L masked to each pair's B block) X the 2b x 2b
    ones: log2 C steps of two full-size matmuls (`kernels.delta_rule.doubling_step`), one loop
    body (the inverse kernel unrolls the same steps)."""
    *lead, c, _ = system.shape
    if c & (c - 1):
        raise ValueError(f"unit_lower_inverse: blocks of {c} rows; expected a power of two")
    r, col = iotas(c)
    eye = jnp.eye(c, dtype=system.dtype)
    low = system - eye

    def double(level, x):
        return doubling_step(x, low, r, col, jnp.left_shift(1, level), _mm)

    return lax.fori_loop(0, c.bit_length() - 1, double, jnp.broadcast_to(eye, system.shape))


def _mm(a, b, products: str = "float32"):
    if products == "bf16":  # bf16 operands, float32 sums
        return jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)
    return jnp.matmul(a, b, precision=_HIGHEST)


def _carry_scan(w, qd, kd, u, last, state, products: str = "float32", unroll: int = 1):
    """`kernels.delta_rule`'s walk over the blocks as a scan: w, qd, kd [Hv, n, C, dk], u
    [Hv, n, C, dv], last [Hv, n]. Returns (inter, new [Hv, n, C, dv], the last state)."""
    block = w.shape[2]
    reads = jnp.concatenate([w, qd], axis=-2)  # [Hv, n, 2C, dk]

    def step(s, xs):
        reads_i, u_i, kd_i, last_i = xs  # [Hv, 2C, dk], [Hv, C, dv], [Hv, C, dk], [Hv]
        r = _mm(reads_i, s, products)  # [Hv, 2C, dv]
        v_new = u_i - r[:, :block]
        s = s * jnp.exp(last_i)[:, None, None] + _mm(jnp.swapaxes(kd_i, -1, -2), v_new,
                                                     products)
        return s, (r[:, block:], v_new)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (reads, u, kd, last))  # blocks first
    state, (inter, v_new) = lax.scan(step, state.astype(jnp.float32), xs, unroll=unroll)
    return tuple(jnp.moveaxis(a, 0, 1) for a in (inter, v_new)) + (state,)


class GatedDeltaNet(nnx.Module):
    """A Gated DeltaNet layer (see the module docstring).

    Parameters, in the model's layout:
        in_proj [H, 2*Kd + 2*Vd]: q (Hk heads of dk), k, v (Hv heads of dv), z, in that order.
        in_gates [H, 2*Hv]: b, then a.
        conv [K, 2*Kd + Vd]: the conv taps over q, k, v.
        dt_bias, A_log [Hv]; norm.weight [dv]; out_proj [Vd, H].
    Value head h reads query/key head h // (Hv / Hk).
    """

    def __init__(self, hidden: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int,
                 conv_kernel: int, eps: float, dtype, *, rngs: nnx.Rngs | None,
                 delta_rule: str = "auto"):
        if v_heads % k_heads:
            raise ValueError(f"linear attention value heads ({v_heads}) must be a multiple of "
                             f"its key heads ({k_heads})")
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = k_heads, v_heads, k_dim, v_dim
        self.conv_kernel = conv_kernel
        self.delta_rule = delta_rule  # `Kernels.delta_rule`
        kd, vd = k_heads * k_dim, v_heads * v_dim
        self.conv_dim = 2 * kd + vd
        self.in_proj = nnx.Param(normal(rngs, (hidden, 2 * kd + 2 * vd), dtype))
        self.in_gates = nnx.Param(normal(rngs, (hidden, 2 * v_heads), dtype))
        self.conv = nnx.Param(normal(rngs, (conv_kernel, self.conv_dim), dtype, std=0.5))
        self.dt_bias = nnx.Param(filled(rngs, (v_heads,), dtype, 1.0))
        self.A_log = nnx.Param(filled(rngs, (v_heads,), dtype, 0.0))
        self.norm = GatedRMSNorm(v_dim, eps, dtype, rngs)
        self.out_proj = nnx.Param(normal(rngs, (vd, hidden), dtype))

    def __call__(self, x, window, state, valid=None):
        """x [T, H]; window [K-1, C]; state float32 [Hv, dk, dv]; valid: None (every row
        real) or bool [T], True on a prefix of real rows.

        Returns (out [T, H], next window, next state)."""
        t = x.shape[0]
        n_valid = None if valid is None else jnp.sum(valid.astype(jnp.int32))
        kd, vd = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        proj = dot(x, self.in_proj[...])  # [T, 2Kd + 2Vd]
        gates = dot(x, self.in_gates[...])  # [T, 2Hv]
        mixed, z = proj[:, :self.conv_dim], proj[:, self.conv_dim:]
        mixed, window = causal_conv(mixed, window, self.conv[...], n_valid)
        q = mixed[:, :kd].reshape(t, self.k_heads, self.k_dim)
        k = mixed[:, kd:2 * kd].reshape(t, self.k_heads, self.k_dim)
        v = mixed[:, 2 * kd:].reshape(t, self.v_heads, self.v_dim)
        b, a = gates[:, :self.v_heads], gates[:, self.v_heads:]
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        if valid is not None:
            beta = jnp.where(valid[:, None], beta, 0.0)
            g = jnp.where(valid[:, None], g, 0.0)
        qf = l2_normalize(q.astype(jnp.float32)) * (self.k_dim ** -0.5)
        kf = l2_normalize(k.astype(jnp.float32))
        with jax.named_scope("delta_rule"):
            # auto picks by the products the kernels would take; the path taken sets them
            carry = delta_rule_path(self.delta_rule, products=products_for(x.dtype, "pallas"))
            o, state = gated_delta_rule(qf, kf, v, g, beta, state, carry=carry,
                                        products=products_for(x.dtype, carry),
                                        out_dtype=x.dtype)
        o = self.norm(o, z.reshape(t, self.v_heads, self.v_dim))
        return dot(o.reshape(t, vd), self.out_proj[...]), window, state
