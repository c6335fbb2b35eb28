"""The tau study's design (docs/studies/tau/README.md): the paper's tau grid, relative to
the score spread, beside GRPO on the same seeds.

``make_design`` is what the runs record in ``<root>/tau_design.json``
(``studies/tau/run.py``).
"""

from __future__ import annotations

from typing import Any

from studies.demo_v3 import design as v3

GRID = (0.4, 0.6, 1.0)  # the paper's tau grid, on its own scale
PAPER_TAU = 0.6  # the paper's default: the centre of the grid, c = 1 here
REFERENCE = "grpo"
SEEDS = (0, 1)
_SETTINGS: dict[str, Any] = {"seeds": SEEDS, "n_boot": 2000}


def variant_names() -> list[str]:
  return [REFERENCE] + [f"capo_rtau{t:g}" for t in GRID]


def make_design() -> dict[str, Any]:
  """The pre-registered design; reads v3's DESIGN, so after ``--shrink`` it is the shrunk one."""
  from capo_jax.demo import compare  # pylint: disable=import-outside-toplevel

  return {
    "warm_start": 0,
    "v3": v3.warm_start_design(),
    **_SETTINGS,
    "grid": GRID,
    "paper_tau": PAPER_TAU,
    "variants": {v: compare.VARIANTS[v] for v in variant_names()},
  }


def run_names() -> list[str]:
  """Seed 0 of every variant first, then seed 1."""
  return [f"ws0/tau/{v}_seed{k}" for k in _SETTINGS["seeds"] for v in variant_names()]


def spec_for(variant: str, seed: int):
  return v3.spec_for(0, variant, "", seed)


def shrink() -> None:
  v3.shrink()
  _SETTINGS.update({"seeds": (0,), "n_boot": 200})
