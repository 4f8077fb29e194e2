"""Compile the GPU kernels for a Hopper GPU on a machine without one: whether each compiles,
its registers and spilled bytes (ptxas on the PTX XLA emits), and XLA's temporary memory for a
hybrid model's layers against the engine's memory plan.

XLA compiles for a GPU it is only told about (a "compile-only" device from a target
description: SMs, shared memory, registers, memory), so kernel launches that would spill or
fail to compile, and layers whose buffers outgrow the plan, show up before any GPU time is
spent. Needs jax's CUDA plugin installed (`pip install "jax[cuda12]"`; no GPU or driver) and,
for registers, a `ptxas` (a CUDA toolkit's, or the plugin's nvidia-cuda-nvcc wheel).

    python -m strata_jax.benchmarks.compile_check --target h100 --tokens 32768 --json out.json

Cases: `delta-rule` (the Pallas delta rule at the real head sizes of `--preset`: bf16
products, a bf16 layer's, in blocks of 64 at `hybrid_bench.PALLAS_LAUNCHES` and the
transform's `TRANSFORM_LAUNCHES`; float32 products, a float32 layer's, at their default launch);
`layers` (the token
mixers of `--preset` and `--mla-preset`: a hybrid's Gated DeltaNet layer through each
`Kernels.delta_rule` and its gated attention layer, latent attention; a first chunk of
`--tokens` and a later `--chunk` over that cache at a traced start, against
`engine.memory.attention_working_bytes`); `model` (each preset's first `--layers` layers,
experts resident, a first chunk of `--tokens`, against `engine.memory.chunk_bytes`); `parts`
(`--mla-preset`'s first `--layers` layers with fp8 experts, layer-major over `--tokens` in
sub-chunks of `--sub-chunk`, each MoE layer in `--parts` parts read from three ring frames
given as program inputs in the stream's order, compiled with the engine's options for such a
program, against `engine.memory.layer_major_bytes`). Exit status 1 where a compile fails, the
default launch (bf16, blocks of 64) spills, or temporaries exceed the plan.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

# Hopper targets: what XLA's GPU compiler reads of a device (public specifications).
TARGETS = {
    "h100": {"name": "NVIDIA H100 80GB HBM3", "memory": 85_520_809_984, "bandwidth": 3.35e12},
    "h200": {"name": "NVIDIA H200", "memory": 150_754_820_096, "bandwidth": 4.8e12},
}
_HOPPER = dict(core_count=132, threads_per_block_limit=1024, threads_per_warp=32,
               shared_memory_per_block=49152, shared_memory_per_core=233472,
               shared_memory_per_block_optin=232448, threads_per_core_limit=2048,
               fpus_per_core=128, block_dim_limit_x=2147483647, block_dim_limit_y=65535,
               block_dim_limit_z=65535, l2_cache_size=52428800, clock_rate_ghz=1.98,
               registers_per_core_limit=65536, registers_per_block_limit=65536)
CASES = ("delta-rule", "layers", "model", "parts")


def target_config(target: str) -> str:
    """The GpuTargetConfig text proto XLA compiles for: Hopper (sm_90) with `target`'s memory."""
    if target not in TARGETS:
        raise ValueError(f"target {target!r}: expected one of {'|'.join(TARGETS)}")
    t = TARGETS[target]
    fields = dict(_HOPPER, memory_bandwidth=int(t["bandwidth"]), device_memory_size=t["memory"])
    body = "".join(f"  {k}: {v}\n" for k, v in fields.items())
    return (f"gpu_device_info {{\n{body}  cuda_compute_capability {{\n    major: 9\n  }}\n}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{\n  major: 9\n  minor: 10\n}}\n'
            f'device_description_str: "{t["name"]}"\n')


def find_ptxas() -> str | None:
    """A ptxas: on PATH, under $CUDA_HOME or /usr/local/cuda*, or in the nvidia-cuda-nvcc
    wheel the CUDA plugin installs."""
    found = shutil.which("ptxas")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(
        glob.glob("/usr/local/cuda-*"), reverse=True)]
    try:
        import nvidia.cuda_nvcc as nvcc  # the plugin's toolkit wheel
        roots += list(nvcc.__path__)
    except ImportError:
        pass
    for root in roots:
        path = os.path.join(root, "bin", "ptxas")
        if root and os.access(path, os.X_OK):
            return path
    return None


def parse_ptxas(text: str) -> dict[str, dict]:
    """`ptxas -v` output -> {kernel: {"registers", "spill_stores", "spill_loads"}}."""
    out, name = {}, None
    for line in text.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = {"registers": None, "spill_stores": 0, "spill_loads": 0}
            continue
        if name is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[name]["spill_stores"], out[name]["spill_loads"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[name]["registers"] = int(m.group(1))
    return out


def compile_only_device(target: str):
    """A compile-only CUDA device of `target` (jax's CUDA plugin, no GPU needed)."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check
    import jax
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc("compile_check", "cuda",
                                                target_config=target_config(target),
                                                topology="1x1x1")
    except Exception as e:  # noqa: BLE001 - the plugin's absence shows as several kinds
        raise RuntimeError(
            f"no compile-only CUDA device ({str(e).splitlines()[0][:200]}): install jax's CUDA "
            f'plugin (pip install "jax[cuda12]=={jax.__version__}"); no GPU is needed') from e
    return topology.devices[0]


@contextlib.contextmanager
def as_gpu(device):
    """The library's platform checks (`jax.devices()`, `jax.default_backend()`, cuDNN's
    compute capability) answer for `device` while compiling for it."""
    import jax
    from jax._src.cudnn import fused_attention_stablehlo as fa

    saved = (jax.devices, jax.default_backend, getattr(fa, "check_compute_capability", None))
    cap = tuple(int(x) for x in device.compute_capability.split("."))
    jax.devices = lambda *a, **k: [device]
    jax.default_backend = lambda: "gpu"
    if saved[2] is not None:
        fa.check_compute_capability = lambda c: cap >= tuple(int(x) for x in c.split("."))
    try:
        yield
    finally:
        jax.devices, jax.default_backend = saved[:2]
        if saved[2] is not None:
            fa.check_compute_capability = saved[2]


def compile_report(fn, args, ptxas: str | None, options: dict | None = None) -> dict:
    """Compile jitted `fn` on `args` (ShapeDtypeStructs on the compile-only device) with XLA
    `options`: temp bytes and, with `ptxas`, each kernel's registers and spills."""
    import jax

    dump = tempfile.mkdtemp(prefix="compile_check_")
    try:
        compiled = jax.jit(fn).trace(*args).lower().compile({**(options or {}),
                                                             "xla_dump_to": dump})
        row = {"ok": True, "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
               "kernels": {}}
        for ptx in glob.glob(os.path.join(dump, "*.ptx")) if ptxas else ():
            if os.path.getsize(ptx):
                run = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                                     capture_output=True, text=True, timeout=600, check=False)
                row["kernels"].update(parse_ptxas(run.stderr))
        return row
    except Exception as e:  # noqa: BLE001 - a compile failure is the finding
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        return {"ok": False, "error": " | ".join(lines[:4])[:600]}
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def on_device(device, tree):
    """`tree`'s arrays or shapes as ShapeDtypeStructs placed on `device`."""
    import jax
    from jax.sharding import SingleDeviceSharding

    where = SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where), tree)


def delta_rule_rows(cfg, device, tokens: int, ptxas) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from strata_jax.benchmarks.hybrid_bench import PALLAS_LAUNCHES, TRANSFORM_LAUNCHES
    from strata_jax.kernels import delta_rule as dr

    f32 = lambda *s: on_device(device, jax.ShapeDtypeStruct(s, jnp.float32))  # noqa: E731
    hk, hv = cfg.linear_k_heads, cfg.linear_v_heads
    dk, dv = cfg.linear_k_dim, cfg.linear_v_dim
    args = (f32(tokens, hk, dk), f32(tokens, hk, dk), f32(tokens, hv, dv), f32(tokens, hv),
            f32(tokens, hv), f32(hv, dk, dv))

    bf16 = dr.TRANSFORM_WARPS["bf16"]
    launches = [("bf16", 64, bf16, launch) for launch in PALLAS_LAUNCHES]
    launches += [("bf16", 64, tw, (dr.WALK_COLUMNS["bf16"], dr.WALK_WARPS["bf16"],
                                   dr.WALK_STAGES["bf16"])) for tw in TRANSFORM_LAUNCHES
                 if tw != bf16]
    launches += [("float32", dr.KERNEL_BLOCKS["float32"], dr.TRANSFORM_WARPS["float32"],
                  (dr.WALK_COLUMNS["float32"], dr.WALK_WARPS["float32"], 1))]
    rows = []
    for products, block, tw, (bv, warps, stages) in launches:
        fn = lambda *a, p=products, b=block, tw=tw, bv=bv, w=warps, s=stages: \
            dr.delta_rule_chunk(*a, block=b, products=p, transform_warps=tw, interpret=False,
                                bv=bv, num_warps=w, num_stages=s)  # noqa: E731
        row = {"case": "delta-rule", "products": products, "block": block,
               "transform_warps": tw, "bv": bv, "num_warps": warps, "num_stages": stages,
               "tokens": tokens,
               "default": (block, tw, bv, warps, stages) == (
                   dr.KERNEL_BLOCKS[products], dr.TRANSFORM_WARPS[products],
                   dr.WALK_COLUMNS[products], dr.WALK_WARPS[products],
                   dr.WALK_STAGES[products]),
               **compile_report(fn, args, ptxas)}
        rows.append(row)
        _print(row, f"delta rule {products:7s} blocks of {block:3d} (transform {tw} warps), "
                    f"{bv:3d} columns, {warps} warps, {stages} stages")
    return rows


def layer_rows(cfg, device, tokens: int, chunk: int, ptxas) -> list[dict]:
    """The token mixers of `cfg` (a hybrid's DeltaNet layer through each delta rule and its
    gated attention layer; an MLA model's latent attention), a first chunk of `tokens` and a
    later `chunk` over a cache of `tokens` positions at a traced start (the engine's), each
    against `engine.memory.attention_working_bytes`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from strata_jax.engine.memory import attention_working_bytes

    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, tokens))
    rows = []
    for kind, make, cache in _mixers(cfg, tokens):
        graph, state = nnx.split(nnx.eval_shape(make))
        for queries, first in ((tokens, True), (chunk, False)):
            def run(state, x, a, b, start, graph=graph, queries=queries, first=first):
                start = 0 if first else start
                return nnx.merge(graph, state)(
                    x, a, b, start, start + jnp.arange(queries, dtype=jnp.int32))

            args = on_device(device, (state, jax.ShapeDtypeStruct((queries, cfg.hidden_size),
                                                                  cfg.dtype),
                                      *cache, jax.ShapeDtypeStruct((), jnp.int32)))
            plan = attention_working_bytes(cfg, queries, tokens, first=first, platform="gpu")
            row = {"case": "layers", "mixer": kind, "queries": queries, "capacity": tokens,
                   "first": first, "plan_bytes": int(plan), **compile_report(run, args, ptxas)}
            rows.append(row)
            _print(row, f"{kind:24s} " + (f"first {queries}" if first else
                                          f"{queries} over {tokens}"))
    return rows


def model_rows(cfg, device, tokens: int, layers: int, ptxas) -> list[dict]:
    """`cfg`'s first `layers` layers, experts resident, a first chunk of `tokens` (the
    engine's program less the stream): XLA's temporaries against `engine.memory.chunk_bytes`,
    the activations the plan counts (`CHUNK_HEADROOM` times them)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from strata_jax.engine.memory import chunk_bytes
    from strata_jax.models import cache_shapes, model_module

    cfg = cfg.replace(n_layers=min(layers, cfg.n_layers), max_seq_len=max(cfg.max_seq_len,
                                                                          tokens))
    graph, state = nnx.split(model_module(cfg).abstract_model(cfg))

    def run(state, ids, cache):
        return nnx.merge(graph, state)(ids, cache, 0, None)

    args = on_device(device, (state, jax.ShapeDtypeStruct((tokens,), jnp.int32),
                              cache_shapes(cfg, tokens)))
    row = {"case": "model", "model": cfg.name, "layers": cfg.n_layers, "tokens": tokens,
           "plan_bytes": int(chunk_bytes(cfg, tokens, tokens, first=True, platform="gpu")),
           **compile_report(run, args, ptxas)}
    _print(row, f"{cfg.name}, {cfg.n_layers} layers, first {tokens}")
    return [row]


class _RingParts:
    """The stream's source of a layer in parts (`stream.StreamedExperts`) as a compile-only
    program sees it, without the native library: part p's weights are ring frame p % frames
    (a program input, read in place), available after the part before's release; a release
    waits for every output of the part's math."""

    def __init__(self, fmt, dtype, frames, per: int, parts: int):
        import jax.numpy as jnp

        self.fmt, self.dtype, self.frames, self.per, self.parts = fmt, dtype, frames, per, parts
        self.token, self.taken = jnp.zeros((), jnp.int32), 0

    def expert_parts(self, layer):
        return tuple((p * self.per, (p + 1) * self.per) for p in range(self.parts))

    def expert_weights_part(self, layer, counts, part):
        import jax

        from strata_jax.stream.source import frame_planes

        if part == 0:
            self.token = self.token + counts.sum()
        frame = self.frames[self.taken % len(self.frames)]
        self.taken += 1
        views, self.token = jax.lax.optimization_barrier(
            (tuple(frame[p.name] for p in self.fmt.planes), self.token + 1))
        return self.fmt.expert_matrices(frame_planes(self.fmt, views), self.dtype)

    def release_part(self, layer, part, outs):
        import jax

        outs = jax.lax.optimization_barrier(outs)
        tok = self.token + jax.tree_util.tree_leaves(outs)[0][0, 0].astype(self.token.dtype)
        outs, self.token = jax.lax.optimization_barrier((outs, tok))
        return outs


def parts_rows(cfg, device, tokens: int, sub: int, layers: int, parts: int, ptxas
               ) -> list[dict]:
    """`cfg`'s first `layers` layers with fp8 experts, layer-major over `tokens` in
    sub-chunks of `sub`, each MoE layer in `parts` parts from three ring frames (`_RingParts`),
    compiled with the engine's options for it: XLA's temporaries against
    `engine.memory.layer_major_bytes`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from strata_jax.engine.memory import layer_major_bytes
    from strata_jax.formats import ExpertFormat, quantized_config
    from strata_jax.layers.moe import PARTS_COMPILER_OPTIONS
    from strata_jax.models import cache_shapes, model_module
    from strata_jax.stream.streamer import _dlpack_dtype

    cfg = quantized_config(cfg.replace(n_layers=min(layers, cfg.n_layers),
                                       max_seq_len=max(cfg.max_seq_len, tokens)), "fp8", 128)
    fmt, per = ExpertFormat.of(cfg), cfg.n_experts // parts
    # The stream's frames as DLPack gives them (`_dlpack_dtype`: a float8 plane as bytes).
    frames = tuple({p.name: jax.ShapeDtypeStruct((per, *p.shape), _dlpack_dtype(p.dtype))
                    for p in fmt.planes} for _ in range(3))
    graph, state = nnx.split(model_module(cfg).abstract_model(cfg, resident_experts=False))

    def run(state, ids, cache, frames):
        source = _RingParts(fmt, cfg.dtype, frames, per, parts)
        return nnx.merge(graph, state).layer_major(ids, cache, 0, source, sub,
                                                   last_logits=True)[0]

    args = on_device(device, (state, jax.ShapeDtypeStruct((tokens,), jnp.int32),
                              cache_shapes(cfg, tokens), frames))
    row = {"case": "parts", "model": cfg.name, "layers": cfg.n_layers, "tokens": tokens,
           "sub_chunk": sub, "parts": parts,
           "plan_bytes": int(layer_major_bytes(cfg, tokens, sub, tokens, sub, platform="gpu",
                                               parts=parts)),
           **compile_report(run, args, ptxas, PARTS_COMPILER_OPTIONS)}
    _print(row, f"{cfg.name}, {cfg.n_layers} layers, layer-major {tokens} in {sub}, "
                f"{parts} parts")
    return [row]


def _mixers(cfg, tokens):
    """(name, a maker of the mixer, its cache shapes) for `cfg`'s token mixers; each mixer is
    called (x, cache a, cache b, start, positions)."""
    from flax import nnx

    from strata_jax.kernels import DELTA_RULES, Kernels
    from strata_jax.models import cache_shapes
    from strata_jax.models.hybrid import HybridConfig

    caches = cache_shapes(cfg, tokens)
    if not isinstance(cfg, HybridConfig):
        from strata_jax.layers.mla import LatentAttention

        return [("latent attention", lambda: LatentAttention(
            cfg, rngs=nnx.Rngs(0), layer=0, kernels=Kernels()),
            (caches.keys[0], caches.values[0]))]
    from strata_jax.models.hybrid import HybridLayer

    class Mixer(nnx.Module):  # a hybrid layer's mixer with its input norm
        def __init__(self, layer, rule):
            self.block = HybridLayer(cfg, layer, rngs=nnx.Rngs(0),
                                     kernels=Kernels(delta_rule=rule))

        def __call__(self, x, a, b, start, positions):
            return self.block.attention_block(x, a, b, start, positions)

    linear = next(i for i in range(cfg.n_layers) if cfg.is_linear(i))
    full = next(i for i in range(cfg.n_layers) if not cfg.is_linear(i))
    return [("gated-attention" if layer == full else f"gated-deltanet ({rule})",
             lambda layer=layer, rule=rule: Mixer(layer, rule),
             (caches.keys[layer], caches.values[layer]))
            for layer, rule in [(linear, r) for r in DELTA_RULES if r != "auto"]
            + [(full, "auto")]]


def _print(row: dict, what: str) -> None:
    if not row["ok"]:
        print(f"{what}: FAILED {row['error']}", flush=True)
        return
    spilled = {k: v for k, v in row["kernels"].items() if v["spill_stores"]}
    regs = max((v["registers"] or 0 for v in row["kernels"].values()), default=0)
    extra = f", plan {row['plan_bytes'] / 2**20:,.0f} MiB" if "plan_bytes" in row else ""
    print(f"{what}: temp {row['temp_bytes'] / 2**20:,.0f} MiB{extra}; "
          f"{len(row['kernels'])} kernels, most registers {regs}, "
          + (", ".join(f"{k} spills {v['spill_stores']} B" for k, v in spilled.items())
             or "no spills"), flush=True)


def problems(rows: list[dict]) -> list[str]:
    """What fails the check: a compile failure, a spilled default launch, a layer's
    temporaries above the plan."""
    out = []
    for r in rows:
        name = r.get("mixer") or r.get("model") or (
            f"delta rule {r.get('products')} {r.get('block')}/{r.get('bv')}")
        if not r["ok"]:
            out.append(f"{name}: does not compile")
        elif r.get("default") and any(v["spill_stores"] for v in r["kernels"].values()):
            out.append(f"{name}: the default launch spills registers")
        elif "plan_bytes" in r and r["temp_bytes"] > r["plan_bytes"]:
            out.append(f"{name}: {r['temp_bytes']:,} temporary bytes, plan {r['plan_bytes']:,}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="h100", choices=sorted(TARGETS))
    ap.add_argument("--preset", default="qwen3-next-80b-a3b",
                    help="the hybrid model (delta-rule and layers)")
    ap.add_argument("--mla-preset", default="deepseek-v3", help="the MLA model (layers)")
    ap.add_argument("--tokens", type=int, default=32768, help="a first chunk; the cache")
    ap.add_argument("--chunk", type=int, default=8192, help="a later chunk over the cache")
    ap.add_argument("--layers", type=int, default=4, help="the model and parts cases' layers")
    ap.add_argument("--sub-chunk", type=int, default=2048, help="the parts case's sub-chunk")
    ap.add_argument("--parts", type=int, default=16, help="the parts case's parts a layer")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of {'|'.join(CASES)}")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"--cases {','.join(bad)}: expected of {'|'.join(CASES)}")
    if not 64 <= a.chunk <= a.tokens:
        ap.error(f"--tokens {a.tokens} --chunk {a.chunk}: 64 <= chunk <= tokens")
    if a.tokens % a.sub_chunk:
        ap.error(f"--tokens {a.tokens} is not a multiple of --sub-chunk {a.sub_chunk}")
    if a.parts < 2:
        ap.error(f"--parts {a.parts}: the parts case needs at least 2")
    from strata_jax.models import get_preset
    from strata_jax.models.hybrid import HybridConfig
    from strata_jax.models.mla import MLAConfig

    cfg, mla = get_preset(a.preset), get_preset(a.mla_preset)
    if not isinstance(cfg, HybridConfig):
        ap.error(f"--preset {a.preset}: not a hybrid (Gated DeltaNet) model")
    if not isinstance(mla, MLAConfig):
        ap.error(f"--mla-preset {a.mla_preset}: not a latent-attention model")
    if "parts" in cases and mla.n_experts % a.parts:
        ap.error(f"--parts {a.parts} does not divide --mla-preset's {mla.n_experts} experts")
    try:
        device = compile_only_device(a.target)
    except RuntimeError as e:
        print(f"compile_check: {e}", file=sys.stderr)
        return 2
    ptxas = find_ptxas()
    if ptxas is None:
        print("compile_check: no ptxas found (CUDA toolkit or nvidia-cuda-nvcc): compiles and "
              "memory only, no registers", file=sys.stderr)
    rows = []
    with as_gpu(device):
        if "delta-rule" in cases:
            rows += delta_rule_rows(cfg, device, min(a.tokens, 8192), ptxas)
        if "layers" in cases:
            for model in (cfg, mla):
                rows += layer_rows(model, device, a.tokens, a.chunk, ptxas)
        if "model" in cases:
            for model in (cfg, mla):
                rows += model_rows(model, device, a.tokens, a.layers, ptxas)
        if "parts" in cases:
            rows += parts_rows(mla, device, a.tokens, a.sub_chunk, a.layers, a.parts, ptxas)
    found = problems(rows)
    for p in found:
        print(f"PROBLEM {p}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "device": device.device_kind, "ptxas": ptxas,
                       "rows": rows, "problems": found}, f, indent=1)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
