"""Docstrings name only what exists, and no dates, machines or sessions (issue 45, item 5).

Every path (``capo_jax/rl/packing.py``, ``docs/tpu.md``) and every dotted module name of the
project (``capo_jax.eval.report``) a docstring mentions must exist in the checkout; measured
figures carry their date and machine in docs/, never in a docstring.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOTS = ("capo_jax", "models", "configs", "benchmarks", "studies", "tools", "launch", "tests")
TOP = ("capo_jax", "models", "configs", "benchmarks", "studies", "tools", "launch", "tests", "docs")
_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/])" % "|".join(TOP))
# Paths inside the package written from its root (``rl/packing.py``).
_SUBPACKAGE = re.compile(r"(?<![\w./-])((?:rl|run|runtime|eval|data|sampling|demo)/\w+\.py)")
_MODULE = re.compile(
  r"(?<![\w./\"'-])((?:capo_jax|models|configs|benchmarks|studies|tools)"
  r"(?:\.[A-Za-z_]\w*)+)(?![\w*])"
)
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
_MACHINE = re.compile(r"\b(\d+-core|Xeon|EPYC|this (?:box|session)|the box|our box)\b", re.I)


def _docstrings() -> list[tuple[str, str]]:
  out = []
  for root in ROOTS:
    for path in sorted((REPO / root).rglob("*.py")):
      if any(part.startswith(".venv") for part in path.parts):
        continue
      tree = ast.parse(path.read_text(encoding="utf-8"))
      for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
          doc = ast.get_docstring(node, clean=False)
          if doc:
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 1)}"
            out.append((where, doc))
  return out


DOCSTRINGS = _docstrings()


def _top_level_names(path: pathlib.Path) -> set[str]:
  names: set[str] = set()
  for node in ast.parse(path.read_text(encoding="utf-8")).body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names.update(n.id for tg in targets for n in ast.walk(tg) if isinstance(n, ast.Name))
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split(".")[0] for a in node.names)
  return names


def _module_exists(name: str) -> bool:
  """A module of the checkout, or a top-level name of one (``capo_jax.eval.comparison.compare``)."""
  parts = name.split(".")
  for n in range(len(parts), 0, -1):
    base = REPO.joinpath(*parts[:n])
    path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    if path.is_file():
      return n == len(parts) or parts[n] in _top_level_names(path)
  return False


def test_the_scan_sees_the_package():
  assert len(DOCSTRINGS) > 200, len(DOCSTRINGS)
  assert _module_exists("capo_jax.eval.report") and not _module_exists("capo_jax.no_such")


@pytest.mark.parametrize("where, doc", DOCSTRINGS, ids=[w for w, _ in DOCSTRINGS])
def test_every_named_path_and_module_exists(where, doc):
  missing = [
    p
    for p in _PATH.findall(doc)  # venvs are made by the scripts, not checked in
    if not any(ch in p for ch in "*<{")
    and "/.venv" not in p
    and not (REPO / p.rstrip("/.")).exists()
  ]
  missing += [p for p in _SUBPACKAGE.findall(doc) if not (REPO / "capo_jax" / p).exists()]
  missing += [
    m
    for m in _MODULE.findall(doc)  # ``benchmarks.NAME``: a placeholder
    if not m.rsplit(".", 1)[-1].isupper() and not _module_exists(m.rstrip("."))
  ]
  assert not missing, f"{where}: the docstring names what does not exist: {missing}"


@pytest.mark.parametrize("where, doc", DOCSTRINGS, ids=[w for w, _ in DOCSTRINGS])
def test_no_dates_or_machines(where, doc):
  found = _DATE.findall(doc) + _MACHINE.findall(doc)
  assert not found, f"{where}: a docstring names a date or machine {found}; move it to docs/"
