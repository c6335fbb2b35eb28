"""The chunked unembedding of ``logprobs`` on a mesh: the weight gathered once per call.

``logprobs.logprobs_from_hidden`` unembeds the hidden states a chunk of positions at a
time in a ``lax.scan``. Under XLA's automatic partitioning, a chunk's logits need the
[D, V] unembedding whole over the row axes (data x fsdp), and its gradient back in
the weight's fsdp split, so the loop the TPU compiler makes gathers the weight and
all-reduces its gradient once per chunk: most of what a chip sends per micro-batch of
the train program (docs/packing.md has the figures).

Here the loop runs inside a ``shard_map`` over the mesh: the weight enters it whole
over the row axes (one gather a call, in its stored dtype), each chip unembeds its own
rows, and the weight's gradient sums over the chunks on each chip and over the chips
once, at the ``shard_map``'s boundary. A vocabulary split over the tensor axes stays
split: the log-sum-exp, the picked tokens' logits, the entropy, the top-k and the
argmax combine the shards with collectives over those axes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from capo_jax.rl import local_grads
from capo_jax.types import Array
from models.sharding import Layout

Axes = tuple[str, ...]


def split_vocab_stats(
  logits_BCv: Array, tokens_BC: Array, ids_BCJ: Array | None, top_k: int, vocab: Axes
) -> dict[str, Array]:
  """Log-prob, entropy and (given ``ids_BCJ`` or ``top_k`` > 0) top-k log-probs, ids
  and argmax flags of float32 logits whose vocabulary is split over the mesh axes
  ``vocab`` (this device holds the ``v`` columns at ``axis_index(vocab) * v``; inside a
  ``shard_map``); ``vocab`` empty: the whole vocabulary, on any device."""
  reduce = lambda f, x: f(x, vocab) if vocab else x  # noqa: E731
  v = logits_BCv.shape[-1]
  offset = jax.lax.axis_index(vocab) * v if vocab else 0
  sg = jax.lax.stop_gradient(logits_BCv)
  m_BC = reduce(jax.lax.pmax, jnp.max(sg, axis=-1))
  se_BC = reduce(jax.lax.psum, jnp.sum(jnp.exp(logits_BCv - m_BC[..., None]), axis=-1))
  lse_BC = m_BC + jnp.log(se_BC)

  def pick(ids_BCK: Array) -> Array:
    """The logits at global vocabulary ids, each from the shard that holds it."""
    local = ids_BCK - offset
    inside = (local >= 0) & (local < v)
    got = jnp.take_along_axis(logits_BCv, jnp.clip(local, 0, v - 1), axis=-1)
    return reduce(jax.lax.psum, jnp.where(inside, got, 0.0))

  probs = jnp.exp(sg - jax.lax.stop_gradient(lse_BC)[..., None])
  entropy_BC = jax.lax.stop_gradient(lse_BC) - reduce(jax.lax.psum, jnp.sum(probs * sg, axis=-1))
  out = {"logp": pick(tokens_BC[..., None])[..., 0] - lse_BC, "entropy": entropy_BC}
  if ids_BCJ is None and top_k > 0:
    vals, ids = jax.lax.top_k(sg, top_k)
    if vocab:  # each shard's top-k, gathered, then the top-k of those
      vals, ids = (_gather_last(x, vocab) for x in (vals, ids + offset))
      _, at = jax.lax.top_k(vals, top_k)
      ids = jnp.take_along_axis(ids, at, axis=-1)
    ids_BCJ = ids
  if ids_BCJ is not None:
    ids_BCJ = ids_BCJ.astype(jnp.int32)
    out["topk_logp"] = pick(ids_BCJ) - lse_BC[..., None]
    out["topk_ids"] = ids_BCJ
    # jnp.argmax's first maximal index, over the shards: the lowest id holding the max.
    none = jnp.iinfo(jnp.int32).max
    first = jnp.where(jnp.max(sg, axis=-1) == m_BC, jnp.argmax(sg, axis=-1) + offset, none)
    out["is_argmax"] = reduce(jax.lax.pmin, first) == tokens_BC
  return out


def _gather_last(x: Array, axes: Axes) -> Array:
  """``x`` of every device along ``axes``, concatenated on the last axis in device order:
  a psum of one-hot slots, so the result is typed the same on every device (a
  ``shard_map`` output may then leave ``axes`` out of its spec)."""
  n, i = jax.lax.psum(1, axes), jax.lax.axis_index(axes)
  mine = (jnp.arange(n) == i)[:, None]
  slots = jnp.where(mine, x[..., None, :], jnp.zeros((), x.dtype))
  return jax.lax.psum(slots, axes).reshape(x.shape[:-1] + (n * x.shape[-1],))


def scan_on_mesh(
  layout: Layout,
  w_DV: Array,
  xs: tuple[Array, Array, Array | None],
  body: Callable[[Array, Any, Axes], dict[str, Array]],
) -> dict[str, Array]:
  """``lax.scan`` of ``body(w_DV, x, vocab)`` over the leading (chunk) axis of ``xs``
  ([n, B, chunk, ...] each), inside a ``shard_map`` over ``layout``'s mesh: rows split as
  the layout splits "batch", the weight's vocabulary as it splits "act_vocab" (the
  axes ``body`` gets as ``vocab``), every other mesh axis whole."""
  B = xs[0].shape[1]
  D, V = w_DV.shape
  rows = layout.spec(("batch",), (B,), "unembedded rows")[0]
  vocab_entry = layout.spec((None, "act_vocab"), (D, V), "unembedding")[1]
  vocab: Axes = (vocab_entry,) if isinstance(vocab_entry, str) else tuple(vocab_entry or ())
  per_chunk = PartitionSpec(None, rows)

  def local(w: Array, x: tuple[Array, Array, Array | None]) -> dict[str, Array]:
    _, out = jax.lax.scan(lambda carry, xi: (carry, body(w, xi, vocab)), None, x)
    return out

  specs = jax.tree.map(lambda _: per_chunk, xs)
  return jax.shard_map(
    local,
    mesh=layout.mesh,
    in_specs=(PartitionSpec(None, vocab_entry), specs),
    out_specs=per_chunk,
    check_vma=not local_grads.inside(),
  )(w_DV, xs)
