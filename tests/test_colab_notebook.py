"""launch/colab_demo.ipynb runs top to bottom, with tiny settings, in a real Jupyter kernel.

The cells run unmodified through nbclient in an ipykernel ``python3`` kernel
(jupyter_client falls back to ipykernel's built-in spec when no kernel.json
is installed), so IPython syntax (the ``!`` lines of the install cell) and
the inline matplotlib backend behave as on Colab. ``CAPO_NOTEBOOK_TINY=1``
selects ``configs/demo.py:shrink``; ``PYTHONPATH`` points the kernel at this
checkout, so the install cell takes its "already installed" branch and
clones nothing.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "launch" / "colab_demo.ipynb"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The notebook's tiny settings: 2 RL steps, a held-out evaluation after every step.
TINY_EVAL_STEPS = [0, 1, 2]


def _code_cells(nb: Any) -> list[Any]:
  return [cell for cell in nb.cells if cell.cell_type == "code"]


def _stdout(cell: Any) -> str:
  return "".join(
    o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout"
  )


def _png_outputs(cell: Any) -> list[Any]:
  return [
    o
    for o in cell.outputs
    if o.output_type in ("display_data", "execute_result") and "image/png" in o.data
  ]


def _jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
  return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_notebook_is_stored_without_outputs() -> None:
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  cells = _code_cells(nb)
  for i, cell in enumerate(cells):
    assert cell.outputs == [] and cell.execution_count is None, f"code cell {i} has outputs"
  install = cells[0].source
  assert install.lstrip().startswith("# Where to get capo-jax")
  assert 'REPO_URL = "https://github.com/capo-jax/capo-jax.git"' in install
  # The clone and pip lines sit under the "not importable" branch only.
  guarded = install.split('find_spec("capo_jax") is None', 1)[1].split("\nelse:", 1)[0]
  for needle in (
    "!git clone",
    "pip install -q -r requirements.txt",
    "pip install -q -e . --no-deps",
  ):
    assert needle in guarded, needle


@pytest.mark.slow  # whole runs in subprocesses (1-4 min on 2 cores); .ci/run runs it
def test_notebook_runs_with_tiny_settings(
  tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
  workdir = tmp_path / "work"
  monkeypatch.setenv("CAPO_NOTEBOOK_TINY", "1")
  monkeypatch.setenv("CAPO_NOTEBOOK_WORKDIR", str(workdir))
  monkeypatch.setenv(
    "PYTHONPATH",
    os.pathsep.join(
      [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    ),
  )
  monkeypatch.delenv("MPLBACKEND", raising=False)  # keep the kernel's inline backend
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(
    nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
  )
  client.execute()  # raises CellExecutionError, with the traceback, if any cell fails

  cells = _code_cells(nb)
  assert f"capo-jax from {REPO}" in _stdout(cells[0])
  assert not (tmp_path / "capo-jax").exists(), "the install cell cloned although installed"
  assert "tiny=True" in _stdout(cells[1])

  # Both RL runs finished, with the held-out evaluations the tiny settings ask for.
  for name in ("colab_grpo", "colab_capo"):
    run_dir = workdir / name
    evals = json.loads((run_dir / "evals.json").read_text(encoding="utf-8"))
    assert [e["step"] for e in evals] == TINY_EVAL_STEPS, name
    rows = _jsonl(run_dir / "metrics.jsonl")
    assert sorted({r["step"] for r in rows if "eval/accuracy" in r}) == TINY_EVAL_STEPS, name
    assert sorted({r["step"] for r in rows if "loss" in r}) == [1, 2], name
    assert (run_dir / "export_hf" / "config.json").is_file(), name
  assert len(list((workdir / "warm_start").iterdir())) == 1  # one warm start, shared

  # Two inline figures (curves, precision-coverage), also saved as PNG files.
  figure_cells = [cell for cell in cells if _png_outputs(cell)]
  assert len(figure_cells) == 2, [len(_png_outputs(c)) for c in cells]
  for name in ("colab_curves.png", "colab_precision_coverage.png"):
    assert (workdir / name).read_bytes()[:8] == PNG_MAGIC, name
