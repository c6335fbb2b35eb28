"""The cued study: GRPO and CAPO on a testbed where RL is rewarded for trusting a cue.

``design``: the pre-registered design; ``run``: the runner (``python -m studies.cued.run
--root DIR``); ``report``: M, P1, P2 and the table over every arm.
docs/studies/cued/README.md.
"""
