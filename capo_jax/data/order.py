"""Which questions, in which order: the fixed-seed train/validation split and the resumable
prompt iterator that walks the training set in shuffled epochs."""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Iterator, Sequence

import numpy as np

from capo_jax.data.rows import DataError, Example

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Split:
  """A training set and the held-out validation set drawn from the same file."""

  train: list[Example]
  val: list[Example]

  def ids(self) -> dict[str, list[str]]:
    return {"train_ids": [e.id for e in self.train], "val_ids": [e.id for e in self.val]}


def split_train_val(
  examples: Sequence[Example],
  train_size: int,
  val_size: int,
  seed: int,
  source: str = "the training data",
) -> Split:
  """A fixed-seed split: ``val_size`` held-out questions, then ``train_size`` for training.

  The paper trains on 20,000 DeepScaleR problems and validates on 240 others.
  One permutation of (seed) orders the file; the first ``val_size`` are the
  validation set and the next ``train_size`` (0: all the rest) the training
  set, so the two never overlap. Ids must be unique (they name the split).
  """
  if train_size < 0 or val_size < 0:
    raise ValueError(f"train_size ({train_size}) and val_size ({val_size}) must be >= 0")
  counts = collections.Counter(e.id for e in examples)
  dup = next((i for i, n in counts.items() if n > 1), None)
  if dup is not None:
    raise DataError(
      f"{source}: question id {dup!r} appears more than once; the split needs unique ids"
    )
  if val_size >= len(examples):
    raise DataError(
      f"{source}: {len(examples)} questions, not enough for a validation set "
      f"of {val_size} plus training questions (config.data.val_size)"
    )
  order = np.random.default_rng(seed).permutation(len(examples))
  val = [examples[i] for i in order[:val_size]]
  rest = order[val_size:]
  if train_size and train_size > len(rest):
    log.warning(
      "%s: %d questions left after the %d held out, fewer than "
      "config.data.train_size=%d; training on all of them",
      source,
      len(rest),
      val_size,
      train_size,
    )
  train = [examples[i] for i in (rest[:train_size] if train_size else rest)]
  return Split(train=train, val=val)


class PromptIterator:
  """Endless batches over shuffled epochs; its state restores the stream exactly.

  The stream is the concatenation of per-epoch permutations, each drawn from (seed, epoch),
  so a batch may span two epochs and every example is seen once per epoch. With several
  processes, all advance through the same global batch of `batch_size` and each returns only
  its contiguous share [process_index * b, (process_index + 1) * b), b = batch_size /
  process_count.
  """

  def __init__(
    self,
    examples: Sequence[Example],
    batch_size: int,
    seed: int,
    *,
    process_index: int = 0,
    process_count: int = 1,
  ) -> None:
    if not examples:
      raise ValueError("PromptIterator needs at least one example")
    if batch_size < 1 or process_count < 1 or batch_size % process_count:
      raise ValueError(
        f"batch_size {batch_size} must be a positive multiple of process_count {process_count}"
      )
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    self.examples = list(examples)
    self.batch_size = batch_size
    self.process_index = process_index
    self.process_count = process_count
    self.seed = int(seed)
    self.epoch = 0
    self.position = 0
    self._perm: tuple[int, np.ndarray] | None = None

  def _order(self, epoch: int) -> np.ndarray:
    if self._perm is None or self._perm[0] != epoch:
      rng = np.random.default_rng([self.seed, epoch])
      self._perm = (epoch, rng.permutation(len(self.examples)))
    return self._perm[1]

  def next_global_indices(self) -> list[int]:
    """Advances one global batch; returns all its example indices (every process's share)."""
    out: list[int] = []
    while len(out) < self.batch_size:
      order = self._order(self.epoch)
      take = min(self.batch_size - len(out), len(order) - self.position)
      out.extend(int(i) for i in order[self.position : self.position + take])
      self.position += take
      if self.position == len(order):
        self.epoch, self.position = self.epoch + 1, 0
    return out

  def next_batch(self) -> list[Example]:
    """This process's share of the next global batch."""
    share = self.batch_size // self.process_count
    idx = self.next_global_indices()[self.process_index * share : (self.process_index + 1) * share]
    return [self.examples[i] for i in idx]

  def __iter__(self) -> Iterator[list[Example]]:
    while True:
      yield self.next_batch()

  def state(self) -> dict[str, int]:
    """JSON-friendly state for checkpoints."""
    return {
      "epoch": self.epoch,
      "position": self.position,
      "seed": self.seed,
      "num_examples": len(self.examples),
    }

  def restore(self, state: dict[str, Any]) -> None:
    """Continues exactly where `state()` was taken (same dataset required)."""
    n = int(state.get("num_examples", len(self.examples)))
    if n != len(self.examples):
      raise ValueError(f"iterator state is for {n} examples, this dataset has {len(self.examples)}")
    epoch, position = int(state["epoch"]), int(state["position"])
    if epoch < 0 or not 0 <= position < n:
      raise ValueError(f"bad iterator state: epoch {epoch}, position {position} (n={n})")
    self.seed, self.epoch, self.position = int(state["seed"]), epoch, position
    self._perm = None
