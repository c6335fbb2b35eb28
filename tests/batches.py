"""A rollout mini-batch as the host holds it, its ``TrainBatch``, and the log-prob pass over
padded arrays (tests, benchmarks and tools)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from capo_jax.rl import microbatches
from capo_jax.rl import train_step as ts
from capo_jax.rl.batch import Sequences, TrainBatch
from capo_jax.rl.logprob_pass import LogprobPass
from capo_jax.runtime import mesh as mesh_lib
from models import qwen2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostBatch:
  """Padded sequences [B, ...]: left-padded prompts, right-padded completions."""

  prompt_tokens_BP: Any
  prompt_mask_BP: Any
  completion_tokens_BC: Any
  completion_mask_BC: Any
  old_logp_BC: Any
  adv_B: Any
  ref_logp_BC: Any = None
  correct_B: Any = None
  old_topk_ids_BCJ: Any = None
  old_topk_logp_BCJ: Any = None

  def seqs(self) -> Sequences:
    return Sequences(
      completion_mask_BC=self.completion_mask_BC,
      old_logp_BC=self.old_logp_BC,
      adv_B=self.adv_B,
      ref_logp_BC=self.ref_logp_BC,
      correct_B=self.correct_B,
      old_topk_ids_BCJ=self.old_topk_ids_BCJ,
      old_topk_logp_BCJ=self.old_topk_logp_BCJ,
    )

  def train_batch(
    self, rows_per_microbatch: int, *, pack: bool = False, row_len: int = 0
  ) -> TrainBatch:
    """The batch the train step takes: packed rows of ``row_len`` tokens, or one
    sequence per row; micro-batches of ``rows_per_microbatch`` rows."""
    host = lambda x: None if x is None else np.asarray(x)  # noqa: E731
    width = self.prompt_tokens_BP.shape[1] + self.completion_tokens_BC.shape[1]
    mbs = microbatches.plan_update(
      host(self.prompt_tokens_BP),
      host(self.prompt_mask_BP),
      host(self.completion_tokens_BC),
      host(self.completion_mask_BC),
      microbatches.RowLayout(row_len or width, rows_per_microbatch, pack),
      topk_ids_BCJ=host(self.old_topk_ids_BCJ),
    )
    return mbs.batch(jax.tree.map(host, self.seqs()))


def padded_pass(
  cfg: Any,
  mesh: Any,
  rules: Any,
  rows: int,
  *,
  chunk_size: int = 0,
  top_k: int = 0,
  lora: Any = None,
  layout: Any = None,
  gather_once: bool = False,
  gathered: Any = None,
) -> LogprobPass:
  """The old / reference log-prob pass, by default one sequence per row, ``rows`` rows per
  call: ``lp.run(params, lp.upload(prompt, pmask, comp, cmask), cmask, keys)`` -> [B, C].
  ``gather_once``: the weights gathered once, before the calls (``config.mesh.gather_once``),
  laid out by ``gathered`` (default ``mesh.GATHERED_RULES``)."""
  sh = mesh_lib.batch_sharding(mesh, rules, rows)
  gathered = gathered or mesh_lib.GATHERED_RULES
  return LogprobPass(
    ts.make_logprob_fn(cfg, mesh, rules, rows, chunk_size=chunk_size, top_k=top_k, lora=lora),
    layout=layout or microbatches.RowLayout(0, rows, pack=False),
    rows_sharding=sh,
    index_sharding=sh,
    gather=ts.make_gather(cfg, mesh, gathered) if gather_once else None,
  )


def run_pass(
  lp: LogprobPass, params: Any, xs: Any, keys: tuple[str, ...] = ("logp_BC",), adapters: Any = None
) -> dict[str, np.ndarray]:
  """``lp`` over the padded arrays ``xs`` (prompt, prompt mask, completion, its mask)."""
  xs = [np.asarray(x) for x in xs]
  out = lp.run(params, lp.upload(*xs), jax.numpy.asarray(xs[3]), keys, adapters=adapters)
  return {k: np.asarray(v) for k, v in out.items()}


@functools.partial(jax.jit, static_argnums=1)
def ref_completion_logp(
  params: Any, cfg: Any, prompt_BP: Any, prompt_mask_BP: Any, completion_BC: Any
):
  """Log-probs of the completion tokens from one unpacked full forward of the model (the
  reference the packed and chunked passes are checked against)."""
  P, C = prompt_BP.shape[1], completion_BC.shape[1]
  logits = qwen2.forward(
    params,
    cfg,
    jnp.concatenate([prompt_BP, completion_BC], 1),
    jnp.concatenate([prompt_mask_BP, jnp.ones_like(completion_BC)], 1),
  )
  logp_BCV = jax.nn.log_softmax(logits[:, P - 1 : P - 1 + C], -1)
  return jnp.take_along_axis(logp_BCV, completion_BC[..., None], -1)[..., 0]
