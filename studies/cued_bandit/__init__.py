"""The cued contextual bandit: CAPO's and GRPO's mechanism on a shortcut task, in seconds.

``bandit``: the task, the policy and one policy-gradient step; ``run``: the study,
measured on held-out questions with ``capo_jax.eval.traps`` (``python -m studies.cued_bandit.run
--out DIR``). docs/studies/cued_bandit/README.md.
"""
