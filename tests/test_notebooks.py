"""The example notebooks execute without error on the CPU (small sizes), on the
reference backend: what they call must work; the kernels they would run
interpreted are tested on their own. They run one after another in one
Jupyter kernel (its start and JAX's import once), the user namespace reset
between them, so that none leans on another's variables. Documentation, not
the library's behaviour (``make demo``'s test runs the layer the quickstart
shows): ``--full`` (test-full) only, all four."""

import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from sweep import FULL

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "notebooks")
NAMES = ["01_quickstart.ipynb", "02_formats.ipynb", "03_performance.ipynb", "04_checkpoints.ipynb"]


def _read(name: str) -> nbformat.NotebookNode:
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    committed = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert any(cell.get("outputs") for cell in committed), f"{name}: committed without outputs"
    for cell in committed:
        cell.outputs = []
    return nb


@FULL
def test_notebooks_run(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("HUMMING_JAX_BACKEND", "reference")
    notebooks = {name: _read(name) for name in NAMES}
    assert sorted(n for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb")) == NAMES, "a notebook no test runs"
    reset = nbformat.v4.new_code_cell("%reset -f")
    client = NotebookClient(
        notebooks[NAMES[0]],
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.abspath(NOTEBOOKS)}},
    )
    with client.setup_kernel():
        for name, nb in notebooks.items():
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                try:
                    client.execute_cell(cell, index)
                except CellExecutionError as error:
                    pytest.fail(f"{name}, cell {index}: {error}")
            errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
            assert not errors, (name, errors)
            client.execute_cell(reset, 0)
    assert sys.executable  # the kernel is this environment's ipykernel
