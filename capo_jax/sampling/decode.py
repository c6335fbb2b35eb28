"""The engine's one-token decode step over W cache slots, each at its own column.

The prefill fills the model's stacked ``KVCache`` [L, Q, P, K, H] once per
prompt; the engine (capo_jax.sampling.engine) copies a prompt's keys / values
into a slot of a ``SlotCache`` when a row starts there, and every decode step
advances all W slots by one token (``step``):

- slot w holds one row: its left-padded prompt in columns [0, P), then its
  completion, token t's key / value at column P + t - 1. Each slot writes at
  its own column (a scatter), so rows of different ages share a step.
- attention reads only the filled part of the cache, one of two ways
  (``Where.attention``; ``resolve`` picks per platform):
  ``ragged`` (TPU): a Pallas kernel (capo_jax.sampling.ragged) reads each
  slot's own columns [``start_W``, col_W] only, in blocks, and an idle slot
  nothing; ``blocks`` (CPU, GPU): blocks of ``block`` columns up to the longest
  active slot (``num_blocks``, a traced value) for all slots, an XLA loop with
  an online softmax. A block past a slot's end is all masked and changes
  nothing (max unchanged, rescale exactly 1, weights exactly 0). Either way a
  row's result does not depend on the other rows in the step.
- blocks: keys as [W, K, H, S] and values as [W, K, S, H], the operand layouts
  of the two attention matmuls, so no step transposes the cache (with the
  model's [B, S, K, H] layout XLA:CPU transposed every layer's whole cache every
  step); ragged: both as [W, S, K*H] (the kernel's layout, and the one the TPU
  compiler keeps a one-column-per-step cache in; capo_jax.sampling.ragged). One
  buffer per layer, not a slice of a stacked array (inside the model's layer
  scan XLA copies every layer's cache slice in and out).

Row-count invariance: a row's logits must not depend on how many slots
share the step (the engine's samples are the same whatever W). XLA:CPU's
GEMM sums an [W, D] x [D, F] product in an order that depends on W (for
small W it blocks the contraction differently), enough to flip an
inverse-CDF draw from a flat distribution, while an [W, D] x [F, D] product
(both operands contracted on their last axis) rounds the same whatever W
(the shapes checked: ``docs/sampling.md``). So on CPU ``prepare`` makes output-major
[F, D] copies of the layer kernels once per rollout and the step contracts
against them (``out_major``); on accelerators it reads the kernels as stored,
since the copies would take a second set of weights in HBM. The embedding is
[V, D] already: the unembedding needs no copy when the weights are tied.
Below 8 rows XLA:CPU also vectorises the row reductions (RMS norms,
softmaxes) another way (~2e-7 apart), so on CPU the engine gives its cache
at least ``MIN_ROWS_CPU`` slots, the extra ones idle when W is smaller.

Logits come out vocab-major [V, W], the layout the strategies
(capo_jax.sampling.strategies) reduce over.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from capo_jax.sampling import ragged
from models import decoder, sharding
from models.config import Qwen2Config
from models.qwen2 import Params
from models.sharding import Layout

_NEG = float(jnp.finfo(jnp.float32).min)  # finite: a fully masked block stays NaN-free
MIN_ROWS_CPU = 8  # from 8 rows up every row of a step is computed the same way on CPU
ATTENTION = ("auto", "blocks", "ragged")  # ``Where.attention``; auto: ``resolve``


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotCache:
  """Per layer keys [W, K, H, S] and values [W, K, S, H] (blocked attention), or both
  [W, S, K*H] (ragged attention: capo_jax.sampling.ragged says why)."""

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  mask_WS: jax.Array  # bool: column holds a real token of the slot's row

  @classmethod
  def empty(
    cls, cfg: Qwen2Config, num_slots: int, num_cols: int, attention: str = "blocks"
  ) -> SlotCache:
    W, K, H, S = num_slots, cfg.num_kv_heads, cfg.head_dim, num_cols
    shapes = [(W, S, K * H)] * 2 if attention == "ragged" else [(W, K, H, S), (W, K, S, H)]
    k, v = (tuple(jnp.zeros(s, cfg.dtype) for _ in range(cfg.num_layers)) for s in shapes)
    return cls(k=k, v=v, mask_WS=jnp.zeros((W, S), jnp.bool_))


def cache_spec(layout: Layout, x: jax.Array, num_kv_heads: int) -> PartitionSpec:
  """The split of one layer of a slot (or prompt) cache: rows first, then for ragged
  attention's [., S, K*H] whole kv heads per device (``ragged.cache_spec``), for the
  blocked layouts rows and kv heads."""
  if x.ndim == 3:
    return ragged.cache_spec(layout, x.shape[0], num_kv_heads)
  return layout.spec(("attn_batch", "kv_heads", None, None), x.shape)


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


_KERNELS = (
  "q_kernel",
  "k_kernel",
  "v_kernel",
  "o_kernel",
  "gate_kernel",
  "up_kernel",
  "down_kernel",
)


def prepare(
  params: Params, cfg: Qwen2Config, num_cols: int, out_major: bool | None = None
) -> DecodeWeights:
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
  cos, sin = decoder.rope_tables(jnp.arange(num_cols)[None], cfg.head_dim, cfg.rope_theta)
  layers, unembed = [layer(l) for l in range(cfg.num_layers)], unembed.astype(dt)
  if out_major:
    # XLA folds a transpose feeding a dot back into the dot's dimension numbers,
    # which would undo the copies; the barrier keeps them materialised.
    layers, unembed = jax.lax.optimization_barrier((layers, unembed))
  return DecodeWeights(
    embed_VD=params["embed"],
    final_norm_D=params["final_norm"],
    layers=layers,
    unembed=unembed,
    rope_Sh=(cos[0], sin[0]),
    out_major=out_major,
  )


def _proj(w: DecodeWeights, x: jax.Array, kernel: jax.Array) -> jax.Array:
  """``x @ kernel`` for x [W, in] and a kernel [in, out], stored [out, in] when ``w.out_major``."""
  contract = (1,) if w.out_major else (0,)
  return jax.lax.dot_general(x, kernel, (((1,), contract), ((), ())))


def attend_full(
  q_WKRH: jax.Array, k_WKHS: jax.Array, v_WKSH: jax.Array, mask_WS: jax.Array
) -> jax.Array:
  """One query token per slot against every column; scores and softmax in float32."""
  H = q_WKRH.shape[-1]
  scores_WKRS = jnp.einsum(
    "wkrh,wkhs->wkrs", q_WKRH, k_WKHS, preferred_element_type=jnp.float32
  ) * (H**-0.5)
  scores_WKRS = jnp.where(mask_WS[:, None, None], scores_WKRS, _NEG)
  probs = jax.nn.softmax(scores_WKRS, axis=-1).astype(v_WKSH.dtype)
  return jnp.einsum("wkrs,wksh->wkrh", probs, v_WKSH)


def attend_blocks(
  q_WKRH: jax.Array,
  k_WKHS: jax.Array,
  v_WKSH: jax.Array,
  mask_WS: jax.Array,
  num_blocks: jax.Array,
  block: int,
) -> jax.Array:
  """``attend_full`` over the first ``num_blocks`` blocks of ``block`` columns only.

  Online softmax (running max, normaliser and weighted sum in float32). A
  leading all-padding block is wiped out exactly when the first real score
  arrives (its rescale is exp(min - real) = 0), a trailing all-masked one is
  an exact no-op, so the result is the softmax over the slot's real columns
  whatever ``num_blocks`` (>= the slot's filled blocks) is.
  """
  W, K, R, H = q_WKRH.shape

  def body(
    b: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    m_WKR, l_WKR, acc_WKRH = carry
    s0 = b * block
    k_blk = jax.lax.dynamic_slice_in_dim(k_WKHS, s0, block, axis=3)
    v_blk = jax.lax.dynamic_slice_in_dim(v_WKSH, s0, block, axis=2)
    mask_blk = jax.lax.dynamic_slice_in_dim(mask_WS, s0, block, axis=1)
    s_WKRS = jnp.einsum("wkrh,wkhs->wkrs", q_WKRH, k_blk, preferred_element_type=jnp.float32) * (
      H**-0.5
    )
    s_WKRS = jnp.where(mask_blk[:, None, None], s_WKRS, _NEG)
    m_new = jnp.maximum(m_WKR, s_WKRS.max(-1))
    rescale = jnp.exp(m_WKR - m_new)
    p_WKRS = jnp.exp(s_WKRS - m_new[..., None])
    acc_WKRH = acc_WKRH * rescale[..., None] + jnp.einsum(
      "wkrs,wksh->wkrh", p_WKRS.astype(v_WKSH.dtype), v_blk, preferred_element_type=jnp.float32
    )
    return m_new, l_WKR * rescale + p_WKRS.sum(-1), acc_WKRH

  init = (
    jnp.full((W, K, R), _NEG, jnp.float32),
    jnp.zeros((W, K, R), jnp.float32),
    jnp.zeros((W, K, R, H), jnp.float32),
  )
  _, l_WKR, acc_WKRH = jax.lax.fori_loop(0, num_blocks, body, init)
  return (acc_WKRH / l_WKR[..., None]).astype(v_WKSH.dtype)


def resolve(attention: str, layout: Layout | None = None) -> str:
  """The attention ``auto`` stands for: ragged on TPU (the layout's devices' platform
  when given, so an ahead-of-time TPU compile from a CPU host gets it), else blocks."""
  if attention not in ATTENTION:
    raise ValueError(f"decode attention {attention!r} is not one of {ATTENTION}")
  if attention != "auto":
    return attention
  return "ragged" if ragged.platform(layout) == "tpu" else "blocks"


@dataclasses.dataclass(frozen=True)
class Where:
  """Per slot: the column its token is written at and that token's RoPE position;
  ``num_blocks``: the blocks of ``block`` columns that hold any active slot's tokens
  (blocks only; ignored when the cache is one block or less: then attention reads it
  all). ``start_W``: the slot's first real column (ragged only, which reads through
  the kernel whatever the cache's size; an idle slot gives col_W + 1, nothing to
  read). ``attention``: "blocks" or "ragged" (``resolve``); ``align``: where the
  ragged kernel lays a slot's first block (``ragged.attend``); ``layout``: the
  cache's, which the ragged kernel's ``shard_map`` follows."""

  col_W: jax.Array
  pos_W: jax.Array
  num_blocks: jax.Array
  block: int
  start_W: jax.Array | None = None
  attention: str = "blocks"
  layout: Layout | None = None
  align: int = ragged.ALIGN


def step(
  w: DecodeWeights, cfg: Qwen2Config, tokens_W: jax.Array, cache: SlotCache, where: Where
) -> tuple[jax.Array, SlotCache]:
  """Float32 logits [V, W] of the next token after ``tokens_W``, and the updated cache.

  ``qwen2.forward_with_cache`` for T = 1 (same positions, masking and
  numerics up to the blocked softmax), with the weights of ``prepare``.
  """
  W, S = cache.mask_WS.shape
  slot_W = jnp.arange(W)
  mask_WS = cache.mask_WS.at[slot_W, where.col_W].set(True)
  cos_S, sin_S = w.rope_Sh
  rope_W1 = (cos_S[where.pos_W][:, None], sin_S[where.pos_W][:, None])
  x_WD = w.embed_VD.astype(cfg.dtype)[tokens_W]
  ks, vs = list(cache.k), list(cache.v)
  blocked = S > where.block
  if where.attention not in ("blocks", "ragged"):
    raise ValueError(f"decode.step: attention {where.attention!r} is not 'blocks' or 'ragged'")
  if where.attention == "ragged" and where.start_W is None:
    raise ValueError("decode.step: ragged attention needs Where.start_W")
  rows_split = _attention_rows_split()
  for l, p in enumerate(w.layers):
    # Each slot writes its token's key / value at its own column, in place.
    q_WKRH, k_WKH, v_WKH = _attention_inputs(w, cfg, p, x_WD, rope_W1)
    # Attention runs on the cache's split: rows over "attn_batch" (a sampling mesh's
    # tensor_q chips each take 1 / tensor_q of their group's rows), kv heads over
    # tensor. The projections came out rows-whole in the group: this is a local slice.
    q_WKRH = sharding.constrain(q_WKRH, ("attn_batch", "act_kv_heads", None, None))
    k_WKH, v_WKH = (
      sharding.constrain(x, ("attn_batch", "act_kv_heads", None)) for x in (k_WKH, v_WKH)
    )
    if where.attention == "ragged":
      ks[l] = ks[l].at[slot_W, where.col_W].set(k_WKH.reshape(W, -1))
      vs[l] = vs[l].at[slot_W, where.col_W].set(v_WKH.reshape(W, -1))
    else:
      ks[l] = ks[l].at[slot_W, :, :, where.col_W].set(k_WKH)
      vs[l] = vs[l].at[slot_W, :, where.col_W, :].set(v_WKH)
    if where.attention == "ragged":
      assert where.start_W is not None
      out_WKRH = ragged.attend(
        q_WKRH,
        ks[l],
        vs[l],
        where.start_W,
        where.col_W + 1,
        block=where.block,
        align=where.align,
        layout=where.layout,
      )
    elif blocked:
      out_WKRH = attend_blocks(q_WKRH, ks[l], vs[l], mask_WS, where.num_blocks, where.block)
    else:
      out_WKRH = attend_full(q_WKRH, ks[l], vs[l], mask_WS)
    if rows_split:
      # Back to the group's rows (an all-gather over tensor_q only), heads still over
      # tensor, and the residual rows-whole in the group: left to XLA, it kept the
      # residual split by attention rows and gathered every row on every chip for the
      # MLP (1.5B on v4-32, a group of 8: 379 GB sent a decode, 242 pinned).
      out_WKRH = sharding.constrain(out_WKRH, ("batch", "act_kv_heads", None, None))
    x_WD = _attention_output(w, cfg, p, x_WD, out_WKRH.reshape(W, -1))
    if rows_split:
      x_WD = sharding.constrain(x_WD, ("batch", "act_embed"))
  h_WD = decoder.rms_norm(x_WD, w.final_norm_D, cfg.rms_norm_eps).astype(cfg.dtype)
  if w.out_major:
    # The barrier stops XLA from turning the transpose into a [V, D] x [W, D]
    # dot, the row-count-dependent form again.
    logits_VW = jax.lax.optimization_barrier(
      jnp.einsum("wd,vd->wv", h_WD, w.unembed, preferred_element_type=jnp.float32)
    ).T
  else:
    logits_VW = jnp.einsum("dv,wd->vw", w.unembed, h_WD, preferred_element_type=jnp.float32)
  return logits_VW, SlotCache(tuple(ks), tuple(vs), mask_WS)


def _attention_rows_split() -> bool:
  """Whether the traced program's layout splits the attention's rows over more chips than
  the other activations' (a sampling group past the kv heads: ``mesh.tensor_split``)."""
  layout = sharding.active_layout()
  return layout is not None and layout.shards("attn_batch") > layout.shards("batch")


def _attention_inputs(
  w: DecodeWeights,
  cfg: Qwen2Config,
  p: Params,
  x_WD: jax.Array,
  rope_W1: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``decoder.DecoderLayer.attention_inputs`` for one token per slot, on 2-D kernels.

  q as [W, K, R, H] (R query heads per kv head), k / v as [W, K, H].
  """
  W, dt = x_WD.shape[0], cfg.dtype
  K, H = cfg.num_kv_heads, cfg.head_dim
  h_WD = decoder.rms_norm(x_WD, p["attn_norm"], cfg.rms_norm_eps)
  q, k, v = (
    _proj(w, h_WD, p[n]).reshape(W, 1, -1, H) for n in ("q_kernel", "k_kernel", "v_kernel")
  )
  if cfg.qkv_bias:
    q, k, v = q + p["q_bias"].astype(dt), k + p["k_bias"].astype(dt), v + p["v_bias"].astype(dt)
  if cfg.qk_norm:
    q = decoder.rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = decoder.rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
  q, k = decoder.apply_rope(q, *rope_W1), decoder.apply_rope(k, *rope_W1)
  return q.reshape(W, K, -1, H), k[:, 0], v[:, 0]


def _attention_output(
  w: DecodeWeights, cfg: Qwen2Config, p: Params, x_WD: jax.Array, attn: jax.Array
) -> jax.Array:
  """``decoder.DecoderLayer.attention_output`` for one token per slot, on 2-D kernels."""
  x_WD = x_WD + _proj(w, attn, p["o_kernel"])
  h_WD = decoder.rms_norm(x_WD, p["mlp_norm"], cfg.rms_norm_eps)
  act_WF = jax.nn.silu(_proj(w, h_WD, p["gate_kernel"])) * _proj(w, h_WD, p["up_kernel"])
  return x_WD + _proj(w, act_WF, p["down_kernel"])
