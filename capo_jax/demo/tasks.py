"""The demo's two tasks behind one interface: the arithmetic task (``task.py``, boxed
answers) and the cued task (``cued.py``, bare answers after a cue).

A run file's ``demo.task`` picks one: ``kind="cued"`` the cued task, no ``kind`` the
arithmetic one. The warm start (``warm_start.py``) and the demo's runs (``run.py``)
ask here for the config, the tokenizer, the SFT data, the RL and held-out splits,
the grader and how to read a completion's answer.
"""

from __future__ import annotations

from typing import Any, Union

from capo_jax.data import rewards
from capo_jax.data.datasets import Example
from capo_jax.demo import cued
from capo_jax.demo import task as task_lib
from capo_jax.demo.char_tokenizer import CharTokenizer

AnyTask = Union[task_lib.TaskConfig, cued.CuedConfig]


def config_of(d: dict[str, Any]) -> AnyTask:
  """The task config of a run file's ``demo.task`` fields."""
  d = dict(d)
  if d.get("kind") == "cued":
    return cued.CuedConfig(**d)
  if "kind" in d:
    raise ValueError(f"config.demo.task.kind={d['kind']!r}: expected 'cued' or no kind")
  return task_lib.TaskConfig(**d)


def tokenizer(cfg: AnyTask) -> CharTokenizer:
  return cued.tokenizer() if isinstance(cfg, cued.CuedConfig) else CharTokenizer()


def splits(cfg: AnyTask) -> tuple[list[Example], list[Example]]:
  """(RL training questions, held-out questions)."""
  if isinstance(cfg, cued.CuedConfig):
    return cued.make_splits(cfg)
  return task_lib.make_splits(cfg)


def sft_examples(cfg: AnyTask) -> list[Example]:
  """The warm start's supervised data (its first questions are its validation set)."""
  if isinstance(cfg, cued.CuedConfig):
    return cued.sft_examples(cfg)
  return task_lib.make_splits(cfg)[0]


def is_cued(examples: list[Example]) -> bool:
  return bool(examples) and "cue" in examples[0].meta


def grader(examples: list[Example]) -> cued.Grader | None:
  """The grader of these examples: the cued checker in process (``cued.Grader``) for
  cued questions; None otherwise, which leaves the boxed answers to the math grader
  (the evaluator's and the trainer's default)."""
  return cued.Grader() if is_cued(examples) else None


def answers(examples: list[Example], completions: list[str]) -> list[str]:
  """Each completion's answer text ("" for none): the bare integer on the cued task,
  the last ``\\boxed{}`` otherwise."""
  if is_cued(examples):
    return [cued.answer_of(c) for c in completions]
  return [rewards.extract_boxed(c) or "" for c in completions]
