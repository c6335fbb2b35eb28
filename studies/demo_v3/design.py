"""The demo study v3's design: warm starts, methods, runs and their configuration.

Fixed in ``DESIGN`` and written, before any run, in docs/studies/demo_v3/README.md
("Pre-registered design"); the runs record it in ``<root>/design.json`` and refuse another
(``studies/demo_v3/run.py``). The mask and tau studies start from its warm start 0
and record the part of it that warm start depends on (``warm_start_design``).
"""

from __future__ import annotations

from typing import Any

# The pre-registered design (docs/studies/demo_v3/README.md). Changing it is a new study.
DESIGN: dict[str, Any] = dict(
  warm_starts=(0, 1, 2),  # SFT seeds
  task=dict(
    min_operands=3,
    max_operands=6,
    max_operand=9,
    operators="+-*",
    num_train=20000,
    num_heldout=1000,
    seed=0,
    wrong_rule="",
    wrong_fraction=0.0,
  ),
  sft=dict(max_steps=4000, eval_every=25, target_low=0.30, target_high=0.40),
  steps=150,
  eval_every=25,
  band=(0.0, 0.6),
  selection_seed=4321,
  selection_samples=16,
  match_tol=0.005,
  scaling_samples=64,
  scaling_seed=777,
  scaling_ks=(4, 8, 16),
  scaling_subsets=64,
  # learning rates of the accuracy-AUC frontier: the demo's and twice it
  lrs={"": 1e-4, "_lr2": 2e-4},
)
# --shrink: the same code at a seconds-long size (the smoke test; no result).
SHRINK_DESIGN: dict[str, Any] = dict(
  warm_starts=(0,),
  task=dict(DESIGN["task"], num_train=600, num_heldout=32),
  sft=dict(
    max_steps=20, eval_every=10, eval_questions=32, eval_samples=2, early_stop=False, batch_size=16
  ),
  steps=2,
  eval_every=1,
  band=(-1.0, 1.0),
  selection_samples=2,
  scaling_samples=4,
  scaling_ks=(2, 4),
  scaling_subsets=4,
)
_SHRINK = [False]
METHODS = ("grpo", "capo", "gspo", "codapo", "cde", "simko", "dr_grpo")
FRONTIER_METHODS = ("grpo", "capo")
PRIMARY = ("capo", "grpo")

# The parts of DESIGN the warm start, its evaluation and the question selection depend on.
WARM_START_KEYS = (
  "task",
  "sft",
  "steps",
  "eval_every",
  "band",
  "selection_seed",
  "selection_samples",
)


def shrink() -> None:
  """Switches this module to the smoke-run size (``--shrink``)."""
  _SHRINK[0] = True
  DESIGN.update(SHRINK_DESIGN)


def warm_start_design() -> dict[str, Any]:
  """What a study from these warm starts records of DESIGN (after ``shrink``, the shrunk one)."""
  return {k: DESIGN[k] for k in WARM_START_KEYS}


def base_config(warm_start: int):
  """configs/demo.py with the study's task, SFT target and evaluation cadence."""
  from configs import demo  # pylint: disable=import-outside-toplevel

  c = demo.get_config("shrink" if _SHRINK[0] else None)
  c.demo.task.update(DESIGN["task"])
  c.demo.sft.update({**DESIGN["sft"], "seed": warm_start})
  c.train.num_steps = DESIGN["steps"]
  c.eval.every_steps = DESIGN["eval_every"]
  return c


def run_names() -> list[str]:
  """Every run, most important first: the primary pair on each warm start, then the
  other methods, then the frontier's second learning rate."""
  ws = DESIGN["warm_starts"]
  names = [f"ws{w}/{m}_seed0" for w in ws for m in PRIMARY]  # a pair per warm start, early
  names += [f"ws{w}/{m}_seed0" for m in METHODS if m not in PRIMARY for w in ws]
  names += [
    f"ws{w}/{m}{lr}_seed0" for lr in DESIGN["lrs"] if lr for m in FRONTIER_METHODS for w in ws
  ]
  return names


def parse_name(name: str) -> tuple[int, str, str, int]:
  """``ws1/capo_lr2_seed0`` -> (1, "capo", "_lr2", 0)."""
  ws, rest = name.split("/", 1)
  variant, seed = rest.rsplit("_seed", 1)
  lr = next((s for s in DESIGN["lrs"] if s and variant.endswith(s)), "")
  method = variant[: len(variant) - len(lr)] if lr else variant
  if not ws.startswith("ws") or method not in METHODS:
    raise SystemExit(
      f"--runs: {name!r} is not ws<k>/<method>[_lr2]_seed<k> with method in {METHODS}"
    )
  return int(ws[2:]), method, lr, int(seed)


def spec_for(warm_start: int, method: str = "capo", lr: str = "", seed: int = 0):
  from capo_jax.demo import compare  # pylint: disable=import-outside-toplevel
  from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel

  c = base_config(warm_start)
  c.seed = seed
  for key, value in compare.VARIANTS[method].items():
    section, leaf = key.split(".")
    c[section][leaf] = value
  c.optim.lr = DESIGN["lrs"][lr]
  return demo_run.spec_of(c)
