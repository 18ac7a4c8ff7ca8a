"""The example notebooks execute without error on the CPU (small sizes), on the
reference backend: what they call must work; the kernels they would run
interpreted are tested on their own."""

import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "notebooks")


@pytest.mark.parametrize(
    "name", ["01_quickstart.ipynb", "02_formats.ipynb", "03_performance.ipynb", "04_checkpoints.ipynb"]
)
def test_notebook_runs(name, tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("HUMMING_JAX_BACKEND", "reference")
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    assert any(cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), "committed without outputs"
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": os.path.abspath(NOTEBOOKS)}}
    )
    client.execute()  # raises CellExecutionError naming the failing cell
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    assert sys.executable  # the kernel is this environment's ipykernel
