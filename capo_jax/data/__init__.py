"""Questions in, rewards out: datasets and splits, the chat tokenizer, math answer grading."""

from capo_jax.data.answers import extract_answer
from capo_jax.data.datasets import load_examples, resolve
from capo_jax.data.order import PromptIterator, split_train_val
from capo_jax.data.rewards import Grader, default_grader, is_correct, score
from capo_jax.data.rows import DataError, Example
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
