"""Math datasets: loading with a field mapping, a named registry, and a resumable iterator.

Local files are JSON Lines (one object per line), JSON (a list of objects, or an object holding
one) or parquet (needs pyarrow). A name from `REGISTRY` resolves to a file in the data dir
(argument `data_dir`, else $CAPO_DATA_DIR) when present there, else to its hub dataset, loaded
with the `datasets` package when installed and online. Files and data dirs may be local or on
Cloud Storage (``gs://``; see `capo_jax.runtime.fs`).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import logging
import os
from typing import Any, Iterator, Sequence

import numpy as np

from capo_jax.runtime import fs

log = logging.getLogger(__name__)

# Our field -> the source keys tried in order, unless a field map says otherwise.
DEFAULT_FIELDS: dict[str, tuple[str, ...]] = {
  "id": ("id", "unique_id", "idx"),
  "problem": ("problem", "question"),
  "answer": ("answer", "final_answer"),
}


@dataclasses.dataclass(frozen=True)
class Example:
  """One question: `meta` holds every other field of the source row (solution, level...)."""

  id: str
  problem: str
  answer: str
  meta: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """Where a named dataset lives: file names tried in the data dir, then the hub."""

  name: str
  filenames: tuple[str, ...]
  hub_id: str
  split: str
  hub_config: str | None = None
  field_map: dict[str, str] | None = None
  # The hub copy has no answer field: take the last \boxed{} of this field instead.
  answer_from: str | None = None
  # What decides `correct` on its questions (a name or target of capo_jax.data.reward_fns).
  checker: str = "math"
  # "module:function" returning the examples, when no file is in the data dir (no hub copy).
  generator: str | None = None


REGISTRY: dict[str, DatasetSpec] = {
  s.name: s
  for s in (
    DatasetSpec("math500", ("math500.jsonl",), "HuggingFaceH4/MATH-500", "test"),
    DatasetSpec("aime24", ("aime24.jsonl",), "HuggingFaceH4/aime_2024", "train"),
    DatasetSpec("aime25", ("aime25.jsonl",), "math-ai/aime25", "test"),
    DatasetSpec("amc23", ("amc23.jsonl",), "math-ai/amc23", "test"),
    DatasetSpec("minerva_math", ("minerva_math.jsonl",), "math-ai/minervamath", "test"),
    DatasetSpec(
      "olympiadbench",
      ("olympiadbench.jsonl",),
      "Hothan/OlympiadBench",
      "train",
      hub_config="OE_TO_maths_en_COMP",
    ),
    DatasetSpec(
      "deepscaler",
      ("deepscaler.jsonl", "deepscaler_sample.jsonl"),
      "agentica-org/DeepScaleR-Preview-Dataset",
      "train",
    ),
    DatasetSpec(
      "math_train",
      ("math_train.jsonl", "math_train_sample.jsonl"),
      "DigitalLearningGmbH/MATH-lighteval",
      "train",
      answer_from="solution",
    ),
    # Generated (capo_jax/data/countdown.py): answers are expressions, checked by value.
    DatasetSpec(
      "countdown",
      ("countdown.jsonl",),
      "",
      "",
      checker="countdown",
      generator="capo_jax.data.countdown:examples",
    ),
  )
}


class DataError(ValueError):
  """A bad row or file; the message names the file and line (or row)."""


@dataclasses.dataclass
class Dataset:
  """Loaded examples plus what was skipped (only with ``skip_bad=True``)."""

  source: str
  examples: list[Example]
  num_skipped: int = 0
  skipped: list[str] = dataclasses.field(default_factory=list)  # first 20 reasons

  def __len__(self) -> int:
    return len(self.examples)

  def __getitem__(self, i: int) -> Example:
    return self.examples[i]

  def __iter__(self) -> Iterator[Example]:
    return iter(self.examples)


def _data_dir(data_dir: str | os.PathLike | None) -> fs.Path | None:
  d = data_dir if data_dir is not None else os.environ.get("CAPO_DATA_DIR")
  return fs.path(d) if d else None


def resolve(
  name_or_path: str | os.PathLike, data_dir: str | os.PathLike | None = None
) -> fs.Path | DatasetSpec:
  """An existing file path, a registry name's file in the data dir, or its spec (hub)."""
  path = fs.path(name_or_path)
  if path.is_file():
    return path
  spec = REGISTRY.get(str(name_or_path))
  if spec is None:
    raise FileNotFoundError(
      f"{name_or_path!s}: no such file, and not a dataset name "
      f"(known: {', '.join(sorted(REGISTRY))})"
    )
  d = _data_dir(data_dir)
  if d is not None:
    for fname in spec.filenames:
      if (d / fname).is_file():
        return d / fname
  return spec


def _text(value: Any) -> str:
  """Source values as strings: 27.0 -> "27"; a list (OlympiadBench) -> ", "-joined."""
  if isinstance(value, bool):
    return str(value)
  if isinstance(value, float) and value.is_integer():
    return str(int(value))
  if isinstance(value, (list, tuple)):
    return ", ".join(_text(v) for v in value)
  return value.strip() if isinstance(value, str) else str(value)


def _to_example(
  row: Any,
  where: str,
  default_id: str,
  field_map: dict[str, str] | None,
  answer_from: str | None = None,
) -> Example:
  if not isinstance(row, dict):
    raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
  used, values = set(), {}
  for field, keys in DEFAULT_FIELDS.items():
    keys = (field_map[field],) if field_map and field in field_map else keys
    key = next((k for k in keys if k in row and row[k] is not None), None)
    if key is None and field == "answer" and answer_from and answer_from in row:
      from capo_jax.data.rewards import extract_boxed  # noqa: PLC0415

      key, value = answer_from, extract_boxed(_text(row[answer_from])) or ""
    elif key is None:
      if field == "id":
        values[field] = default_id
        continue
      raise DataError(f"{where}: missing field {field!r} (looked for {', '.join(keys)})")
    else:
      used.add(key)
      value = _text(row[key])
    if not value and field != "id":
      raise DataError(f"{where}: empty {field!r} (field {key!r})")
    values[field] = value or default_id
  meta = {k: v for k, v in row.items() if k not in used}
  return Example(id=values["id"], problem=values["problem"], answer=values["answer"], meta=meta)


def _read_rows(path: fs.Path) -> Iterator[tuple[str, Any]]:
  """(location, row or the exception that made it unreadable) for each row of a file."""
  suffix = path.suffix.lower()
  if suffix in (".jsonl", ".ndjson"):
    with path.open("rb") as f:
      for lineno, raw in enumerate(f, 1):
        if not raw.strip():
          continue
        where = f"{path}:{lineno}"
        try:
          yield where, json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
          yield where, DataError(f"{where}: invalid JSON ({e})")
  elif suffix == ".json":
    try:
      data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      line = getattr(e, "lineno", "?")
      raise DataError(f"{path}:{line}: invalid JSON ({e})") from e
    if isinstance(data, dict):
      lists = [v for v in data.values() if isinstance(v, list)]
      if len(lists) != 1:
        raise DataError(f"{path}: expected a list of rows, or an object holding exactly one")
      data = lists[0]
    if not isinstance(data, list):
      raise DataError(f"{path}: expected a list of rows, got {type(data).__name__}")
    for i, row in enumerate(data):
      yield f"{path}: row {i}", row
  elif suffix == ".parquet":
    try:
      import pyarrow.parquet as pq  # noqa: PLC0415 -- optional dependency
    except ImportError as e:
      raise ImportError(
        f"reading {path} needs the package 'pyarrow' (pip install pyarrow), "
        "which is not installed; or convert the file to JSONL"
      ) from e
    with path.open("rb") as f:
      rows = pq.read_table(f).to_pylist()
    for i, row in enumerate(rows):
      yield f"{path}: row {i}", row
  else:
    raise DataError(f"{path}: unknown format {suffix!r} (use .jsonl, .json or .parquet)")


def _hub_rows(spec: DatasetSpec) -> Iterator[tuple[str, Any]]:
  try:
    import datasets  # noqa: PLC0415 -- optional dependency, needs the network
  except ImportError as e:
    raise ImportError(
      f"dataset {spec.name!r} is not in the data dir (tried {', '.join(spec.filenames)}; "
      "set CAPO_DATA_DIR or pass data_dir), and loading it from the hub "
      f"({spec.hub_id}) needs the package 'datasets', which is not installed"
    ) from e
  try:
    ds = datasets.load_dataset(spec.hub_id, spec.hub_config, split=spec.split)
  except Exception as e:  # offline, unknown id, ...: say which dataset and what to do
    raise RuntimeError(
      f"could not load {spec.hub_id} (split {spec.split}) from the hub: {e}. "
      f"Offline? Put {spec.filenames[0]} in CAPO_DATA_DIR instead."
    ) from e
  for i, row in enumerate(ds):
    yield f"{spec.hub_id}[{spec.split}]: row {i}", row


def load_examples(
  path_or_name: str | os.PathLike,
  *,
  data_dir: str | os.PathLike | None = None,
  field_map: dict[str, str] | None = None,
  skip_bad: bool = False,
) -> Dataset:
  """Loads a dataset file or a registry name (see `resolve`).

  Args:
    path_or_name: a .jsonl/.json/.parquet path or a `REGISTRY` name.
    data_dir: where registry names look for files (default $CAPO_DATA_DIR).
    field_map: our field ("id", "problem", "answer") -> the source key; default: the first of
      `DEFAULT_FIELDS` present. A row without an id gets "<file stem>/<row number>".
    skip_bad: skip rows that are invalid JSON, not objects, or miss/empty a field, counting
      them in `Dataset.num_skipped`, instead of raising a `DataError` naming file and line.
  """
  target = resolve(path_or_name, data_dir)
  if isinstance(target, DatasetSpec) and target.generator:
    module, _, fn = target.generator.partition(":")
    return Dataset(
      source=f"{target.name} (generated by {target.generator})",
      examples=list(getattr(importlib.import_module(module), fn)()),
    )
  if isinstance(target, DatasetSpec):
    rows, stem, source = _hub_rows(target), target.name, target.hub_id
    field_map = field_map or target.field_map
    answer_from = target.answer_from
  else:
    rows, stem, source, answer_from = _read_rows(target), target.stem, str(target), None
  out = Dataset(source=source, examples=[])
  for n, (where, row) in enumerate(rows):
    try:
      if isinstance(row, Exception):
        raise row
      out.examples.append(_to_example(row, where, f"{stem}/{n}", field_map, answer_from))
    except DataError as e:
      if not skip_bad:
        raise
      out.num_skipped += 1
      if len(out.skipped) < 20:
        out.skipped.append(str(e))
  return out


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
