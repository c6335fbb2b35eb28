"""The rollout engine: continuous batching over W cache slots, all in two jitted programs.

``prefill`` runs the Q prompts once (the G samples of a prompt share it):
their keys / values (a ``PromptCache``, Q x P columns) and every row's token 0.
``decode_loop`` is one ``lax.while_loop`` over a ``SlotCache`` of W slots x S
columns. Each iteration

1. refills: a slot whose row stopped (or that never had one) takes the next
   waiting row, whose prompt's keys / values are copied in from the prompt
   cache (a ``lax.cond``: no copy on steps where no slot frees up): only the
   128-column chunks that hold the prompt's tokens (left-padded: its last
   columns), the mask row set from its length (capo_jax.sampling.slots);
2. decodes one token in all W slots (capo_jax.sampling.decode.step), each at
   its own column; attention reads each row's own columns (the ragged kernel,
   on TPU) or the cache blocks up to the longest active row (elsewhere);
3. writes each active slot's token into the [B, C] outputs at (row, t).

So a rollout costs about (tokens generated) / W steps of W rows instead of
(longest row) steps of B rows, and the cache holds W rows, not B. Nothing
crosses to the host until the loop ends. ``num_slots = B`` (every row at once,
no refills after the first) is the lockstep decode, with the tail loops below on an
accelerator (``sampler.engine_plan``) and as one loop on CPU.

The tail: once no row waits, slots free up for good, and the last long rows
would keep paying for W slots per step (all of them read up to the longest
active row). With ``Plan.shrink`` the program then moves on to smaller loops
(``Plan.phases``: W, W/4, W/16, at most three): when the active rows fit in a
quarter of the slots, they are gathered into a cache of that many slots and
decoding goes on there. Still one program, no host sync. The cache is one
buffer per layer and per k / v, each gathered after the previous one and freed
once gathered, so the copy adds about the smaller cache to the peak, not a cache's
worth (XLA's memory analysis, in ``docs/sampling.md``; gathered all at once, the
TPU compiler held about a second cache: ``_gather_layers``).

Scheduling independence: token t of row b = q*G + g is drawn with the uniform
of ``fold_in(fold_in(rng, b), t)``, from logits that depend only on row b's
own prompt and tokens (attention masks everything else, and the blocked
softmax is exact over the blocks it skips), so which slot or step a row ran
in does not change its sample (tests/test_engine.py checks it).

The plans (the programs' static shapes), their phases and the containers the two
programs pass each other are ``capo_jax.sampling.plans``'s.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from capo_jax.sampling import choice, decode, ragged
from capo_jax.sampling import slots as slots_lib
from capo_jax.sampling.plans import (
  Ends,
  FirstTokens,
  Plan,
  PrefillPlan,
  PromptCache,
  num_columns,
)
from capo_jax.sampling.slots import Slots
from models import kv_cache, qwen2, sharding
from models.qwen2 import Params
from models.sharding import Layout

# Traces of each jitted function (one per compilation), for tests and logs.
TRACE_COUNTS: collections.Counter[str] = collections.Counter()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Out:
  tokens_BC: jax.Array
  logprobs_BC: jax.Array
  mask_BC: jax.Array
  stopped_B: jax.Array  # bool: emitted a stop token


def _constrain(layout: Layout | None, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  return x if layout is None else layout.constrain(x, axes)


def _constrain_cache(
  layout: Layout | None, k: tuple[jax.Array, ...], v: tuple[jax.Array, ...], num_kv_heads: int
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
  if layout is None:
    return k, v
  put = lambda x: jax.lax.with_sharding_constraint(
    x, NamedSharding(layout.mesh, decode.cache_spec(layout, x, num_kv_heads))
  )
  return tuple(map(put, k)), tuple(map(put, v))


def _constrain_rows(layout: Layout | None, tree: Any) -> Any:
  """Leading axis (rows or slots) over the batch axes, scalars whole."""

  def one(x: jax.Array) -> jax.Array:
    return x if x.ndim == 0 else _constrain(layout, x, ("batch",) + (None,) * (x.ndim - 1))

  return tree if layout is None else jax.tree.map(one, tree)


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
  return jnp.any(tokens[..., None] == stop_ids, axis=-1)


def row_uniforms(rng: jax.Array, row_W: jax.Array, t_W: jax.Array) -> jax.Array:
  """The uniform of token t of row b: from ``fold_in(fold_in(rng, b), t)`` alone."""
  key = lambda r, t: jax.random.uniform(
    jax.random.fold_in(jax.random.fold_in(rng, r), t), (), jnp.float32
  )
  return jax.vmap(key)(row_W, t_W)


@functools.partial(jax.jit, static_argnames=("plan",))
def prefill(
  params: Params, tokens_QP: jax.Array, mask_QP: jax.Array, rng: jax.Array, *, plan: PrefillPlan
) -> tuple[PromptCache, FirstTokens]:
  """The Q prompts' keys / values and token 0 of all B = Q*G rows."""
  TRACE_COUNTS["prefill"] += 1
  cfg, strategy, num_samples, layout = plan.cfg, plan.strategy, plan.num_samples, plan.layout
  Q, P = tokens_QP.shape
  cache = kv_cache.init_cache(cfg, Q, P)
  if layout is not None:
    cache = dataclasses.replace(
      cache,
      k_LBSKH=layout.constrain(cache.k_LBSKH, (None, "batch", None, "kv_heads", None)),
      v_LBSKH=layout.constrain(cache.v_LBSKH, (None, "batch", None, "kv_heads", None)),
    )
  # The model's activation constraints, as in the decode step: without them the TPU
  # compiler took the prompt cache's split (rows over tensor_q too) into the layers and
  # gathered every prompt's hidden states on every chip of a group past the kv heads
  # (7B prefill on v4-64, a group of 8: 119 GB sent).
  with sharding.activations(layout):
    h_QPD, cache = qwen2.hidden_states_with_cache(params, cfg, tokens_QP, mask_QP, cache)
  # Left padding puts every row's last prompt token at P - 1: unembed only it.
  logits_QV = qwen2.logits_from_hidden(params, cfg, h_QPD[:, -1:])[:, 0]
  logits_VB = jnp.repeat(logits_QV, num_samples, axis=0).T
  B = Q * num_samples
  u_B = row_uniforms(rng, jnp.arange(B), jnp.zeros((B,), jnp.int32))
  token_B, logprob_B = choice.choose(strategy, logits_VB, u_B, layout)
  L = cfg.num_layers
  if plan.attention == "ragged":  # [Q, P, K, H] -> [Q, P, K*H]: a reshape, no copy
    k_L = tuple(cache.k_LBSKH[l].reshape(Q, P, -1) for l in range(L))
    v_L = tuple(cache.v_LBSKH[l].reshape(Q, P, -1) for l in range(L))
  else:
    k_L = tuple(cache.k_LBSKH[l].transpose(0, 2, 3, 1) for l in range(L))
    v_L = tuple(cache.v_LBSKH[l].transpose(0, 2, 1, 3) for l in range(L))
  k, v = _constrain_cache(layout, k_L, v_L, cfg.num_kv_heads)
  prompts = PromptCache(k=k, v=v, mask_QP=mask_QP, length_Q=mask_QP.sum(-1, dtype=jnp.int32))
  return prompts, _constrain_rows(layout, FirstTokens(token_B, logprob_B))


def _gather_layers(
  k: tuple[jax.Array, ...], v: tuple[jax.Array, ...], idx_W: jax.Array
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
  """Each layer's k and v at ``idx_W``, one buffer after the other: each gather waits for
  the previous one (an optimization barrier), so the TPU compiler cannot hold them all
  in flight at once (the gathers of rows across chips are all-reduces of the whole
  smaller cache: in flight together they held about a second cache, 1.5B on v4-32)."""
  out: list[jax.Array] = []
  for x in (a for pair in zip(k, v) for a in pair):
    if out:
      x, _ = jax.lax.optimization_barrier((x, out[-1]))
    out.append(x[idx_W])
  return tuple(out[0::2]), tuple(out[1::2])


def _compact(
  plan: Plan, carry: tuple[Slots, decode.SlotCache, _Out], n: int, num_rows: int
) -> tuple[Slots, decode.SlotCache, _Out]:
  """The active slots (at most ``n``) gathered into a cache of ``n`` slots, in slot order.

  A row's cache columns, token count and last token move with it, so its
  next steps compute what they would have in the larger cache.
  """
  layout = plan.layout
  s, cache, out = carry
  idx_W = jnp.nonzero(s.active_W, size=n, fill_value=0)[0]
  valid_W = jnp.arange(n) < s.active_W.sum(dtype=jnp.int32)
  slots = Slots(
    row_W=jnp.where(valid_W, s.row_W[idx_W], num_rows),
    t_W=s.t_W[idx_W],
    active_W=valid_W,
    last_W=s.last_W[idx_W],
    next=s.next,
  )
  k, v = _constrain_cache(layout, *_gather_layers(cache.k, cache.v, idx_W), plan.cfg.num_kv_heads)
  cache = decode.SlotCache(k, v, _constrain(layout, cache.mask_WS[idx_W], ("batch", None)))
  return _constrain_rows(layout, slots), cache, out


@functools.partial(jax.jit, static_argnames=("plan",))
def decode_loop(
  params: Params,
  prompts: PromptCache,
  first: FirstTokens,
  rng: jax.Array,
  ends: Ends,
  *,
  plan: Plan,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Decodes every row to a stop id or ``max_new_tokens``; one device program.

  ``prompts`` and ``first`` are ``prefill``'s (under ``plan.prefill_plan``).
  Returns tokens, log-probs and mask [B, C] and stopped [B].
  """
  TRACE_COUNTS["decode"] += 1
  stop_ids, pad_id, max_new_tokens = ends.stop_ids, ends.pad_id, ends.max_new_tokens
  cfg, layout, G, C = plan.cfg, plan.layout, plan.num_samples, plan.gen_len
  W = plan.phases[0]
  Q, P = prompts.mask_QP.shape
  B = Q * G
  attention = decode.resolve(plan.attention, layout)
  S = num_columns(P, C, plan.block)
  if attention == "ragged":  # the kernel copies whole 128-column tiles
    S = -(-S // ragged.LANES) * ragged.LANES
  # The program's own platform: a TPU program compiled ahead of time on a CPU host
  # reads its kernels as stored (decode.prepare), as it will on the chip.
  w = decode.prepare(params, cfg, S, out_major=ragged.platform(layout) == "cpu")
  stop0_B = is_stop(first.token_B, stop_ids)
  done0_B = stop0_B | (max_new_tokens <= 1)
  # Rows still going after token 0, in row order, then the finished ones.
  order_B = jnp.argsort(done0_B, stable=True).astype(jnp.int32)
  num_waiting = (~done0_B).sum(dtype=jnp.int32)
  out = _constrain_rows(
    layout,
    _Out(
      tokens_BC=jnp.full((B, C), pad_id, jnp.int32).at[:, 0].set(first.token_B),
      logprobs_BC=jnp.zeros((B, C), jnp.float32).at[:, 0].set(first.logprob_B),
      mask_BC=jnp.zeros((B, C), jnp.int32).at[:, 0].set(1),
      stopped_B=stop0_B,
    ),
  )
  slots = Slots(
    row_W=jnp.full((W,), B, jnp.int32),
    t_W=jnp.zeros((W,), jnp.int32),
    active_W=jnp.zeros((W,), jnp.bool_),
    last_W=jnp.zeros((W,), jnp.int32),
    next=jnp.zeros((), jnp.int32),
  )
  empty = decode.SlotCache.empty(cfg, W, S, attention)
  k, v = _constrain_cache(layout, empty.k, empty.v, cfg.num_kv_heads)
  cache = decode.SlotCache(k, v, _constrain(layout, empty.mask_WS, ("batch", None)))
  refill = functools.partial(slots_lib.refill, plan, prompts, first, order_B, num_waiting)

  Carry = tuple[Slots, decode.SlotCache, _Out]

  def cond(smaller: int, carry: Carry) -> jax.Array:
    s = carry[0]
    going = jnp.any(s.active_W) | (s.next < num_waiting)
    if smaller:  # hand over to the next loop once its slots hold every active row
      going &= (s.next < num_waiting) | (s.active_W.sum(dtype=jnp.int32) > smaller)
    return going

  def body(refills: bool, carry: Carry) -> Carry:
    s, cache, out = carry
    if refills:  # later loops start after the last row was handed out
      s, cache = jax.lax.cond(
        jnp.any(~s.active_W[: plan.num_slots]) & (s.next < num_waiting),
        lambda sc: refill(*sc),
        lambda sc: sc,
        (s, cache),
      )
    q_W = jnp.minimum(s.row_W, B - 1) // G
    col_W = P + jnp.maximum(s.t_W, 1) - 1
    pos_W = prompts.length_Q[q_W] + jnp.maximum(s.t_W, 1) - 1
    longest = jnp.max(jnp.where(s.active_W, col_W + 1, 1))
    # A row's real columns: its left-padded prompt's, then its completion's from P on.
    start_W = jnp.where(s.active_W, P - prompts.length_Q[q_W], col_W + 1)
    where = decode.Where(
      col_W=col_W,
      pos_W=pos_W,
      block=plan.ragged_block if attention == "ragged" else plan.block,
      num_blocks=-(-longest // plan.block),
      start_W=start_W,
      attention=attention,
      layout=layout,
      align=plan.ragged_align,
    )
    with sharding.activations(layout):  # the step's activation constraints
      logits_VW, cache = decode.step(w, cfg, s.last_W, cache, where)
    u_W = row_uniforms(rng, s.row_W, s.t_W)
    token_W, logprob_W = choice.choose(plan.strategy, logits_VW, u_W, layout)
    # Inactive slots write to row B: out of range, dropped.
    row_W = jnp.where(s.active_W, s.row_W, B)
    stop_W = is_stop(token_W, stop_ids)
    out = _Out(
      tokens_BC=out.tokens_BC.at[row_W, s.t_W].set(token_W, mode="drop"),
      logprobs_BC=out.logprobs_BC.at[row_W, s.t_W].set(logprob_W, mode="drop"),
      mask_BC=out.mask_BC.at[row_W, s.t_W].set(1, mode="drop"),
      stopped_B=out.stopped_B.at[row_W].set(stop_W, mode="drop"),
    )
    done_W = stop_W | (s.t_W + 1 >= max_new_tokens)
    s = Slots(
      row_W=s.row_W,
      t_W=jnp.where(s.active_W, s.t_W + 1, s.t_W),
      active_W=s.active_W & ~done_W,
      last_W=token_W,
      next=s.next,
    )
    k, v = _constrain_cache(layout, cache.k, cache.v, cfg.num_kv_heads)
    cache = decode.SlotCache(k, v, _constrain(layout, cache.mask_WS, ("batch", None)))
    return _constrain_rows(layout, s), cache, _constrain_rows(layout, out)

  carry = (_constrain_rows(layout, slots), cache, out)
  phases = plan.phases
  for i, n in enumerate(phases):
    if i:
      carry = _compact(plan, carry, n, B)
    smaller = phases[i + 1] if i + 1 < len(phases) else 0
    carry = jax.lax.while_loop(
      functools.partial(cond, smaller), functools.partial(body, i == 0), carry
    )
  out = carry[2]
  return out.tokens_BC, out.logprobs_BC, out.mask_BC, out.stopped_B
