r"""The mask study (docs/studies/mask/README.md): CAPO with and without the noise mask.

  python -m studies.mask.run --root=/tmp/capo_v3        # every run, then report
  python -m studies.mask.run --root=/tmp/capo_v3 --runs=ws0/mask/capo_fneg_seed0
  python -m studies.mask.run --root=/tmp/capo_v3 --report_only
  python -m studies.mask.run --root=/tmp/mask_smoke --out=/tmp/mask_smoke/report \
      --shrink                                                    # seconds-long smoke run

From warm start 0 of the demo study v3 (its task, SFT recipe and question
selection: ``studies/demo_v3/``; give ``--root`` the v3 study's root
and its cached warm start, held-out evaluation and selection are reused), GRPO,
CAPO with the mask at the paper's thresholds, CAPO with the mask at the
reference's perplexity quantiles, and CAPO without the mask, each under (i) a
verifier that flips 10% of the training rewards and (ii) one that rejects half
the correct negative answers (structured false negatives), 3 RL seeds each. The
design is ``studies/mask/design.py``; runs record it in ``<root>/mask_design.json`` (and
v3's in ``<root>/design.json``: the warm start is v3's) and refuse another.

Runs are ordinary RL workdirs under ``<root>/ws0/mask/`` and resume where they
stopped; ``--runs`` splits them over processes (``studies/ws0.py``). The report
(``studies/mask/report.py``) goes to ``<out>/mask_study.md``,
``mask_study.json`` and ``mask_study_curves.png``.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX is imported (capo_jax/hugepages.py), as the launcher
  from capo_jax import hugepages

  hugepages.reexec_with_hugepages()

# pylint: disable=g-import-not-at-top,wrong-import-position
from studies import ws0
from studies.mask import design, report

STUDY = ws0.Ws0Study.of("mask", design, report)

if __name__ == "__main__":
  STUDY.main(__doc__.split("\n")[0])
