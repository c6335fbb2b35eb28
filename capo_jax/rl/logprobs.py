"""Per-token log-probs of completions, without materialising [B, T, V] logits.

The sequence fed to the model is ``prompt_BP ++ completion_BC`` (prompt
left-padded, completion right-padded, so real tokens are contiguous and RoPE
positions come from the mask). The completion token at column c is predicted
by the hidden state at column ``P - 1 + c``.

With ``chunk_size > 0`` the completion axis is cut into chunks and a
``lax.scan`` runs the unembedding, log-softmax, entropy and top-k of one
chunk at a time; the per-chunk function is wrapped in ``jax.checkpoint`` so
the backward pass recomputes each chunk's logits instead of keeping them:
peak logits memory is B x chunk_size x V floats instead of B x C x V (with
V = 151,936 and C = 3,072 the latter is ~1.8 GB per row in float32).

Outputs (a dict, float32, zero on completion padding):
  logp_BC        log-prob of each completion token (differentiable);
  entropy_BC     entropy of the next-token distribution (stop-gradient);
  is_argmax_BC   the token is the distribution's argmax (bool), when top_k > 0
                 or topk_ids_BCJ is given;
  topk_logp_BCJ  log-probs of K tokens (differentiable): the K most likely
                 ones (top_k > 0) or the given ``topk_ids_BCJ``;
  topk_ids_BCJ   the ids those log-probs belong to (int32).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from capo_jax.rl import chunked_unembed
from capo_jax.types import Array
from models import qwen2, sharding
from models.config import Qwen2Config
from models.qwen2 import Params


def _check(
  prompt_tokens_BP: Array,
  prompt_mask_BP: Array,
  completion_tokens_BC: Array,
  completion_mask_BC: Array,
  topk_ids_BCJ: Array | None,
) -> None:
  B, P = prompt_tokens_BP.shape
  C = completion_tokens_BC.shape[1] if completion_tokens_BC.ndim == 2 else -1
  for name, x, want in (
    ("prompt_mask_BP", prompt_mask_BP, (B, P)),
    ("completion_tokens_BC", completion_tokens_BC, (B, C)),
    ("completion_mask_BC", completion_mask_BC, (B, C)),
  ):
    if x.shape != want:
      raise ValueError(f"token_logprobs: {name} has shape {x.shape}, expected {want}")
  if P < 1:
    raise ValueError(
      "token_logprobs: prompt_tokens_BP needs at least one column (the "
      "first completion token is predicted from the last prompt position)"
    )
  if topk_ids_BCJ is not None and (topk_ids_BCJ.ndim != 3 or topk_ids_BCJ.shape[:2] != (B, C)):
    raise ValueError(
      f"token_logprobs: topk_ids_BCJ has shape {topk_ids_BCJ.shape}, expected {(B, C)} + (J,)"
    )


def _chunk_stats(
  h_BCD: Array,
  w_DV: Array,
  x: tuple[Array, Array | None],
  top_k: int,
  temperature: float,
  vocab: tuple[str, ...] | None = None,
) -> dict[str, Array]:
  """Log-prob, entropy and top-k of one chunk (``x``: its tokens and the ids to score);
  logits live only inside. ``vocab`` None: traced off any ``shard_map`` (the logits
  constrained to the activation layout); else inside ``chunked_unembed``'s, the mesh
  axes that split this device's vocabulary columns."""
  logits = jnp.einsum("bcd,dv->bcv", h_BCD, w_DV, preferred_element_type=jnp.float32)
  if vocab is None:
    logits = sharding.constrain(logits, sharding.ACT_BTV)
  if temperature != 1.0:
    logits = logits / temperature
  return chunked_unembed.split_vocab_stats(logits, x[0], x[1], top_k, vocab or ())


def token_logprobs(
  params: Params,
  cfg: Qwen2Config,
  prompt_tokens_BP: Array,
  prompt_mask_BP: Array,
  completion_tokens_BC: Array,
  completion_mask_BC: Array,
  *,
  chunk_size: int = 0,
  top_k: int = 0,
  topk_ids_BCJ: Array | None = None,
  temperature: float = 1.0,
) -> dict[str, Array]:
  """Per-token log-probs (and entropy, top-k) of the completion tokens.

  Args:
    params: Qwen2 params (any float dtype; matmuls run in ``cfg.compute_dtype``).
    cfg: the model config (``cfg.remat`` rematerialises each layer).
    prompt_tokens_BP, prompt_mask_BP: left-padded prompts, mask 1 on real tokens.
    completion_tokens_BC, completion_mask_BC: right-padded completions.
    chunk_size: completion positions per unembedding chunk; 0 = all at once.
    top_k: also return the K most likely tokens' log-probs and ids, and
      ``is_argmax_BC``.
    topk_ids_BCJ: instead of the current top-k, the log-probs of these ids
      (e.g. the old policy's top-k, for SimKO's ratios); overrides ``top_k``.
    temperature: divides the logits (1.0 = the model's own distribution).

  Returns:
    dict with logp_BC, entropy_BC and, when asked, topk_logp_BCJ, topk_ids_BCJ,
    is_argmax_BC; every value is 0 / False on completion padding.
  """
  _check(prompt_tokens_BP, prompt_mask_BP, completion_tokens_BC, completion_mask_BC, topk_ids_BCJ)
  if chunk_size < 0 or top_k < 0:
    raise ValueError(f"token_logprobs: chunk_size={chunk_size} and top_k={top_k} must be >= 0")
  P = prompt_tokens_BP.shape[1]
  tokens_BT = jnp.concatenate([prompt_tokens_BP, completion_tokens_BC], axis=1)
  mask_BT = jnp.concatenate([prompt_mask_BP, completion_mask_BC], axis=1).astype(jnp.bool_)
  # The last position predicts nothing we need; dropping it saves a column.
  h_BCD = qwen2.hidden_states(params, cfg, tokens_BT[:, :-1], mask_BT[:, :-1])[:, P - 1 :]
  return logprobs_from_hidden(
    params,
    cfg,
    Targets(h_BCD, completion_tokens_BC, completion_mask_BC, topk_ids_BCJ),
    chunk_size=chunk_size,
    top_k=top_k,
    temperature=temperature,
  )


def packed_token_logprobs(
  params: Params,
  cfg: Qwen2Config,
  rows: Any,
  *,
  chunk_size: int = 0,
  top_k: int = 0,
  temperature: float = 1.0,
) -> dict[str, Array]:
  """``token_logprobs`` of model rows (``capo_jax.rl.batch.ModelRows``).

  The rows [Y, T] run through the model with their segment ids and
  positions; only each row's Z target columns ``rows.target_col_YZ`` are
  unembedded, for the tokens ``rows.targets_YZ`` (mask ``rows.target_mask_YZ``),
  row by row: the gather stays within a row, so the hidden states and logits stay
  sharded as the rows are. ``rows.topk_ids_YZJ``, when not None, plays the part of
  ``topk_ids_BCJ``. Keys end in ``_YZ`` / ``_YZJ``; ``batch.unpack`` puts them back
  in [B, C].
  """
  h_YZD = qwen2.hidden_states_at(
    params, cfg, rows.tokens_YT, rows.positions_YT, rows.segment_ids_YT, rows.target_col_YZ
  )
  h_YZD = sharding.constrain(h_YZD, sharding.ACT_BTD)
  out = logprobs_from_hidden(
    params,
    cfg,
    Targets(h_YZD, rows.targets_YZ, rows.target_mask_YZ, rows.topk_ids_YZJ),
    chunk_size=chunk_size,
    top_k=top_k,
    temperature=temperature,
  )
  return {k.replace("_BC", "_YZ"): v for k, v in out.items()}


@dataclasses.dataclass(frozen=True)
class Targets:
  """The hidden states [B, C, D] that predict ``tokens_BC`` (mask ``mask_BC``), and the
  ids whose log-probs to return at each position (or None: the current top-k)."""

  h_BCD: Array
  tokens_BC: Array
  mask_BC: Array
  topk_ids_BCJ: Array | None = None


def logprobs_from_hidden(
  params: Params,
  cfg: Qwen2Config,
  targets: Targets,
  *,
  chunk_size: int,
  top_k: int,
  temperature: float,
) -> dict[str, Array]:
  """The stats of ``token_logprobs`` at ``targets``, unembedded ``chunk_size`` positions
  at a time."""
  h_BCD, tokens_BC, mask_BC, topk_ids_BCJ = (
    targets.h_BCD,
    targets.tokens_BC,
    targets.mask_BC,
    targets.topk_ids_BCJ,
  )
  B, C = tokens_BC.shape
  # The unembedding stays in its stored dtype and is cast where it is used: cast
  # outside the chunk loop, its gradient would be summed over the chunks in the
  # compute dtype (bfloat16), and kept there in a second [D, V] buffer.
  w_DV = qwen2.unembed_matrix(params, cfg)
  h_BCD = h_BCD.astype(cfg.dtype)
  tokens_BC = tokens_BC.astype(jnp.int32)
  stats = functools.partial(_chunk_stats, top_k=top_k, temperature=temperature)
  # Whole over fsdp (gathered once per chunk, in the compute dtype), split over tensor.
  cast = lambda w: sharding.constrain(w.astype(cfg.dtype), (None, "act_vocab"))  # noqa: E731

  if chunk_size == 0 or chunk_size >= C:
    out = stats(h_BCD, cast(w_DV), (tokens_BC, topk_ids_BCJ))
  else:
    n = -(-C // chunk_size)
    pad = n * chunk_size - C

    def split(x: Array) -> Array:  # [B, C, ...] -> [n, B, chunk, ...]
      x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
      x = x.reshape((B, n, chunk_size) + x.shape[2:])
      return jnp.moveaxis(x, 1, 0)

    xs = (split(h_BCD), split(tokens_BC), None if topk_ids_BCJ is None else split(topk_ids_BCJ))
    layout = sharding.active_layout()
    # Remat: the backward recomputes each chunk's [B, chunk, V] logits from h.
    if layout is not None and layout.mesh.size > 1:
      # On a mesh the loop runs per device (chunked_unembed): the weight gathered once
      # a call, not once a chunk, and its gradient summed over the devices once.
      def local(w: Array, x: Any, vocab: tuple[str, ...]) -> dict[str, Array]:
        return stats(x[0], w.astype(cfg.dtype), x[1:], vocab=vocab)

      out = chunked_unembed.scan_on_mesh(layout, w_DV, xs, jax.checkpoint(local, static_argnums=2))
    else:
      body = jax.checkpoint(lambda w, x: stats(x[0], cast(w), x[1:]))
      _, out = jax.lax.scan(lambda carry, x: (carry, body(w_DV, x)), None, xs)
    out = jax.tree.map(
      lambda y: jnp.moveaxis(y, 0, 1).reshape((B, n * chunk_size) + y.shape[3:])[:, :C], out
    )

  m_BC = mask_BC.astype(jnp.bool_)
  zero = lambda x: jnp.where(
    m_BC.reshape(m_BC.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype)
  )
  return {f"{k}_BCJ" if k.startswith("topk") else f"{k}_BC": zero(v) for k, v in out.items()}
