"""The demo study v3's statistics: warm starts as a factor, matched checkpoints.

The pre-registered design and primary metric are written in ``docs/studies/demo_v3/README.md``
("Pre-registered design"); ``studies/demo_v3/run.py`` runs it. What lives here is the
part with maths in it, tested against brute-force references:

- ``select_questions``: the held-out questions of a warm start whose accuracy
  lies in (lo, hi], measured on samples drawn with a *selection* seed that the
  reported evaluation does not use (selecting and scoring on the same samples
  would regress every method toward the mean by the same amount and hide it).
- ``matched_checkpoints``: the two evaluated checkpoints, one per run, whose
  held-out accuracies are within ``tol`` of each other, the most accurate such
  pair; so AUC is compared at equal accuracy, not at equal step.
- ``frontier_gaps``: how far each checkpoint of one run lies above (or below)
  the other run's accuracy-AUC frontier, linearly interpolated at its accuracy;
  the descriptive reading of the frontiers over learning rates.
- ``hierarchical_delta``: the pair-weighted mean paired per-question ΔAUC over
  warm starts, their seeds and their questions, with a bootstrap interval that
  resamples warm starts, then seeds within each, then questions within each
  (shared by that warm start's seeds, which see the same questions); a warm
  start drawn twice gets two independent inner draws. Beside it, with fewer
  than 10 warm starts, a t-interval over the warm starts' deltas.
- ``tau_verdict`` / ``null_false_alarm``: whether a result is robust to tau, by
  the tau study's pre-registered rule or by a stricter one, and how often each
  rule says "robust" when there is no effect (a simulation of the study's design).

Letters: W warm starts, I seeds of one warm start, Q questions, G samples, O
bootstrap replicates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from capo_jax.eval import paired


def select_questions(correct_QG: Any, lo: float = 0.0, hi: float = 0.6) -> np.ndarray:
  """Questions whose accuracy (mean over G) lies in (lo, hi]; a bool mask [Q]."""
  acc_Q = np.asarray(correct_QG, bool).mean(axis=1)
  return (acc_Q > lo) & (acc_Q <= hi)


def matched_checkpoints(
  evals_a: Sequence[Mapping[str, float]],
  evals_b: Sequence[Mapping[str, float]],
  tol: float = 0.005,
  key: str = "accuracy",
) -> dict[str, Any] | None:
  """The evaluated steps (one of each run, step 0 excluded) whose ``key`` differ by at
  most ``tol``, the pair with the highest mean ``key`` (ties: the earlier steps).

  Returns ``{"step_a", "step_b", "acc_a", "acc_b", "gap"}`` or None when no pair of
  checkpoints is that close (the report counts such run pairs as unmatched).
  """
  best: tuple[float, float, float] | None = None
  for ea in evals_a:
    for eb in evals_b:
      if ea["step"] == 0 or eb["step"] == 0 or abs(ea[key] - eb[key]) > tol:
        continue
      cand = (-(ea[key] + eb[key]) / 2, ea["step"], eb["step"])
      if best is None or cand < best:
        best = cand
  if best is None:
    return None
  ea = next(e for e in evals_a if e["step"] == best[1])
  eb = next(e for e in evals_b if e["step"] == best[2])
  return {
    "step_a": best[1],
    "step_b": best[2],
    "acc_a": float(ea[key]),
    "acc_b": float(eb[key]),
    "gap": float(ea[key] - eb[key]),
  }


def frontier_gaps(
  points_a: Sequence[tuple[float, float]], points_b: Sequence[tuple[float, float]]
) -> list[float]:
  """For each (accuracy, AUC) checkpoint of run a whose accuracy lies within the range
  of run b's, its AUC minus b's AUC linearly interpolated at that accuracy.

  b's checkpoints are joined in order of accuracy (a run's accuracy need not grow with
  its step); a's checkpoints outside b's accuracy range are left out, since there b
  has no frontier to compare with. Positive: a is better calibrated at equal accuracy.
  Two of b's checkpoints at exactly the same accuracy leave the frontier ambiguous
  there; ``np.interp`` then takes one of them.
  """
  if not points_b:
    return []
  order = np.argsort([x for x, _ in points_b], kind="stable")
  xb = np.array([points_b[i][0] for i in order], float)
  yb = np.array([points_b[i][1] for i in order], float)
  return [float(y - np.interp(x, xb, yb)) for x, y in points_a if xb[0] <= x <= xb[-1]]


def _sums(
  d_IQ: np.ndarray, valid_IQ: np.ndarray, w_OI: np.ndarray, v_OQ: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """Per replicate: the weighted sum of differences and of valid cells."""
  return (
    np.einsum("oi,iq,oq->o", w_OI, d_IQ, v_OQ),
    np.einsum("oi,iq,oq->o", w_OI, valid_IQ.astype(np.float64), v_OQ),
  )


def _draw(n: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
  """How often each of n units is drawn in each of n_boot resamples: [O, n] floats."""
  return rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)


def cluster_sums(
  d_IQ: np.ndarray, valid_IQ: np.ndarray, times_O: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
  """The inner stage of the two-stage bootstrap for one warm start (cluster).

  Replicate o drew this cluster ``times_O[o]`` times; each time gets its own inner
  resample (seeds, then questions shared by them), so a cluster drawn twice adds
  two independent draws, not one draw counted twice. Returns per replicate the sums
  of the drawn differences and of the drawn valid cells.
  """
  n_i, n_q = d_IQ.shape
  num_O, den_O = np.zeros(times_O.shape), np.zeros(times_O.shape)
  for k in range(int(times_O.max(initial=0))):
    num, den = _sums(d_IQ, valid_IQ, _draw(n_i, times_O.size, rng), _draw(n_q, times_O.size, rng))
    num_O += np.where(times_O > k, num, 0.0)
    den_O += np.where(times_O > k, den, 0.0)
  return num_O, den_O


def hierarchical_delta(
  pairs: Sequence[tuple[Any, Any]], *, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> dict[str, Any]:
  """Mean paired ΔAUC (A - B) pooled over warm starts, with a hierarchical bootstrap.

  ``pairs``: one ``(auc_a_IQ, auc_b_IQ)`` per warm start: per-question AUCs (NaN
  where a question is all-right or all-wrong) of A's and B's runs, row i of both
  from the same RL seed; Q may differ between warm starts (each has its own
  selected questions). A cell counts where both are finite. The estimate is the
  mean over all counted cells. Each replicate draws W warm starts with
  replacement, and for every time a warm start is drawn, its I seeds and its Q
  questions with replacement (one question draw shared by its seeds;
  ``cluster_sums``); its estimate is the cell-weighted mean of the drawn cells.
  Returns ``delta``, ``lo``, ``hi``, ``pairs`` (counted cells), ``warm_starts``,
  ``per_warm_start`` (each one's delta and cells) and, with fewer than
  ``paired.T_BELOW`` warm starts, ``t_mean`` / ``t_lo`` / ``t_hi`` / ``clusters``:
  the t-interval over the warm starts' deltas (``paired.t_interval``, df = W - 1),
  since a bootstrap over 2-5 clusters has too few distinct draws to be trusted.
  """
  if not pairs:
    raise ValueError("hierarchical_delta: no warm starts")
  rng = np.random.default_rng(seed)
  n_w = len(pairs)
  u_OW = _draw(n_w, n_boot, rng)
  num_O, den_O, per = np.zeros(n_boot), np.zeros(n_boot), []
  total_d = total_n = 0.0
  for w, (a, b) in enumerate(pairs):
    a_IQ = np.atleast_2d(np.asarray(a, np.float64))
    b_IQ = np.atleast_2d(np.asarray(b, np.float64))
    if a_IQ.shape != b_IQ.shape:
      raise ValueError(
        f"hierarchical_delta: warm start {w}: shapes differ, {a_IQ.shape} vs {b_IQ.shape}"
      )
    valid_IQ = np.isfinite(a_IQ) & np.isfinite(b_IQ)
    d_IQ = np.where(valid_IQ, a_IQ - b_IQ, 0.0)
    num, den = cluster_sums(d_IQ, valid_IQ, u_OW[:, w], rng)
    num_O, den_O = num_O + num, den_O + den
    n = float(valid_IQ.sum())
    per.append({"delta": float(d_IQ.sum() / n) if n else float("nan"), "pairs": int(n)})
    total_d, total_n = total_d + float(d_IQ.sum()), total_n + n
  est_O = num_O[den_O > 0] / den_O[den_O > 0]
  alpha = (1.0 - level) / 2
  if total_n == 0 or est_O.size == 0:
    lo = hi = delta = float("nan")
  else:
    lo, hi = (float(x) for x in np.quantile(est_O, [alpha, 1.0 - alpha]))
    delta = total_d / total_n
  return {
    "delta": delta,
    "lo": lo,
    "hi": hi,
    "pairs": int(total_n),
    "warm_starts": n_w,
    "per_warm_start": per,
    **paired.beside_bootstrap([p["delta"] for p in per], level),
  }


def _reading(d: Mapping[str, Any] | None) -> str:
  """ "held (above 0)" / "held (below 0)" / "did not hold" for one pooled interval."""
  if not d or not np.isfinite(d["lo"]):
    return "not measured"
  if d["lo"] > 0 or d["hi"] < 0:
    return f"held ({'above' if d['lo'] > 0 else 'below'} 0)"
  return "did not hold (the interval contains 0)"


def held_across_warm_starts(result: Mapping[str, Any], reference: str = "grpo") -> str:
  """What the recorded v3 study says held across warm starts, every comparison listed.

  ``result``: ``study_v3.json`` (``studies/demo_v3/report.py``). For each
  method paired against ``reference``: the primary, paired ΔAUC at matched accuracy,
  and the final step's, each pooled over warm starts with its hierarchical interval and
  the per-warm-start signs. A comparison *held* when its interval excludes 0; nothing
  else is called a result. Every compared method is printed, whatever it shows.
  """
  sg = lambda v: f"{v:+.3f}"  # noqa: E731
  lines = [
    f"Across warm starts (the demo study v3, {result.get('date', '?')}, "
    f"{result.get('machine', '?')}; docs/studies/demo_v3/README.md):\npaired per-question ΔAUC "
    f"against {reference} on the questions each warm start gets right in (0, 60%],\n"
    "95% hierarchical bootstrap over warm starts and questions."
  ]
  held = []
  controls = {"dr_grpo": "dr_grpo (large-tau control)"}  # not a paper baseline
  for method, p in sorted(result.get("paired", {}).items()):
    name = controls.get(method, method)
    for when, label in (("matched", "at matched accuracy"), ("final", "at the final step")):
      d = p.get(when)
      if not d:
        lines.append(
          f"  {name} - {reference} {label}: "
          + ("no matched checkpoints" if when == "matched" else "not measured")
        )
        continue
      signs = [np.sign(w["delta"]) for w in d["per_warm_start"] if np.isfinite(w["delta"])]
      same = max(signs.count(1.0), signs.count(-1.0)) if signs else 0
      reading = _reading(d)
      acc = ""
      if when == "final":
        fa, fb = result["final"].get(method, {}), result["final"].get(reference, {})
        both = [w for w in fa if w in fb]
        if both:
          acc = (
            f" (accuracy {np.mean([fa[w]['accuracy'] for w in both]):.3f} vs "
            f"{np.mean([fb[w]['accuracy'] for w in both]):.3f})"
          )
      lines.append(
        f"  {name} - {reference} {label}{acc}: {sg(d['delta'])} [{sg(d['lo'])}, "
        f"{sg(d['hi'])}]{paired.t_note(d, 'warm starts')}, {d['pairs']} question pairs "
        f"on {d['warm_starts']} warm starts, the same sign on {same}: {reading}"
      )
      if reading.startswith("held"):
        held.append(f"{name} - {reference} {label}")
  lines.append(
    "What held: "
    + ("; ".join(held) if held else "nothing; no comparison's interval excludes 0")
    + "."
  )
  return "\n".join(lines)


# --- Is a result robust to tau? Two rules, and how often each says so under a null. ---


def tau_verdict(deltas: Sequence[Mapping[str, float]], rule: str = "signs") -> str:
  """ "robust to tau" / "not robust" from one paired ΔAUC (delta, lo, hi) per tau.

  "signs" (the tau study's pre-registered rule, ``studies/tau/report.py``):
  robust when the point estimates share one sign and no interval lies wholly on the
  other side of 0. It needs no effect at all: under a null it says "robust" about
  half the time (``null_false_alarm``). "intervals": robust when every interval
  excludes 0 on the same side, i.e. the effect held at every tau. "-" when a delta is
  missing or not finite.
  """
  if rule not in ("signs", "intervals"):
    raise ValueError(f"tau_verdict: rule={rule!r} is not 'signs' or 'intervals'")
  if not deltas or not all(np.isfinite(d["delta"]) for d in deltas):
    return "-"
  if rule == "intervals":
    above, below = all(d["lo"] > 0 for d in deltas), all(d["hi"] < 0 for d in deltas)
    return "robust to tau" if above or below else "not robust"
  signs = {np.sign(d["delta"]) for d in deltas}
  if len(signs) != 1:
    return "not robust"
  s = signs.pop()
  against = any((d["hi"] < 0) if s > 0 else (d["lo"] > 0) for d in deltas)
  return "not robust" if against else "robust to tau"


def null_false_alarm(
  rule: str,
  *,
  taus: int = 3,
  seeds: int = 2,
  questions: int = 409,
  n_sim: int = 200,
  n_boot: int = 400,
  seed: int = 0,
) -> float:
  """Share of simulated tau studies with no effect at any tau that ``rule`` calls robust.

  The tau study's design: ``taus`` CAPO variants and one GRPO reference, each run on
  the same ``seeds``, paired per question against the shared GRPO runs
  (``paired.paired_delta_auc``). Null model, every run alike: per-question AUC
  = clip(m_q + e, 0, 1), m_q ~ U(0.5, 1) the question's own level, e ~ N(0, 0.2) per
  run and question, plus a run offset ~ N(0, 0.01); 30% of the cells not mixed (NaN).
  Because every variant is compared with the same GRPO runs, the three deltas are
  correlated (0.5): "signs" then fires with probability 1/2, not 1/4.
  """
  rng = np.random.default_rng(seed)
  hits = 0
  for _ in range(n_sim):
    m_Q = rng.uniform(0.5, 1.0, questions)
    runs_VIQ = np.clip(
      m_Q
      + rng.normal(0, 0.2, (taus + 1, seeds, questions))
      + rng.normal(0, 0.01, (taus + 1, seeds, 1)),
      0.0,
      1.0,
    )
    runs_VIQ[rng.random(runs_VIQ.shape) < 0.3] = np.nan
    deltas = [
      paired.paired_delta_auc(
        runs_VIQ[v], runs_VIQ[0], n_boot=n_boot, seed=int(rng.integers(1 << 30))
      )
      for v in range(1, taus + 1)
    ]
    hits += tau_verdict(deltas, rule) == "robust to tau"
  return hits / n_sim
