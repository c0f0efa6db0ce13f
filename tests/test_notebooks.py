"""The notebooks run top to bottom (as CI runs them) and are stored without outputs.

Each notebook executes in a temporary directory (its figures land there) on this interpreter's
kernel, with a per-cell timeout, so a hanging cell fails the test instead of the CI job.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 120
"""Generous for one cell (the slowest profiles a GPT-style step on a 2-core CPU in about 20 s)."""


def test_there_are_notebooks() -> None:
    assert len(NOTEBOOKS) >= 2, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name} cell {index} has outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copy(path, tmp_path))
    notebook = nbformat.read(copy, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "error"
    ]
    assert not errors, errors
