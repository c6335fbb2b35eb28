r"""GRPO on Qwen2.5-Math-1.5B: the CAPO run of ``capo_qwen2p5_math_1p5b.py`` with GRPO's advantage.

  python -m capo_jax.main --config=configs/grpo_qwen2p5_math_1p5b.py \
      --workdir=gs://BUCKET/grpo-1p5b

Tiny CPU variant: ``--config=configs/grpo_qwen2p5_math_1p5b.py:shrink``. The noise
mask stays off (``algo.mask="auto"`` masks for CAPO only); the paper's ablation
"GRPO with the mask" is ``--config.algo.mask=on``.
"""

from __future__ import annotations

import ml_collections

from configs import capo_qwen2p5_math_1p5b, common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  common.wants_shrink(arg, __file__)  # the error names this file, not the CAPO one
  c = capo_qwen2p5_math_1p5b.get_config(arg)
  c.algo.name = "grpo"
  return c
