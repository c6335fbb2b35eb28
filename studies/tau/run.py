r"""The tau study (docs/studies/tau/README.md): the paper's tau grid, relative to the score spread.

  python -m studies.tau.run --root=/tmp/capo_v3        # every run, then report
  python -m studies.tau.run --root=/tmp/capo_v3 --runs=ws0/tau/capo_rtau0.4_seed1
  python -m studies.tau.run --root=/tmp/capo_v3 --report_only

The paper's grid is tau in {0.4, 0.6, 1.0} around its default 0.6 on its own
score scale. Here the within-group spread of s (``s_spread``, the batch's mean
within-group std of the mean token log-prob) is ~0.1 at the v3 warm starts, and
the demo's tau 0.1 is the paper's 0.6 on this scale. So the grid is taken
relative to the measured spread: ``algo.adaptive_tau = t / 0.6``, i.e.
tau = (t / 0.6) x s_spread at every step, for t in {0.4, 0.6, 1.0}. Each from
warm start 0 of the v3 study, 2 RL seeds, beside GRPO on the same seeds; the
design is ``studies/tau/design.py`` (``<root>/tau_design.json``; v3's in
``<root>/design.json``). Runs are ordinary RL workdirs under ``<root>/ws0/tau/``
and resume where they stopped (``studies/ws0.py``). The report, with the
pre-registered reading (``verdict``), is ``studies/tau/report.py``.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX is imported (capo_jax/hugepages.py), as the launcher
  from capo_jax import hugepages

  hugepages.reexec_with_hugepages()

# pylint: disable=g-import-not-at-top,wrong-import-position
from studies import ws0
from studies.tau import design, report

STUDY = ws0.Ws0Study.of("tau", design, report)

if __name__ == "__main__":
  STUDY.main(__doc__.split("\n")[0])
