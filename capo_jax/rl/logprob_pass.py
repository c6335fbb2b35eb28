"""The old-policy and reference log-prob passes of a rollout, on the devices.

A pass runs the trainer's forward (``train_step.make_logprob_fn``) over a step's
sequences laid into model rows (``packing.plan_calls``: packed, or one sequence
per row), ``layout.rows`` rows per call. The host plans the rows once per
step and uploads them once (``upload``); the old and the reference pass both
run over them, and each output comes back to the [B, C] layout with one
gather on the devices (``run``): nothing of it returns to the host.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from capo_jax.rl import packing
from capo_jax.rl.batch import ModelRows
from capo_jax.runtime.host import put_global
from capo_jax.types import Array


@functools.partial(jax.jit, static_argnames="keys")
def _unpack_calls(outs: Sequence[dict[str, Array]], index_BC: Array, mask_BC: Array, *,
                  keys: tuple[str, ...]) -> dict[str, Array]:
  """Each key's per-call [Y, Z_i, ...] outputs, flattened and laid end to end, gathered
  to [B, C, ...]."""
  m_BC = mask_BC > 0
  result = {}
  for k in keys:
    per_call = [o[k.replace("_BC", "_YZ")] for o in outs]
    flat = jnp.concatenate([x.reshape((-1,) + x.shape[2:]) for x in per_call])
    got = flat[index_BC]
    m = m_BC.reshape(m_BC.shape + (1,) * (got.ndim - 2))
    result[k] = jnp.where(m, got, jnp.zeros((), got.dtype))
  return result


@dataclasses.dataclass(frozen=True)
class StepRows:
  """A step's sequences as uploaded model rows: one entry per call, and the index back."""
  calls: list[ModelRows]
  index_BC: Array


@dataclasses.dataclass(frozen=True)
class LogprobPass:
  """The jitted pass ``fn(params, rows, adapters=None)`` and how a step's rows are laid out.

  Attributes:
    fn: ``train_step.make_logprob_fn`` over ``layout.rows`` rows a call.
    layout: the calls' rows (``packing.RowLayout``).
    rows_sharding: the sharding of one call's rows (and of its outputs).
    index_sharding: the sharding of the [B, C] index and outputs.
  """
  fn: Callable[..., dict[str, Array]]
  layout: packing.RowLayout
  rows_sharding: jax.sharding.Sharding
  index_sharding: jax.sharding.Sharding

  def upload(self, prompt_BP: np.ndarray, pmask_BP: np.ndarray, comp_BC: np.ndarray,
             cmask_BC: np.ndarray) -> StepRows:
    """Plans the step's rows on the host and places them on the devices, once."""
    plan = packing.plan_calls(prompt_BP, pmask_BP, comp_BC, cmask_BC, self.layout)
    return StepRows([put_global(r, self.rows_sharding) for r in plan.calls],
                    put_global(plan.index_BC, self.index_sharding))

  def run(self, params: Any, rows: StepRows, mask_BC: Array, keys: Sequence[str],
          adapters: Any = None) -> dict[str, Array]:
    """``{key: [B, C(, J)] device array}`` of the pass's outputs (``logp_BC``, ...).

    Every call is dispatched before any output is used.
    """
    outs = [self.fn(params, r, adapters=adapters) for r in rows.calls]
    return _unpack_calls(outs, rows.index_BC, mask_BC, keys=tuple(keys))
