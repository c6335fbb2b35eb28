"""The old-policy and reference log-prob passes of a rollout, on the devices.

A pass runs the trainer's forward (``train_step.make_logprob_fn``) over a step's
sequences as the updates will see them: the host plans each update's
micro-batches once (``microbatches.plan_step``) and uploads them once (``upload``);
the passes regroup the micro-batches that hold tokens into calls of
``layout.rows`` rows on the devices, and each output comes back to the [B, C]
layout with one gather (``run``): nothing of it returns to the host, and the
updates' train batches are built from the same uploaded rows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from capo_jax.rl import microbatches
from capo_jax.rl.batch import ModelRows
from capo_jax.runtime.host import put_global
from capo_jax.types import Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UpdateRows:
  """One update's micro-batches on the devices (``microbatches.MicroBatches`` uploaded).

  ``filled`` (static): how many of the M micro-batches hold tokens.
  """

  rows: ModelRows
  index_MBC: Array
  take_MB: Array
  filled: int = dataclasses.field(metadata=dict(static=True))


def upload(
  plans: Sequence[microbatches.MicroBatches], sharding: jax.sharding.Sharding
) -> list[UpdateRows]:
  """The step's planned updates placed on the devices in one transfer; ``sharding``:
  the train batches' ([M, rows or slots, ...] on axis 1)."""
  put = put_global([(p.rows, p.index_MBC, p.take_MB) for p in plans], sharding)
  return [
    UpdateRows(rows, index_MBC, take_MB, p.filled)
    for (rows, index_MBC, take_MB), p in zip(put, plans)
  ]


_Z_FIELDS = ("target_col_YZ", "targets_YZ", "target_mask_YZ", "topk_ids_YZJ")


@functools.partial(jax.jit, static_argnames=("per_call", "sharding"))
def _calls(
  updates: list[UpdateRows], *, per_call: int, sharding: jax.sharding.Sharding
) -> list[ModelRows]:
  """The updates' filled micro-batches, rows laid end to end (target slots padded to the
  widest update's Z), in calls of ``per_call`` rows (the last one padded with empty rows)."""
  Z = max(u.rows.targets_YZ.shape[-1] for u in updates)

  def flat(u: UpdateRows) -> ModelRows:
    rows = jax.tree.map(lambda x: x[: u.filled].reshape((-1,) + x.shape[2:]), u.rows)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, Z - x.shape[1])] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    return dataclasses.replace(
      rows, **{f: pad(getattr(rows, f)) for f in _Z_FIELDS if getattr(rows, f) is not None}
    )

  rows = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[flat(u) for u in updates])
  n = -(-rows.tokens_YT.shape[0] // per_call)
  rows = jax.tree.map(
    lambda x: jnp.pad(x, [(0, n * per_call - x.shape[0])] + [(0, 0)] * (x.ndim - 1)), rows
  )
  return [
    jax.lax.with_sharding_constraint(
      jax.tree.map(lambda x, i=i: x[i * per_call : (i + 1) * per_call], rows), sharding
    )
    for i in range(n)
  ]


def _call_index(updates: list[UpdateRows], Z: int, B: int, C: int) -> Array:
  """[B, C]: each completion token's flat slot in the calls' outputs laid end to end
  (``_calls``' rows, ``Z`` slots a row), from the updates' own micro-batch slots."""
  index_BC = jnp.zeros((B, C), jnp.int32)
  row0 = 0
  for u in updates:
    M, Y, Zu = u.rows.targets_YZ.shape
    idx_MSC = u.index_MBC
    row_MSC = row0 + jnp.arange(M)[:, None, None] * Y + idx_MSC // Zu
    take_MS = jnp.where(u.take_MB >= 0, u.take_MB, B)  # empty slots: dropped
    index_BC = index_BC.at[take_MS].set(row_MSC * Z + idx_MSC % Zu, mode="drop")
    row0 += u.filled * Y
  return index_BC


@functools.partial(jax.jit, static_argnames=("keys", "sharding"))
def _unpack_calls(
  outs: Sequence[dict[str, Array]],
  updates: list[UpdateRows],
  mask_BC: Array,
  *,
  keys: tuple[str, ...],
  sharding: jax.sharding.Sharding,
) -> dict[str, Array]:
  """Each key's per-call [Y, Z, ...] outputs, flattened and laid end to end, gathered
  to [B, C, ...]."""
  Z = outs[0][keys[0].replace("_BC", "_YZ")].shape[1]
  index_BC = _call_index(updates, Z, *mask_BC.shape)
  m_BC = mask_BC > 0
  result = {}
  for k in keys:
    per_call = [o[k.replace("_BC", "_YZ")] for o in outs]
    flat = jnp.concatenate([x.reshape((-1,) + x.shape[2:]) for x in per_call])
    got = flat[index_BC]
    m = m_BC.reshape(m_BC.shape + (1,) * (got.ndim - 2))
    result[k] = jax.lax.with_sharding_constraint(
      jnp.where(m, got, jnp.zeros((), got.dtype)), sharding
    )
  return result


@dataclasses.dataclass(frozen=True)
class LogprobPass:
  """The jitted pass ``fn(params, rows, adapters=None)`` and its calls' rows.

  Attributes:
    fn: ``train_step.make_logprob_fn`` over ``layout.rows`` rows a call.
    gather: ``train_step.make_gather``: the weights gathered once a pass, before its
      calls (``config.mesh.gather_once``); None: each call gathers its own, layer by layer.
    layout: the calls' rows (``microbatches.RowLayout``); ``upload`` plans with it.
    rows_sharding: the sharding of one call's rows (and of its outputs).
    index_sharding: the sharding of the [B, C] outputs.
  """

  fn: Callable[..., dict[str, Array]]
  layout: microbatches.RowLayout
  rows_sharding: NamedSharding
  index_sharding: jax.sharding.Sharding
  gather: Callable[[Any], Any] | None = None

  def upload(
    self, prompt_BP: np.ndarray, pmask_BP: np.ndarray, comp_BC: np.ndarray, cmask_BC: np.ndarray
  ) -> list[UpdateRows]:
    """The sequences as one update in micro-batches of ``layout.rows`` rows, on the
    devices (a pass on its own; the rollout uploads its updates' rows instead)."""
    sh = self.rows_sharding
    batch_sh = NamedSharding(sh.mesh, PartitionSpec(None, *sh.spec))
    plan = microbatches.plan_update(prompt_BP, pmask_BP, comp_BC, cmask_BC, self.layout)
    return upload([plan], batch_sh)

  def run(
    self,
    params: Any,
    updates: list[UpdateRows],
    mask_BC: Array,
    keys: Sequence[str],
    adapters: Any = None,
  ) -> dict[str, Array]:
    """``{key: [B, C(, J)] device array}`` of the pass's outputs (``logp_BC``, ...) over
    the uploaded updates' rows. Every call is dispatched before any output is used."""
    calls = _calls(updates, per_call=self.layout.rows, sharding=self.rows_sharding)
    if self.gather is not None:  # one copy for every call, freed with the pass
      params = self.gather(params)
    outs = [self.fn(params, r, adapters=adapters) for r in calls]
    return _unpack_calls(outs, updates, mask_BC, keys=tuple(keys), sharding=self.index_sharding)
