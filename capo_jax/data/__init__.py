"""Questions in, rewards out: datasets and splits, the chat tokenizer, math answer grading."""

from capo_jax.data.datasets import (
  DataError,
  Example,
  PromptIterator,
  load_examples,
  resolve,
  split_train_val,
)
from capo_jax.data.rewards import Grader, default_grader, extract_answer, is_correct, score
from capo_jax.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
  "DataError",
  "Example",
  "Grader",
  "PromptIterator",
  "Tokenizer",
  "default_grader",
  "extract_answer",
  "is_correct",
  "load_examples",
  "load_tokenizer",
  "resolve",
  "score",
  "split_train_val",
]
