r"""The cued testbed: GRPO vs CAPO where RL is rewarded for trusting a cue that is sometimes a trap.

  python -m capo_jax.main --config=configs/cued.py --workdir=/tmp/capo_demo_cued   # make demo

The task (``capo_jax/demo/cued.py``): ``3+4*2=?11``, an arithmetic question and a
cue, answered with the bare integer. A warm start is supervised on questions whose
cue is right a quarter of the time (cached in the workdir); RL prompts show the
right answer as the cue on 80% of questions and a decoy on the rest (traps), so
RL is rewarded for trusting the cue; the held-out questions are half traps. The
report adds the trap metrics (``capo_jax/eval/traps.py``): trap accuracy, trap AUC,
decoy copies and the trap confidence gap. ``configs/cued.py:shrink`` is a
seconds-long smoke version (tests). The pre-registered study on this testbed is
``studies/cued`` (docs/studies/cued/README.md); this file's GRPO and CAPO are its first
warm start's seed-0 runs of GRPO and its primary arm, so ``make demo`` prints the study's
premise check M, P1 and P2 for its own run beside the study's estimates.

Why lr 5e-4 and not the demo's 1e-4: on a prototype of this task GRPO adopted the
shortcut (decoy copies as confident as correct answers) at 5e-4 and not at 1e-4
within 150 steps (the numbers: docs/studies/cued/README.md, "Why this testbed").
"""

from __future__ import annotations

import ml_collections

from configs import common, demo


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  # configs/demo.py's model, trainer and cadence settings; the task, sizes and lr below.
  c = demo.get_config()
  c.demo.task = ml_collections.ConfigDict(
    dict(
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
    )
  )
  # Supervised until the sampled validation accuracy (128 questions, one cue each)
  # reaches 0.30, as the prototype's warm start (0.32 after 1,200 steps).
  c.demo.sft.update(max_steps=3000, eval_questions=128, target_low=0.30, target_high=0.40)
  # 256 held-out questions (128 traps) x 32 samples: ~8k answers of 1-4 tokens.
  c.demo.eval_questions = 256
  c.demo.eval_samples = 32
  c.demo.methods = "grpo,capo"
  # The bare-integer checker (a reward.correct plug-in: docs/rewards.md).
  c.reward.correct = "capo_jax.demo.cued:is_correct"

  c.rollout.max_prompt_len = 16  # "9*9*9=?729" and <bos>: 11 tokens
  c.rollout.max_new_tokens = 6  # the longest answer ("-81", "729": 3 tokens), <eos>, 2 spare
  c.algo.name = "capo"
  c.algo.tau = 0.6  # the paper's; the studies add tau 1.0 and tau relative to the spread
  c.optim.lr = 5e-4
  c.train.num_steps = 150
  c.train.pack_len = 0  # sequences of <= 22 tokens: one per row
  c.train.pack_rows = 0
  c.eval.every_steps = 25
  c.checkpoint.every_steps = 50
  if common.wants_shrink(arg, __file__):
    c.demo.task.update(num_sft=200, sft_val=16, num_rl=200, num_heldout=16)
    c.demo.model.update(dict(num_layers=1, hidden_size=32, intermediate_size=64))
    c.demo.sft.update(
      max_steps=20,
      eval_every=10,
      eval_questions=16,
      eval_samples=2,
      early_stop=False,
      batch_size=16,
    )
    c.demo.eval_questions, c.demo.eval_samples = 16, 4
    c.rollout.num_prompts, c.rollout.num_samples = 4, 4
    c.train.num_steps, c.train.mini_batch_prompts, c.train.micro_batch_size = 2, 2, 8
    c.eval.every_steps, c.checkpoint.every_steps = 1, 1
  return c
