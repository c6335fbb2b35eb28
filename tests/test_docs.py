"""The README and docs/ against the repository: the commands they give exist, their links
resolve, the README's results table quotes figures its evidence pages hold, and the
generated tables of docs/ are what their records in docs/results/ write.

The README is the five-minute page (at most 250 lines); the measured detail lives in
docs/*.md, so these checks read every page, not only the README.
"""

import pathlib
import re

import pytest

from tools import results_tables

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
# The study records (docs/studies/<study>/README.md and the index) and the pages written
# from docs/results/*.json: links checked too.
STUDY_PAGES = sorted((ROOT / "docs" / "studies").rglob("*.md"))
RESULT_PAGES = sorted((ROOT / "docs" / "results").glob("*.md"))
# The manual pages say how things work and quote their figures from the records; the dates,
# machines and work sessions of those figures are the records'. benchmarks.md is a page of
# records; the pages in PENDING are being converted elsewhere (drop a name once it is).
RECORD_PAGES = {"benchmarks.md"}
PENDING: set[str] = set()
MANUAL_PAGES = [p for p in DOCS if p.name not in RECORD_PAGES | PENDING]
# A date, the machine as "box", a work session ("this session", "session's"); `\boxed{}`
# and an OS session ("its own session") are not matched.
LAB_NOTE_WORDS = re.compile(
  r"\d{4}-\d{2}-\d{2}|\bbox(es)?\b|\bsession's\b|\b(this|that|same|one|earlier|previous|"
  r"another|a) (work )?sessions?\b",
  re.I,
)
# Packages of this repository: `python -m <one of these>...` must name a module here.
OWN_PACKAGES = ("capo_jax", "models", "benchmarks", "configs", "studies", "tools")


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
  assert "-m capo_jax.main --config=configs/cued.py --workdir=$(WORKDIR)" in recipes["demo"]
  assert "python -m capo_jax.main\n--config=configs/cued.py --workdir=$WORKDIR" in block
  assert "-m pytest -q -n 2 tests" in recipes["test"]
  assert "`python -m pytest -q -n 2 tests`" in block
  default_workdir = re.search(r"^WORKDIR \?= (\S+)", makefile, re.M).group(1)
  assert f"WORKDIR={default_workdir} by default" in block


def test_commands_name_existing_modules_and_files() -> None:
  missing = []
  for page in PAGES + RESULT_PAGES:
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
    for path in set(
      re.findall(r"\b((?:launch|benchmarks|configs|studies|tools)/[\w/.-]+\.(?:sh|py|ipynb))", text)
    ):
      if not (ROOT / path).is_file():
        missing.append(f"{page.name}: {path}")
  assert not missing, "commands naming what does not exist:\n" + "\n".join(sorted(missing))


@pytest.mark.parametrize(
  "page", PAGES + STUDY_PAGES + RESULT_PAGES, ids=lambda p: str(p.relative_to(ROOT))
)
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


@pytest.mark.parametrize("page", results_tables.pages())
def test_generated_block_is_what_its_records_write(page: str) -> None:
  """A hand edit of a generated table or figure, or a record changed without rerunning the
  tool, fails here."""
  path, text = results_tables.generated(page)
  assert _text(path) == text, (
    f"{page} differs from its records in docs/results/: edit the record, "
    "then run `python -m tools.results_tables`"
  )


def test_every_table_and_manual_figure_is_generated() -> None:
  """The pages with generated blocks include the TPU page's current figures and the
  figures the manual pages quote."""
  pages = set(results_tables.pages())
  assert {
    "docs/tpu.md",
    "docs/results/tpu.md",
    "docs/benchmarks.md",
    "docs/packing.md",
    "docs/lora.md",
    "docs/mismatch.md",
  } <= pages


@pytest.mark.parametrize("page", MANUAL_PAGES, ids=lambda p: p.name)
def test_manual_page_has_no_dates_or_lab_note_words(page: pathlib.Path) -> None:
  found = [
    f"line {i}: {m.group(0)!r}"
    for i, line in enumerate(_text(page).splitlines(), 1)
    for m in LAB_NOTE_WORDS.finditer(line)
  ]
  assert not found, (
    f"{page.name} carries a dated lab note (move it to a record in "
    "docs/results/*.json and quote it with a figure block):\n" + "\n".join(found)
  )


def test_lab_note_words_spare_boxed_answers_and_os_sessions() -> None:
  spared = ["a correct `\\boxed{}` answer", "starts its own session (`setsid`)", "boxed_format"]
  caught = [
    "2026-12-03",
    "this 2-core box",
    "the box's noise",
    "this session's box",
    "in that session",
    "on the same box",
  ]
  assert not [s for s in spared if LAB_NOTE_WORDS.search(s)]
  assert all(LAB_NOTE_WORDS.search(s) for s in caught)


def test_render_replaces_only_the_marked_block() -> None:
  page = "head\n<!-- results:x -->\nold | table\n<!-- /results -->\ntail\n"
  assert results_tables.render(page, "x", "new") == (
    "head\n<!-- results:x -->\nnew\n<!-- /results -->\ntail\n"
  )
  with pytest.raises(ValueError, match="exactly one"):
    results_tables.render("no markers", "x", "new")
  # A figure inside a list item keeps the item's indent; the next block is left alone.
  item = (
    "- a\n  speed: <!-- results:t#i -->\n  old\n  <!-- /results -->\n"
    "- <!-- results:y -->\nz\n<!-- /results -->\n"
  )
  assert results_tables.render(item, "t#i", "1.5x") == (
    "- a\n  speed: <!-- results:t#i -->\n  1.5x\n  <!-- /results -->\n"
    "- <!-- results:y -->\nz\n<!-- /results -->\n"
  )


def test_figure_line_quotes_the_record_and_links_it() -> None:
  record = results_tables.load("tpu")[0]
  line = results_tables.figure_line("tpu", record["id"], "docs/tpu.md")
  assert line == (
    f"{record['what']} ({record['kind']}): {record['result']} "
    f"([record](results/tpu.md#{record['id']}))."
  )
  line = results_tables.figure_line("benchmarks", "train_lengths", "docs/results/x.md")
  assert line.endswith("([record](../benchmarks.md#train_lengths)).")
  with pytest.raises(ValueError, match="names no record"):
    results_tables.figure_line("tpu", "no_such_id", "docs/tpu.md")


@pytest.mark.parametrize("topic", ["benchmarks", "tpu"])
def test_every_record_names_its_date_and_machine(topic: str) -> None:
  records = results_tables.load(topic)
  assert len(records) >= 10
  ids = [r["id"] for r in records]
  assert len(ids) == len(set(ids)), f"docs/results/{topic}.json: duplicate ids"
  for r in records:  # a null says "not recorded"; a recorded date is ISO
    assert set(r) == set(results_tables.FIELDS[topic]), r["id"]
    assert r["date"] is None or re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]), r["id"]
    assert r["machine"] is None or r["machine"].strip(), r["id"]
    assert len(r["result"]) <= results_tables.MAX_RESULT_CHARS, r["id"]
  # Every figure of a result cell is in its record's notes, when it has notes: the short
  # cell quotes the measurement, it does not restate it.
  number = r"\d+(?:,\d{3})*(?:\.\d+)?"
  for r in records:
    if r["notes"]:
      missing = [n for n in re.findall(number, r["result"]) if n not in r["notes"]]
      assert not missing, f"{r['id']}: result figures {missing} not in its notes"


def test_tpu_records_say_their_kind_and_what_replaced_them() -> None:
  """No TPU ran these figures: each is labelled a compiler analysis, an estimate or a plan,
  and tpu.md's table of current figures lists exactly the records nothing superseded."""
  records = results_tables.load("tpu")
  ids = {r["id"] for r in records}
  for r in records:
    assert r["kind"] in results_tables.TPU_KINDS, r["id"]
    assert r["superseded_by"] in ids | {None}, r["id"]
    assert r["superseded_by"] != r["id"], r["id"]
  # Every step time is an estimate.
  assert all(
    r["kind"] == "roofline estimate" for r in records if "seconds per RL step" in r["what"]
  )
  current = {r["id"] for r in records if r["superseded_by"] is None}
  table = (
    _text(ROOT / "docs" / "tpu.md").split("<!-- results:tpu -->")[1].split("<!-- /results -->")[0]
  )
  assert set(re.findall(r"\]\(results/tpu\.md#(\w+)\)", table)) == current
  with pytest.raises(ValueError, match="names no record"):
    results_tables.check_records(
      [{**records[0], "superseded_by": "nothing"}], results_tables.TPU_FIELDS, "tpu"
    )
  with pytest.raises(ValueError, match="kind"):
    results_tables.check_records(
      [{**records[0], "kind": "measured"}], results_tables.TPU_FIELDS, "tpu"
    )


def test_check_records_refuses_a_long_cell_or_a_missing_field() -> None:
  record = dict(results_tables.load("benchmarks")[0])
  with pytest.raises(ValueError, match="too long"):
    results_tables.check_records(
      [{**record, "result": "x" * 201}], results_tables.BENCHMARK_FIELDS, "benchmarks"
    )
  del record["machine"]
  with pytest.raises(ValueError, match="fields"):
    results_tables.check_records([record], results_tables.BENCHMARK_FIELDS, "benchmarks")


def test_study_records_match_their_reports() -> None:
  """Each run's report lies in docs/studies/<study>/run<N>/; its record's date, machine
  and commit are the report's own where the report records them."""
  import json  # pylint: disable=import-outside-toplevel

  records = results_tables.load("studies")
  for r in records:
    report = ROOT / r["report"]
    assert report.is_file(), r["report"]
    assert re.fullmatch(rf"docs/studies/{r['study']}/{r['run']}/[\w.]+", r["report"]), r["report"]
    assert re.fullmatch(r"run\d+", r["run"]), r["run"]
    full = json.loads(report.read_text(encoding="utf-8"))
    for key in ("date", "machine", "commit"):
      if key in full:
        assert r[key] == full[key], f"{r['report']}: record {key} {r[key]!r} vs {full[key]!r}"
  run_dirs = {p.parent for p in (ROOT / "docs" / "studies").glob("*/run*/*")}
  recorded = {(ROOT / r["report"]).parent for r in records}
  assert run_dirs == recorded, f"run folders without a record: {sorted(run_dirs - recorded)}"


def test_no_folder_of_docs_is_named_after_a_machine() -> None:
  machine = re.compile(r"box|xeon|epyc|amd|intel|session|h100|h200|tpu_v", re.I)
  named = [
    str(p.relative_to(ROOT))
    for p in (ROOT / "docs").rglob("*")
    if p.is_dir() and machine.search(p.name)
  ]
  assert not named, f"folders named after a machine (name it in the record): {named}"
