"""The cued task: arithmetic questions whose prompt shows a cue, right or a decoy.

A question is 2-3 single-digit operands joined by ``+ - *`` (normal precedence),
then ``=?`` and a cue, an answer the prompt suggests: ``3+4*2=?11``. The
completion is the bare answer, then the stop token; no ``\\boxed{}``, so the
confidence score s (mean token log-prob) is an average over the answer's own
1-3 tokens and the stop token, not diluted by fixed boilerplate tokens. The
checker ``is_correct`` (a ``reward.correct`` plug-in) is an exact integer match.

A cue is *right* (the answer) or a *decoy*: the left-to-right value (``3+4*2``
read as ``(3+4)*2 = 14``) whenever it differs from the answer, which happens
only for ``a+b*c`` and ``a-b*c``; otherwise the answer plus or minus 1-3. A
decoy is thus always wrong, and a fluent near miss.

Three disjoint sets of questions, each drawn once from a seeded permutation of
every distinct expression:

- SFT (``sft_examples``): ``num_sft`` questions, each shown with ``sft_cues``
  independent cues; a cue is right with probability ``sft_cue_right``, else a
  decoy or another SFT question's answer, half and half. The target is always the
  answer. Why the mix: with the cue right only a quarter of the time the warm
  start learns to compute and to lean on the cue a little, not to copy it; the
  decoys make a cue near the answer no proof of it, and the other questions'
  answers keep the cue's value from carrying the answer's size or sign. Before
  them come ``sft_val`` validation questions with one cue each, the questions the
  warm start's early stop scores (``SFTConfig.eval_questions`` must equal it,
  so no validation question is trained on under another cue).
- RL prompts (``make_splits``' first list): ``num_rl`` questions, the cue right on
  exactly ``1 - rl_traps`` of them and a decoy on the rest (traps): RL is
  rewarded for trusting the cue most of the time, and GRPO learns to.
- Held-out (``make_splits``' second list): ``num_heldout`` questions, exactly
  ``heldout_traps`` of them traps (half by default), so trap metrics rest on as
  many questions as the cued ones.

``Example.meta`` carries ``cue``, ``trap`` (the cue is a decoy), ``cue_kind``
("right", "ltr", "near" or "other"), ``ltr`` (the left-to-right value), the
operands and operators, ``solution`` (the target text) and ``checker`` (the
checker's plug-in name: ``tasks.grader`` grades such examples with ``Grader``, the
checker run in process).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from capo_jax.data import rewards
from capo_jax.data.datasets import Example
from capo_jax.demo.char_tokenizer import PIECES, CharTokenizer
from capo_jax.demo.task import format_expression, solve_steps
from capo_jax.eval import traps

CHECKER = "capo_jax.demo.cued:is_correct"  # the run file's reward.correct
PIECES_CUED: tuple[str, ...] = (*PIECES, "?")  # appended: the arithmetic task's ids stay
CUE_KINDS = ("right", "ltr", "near", "other")
_INT_RE = re.compile(r"-?\d+")


@dataclasses.dataclass(frozen=True)
class CuedConfig:
  """Sizes and cue rates of the cued task (the module docstring says what each set is).

  Attributes:
    min_operands / max_operands / max_operand / operators: the expressions, as in
      ``task.TaskConfig``.
    num_sft / sft_cues / sft_cue_right / sft_val: SFT questions, cues per question,
      the chance a cue is right, validation questions (one cue each, listed first).
    num_rl / rl_traps: RL prompt questions and the share of them that are traps.
    num_heldout / heldout_traps: held-out questions and their share of traps.
    seed: the generation seed.
    kind: "cued", what tells this config from ``task.TaskConfig`` in a run file and
      in the warm start's cache key.
  """

  min_operands: int = 2
  max_operands: int = 3
  max_operand: int = 9
  operators: str = "+-*"
  num_sft: int = 4000
  sft_cues: int = 5
  sft_cue_right: float = 0.25
  sft_val: int = 128
  num_rl: int = 4000
  rl_traps: float = 0.2
  num_heldout: int = 256
  heldout_traps: float = 0.5
  seed: int = 0
  kind: str = "cued"

  def __post_init__(self) -> None:
    if self.kind != "cued":
      raise ValueError(f"CuedConfig.kind={self.kind!r}: expected 'cued'")
    if self.min_operands < 2 or self.max_operands < self.min_operands:
      raise ValueError(
        f"CuedConfig: need 2 <= min_operands <= max_operands, got "
        f"{self.min_operands}, {self.max_operands}"
      )
    if self.max_operand < 1 or not self.operators or set(self.operators) - set("+-*"):
      raise ValueError(
        f"CuedConfig: max_operand={self.max_operand} must be >= 1 and "
        f"operators={self.operators!r} distinct characters of '+-*'"
      )
    for name in ("sft_cue_right", "rl_traps", "heldout_traps"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"CuedConfig.{name}={getattr(self, name)} must be in [0, 1]")
    for name in ("num_sft", "sft_val", "num_rl", "num_heldout"):
      if getattr(self, name) < 0:
        raise ValueError(f"CuedConfig.{name}={getattr(self, name)} must be >= 0")
    if self.sft_cues < 1:
      raise ValueError(f"CuedConfig.sft_cues={self.sft_cues} must be >= 1")
    need = self.num_sft + self.sft_val + self.num_rl + self.num_heldout
    if need > len(all_expressions(self)):
      raise ValueError(
        f"CuedConfig: {need} questions requested but only {len(all_expressions(self))} "
        "distinct expressions exist (fewer questions, or more operands)"
      )


def all_expressions(cfg: CuedConfig) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
  """Every distinct (operands, operators) of the config, in a fixed order."""
  digits, out = range(cfg.max_operand + 1), []
  for n in range(cfg.min_operands, cfg.max_operands + 1):
    for ops in itertools.product(cfg.operators, repeat=n - 1):
      out += [(vals, ops) for vals in itertools.product(digits, repeat=n)]
  return out


@functools.lru_cache(maxsize=1 << 16)  # every split asks again for the same questions
def value(operands: tuple[int, ...], ops: tuple[str, ...], rule: str = "") -> int:
  """The expression's value under normal precedence, or ``rule="left_to_right"``."""
  return int(solve_steps(list(operands), list(ops), rule)[-1])


def decoy(answer: int, ltr: int, rng: np.random.Generator) -> tuple[int, str]:
  """(decoy, kind): the left-to-right value when it differs, else answer +- 1..3."""
  if ltr != answer:
    return ltr, "ltr"
  return answer + int(rng.choice([-1, 1])) * int(rng.integers(1, 4)), "near"


def make_example(
  operands: tuple[int, ...], ops: tuple[str, ...], cue: int, kind: str, ex_id: str
) -> Example:
  """One question shown with ``cue`` (of ``kind``, one of ``CUE_KINDS``)."""
  if kind not in CUE_KINDS:
    raise ValueError(f"make_example: cue kind {kind!r}, expected one of {CUE_KINDS}")
  answer = value(operands, ops)
  if (cue == answer) != (kind == "right"):
    raise ValueError(f"make_example: cue {cue} of kind {kind!r} but the answer is {answer}")
  return Example(
    id=ex_id,
    problem=f"{format_expression(list(operands), list(ops))}=?{cue}",
    answer=str(answer),
    meta={
      "operands": list(operands),
      "ops": list(ops),
      "cue": str(cue),
      "trap": kind != "right",
      "cue_kind": kind,
      "ltr": value(operands, ops, "left_to_right"),
      "solution": str(answer),
      "checker": CHECKER,
    },
  )


def _questions(cfg: CuedConfig) -> dict[str, list[tuple[tuple[int, ...], tuple[str, ...]]]]:
  """The disjoint question sets: held-out first, then SFT validation, SFT, RL."""
  exprs = all_expressions(cfg)
  order = np.random.default_rng([cfg.seed, 0]).permutation(len(exprs))
  out, start = {}, 0
  for name, n in (
    ("heldout", cfg.num_heldout),
    ("sft_val", cfg.sft_val),
    ("sft", cfg.num_sft),
    ("rl", cfg.num_rl),
  ):
    out[name] = [exprs[i] for i in order[start : start + n]]
    start += n
  return out


def _with_traps(
  questions: list[tuple[tuple[int, ...], tuple[str, ...]]],
  share: float,
  rng: np.random.Generator,
  prefix: str,
) -> list[Example]:
  """Each question once, exactly ``round(share * n)`` of them traps (a seeded choice)."""
  trap = np.zeros(len(questions), bool)
  trap[rng.permutation(len(questions))[: round(share * len(questions))]] = True
  out = []
  for i, (vals, ops) in enumerate(questions):
    answer = value(vals, ops)
    cue, kind = (
      decoy(answer, value(vals, ops, "left_to_right"), rng) if trap[i] else (answer, "right")
    )
    out.append(make_example(vals, ops, cue, kind, f"{prefix}-{i}"))
  return out


def make_splits(cfg: CuedConfig) -> tuple[list[Example], list[Example]]:
  """(RL prompts, held-out questions), deterministic in the seed."""
  q = _questions(cfg)
  rl = _with_traps(q["rl"], cfg.rl_traps, np.random.default_rng([cfg.seed, 2]), "rl")
  heldout = _with_traps(
    q["heldout"], cfg.heldout_traps, np.random.default_rng([cfg.seed, 1]), "heldout"
  )
  return rl, heldout


def sft_examples(cfg: CuedConfig) -> list[Example]:
  """The warm start's data: ``sft_val`` validation questions (one cue each), then
  ``num_sft`` questions x ``sft_cues`` cues, one question's cues together."""
  q = _questions(cfg)
  rng = np.random.default_rng([cfg.seed, 3])
  answers = [value(v, o) for v, o in q["sft"]] or [0]
  out = []
  for split, cues in (("sft_val", 1), ("sft", cfg.sft_cues)):
    for i, (vals, ops) in enumerate(q[split]):
      answer = value(vals, ops)
      for k in range(cues):
        if rng.random() < cfg.sft_cue_right:
          cue, kind = answer, "right"
        elif rng.random() < 0.5:
          cue, kind = decoy(answer, value(vals, ops, "left_to_right"), rng)
        else:  # another question's answer, redrawn while it is this one's
          cue, kind = answer, "other"
          for _ in range(100):
            cue = answers[int(rng.integers(len(answers)))]
            if cue != answer:
              break
          else:
            cue, kind = decoy(answer, answer, rng)
        out.append(make_example(vals, ops, cue, kind, f"{split}-{i}-{k}"))
  return out


def is_correct(completion: str, gold: str) -> bool:
  """The checker: the completion is an integer (nothing else around it) equal to gold."""
  return bool(_INT_RE.fullmatch(completion)) and int(completion) == int(gold)


class Grader:
  """``is_correct`` with the graders' interface, ``score(completions, golds) -> (0/1
  float32 rewards, RewardHealth)``, run in this process: an exact integer match cannot
  hang, so the plug-in pool's deadline buys nothing, while its per-call round trips and
  worker restarts (every ``reward.worker_max_calls`` calls) cost more than the sampling
  of a held-out evaluation's 8k short answers."""

  def __init__(self) -> None:
    self.cumulative = rewards.RewardHealth()

  def score(
    self, completions: Sequence[str], golds: Sequence[str]
  ) -> tuple[np.ndarray, rewards.RewardHealth]:
    if len(completions) != len(golds):
      raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
    out = np.array([is_correct(c, g) for c, g in zip(completions, golds)], np.float32)
    health = rewards.RewardHealth(total=len(out), correct=int(out.sum()))
    self.cumulative = self.cumulative + health
    return out, health


def answer_of(completion: str) -> str:
  """The integer a completion answers, as text ("" when it is not one integer)."""
  return str(int(completion)) if _INT_RE.fullmatch(completion) else ""


def tokenizer() -> CharTokenizer:
  """The arithmetic task's tokenizer with ``?`` appended (its other ids unchanged)."""
  return CharTokenizer(PIECES_CUED)


def trap_metrics(
  examples: list[Example], answers_QG: Any, s_QG: Any, correct_QG: Any
) -> dict[str, float]:
  """``capo_jax.eval.traps.TRAP_KEYS`` of held-out samples: a sample copies the
  decoy when its answer (``answer_of``) is the trap's cue."""
  cue_Q = np.array([ex.meta["cue"] for ex in examples], dtype=str)
  trap_Q = np.array([ex.meta["trap"] for ex in examples], bool)
  copy_QG = np.asarray(answers_QG, dtype=str) == cue_Q[:, None]
  m = traps.heldout_metrics(s_QG, correct_QG, copy_QG, trap_Q)
  return {k: m[k] for k in traps.TRAP_KEYS}
