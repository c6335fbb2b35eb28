"""The cued contextual bandit: CAPO's and GRPO's mechanism on a shortcut task, in seconds.

``bandit``: the task, the policy and one policy-gradient step; ``run``: the study
(``python -m studies.cued_bandit.run --out DIR``), scored with ``capo_jax.eval.traps``.
docs/studies/cued_bandit/README.md.
"""
