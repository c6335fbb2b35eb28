"""The cued study's pre-registered design (docs/studies/cued/README.md): the testbed, the
arms, the warm starts and seeds, the premise check M and the comparisons P1 and P2.

``DESIGN`` is fixed before any run; the runs record it in ``<root>/design.json`` and refuse
another (``studies.records.check_design``). Changing it is a new study.
"""

from __future__ import annotations

from typing import Any

_CAPO = {"algo.name": "capo", "algo.mask": "on", "algo.tau": 0.6}
# Every arm: config overrides of configs/cued.py, at the same budget (steps, prompts,
# samples, learning rate). Report order.
ARMS: dict[str, dict[str, Any]] = {
  "grpo": {"algo.name": "grpo", "algo.mask": "off"},
  "capo_tau0.6": _CAPO,  # the paper's CAPO: tau 0.6, the noise mask in partner mode
  "capo_tau1": {**_CAPO, "algo.tau": 1.0},
  # tau = the batch's within-group spread of s at every step (the paper's 0.6 on its scale)
  "capo_rtau": {**_CAPO, "algo.adaptive_tau": 1.0},
  "capo_nomask": {**_CAPO, "algo.mask": "off"},
  "capo_drop": {**_CAPO, "algo.mask_mode": "drop"},  # the mask's partner vs drop mode
  "dr_grpo": {"algo.name": "dr_grpo", "algo.mask": "off"},  # the large-tau control
  "gspo": {"algo.name": "gspo", "algo.mask": "off"},
  "codapo": {"algo.name": "codapo", "algo.mask": "off"},
  "cde": {"algo.name": "cde", "algo.mask": "off"},
  "simko": {"algo.name": "simko", "algo.mask": "off"},
}
REFERENCE = "grpo"
PRIMARY = "capo_tau0.6"

DESIGN: dict[str, Any] = dict(
  warm_starts=(0, 1, 2, 3, 4),  # SFT seeds
  premise_warm_starts=(0, 1, 2),  # the premise stage: GRPO from these first
  seeds=(0, 1),  # RL seeds per (warm start, arm)
  arms=ARMS,
  reference=REFERENCE,
  primary=PRIMARY,
  lr=5e-4,
  steps=150,
  eval_every=25,
  # configs/cued.py's task, SFT target and held-out evaluation, written out so that a
  # later edit of the run file cannot change the study.
  task=dict(
    kind="cued",
    min_operands=2,
    max_operands=3,
    max_operand=9,
    operators="+-*",
    num_sft=4000,
    sft_cues=5,
    sft_cue_right=0.25,
    sft_val=128,
    num_rl=4000,
    rl_traps=0.2,
    num_heldout=256,
    heldout_traps=0.5,
    seed=0,
  ),
  sft=dict(
    max_steps=3000,
    batch_size=64,
    lr=2e-3,
    eval_every=50,
    eval_questions=128,
    eval_samples=8,
    early_stop=True,
    target_low=0.30,
    target_high=0.40,
  ),
  eval=dict(questions=256, samples=32, seed=1234),
  # M: per premise warm start, the mean over its GRPO seeds at the final step against
  # the warm start: trap accuracy falls by >= 0.05 and the trap gap rises by >= 0.03
  # nats; M holds when both do on >= 2 of the 3 premise warm starts. Without M the
  # study stops after the premise stage: a testbed where GRPO does not fail cannot
  # show CAPO preventing the failure.
  premise=dict(trap_accuracy_drop=0.05, trap_gap_rise=0.03, need=2),
  # P1 (AUC-mean), P2 (pooled trap AUC), and the trap gap as a secondary, each arm
  # minus GRPO at matched accuracy (studies/cued/report.py, ``matched_gap``).
  compare=dict(p1="auc_mean", p2="trap_auc", secondary=("trap_gap",), level=0.95),
)
# --shrink: the same code at a seconds-long size (the smoke test; no result).
SHRINK_DESIGN: dict[str, Any] = dict(
  warm_starts=(0, 1),
  premise_warm_starts=(0, 1),
  seeds=(0,),
  arms={k: ARMS[k] for k in (REFERENCE, PRIMARY)},
  steps=2,
  eval_every=1,
  task=dict(DESIGN["task"], num_sft=200, sft_val=16, num_rl=200, num_heldout=16),
  sft=dict(
    max_steps=20, eval_every=10, eval_questions=16, eval_samples=2, early_stop=False, batch_size=16
  ),
  eval=dict(questions=16, samples=4, seed=1234),
  premise=dict(DESIGN["premise"], need=0),  # the smoke test runs past the premise stage
)
_SHRINK = [False]


def shrink() -> None:
  """Switches this module to the smoke-run size (``--shrink``)."""
  _SHRINK[0] = True
  DESIGN.update(SHRINK_DESIGN)


def premise_runs() -> list[str]:
  """The premise stage: GRPO from the first warm starts, every seed."""
  return [
    f"ws{w}/{REFERENCE}_seed{k}" for w in DESIGN["premise_warm_starts"] for k in DESIGN["seeds"]
  ]


def run_names() -> list[str]:
  """Every run, the premise stage first; then GRPO from the other warm starts, then each
  arm in report order (the primary first) over every warm start and seed."""
  names = premise_runs()
  arms = [REFERENCE, PRIMARY] + [a for a in DESIGN["arms"] if a not in (REFERENCE, PRIMARY)]
  for arm in arms:
    names += [
      n
      for w in DESIGN["warm_starts"]
      for k in DESIGN["seeds"]
      if (n := f"ws{w}/{arm}_seed{k}") not in names
    ]
  return names


def parse_name(name: str) -> tuple[int, str, int]:
  """``ws1/capo_tau0.6_seed0`` -> (1, "capo_tau0.6", 0)."""
  ws, _, rest = name.partition("/")
  arm, _, seed = rest.rpartition("_seed")
  if not (ws.startswith("ws") and ws[2:].isdigit() and arm in DESIGN["arms"] and seed.isdigit()):
    raise SystemExit(
      f"--runs: {name!r} is not ws<k>/<arm>_seed<k> with arm in {list(DESIGN['arms'])}"
    )
  return int(ws[2:]), arm, int(seed)


def base_config(warm_start: int):
  """configs/cued.py with the study's task, SFT target, evaluation and budget."""
  from configs import cued  # pylint: disable=import-outside-toplevel

  c = cued.get_config("shrink" if _SHRINK[0] else None)
  c.demo.task.update(DESIGN["task"])
  c.demo.sft.update({**DESIGN["sft"], "seed": warm_start})
  c.demo.eval_questions = DESIGN["eval"]["questions"]
  c.demo.eval_samples = DESIGN["eval"]["samples"]
  c.demo.eval_seed = DESIGN["eval"]["seed"]
  c.train.num_steps = DESIGN["steps"]
  c.eval.every_steps = DESIGN["eval_every"]
  c.optim.lr = DESIGN["lr"]
  return c


def spec_for(warm_start: int, arm: str = REFERENCE, seed: int = 0):
  """The RunSpec of one run: the base config, the arm's overrides, the RL seed."""
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel

  c = base_config(warm_start)
  c.seed = seed
  for key, value in DESIGN["arms"][arm].items():
    section, leaf = key.split(".")
    c[section][leaf] = value
  return demo_run.spec_of(c)
