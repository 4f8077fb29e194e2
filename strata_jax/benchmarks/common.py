"""What the streaming benchmarks share: the interleaved arm schedule and its pair ratios, fast
synthetic weights and quantized variants, preset slices, the timed read and its hashes, the stream
options of the command line, and the pure-JAX pinned-host baseline.
"""

from __future__ import annotations

import gc
import json
import statistics
import time

import numpy as np

from strata_jax.formats import MXFP4_GROUP, quantized_config

QUANTIZED_MATMUL = {"impl": "auto"}  # --quantized-matmul


def engine(*args, **kwargs):
    """An Engine whose kernels read quantized experts as --quantized-matmul says."""
    from strata_jax.engine import Engine
    from strata_jax.kernels import Kernels
    return Engine(*args, kernels=Kernels(quantized_matmul=QUANTIZED_MATMUL["impl"]), **kwargs)


ORDER = ("stream-all", "routed", "routed", "stream-all", "routed", "stream-all", "stream-all",
         "routed")
PAIRS = ((1, 0), (2, 3), (4, 5), (7, 6))  # (ON, OFF) positions, 0-based
SAME_ARM = ((0, 3), (1, 2), (4, 7), (5, 6))  # two slots of one arm side by side


def schedule(blocks: int) -> tuple[str, ...]:
    """ORDER run `blocks` times over: the arms' slots of one length, each with its own prompt."""
    if blocks < 1:
        raise ValueError(f"blocks={blocks}: must be at least 1")
    return ORDER * blocks


def _pairs(n_slots: int, within=PAIRS) -> list[tuple[int, int]]:
    """`within` (PAIRS, or SAME_ARM) in every block of ORDER among `n_slots` slots."""
    return [(b + x, b + y) for b in range(0, n_slots, len(ORDER)) for x, y in within]


def fast_params(config, seed: int, skew: float) -> dict:
    """Synthetic weights quickly at full expert shapes: experts tile a few random blocks."""
    from strata_jax.models import param_shapes
    from strata_jax.synthetic import _router

    rng = np.random.default_rng(seed)
    out = {}
    for name, spec in param_shapes(config).items():
        shape, leaf = tuple(spec.shape), name.rsplit(".", 1)[-1]
        if leaf == "router":
            v = _router(config, skew, rng)
        elif leaf == "weight":
            v = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        elif leaf == "selection_bias":
            v = np.zeros(shape, np.float32)
        elif leaf in ("gate", "up", "down") and ".mlp." in name and len(shape) == 3:
            base = (rng.standard_normal((8,) + shape[1:], dtype=np.float32)
                    / np.sqrt(shape[1])).astype(spec.dtype)
            v = np.tile(base, (shape[0] // 8 + 1, 1, 1))[: shape[0]]
        else:
            v = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(max(shape[0], 1))
        out[name] = np.ascontiguousarray(np.asarray(v).astype(spec.dtype))
    return out


def quantized(cfg, params, kind: str | None, tile: int | None = None):
    """(config, params) with the experts in format `kind` (`formats.QUANTIZE_CHOICES`; None: as
    they are), quantized as each engine takes them (`weights.QuantizedParams`, 128-wide blocks,
    or the widest of 128, 64, ..., 8 dividing tiny widths; mxfp4's 32)."""
    if kind is None:
        return cfg, params
    from strata_jax.weights import QuantizedParams

    widths = (cfg.hidden_size, cfg.expert_intermediate)
    block = next((b for b in (128, 64, 32, 16, 8) if all(w % b == 0 for w in widths)), 128)
    if kind == "mxfp4":
        block = MXFP4_GROUP
    qcfg = quantized_config(cfg, kind, block)
    return qcfg, QuantizedParams(params, qcfg, tile=tile)


def model_config(preset: str, layers: int, vocab: int, max_tokens: int, tiny: bool = False,
                 quantize: str | None = None):
    """The preset cut to `layers` layers and a `vocab` vocabulary, full expert shapes (or tiny
    widths with `tiny`, for a quick run of the script itself on a CPU; 64 wide for `quantize`
    mxfp4, which reads its inputs in packs of 64)."""
    from strata_jax.models import get_preset

    base = get_preset(preset)
    if tiny:
        base = base.scaled(n_layers=layers, n_experts=min(base.n_experts, 32),
                           top_k=min(base.top_k, 4), vocab_size=min(vocab, 512),
                           max_seq_len=max(4096, max_tokens))
        if quantize == "mxfp4":
            base = base.replace(hidden_size=64 * -(-base.hidden_size // 64),
                                expert_intermediate=64 * -(-base.expert_intermediate // 64))
    return base.replace(name=f"{base.name}-{layers}L", n_layers=layers,
                        n_dense_layers=min(base.n_dense_layers, layers - 1),
                        vocab_size=min(vocab, base.vocab_size) if tiny else vocab,
                        max_seq_len=max(base.max_seq_len, max_tokens))


def median_ms(fn, args, reps: int) -> float:
    """The median wall time of `fn(*args)` in ms over `reps` calls, after one call that
    compiles (each call waits for its outputs)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def write_rows(path: str | None, args, rows: list) -> None:
    """A benchmark's rows and its parsed arguments as JSON at `path` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


def bootstrap_ci(ratios, n: int = 20000, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap 95% interval of the mean of `ratios`."""
    r = np.asarray(ratios, np.float64)
    idx = np.random.default_rng(seed).integers(0, r.size, (n, r.size))
    means = r[idx].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def _timed(engine, tokens, session=None, *, collect=True, **prefill_args):
    if collect:
        gc.collect()  # see _gc_note
    t0 = time.perf_counter()
    r = engine.prefill(tokens, session, sync_chunks=False, **prefill_args)
    return (time.perf_counter() - t0) * 1e3, r


# _drop_note: each timed result is dropped before the next timed call, as a caller that has
# read it would. Held, the last result (its KV cache is 1 GB at 32K) stays alive through the
# next call, which then takes longer than the same prefill back to back in `timeline` (_gc_note).
#
# _gc_note: hashing a result leaves its host copies (the KV cache, 0.5 GB at 32K) for jaxlib to
# free later, and the next JAX call frees them first (PythonRefManager::CollectGarbage, inside
# that call's device_put), before its program launches (`timeline --between hash-hold` shows it).
# That is the caller's garbage, not the prefill's: each timed call starts after gc.collect(),
# whose callback makes jaxlib free it then.


def _hashes(r):
    from strata_jax.engine import sha256_of

    return sha256_of(r.logits), r.session.kv_sha256()


def add_model_args(ap) -> None:
    """The model options of the streaming benchmarks (model_config's preset, layers, vocab)."""
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)


def add_stream_args(ap) -> None:
    """The streamed arms' options that _stream_config reads."""
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--publish", default="event", choices=["callback", "event"],
                    help="the stream arms' publish mode (StreamTuning.publish)")
    ap.add_argument("--ring-gib", type=float, default=8.0)
    ap.add_argument("--layout", default="auto", choices=["auto", "frames", "packed"],
                    help="how streamed chunks lay the ring out (StreamTuning.layout): packed "
                         "below --frames-from tokens and frames from there on (auto), or one "
                         "of them for every chunk")
    ap.add_argument("--frames-from", type=int, default=None,
                    help="layout auto's crossover in tokens (StreamTuning.frames_from)")
    ap.add_argument("--packed", action="store_true",
                    help="the same as --layout packed (the ninth session's spelling)")
    ap.add_argument("--stream-floor", type=int, default=None,
                    help="StreamTuning.stream_floor of the streamed arms (default 1,024): "
                         "shorter chunks are routed-only")
    ap.add_argument("--tail-pieces", type=int, default=None,
                    help="StreamTuning.tail_pieces (default 4): the last MoE layer's expert "
                         "math in this many row pieces; 1 runs it whole")
    ap.add_argument("--tail-shape", choices=["auto", "equal", "halving"], default=None,
                    help="StreamTuning.tail_shape (default auto): the pieces' sizes; halving "
                         "makes each half the one before (1/2, 1/4, 1/8, 1/8); auto takes "
                         "halving up to TAIL_HALVING_MAX_INTENSITY FLOPs a copied byte")
    ap.add_argument("--tail-from", type=int, default=None,
                    help="StreamTuning.tail_from (default: 8,192 for bf16 experts or dequantized "
                         "ones, 1,024 for the quantized kernels): the shortest chunk in pieces")


def _layout(args) -> str:
    return "packed" if args.packed else args.layout


def _stream_config(args, routed: bool, **tuning):
    """The streamed arms' StreamConfig from the command line (depth, ring budget) with its
    StreamTuning (publish mode, layout, crossover, floor, tail pieces) and `tuning`'s fields
    over those."""
    from strata_jax.stream import StreamConfig, StreamTuning

    tuning.setdefault("layout", _layout(args))
    tuning.setdefault("publish", args.publish)
    for name in ("frames_from", "stream_floor", "tail_pieces", "tail_shape", "tail_from"):
        if getattr(args, name) is not None:
            tuning.setdefault(name, getattr(args, name))
    return StreamConfig(routed=routed, depth=args.depth, ring_budget_gib=args.ring_gib,
                        tuning=StreamTuning(**tuning))


def _nonce_prompts(cfg, lengths, seed: int, slots: int = len(ORDER)) -> dict:
    """Per length, a new random prompt for each of `slots` repetitions, plus one to compile."""
    rng = np.random.default_rng(seed)
    return {n: [rng.integers(0, cfg.vocab_size, n) for _ in range(slots + 1)]
            for n in lengths}


def _resident_reference(cfg, params, ctx: int, lengths, prompts,
                        slots: int = len(ORDER)) -> tuple[dict, dict]:
    """The all-resident arm reads every prompt: its median time per length, and the hashes
    every streamed repetition of the same prompt must equal, keyed (length, repetition)."""
    resident_ms, hashes = {}, {}
    with engine(cfg, params, None, max_context=ctx, chunk_size=ctx) as eng:
        for n in lengths:
            eng.prefill(prompts[n][-1])  # compile
            times = []
            for i in range(slots):
                ms, r = _timed(eng, prompts[n][i])
                times.append(ms)
                hashes[(n, i)] = _hashes(r)
                del r  # see _drop_note
            resident_ms[n] = statistics.median(times)
    return resident_ms, hashes


def _pair_ratios(times) -> tuple[list, float, list]:
    """OFF/ON time ratio of each of PAIRS, in each block of ORDER, over the slots' times:
    (ratios, median, 95% interval)."""
    ratios = [times[off] / times[on] for on, off in _pairs(len(times))]
    return ratios, statistics.median(ratios), list(bootstrap_ci(ratios))


class PinnedHostBaseline:
    """What a JAX user writes without this library: each MoE layer's experts live in
    `pinned_host` memory and move to the device with `jax.device_put` inside the jitted prefill.
    The same model and math; only where the expert bytes come from differs."""

    def __init__(self, config, params, max_context: int):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from strata_jax.models import build_model, expert_plane_names
        from strata_jax.formats import expert_format

        self.config = config
        dev = jax.devices()[0]
        self.device = dev
        host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        self.dev_sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        names = {n for l in config.moe_layers for n in expert_plane_names(config, l).values()}
        # Each layer's planes (gate, up, down; with their scales in a quantized format).
        self.host = {l: {p: jax.device_put(params[n], host)
                         for p, n in expert_plane_names(config, l).items()}
                     for l in config.moe_layers}
        fmt = expert_format(config)
        model = build_model(config, {k: params[k] for k in params if k not in names},
                            resident_experts=False)
        self.graphdef, self.state = nnx.split(model)
        self.state = jax.device_put(self.state, dev)
        self.max_context = max_context
        sharding = self.dev_sharding

        class Source:
            def __init__(self, host_w):
                self.host_w = host_w

            def expert_weights(self, layer, counts, resident):
                planes = {p: jax.device_put(a, sharding) for p, a in self.host_w[layer].items()}
                return fmt.expert_weights(planes, config.dtype)

        def run(state, host_w, tokens, cache, n_valid, start=0):
            model = nnx.merge(self.graphdef, state)
            logits, cache, counts = model(tokens, cache, start, Source(host_w), n_valid=n_valid,
                                          last_logits=True)
            return logits, cache

        # A first chunk leaves `start` at its static 0; a later one passes it traced (the
        # cached path), which jit compiles as a program of its own.
        self._jit = jax.jit(run)
        self._jnp = jnp

    def prefill(self, tokens, chunk: int | None = None):
        """The prompt in one chunk (or chunks of `chunk` tokens, every layer's experts moved
        for each), padded as the Engine pads it (same bucket, same cache capacity), so its
        bytes can be compared with the engine's. Returns (ms, logits, valid KV cache)."""
        import jax

        from strata_jax.engine.results import _bucket
        from strata_jax.engine import compile_buckets
        from strata_jax.models import KVCache

        n = len(tokens)
        chunk = min(chunk or n, n)
        buckets = compile_buckets(min(chunk, self.max_context))
        c = self.config
        shape = (2 * self.max_context, c.n_kv_heads, c.head_dim)
        cache = KVCache(tuple(self._jnp.zeros(shape, c.dtype) for _ in range(c.n_layers)),
                        tuple(self._jnp.zeros(shape, c.dtype) for _ in range(c.n_layers)))
        pieces = []
        for off in range(0, n, chunk):
            piece = tokens[off:off + chunk]
            padded = np.zeros(_bucket(len(piece), buckets), np.int32)
            padded[:len(piece)] = piece
            pieces.append((off, jax.device_put(padded, self.device), len(piece)))
        jax.block_until_ready((cache, [p for _, p, _ in pieces]))
        gc.collect()  # as before every engine arm's timed call (_gc_note)
        t0 = time.perf_counter()
        for off, padded, m in pieces:
            if off == 0:
                logits, cache = self._jit(self.state, self.host, padded, cache,
                                          self._jnp.int32(m))
            else:
                logits, cache = self._jit(self.state, self.host, padded, cache,
                                          self._jnp.int32(m), self._jnp.int32(off))
        jax.block_until_ready((logits, cache))
        ms = (time.perf_counter() - t0) * 1e3
        return ms, logits, KVCache(tuple(k[:n] for k in cache.keys),
                                   tuple(v[:n] for v in cache.values))


