"""The `strata-jax` command: prefill / profile / info / demo, in-process and once as a program.

Tiny scaled presets (2 MoE layers, hidden 64, 32 experts top-2, skewed routing so chunks leave
experts unrouted) keep the whole file well under two minutes on two CPU cores. What must hold:
--json prints exactly one JSON object with the documented keys; copied + skipped equals the
experts streamed; stream-all skips nothing; the resident, stream-all, routed and profile-resident
arms give the same logits and KV bytes; a follow-up turn reuses the session; bad input is one
line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

from strata_jax import cli
from strata_jax.engine import memory

MODEL = ["--preset", "qwen3-30b-a3b", "--scale", "tiny", "--experts", "32", "--top-k", "2",
         "--skew", "2.0"]
PROMPT = ["--tokens", "128", "--chunk", "64", "--max-context", "192"]  # one KV capacity: same kv bytes
REQUIRED = ("tokens", "reused", "read", "prompt_ms", "experts_streamed", "copied", "skipped",
            "unrouted", "bytes_copied", "logits_sha256", "kv_sha256", "per_layer", "compiled")
N_LAYERS, N_EXPERTS = 2, 32


def run(argv) -> tuple[int, str, str]:
    """main(argv) in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def run_json(argv) -> dict:
    rc, out, err = run([*argv, "--json", "-q"])
    assert rc == 0, err
    return json.loads(out)  # the whole of stdout: exactly one object


def layer_rows(d: dict) -> list[dict]:
    return cli._per_layer_rows(d["per_layer"])


def patch_cli(monkeypatch, name: str, value) -> None:
    """Sets `name` in every module of the strata_jax.cli package that has it: each command's
    module looks the names it imports up in its own namespace."""
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(cli.__path__):
        if info.name == "__main__":
            continue
        module = importlib.import_module(f"{cli.__name__}.{info.name}")
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(cli, name, value, raising=False)


@pytest.fixture(scope="module")
def arms():
    """The same prompt through the resident, stream-all and routed arms (routed with a follow-up)."""
    return {
        "resident": run_json(["prefill", *MODEL, *PROMPT, "--no-stream"]),
        "stream-all": run_json(["prefill", *MODEL, *PROMPT, "--routed", "off"]),
        "routed": run_json(["prefill", *MODEL, *PROMPT, "--follow-up", "32"]),
    }


@pytest.mark.slow  # the `arms` fixture: three prefills through the command
def test_json_has_every_documented_key(arms):
    for name, d in arms.items():
        missing = [k for k in REQUIRED if k not in d]
        assert not missing, f"{name} lacks {missing}"
        assert (d["tokens"], d["reused"], d["read"]) == (128, 0, 128)
        assert d["prompt_ms"] > 0
        assert len(d["logits_sha256"]) == len(d["kv_sha256"]) == 64
        assert d["arm"] == name


@pytest.mark.slow  # the `arms` fixture: three prefills through the command
def test_streamed_counts_add_up(arms):
    for name in ("stream-all", "routed"):
        d = arms[name]
        # Two chunks of 64 tokens through 2 MoE layers of 32 streamed experts.
        assert d["experts_streamed"] == 2 * N_LAYERS * N_EXPERTS
        assert d["copied"] + d["skipped"] == d["experts_streamed"]
        assert d["bytes_copied"] == d["copied"] * d["model"]["expert_bytes"]
        rows = layer_rows(d)
        assert len(rows) == N_LAYERS
        for key, total in (("copied", "copied"), ("skipped", "skipped"),
                           ("unrouted", "unrouted")):
            assert sum(r[key] for r in rows) == d[total], (name, key)
        assert d["unrouted"] > 0  # skewed top-2 routing leaves experts idle in every chunk


@pytest.mark.slow  # the `arms` fixture: three prefills through the command
def test_routed_off_skips_nothing_and_routed_on_skips(arms):
    assert arms["stream-all"]["skipped"] == 0
    assert arms["stream-all"]["copied"] == arms["stream-all"]["experts_streamed"]
    assert arms["routed"]["skipped"] > 0
    assert arms["routed"]["skipped"] <= arms["routed"]["unrouted"]


@pytest.mark.slow  # a prefill of its own under the environment override
def test_depth_reported_is_the_one_that_runs(arms, monkeypatch):
    assert (arms["routed"]["depth"], arms["stream-all"]["depth"], arms["resident"]["depth"]) == (
        16, None, None)  # --depth's default; no depth where the routed switch is off
    # --depth not given: the environment's depth applies, clamped: the header and the JSON
    # say what the engine runs (256), not the default (16), and only -q silences the engine's
    # warning, one line on stderr (not Python's source location and code line).
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM_DEPTH", "100000")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        rc, out, err = run(["prefill", *MODEL, *PROMPT])
    assert rc == 0, err
    assert "arm routed (depth 256)," in out
    warned = [line for line in err.splitlines() if "warning" in line.lower()]
    assert warned == ["strata-jax prefill: warning: STRATA_PREFILL_ROUTED_STREAM_DEPTH=100000 "
                      "is outside 1..256; using 256"], err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = run_json(["prefill", *MODEL, *PROMPT])  # with -q
    assert d["depth"] == 256
    assert [str(w.message) for w in caught] == []
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM_DEPTH", "abc")  # -q keeps errors
    rc, out, err = run(["prefill", *MODEL, *PROMPT, "-q"])
    assert (rc, out) == (2, "")
    assert err.strip() == ("strata-jax prefill: error: STRATA_PREFILL_ROUTED_STREAM_DEPTH='abc': "
                           "expected an integer 1..256")


def test_explicit_flags_win_over_the_environment(monkeypatch):
    # STRATA_PREFILL_ROUTED_STREAM(_DEPTH) apply where --routed / --depth are not given; given,
    # the flags win (one warning line each names what was ignored), and the header and the
    # JSON say what ran.
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM", "0")
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM_DEPTH", "4")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        rc, out, err = run(["prefill", *MODEL, *PROMPT])
    assert rc == 0, err
    assert "arm stream-all, backend cpu" in out
    assert "warning" not in err.lower(), err
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        rc, out, err = run(["prefill", *MODEL, *PROMPT, "--routed", "on", "--depth", "8"])
    assert rc == 0, err
    assert "arm routed (depth 8), backend cpu" in out
    assert [line for line in err.splitlines() if "warning" in line.lower()] == [
        "strata-jax prefill: warning: STRATA_PREFILL_ROUTED_STREAM=0 is ignored: routed=True "
        "was given (an explicit argument wins over the environment)",
        "strata-jax prefill: warning: STRATA_PREFILL_ROUTED_STREAM_DEPTH=4 is ignored: depth=8 "
        "was given (an explicit argument wins over the environment)"], err


@pytest.mark.slow  # two more prefills through the command
def test_json_reports_the_arm_that_ran_under_the_environment(monkeypatch):
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM", "0")
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM_DEPTH", "4")
    d = run_json(["prefill", *MODEL, *PROMPT, "--routed", "on", "--depth", "8"])
    assert (d["arm"], d["depth"]) == ("routed", 8)
    monkeypatch.setenv("STRATA_PREFILL_ROUTED_STREAM", "1")
    d = run_json(["prefill", *MODEL, *PROMPT, "--routed", "off"])
    assert (d["arm"], d["depth"], d["skipped"]) == ("stream-all", None, 0)
    assert d["copied"] == d["experts_streamed"]


def test_garbage_profile_is_one_line_naming_the_file_once(tmp_path):
    bad = tmp_path / "prof.txt"
    bad.write_bytes(b"\x00garbage" + np.random.default_rng(0).bytes(300))
    rc, out, err = run(["prefill", *MODEL, "--profile", str(bad), "-q"])
    assert (rc, out) == (2, "")
    assert err.strip().splitlines() == [
        f"strata-jax prefill: error: profile {str(bad)!r}: not an expert profile written by "
        "`strata-jax profile` or ExpertProfile.save (not an .npz archive)"]


@pytest.mark.slow  # the `arms` fixture: three prefills through the command
def test_every_arm_gives_the_same_bytes(arms):
    assert arms["resident"]["experts_streamed"] == 0
    hashes = {(d["logits_sha256"], d["kv_sha256"]) for d in arms.values()}
    assert len(hashes) == 1, {k: d["logits_sha256"][:12] for k, d in arms.items()}


@pytest.mark.slow
def test_last_layer_in_pieces_gives_the_same_bytes(arms):
    # --tail-pieces/--tail-from: the last MoE layer's expert math in row pieces, each after a
    # fetch that waits only for its own experts (StreamTuning.tail_pieces); --tail-shape
    # halving: pieces of 1/2, 1/4 and 1/4 of the rows.
    for layout, shape in (("frames", "equal"), ("packed", "halving")):
        d = run_json(["prefill", *MODEL, *PROMPT, "--tail-pieces", "3", "--tail-from", "64",
                      "--stream-floor", "64", "--layout", layout, "--tail-shape", shape])
        assert (d["logits_sha256"], d["kv_sha256"]) == (arms["resident"]["logits_sha256"],
                                                        arms["resident"]["kv_sha256"])
        assert d["copied"] + d["skipped"] == d["experts_streamed"]
        assert [(c["ring_layout"], c["tail_pieces"], c["tail_shape"])
                for c in d["chunks"]] == [(layout, 3, shape)] * 2


@pytest.mark.slow  # the `arms` fixture: three prefills through the command
def test_follow_up_reuses_the_session(arms):
    f = arms["routed"]["follow_up"]
    assert (f["tokens"], f["reused"], f["read"]) == (160, 128, 32)
    assert f["copied"] + f["skipped"] == f["experts_streamed"]
    assert f["logits_sha256"] != arms["routed"]["logits_sha256"]


@pytest.mark.slow  # the `arms` fixture: three prefills through the command
def test_compiled_says_what_each_call_compiled(arms):
    # A first call's prompt_ms includes compiling its programs: the first chunk's and a later
    # chunk's of 64 tokens; the follow-up of 32 tokens compiles its own bucket.
    for d in arms.values():
        assert d["compiled"] == 2, d["compiled"]
    d = arms["routed"]
    assert d["follow_up"]["compiled"] == 1
    assert d["compilations"] == d["compiled"] + d["follow_up"]["compiled"]


COMPILED = ("  (this time includes compiling {n} chunk program{s}, once per chunk shape; a later "
            "call of the same shapes on this engine runs without it)")
SKIPS = ("  (skips depend on timing: an unrouted expert is skipped only when its layer's routing "
         "reaches the issuer before the walk has queued its copy; the copies queued before that, "
         "up to depth 16 ahead of the link plus those it has landed, are the blind window)")


def test_readable_output_with_progress_on_stderr():
    # Chunks from 16 tokens stream (the blind window), so the skip counts depend on timing.
    rc, out, err = run(["prefill", *MODEL, *PROMPT, "--follow-up", "16", "--stream-floor", "16"])
    assert rc == 0, err
    assert "128 tokens = 0 reused + 128 read" in out
    assert "follow-up: 144 tokens = 128 reused + 16 read" in out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("128 tokens = "))
    assert lines[first + 1:first + 3] == [COMPILED.format(n=2, s="s"), SKIPS]
    assert "follow-up prompt: 16 random tokens (seed 0)" in lines
    follow = next(i for i, line in enumerate(lines) if line.startswith("follow-up: "))
    assert lines[follow + 1] == COMPILED.format(n=1, s="")
    # The second turn's 5 most likely next tokens: ids (a preset has no tokenizer).
    assert re.fullmatch(r"follow-up next tokens: (\d+ \(p [01]\.\d{3}\)(, |$)){5}",
                        lines[follow + 2]) and len(lines) == follow + 3
    assert "arm routed" in out and "backend cpu" in out
    table = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert [row[0] for row in table] == ["0", "1"]  # one row per MoE layer
    assert "synthetic weights" in err and "prefill" in err  # progress bars went to stderr
    assert "{" not in out


@pytest.mark.slow  # the profile's recording and use: tests/test_profile.py by default
def test_profile_then_prefill_with_it(tmp_path, arms):
    path = str(tmp_path / "experts.prof")
    rc, out, err = run(["profile", *MODEL, "--prompts", "2", "--tokens", "64", "--chunk", "64",
                        "--out", path, "-q"])
    assert rc == 0, err
    assert os.path.exists(path) and path in out
    assert "layer 0:" in out and "layer 1:" in out

    from strata_jax.models import get_preset  # noqa: F401 - the profile loads for this shape
    from strata_jax.profile import ExpertProfile

    counts = np.asarray(ExpertProfile.load(path).counts)
    assert counts.shape == (N_LAYERS, N_EXPERTS)
    assert counts.sum() == 2 * 64 * 2 * N_LAYERS  # prompts * tokens * top-k * layers

    d = run_json(["prefill", *MODEL, *PROMPT, "--profile", path, "--resident-per-layer", "8"])
    assert d["experts_streamed"] == 2 * N_LAYERS * (N_EXPERTS - 8)
    assert d["copied"] + d["skipped"] == d["experts_streamed"]
    assert (d["logits_sha256"], d["kv_sha256"]) == (arms["resident"]["logits_sha256"],
                                                    arms["resident"]["kv_sha256"])

    # The same profile for a model of another shape is refused before any work.
    other = ["--preset", "qwen3-30b-a3b", "--scale", "tiny", "--experts", "16", "--top-k", "2"]
    rc, out, err = run(["prefill", *other, *PROMPT, "--profile", path])
    assert rc == 2 and out == ""
    assert "profile" in err and len(err.strip().splitlines()) == 1


def test_profile_json(tmp_path):
    path = str(tmp_path / "p.prof")
    d = run_json(["profile", *MODEL, "--prompts", "1", "--tokens", "32", "--chunk", "32",
                  "--no-stream", "--out", path, "--top", "3"])
    assert d["out"] == path and d["prompts"] == 1 and d["tokens"] == 32
    assert sorted(d["hottest"]) == ["0", "1"]
    for pairs in d["hottest"].values():
        counts = [c for _, c in pairs]
        assert len(pairs) == 3 and counts == sorted(counts, reverse=True)


def test_profile_reads_prompt_files_as_prefill_does(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.npy"
    a.write_text("1, 2, 3, 4, 5, 6, 7, 8, 9, 10")
    np.save(b, np.arange(20, 24))
    files = ["--prompt-file", str(a), "--prompt-file", str(b)]
    d = run_json(["profile", *MODEL, *files, "--chunk", "32", "--no-stream",
                  "--out", str(tmp_path / "p.prof")])
    assert (d["prompts"], d["tokens"]) == (2, 14)
    assert d["inputs"] == [
        {"tokens": 10, "source": f"10 tokens from {a}", "head": list(range(1, 9)),
         "head_text": None},  # a preset has no tokenizer: ids only
        {"tokens": 4, "source": f"4 tokens from {b}", "head": [20, 21, 22, 23],
         "head_text": None}]
    rc, out, err = run(["profile", *MODEL, *files, "--chunk", "32", "--no-stream", "-q",
                        "--out", str(tmp_path / "q.prof")])
    assert rc == 0, err
    assert f"prompt 1: 10 tokens from {a}; first tokens: 1, 2, 3, 4, 5, 6, 7, 8, ..." in out
    assert f"prompt 2: 4 tokens from {b}; first tokens: 20, 21, 22, 23" in out


@pytest.mark.parametrize("argv, words", [
    (["--prompt", "the cat"], ["--prompt needs a tokenizer", "--preset model",
                               "--prompt-file FILE of ids, or --tokens N"]),
    (["--prompt-file", "/nonexistent/p.txt"], ["does not exist"]),
    (["--prompt-file", "/nonexistent/p.txt", "--prompt-format", "text"],
     ["does not exist", "UTF-8 text file"]),
])
def test_profile_refuses_prompts_as_prefill_does(argv, words, no_work, tmp_path):
    rc, out, err = run(["profile", *MODEL, *argv, "--out", str(tmp_path / "p.prof")])
    assert (rc, out) == (2, ""), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


def test_info_json_plan_matches_the_engine():
    d = run_json(["info", *MODEL, "--resident-per-layer", "4", "--max-context", "512",
                  "--no-measure"])
    assert {"jax", "devices", "native", "link", "plan"} <= set(d)
    assert d["devices"] and all("kind" in dev for dev in d["devices"])
    p = d["plan"]
    cfg = cli.model_config("qwen3-30b-a3b", "tiny", experts=32, top_k=2)
    assert p["expert_bytes"] == cfg.expert_bytes
    assert p["expert_bytes_per_layer"] == N_EXPERTS * cfg.expert_bytes
    assert p["expert_bytes_total"] == N_LAYERS * N_EXPERTS * cfg.expert_bytes
    assert p["streamed_per_layer"] == N_EXPERTS - 4

    from strata_jax.stream import StreamConfig, NativeStreamer
    from strata_jax.synthetic import init_synthetic, split_experts

    dense, experts = split_experts(cfg, init_synthetic(cfg, 0))
    assert p["dense_bytes"] == sum(a.nbytes for a in dense.values())
    blob = cfg.expert_bytes
    # (resident GiB, resident per layer, ring GiB): the plan's figures are the engine's.
    cases = [
        (None, 4, 4.0),                   # the command above
        (None, None, 4.0),                # everything streams: a ring of two layer frames
        (None, N_EXPERTS, 4.0),           # nothing streams: one frame, filled from the cache
        (None, 8, 40 * blob / 2**30),     # the budget holds one frame, not two
        (13 * blob / 2**30, None, 4.0),   # 13 experts over 2 layers: 6 per layer
        (1e6, None, 4.0),                 # a budget past the model: every expert resident
    ]
    seen_rings = set()
    for resident_gib, per_layer, ring_gib in cases:
        plan = cli.memory_plan(cfg, max_context=512, resident_gib=resident_gib,
                               resident_per_layer=per_layer, ring_gib=ring_gib)
        sc = StreamConfig(resident_budget_gib=resident_gib, resident_per_layer=per_layer or 0,
                          ring_budget_gib=ring_gib, backend="cpu")
        with NativeStreamer(cfg, [experts.get(l) for l in range(cfg.n_layers)], sc) as eng:
            case = (resident_gib, per_layer, ring_gib)
            assert plan["ring_slots"] == eng.ring, case
            assert plan["ring_frames"] == eng.plan.frames == eng.ring // N_EXPERTS, case
            assert plan["ring_bytes"] == eng.ring * eng.blob_bytes, case
            assert plan["resident_bytes"] == sum(map(len, eng.resident)) * eng.blob_bytes, case
            assert [plan["resident_per_layer"]] * N_LAYERS == [len(r) for r in eng.resident], case
            assert plan["streamed_per_layer"] == int(eng.streamed_per_layer.max()), case
            assert plan["ring_fits_budget"] is True
        seen_rings.add(plan["ring_slots"])
    assert seen_rings == {2 * N_EXPERTS, N_EXPERTS}  # whole frames: two, or one
    # A ring budget below one layer frame: each layer in the fewest parts of which two
    # frames fit it, as the engine streams it (20 slots: 4 parts of 8 experts, 2 frames).
    small = run_json(["info", *MODEL, "--ring-gib", str(cfg.expert_bytes * 20.5 / 2**30),
                      "--no-measure"])["plan"]
    assert small["ring_fits_budget"] is True
    assert (small["ring_parts"], small["ring_slots"], small["ring_frames"]) == (4, 16, 2)
    with NativeStreamer(cfg, [experts.get(l) for l in range(cfg.n_layers)],
                        StreamConfig(ring_budget_gib=cfg.expert_bytes * 20.5 / 2**30,
                                     backend="cpu")) as eng:
        assert (eng.parts, eng.ring) == (4, 16)
    # Below one expert a part, it is flagged, as the engine refuses it.
    tiny = run_json(["info", *MODEL, "--ring-gib", str(cfg.expert_bytes * 0.5 / 2**30),
                     "--no-measure"])["plan"]
    assert tiny["ring_fits_budget"] is False
    with pytest.raises(ValueError, match="holds 0 experts"):
        NativeStreamer(cfg, [experts.get(l) for l in range(cfg.n_layers)],
                       StreamConfig(ring_budget_gib=cfg.expert_bytes * 0.5 / 2**30,
                                    backend="cpu"))
    # Bad figures are refused by the plan itself, not turned into nonsense.
    with pytest.raises(ValueError, match="exceeds the 32 experts"):
        cli.memory_plan(cfg, max_context=512, resident_per_layer=33)
    with pytest.raises(ValueError, match="must be >= 0"):
        cli.memory_plan(cfg, max_context=512, resident_gib=-1.0)


def test_info_says_why_the_link_was_not_measured():
    d = run_json(["info"])
    assert "plan" not in d
    if not any(dev["platform"] == "gpu" for dev in d["devices"]):
        assert d["link"] == {"pinned_gbps": None, "note": "not measured: no CUDA device"}
    rc, out, _ = run(["info", "--no-measure"])
    assert rc == 0 and "native library:" in out and "link: not measured" in out


@pytest.mark.slow
def test_demo_is_the_default_command():
    rc, out, err = run(["--scale", "tiny", "--tokens", "64", "--chunk", "32", "-q"])
    assert rc == 0, err
    for arm in ("resident", "stream-all", "routed"):
        assert f"{arm}: 64 tokens = 0 reused + 64 read" in out
    assert "identical in every arm" in out


def test_demo_builds_its_three_arms(monkeypatch):
    """The demo (the default command) in the fast run: its arms' configs are made and
    checked as an engine would (`resolved`, `plan_stream`), on the chosen backend; the
    engines are stand-ins (the slow tests above run them)."""
    import types

    from strata_jax.stream import plan_stream

    made = []

    class Stand_in:
        streamer = None

        def __init__(self, cfg, params, stream, **kwargs):
            if stream is not None:
                stream.resolved()
                plan_stream(cfg, stream)
            made.append((stream, kwargs["device"]))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def prefill(self, tokens):
            return types.SimpleNamespace(logits=np.zeros(2), session=types.SimpleNamespace(
                cache=np.zeros(2)), summary=lambda: "stand-in", chunks=[], mode="routed")

    patch_cli(monkeypatch, "Engine", Stand_in)
    rc, out, err = run(["demo", "--scale", "tiny", "--depth", "4", "-q"])
    assert rc == 0, err
    assert "identical in every arm" in out
    (resident, device), (stream_all, _), (routed, _) = made
    assert (resident, device) == (None, "cpu")
    # routed=False is stream-all by itself: no stream_floor patch (the floor is the routed
    # stream's only)
    assert (stream_all.routed, stream_all.tuning.stream_floor, stream_all.backend) == (
        False, 1024, "cpu")
    assert (routed.routed, routed.depth, routed.backend) == (True, 4, "cpu")


@pytest.mark.slow  # a subprocess running every arm of the demo (~20 s)
def test_the_demos_routed_arm_skips_unrouted_experts():
    """`strata-jax demo` as a user first runs it: the routed arm skips some of the experts no
    token routes to (on the CPU the simulated link is paced at LINK_TO_COMPUTE times the
    compute, timed on the resident arm: a faster link had every copy issued before its
    layer's routing landed, "skipped 0 of 274 unrouted"), stream-all skips none, and every
    arm gives the same bits."""
    rc, out, err = run(["-q"])
    assert rc == 0, err
    lines = out.splitlines()

    def counts(arm: str) -> tuple[int, int, int]:
        line = next(line for line in lines if line.startswith(f"{arm:>10}: "))
        found = re.search(r"copied (\d+), skipped (\d+) of (\d+) unrouted", line)
        assert found, line
        return tuple(int(g) for g in found.groups())

    _, skipped, unrouted = counts("routed")
    assert 0 < skipped <= unrouted, lines
    assert counts("stream-all")[1] == 0
    assert "identical in every arm" in lines[-1]
    if "backend cpu" in lines[0]:
        assert "(simulated link: set from the resident arm's compute)" in lines[0]
        link = next(line for line in lines if "simulated link" in line and "GB/s" in line)
        assert f"take {cli.demo.LINK_TO_COMPUTE:g}x its compute" in link, link


@pytest.mark.slow
def test_demo_says_what_its_numbers_depend_on():
    # A chunk of stream_floor (1024) tokens streams, so the routed arm's skips depend on when
    # each layer's routing lands; each arm's one call includes its compilation.
    rc, out, err = run(["demo", "--scale", "tiny", "--experts", "32", "--top-k", "2",
                        "--skew", "2.0", "--tokens", "1024", "--chunk", "1024", "-q"])
    assert rc == 0, err
    lines = out.splitlines()
    times = lines.index("each arm's first prefill; its time includes compiling the chunk "
                        "programs:")
    assert lines[times + 1].startswith("  resident: 1024 tokens")
    routed = next(i for i, line in enumerate(lines) if line.startswith("    routed: "))
    assert "unrouted" in lines[routed]
    assert lines[routed + 1] == (
        " " * 12 + "(skips depend on timing: an unrouted expert is skipped only when its layer's "
        "routing reaches the issuer before the walk has queued its copy; the copies queued "
        "before that, up to depth 4 ahead of the link plus those it has landed, are the blind "
        "window)")


@pytest.mark.parametrize("command", ["prefill", "score", "profile"])
def test_every_option_is_documented(command):
    parser = cli.build_parser()._subparsers._group_actions[0].choices[command]
    help_text = parser.format_help()
    for action in parser._actions:
        assert action.help and action.help.strip(), action.option_strings
        for opt in action.option_strings:
            assert opt in help_text
    for key in SCORE_KEYS if command == "score" else ():
        assert key in help_text, key


def _bad_checkpoints(tmp_path) -> dict[str, str]:
    """Checkpoint folders whose config.json is refused before any tensor is read."""
    from test_checkpoint import hf_config

    good = hf_config(cli.model_config("qwen3-30b-a3b", "tiny"), "Qwen3MoeForCausalLM")
    out = {}
    for name, text in (("unknown_field", json.dumps({**good, "my_new_field": 3})),
                       ("string_size", json.dumps({**good, "hidden_size": "64"})),
                       ("not_json", "{not json"), ("a_list", "[1, 2]")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(text)
        out[name] = str(folder)
    return out


def _broken_shards(tmp_path) -> dict[str, str]:
    """Checkpoint folders with a good config.json and a safetensors file as an interrupted
    download leaves it: empty, cut inside its header, cut inside its data (a shard of an
    index)."""
    from safetensors.numpy import save_file
    from test_checkpoint import hf_config

    good = json.dumps(hf_config(cli.model_config("qwen3-30b-a3b", "tiny"), "Qwen3MoeForCausalLM"))
    whole = tmp_path / "whole.safetensors"
    save_file({"model.embed_tokens.weight": np.ones((8, 4), np.float32)}, str(whole))
    data = whole.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    shard = "model-00001-of-00001.safetensors"
    out = {}
    for name, cut, file in (("empty_shard", b"", "model.safetensors"),
                            ("cut_in_header", data[:header_end // 2], "model.safetensors"),
                            ("cut_in_data", data[:-7], shard)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(good)
        (folder / file).write_bytes(cut)
        if file == shard:
            (folder / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"model.embed_tokens.weight": shard}}))
        out[name] = str(folder)
    return out


def _bad_prompt_files(tmp_path):
    text = tmp_path / "bad.txt"
    text.write_text("1 2 three 4")
    oov = tmp_path / "oov.txt"
    oov.write_text("1, 2, 3, 600")
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    npy = tmp_path / "floats.npy"
    np.save(npy, np.ones(4, np.float32))
    return str(text), str(oov), str(empty), str(npy)


BAD = {
    # name: (argv after "prefill", words the one-line message must hold)
    "unknown preset": (["--preset", "qwen9"], ["unknown preset", "qwen3-30b-a3b"]),
    "no model": ([*PROMPT], ["--preset", "--checkpoint"]),
    "missing prompt file": ([*MODEL, "--prompt-file", "/nonexistent/p.txt"], ["does not exist"]),
    "not integers": ([*MODEL, "--prompt-file", "{text}"], ["'three'", "not an integer"]),
    "outside the vocabulary": ([*MODEL, "--prompt-file", "{oov}"], ["600", "vocabulary"]),
    "empty prompt file": ([*MODEL, "--prompt-file", "{empty}"], ["no token ids"]),
    "float npy": ([*MODEL, "--prompt-file", "{npy}"], ["float32", "integer"]),
    "past max context": ([*MODEL, "--tokens", "300", "--max-context", "256"],
                         ["maximum context", "--max-context"]),
    "past a full preset's context": (["--preset", "olmoe-1b-7b", "--tokens", "5000"],
                                     ["max_seq_len", "4096"]),
    "negative budget": ([*MODEL, "--resident-gib", "-1"], ["--resident-gib", "0 or more"]),
    "budget past the device": ([*MODEL, "--resident-gib", "100000"], ["more than the device"]),
    "too many residents": ([*MODEL, "--resident-per-layer", "33"], ["33", "32 experts"]),
    "zero chunk": ([*MODEL, "--chunk", "0"], ["--chunk", "at least 1"]),
    "zero tail pieces": ([*MODEL, "--tail-pieces", "0"], ["--tail-pieces", "at least 1"]),
    "bad routed value": ([*MODEL, "--routed", "maybe"], ["--routed", "invalid choice"]),
    "preset and checkpoint": ([*MODEL, "--checkpoint", "/tmp"], ["either --preset or --checkpoint"]),
    "checkpoint without config": (["--checkpoint", "/"], ["config.json"]),
    "checkpoint with an unknown field": (["--checkpoint", "{unknown_field}"],
                                         ["my_new_field=3", "not fields of Qwen3MoeForCausalLM",
                                          "remove them from config.json"]),
    "checkpoint with a string size": (["--checkpoint", "{string_size}"],
                                      ["config.json hidden_size='64': expected an integer"]),
    "checkpoint config not json": (["--checkpoint", "{not_json}"],
                                   ["config.json is not valid JSON"]),
    "checkpoint config a list": (["--checkpoint", "{a_list}"],
                                 ["config.json holds a list, not an object"]),
    "empty safetensors file": (["--checkpoint", "{empty_shard}"],
                               ["model.safetensors is empty (0 bytes)", "download it again"]),
    "safetensors cut in its header": (["--checkpoint", "{cut_in_header}"],
                                      ["model.safetensors is truncated: cut inside its header",
                                       "download it again"]),
    "safetensors cut in its data": (["--checkpoint", "{cut_in_data}"],
                                    [("model-00001-of-00001.safetensors is truncated: cut inside "
                                      "its data"), "download it again"]),
    "missing profile": ([*MODEL, "--profile", "/nonexistent/p.prof"], ["profile", "does not exist"]),
    "scale with a checkpoint": (["--checkpoint", "/tmp", "--scale", "tiny"],
                                ["--scale", "checkpoint's shapes are fixed"]),
    "full preset past host memory": (["--preset", "deepseek-v3", "--tokens", "8"],
                                     ["host memory", "--scale small|tiny"]),
    "residents with --no-stream": ([*MODEL, "--no-stream", "--resident-per-layer", "4"],
                                 ["--no-stream", "streamed run"]),
    "follow-up text without a tokenizer": ([*MODEL, "--follow-up-prompt", "the cat"],
                                           ["--follow-up-prompt needs a tokenizer",
                                            "--follow-up-file FILE of ids, or --follow-up N"]),
    "follow-up given two ways": ([*MODEL, "--follow-up", "8", "--follow-up-file", "{text}"],
                                 ["--follow-up 8 and --follow-up-file", "give one"]),
    "follow-up file not integers": ([*MODEL, "--follow-up-file", "{text}"],
                                    ["'three'", "not an integer"]),
    "follow-up file outside the vocabulary": ([*MODEL, "--follow-up-file", "{oov}"],
                                              ["600", "vocabulary"]),
    "empty follow-up file": ([*MODEL, "--follow-up-file", "{empty}"], ["no token ids"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path):
    text, oov, empty, npy = _bad_prompt_files(tmp_path)
    checkpoints = _bad_checkpoints(tmp_path)
    argv, words = BAD[case]
    if any("_shard}" in a or "{cut_in_" in a for a in argv):
        checkpoints.update(_broken_shards(tmp_path))
    argv = [a.format(text=text, oov=oov, empty=empty, npy=npy, **checkpoints) for a in argv]
    rc, out, err = run(["prefill", *argv])
    assert rc == 2, (case, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "Traceback" not in err and "error" in lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])


GIB = 2**30
TINY = ["--preset", "qwen3-30b-a3b", "--scale", "tiny"]  # grows max_seq_len to fit --tokens


@pytest.fixture
def no_work(monkeypatch):
    """Fails a test that draws a prompt, makes weights or builds an engine."""
    import strata_jax.engine

    def forbidden(*args, **kwargs):
        raise AssertionError("work done before the plan was checked")

    patch_cli(monkeypatch, "random_prompt", forbidden)
    patch_cli(monkeypatch, "init_synthetic", forbidden)
    patch_cli(monkeypatch, "SyntheticParams", forbidden)
    monkeypatch.setattr(strata_jax.engine.Engine, "__init__", forbidden)


@pytest.mark.parametrize("argv", [
    ["prefill", *TINY, "--tokens", "100000000"],
    ["prefill", *TINY, "--tokens", "1000000000", "--no-stream"],
    ["prefill", *TINY, "--tokens", "1000", "--max-context", "100000000"],
    ["profile", *TINY, "--prompts", "2", "--tokens", "100000000", "--out", "{tmp}/p.prof"],
    ["demo", "--scale", "tiny", "--tokens", "1000000000"],  # a hybrid: few layers cache KV
], ids=["prefill", "prefill-no-stream", "max-context", "profile", "demo"])
def test_a_plan_past_memory_is_refused_at_once(argv, no_work, monkeypatch, tmp_path):
    """A KV cache (scaled presets grow max_seq_len to fit the prompt) past the device's memory:
    one line with the figures and the way out, in well under a second, before any work (a
    24 GiB host, as where `--tokens 100000000` was killed after 29 s)."""
    import time

    patch_cli(monkeypatch, "host_memory", lambda: (24 * GIB, 23 * GIB))
    argv = [a.format(tmp=tmp_path) for a in argv]
    run(["prefill", *TINY, "--tokens", "8", "--max-context", "100000000"])  # imports, warm
    t0 = time.perf_counter()
    rc, out, err = run(argv)
    elapsed = time.perf_counter() - t0
    assert rc == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, lines
    assert lines[0].startswith(f"strata-jax {argv[0]}: error: this prefill needs about ")
    for words in ("KV cache", "GiB of host RAM and 23.00 GiB is available",
                  "use fewer tokens or a smaller --max-context", "positions fit"):
        assert words in lines[0], (words, lines[0])
    assert elapsed < 1.0, elapsed


@pytest.fixture
def engine_kernels(monkeypatch):
    """The `kernels` of every Engine the command line builds, in order."""
    from strata_jax import engine as engine_module

    seen = []
    real = engine_module.Engine.__init__

    def spy(self, *a, **kw):
        seen.append(kw.get("kernels"))
        return real(self, *a, **kw)

    monkeypatch.setattr(engine_module.Engine, "__init__", spy)
    return seen


@pytest.mark.slow
def test_delta_rule_option_reaches_a_hybrids_engine(engine_kernels):
    """--delta-rule builds the engine's Kernels for a hybrid (its DeltaNet layers run the Pallas
    kernels, interpreted here)."""
    seen = engine_kernels
    d = run_json(["prefill", "--preset", "qwen3-next-80b-a3b", "--scale", "tiny", "--tokens",
                  "16", "--no-stream", "--delta-rule", "pallas"])
    assert d["tokens"] == 16 and [k.delta_rule for k in seen] == ["pallas"]


@pytest.mark.parametrize("argv, words", [
    (["prefill", *TINY, "--tokens", "8", "--delta-rule", "pallas"],
     ["--delta-rule pallas", "no Gated DeltaNet layers", "leave it out"]),
    (["profile", *TINY, "--tokens", "8", "--delta-rule", "xla", "--out", "{tmp}/p.prof"],
     ["--delta-rule xla", "no Gated DeltaNet layers"]),
    (["prefill", *TINY, "--tokens", "8", "--quantized-matmul", "fused"],
     ["--quantized-matmul fused", "not quantized", "leave it out"]),
], ids=["delta-rule", "profile-delta-rule", "quantized-matmul"])
def test_kernel_choices_that_do_nothing_are_refused(argv, words, no_work, tmp_path):
    """A kernel option for layers or experts the model does not have: one line naming it,
    before any work; the same options where they apply run (test_hybrid, test_quant_*)."""
    rc, out, err = run([a.format(tmp=tmp_path) for a in argv])
    assert (rc, out) == (2, ""), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


def test_the_plan_check_uses_the_engines_estimates(monkeypatch):
    """The refusal's KV cache and activations are the engine's (engine.memory.chunk_memory, by
    which the engine's choose_chunk chooses its chunk); the positions it says fit pass the check, one more does
    not."""
    import re

    import strata_jax.engine.engine as E
    import strata_jax.engine.memory as M

    assert E.choose_chunk is M.choose_chunk and E.kv_cache_bytes is M.kv_cache_bytes
    cfg = cli.model_config("qwen3-30b-a3b", "tiny", max_seq_len=10**8)
    act, kv, cap = M.chunk_memory(cfg, 16, 10**8, platform="cpu", streamed=True)
    assert cap == 10**8 + 16
    assert kv == 2 * M.kv_cache_bytes(cfg, cap) == 2 * (
        2 * cfg.n_layers * cap * cfg.n_kv_heads * cfg.head_dim * np.dtype(cfg.dtype).itemsize)
    patch_cli(monkeypatch, "host_memory", lambda: (24 * GIB, 23 * GIB))
    rc, _, err = run(["prefill", *TINY, "--tokens", "100000000"])
    assert rc == 2
    assert f"KV cache {kv / GIB:.2f} GiB (2 copies of {cap} positions" in err
    assert f"activations of a 16-token chunk {act / GIB:.2f} GiB" in err
    fit = int(re.search(r"about (\d+) positions fit", err).group(1))
    assert 10**6 < fit < 10**8

    checked = []
    patch_cli(monkeypatch, "random_prompt", lambda *a: checked.append(a[1]) or 1 / 0)
    for n, ok in ((fit, True), (fit + 1, False)):
        args = cli.build_parser().parse_args(["prefill", *TINY, "--tokens", str(n), "-q"])
        with pytest.raises((cli.UsageError, ZeroDivisionError)) as e:
            cli.cmd_prefill(args, cli._Log(True))  # ZeroDivisionError: past the check
        assert (e.type is ZeroDivisionError) == ok, (n, e.value)
    assert checked == [fit]  # the prompt is drawn only once the plan fits


# info refuses the budgets prefill refuses, with prefill's message.
INFO_BAD = {
    "budget past the device": ["--resident-gib", "1e9"],
    "negative budget": ["--resident-gib", "-1"],
    "too many residents": ["--resident-per-layer", "33"],
    "no ring": ["--ring-gib", "0"],
}


@pytest.mark.parametrize("case", sorted(INFO_BAD))
def test_info_refuses_what_prefill_refuses(case):
    rc, out, err = run(["info", *MODEL, *INFO_BAD[case], "--no-measure"])
    assert rc == 2 and out == "", err
    rc2, out2, err2 = run(["prefill", *MODEL, *INFO_BAD[case]])
    assert rc2 == 2 and out2 == "", err2
    info_line, = err.strip().splitlines()
    prefill_line, = err2.strip().splitlines()
    assert info_line.startswith("strata-jax info: error: ")
    assert info_line.removeprefix("strata-jax info: ") == \
        prefill_line.removeprefix("strata-jax prefill: ")


def test_info_says_why_streaming_can_take_more_than_every_expert_resident():
    """The ring is whole layer frames, residents copied in, whatever the residents: with every
    expert resident the streamed plan takes one frame more than the resident one. info keeps
    that cost and says why, and how many residents stay within the all-resident total."""
    import re

    d = run_json(["info", "--preset", "qwen3-next-80b-a3b", "--resident-per-layer", "512",
                  "--no-measure"])["plan"]
    assert d["device_bytes_streamed"] == d["device_bytes_all_resident"] + d["ring_bytes"]
    note = d["streamed_note"]
    assert "more than every expert resident" in note and "ring frame of all 512" in note
    assert "--no-stream" in note
    rc, out, _ = run(["info", "--preset", "qwen3-next-80b-a3b", "--resident-per-layer", "512",
                      "--no-measure"])
    assert rc == 0 and f"  note: {note}" in out.splitlines()

    from strata_jax.models import get_preset

    for name in ("qwen3-next-80b-a3b", "qwen3-30b-a3b", "olmoe-1b-7b", "mixtral-8x7b"):
        cfg = get_preset(name)

        def plan(r, cfg=cfg):
            return cli.memory_plan(cfg, max_context=4096, resident_per_layer=r)

        everything = plan(cfg.n_experts)["streamed_note"]
        said = re.search(r"keep at most (\d+) per layer", everything)
        keep = int(said.group(1)) if said else 0  # "stream every expert": none
        for r in {0, keep, keep + 1, cfg.n_experts}:
            p = plan(r)
            over = p["device_bytes_streamed"] > p["device_bytes_all_resident"]
            assert over == (r > keep) == (p["streamed_note"] is not None), (name, r)


@pytest.mark.slow
def test_no_stream_runs_on_the_backend_device(arms):
    """--no-stream --backend cpu|cuda picks the resident arm's device (no JAX_PLATFORMS)."""
    import jax

    d = run_json(["prefill", *MODEL, *PROMPT, "--no-stream", "--backend", "cpu"])
    assert (d["arm"], d["backend"], d["experts_streamed"]) == ("resident", "resident", 0)
    assert (d["logits_sha256"], d["kv_sha256"]) == (arms["routed"]["logits_sha256"],
                                                    arms["routed"]["kv_sha256"])
    rc, out, err = run(["prefill", *MODEL, *PROMPT, "--no-stream", "--backend", "cpu", "-q"])
    assert rc == 0, err
    cpu = jax.devices("cpu")[0]
    assert f"arm resident, backend resident on cpu:{cpu.id} ({cpu.device_kind})" in out
    if not any(dev.platform == "gpu" for dev in jax.devices()):
        rc, out, err = run(["prefill", *MODEL, *PROMPT, "--no-stream", "--backend", "cuda"])
        assert rc == 2 and out == ""
        assert len(err.strip().splitlines()) == 1
        assert "--backend cuda: JAX sees no GPU" in err and "--backend auto or cpu" in err
    prefill = cli.build_parser()._subparsers._group_actions[0].choices["prefill"]
    assert "JAX_PLATFORMS" not in prefill.format_help()


def test_backend_cuda_without_cuda_is_refused():
    import jax

    from strata_jax import native

    if jax.default_backend() == "gpu" and native.has_cuda():
        pytest.skip("this machine can run --backend cuda")
    rc, out, err = run(["prefill", *MODEL, *PROMPT, "--backend", "cuda"])
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--backend cuda" in err


def test_checkpoint_reads_like_the_preset_it_was_written_from(tmp_path):
    """--checkpoint DIR (safetensors) gives the bytes of the same weights made from the preset."""
    from test_checkpoint import hf_tensors, write_checkpoint

    from strata_jax.synthetic import init_synthetic

    shape = ["--experts", "8", "--top-k", "2", "--expert-width", "24", "--dtype", "float32"]
    cfg = cli.model_config("qwen3-30b-a3b", "tiny", experts=8, top_k=2, expert_width=24,
                           dtype="float32")
    write_checkpoint(tmp_path, cfg, "qwen3-30b-a3b",
                     hf_tensors(cfg, init_synthetic(cfg, 0, 0.0), "qwen3-30b-a3b"))
    prompt = ["--tokens", "64", "--chunk", "64"]
    from_ckpt = run_json(["prefill", "--checkpoint", str(tmp_path), *prompt])
    from_preset = run_json(["prefill", "--preset", "qwen3-30b-a3b", "--scale", "tiny", *shape,
                            "--skew", "0", "--seed", "0", *prompt])
    assert from_ckpt["model"]["checkpoint"] == str(tmp_path)
    assert from_ckpt["experts_streamed"] == 2 * 8
    assert (from_ckpt["logits_sha256"], from_ckpt["kv_sha256"]) == (
        from_preset["logits_sha256"], from_preset["kv_sha256"])


@pytest.mark.slow
def test_as_a_program():
    """`python -m strata_jax`: one JSON object on stdout; bad input exits 2 with one line."""
    def program(*argv):
        return subprocess.run([sys.executable, "-m", "strata_jax", *argv], check=False,
                              capture_output=True, text=True, timeout=300)

    ok = program("prefill", *MODEL, *PROMPT, "--json")
    assert ok.returncode == 0, ok.stderr[-2000:]
    d = json.loads(ok.stdout)
    assert all(k in d for k in REQUIRED)
    assert d["copied"] + d["skipped"] == d["experts_streamed"]

    bad = program("prefill", "--preset", "nope")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()]
    assert "unknown preset 'nope'" in bad.stderr


class _ClosedPipe(io.StringIO):
    """A stdout whose reader has gone (`| head` done): every write and flush is EPIPE."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_stdout_ends_the_command_quietly():
    err = io.StringIO()
    with contextlib.redirect_stdout(_ClosedPipe()), contextlib.redirect_stderr(err):
        rc = cli.main(["info", "--no-measure"])
    assert rc == cli.EXIT_STDOUT_CLOSED == 141
    assert err.getvalue() == ""  # no traceback, no error line: the reader asked for no more


@pytest.mark.slow  # a subprocess
def test_a_reader_that_closes_early_gets_no_traceback():
    """`strata-jax prefill ... | head -1`: the reader takes the first line and closes the pipe
    while the prefill runs; the rest of the output meets the closed pipe and the command
    ends quietly (exit 141, 128 + SIGPIPE), nothing on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "strata_jax", "prefill", *MODEL,
                             "--tokens", "64", "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        proc.stdout.close()  # before the summary: the header is flushed before any work
        err = proc.stderr.read()
        rc = proc.wait(timeout=300)
    finally:
        proc.kill()
    assert first.startswith("model qwen3-30b-a3b-scaled"), first
    assert rc == 141, err
    assert err == "", err


# ---- score --------------------------------------------------------------------------------------


SCORE_KEYS = ("scored", "sum_logprob", "mean_nll", "perplexity", "top1_accuracy",
              "logprobs_sha256", "logprobs", "top1")
SCORE_PROMPT = ["--tokens", "48", "--chunk", "64", "--max-context", "64"]  # one chunk program


@pytest.mark.slow  # the arms' score bits: test_engine in the default run
def test_score_json_and_text_give_the_same_bits_in_every_arm():
    # The resident arm's JSON and the routed arm's text: the same log-probabilities' bytes
    # (chunk boundaries and follow-up turns: tests/test_engine.py).
    d = run_json(["score", *MODEL, *SCORE_PROMPT, "--no-stream"])
    missing = [k for k in (*REQUIRED, *SCORE_KEYS) if k not in d]
    assert not missing, missing
    assert (d["tokens"], d["read"], d["scored"], len(d["logprobs"])) == (48, 48, 47, 47)
    assert d["arm"] == "resident" and d["chunk_size"] == 64
    logprobs = np.asarray(d["logprobs"], np.float64)
    assert np.isfinite(logprobs).all() and (logprobs < 0).all()
    assert d["sum_logprob"] == pytest.approx(logprobs.sum())
    assert d["mean_nll"] == pytest.approx(-logprobs.mean())
    assert d["perplexity"] == pytest.approx(np.exp(-logprobs.mean()))
    top1 = np.asarray(d["top1"])
    assert top1.shape == (47,) and ((0 <= top1) & (top1 < 512)).all()
    hits = round(d["top1_accuracy"] * 47)
    assert d["top1_accuracy"] == hits / 47
    rc, out, err = run(["score", *MODEL, *SCORE_PROMPT, "--stream-floor", "16"])
    assert rc == 0, err
    assert "arm routed" in out and "48 tokens = 0 reused + 48 read" in out
    assert "experts streamed" in out
    assert f"scored 47 tokens: mean NLL {d['mean_nll']:.4f} nats" in out
    assert f"(perplexity {d['perplexity']:.6g}); top-1 {hits} of 47" in out
    assert d["compiled"] == 1 and COMPILED.format(n=1, s="") in out.splitlines()
    assert SKIPS in out.splitlines()
    assert f"logprobs sha256 {d['logprobs_sha256'][:16]}..., kv sha256 {d['kv_sha256'][:16]}" \
        in out
    assert "score" in err and "{" not in out  # the progress bar went to stderr


@pytest.mark.parametrize("argv, words", [
    (["--tokens", "1"], ["1 token has nothing to score", "at least 2 tokens"]),
    (["--prompt-file", "{one}"], ["1 token has nothing to score"]),
    (["--prompt-file", "{oov}"], ["600", "vocabulary"]),
])
def test_score_refuses_what_it_cannot_score_before_any_work(argv, words, no_work, tmp_path):
    _, oov, _, _ = _bad_prompt_files(tmp_path)
    one = tmp_path / "one.txt"
    one.write_text("7")
    argv = [a.format(one=one, oov=oov) for a in argv]
    rc, out, err = run(["score", *MODEL, *argv])
    assert (rc, out) == (2, ""), err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("strata-jax score: error: "), lines
    for w in words:
        assert w in lines[0], (w, lines[0])


    assert "score" in cli.build_parser().format_help()


def test_kernel_options_reach_the_engine(engine_kernels):
    # --grouped-matmul / --quantized-matmul / --attention build the engine's Kernels; a choice
    # the kernels do not have is refused by argparse, naming the choices.
    seen = engine_kernels
    d = run_json(["prefill", *MODEL, "--tokens", "32", "--no-stream", "--quantize", "int4",
                  "--grouped-matmul", "tiled", "--quantized-matmul", "dequantize",
                  "--attention", "xla"])
    assert d["tokens"] == 32
    (k,) = seen
    assert (k.grouped_matmul, k.quantized_matmul, k.attention) == ("tiled", "dequantize", "xla")
    rc, out, err = run(["prefill", *MODEL, "--quantized-matmul", "fast"])
    assert (rc, out) == (2, "") and "invalid choice: 'fast'" in err and "dequantize" in err


def test_dense_host_prefill_reads_the_same_bytes():
    """prefill --dense host: the weights' copies in flight in the plan check, the same logits
    and KV bytes as --dense device."""
    out = []
    for dense in ("device", "host"):
        rc, stdout, err = run(["prefill", *TINY, "--tokens", "40", "--no-stream", "--dense",
                               dense, "--json"])
        assert rc == 0, err
        d = json.loads(stdout)
        out.append((d["logits_sha256"], d["kv_sha256"]))
    assert out[0] == out[1]
    cfg = cli.model_config("qwen3-30b-a3b", "tiny")
    assert memory.weight_bytes(cfg, None, "gpu", "host") < memory.weight_bytes(cfg, None, "gpu")


def test_plan_check_names_dense_host_where_it_fits(monkeypatch):
    """A GPU whose memory the dense weights outgrow (GLM-4.5-Air's 13.4 GiB on a 16 GB card):
    the refusal says --dense host fits; with --dense host the check passes."""
    from strata_jax.cli import checks
    from strata_jax.cli.common import _Model
    from strata_jax.stream import StreamConfig

    monkeypatch.setattr(checks, "device_memory", lambda platform: (14 * GIB, "a 16 GB GPU"))
    args = cli.build_parser().parse_args(["prefill", "--preset", "glm-4.5-air", "--tokens", "8",
                                          "--quantize", "int4"])
    model = _Model(args)
    kw = dict(max_context=4096, n_tokens=4096, chunk=None, sub_chunk=None, backend="cuda",
              stream=StreamConfig(ring_budget_gib=2.5))
    with pytest.raises(cli.UsageError, match="--dense host fits"):
        checks._check_plan(model, **kw)
    checks._check_plan(model, **kw, dense_on="host")
