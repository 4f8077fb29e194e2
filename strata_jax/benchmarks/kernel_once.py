"""One expert matmul of a Qwen3-30B-A3B-shaped layer, run a few times, for a profiler to read.

For each path given, the grouped matmul of one matrix (gate [M, 2048] x [2048, 768], or down
[M, 768] x [768, 2048]; M = tokens x top-k rows, uniform routing) is compiled, then run
--runs times, each waited for. Under Nsight Compute (BENCHMARKS.md, "Not run yet"):

    ncu --replay-mode application --section SpeedOfLight --section WarpStateStats \\
        --kernel-name regex:mosaic --launch-skip 1 --launch-count 1 \\
        python -m strata_jax.benchmarks.kernel_once --paths int4 --matrix gate
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.benchmarks.grouped_matmul_bench import uniform_group_sizes
from strata_jax.config import get_preset
from strata_jax.formats import ExpertFormat, quantized_config
from strata_jax.grouped_matmul import grouped_matmul

PATHS = ("bf16", "fp8", "int4")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="bf16,int4", help="comma list of " + "|".join(PATHS))
    ap.add_argument("--matrix", choices=("gate", "down"), default="gate")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args(argv)
    paths = a.paths.split(",")
    if set(paths) - set(PATHS):
        ap.error(f"--paths {a.paths!r}: a comma list of {'|'.join(PATHS)}")
    cfg = get_preset("qwen3-30b-a3b")
    h, i, e = cfg.hidden_size, cfg.expert_intermediate, cfg.n_experts
    k, n = (h, i) if a.matrix == "gate" else (i, h)
    m = a.tokens * cfg.top_k
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(uniform_group_sizes(a.tokens, e, cfg.top_k))
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    w32 = rng.standard_normal((e, k, n), np.float32) * 0.02
    f = jax.jit(lambda x, w, s: grouped_matmul(x, w, s))
    for path in paths:
        if path == "bf16":
            w = jnp.asarray(w32, jnp.bfloat16)
        else:
            fmt = ExpertFormat.of(quantized_config(cfg.replace(param_dtype="bfloat16"), path, 0))
            planes = {name: jnp.asarray(v) for name, v in
                      fmt.quantize_matrix_np(a.matrix, w32).items()}
            w = fmt.matrix(planes, a.matrix, jnp.bfloat16)
        for _ in range(a.runs):
            f(x, w, sizes).block_until_ready()
        print(f"{path} {a.matrix} {a.tokens} tokens: ran {a.runs}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
