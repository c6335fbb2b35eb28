"""The tables and figures of measured results in docs/, written from their records in
docs/results/.

A dated measurement lives once, as a record in ``docs/results/<topic>.json`` (what, the
command, the date, the machine, a short result and the long notes verbatim); a page that
shows it carries a generated block between ``<!-- results:<topic> -->`` and
``<!-- /results -->`` (a table of the topic), or between ``<!-- results:<topic>#<id> -->``
and ``<!-- /results -->`` (one record's figure, one line with a link to the record). The
manual pages quote figures through such blocks, so their dates stay in the records. Edit the
record, then rewrite the pages:

  python -m tools.results_tables           # rewrite every generated block
  python -m tools.results_tables --check   # exit 1 if a page differs from its records

``tests/test_docs.py`` runs the check, so a hand edit of a generated table fails.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
from typing import Any, Callable

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
END = "<!-- /results -->"
# Fields every record of a topic carries; a null date or machine says "not recorded".
BENCHMARK_FIELDS = ("id", "what", "setup", "command", "date", "machine", "result", "notes", "link")
STUDY_FIELDS = ("study", "run", "date", "machine", "commit", "report", "notes")
# A TPU figure says what kind of figure it is (no TPU ran any of them) and which later
# record, if any, replaced it: the pages quote only the current ones.
TPU_FIELDS = (
  "id",
  "what",
  "kind",
  "setup",
  "command",
  "date",
  "machine",
  "result",
  "notes",
  "superseded_by",
)
TPU_KINDS = (
  "TPU compiler analysis",
  "roofline estimate",
  "memory plan",
  "XLA memory analysis off TPU",
)
FIELDS = {"benchmarks": BENCHMARK_FIELDS, "studies": STUDY_FIELDS, "tpu": TPU_FIELDS}
# Where each topic's records are written out in full, with their notes (figures link there).
RECORD_PAGES = {"benchmarks": "docs/benchmarks.md", "tpu": "docs/results/tpu.md"}
# Longest cell of a generated table: the long prose goes to the notes, not the table.
MAX_RESULT_CHARS = 200
MAX_WHAT_CHARS = 120
FIGURE = re.compile(r"<!-- results:(\w+)#(\w+) -->")

Record = dict[str, Any]


def load(topic: str) -> list[Record]:
  """The records of ``docs/results/<topic>.json``."""
  return json.loads((RESULTS / f"{topic}.json").read_text(encoding="utf-8"))


def _cell(value: Any) -> str:
  """A table cell: null as "not recorded", pipes escaped so a cell stays one cell."""
  return "not recorded" if value is None else str(value).replace("|", "\\|")


def _command(command: str | None) -> str:
  """A command as a code span; one with its own code spans (a command, then another) is
  stored as written."""
  if command is None or "`" in command:
    return _cell(command)
  return _cell(f"`{command}`")


def check_records(records: list[Record], fields: tuple[str, ...], topic: str) -> None:
  """Every record has exactly ``fields`` and short table cells; raises ValueError naming it."""
  for i, r in enumerate(records):
    name = f"docs/results/{topic}.json record {i} ({r.get('id') or r.get('study')})"
    if tuple(r) != fields:
      raise ValueError(f"{name}: fields {tuple(r)}, expected {fields}")
    if len(r.get("result") or "") > MAX_RESULT_CHARS or len(r.get("what") or "") > MAX_WHAT_CHARS:
      raise ValueError(f"{name}: 'what' or 'result' too long for a table cell; move it to 'notes'")
    if "kind" in fields and r["kind"] not in TPU_KINDS:
      raise ValueError(f"{name}: kind {r['kind']!r} is none of {TPU_KINDS}")
    if r.get("superseded_by") is not None and r["superseded_by"] not in {x["id"] for x in records}:
      raise ValueError(f"{name}: superseded_by {r['superseded_by']!r} names no record")


def _notes(records: list[Record]) -> list[str]:
  """Each record's heading (its id, the anchor the tables link to), setup and notes."""
  lines = ["", "### Notes", ""]
  for r in records:
    lines += [f"#### {r['id']}", ""]
    lines.append(f"{r['what']}" + (f" ({r['setup']})." if r["setup"] else "."))
    if r.get("kind"):
      lines += ["", f"Kind: {r['kind']}."]
    if r.get("superseded_by"):
      lines += ["", f"Superseded by [{r['superseded_by']}](#{r['superseded_by']})."]
    if r["notes"]:
      lines += ["", r["notes"]]
    if r.get("link"):
      lines += ["", f"More: [{r['link']}]({r['link']})."]
    lines.append("")
  return lines


def benchmarks_block(records: list[Record]) -> str:
  """The benchmarks table, one row per record, then each record's setup and notes."""
  check_records(records, BENCHMARK_FIELDS, "benchmarks")
  lines = ["| claim | command | date | machine | result |", "|---|---|---|---|---|"]
  for r in records:
    lines.append(
      f"| [{_cell(r['what'])}](#{r['id']}) | {_command(r['command'])} | "
      f"{_cell(r['date'])} | {_cell(r['machine'])} | {_cell(r['result'])} |"
    )
  return "\n".join(lines + _notes(records))


def tpu_records_block(records: list[Record]) -> str:
  """Every TPU figure: kind, command, date, the machine the compile or plan ran on, the
  result, then each record's notes (for ``docs/results/tpu.md``)."""
  check_records(records, TPU_FIELDS, "tpu")
  lines = ["| figure | kind | command | date | ran on | result |", "|---|---|---|---|---|---|"]
  for r in records:
    what = _cell(r["what"]) + (" (superseded)" if r["superseded_by"] else "")
    lines.append(
      f"| [{what}](#{r['id']}) | {r['kind']} | {_command(r['command'])} | "
      f"{_cell(r['date'])} | {_cell(r['machine'])} | {_cell(r['result'])} |"
    )
  return "\n".join(lines + _notes(records))


def tpu_current_block(records: list[Record]) -> str:
  """The current TPU figures (no later record replaced them), no dates: for ``docs/tpu.md``."""
  check_records(records, TPU_FIELDS, "tpu")
  lines = ["| figure | kind | result |", "|---|---|---|"]
  lines += [
    f"| [{_cell(r['what'])}](results/tpu.md#{r['id']}) | {r['kind']} | {_cell(r['result'])} |"
    for r in records
    if r["superseded_by"] is None
  ]
  return "\n".join(lines)


def studies_block(records: list[Record]) -> str:
  """The index of recorded study runs, for ``docs/studies/README.md`` (links relative to it)."""
  check_records(records, STUDY_FIELDS, "studies")
  lines = ["| study | run | date | machine | commit | report |", "|---|---|---|---|---|---|"]
  for r in records:
    report = r["report"].removeprefix("docs/studies/")
    lines.append(
      f"| [{r['study']}]({r['study']}/README.md) | {r['run']} | {_cell(r['date'])} | "
      f"{_cell(r['machine'])} | {_cell(r['commit'])} | [{report}]({report}) |"
    )
  notes = [f"- {r['study']} {r['run']}: {r['notes']}" for r in records if r["notes"]]
  return "\n".join(lines + ([""] + notes if notes else []))


def figure_line(topic: str, record_id: str, page: str) -> str:
  """One record's figure for a manual page: what, its kind where it has one, the result, and
  a link to the record (no date: that is the record's)."""
  records = load(topic)
  check_records(records, FIELDS[topic], topic)
  matches = [r for r in records if r.get("id") == record_id]
  if topic not in RECORD_PAGES or len(matches) != 1:
    raise ValueError(
      f"{page}: '<!-- results:{topic}#{record_id} -->' names no record of docs/results/{topic}.json"
    )
  r = matches[0]
  link = os.path.relpath(REPO / RECORD_PAGES[topic], (REPO / page).parent)
  kind = f" ({r['kind']})" if r.get("kind") else ""
  return f"{r['what']}{kind}: {r['result']} ([record]({link}#{record_id}))."


# The tables: (page, topic of its records and of its marker, writer).
TABLES: tuple[tuple[str, str, Callable[[list[Record]], str]], ...] = (
  ("docs/benchmarks.md", "benchmarks", benchmarks_block),
  ("docs/studies/README.md", "studies", studies_block),
  ("docs/results/tpu.md", "tpu", tpu_records_block),
  ("docs/tpu.md", "tpu", tpu_current_block),
)


def render(text: str, marker: str, block: str) -> str:
  """``text`` with the block between ``marker``'s start and the end replaced by ``block``,
  indented as the line holding the start is (so a figure stays inside its list item)."""
  start = f"<!-- results:{marker} -->"
  pattern = re.compile(
    r"^([ \t]*)([^\n]*?)" + re.escape(start) + r"\n.*?" + re.escape(END), re.S | re.M
  )
  if len(pattern.findall(text)) != 1:
    raise ValueError(f"render: the page needs exactly one '{start}' ... '{END}' block")

  def write(m: re.Match[str]) -> str:
    indent = m.group(1)
    body = "\n".join(indent + line if line else line for line in block.split("\n"))
    return f"{indent}{m.group(2)}{start}\n{body}\n{indent}{END}"

  return pattern.sub(write, text)


def pages() -> list[str]:
  """Every page with a generated block: the tables' pages and each docs page with a figure."""
  with_figures = [
    str(p.relative_to(REPO))
    for p in sorted((REPO / "docs").rglob("*.md"))
    if FIGURE.search(p.read_text(encoding="utf-8"))
  ]
  return sorted({page for page, _, _ in TABLES} | set(with_figures))


def generated(page: str) -> tuple[pathlib.Path, str]:
  """The path of ``page`` (relative to the repository) and its full text as its records
  write it: every table and every figure block rewritten."""
  path = REPO / page
  text = path.read_text(encoding="utf-8")
  for table_page, topic, writer in TABLES:
    if table_page == page:
      text = render(text, topic, writer(load(topic)))
  for topic, record_id in sorted(set(FIGURE.findall(text))):
    text = render(text, f"{topic}#{record_id}", figure_line(topic, record_id, page))
  return path, text


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--check", action="store_true", help="exit 1 if a page differs; write nothing")
  args = p.parse_args(argv)
  stale = []
  for page in pages():
    path, text = generated(page)
    if path.read_text(encoding="utf-8") != text:
      stale.append(page)
      if not args.check:
        path.write_text(text, encoding="utf-8")
  verb = "differ from their records" if args.check else "rewritten"
  print(f"{verb}: {', '.join(stale)}" if stale else "every generated block matches its records")
  return 1 if stale and args.check else 0


if __name__ == "__main__":
  sys.exit(main())
