"""The cued study's report (docs/studies/cued/README.md): the premise check M, P1 and P2
with a t-interval across warm starts and each warm start's estimate, and a table over
every arm.

Reads the ``evals.json`` of every finished run under ``<root>/ws<w>/<arm>_seed<k>/`` (step
0 is the warm start's evaluation, shared by its runs) and the design the runs recorded
(``<root>/design.json``); writes ``<out>/cued_study.md`` and ``cued_study.json``. M, the
matched-accuracy gaps and P1 / P2 are computed by ``capo_jax.demo.cued_checks``, the
code the demo's report shares. P1 reads AUC-mean, P2 the pooled trap AUC (it keeps
all-wrong traps), the trap gap beside them.

``record`` writes what ``make demo`` prints of the study (``RECORDED``, package data, so
the demo reads nothing from docs/) from the latest cued entry of
``docs/results/studies.json`` and the report it names:

  python -m studies.cued.report --record
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from capo_jax.demo import cued_checks
from capo_jax.demo.cued_checks import (  # noqa: F401  the study's names, re-exported
  Runs,
  compare,
  interval_text,
  matched_gap,
  premise,
  verdict,
)
from capo_jax.demo.report import STUDY_CUED
from capo_jax.eval import paired, traps
from studies.records import REPO, fmt, header, mean_sd, write_report

TABLE_KEYS = (*traps.SUMMARY_KEYS, *traps.TRAP_KEYS)
STUDIES_INDEX = REPO / "docs" / "results" / "studies.json"
RECORDED = pathlib.Path(STUDY_CUED)
# What the demo reads of the design the runs recorded.
DESIGN_KEYS = (
  "warm_starts",
  "premise_warm_starts",
  "seeds",
  "reference",
  "primary",
  "steps",
  "lr",
  "eval",
  "premise",
  "compare",
)
_value = cued_checks.value


def load_runs(root: pathlib.Path) -> Runs:
  """(warm start, arm, seed) -> evaluations, of every finished run."""
  out: Runs = {}
  for path in sorted(root.glob("ws*/*_seed*/evals.json")):
    arm, _, seed = path.parent.name.rpartition("_seed")
    w = path.parent.parent.name[2:]
    if w.isdigit() and seed.isdigit():
      evals = json.loads(path.read_text(encoding="utf-8"))
      # heldout_metrics names AUC-mean's mixed questions auc_questions
      out[(int(w), arm, int(seed))] = [{"mixed": e.get("auc_questions"), **e} for e in evals]
  return out


def analyse(root: pathlib.Path, design: dict[str, Any]) -> dict[str, Any]:
  runs = load_runs(root)
  cmp = design["compare"]
  keys = {"p1": cmp["p1"], "p2": cmp["p2"], **{k: k for k in cmp["secondary"]}}
  arms = [a for a in design["arms"] if a != design["reference"]]
  return {
    "premise": premise(runs, design),
    "compare": {a: {name: compare(runs, design, a, k) for name, k in keys.items()} for a in arms},
    "final": {
      a: {
        k: [_value(ev[-1], k) for (w, arm, s), ev in sorted(runs.items()) if arm == a]
        for k in TABLE_KEYS
      }
      for a in design["arms"]
    },
    "warm_start": {
      w: {k: _value(ev[0], k) for k in TABLE_KEYS} for (w, _, _), ev in sorted(runs.items())
    },
    "runs": len(runs),
  }


def family(res: dict[str, Any], design: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """Every arm's gaps but the primary's (its P1 / P2 were pre-registered alone): each
  one's t p-value over warm starts and whether it holds under Holm at 5% across them."""
  label = {"p1": "AUC-mean", "p2": "pooled trap AUC", "trap_gap": "trap gap"}
  p = {
    f"{a} {label.get(k, k)}": paired.t_pvalue([w["estimate"] for w in c["per_warm_start"]])
    for a, comps in res["compare"].items()
    if a != design["primary"]
    for k, c in comps.items()
  }
  held = paired.holm(p)
  return {name: {"p": p[name], "holds": held[name]} for name in p}


def tables(res: dict[str, Any], design: dict[str, Any]) -> str:
  m = res["premise"]
  p = design["premise"]
  out = [
    f"## M: GRPO takes the shortcut ({'holds' if m['holds'] else 'does not hold'}"
    f"{'' if m['decided'] else ', premise stage unfinished'}: {m['held']} of "
    f"{len(m['per_warm_start'])} premise warm starts, {p['need']} needed)\n",
    "| warm start | GRPO seeds | trap accuracy (start -> final) | drop (>= "
    f"{p['trap_accuracy_drop']:g}) | trap gap (start -> final) | rise (>= "
    f"{p['trap_gap_rise']:g}) | holds |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in m["per_warm_start"]:
    if not r["seeds"]:
      out.append(f"| ws{r['warm_start']} | 0 | - | - | - | - | no |")
      continue
    a, g = r["trap_accuracy"], r["trap_gap"]
    out.append(
      f"| ws{r['warm_start']} | {r['seeds']} | {fmt(a[0])} -> {fmt(a[1])} | "
      f"{fmt(r['trap_accuracy_drop'], True)} | {fmt(g[0], True)} -> {fmt(g[1], True)} | "
      f"{fmt(r['trap_gap_rise'], True)} | {'yes' if r['holds'] else 'no'} |"
    )
  primary = res["compare"].get(design["primary"])
  if primary:
    out += [
      f"\n## P1 and P2: {design['primary']} - {design['reference']} at matched accuracy\n",
      f"- P1, AUC-mean: {interval_text(primary['p1'])}; {verdict(primary['p1'])}",
      f"- P2, pooled trap AUC: {interval_text(primary['p2'])}; {verdict(primary['p2'])}",
    ]
    out += [
      f"- {k} (secondary; lower is better): {interval_text(c)}; {verdict(c, -1)}"
      for k, c in primary.items()
      if k not in ("p1", "p2")
    ]
    if not m["holds"]:
      out.append("\nM does not hold: P1 and P2 are not read (the pre-registered rule).")
  fam = res.get("family", {})
  if fam:
    held = [n for n, f in fam.items() if f["holds"]]
    out += [
      f"\n## The other arms' {len(fam)} gaps as one family (Holm, 5% family-wise)\n",
      "Each gap's 95% interval below is a test of its own; read together, about one in "
      "20 would exclude 0 by chance. Those that hold under Holm's step-down: "
      + (
        ", ".join(f"{n} (p {fam[n]['p']:.4f})" for n in sorted(held, key=lambda n: fam[n]["p"]))
        if held
        else "none"
      )
      + ".",
    ]
  out += [
    "\n## Every arm: the final step (mean ± sd over runs) and the gaps to GRPO at matched "
    "accuracy (t over warm starts)\n",
    "| arm | runs | " + " | ".join(TABLE_KEYS) + " | Δ AUC-mean | Δ trap AUC |",
    "|---|---|" + "---|" * (len(TABLE_KEYS) + 2),
  ]
  for a, vals in res["final"].items():
    c = res["compare"].get(a)
    deltas = (
      [
        f"{fmt(c[k]['t_mean'], True)} [{fmt(c[k]['t_lo'], True)}, {fmt(c[k]['t_hi'], True)}]"
        for k in ("p1", "p2")
      ]
      if c
      else ["-", "-"]
    )
    n = len(vals[TABLE_KEYS[0]])
    out.append(
      f"| {a} | {n} | "
      + " | ".join(mean_sd(vals[k]) for k in TABLE_KEYS)
      + " | "
      + " | ".join(deltas)
      + " |"
    )
  for w, v in sorted(res["warm_start"].items()):
    out.append(
      f"| warm start ws{w} | - | " + " | ".join(fmt(v[k]) for k in TABLE_KEYS) + " | - | - |"
    )
  out.append(
    "\nmixed: the questions AUC-mean averages over (some samples right, some wrong); "
    "confidently_wrong: the share of questions all wrong with mean exp(s) >= 1/2."
  )
  return "\n".join(out) + "\n"


def report(root: str, out: str) -> str:
  root_p = pathlib.Path(root)
  # The design the runs were made with (run_all writes it), not this file's.
  design = json.loads((root_p / "design.json").read_text(encoding="utf-8"))
  res = analyse(root_p, design)
  res["family"] = family(res, design)
  dirs = sorted(p.parent for p in root_p.glob("ws*/*_seed*/evals.json"))
  text = header("Cued study", dirs) + "\n\n" + tables(res, design)
  write_report(out, "cued_study", text, {"design": design, **res})
  return text


def recorded_summary(entry: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
  """What the demo prints of one cued entry of the studies' index (``entry``) and its
  report's ``cued_study.json`` (``result``): the entry's run, date and notes, the
  report's machine and commit, the design it ran, M, and the primary arm's comparisons."""
  design = result["design"]
  return {
    "report": entry["report"],
    "run": entry["run"],
    "date": entry["date"],
    "notes": entry["notes"],
    "machine": result["machine"],
    "commit": result["commit"],
    "runs": result["runs"],
    "design": {k: design[k] for k in DESIGN_KEYS},
    "premise": result["premise"],
    "compare": result["compare"][design["primary"]],
  }


def record(index: pathlib.Path = STUDIES_INDEX, path: pathlib.Path = RECORDED) -> pathlib.Path:
  """Writes ``path`` from the last entry of ``index`` whose study is "cued"."""
  entries = [e for e in json.loads(index.read_text(encoding="utf-8")) if e["study"] == "cued"]
  if not entries:
    raise ValueError(f"{index}: no entry with study 'cued'")
  entry = entries[-1]
  result = json.loads((REPO / entry["report"]).read_text(encoding="utf-8"))
  path.write_text(json.dumps(recorded_summary(entry, result), indent=1) + "\n", encoding="utf-8")
  return path


if __name__ == "__main__":
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--record", action="store_true", help=f"write {RECORDED.relative_to(REPO)}")
  if p.parse_args().record:
    print(f"wrote {record()}")
