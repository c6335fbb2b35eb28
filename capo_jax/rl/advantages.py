"""Advantage estimators: CAPO (the method) and the paper's baselines.

Every estimator is written for one group (one question's G samples, [G] -> [G])
and lifted over questions with `jax.vmap`; the public functions take and return
[Q, G] arrays. Equations: ``docs/algorithms.md``, "Advantages" and "Noise mask".
``capo_jax.rl.algorithms`` wraps each in a typed estimator (``Capo(tau=0.6)``) and
names the algorithms.

Two masks (design). A row of a group can be
  * valid: it exists and takes part in the group: it is a pair partner for
    CAPO and counts in the group mean / std of GRPO-style estimators.
    Padding rows, and noise-masked rows in "drop" mode, are not valid.
  * receiving: it gets a (possibly) non-zero advantage. Receiving rows are a
    subset of valid rows. A noise-masked row in the default "partner" mode is
    valid but not receiving: it still counts in the others' pair sums (and
    group statistics) while its own advantage is exactly 0.
`split_masks` turns (validity, noise mask, mode) into these two masks; every
estimator takes `valid_QG` and an optional `receive_QG` (default: valid).

A group whose estimator input is equal on every valid row ("degenerate") gets
exactly 0, and so does every non-receiving row. For binary rewards that is a group
all correct or all wrong; CDE's input is its shaped reward, so its all-correct
groups stay live while the perplexity bonus differs between samples. A group with
one valid row is degenerate. Inputs on invalid rows are replaced by 0 before any
arithmetic, so NaN / inf there (an empty completion's mean log-prob, say) never
leaks into the others.

GRPO's normalisation (GRPO, GSPO, SimKO, CoDaPO, CDE) divides by the unbiased std of
the group's valid rows by default (ddof = 1, as verl and TRL do); ``std="population"``
divides by the population std (ddof = 0, the earlier default).

Rewards are binary {0, 1} (correct: above 1/2), unless ``GroupBatch.correct_QG`` holds the
labels: then rewards are any scalar (docs/rewards.md) and CAPO's pairs read the labels.
The score ``s_QG`` is each response's mean token log-prob under the old policy
(``logprobs.mean_logprob``); CAPO may convert it first (``to_score``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from capo_jax.masked import masked_mean
from capo_jax.types import Array

GRPO_EPS = 1e-6
NORMS = ("group", "pairs", "none")
SCORES = ("mean_logprob", "neg_ppl")
MASK_MODES = ("partner", "drop")
STDS = ("unbiased", "population")  # GRPO's std: ddof 1 (verl, TRL) or ddof 0


@dataclasses.dataclass(frozen=True)
class GroupBatch:
  """One step's groups, [Q, G] arrays: what every estimator reads.

  Attributes:
    rewards_QG: rewards: binary, or any finite scalar when ``correct_QG`` is given.
    s_QG: the score s of each response: its mean token log-prob under the old
      policy. CAPO converts it with its ``score`` field; CoDaPO and CDE use s
      itself, as their papers do.
    valid_QG: rows that exist and act as partners (see ``split_masks``).
    receive_QG: rows allowed a non-zero advantage (None: the valid ones).
    correct_QG: binary labels (CAPO's pairs, CoDaPO's accuracy); None: the rewards are.
  """

  rewards_QG: Array
  s_QG: Array
  valid_QG: Array
  receive_QG: Array | None = None
  correct_QG: Array | None = None

  def __post_init__(self) -> None:
    """One [Q, G] shape; concrete inputs (not traced) also need binary labels and finite
    rewards on the valid rows."""
    arrays = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    shapes = {k: np.shape(a) for k, a in arrays.items() if a is not None}
    if len(set(shapes.values())) != 1 or len(shapes["rewards_QG"]) != 2:
      raise ValueError(f"GroupBatch: inputs must all have one shape [Q, G]; got {shapes}")
    r = self.labels_QG
    label = "rewards_QG" if self.correct_QG is None else "correct_QG"
    if any(isinstance(a, jax.core.Tracer) for a in (r, self.valid_QG, self.rewards_QG)):
      return
    v = np.asarray(self.valid_QG).astype(bool)
    for what, arr, bad in (
      (f"{label} must be 0 or 1", r, ~np.isin(np.asarray(r), (0.0, 1.0)) & v),
      ("rewards_QG must be finite", self.rewards_QG, ~np.isfinite(self.rewards_QG) & v),
    ):
      if bad.any():
        q, g = np.argwhere(bad)[0]
        raise ValueError(
          f"GroupBatch: {what}; {what.split()[0]}[{q}, {g}] = {np.asarray(arr)[q, g]}"
        )

  @property
  def labels_QG(self) -> Array:
    """The binary labels: ``correct_QG``, or the (binary) rewards themselves."""
    return self.rewards_QG if self.correct_QG is None else self.correct_QG


@dataclasses.dataclass(frozen=True)
class CdeParams:
  """CDE's fixed hyper-parameters: the bonus ``min(|r|/kappa, alpha * (-s))`` and the
  ``eps`` and ``std`` of the GRPO normalisation that follows (its weight omega is scheduled)."""

  kappa: float = 3.0
  alpha: float = 1.0
  eps: float = GRPO_EPS
  std: str = "unbiased"


# --- Per-group kernels ([G] -> [G]). ---


def _classes(r_G: Array, v_G: Array) -> tuple[Array, Array, Array]:
  """(positives, negatives, non-degenerate) of one group."""
  correct_G = r_G > 0.5
  pos_G = v_G & correct_G
  neg_G = v_G & ~correct_G
  return pos_G, neg_G, jnp.any(pos_G) & jnp.any(neg_G)


def _masked_mean_std(x_G: Array, v_G: Array, ddof: int = 0) -> tuple[Array, Array]:
  """Mean and std of x over the valid rows: sum of squares / (n - ddof); 0 when n <= ddof
  (one valid row has no spread: its group is degenerate, never a division by 0)."""
  mean = masked_mean(x_G, v_G)
  sq = jnp.where(v_G, (x_G - mean) ** 2, 0.0).sum()
  return mean, jnp.sqrt(sq / jnp.maximum(v_G.sum() - ddof, 1))


def std_ddof(std: str, where: str) -> int:
  """The ddof of GRPO's std ``std`` (``STDS``); an error naming ``where`` otherwise."""
  if std not in STDS:
    raise ValueError(f"{where}: std={std!r} is not one of {STDS}")
  return 1 if std == "unbiased" else 0


def _finish(a_G: Array, r_G: Array, v_G: Array, u_G: Array) -> Array:
  """Zeroes degenerate groups (valid inputs all equal: for binary r, all right or all
  wrong) and non-receiving rows (exact zeros, no NaN)."""
  live = jnp.where(v_G, r_G, -jnp.inf).max() > jnp.where(v_G, r_G, jnp.inf).min()
  return jnp.where(live & u_G & v_G, a_G, 0.0)


def _grpo_group(r_G: Array, v_G: Array, u_G: Array, eps: float, ddof: int) -> Array:
  r_G = jnp.where(v_G, r_G, 0.0)
  mean, std = _masked_mean_std(r_G, v_G, ddof)
  return _finish((r_G - mean) / (std + eps), r_G, v_G, u_G)


def _dr_grpo_group(r_G: Array, v_G: Array, u_G: Array) -> Array:
  r_G = jnp.where(v_G, r_G, 0.0)
  mean, _ = _masked_mean_std(r_G, v_G)
  return _finish(r_G - mean, r_G, v_G, u_G)


def _capo_group(r_G: Array, s_G: Array, v_G: Array, u_G: Array, tau: Array, norm: str) -> Array:
  pos_G, neg_G, _ = _classes(r_G, v_G)
  s_G = jnp.where(v_G, s_G, 0.0)
  # w_GG[i, j] = sigmoid((s_j - s_i) / tau): the logistic loss's slope on
  # the pair (i correct, j wrong); near 1 when the pair is misranked.
  w_GG = jax.nn.sigmoid((s_G[None, :] - s_G[:, None]) / tau)
  w_GG = jnp.where(pos_G[:, None] & neg_G[None, :], w_GG, 0.0)
  a_G = jnp.where(pos_G, w_GG.sum(axis=1), 0.0) - jnp.where(neg_G, w_GG.sum(axis=0), 0.0)
  denom: Array | int
  if norm == "group":
    denom = jnp.maximum(v_G.sum(), 1)
  elif norm == "pairs":
    denom = jnp.maximum(pos_G.sum() * neg_G.sum(), 1)
  else:
    denom = 1
  return _finish(a_G / (denom * tau), r_G, v_G, u_G)


def _codapo_group(
  r_G: Array, c_G: Array, s_G: Array, v_G: Array, u_G: Array, eps: float, ddof: int
) -> Array:
  r_G = jnp.where(v_G, r_G, 0.0)
  acc, _ = _masked_mean_std(jnp.where(v_G, c_G, 0.0), v_G)
  mean_s, _ = _masked_mean_std(s_G, v_G)
  d = 1.0 - acc
  w = 1.0 - 4.0 * (d - 0.5) ** 2
  c = jnp.exp(mean_s)
  return _grpo_group(r_G, v_G, u_G, eps, ddof) * (c * w + 0.1)


def _cde_group(
  r_G: Array, c_G: Array, s_G: Array, v_G: Array, u_G: Array, omega: Array, p: CdeParams, ddof: int
) -> Array:
  s_G = jnp.where(v_G, s_G, 0.0)
  # {-1, +1} from the label, plus the plug-ins' shaping (reward - label) unscaled: an
  # overlong penalty of -1 on a wrong sample gives -2, not 2 * (-1) - 1 = -3.
  signed_G = jnp.where(v_G, 2.0 * c_G - 1.0 + (r_G - c_G), 0.0)
  bonus_G = jnp.minimum(jnp.abs(signed_G) / p.kappa, p.alpha * (-s_G))
  # Degenerate only when the shaped rewards are all equal (_grpo_group's _finish reads
  # them): in an all-correct group the bonus is what spreads the samples.
  return _grpo_group(signed_G + omega * bonus_G, v_G, u_G, p.eps, ddof)


# --- Public [Q, G] estimators. ---


def _float(x: Array) -> Array:
  """x as a float array; float64 inputs stay float64 (tests run the maths in x64)."""
  x = jnp.asarray(x)
  return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32)


def _receive(valid_QG: Array, receive_QG: Array | None) -> tuple[Array, Array]:
  valid_QG = jnp.asarray(valid_QG).astype(bool)
  if receive_QG is None:
    return valid_QG, valid_QG
  return valid_QG, jnp.asarray(receive_QG).astype(bool) & valid_QG


def grpo(
  rewards_QG: Array,
  valid_QG: Array,
  *,
  receive_QG: Array | None = None,
  eps: float = GRPO_EPS,
  std: str = "unbiased",
) -> Array:
  """GRPO: `(R - mean R) / (std R + eps)` per group over the valid rows; `std` is
  "unbiased" (ddof 1, verl's torch.std) or "population" (ddof 0)."""
  v, u = _receive(valid_QG, receive_QG)
  return jax.vmap(_grpo_group, in_axes=(0, 0, 0, None, None))(
    _float(rewards_QG), v, u, eps, std_ddof(std, "grpo")
  )


def dr_grpo(rewards_QG: Array, valid_QG: Array, *, receive_QG: Array | None = None) -> Array:
  """Dr.GRPO: `R - mean R` per group (no std normalisation)."""
  v, u = _receive(valid_QG, receive_QG)
  return jax.vmap(_dr_grpo_group)(_float(rewards_QG), v, u)


def capo(
  rewards_QG: Array,
  s_QG: Array,
  valid_QG: Array,
  *,
  tau: float | Array,
  norm: str = "group",
  receive_QG: Array | None = None,
) -> Array:
  """CAPO: minus the gradient of the logistic pairwise AUC surrogate.

  For correct i: `A_i = (1/(n tau)) sum_{j wrong} sigmoid((s_j - s_i)/tau)`;
  for wrong j: `A_j = -(1/(n tau)) sum_{i correct} sigmoid((s_j - s_i)/tau)`,
  sums over valid rows. `norm` picks n: "group" = number of valid rows of
  the group (G without padding), "pairs" = |P| * |N|, "none" = 1.

  Args:
    rewards_QG: binary rewards.
    s_QG: confidence scores (already converted by `to_score`).
    valid_QG: rows that exist and act as partners.
    tau: temperature (a Python float or a traced scalar, e.g. adaptive tau).
    norm: "group", "pairs" or "none".
    receive_QG: rows allowed a non-zero advantage (default: valid).

  Returns:
    adv_QG (float32, or float64 for float64 inputs).
  """
  if norm not in NORMS:
    raise ValueError(f"capo: norm={norm!r} is not one of {NORMS}")
  if isinstance(tau, (int, float)) and not tau > 0:
    raise ValueError(f"capo: tau must be > 0, got {tau}")
  v, u = _receive(valid_QG, receive_QG)
  kernel = lambda r, s, vv, uu, t: _capo_group(r, s, vv, uu, t, norm)
  return jax.vmap(kernel, in_axes=(0, 0, 0, 0, None))(
    _float(rewards_QG), _float(s_QG), v, u, jnp.asarray(tau)
  )


def codapo(
  rewards_QG: Array,
  s_QG: Array,
  valid_QG: Array,
  *,
  receive_QG: Array | None = None,
  eps: float = GRPO_EPS,
  std: str = "unbiased",
  correct_QG: Array | None = None,
) -> Array:
  """CoDaPO: GRPO advantage times `c*w + 0.1`, `w = 1 - 4(d - 1/2)^2`, `c = exp(mean s)`,
  d = 1 - the group's accuracy (of ``correct_QG``; default: the binary rewards)."""
  v, u = _receive(valid_QG, receive_QG)
  c = _float(rewards_QG if correct_QG is None else correct_QG)
  return jax.vmap(_codapo_group, in_axes=(0, 0, 0, 0, 0, None, None))(
    _float(rewards_QG), c, _float(s_QG), v, u, eps, std_ddof(std, "codapo")
  )


def cde_omega(step: int | Array, total_steps: int | Array) -> Array:
  """CDE's bonus weight: 1 for the first half of training (step < total/2), then 0."""
  return jnp.where(jnp.asarray(step) < jnp.asarray(total_steps) / 2, 1.0, 0.0)


def cde(
  rewards_QG: Array,
  s_QG: Array,
  valid_QG: Array,
  *,
  omega: float | Array,
  params: CdeParams = CdeParams(),
  receive_QG: Array | None = None,
  correct_QG: Array | None = None,
) -> Array:
  """CDE: `r = 2c - 1 + (reward - c)`, `r~ = r + omega * min(|r|/kappa, alpha * (-s))`,
  then GRPO's normalisation of r~.

  c is the binary label (``correct_QG``; default: the binary rewards), reward - c the
  reward plug-ins' shaping (0 by default). `-s` is the response's log-perplexity;
  `omega` is this step's bonus weight (`cde_omega` schedules it). A group is
  degenerate only when its r~ are all equal: an all-correct group whose bonuses differ
  keeps its advantages, the less confident samples up.
  """
  ddof = std_ddof(params.std, "cde")
  v, u = _receive(valid_QG, receive_QG)
  c = _float(rewards_QG if correct_QG is None else correct_QG)
  kernel = lambda r, cc, s, vv, uu, w: _cde_group(r, cc, s, vv, uu, w, params, ddof)
  return jax.vmap(kernel, in_axes=(0, 0, 0, 0, 0, None))(
    _float(rewards_QG), c, _float(s_QG), v, u, jnp.asarray(omega)
  )


# --- Noise mask, score scale, adaptive tau. ---


def ref_ppl(ref_s_QG: Array) -> Array:
  """Reference perplexity `exp(-mean_t log pi_ref)` from the reference's score s."""
  return jnp.exp(-_float(ref_s_QG))


def noise_mask(
  rewards_QG: Array, ref_ppl_QG: Array, *, high: float = 2.5, low: float = 1.05
) -> Array:
  """CAPO's noise mask (True = masked): lucky guesses and near misses.

  A correct sample with reference perplexity above `high`, or a wrong one
  below `low`, is masked. Combine with validity through `split_masks`.
  """
  correct_QG = jnp.asarray(rewards_QG) > 0.5
  ppl_QG = jnp.asarray(ref_ppl_QG)
  return (correct_QG & (ppl_QG > high)) | (~correct_QG & (ppl_QG < low))


def split_masks(
  valid_QG: Array, mask_QG: Array | None = None, *, mode: str = "partner"
) -> tuple[Array, Array]:
  """(valid_QG, receive_QG) for the estimators, from validity and a noise mask.

  "partner" (default): masked rows stay valid (partners) but do not receive.
  "drop": masked rows are removed from the group altogether.
  """
  if mode not in MASK_MODES:
    raise ValueError(f"split_masks: mode={mode!r} is not one of {MASK_MODES}")
  valid_QG = jnp.asarray(valid_QG).astype(bool)
  if mask_QG is None:
    return valid_QG, valid_QG
  keep_QG = valid_QG & ~jnp.asarray(mask_QG).astype(bool)
  return (valid_QG, keep_QG) if mode == "partner" else (keep_QG, keep_QG)


def masked_fraction(mask_QG: Array, rewards_QG: Array, valid_QG: Array) -> dict[str, Array]:
  """Fractions of valid samples masked: overall, among correct, among wrong (for logging)."""
  v = jnp.asarray(valid_QG).astype(bool)
  m = jnp.asarray(mask_QG).astype(bool) & v
  c = jnp.asarray(rewards_QG) > 0.5
  frac = lambda sel: (m & sel).sum() / jnp.maximum(sel.sum(), 1)
  return {
    "masked_frac": frac(v),
    "masked_frac_correct": frac(v & c),
    "masked_frac_wrong": frac(v & ~c),
  }


def to_score(s_QG: Array, score: str = "mean_logprob") -> Array:
  """The configured confidence score from the mean token log-prob s.

  "mean_logprob": s itself (= -log PPL). "neg_ppl": -PPL = -exp(-s).
  Both rank samples identically; CAPO's advantages differ.
  """
  if score not in SCORES:
    raise ValueError(f"to_score: score={score!r} is not one of {SCORES}")
  s_QG = _float(s_QG)
  return s_QG if score == "mean_logprob" else -jnp.exp(-s_QG)


def score_spread(s_QG: Array, rewards_QG: Array, valid_QG: Array) -> Array:
  """Mean over non-degenerate groups of the within-group std of the valid scores.

  What tau has to be compared with; 0 when every group is degenerate.
  """
  v_QG = jnp.asarray(valid_QG).astype(bool)
  r_QG = _float(rewards_QG)
  s_QG = _float(s_QG)
  std_Q = jax.vmap(lambda s, v: _masked_mean_std(s, v)[1])(s_QG, v_QG)
  live_Q = jax.vmap(lambda r, v: _classes(r, v)[2])(r_QG, v_QG)
  return jnp.where(live_Q, std_Q, 0.0).sum() / jnp.maximum(live_Q.sum(), 1)


def adaptive_tau_value(
  s_QG: Array, rewards_QG: Array, valid_QG: Array, *, scale: float, fallback: float
) -> Array:
  """`scale * score_spread(...)`; `fallback` when the batch has no spread (all degenerate)."""
  spread = score_spread(s_QG, rewards_QG, valid_QG)
  return jnp.where(spread > 0, scale * spread, fallback)
