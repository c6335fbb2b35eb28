"""The engine's one-token decode step over N cache slots, each at its own column.

The prefill fills the model's stacked ``KVCache`` [L, Q, P, K, H] once per
prompt; the engine (capo_jax.sampling.engine) copies a prompt's keys / values
into a slot of a ``SlotCache`` when a row starts there, and every decode step
advances all N slots by one token (``step``):

- slot n holds one row: its left-padded prompt in columns [0, P), then its
  completion, token t's key / value at column P + t - 1. Each slot writes at
  its own column (a scatter), so rows of different ages share a step.
- attention reads only the filled part of the cache: blocks of ``block``
  columns up to the longest active slot (``num_blocks``, a traced value), with
  an online softmax. A block past a slot's end is all masked and changes
  nothing (max unchanged, rescale exactly 1, weights exactly 0), so a row's
  result does not depend on the other rows in the step.
- keys as [N, K, H, S] and values as [N, K, S, H], the operand layouts of the
  two attention matmuls, so no step transposes the cache (with the model's
  [B, S, K, H] layout XLA transposed every layer's whole cache every step),
  and one buffer per layer, not a slice of a stacked array (inside the
  model's layer scan XLA copies every layer's cache slice in and out).

Row-count invariance: a row's logits must not depend on how many slots
share the step (the engine's samples are the same whatever N). XLA:CPU's
GEMM sums an [N, D] x [D, F] product in an order that depends on N: below
64 rows it blocks the contraction differently, and logits move by ~4e-6,
enough to flip an inverse-CDF draw from a flat distribution. An
[N, D] x [F, D] product (both operands contracted on their last axis) came
out bitwise the same for every N from 2 to 256, on every projection shape
of the benchmark model and of Qwen2.5-0.5B and on both unembeddings
(measured 2026-12-02, jax 0.10.2). So on CPU ``prepare`` makes output-major
[F, D] copies of the layer kernels once per rollout and the step contracts
against them (``out_major``); on accelerators it reads the kernels as stored,
since the copies would take a second set of weights in HBM. The embedding is
[V, D] already: the unembedding needs no copy when the weights are tied.
Below 8 rows XLA:CPU also vectorises the row reductions (RMS norms,
softmaxes) another way (~2e-7 apart), so on CPU the engine gives its cache
at least ``MIN_ROWS_CPU`` slots, the extra ones idle when N is smaller.

Logits come out vocab-major [V, N], the layout the strategies
(capo_jax.sampling.strategies) reduce over.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models import qwen2
from models.config import Qwen2Config
from models.qwen2 import Params

_NEG = float(jnp.finfo(jnp.float32).min)  # finite: a fully masked block stays NaN-free
MIN_ROWS_CPU = 8  # from 8 rows up every row of a step is computed the same way on CPU


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotCache:
  k: tuple[jax.Array, ...]  # per layer [N, K, H, S]
  v: tuple[jax.Array, ...]  # per layer [N, K, S, H]
  mask_NS: jax.Array  # bool: column holds a real token of the slot's row

  @classmethod
  def empty(cls, cfg: Qwen2Config, num_slots: int, num_cols: int) -> SlotCache:
    N, K, H, S = num_slots, cfg.num_kv_heads, cfg.head_dim, num_cols
    return cls(k=tuple(jnp.zeros((N, K, H, S), cfg.dtype) for _ in range(cfg.num_layers)),
               v=tuple(jnp.zeros((N, K, S, H), cfg.dtype) for _ in range(cfg.num_layers)),
               mask_NS=jnp.zeros((N, S), jnp.bool_))


@dataclasses.dataclass(frozen=True)
class DecodeWeights:
  """What every decode step reads, prepared once per loop (``prepare``).

  Per-layer 2-D kernels (sliced per layer per step, XLA would copy them
  every step): [F, D] output-major when ``out_major``, else [D, F] as stored;
  the output projection likewise ([V, D] / [D, V]); and RoPE cos / sin
  [S, H/2] for every position a row can reach in the cache: computing them
  inside the step instead, XLA fused cos / sin into every layer's rotation,
  evaluated once per head and element.
  """
  embed_VD: jax.Array
  final_norm_D: jax.Array
  layers: list[Params]
  unembed: jax.Array
  rope_Sh: tuple[jax.Array, jax.Array]
  out_major: bool


_KERNELS = ("q_kernel", "k_kernel", "v_kernel", "o_kernel", "gate_kernel", "up_kernel",
            "down_kernel")


def prepare(params: Params, cfg: Qwen2Config, num_cols: int,
            out_major: bool | None = None) -> DecodeWeights:
  """``DecodeWeights`` of ``params`` for a cache of ``num_cols`` columns.

  ``out_major`` None: on the CPU backend only (see the module docstring).
  """
  if out_major is None:
    out_major = jax.default_backend() == "cpu"
  D, dt = cfg.hidden_size, cfg.dtype

  def layer(l: int) -> Params:
    p = {k: w[l] for k, w in params["layers"].items()}
    for k in _KERNELS:  # [in..., out...] -> [I, O]: q / k / v / gate / up take D in
      w = p[k].astype(dt)
      w = w.reshape(D, -1) if k not in ("o_kernel", "down_kernel") else w.reshape(-1, D)
      p[k] = w.T if out_major else w
    return p

  if cfg.tie_word_embeddings:
    unembed = params["embed"] if out_major else params["embed"].T
  else:
    unembed = params["lm_head"].T if out_major else params["lm_head"]
  cos, sin = qwen2.rope_tables(jnp.arange(num_cols)[None], cfg.head_dim, cfg.rope_theta)
  layers, unembed = [layer(l) for l in range(cfg.num_layers)], unembed.astype(dt)
  if out_major:
    # XLA folds a transpose feeding a dot back into the dot's dimension numbers,
    # which would undo the copies; the barrier keeps them materialised.
    layers, unembed = jax.lax.optimization_barrier((layers, unembed))
  return DecodeWeights(
      embed_VD=params["embed"], final_norm_D=params["final_norm"], layers=layers,
      unembed=unembed, rope_Sh=(cos[0], sin[0]), out_major=out_major)


def _proj(w: DecodeWeights, x_NI: jax.Array, kernel: jax.Array) -> jax.Array:
  """``x_NI @ W`` with W [I, O], stored [O, I] when ``w.out_major``."""
  eq = "ni,oi->no" if w.out_major else "ni,io->no"
  return jnp.einsum(eq, x_NI, kernel)


def attend_full(q_NKRH: jax.Array, k_NKHS: jax.Array, v_NKSH: jax.Array,
                mask_NS: jax.Array) -> jax.Array:
  """One query token per slot against every column; scores and softmax in float32."""
  H = q_NKRH.shape[-1]
  scores_NKRS = jnp.einsum("nkrh,nkhs->nkrs", q_NKRH, k_NKHS,
                           preferred_element_type=jnp.float32) * (H ** -0.5)
  scores_NKRS = jnp.where(mask_NS[:, None, None], scores_NKRS, _NEG)
  probs = jax.nn.softmax(scores_NKRS, axis=-1).astype(v_NKSH.dtype)
  return jnp.einsum("nkrs,nksh->nkrh", probs, v_NKSH)


def attend_blocks(q_NKRH: jax.Array, k_NKHS: jax.Array, v_NKSH: jax.Array, mask_NS: jax.Array,
                  num_blocks: jax.Array, block: int) -> jax.Array:
  """``attend_full`` over the first ``num_blocks`` blocks of ``block`` columns only.

  Online softmax (running max, normaliser and weighted sum in float32). A
  leading all-padding block is wiped out exactly when the first real score
  arrives (its rescale is exp(min - real) = 0), a trailing all-masked one is
  an exact no-op, so the result is the softmax over the slot's real columns
  whatever ``num_blocks`` (>= the slot's filled blocks) is.
  """
  N, K, R, H = q_NKRH.shape

  def body(b: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    m_NKR, l_NKR, acc_NKRH = carry
    s0 = b * block
    k_blk = jax.lax.dynamic_slice_in_dim(k_NKHS, s0, block, axis=3)
    v_blk = jax.lax.dynamic_slice_in_dim(v_NKSH, s0, block, axis=2)
    mask_blk = jax.lax.dynamic_slice_in_dim(mask_NS, s0, block, axis=1)
    s_NKRJ = jnp.einsum("nkrh,nkhj->nkrj", q_NKRH, k_blk,
                        preferred_element_type=jnp.float32) * (H ** -0.5)
    s_NKRJ = jnp.where(mask_blk[:, None, None], s_NKRJ, _NEG)
    m_new = jnp.maximum(m_NKR, s_NKRJ.max(-1))
    rescale = jnp.exp(m_NKR - m_new)
    p_NKRJ = jnp.exp(s_NKRJ - m_new[..., None])
    acc_NKRH = acc_NKRH * rescale[..., None] + jnp.einsum(
        "nkrj,nkjh->nkrh", p_NKRJ.astype(v_NKSH.dtype), v_blk,
        preferred_element_type=jnp.float32)
    return m_new, l_NKR * rescale + p_NKRJ.sum(-1), acc_NKRH

  init = (jnp.full((N, K, R), _NEG, jnp.float32), jnp.zeros((N, K, R), jnp.float32),
          jnp.zeros((N, K, R, H), jnp.float32))
  _, l_NKR, acc_NKRH = jax.lax.fori_loop(0, num_blocks, body, init)
  return (acc_NKRH / l_NKR[..., None]).astype(v_NKSH.dtype)


@dataclasses.dataclass(frozen=True)
class Where:
  """Per slot: the column its token is written at and that token's RoPE position;
  ``num_blocks``: the blocks of ``block`` columns that hold any active slot's tokens
  (ignored when the cache is one block or less: then attention reads it all)."""
  col_N: jax.Array
  pos_N: jax.Array
  num_blocks: jax.Array
  block: int


def step(w: DecodeWeights, cfg: Qwen2Config, tokens_N: jax.Array, cache: SlotCache,
         where: Where) -> tuple[jax.Array, SlotCache]:
  """Float32 logits [V, N] of the next token after ``tokens_N``, and the updated cache.

  ``qwen2.forward_with_cache`` for T = 1 (same positions, masking and
  numerics up to the blocked softmax), with the weights of ``prepare``.
  """
  N, S = cache.mask_NS.shape
  slot_N = jnp.arange(N)
  mask_NS = cache.mask_NS.at[slot_N, where.col_N].set(True)
  rope_N1 = tuple(t[where.pos_N][:, None] for t in w.rope_Sh)
  x_ND = w.embed_VD.astype(cfg.dtype)[tokens_N]
  ks, vs = list(cache.k), list(cache.v)
  blocked = S > where.block
  for l, p in enumerate(w.layers):
    # Each slot writes its token's key / value at its own column, in place.
    q_NKRH, k_NKH, v_NKH = _attention_inputs(w, cfg, p, x_ND, rope_N1)
    ks[l] = ks[l].at[slot_N, :, :, where.col_N].set(k_NKH)
    vs[l] = vs[l].at[slot_N, :, where.col_N, :].set(v_NKH)
    if blocked:
      out_NKRH = attend_blocks(q_NKRH, ks[l], vs[l], mask_NS, where.num_blocks, where.block)
    else:
      out_NKRH = attend_full(q_NKRH, ks[l], vs[l], mask_NS)
    x_ND = _attention_output(w, cfg, p, x_ND, out_NKRH.reshape(N, -1))
  h_ND = qwen2.rms_norm(x_ND, w.final_norm_D, cfg.rms_norm_eps).astype(cfg.dtype)
  if w.out_major:
    # The barrier stops XLA from turning the transpose into a [V, D] x [N, D]
    # dot, the row-count-dependent form again.
    logits_VN = jax.lax.optimization_barrier(jnp.einsum(
        "nd,vd->nv", h_ND, w.unembed, preferred_element_type=jnp.float32)).T
  else:
    logits_VN = jnp.einsum("dv,nd->vn", w.unembed, h_ND, preferred_element_type=jnp.float32)
  return logits_VN, SlotCache(tuple(ks), tuple(vs), mask_NS)


def _attention_inputs(w: DecodeWeights, cfg: Qwen2Config, p: Params, x_ND: jax.Array,
                      rope_N1: tuple[jax.Array, jax.Array]
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``qwen2.DecoderLayer.attention_inputs`` for one token per slot, on 2-D kernels.

  q as [N, K, R, H] (R query heads per kv head), k / v as [N, K, H].
  """
  N, dt = x_ND.shape[0], cfg.dtype
  K, H = cfg.num_kv_heads, cfg.head_dim
  h_ND = qwen2.rms_norm(x_ND, p["attn_norm"], cfg.rms_norm_eps)
  q, k, v = (_proj(w, h_ND, p[n]).reshape(N, 1, -1, H)
             for n in ("q_kernel", "k_kernel", "v_kernel"))
  if cfg.qkv_bias:
    q, k, v = q + p["q_bias"].astype(dt), k + p["k_bias"].astype(dt), v + p["v_bias"].astype(dt)
  if cfg.qk_norm:
    q = qwen2.rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = qwen2.rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
  q, k = qwen2.apply_rope(q, *rope_N1), qwen2.apply_rope(k, *rope_N1)
  return q.reshape(N, K, -1, H), k[:, 0], v[:, 0]


def _attention_output(w: DecodeWeights, cfg: Qwen2Config, p: Params, x_ND: jax.Array,
                      attn_NE: jax.Array) -> jax.Array:
  """``qwen2.DecoderLayer.attention_output`` for one token per slot, on 2-D kernels."""
  x_ND = x_ND + _proj(w, attn_NE, p["o_kernel"])
  h_ND = qwen2.rms_norm(x_ND, p["mlp_norm"], cfg.rms_norm_eps)
  act_NF = jax.nn.silu(_proj(w, h_ND, p["gate_kernel"])) * _proj(w, h_ND, p["up_kernel"])
  return x_ND + _proj(w, act_NF, p["down_kernel"])
