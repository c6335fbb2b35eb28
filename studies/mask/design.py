r"""The mask study (docs/demo_v3.md, "Mask study"): CAPO with and without the noise mask.

  python -m benchmarks.demo_mask_study --root=/tmp/capo_v3        # every run, then report
  python -m benchmarks.demo_mask_study --root=/tmp/capo_v3 --runs=ws0/mask/capo_fneg_seed0
  python -m benchmarks.demo_mask_study --root=/tmp/capo_v3 --report_only
  python -m benchmarks.demo_mask_study --root=/tmp/mask_smoke --out=/tmp/mask_smoke/report \
      --shrink                                                    # seconds-long smoke run

From warm start 0 of the demo study v3 (its task, SFT recipe and question
selection: ``benchmarks/demo_study_v3.py``; give ``--root`` the v3 study's root
and its cached warm start, held-out evaluation and selection are reused), GRPO,
CAPO with the mask at the paper's thresholds, CAPO with the mask at the
reference's perplexity quantiles, and CAPO without the mask, each under (i) a
verifier that flips 10% of the training rewards and (ii) one that rejects half
the correct negative answers (structured false negatives), 3 RL seeds each. The
design is ``make_design()``; runs record it in ``<root>/mask_design.json`` (and
v3's in ``<root>/design.json``: the warm start is v3's) and refuse another.

Runs are ordinary RL workdirs under ``<root>/ws0/mask/`` and resume where they
stopped; ``--runs`` splits them over processes (``benchmarks/demo_ws0_study.py``). The report
(``benchmarks/demo_mask_study_report.py``) goes to ``<out>/mask_study.md``,
``mask_study.json`` and ``mask_study_curves.png``.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX is imported (capo_jax/hugepages.py), as the launcher
  from capo_jax import hugepages
  hugepages.reexec_with_hugepages()

# pylint: disable=g-import-not-at-top,wrong-import-position
from typing import Any

from benchmarks import demo_study_v3 as v3
from benchmarks import demo_ws0_study

# The variants (capo_jax/demo/compare.py VARIANTS: "<method>_<noise>"), the primary pair
# first: CAPO with the mask at the paper's thresholds against CAPO without it.
METHODS = ("capo", "capo_nomask", "grpo", "capo_qmask")
NOISES = ("noise", "fneg")  # 10% random flips; structured false negatives
PRIMARY = ("capo", "capo_nomask")
SECONDARY = ("capo_qmask", "capo_nomask")
SEEDS = (0, 1, 2)
# The parts of v3's design the warm start, its evaluation and the selection depend on.
V3_KEYS = ("task", "sft", "steps", "eval_every", "band", "selection_seed", "selection_samples")
_SETTINGS: dict[str, Any] = {"seeds": SEEDS, "mask_questions": 512, "mask_seed": 99,
                             "n_boot": 2000}
SHRINK_SETTINGS: dict[str, Any] = {"seeds": (0,), "mask_questions": 16, "n_boot": 200}


def make_design() -> dict[str, Any]:
  """The pre-registered design (docs/demo_v3.md, "Mask study"); reads v3's DESIGN, so
  after ``--shrink`` it is the shrunk one."""
  from capo_jax.demo import compare  # pylint: disable=import-outside-toplevel
  return {"warm_start": 0, "v3": {k: v3.DESIGN[k] for k in V3_KEYS}, **_SETTINGS,
          "variants": {v: compare.VARIANTS[v] for v in variant_names()},
          "primary": PRIMARY, "secondary": SECONDARY,
          "mask_quantiles": compare.QMASK["demo.mask_quantiles"]}


def variant_names() -> list[str]:
  return [f"{m}_{n}" for n in NOISES for m in METHODS]


def run_names() -> list[str]:
  """Every run, most important first: the primary pair under both noises, seed by seed,
  then GRPO and the quantile-threshold mask."""
  names = []
  for group in (PRIMARY, ("grpo", "capo_qmask")):
    names += [f"ws0/mask/{m}_{n}_seed{k}" for k in _SETTINGS["seeds"] for n in NOISES
              for m in group]
  return names


def spec_for(variant: str, seed: int):
  """v3's configuration of warm start 0 with the variant's overrides and the study's
  threshold-calibration sample."""
  return v3.spec_for(0, variant, "", seed).with_overrides(
      {"demo.mask_questions": _SETTINGS["mask_questions"],
       "demo.mask_seed": _SETTINGS["mask_seed"]}, policy_given=True)


def shrink() -> None:
  v3.shrink()
  _SETTINGS.update(SHRINK_SETTINGS)


def _report(root: str, out: str) -> str:
  from benchmarks import demo_mask_study_report  # pylint: disable=import-outside-toplevel
  return demo_mask_study_report.report(root, out)


STUDY = demo_ws0_study.Ws0Study(name="mask", variants=variant_names, make_design=make_design,
                                spec_for=spec_for, run_names=run_names, report=_report,
                                shrink=shrink)

if __name__ == "__main__":
  STUDY.main(__doc__.split("\n")[0])
