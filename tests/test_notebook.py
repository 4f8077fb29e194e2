"""notebooks/quickstart.ipynb runs top to bottom (nbclient, kernel python3) so it cannot rot.

The notebook is committed without outputs; executing it must raise no error, show the identity
check, the follow-up's "reused + read" line, the scores' identity check, the quantized formats'
accuracy lines and the per-layer plot.
"""

from __future__ import annotations

import os

import pytest

NOTEBOOK = os.path.join(os.path.dirname(__file__), os.pardir, "notebooks", "quickstart.ipynb")

nbformat = pytest.importorskip(
    "nbformat", reason="nbformat is not installed: `pip install -e .[test]` brings it")
nbclient = pytest.importorskip(
    "nbclient", reason="nbclient is not installed: `pip install -e .[test]` brings it")
pytest.importorskip(
    "ipykernel", reason="ipykernel (the python3 kernel) is not installed: `pip install -e .[test]`")


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in _code_cells(nb):
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_saves_its_profile_where_it_is_removed():
    # tempfile.mkdtemp() left a folder with experts.npz in the temp directory on every run.
    nb = nbformat.read(NOTEBOOK, as_version=4)
    saving = [c.source for c in _code_cells(nb) if "experts.npz" in c.source]
    assert len(saving) == 1
    assert "mkdtemp" not in saving[0] and "tempfile.TemporaryDirectory()" in saving[0]


@pytest.mark.slow
def test_quickstart_runs(tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    scratch = tmp_path / "tmp"  # the kernel's temp directory: the notebook leaves nothing there
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    assert not list(scratch.rglob("experts.npz"))
    outputs = [o for cell in _code_cells(nb) for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "streaming backend:" in text
    assert "identical: resident and routed-streamed" in text
    assert "612 tokens = 512 reused + 100 read" in text
    assert "identical scores: resident and routed-streamed" in text
    assert "511 tokens scored" in text
    assert "routed + profile:" in text
    # quantized experts against the plain model, position by position
    assert [line.split(":")[0] for line in text.splitlines()
            if "top token the same at" in line] == ["fp8", "int4"]
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 1  # the per-layer copied/skipped plot
