r"""CAPO on Qwen2.5-Math-7B with the paper's settings.

  python -m capo_jax.main --config=configs/capo_qwen2p5_math_7b.py \
      --workdir=gs://BUCKET/capo-7b

The weights come from the hub id Qwen/Qwen2.5-Math-7B (``model.hf_path``; a local or gs://
copy: ``--config.model.hf_path=DIR``). Tiny CPU variant (random weights):
``--config=configs/capo_qwen2p5_math_7b.py:shrink``.
Another baseline: ``--config.algo.name=grpo`` (capo, grpo, dr_grpo, gspo,
codapo, cde, simko).
"""

from __future__ import annotations

import ml_collections

from configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = common.get_base_config()
  # The weights: the hub id (fetched once into HF_HOME's hub cache; HF_HUB_OFFLINE=1 reads
  # only the cache), or a local / gs:// copy with --config.model.hf_path=DIR. The preset
  # names the same architecture for tools/memory_plan.py.
  c.model.hf_path = "Qwen/Qwen2.5-Math-7B"
  c.model.preset = "qwen2p5_math_7b"
  c.algo.name = "capo"
  c.algo.tau = 0.5
  c.train.num_steps = 400
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  # --config.mesh.gather_once=True on 32 chips or more (v4-32 / v4-64 / v5p-64): the
  # weights gathered once per log-prob pass and per update, a bf16 copy of 15 GB / tensor
  # per chip, which v6e-8 cannot hold (tools/memory_plan.py; docs/tpu.md).
  # The rollout engine's active rows (KV slots): what tools/memory_plan.py picks
  # for v4-64 / v5p-64 (0: all 1,024 rows at once, then the tail loops). On v4-64 the
  # launch command of docs/tpu.md also splits the sampler's weights over 8 chips
  # (--config.mesh.sampling_tensor=8; one host's 4 by default).
  c.rollout.max_active_rows = 0
  return common.shrink(c) if common.wants_shrink(arg, __file__) else c
