"""The package's shape: imports go one way (the import-linter contracts in pyproject.toml), no
module is part of an import cycle, no import hides inside a function, no file grows past what a
reader can hold, and the docs stay references of bounded length."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

# The test extra installs import-linter (and grimp with it); a machine without it skips the
# module, never CI.
grimp = pytest.importorskip("grimp")

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "strata_jax"

# Imports a function may make: optional dependencies, missing from a default install.
OPTIONAL = {
    "matplotlib": "benchmarks' plots only (the notebook extra)",
}
# Scripts run as `python -m strata_jax.benchmarks.X`; they are not the library core.
NOT_CORE = ("benchmarks",)
MAX_LINES = 800
DOC_LINES = {"docs/DESIGN.md": 600, "docs/BENCHMARKS.md": 400, "README.md": 200}


def _library_files():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_import_contracts_hold():
    """Every contract of [tool.importlinter] in pyproject.toml is kept (the layers, the kernels
    package's layers, families independent of each other, the engine and the stream blind to
    families)."""
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import "
                          "lint_imports_command; sys.exit(lint_imports_command())",
                          "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "Contracts: 4 kept, 0 broken" in run.stdout, run.stdout + run.stderr
    assert run.returncode == 0, run.stdout + run.stderr


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), the root package's
    re-exports left out."""
    nodes = sorted(m for m in graph.modules if m != "strata_jax")
    edges = {m: sorted(d for d in graph.find_modules_directly_imported_by(m)
                       if d != "strata_jax") for m in nodes}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = grimp.build_graph("strata_jax", include_external_packages=False,
                              exclude_type_checking_imports=True)
    assert _cycles(graph) == []


def test_a_cycle_is_found(tmp_path, monkeypatch):
    """The cycle check itself: two modules importing each other are reported."""
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclepkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyclepkg import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyclepkg", include_external_packages=False)
    assert _cycles(graph) == [["cyclepkg.a", "cyclepkg.b"]]


def _imports_in_functions(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "")]
            else:
                continue
            for name in names:
                if name.split(".")[0] not in OPTIONAL:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {fn.name}: {name}")
    return found


def test_no_import_inside_a_function():
    core = [p for p in _library_files() if not set(NOT_CORE) & set(p.relative_to(PACKAGE).parts)]
    found = [f for p in core for f in _imports_in_functions(p)]
    assert found == [], "imports inside functions (move them to the module top):\n" + "\n".join(
        found)


@pytest.mark.parametrize("path", _library_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_file_length(path):
    n = path.read_text().count("\n")
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines (at most {MAX_LINES})"


@pytest.mark.parametrize("doc,limit", sorted(DOC_LINES.items()))
def test_doc_length(doc, limit):
    n = (ROOT / doc).read_text().count("\n")
    assert n <= limit, f"{doc} has {n} lines (at most {limit})"


def test_license_ships():
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


# The package's public names before the layout moved (every one must keep importing).
PUBLIC = ("PRESETS", "ModelConfig", "get_preset", "ExpertSource", "ExpertWeights",
          "ResidentExperts", "pack_expert_blobs", "unpack_expert_blobs", "KVCache",
          "MoETransformer", "build_model", "forward", "init_cache", "SKEW_40_PERCENT_512_TOP10",
          "init_synthetic", "SyntheticParams", "Engine", "StreamConfig", "StreamTuning", "Session",
          "ExpertProfile", "Kernels")


def test_public_names_keep_working():
    import strata_jax

    for name in PUBLIC:
        assert name in strata_jax.__all__, name
        assert getattr(strata_jax, name) is not None, name
    text = subprocess.run([sys.executable, "-c", "import pydoc, strata_jax; print(pydoc.render_doc("
                           "strata_jax, renderer=pydoc.plaintext))"],
                          capture_output=True, text=True, timeout=120).stdout
    for name in ("Engine", "StreamConfig", "Session"):  # help(strata_jax) shows them
        assert f"\n    {name}" in text or f" {name} = " in text or f"class {name}" in text, name
    assert "strata_jax - strata_jax" not in text  # the name line does not repeat itself
