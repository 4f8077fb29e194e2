"""Expert parallelism across processes: `jax.distributed.initialize` with two local processes on
the CPU backend (a coordinator on localhost, one CPU device and so one expert shard each),
against one process with two simulated devices and one process with one device.

Each process runs the same program (multi-controller JAX): the engine with mesh=2 over the two
processes' devices, each holding its half of every layer's experts; the float32 partial outputs
are summed across the processes by XLA's CPU collectives (gloo). A sum of two partials is the
same bits in either order, so the two processes' logits and KV cache must equal the one-process
two-device run's bit for bit, and the one-device run's within the tolerance table.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

_CHILD = """
import json, sys
import jax
mode = sys.argv[1]
if mode == "process":
    rank, port = int(sys.argv[2]), sys.argv[3]
    try:  # jax releases where the CPU's cross-process collectives are chosen by this option
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:
        pass
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=rank, initialization_timeout=120)
import numpy as np
from strata_jax.models import get_preset
from strata_jax.engine import Engine
from strata_jax.synthetic import init_synthetic
cfg = get_preset("qwen3-30b-a3b").scaled(n_layers=2, n_experts=8, top_k=2, hidden_size=32,
                                         expert_intermediate=16, param_dtype="float32")
params = init_synthetic(cfg, seed=1)
toks = np.arange(50) * 5 % cfg.vocab_size
mesh = None if mode == "one" else 2
with Engine(cfg, params, None, max_context=64, chunk_size=32, mesh=mesh) as eng:
    first = eng.prefill(toks[:40])
    r = eng.prefill(toks[40:], first.session)  # a follow-up turn: the session's cache
    s = eng.score(toks)
    gate = next(l for l in eng._state_leaves if l.shape == (8, 32, 16))
    mine = [[sh.index[0].start or 0, sh.index[0].stop or 8] for sh in gate.addressable_shards]
    print(json.dumps(dict(
        process=jax.process_index(), processes=jax.process_count(),
        devices=[d.id for d in jax.devices()], mine=mine,
        logits=np.asarray(r.logits).tolist(), logits_sha256=r.logits_sha256(),
        kv_sha256=r.kv_sha256(), logprobs=np.asarray(s.logprobs).tolist(),
        rows=r.per_device()["rows"])))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                   os.environ.get("XLA_FLAGS", ""))
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": (flags + f" --xla_force_host_platform_device_count={devices}").strip()}


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.mark.slow  # four children (two processes at once), about 50 s on 2 cores
def test_two_processes_match_one_process():
    code = textwrap.dedent(_CHILD)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", code, "process", str(rank), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(1))
             for rank in range(2)]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr[-4000:]
            outs.append(_last_json(stdout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    local = {}
    for mode, devices in (("local", 2), ("one", 1)):
        run = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                             timeout=300, env=_env(devices))
        assert run.returncode == 0, run.stderr[-4000:]
        local[mode] = _last_json(run.stdout)

    # Two processes of one device each, each holding its own half of the experts.
    assert [(o["process"], o["processes"], len(o["devices"])) for o in outs] == [(0, 2, 2),
                                                                                  (1, 2, 2)]
    assert [o["mine"] for o in outs] == [[[0, 4]], [[4, 8]]]
    # Both processes hold the same replicated result, the one-process mesh's bits.
    for o in outs:
        for key in ("logits_sha256", "kv_sha256", "logprobs", "rows"):
            assert o[key] == local["local"][key], key
    from strata_jax.testing import assert_close

    assert_close(np.asarray(outs[0]["logits"]), np.asarray(local["one"]["logits"]), np.float32)
    assert_close(np.asarray(outs[0]["logprobs"]), np.asarray(local["one"]["logprobs"]),
                 np.float32)
    assert sum(outs[0]["rows"]) == sum(local["one"]["rows"])
