"""One pure RL train step ``(state, batch) -> (state, metrics)``, jitted once.

Nanodo style: the state is created already sharded, the
step is one pure function wrapped by ``jax.jit`` with in/out shardings and
the state donated; old and reference log-probs are computed before it
(``make_logprob_fn``) and carried in the batch.

Typical use::

  mesh = capo_jax.runtime.mesh.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
  rules = capo_jax.runtime.mesh.TRAIN_RULES
  tcfg = TrainConfig(policy_loss=losses.Ppo(), optim=OptimConfig(learning_rate=1e-6))
  state = create_train_state(model_cfg, tcfg, rng, mesh, rules)   # or from params
  layout = microbatches.plan_update(prompt, pmask, comp, cmask, microbatches.RowLayout(T, Y))
  step_fn = make_train_step(model_cfg, tcfg, mesh, rules, rows_per_microbatch=Y)
  state, metrics = step_fn(state, layout.batch(seqs))   # `state` is donated: use the new one

Precision: params (and Adam moments) are float32 masters; with
``model_cfg.compute_dtype == "bfloat16"`` each layer casts its weights to bfloat16
where it uses them, before their FSDP all-gather (halving its traffic), or, with
``TrainConfig.gather_once``, the update casts and gathers them all once for its
micro-batches (``gathered_weights``); logits, log-softmax and the loss stay float32.
``model_cfg.remat`` remats each layer; ``TrainConfig.logprob_chunk_size`` bounds the
logits memory.

Gradient accumulation: the batch arrives as M micro-batches
(``capo_jax.rl.batch.TrainBatch``, rows packed or one sequence per row), and one
``lax.fori_loop`` runs those that hold tokens. Micro-batch m's loss is weighted by
its share of the aggregation's denominator over the original sequences (rows
with tokens, or tokens for "token-mean"), so the summed gradient equals the
full-batch one.

LoRA (``TrainConfig.lora``): the state's params are the adapters only
(``models.lora``), so the optimizer state and the checkpoints hold nothing
else; the frozen base is the step's third argument, sharded like params
under the rules, never donated and never updated. The step differentiates
the loss of ``with_adapters(base, adapters)`` with respect to the adapters.

Non-finite guard: if the loss or the gradient norm is not finite, params
and optimizer state are kept as they were (``jnp.where`` over the state),
``metrics["skipped"]`` is 1 and ``state.num_skipped`` counts it; ``step``
advances either way.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from capo_jax.rl import local_grads, losses
from capo_jax.rl.batch import ModelRows, Sequences, TrainBatch, unpack
from capo_jax.rl.logprobs import packed_token_logprobs
from capo_jax.rl.optim import current_lr, make_optimizer

# The state lives in capo_jax.rl.train_state; run/setup.py, run/trainer.py, run/aot_programs.py,
# tools/ and benchmarks/ still reach it here as `ts.<name>`.
from capo_jax.rl.train_state import (  # noqa: F401
  TrainConfig,
  TrainState,
  create_train_state,
  init_train_state,
  state_shardings,
  train_state_from_params,
  trainable_shapes,
  trainable_shardings,
)
from capo_jax.runtime import mesh as mesh_lib
from capo_jax.types import Array
from models import lora as lora_lib
from models import sharding
from models.config import Qwen2Config
from models.qwen2 import Params
from models.sharding import Rules


def compute_params(params: Params, model_cfg: Qwen2Config) -> Params:
  return jax.tree.map(lambda p: p.astype(model_cfg.dtype), params)


def gathered_weights(params: Params, model_cfg: Qwen2Config) -> Params:
  """``params`` in the compute dtype, whole over the mesh axes that split only their
  storage (``mesh.GATHERED_RULES``), under the layout being traced (as they are when
  none is). The unembedding keeps its stored dtype: ``logprobs`` casts it chunk by
  chunk, so its gradient still sums over the chunks in float32.

  Gathered once, they serve every micro-batch of an update: the layers' per-use gathers
  become no-ops (with remat, the backward's second gather too). The cost is that copy
  on every chip, about params x 2 bytes / tensor."""
  unembed = "embed" if model_cfg.tie_word_embeddings else "lm_head"
  w = {k: v if k == unembed else compute_params(v, model_cfg) for k, v in params.items()}
  layout = sharding.active_layout()
  if layout is None:
    return w
  whole = mesh_lib.param_shardings(model_cfg, layout.mesh, mesh_lib.GATHERED_RULES)
  return jax.lax.with_sharding_constraint(w, whole)


def policy_weights(
  params: Params, model_cfg: Qwen2Config, tcfg: TrainConfig, base: Params | None = None
) -> Params:
  """What the model applies: ``params`` as stored, or (LoRA) the frozen ``base``
  with the adapters ``params``, merged in the compute dtype.

  Full fine-tuning passes the float32 masters themselves: the model casts each
  weight to the compute dtype where it uses it (inside the layer scan), so no
  bfloat16 copy of the whole model exists, and each layer's gradient becomes
  float32 as it leaves the scan (cast up front, the backward would also hold the
  stacked bfloat16 gradients of every layer; ``tools/train_memory.py``).
  """
  if tcfg.lora is None:
    return params
  if base is None:
    raise ValueError("TrainConfig.lora is set: the step needs the frozen base params")
  return lora_lib.with_adapters(
    compute_params(base, model_cfg), compute_params(params, model_cfg), tcfg.lora
  )


def policy_batch(lp: dict[str, Array], seqs: Sequences, tcfg: TrainConfig) -> losses.PolicyBatch:
  """The loss inputs from the current policy's per-token outputs ([B, C]) and the sequences."""
  top_k = tcfg.policy_loss.top_k > 0  # SimKO reads its top-K candidates and the labels
  return losses.PolicyBatch(
    logp_BC=lp["logp_BC"],
    old_logp_BC=seqs.old_logp_BC,
    mask_BC=seqs.completion_mask_BC,
    adv_B=seqs.adv_B,
    entropy_BC=lp["entropy_BC"],
    ref_logp_BC=seqs.ref_logp_BC,
    topk_logp_BCJ=lp.get("topk_logp_BCJ") if top_k else None,
    old_topk_logp_BCJ=seqs.old_topk_logp_BCJ if top_k else None,
    is_argmax_BC=lp.get("is_argmax_BC") if top_k else None,
    correct_B=seqs.correct_B if top_k else None,
    is_weight_BC=seqs.is_weight_BC,
  )


class MicroBatch(NamedTuple):
  """One micro-batch of a ``TrainBatch``: its packed rows, where each sequence's
  completion tokens lie in them, and the sequences' own arrays."""

  rows: ModelRows
  index_BC: Array
  seqs: Sequences


def microbatch_loss(
  params: Params,
  mb: MicroBatch,
  model_cfg: Qwen2Config,
  tcfg: TrainConfig,
  base: Params | None = None,
  shards: sharding.Layout | None = None,
) -> tuple[Array, dict[str, Array]]:
  """The policy loss of one micro-batch under ``params`` (one forward, no accumulation).

  ``shards``: ``params`` are each row shard's own copy (``local_grads.split_weights``)
  and the forward runs shard by shard under this layout."""
  rows, index_BC, seqs = mb
  if not tcfg.policy_loss.top_k:
    rows = dataclasses.replace(rows, topk_ids_YZJ=None)

  def forward(w: Params, r: ModelRows) -> dict[str, Array]:
    weights = policy_weights(w, model_cfg, tcfg, base)
    return packed_token_logprobs(weights, model_cfg, r, chunk_size=tcfg.logprob_chunk_size)

  if shards is None:
    lp = forward(params, rows)
  else:
    split = local_grads.per_shard(forward, shards)(params, local_grads.split_rows(rows, shards))
    lp = local_grads.merge_rows(split)
  mask_BC = seqs.completion_mask_BC
  lp = {k.replace("_YZ", "_BC"): unpack(v, index_BC, mask_BC) for k, v in lp.items()}
  return losses.policy_loss(tcfg.policy_loss, policy_batch(lp, seqs, tcfg), tcfg.loss)


def denominator_B(mask_BC: Array, agg: str) -> Array:
  """Each row's share of the aggregation's denominator (tokens or non-empty rows)."""
  tokens_B = (mask_BC > 0).sum(-1).astype(jnp.float32)
  return tokens_B if agg == "token-mean" else (tokens_B > 0).astype(jnp.float32)


def combine_aux(key: str, acc: Array, new: Array, w: Array) -> Array:
  if key.endswith("_min"):
    return jnp.minimum(acc, new)
  if key.endswith("_max"):
    return jnp.maximum(acc, new)
  return acc + w * new


def init_aux(aux_shape: dict[str, Any]) -> dict[str, Array]:
  """The neutral start of ``combine_aux``'s accumulation."""
  return {
    k: jnp.full(
      s.shape, jnp.inf if k.endswith("_min") else -jnp.inf if k.endswith("_max") else 0.0, s.dtype
    )
    for k, s in aux_shape.items()
  }


def loss_and_grads(
  params: Params,
  batch: TrainBatch,
  model_cfg: Qwen2Config,
  tcfg: TrainConfig,
  base: Params | None = None,
) -> tuple[Array, dict[str, Array], Params]:
  """Full-batch loss, aux and gradients, accumulated over the micro-batches that hold tokens.

  Micro-batch m's loss is weighted by its share of the aggregation's denominator
  over the original sequences, so the sum is the full-batch loss. Aux values are
  combined with the same weights (``*_min`` / ``*_max`` keys with min / max): exact
  with one micro-batch, weighted means of the per-micro-batch values otherwise.
  """

  # What the micro-batches use: the float32 masters, cast and gathered layer by layer
  # where they are used, or (gather_once) the update's one gathered copy, whose
  # compute-dtype gradient goes back to the masters' split and dtype (the cast's
  # transpose). With LoRA the frozen base is what is gathered once.
  full = tcfg.gather_once and tcfg.lora is None
  if tcfg.gather_once and base is not None:
    base = gathered_weights(base, model_cfg)
  weights = gathered_weights(params, model_cfg) if full else params
  layout = sharding.active_layout()
  stored = (
    mesh_lib.param_shardings(model_cfg, layout.mesh, layout.rules)
    if full and layout is not None
    else None
  )

  # reduce_once: each row shard's own copy of the weights, so its share of the gradient
  # stays where it is computed until the loop ends (local_grads).
  Y = batch.rows.tokens_YT.shape[1]
  shards = local_grads.shards(layout)
  split = (
    layout
    if tcfg.reduce_once and batch.index_MBC.shape[0] > 1 and shards > 1 and Y % shards == 0
    else None
  )
  if split is not None:
    weights = local_grads.split_weights(weights, model_cfg, split)

  def to_master(g: Params) -> Params:
    if split is not None:  # each shard's share, float32, summed once after the loop
      return jax.tree.map(lambda x: x.astype(jnp.float32), g)
    if not full:
      return g
    if stored is not None:
      g = jax.lax.with_sharding_constraint(g, stored)
    return jax.tree.map(lambda x, p: x.astype(p.dtype), g, params)

  def mb_loss(p: Params, mb: MicroBatch) -> tuple[Array, dict[str, Array]]:
    return microbatch_loss(p, mb, model_cfg, tcfg, base, split)

  grad_fn = jax.value_and_grad(mb_loss, has_aux=True)
  mb_at = lambda m: MicroBatch(
    *jax.tree.map(lambda x: x[m], (batch.rows, batch.index_MBC, batch.seqs))
  )
  if batch.index_MBC.shape[0] == 1:  # no accumulator: the gradient is the only copy
    (loss, aux), grads = grad_fn(weights, mb_at(0))
    return loss, aux, to_master(grads)
  den_MB = denominator_B(batch.seqs.completion_mask_BC, tcfg.loss.agg)
  w_M = den_MB.sum(-1) / jnp.maximum(den_MB.sum(), 1.0)
  # Micro-batches fill in order: the ones past the last real row are skipped.
  n = (batch.rows.segment_ids_YT > 0).any(axis=(1, 2)).sum()

  def body(m, carry):
    g_acc, loss_acc, aux_acc = carry
    # The weight scales the loss inside the gradient so grads sum to the full-batch grad.
    (loss, aux), g = grad_fn(weights, mb_at(m))
    g, w = to_master(g), w_M[m]
    g_acc = jax.tree.map(lambda a, b: (a + w * b).astype(a.dtype), g_acc, g)
    aux_acc = {k: combine_aux(k, aux_acc[k], v, w) for k, v in aux.items()}
    return g_acc, loss_acc + w * loss, aux_acc

  aux_shape = jax.eval_shape(grad_fn, weights, mb_at(0))[0][1]
  zeros = jax.tree.map(jnp.zeros_like, params)
  if split is not None:
    zeros = local_grads.zero_shares(model_cfg, weights, split)
  init = (zeros, jnp.zeros((), jnp.float32), init_aux(aux_shape))
  grads, loss, aux = jax.lax.fori_loop(0, n, body, init)
  if split is not None:
    grads = local_grads.reduce_to(grads, stored, params)
  return loss, aux, grads


def train_step(
  state: TrainState,
  batch: TrainBatch,
  base: Params | None = None,
  *,
  model_cfg: Qwen2Config,
  tcfg: TrainConfig,
) -> tuple[TrainState, dict[str, Array]]:
  """One optimizer update on ``batch``; pure (``make_train_step`` jits it).

  ``base``: the frozen base params when ``tcfg.lora`` is set (else None).
  """
  loss, aux, grads = loss_and_grads(state.params, batch, model_cfg, tcfg, base)
  grad_norm = optax.tree.norm(grads)  # float32: grads of the float32 masters
  optimizer = make_optimizer(tcfg.optim)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  if tcfg.skip_nonfinite:
    keep = lambda new, old: jnp.where(finite, new, old)
    params = jax.tree.map(keep, params, state.params)
    opt_state = jax.tree.map(keep, opt_state, state.opt_state)
  skipped = (
    jnp.logical_not(finite).astype(jnp.int32) if tcfg.skip_nonfinite else jnp.zeros((), jnp.int32)
  )
  new_state = TrainState(
    step=state.step + 1, params=params, opt_state=opt_state, num_skipped=state.num_skipped + skipped
  )
  metrics = dict(aux)
  metrics.update(
    loss=loss,
    grad_norm=grad_norm,
    lr=current_lr(tcfg.optim, state.opt_state),
    param_norm=optax.tree.norm(params),
    skipped=skipped,
    num_skipped=new_state.num_skipped,
    num_tokens=(batch.seqs.completion_mask_BC > 0).sum().astype(jnp.int32),
  )
  return new_state, metrics


def batch_sharding(mesh: Mesh, rules: Rules, rows_per_microbatch: int) -> NamedSharding:
  """The sharding of every array of a ``TrainBatch``: [M, rows or slots, ...] on the
  second axis (slots are a multiple of the rows, so one spec serves both)."""
  spec = mesh_lib.batch_spec(mesh, rules, rows_per_microbatch, name="micro-batch rows")
  return NamedSharding(mesh, PartitionSpec(None, *spec))


def make_train_step(
  model_cfg: Qwen2Config, tcfg: TrainConfig, mesh: Mesh, rules: Rules, rows_per_microbatch: int
):
  """``step(state, batch) -> (state, metrics)`` jitted with shardings; the state is donated.

  LoRA (``tcfg.lora``): ``step(state, batch, base)``; the base is sharded like
  params under ``rules`` and not donated (it is the same array every step).
  Metrics come back replicated (scalars).
  """
  state_sh = state_shardings(model_cfg, tcfg, mesh, rules)
  in_sh: tuple[Any, ...] = (state_sh, batch_sharding(mesh, rules, rows_per_microbatch))
  if tcfg.lora is not None:
    in_sh += (mesh_lib.param_shardings(model_cfg, mesh, rules),)
  layout = sharding.Layout.of(mesh, rules)

  def step(*args: Any) -> tuple[TrainState, dict[str, Array]]:
    with sharding.activations(layout):  # the rows stay split as the batch arrives
      return train_step(*args, model_cfg=model_cfg, tcfg=tcfg)

  return jax.jit(
    step, in_shardings=in_sh, out_shardings=(state_sh, mesh_lib.replicated(mesh)), donate_argnums=0
  )


def make_gather(
  model_cfg: Qwen2Config, mesh: Mesh, rules: Rules = mesh_lib.GATHERED_RULES
) -> Callable[[Params], Params]:
  """Jitted ``gather(params)``: every param in the compute dtype, laid out by ``rules``
  (``mesh.GATHERED_RULES``: whole where only its storage is split; ``mesh.PASS_RULES``:
  whole on every chip), run once a log-prob pass (``config.mesh.gather_once``); the
  pass's calls then gather nothing."""
  whole = mesh_lib.param_shardings(model_cfg, mesh, rules)
  return jax.jit(functools.partial(compute_params, model_cfg=model_cfg), out_shardings=whole)


def make_logprob_fn(
  model_cfg: Qwen2Config,
  mesh: Mesh,
  rules: Rules,
  rows_per_call: int,
  *,
  chunk_size: int = 0,
  top_k: int = 0,
  lora: lora_lib.LoraConfig | None = None,
):
  """Jitted forward-only ``fn(params, rows, adapters=None) -> packed_token_logprobs dict``,
  the old / reference log-prob pass over ``rows_per_call`` model rows.

  Params (and adapters) are used in the shardings they arrive in (``state.params``
  under the train rules); rows, activations and outputs are sharded over the rows. With
  ``lora``, ``fn(base, rows, adapters=state.params)`` is the policy and
  ``fn(base, rows)`` the base alone (the reference): two programs, one base.
  """
  r_sh = mesh_lib.batch_sharding(mesh, rules, rows_per_call, name="model rows")
  tcfg = TrainConfig(lora=lora)
  layout = sharding.Layout.of(mesh, rules)

  def fn(params: Params, rows: ModelRows, adapters: Params | None = None) -> dict[str, Array]:
    weights = params if adapters is None else policy_weights(adapters, model_cfg, tcfg, params)
    with sharding.activations(layout):
      return packed_token_logprobs(weights, model_cfg, rows, chunk_size=chunk_size, top_k=top_k)

  return jax.jit(fn, out_shardings=r_sh)
