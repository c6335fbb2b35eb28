"""The README and docs/ against the repository: the commands they give exist, their links
resolve, and the README's results table quotes figures its evidence pages hold.

The README is the five-minute page (at most 250 lines); the measured detail lives in
docs/*.md, so these checks read every page, not only the README.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
# Packages of this repository: `python -m <one of these>...` must name a module here.
OWN_PACKAGES = ("capo_jax", "models", "benchmarks", "configs")


def _text(path: pathlib.Path) -> str:
  return path.read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
  """The body of a `## heading` section, up to the next `## ` heading."""
  m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
  assert m, f"README has no section '## {heading}'"
  return m.group(1)


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
  s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return s.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
  anchors, fence = set(), False
  for line in _text(path).splitlines():
    if line.startswith("```"):
      fence = not fence
    elif not fence and (m := re.match(r"^#{1,6} (.+)$", line)):
      anchors.add(_slug(m.group(1)))
  return anchors


def _links(path: pathlib.Path):
  for m in re.finditer(r"\]\(([^)\s]+)\)", _text(path)):
    target = m.group(1)
    if not re.match(r"^[a-z]+:", target):  # skip http:, https:, mailto:
      yield target


def test_readme_is_short() -> None:
  n = len(_text(README).splitlines())
  assert n <= 250, f"README.md has {n} lines; move detail into docs/ (limit 250)"


def test_two_commands_are_the_makefile_targets() -> None:
  text = _text(README)
  block = _section(text, "The two commands")
  assert re.search(r"^make demo\b", block, re.M) and re.search(r"^make test\b", block, re.M)
  makefile = _text(ROOT / "Makefile")
  recipes = dict(re.findall(r"^(\w+):.*\n\t(.+)", makefile, re.M))
  # What the README says each one runs.
  assert "-m capo_jax.main --config=configs/demo.py --workdir=$(WORKDIR)" in recipes["demo"]
  assert "python -m capo_jax.main\n--config=configs/demo.py --workdir=$WORKDIR" in block
  assert "-m pytest -q tests" in recipes["test"]
  assert "`python -m pytest -q tests`" in block
  default_workdir = re.search(r"^WORKDIR \?= (\S+)", makefile, re.M).group(1)
  assert f"WORKDIR={default_workdir} by default" in block


def test_commands_name_existing_modules_and_files() -> None:
  missing = []
  for page in PAGES:
    text = _text(page)
    for mod in set(re.findall(r"python -m ([A-Za-z_][\w.]*)", text)):
      if mod.split(".")[0] not in OWN_PACKAGES:
        continue
      base = ROOT / mod.replace(".", "/")
      if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
        missing.append(f"{page.name}: python -m {mod}")
    for cfg in set(re.findall(r"--config=(configs/[\w/.]+?\.py)", text)):
      if not (ROOT / cfg).is_file():
        missing.append(f"{page.name}: --config={cfg}")
    paths = re.findall(r"\b((?:launch|benchmarks|configs)/[\w/.-]+\.(?:sh|py|ipynb))", text)
    for path in set(paths):
      if not (ROOT / path).is_file():
        missing.append(f"{page.name}: {path}")
  assert not missing, "commands naming what does not exist:\n" + "\n".join(sorted(missing))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: pathlib.Path) -> None:
  broken = []
  for target in _links(page):
    file_part, _, anchor = target.partition("#")
    dest = (page.parent / file_part).resolve() if file_part else page
    if not dest.exists():
      broken.append(f"{target}: no such file")
    elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
      broken.append(f"{target}: no heading with anchor #{anchor}")
  assert not broken, f"{page.name}:\n" + "\n".join(broken)


def test_readme_indexes_every_docs_page() -> None:
  linked = {(README.parent / t.partition("#")[0]).resolve() for t in _links(README)}
  unlisted = [p.name for p in DOCS if p.resolve() not in linked]
  assert not unlisted, f"docs pages the README does not link: {unlisted}"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_page_opens_with_title_and_summary(page: pathlib.Path) -> None:
  lines = _text(page).splitlines()
  assert lines[0].startswith("# "), f"{page.name} does not start with a '# ' title"
  body = [line for line in lines[1:] if line.strip()]
  assert body and not body[0].startswith(("#", "|", "```", "    ")), (
    f"{page.name}: the title is not followed by a summary paragraph"
  )


def test_results_table_quotes_its_evidence() -> None:
  """Every figure and date in a results row appears on the page that row links to."""
  rows = [
    r for r in _section(_text(README), "Results").splitlines() if r.startswith("| ") and "](" in r
  ]
  assert len(rows) >= 3
  number = r"\d+(?:\.\d+)?e-\d+|\d+\.\d+|\d{4}-\d{2}-\d{2}"
  problems = []
  for row in rows:
    *cells, evidence = [c.strip() for c in row.strip("|").split("|")]
    target = re.search(r"\]\(([^)#]+)", evidence).group(1)
    page_text = _text(README.parent / target)
    for fig in re.findall(number, " ".join(cells[1:])):
      if fig not in page_text:
        problems.append(f"{fig} (row '{cells[0]}') not in {target}")
  assert not problems, "\n".join(problems)
