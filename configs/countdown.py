r"""Countdown: RL on a task whose answers are expressions, graded by a plug-in checker.

  python -m capo_jax.main --config=configs/countdown.py --workdir=DIR

Each question gives 3-4 numbers and a target; the answer is an arithmetic expression
over them (``capo_jax/data/countdown.py``: a generated dataset, registry name
``countdown``, checked by evaluating the expression's syntax tree exactly). ``correct``
comes from that checker (``reward.correct="auto"`` picks the dataset's); the scalar
reward adds a small format bonus through a reward plug-in, which GRPO and the other
baselines see (``--config.algo.name=grpo``) and CAPO's pairs do not (docs/rewards.md).

Tiny CPU variant (a random model; any HF tokenizer directory):
``--config=configs/countdown.py:shrink --config.tokenizer_path=DIR``. Its calibration
report: ``python -m capo_jax.eval --policy=DIR --benchmarks=countdown --limit=8``.
"""

from __future__ import annotations

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = common.get_base_config()
  c.model.hf_path = "Qwen/Qwen2.5-Math-1.5B"  # or a local / gs:// copy
  c.model.preset = "qwen2p5_math_1p5b"
  c.algo.name = "capo"
  c.data.train = "countdown"  # 5,000 generated questions (or countdown.jsonl in data_dir)
  c.data.train_size = 0  # all but the validation questions
  c.data.val_size = 200
  c.data.eval = ()  # the math benchmarks say nothing about this task
  c.rollout.max_prompt_len = 256
  c.rollout.max_new_tokens = 1024
  c.eval.max_new_tokens = 1024
  c.reward.correct = "auto"  # the countdown checker
  c.reward.fns = ("correct", "capo_jax.data.example_rewards:boxed_format")
  c.reward.weights = (1.0, 0.1)
  c.train.num_steps = 200
  c.rollout.max_active_rows = 512
  if common.wants_shrink(arg, __file__):
    c = common.shrink(c)
    c.rollout.max_prompt_len = 256  # the prompts are longer than shrink's 64 tokens
    c.data.val_size = 2
  return c
