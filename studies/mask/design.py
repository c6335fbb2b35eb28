"""The mask study's design (docs/studies/mask/README.md): variants, noises, seeds, runs.

From warm start 0 of the demo study v3: GRPO, CAPO with the mask at the paper's
thresholds, at the reference's perplexity quantiles and without it, each under
10% random reward flips and under structured false negatives. ``make_design`` is
what the runs record in ``<root>/mask_design.json`` (``studies/mask/run.py``).
"""

from __future__ import annotations

from typing import Any

from studies.demo_v3 import design as v3

# The variants (capo_jax/demo/compare.py VARIANTS: "<method>_<noise>"), the primary pair
# first: CAPO with the mask at the paper's thresholds against CAPO without it.
METHODS = ("capo", "capo_nomask", "grpo", "capo_qmask")
NOISES = ("noise", "fneg")  # 10% random flips; structured false negatives
PRIMARY = ("capo", "capo_nomask")
SECONDARY = ("capo_qmask", "capo_nomask")
SEEDS = (0, 1, 2)
_SETTINGS: dict[str, Any] = {"seeds": SEEDS, "mask_questions": 512, "mask_seed": 99, "n_boot": 2000}
SHRINK_SETTINGS: dict[str, Any] = {"seeds": (0,), "mask_questions": 16, "n_boot": 200}


def make_design() -> dict[str, Any]:
  """The pre-registered design (docs/studies/mask/README.md); reads v3's DESIGN, so
  after ``--shrink`` it is the shrunk one."""
  from capo_jax.demo import compare  # pylint: disable=import-outside-toplevel

  return {
    "warm_start": 0,
    "v3": v3.warm_start_design(),
    **_SETTINGS,
    "variants": {v: compare.VARIANTS[v] for v in variant_names()},
    "primary": PRIMARY,
    "secondary": SECONDARY,
    "mask_quantiles": compare.QMASK["demo.mask_quantiles"],
  }


def variant_names() -> list[str]:
  return [f"{m}_{n}" for n in NOISES for m in METHODS]


def run_names() -> list[str]:
  """Every run, most important first: the primary pair under both noises, seed by seed,
  then GRPO and the quantile-threshold mask."""
  names = []
  for group in (PRIMARY, ("grpo", "capo_qmask")):
    names += [
      f"ws0/mask/{m}_{n}_seed{k}" for k in _SETTINGS["seeds"] for n in NOISES for m in group
    ]
  return names


def spec_for(variant: str, seed: int):
  """v3's configuration of warm start 0 with the variant's overrides and the study's
  threshold-calibration sample."""
  return v3.spec_for(0, variant, "", seed).with_overrides(
    {"demo.mask_questions": _SETTINGS["mask_questions"], "demo.mask_seed": _SETTINGS["mask_seed"]},
    policy_given=True,
  )


def shrink() -> None:
  v3.shrink()
  _SETTINGS.update(SHRINK_SETTINGS)
