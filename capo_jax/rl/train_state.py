"""The train state and what the step does (``TrainConfig``), created already sharded.

Params (and Adam moments) are float32 masters. With LoRA (``TrainConfig.lora``) the state's
params are the adapters only (``models.lora``), so the optimizer state and the checkpoints hold
nothing else. ``capo_jax.rl.train_step`` updates the state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from capo_jax.rl import losses
from capo_jax.rl.optim import OptimConfig, make_optimizer
from capo_jax.runtime import mesh as mesh_lib
from capo_jax.types import Array
from models import lora as lora_lib
from models import qwen2, sharding
from models.config import Qwen2Config
from models.qwen2 import Params
from models.sharding import Rules


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  """params: float32 masters (LoRA: the adapters); step: steps taken (int32);
  num_skipped: non-finite ones."""

  step: Array
  params: Params
  opt_state: Any
  num_skipped: Array


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """What the step does; hashable (a static argument of the jitted step).

  Attributes:
    policy_loss: ``losses.Ppo()`` (GRPO, Dr.GRPO, CAPO, ...), ``Gspo()`` or ``Simko()``,
      with its own hyper-parameters.
    loss: the settings every policy loss shares (aggregation, PPO's clip, KL).
    optim: optimizer and learning-rate schedule.
    logprob_chunk_size: completion positions per unembedding chunk (0: all).
    skip_nonfinite: keep the state when the loss or gradients are not finite.
    lora: train low-rank adapters on a frozen base (``models.lora``); None: all params.
    gather_once: the update gathers the weights whole over fsdp once, in the compute
      dtype, for all its micro-batches (``train_step.gathered_weights``); with LoRA, the
      frozen base.
    reduce_once: with ``gather_once`` and full fine-tuning, each row shard's float32
      gradient is summed over the micro-batches where it lies and the update reduces
      the shards' sums once (``capo_jax.rl.local_grads``). With one micro-batch, one row
      shard, or rows the shards do not divide, the step reduces as without it (one
      micro-batch: that reduction is already the update's only one).
  """

  policy_loss: losses.PolicyLoss = losses.Ppo()
  loss: losses.LossConfig = losses.LossConfig()
  optim: OptimConfig = OptimConfig()
  logprob_chunk_size: int = 0
  skip_nonfinite: bool = True
  lora: lora_lib.LoraConfig | None = None
  gather_once: bool = False
  reduce_once: bool = False

  def __post_init__(self) -> None:
    if self.reduce_once and (not self.gather_once or self.lora is not None):
      raise ValueError(
        "TrainConfig.reduce_once needs gather_once and full fine-tuning (with LoRA the "
        "adapters' gradients are small: leave it off)"
      )
    if not isinstance(self.policy_loss, losses.PolicyLoss):
      raise TypeError(
        f"TrainConfig.policy_loss={self.policy_loss!r} is not a "
        "losses.PolicyLoss (Ppo(), Gspo(), Simko())"
      )
    if self.logprob_chunk_size < 0:
      raise ValueError(f"TrainConfig.logprob_chunk_size={self.logprob_chunk_size} must be >= 0")

  def replace(self, **changes: Any) -> TrainConfig:
    return dataclasses.replace(self, **changes)


def init_train_state(params: Params, tcfg: TrainConfig) -> TrainState:
  """A fresh state around ``params`` (cast to float32 masters)."""
  params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=make_optimizer(tcfg.optim).init(params),
    num_skipped=jnp.zeros((), jnp.int32),
  )


def trainable_shapes(model_cfg: Qwen2Config, tcfg: TrainConfig) -> Params:
  """Shapes of what the optimizer updates: every param, or (LoRA) the adapters."""
  shapes = qwen2.param_shapes(model_cfg)
  return shapes if tcfg.lora is None else lora_lib.adapter_shapes(shapes, tcfg.lora)


def trainable_shardings(
  model_cfg: Qwen2Config, tcfg: TrainConfig, mesh: Mesh, rules: Rules
) -> Params:
  """NamedShardings of ``trainable_shapes`` under ``rules``."""
  if tcfg.lora is None:
    return mesh_lib.param_shardings(model_cfg, mesh, rules)
  axes = lora_lib.adapter_axes(qwen2.param_axes(model_cfg), tcfg.lora)
  specs = sharding.tree_specs(axes, rules, trainable_shapes(model_cfg, tcfg), mesh)
  return jax.tree.map(
    lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
  )


def state_shardings(
  model_cfg: Qwen2Config, tcfg: TrainConfig, mesh: Mesh, rules: Rules
) -> TrainState:
  """NamedShardings of the train state: Adam moments follow their params."""
  p_sh = trainable_shardings(model_cfg, tcfg, mesh, rules)
  abstract = jax.eval_shape(lambda p: init_train_state(p, tcfg), trainable_shapes(model_cfg, tcfg))
  rep = mesh_lib.replicated(mesh)
  opt_sh = optax.tree_map_params(
    make_optimizer(tcfg.optim),
    lambda _, s: s,
    abstract.opt_state,
    p_sh,
    transform_non_params=lambda _: rep,
  )
  # The state's tree with a sharding at each leaf (a prefix for jit), not a state of arrays.
  return dataclasses.replace(jax.tree.map(lambda _: rep, abstract), params=p_sh, opt_state=opt_sh)


def train_state_from_params(
  params: Params, model_cfg: Qwen2Config, tcfg: TrainConfig, mesh: Mesh, rules: Rules
) -> TrainState:
  """The train state of loaded params, placed in the shardings ``rules`` give."""
  sh = state_shardings(model_cfg, tcfg, mesh, rules)
  return jax.jit(functools.partial(init_train_state, tcfg=tcfg), out_shardings=sh)(params)


def create_train_state(
  model_cfg: Qwen2Config, tcfg: TrainConfig, rng: jax.Array, mesh: Mesh, rules: Rules
) -> TrainState:
  """Random init straight into the sharded layout (no full copy on one device).

  LoRA: fresh adapters (B = 0); the base comes from elsewhere.
  """
  sh = state_shardings(model_cfg, tcfg, mesh, rules)
  if tcfg.lora is not None:
    shapes = qwen2.param_shapes(model_cfg)
    init = lambda key: init_train_state(lora_lib.init_adapters(shapes, tcfg.lora, key), tcfg)
    return jax.jit(init, out_shardings=sh)(rng)
  init = lambda key: init_train_state(qwen2.init_params(model_cfg, key), tcfg)
  return jax.jit(init, out_shardings=sh)(rng)
