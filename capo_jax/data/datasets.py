"""Math datasets: a named registry, and loading a file or registry name with a field mapping.

Local files are JSON Lines (one object per line), JSON (a list of objects, or an object holding
one) or parquet (needs pyarrow). A name from `REGISTRY` resolves to a file in the data dir
(argument `data_dir`, else $CAPO_DATA_DIR) when present there, else to its hub dataset, loaded
with the `datasets` package when installed and online. Files and data dirs may be local or on
Cloud Storage (``gs://``; see `capo_jax.runtime.fs`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any, Iterator

# The split and the iterator live in capo_jax.data.order; run/setup.py and run/trainer.py
# still reach them here as `data.Split`, `data.split_train_val`, `data.PromptIterator`.
from capo_jax.data.order import PromptIterator, Split, split_train_val  # noqa: F401
from capo_jax.data.rows import DataError, Example, read_rows, to_example
from capo_jax.runtime import fs


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
    rows, stem, source, answer_from = read_rows(target), target.stem, str(target), None
  out = Dataset(source=source, examples=[])
  for n, (where, row) in enumerate(rows):
    try:
      if isinstance(row, Exception):
        raise row
      out.examples.append(to_example(row, where, f"{stem}/{n}", field_map, answer_from))
    except DataError as e:
      if not skip_bad:
        raise
      out.num_skipped += 1
      if len(out.skipped) < 20:
        out.skipped.append(str(e))
  return out
