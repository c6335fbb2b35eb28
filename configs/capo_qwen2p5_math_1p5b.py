r"""CAPO on Qwen2.5-Math-1.5B with the paper's settings.

  python -m capo_jax.main --config=configs/capo_qwen2p5_math_1p5b.py \
      --workdir=gs://BUCKET/capo-1p5b

The weights come from the hub id Qwen/Qwen2.5-Math-1.5B (``model.hf_path``; a local or gs://
copy: ``--config.model.hf_path=DIR``). Tiny CPU variant (random weights):
``--config=configs/capo_qwen2p5_math_1p5b.py:shrink``.
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
  c.model.hf_path = "Qwen/Qwen2.5-Math-1.5B"
  c.model.preset = "qwen2p5_math_1p5b"
  c.algo.name = "capo"
  c.algo.tau = 0.6
  c.train.num_steps = 600
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  # The weights gathered once per log-prob pass and per update (a bf16 copy of 3.1 GB per
  # chip): every slice of tools/memory_plan.py still fits, and a step on v4-32 sends 0.28 TB
  # between chips a chip, not 0.45 (the TPU compiler's count; docs/tpu.md).
  c.mesh.gather_once = True
  # And each chip's rows' float32 gradient kept over an update (6.2 GB a chip; the
  # compiled train program holds 10.5 GiB more on v4-32, 18.6 of 32), reduced
  # once: the train program sends 29 GB a step between chips, not 109 (the TPU
  # compiler's count; docs/tpu.md). LoRA runs set it False (their gradients are small).
  c.mesh.reduce_once = True
  # The rollout engine's active rows (KV slots), 0: every row of a call at once, then
  # the tail loops. What tools/memory_plan.py picks for v4-32 and v5e-16.
  c.rollout.max_active_rows = 0
  return common.shrink(c) if common.wants_shrink(arg, __file__) else c
