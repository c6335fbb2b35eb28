"""An explicit key/value cache: a plain pytree that goes in and comes out.

Columns (S) are shared by all rows: column ``i`` of every row is written at the
same call, so one scalar ``index`` says where the next tokens go. Left-padded
prompts leave masked columns at the start of short rows; ``mask_BS`` marks the
columns that hold real tokens and ``positions_B`` the next RoPE position of
each row (its count of real tokens so far).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.config import Qwen2Config


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k_LBSKH: jax.Array
  v_LBSKH: jax.Array
  mask_BS: jax.Array  # bool: column holds a real token
  positions_B: jax.Array  # int32: RoPE position of the row's next token
  index: jax.Array  # int32 scalar: next column to write

  @property
  def max_len(self) -> int:
    return self.k_LBSKH.shape[2]

  @property
  def batch_size(self) -> int:
    return self.k_LBSKH.shape[1]


def init_cache(cfg: Qwen2Config, batch_size: int, max_len: int) -> KVCache:
  """An empty cache of ``max_len`` columns in the compute dtype."""
  shape = (cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
  return KVCache(
    k_LBSKH=jnp.zeros(shape, cfg.dtype),
    v_LBSKH=jnp.zeros(shape, cfg.dtype),
    mask_BS=jnp.zeros((batch_size, max_len), jnp.bool_),
    positions_B=jnp.zeros((batch_size,), jnp.int32),
    index=jnp.zeros((), jnp.int32),
  )
