r"""The arithmetic demo: GRPO vs CAPO on a synthetic arithmetic task with a tiny Qwen2.

  python -m capo_jax.main --config=configs/demo.py --workdir=/tmp/capo_demo

The demo's earlier task, kept for the studies recorded on it (``studies/grpo_vs_capo``,
``demo_v3``, ``mask``, ``tau``, ``mismatch``) and the Colab notebook; ``make demo`` runs
the cued testbed, ``configs/cued.py``, which takes its model, trainer and cadence from here.

Warm start (supervised fine-tuning to a ~40% base policy on solutions of which 90%
follow a fluent wrong rule, cached in the workdir), then each of ``demo.methods`` (GRPO, CAPO)
from it, then a side-by-side report (accuracy, AUC-mean, paired per-question
ΔAUC with its interval, hard-bucket AUC) and ``<workdir>/demo_curves.png``.
``--config.demo.methods=capo`` runs one; ``configs/demo.py:shrink`` is a
seconds-long smoke version (tests, Colab check).

Why tau = 0.1 and not the paper's 0.6: on this task the mean token log-probs of
one question's samples differ by much less than in the paper, so at tau = 0.6
every sigmoid weight sits near 1/2 and CAPO degenerates to Dr.GRPO up to a
constant that Adam removes (the measured spreads and runs: ``docs/demo.md``).
``s_spread`` in metrics.jsonl shows the spread; ``--config.algo.adaptive_tau=c``
sets tau = c * spread instead.
"""

from __future__ import annotations

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = common.get_base_config()
  c.seed = 0
  c.model.preset = ""  # the warm start provides the policy
  c.model.param_dtype = "float32"
  c.model.compute_dtype = "float32"
  c.model.remat = False

  # <workdir>/jax_cache: a rerun of the command, and the study's later runs, load the
  # programs earlier runs compiled (GRPO and CAPO share no train step: CAPO's batch
  # carries the reference log-probs for its KL metric).
  c.compilation_cache_dir = "jax_cache"

  c.demo = ml_collections.ConfigDict()
  # 90% of the SFT solutions follow a fluent wrong rule (left to right, no precedence):
  # the warm start is then confidently wrong on the questions where the rule's answer
  # differs (capo_jax/demo/task.py). Why 0.9 and what it gave: docs/demo.md.
  c.demo.task = ml_collections.ConfigDict(
    dict(
      min_operands=4,
      max_operands=4,
      max_operand=9,
      operators="+-*",
      num_train=20000,
      num_heldout=1000,
      seed=0,
      wrong_rule="left_to_right",
      wrong_fraction=0.9,
    )
  )
  # Overrides of warm_start.default_model_config. The two CPU forms (docs/training.md, "CPU
  # runs: small models") are off: ~1.3x faster an RL step, equal only up to float rounding,
  # and the recorded studies ran without them.
  c.demo.model = ml_collections.ConfigDict(dict(layer_unroll=1, trim_last_layer=False))
  c.demo.sft = ml_collections.ConfigDict(
    dict(
      max_steps=1500,
      batch_size=64,
      lr=2e-3,
      warmup_steps=50,
      eval_every=50,
      eval_questions=128,
      eval_samples=8,
      early_stop=True,
      target_low=0.40,
      target_high=0.55,
      seed=0,
    )
  )
  c.demo.eval_questions = 1000
  c.demo.eval_samples = 16
  c.demo.eval_seed = 1234
  # The main command trains each of these from the same warm start and compares them
  # (names of capo_jax.demo.compare.VARIANTS).
  c.demo.methods = "grpo,capo"
  c.demo.reward_flip = 0.0  # > 0: flip this fraction of training rewards (noisy verifier)
  # Structured false negatives (training rewards only): "negative" rejects each correct
  # answer boxed with a leading minus with probability false_negative_rate
  # (capo_jax/demo/compare.py: FalseNegativeGrader says why a rate).
  c.demo.false_negative = ""
  c.demo.false_negative_rate = 0.5
  # The noise mask's thresholds: () = algo.mask_low / mask_high (the paper's 1.05 / 2.5);
  # (q_wrong, q_right) = those quantiles of the warm start's reference perplexity on its
  # wrong / correct samples of mask_questions training questions (seed mask_seed), e.g.
  # (0.1, 0.9) masks 10% of each on the warm start (capo_jax/demo/mask.py).
  c.demo.mask_quantiles = ()
  c.demo.mask_questions = 512
  c.demo.mask_seed = 99

  c.rollout.num_prompts = 32
  c.rollout.num_samples = 8
  c.rollout.max_prompt_len = 32
  c.rollout.max_new_tokens = 0  # 0: the longest written solution + 9 (demo.run sets it)
  # The sampler's own log-probs as the old policy's: float32 on a CPU, they equal a
  # trainer pass within ~1e-6 and save one forward over the rollout per step.
  c.rollout.old_logprobs = "sampler"

  c.algo.name = "capo"
  c.algo.tau = 0.1
  c.optim.lr = 1e-4
  c.optim.weight_decay = 0.0
  # 100, not the studies' 150: GRPO's AUC-mean peaked at step 100 in the v2 study, the two
  # methods had separated by then, and 150 steps took the command past 15 minutes on the
  # slower 2-core boxes (docs/demo.md, "Cost").
  c.train.num_steps = 100
  c.train.mini_batch_prompts = 16  # 2 updates per step, as in the paper
  c.train.micro_batch_size = 128
  c.train.logprob_chunk = 0
  c.train.logprob_rows = 0  # all rows in one log-prob call: small enough on a CPU
  # Packed rows of 128 tokens hold ~4 sequences of ~30; 16 rows per micro-batch fit
  # one update's 128 sequences in two micro-batches (the default, 128 rows x 65 tokens,
  # computed twice the padding: 5-6 s per step instead of ~3 on the 2-core box).
  c.train.pack_len = 128
  c.train.pack_rows = 16
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
  c.checkpoint.every_steps = 50
  c.checkpoint.export_hf = False
  c.log.samples_every_steps = 25
  c.eval.every_steps = 50  # held-out evals for the curves (1,000 x 16 samples: ~1 min each)
  if common.wants_shrink(arg, __file__):
    c.demo.task.num_train, c.demo.task.num_heldout = 600, 32
    c.demo.model.update(dict(num_layers=1, hidden_size=32, intermediate_size=64))
    c.demo.sft.update(
      max_steps=20,
      eval_every=10,
      eval_questions=32,
      eval_samples=2,
      early_stop=False,
      batch_size=16,
    )
    c.demo.eval_questions, c.demo.eval_samples = 16, 2
    c.demo.mask_questions = 16
    c.rollout.num_prompts, c.rollout.num_samples = 4, 4
    c.train.num_steps, c.train.mini_batch_prompts, c.train.micro_batch_size = 2, 2, 8
    c.eval.every_steps, c.checkpoint.every_steps = 0, 1
  return c
