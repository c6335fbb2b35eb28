"""The static shape of the rollout engine's two programs, and what flows between them.

``PrefillPlan`` and ``Plan`` are the jit static arguments of ``engine.prefill`` and
``engine.decode_loop``; ``PromptCache`` and ``FirstTokens`` are what the prefill hands
the decode loop, ``Ends`` where rows end (traced). ``Plan.phases`` are the slot
counts of the decode loop's successive loops (``tail_phases``: the tail moves to
smaller caches once no row waits; ``capo_jax/sampling/engine.py`` explains it).
``KV_BLOCK``, ``ATTENTION`` and ``RAGGED_BLOCK`` are the sampler's settings, read
at each ``generate`` call.
"""

from __future__ import annotations

import dataclasses

import jax

from capo_jax.sampling import decode, ragged
from capo_jax.sampling.strategies import Strategy
from models.config import Qwen2Config
from models.sharding import Layout

# Columns per attention block: a step reads ceil(longest active row / KV_BLOCK)
# blocks. Smaller blocks read less past the longest row; each block is one
# iteration of a loop inside every layer. Read at each ``generate`` call.
KV_BLOCK = 128
# The decode attention (decode.ATTENTION: "auto" is the ragged kernel on TPU, the
# blocks above elsewhere) and the ragged kernel's columns per copy (a row reads its
# own length rounded up to it, from its first column rounded down to RAGGED_ALIGN).
# Read at each ``generate`` call.
ATTENTION = "auto"
RAGGED_BLOCK = ragged.BLOCK
RAGGED_ALIGN = ragged.ALIGN


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptCache:
  """The prefilled prompts, in the slot cache's per-layer layouts (decode.SlotCache)."""

  k: tuple[jax.Array, ...]  # per layer [Q, K, H, P], or [Q, P, K*H] for ragged attention
  v: tuple[jax.Array, ...]  # per layer [Q, K, P, H], or [Q, P, K*H]
  mask_QP: jax.Array  # bool
  length_Q: jax.Array  # int32: real prompt tokens (the RoPE position of token 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FirstTokens:
  """Token 0 of every row, chosen from the prefill's logits."""

  token_B: jax.Array  # int32
  logprob_B: jax.Array  # float32


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
  """The static shape of one ``prefill`` program (a jit static argument)."""

  cfg: Qwen2Config
  strategy: Strategy
  num_samples: int  # G
  layout: Layout | None = None
  attention: str = "blocks"  # the decode's (resolved): it sets the prompt cache's layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Ends:
  """Where rows end (traced: a new value does not compile anew)."""

  stop_ids: jax.Array  # int32 [8k]: a row ends at any of them (-1 matches nothing)
  pad_id: jax.Array  # int32 scalar: written after a row's end
  max_new_tokens: jax.Array  # int32 scalar: a row ends at this many tokens


@dataclasses.dataclass(frozen=True)
class Plan:
  """The static shape of one ``decode_loop`` program (a jit static argument)."""

  cfg: Qwen2Config
  strategy: Strategy
  num_samples: int  # G
  num_slots: int  # W
  gen_len: int  # C, the output width (>= max_new_tokens)
  layout: Layout | None = None
  block: int = KV_BLOCK
  # Slots the cache has: max(W, min_slots). Slots past W never take a row;
  # they are there because on CPU a step of fewer than 8 rows rounds its
  # reductions differently (decode.MIN_ROWS_CPU).
  min_slots: int = 1
  # Move the tail to smaller caches once no row waits (engine's module docstring; on
  # an accelerator also with W = B: sampler.engine_plan).
  shrink: bool = False
  attention: str = "auto"  # decode.resolve: ragged on TPU, blocks elsewhere
  ragged_block: int = ragged.BLOCK
  ragged_align: int = ragged.ALIGN

  @property
  def prefill_plan(self) -> PrefillPlan:
    """The plan of the ``prefill`` whose output this program decodes."""
    attention = decode.resolve(self.attention, self.layout)
    return PrefillPlan(self.cfg, self.strategy, self.num_samples, self.layout, attention)

  @property
  def phases(self) -> tuple[int, ...]:
    """Slot counts of the program's successive decode loops."""
    W = max(self.num_slots, self.min_slots)
    return tail_phases(W, batch_shards(self.layout), self.min_slots) if self.shrink else (W,)


# Tail phases: each a quarter of the previous slots, at most three loops in all
# (each loop compiles its own copy of the decode step).
SHRINK, MAX_PHASES = 4, 3


def tail_phases(num_slots: int, shards: int = 1, min_slots: int = 1) -> tuple[int, ...]:
  """W, W/4, W/16 while a phase keeps whole batch shards and ``min_slots`` slots.

  tools/memory_plan.py sizes its tail term with it.
  """
  sizes = [num_slots]
  while len(sizes) < MAX_PHASES:
    n = sizes[-1] // SHRINK
    if n < max(min_slots, 1) or n % shards:
      break
    sizes.append(n)
  return tuple(sizes)


def batch_shards(layout: Layout | None) -> int:
  """Devices the KV cache's slot axis is split over ("attn_batch": the batch axes and,
  on a sampling mesh, tensor_q): a phase keeps whole shards."""
  return 1 if layout is None else layout.shards("attn_batch")


def num_columns(prompt_len: int, gen_len: int, block: int) -> int:
  """S: prompt + completion columns, whole blocks when more than one block."""
  S = prompt_len + gen_len
  return S if S <= block else -(-S // block) * block
