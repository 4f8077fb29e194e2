"""Runs the GPU-free C++ walk test (ffi/tests/routed_stream_test.cpp) from pytest.

Builds it twice with the system C++ compiler: optimised, and under
ThreadSanitizer, so one `pytest` command covers the walk's rules and its
memory ordering. Issue #2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "ffi" / "tests" / "routed_stream_test.cpp"
INCLUDE = ROOT / "ffi" / "include"


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return name
    pytest.skip("no C++ compiler on PATH to build the walk test")


def _build(tmp: Path, flags: list[str], name: str) -> Path:
    out = tmp / name
    cmd = [_compiler(), "-std=c++17", "-pthread", f"-I{INCLUDE}", *flags, str(SOURCE), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"build failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("walk")


def _run(binary: Path, *args: str, env: dict | None = None) -> str:
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{binary.name} {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc.stdout


def test_walk_rules(build_dir):
    binary = _build(build_dir, ["-O2", "-Wall", "-Wextra", "-Werror"], "routed_stream_test")
    out = _run(binary, "60", "20261130")
    assert "0 failures" in out
    # A second seed: the random chunks differ, the rules do not.
    assert "0 failures" in _run(binary, "60", "17")


@pytest.mark.slow
def test_walk_under_thread_sanitizer(build_dir):
    binary = _build(build_dir, ["-O1", "-g", "-fsanitize=thread", "-Wno-tsan"], "routed_stream_test_tsan")
    out = _run(binary, "60", "20261130", env={"TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})
    assert "0 failures" in out
