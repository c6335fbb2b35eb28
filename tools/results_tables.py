"""The tables of measured results in docs/, written from their records in docs/results/.

A dated measurement lives once, as a record in ``docs/results/<topic>.json`` (what, the
command, the date, the machine, a short result and the long notes verbatim); the page
that shows it carries a generated block between ``<!-- results:<topic> -->`` and
``<!-- /results -->``. Edit the record, then rewrite the pages:

  python -m tools.results_tables           # rewrite every generated block
  python -m tools.results_tables --check   # exit 1 if a page differs from its records

``tests/test_docs.py`` runs the check, so a hand edit of a generated table fails.
"""

from __future__ import annotations

import argparse
import json
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
# Longest cell of a generated table: the long prose goes to the notes, not the table.
MAX_RESULT_CHARS = 200
MAX_WHAT_CHARS = 120


def load(topic: str) -> list[dict[str, Any]]:
  """The records of ``docs/results/<topic>.json``."""
  return json.loads((RESULTS / f"{topic}.json").read_text(encoding="utf-8"))


def _cell(value: Any) -> str:
  """A table cell: null as "not recorded", pipes escaped so a cell stays one cell."""
  return "not recorded" if value is None else str(value).replace("|", "\\|")


def check_records(records: list[dict[str, Any]], fields: tuple[str, ...], topic: str) -> None:
  """Every record has exactly ``fields`` and short table cells; raises ValueError naming it."""
  for i, r in enumerate(records):
    name = f"docs/results/{topic}.json record {i} ({r.get('id') or r.get('study')})"
    if tuple(r) != fields:
      raise ValueError(f"{name}: fields {tuple(r)}, expected {fields}")
    if len(r.get("result") or "") > MAX_RESULT_CHARS or len(r.get("what") or "") > MAX_WHAT_CHARS:
      raise ValueError(f"{name}: 'what' or 'result' too long for a table cell; move it to 'notes'")


def benchmarks_block(records: list[dict[str, Any]]) -> str:
  """The benchmarks table, one row per record, then each record's setup and notes."""
  check_records(records, BENCHMARK_FIELDS, "benchmarks")
  lines = ["| claim | command | date | machine | result |", "|---|---|---|---|---|"]
  for r in records:
    claim = f"[{_cell(r['what'])}](#{r['id']})"
    # A command with its own code spans (a command, then another) is stored as written.
    command = r["command"] if "`" in r["command"] else f"`{r['command']}`"
    lines.append(f"| {claim} | {_cell(command)} | {_cell(r['date'])} | "
                 f"{_cell(r['machine'])} | {_cell(r['result'])} |")
  lines += ["", "### Notes", ""]
  for r in records:
    lines += [f"#### {r['id']}", ""]
    lines.append(f"{r['what']}" + (f" ({r['setup']})." if r["setup"] else "."))
    if r["notes"]:
      lines += ["", r["notes"]]
    if r["link"]:
      lines += ["", f"More: [{r['link']}]({r['link']})."]
    lines.append("")
  return "\n".join(lines)


def studies_block(records: list[dict[str, Any]]) -> str:
  """The index of recorded study runs, for ``docs/studies/README.md`` (links relative to it)."""
  check_records(records, STUDY_FIELDS, "studies")
  lines = ["| study | run | date | machine | commit | report |", "|---|---|---|---|---|---|"]
  for r in records:
    report = r["report"].removeprefix("docs/studies/")
    lines.append(f"| [{r['study']}]({r['study']}/README.md) | {r['run']} | {_cell(r['date'])} | "
                 f"{_cell(r['machine'])} | {_cell(r['commit'])} | [{report}]({report}) |")
  notes = [f"- {r['study']} {r['run']}: {r['notes']}" for r in records if r["notes"]]
  return "\n".join(lines + ([""] + notes if notes else []))


# topic -> (the page holding its block, the block's writer)
PAGES: dict[str, tuple[str, Callable[[list[dict[str, Any]]], str]]] = {
    "benchmarks": ("docs/benchmarks.md", benchmarks_block),
    "studies": ("docs/studies/README.md", studies_block),
}


def render(text: str, topic: str, block: str) -> str:
  """``text`` with the block between ``topic``'s markers replaced by ``block``."""
  start = f"<!-- results:{topic} -->"
  pattern = re.compile(re.escape(start) + r"\n.*?" + re.escape(END), re.S)
  if len(pattern.findall(text)) != 1:
    raise ValueError(f"render: the page needs exactly one '{start}' ... '{END}' block")
  return pattern.sub(lambda _: f"{start}\n{block}\n{END}", text)


def generated(topic: str) -> tuple[pathlib.Path, str]:
  """The page of ``topic`` and its full text as its records write it."""
  page, writer = PAGES[topic]
  path = REPO / page
  return path, render(path.read_text(encoding="utf-8"), topic, writer(load(topic)))


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--check", action="store_true", help="exit 1 if a page differs; write nothing")
  args = p.parse_args(argv)
  stale = []
  for topic in PAGES:
    path, text = generated(topic)
    if path.read_text(encoding="utf-8") != text:
      stale.append(str(path.relative_to(REPO)))
      if not args.check:
        path.write_text(text, encoding="utf-8")
  verb = "differ from their records" if args.check else "rewritten"
  print(f"{verb}: {', '.join(stale)}" if stale else "every generated block matches its records")
  return 1 if stale and args.check else 0


if __name__ == "__main__":
  sys.exit(main())
