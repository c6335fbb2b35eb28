"""The research folders outside a run: the recorded study the main command prints, and
who may import whom among studies/, tools/ and benchmarks/."""

from __future__ import annotations

import ast
import json
import pathlib
import tomllib

import pytest

from capo_jax.demo import report as demo_report
from capo_jax.demo import study
from tests.docs_guard import refuse_docs

REPO = pathlib.Path(__file__).resolve().parent.parent
# Each box's report of the demo study v3, in the order the main command prints them.
REPORTS = ("docs/studies/demo_v3/run1/study_v3.json", "docs/studies/demo_v3/run2/study_v3.json")


def _recorded() -> list[dict]:
  return json.loads(pathlib.Path(demo_report.STUDY_RESULTS).read_text(encoding="utf-8"))


def test_recorded_study_matches_the_reports_it_summarises():
  """Each entry is its report's date, machine, commit, final and paired sections as they
  stand, so the main command prints what the report would."""
  recorded = _recorded()
  assert [r["report"] for r in recorded] == list(REPORTS)
  for entry in recorded:
    full = json.loads((REPO / entry["report"]).read_text(encoding="utf-8"))
    assert entry == {
      "report": entry["report"],
      "date": full["date"],
      "machine": full["machine"],
      "commit": full["commit"],
      "final": full["final"],
      "paired": full["paired"],
    }
    assert study.held_across_warm_starts(entry) == study.held_across_warm_starts(full)


def test_record_writes_the_packaged_file(tmp_path):
  """The package file is what the study's report code writes from the reports: rewritten
  from them, it comes back byte for byte."""
  from studies.demo_v3 import report  # pylint: disable=import-outside-toplevel

  out = report.record([str(REPO / r) for r in REPORTS], tmp_path / "recorded.json")
  assert out.read_bytes() == pathlib.Path(demo_report.STUDY_RESULTS).read_bytes()
  with pytest.raises(ValueError, match="lacks"):
    report.recorded_summary({"date": "d"})


def test_main_command_reads_nothing_from_docs(monkeypatch):
  refuse_docs(monkeypatch)
  text = demo_report.recorded_study()
  assert text.count("capo - grpo at matched accuracy") == len(REPORTS)


def test_installed_package_carries_the_recorded_study():
  cfg = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
  data = cfg["tool"]["setuptools"]["package-data"]["capo_jax.demo"]
  path = pathlib.Path(demo_report.STUDY_RESULTS)
  assert path.parent == REPO / "capo_jax" / "demo" and path.name in data


def _imports(path: pathlib.Path) -> set[str]:
  """Every name an absolute import of ``path`` takes, as ``package.module[.name]``."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    names = (
      [a.name for a in node.names]
      if isinstance(node, ast.Import)
      else [node.module + "." + a.name for a in node.names]
      if isinstance(node, ast.ImportFrom) and node.module and not node.level
      else []
    )
    out.update(names)
  return out


# Who may import which research folder: benchmarks time the tools' models against
# their peers; nothing imports a study but another study.
MAY_IMPORT = {
  "capo_jax": set(),
  "models": set(),
  "configs": set(),
  "tools": {"tools"},
  "benchmarks": {"benchmarks", "tools"},
  "studies": {"studies"},
}


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_research_folders_are_imported_downward_only(folder):
  bad = []
  for path in sorted((REPO / folder).rglob("*.py")):
    if any(part.startswith(".") for part in path.relative_to(REPO).parts):
      continue  # tools/.venv-tpu: the TPU compiler's venv, thousands of installed modules
    for name in _imports(path):
      top = name.split(".")[0]
      if top in ("studies", "tools", "benchmarks") and top not in MAY_IMPORT[folder]:
        bad.append(f"{path.relative_to(REPO)} imports {name}")
  assert not bad, "\n".join(bad)


def test_studies_import_no_circle():
  modules = {
    ".".join(p.relative_to(REPO).with_suffix("").parts): p
    for p in (REPO / "studies").rglob("*.py")
    if p.name != "__init__.py"
  }
  # ``from studies.demo_v3 import report`` reads as studies.demo_v3.report: an edge.
  graph = {
    m: {n for n in modules for i in _imports(p) if i == n or i.startswith(n + ".")}
    for m, p in modules.items()
  }
  state: dict[str, int] = {}  # 1: on the current path, 2: done

  def visit(m: str, path: list[str]) -> None:
    state[m] = 1
    for n in graph[m]:
      assert state.get(n) != 1, "import circle: " + " -> ".join(path + [m, n])
      if n not in state:
        visit(n, path + [m])
    state[m] = 2

  for m in sorted(modules):
    if m not in state:
      visit(m, [])
