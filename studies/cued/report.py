"""The cued study's report (docs/studies/cued/README.md): the premise check M, P1 and P2
with a t-interval across warm starts and each warm start's estimate, and a table over
every arm.

Reads the ``evals.json`` of every finished run under ``<root>/ws<w>/<arm>_seed<k>/`` (step
0 is the warm start's evaluation, shared by its runs) and the design the runs recorded
(``<root>/design.json``); writes ``<out>/cued_study.md`` and ``cued_study.json``.

- **M** (``premise``): per premise warm start, the mean over its GRPO seeds at the final
  step against the warm start; trap accuracy falls by at least ``trap_accuracy_drop``
  and the trap gap rises by at least ``trap_gap_rise``; M holds when both do on at
  least ``need`` of the premise warm starts.
- **Matched accuracy** (``matched_gap``): one arm's run against GRPO's run of the same
  warm start and seed. GRPO's evaluated checkpoints, the warm start (step 0)
  included, joined in order of accuracy, form its frontier; each of the arm's
  checkpoints after step 0 whose accuracy lies within the frontier's range gives the
  arm's metric minus GRPO's interpolated at that accuracy
  (``capo_jax.demo.study.frontier_gaps``); the run pair's estimate is their mean.
- **P1 / P2** (``compare``): per warm start, the mean of its seeds' estimates; the mean
  over warm starts with a Student-t interval, df = W - 1 (``capo_jax.eval.paired``).
  P1 reads AUC-mean, P2 the pooled trap AUC (it keeps all-wrong traps), the trap gap
  beside them.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np

from capo_jax.demo.study import frontier_gaps
from capo_jax.eval import paired, traps
from studies.records import fmt, header, mean_sd, write_report

Runs = dict[tuple[int, str, int], list[dict[str, Any]]]
TABLE_KEYS = (*traps.SUMMARY_KEYS, *traps.TRAP_KEYS)


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


def _value(e: dict[str, Any], key: str) -> float:
  v = e.get(key)
  return float("nan") if v is None else float(v)


def premise(runs: Runs, design: dict[str, Any]) -> dict[str, Any]:
  """M per premise warm start and overall (the module docstring). ``decided``: every
  premise run has finished."""
  p, ref = design["premise"], design["reference"]
  rows, finished = [], True
  for w in design["premise_warm_starts"]:
    finals = [runs[(w, ref, k)] for k in design["seeds"] if (w, ref, k) in runs]
    finished &= len(finals) == len(design["seeds"])
    if not finals:
      rows.append({"warm_start": w, "seeds": 0, "holds": False})
      continue
    start = finals[0][0]
    acc = float(np.mean([_value(ev[-1], "trap_accuracy") for ev in finals]))
    gap = float(np.mean([_value(ev[-1], "trap_gap") for ev in finals]))
    drop = _value(start, "trap_accuracy") - acc
    rise = gap - _value(start, "trap_gap")
    rows.append(
      {
        "warm_start": w,
        "seeds": len(finals),
        "trap_accuracy": [_value(start, "trap_accuracy"), acc],
        "trap_gap": [_value(start, "trap_gap"), gap],
        "trap_accuracy_drop": drop,
        "trap_gap_rise": rise,
        # NaN (no decoy copy or no correct trap answer) fails the criterion
        "holds": bool(drop >= p["trap_accuracy_drop"] and rise >= p["trap_gap_rise"]),
      }
    )
  held = sum(r["holds"] for r in rows)
  return {"per_warm_start": rows, "held": held, "holds": held >= p["need"], "decided": finished}


def matched_gap(
  evals_arm: list[dict[str, Any]], evals_ref: list[dict[str, Any]], key: str
) -> float:
  """The arm's ``key`` minus the reference's at matched accuracy (module docstring); NaN
  when no checkpoint of the arm lies within the reference's accuracy range."""
  ref = [(e["accuracy"], _value(e, key)) for e in evals_ref]
  arm = [(e["accuracy"], _value(e, key)) for e in evals_arm if e["step"] > 0]
  gaps = frontier_gaps([p for p in arm if np.isfinite(p[1])], [p for p in ref if np.isfinite(p[1])])
  return float(np.mean(gaps)) if gaps else float("nan")


def compare(runs: Runs, design: dict[str, Any], arm: str, key: str) -> dict[str, Any]:
  """``arm`` minus the reference on ``key`` at matched accuracy: each warm start's
  estimate (the mean over its seeds) and the t-interval over warm starts."""
  ref, per = design["reference"], []
  for w in design["warm_starts"]:
    seeds = {
      k: matched_gap(runs[(w, arm, k)], runs[(w, ref, k)], key)
      for k in design["seeds"]
      if (w, arm, k) in runs and (w, ref, k) in runs
    }
    finite = [v for v in seeds.values() if np.isfinite(v)]
    if seeds:
      est = float(np.mean(finite)) if finite else float("nan")
      per.append({"warm_start": w, "estimate": est, "seeds": seeds})
  t = paired.t_interval([p["estimate"] for p in per], design["compare"]["level"])
  return {"arm": arm, "key": key, "per_warm_start": per, **t}


def verdict(c: dict[str, Any], better: int = 1) -> str:
  """The paper's way (CAPO better: the interval wholly above 0 for ``better`` = 1, wholly
  below for -1), against it (wholly on the other side), or not shown."""
  if not np.isfinite(c["t_lo"]):
    return "not measured (fewer than 2 warm starts)"
  lo, hi = sorted((better * c["t_lo"], better * c["t_hi"]))
  if lo > 0:
    return "the paper's way"
  return "against the paper" if hi < 0 else "not shown (the interval holds 0)"


def _interval(c: dict[str, Any]) -> str:
  per = ", ".join(f"ws{p['warm_start']} {fmt(p['estimate'], True)}" for p in c["per_warm_start"])
  return (
    f"{fmt(c['t_mean'], True)} [{fmt(c['t_lo'], True)}, {fmt(c['t_hi'], True)}] "
    f"over {c['clusters']} warm starts ({per or 'none'})"
  )


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
      f"- P1, AUC-mean: {_interval(primary['p1'])}; {verdict(primary['p1'])}",
      f"- P2, pooled trap AUC: {_interval(primary['p2'])}; {verdict(primary['p2'])}",
    ]
    out += [
      f"- {k} (secondary; lower is better): {_interval(c)}; {verdict(c, -1)}"
      for k, c in primary.items()
      if k not in ("p1", "p2")
    ]
    if not m["holds"]:
      out.append("\nM does not hold: P1 and P2 are not read (the pre-registered rule).")
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
  dirs = sorted(p.parent for p in root_p.glob("ws*/*_seed*/evals.json"))
  text = header("Cued study", dirs) + "\n\n" + tables(res, design)
  write_report(out, "cued_study", text, {"design": design, **res})
  return text
