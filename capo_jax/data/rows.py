"""A question (`Example`) and how a row of a source file becomes one.

Local files are JSON Lines (one object per line), JSON (a list of objects, or an object holding
one) or parquet (needs pyarrow); a bad row raises a `DataError` naming the file and line.
`capo_jax.data.datasets` finds the file (or hub copy) by name and loads it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterator

from capo_jax.data.answers import extract_boxed
from capo_jax.runtime import fs

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


class DataError(ValueError):
  """A bad row or file; the message names the file and line (or row)."""


def _text(value: Any) -> str:
  """Source values as strings: 27.0 -> "27"; a list (OlympiadBench) -> ", "-joined."""
  if isinstance(value, bool):
    return str(value)
  if isinstance(value, float) and value.is_integer():
    return str(int(value))
  if isinstance(value, (list, tuple)):
    return ", ".join(_text(v) for v in value)
  return value.strip() if isinstance(value, str) else str(value)


def to_example(
  row: Any,
  where: str,
  default_id: str,
  field_map: dict[str, str] | None,
  answer_from: str | None = None,
) -> Example:
  """One source row as an `Example`; `where` names the row in errors, `default_id` stands in
  for a missing id, `answer_from` is the field whose last \\boxed{} is the answer."""
  if not isinstance(row, dict):
    raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
  used, values = set(), {}
  for field, keys in DEFAULT_FIELDS.items():
    keys = (field_map[field],) if field_map and field in field_map else keys
    key = next((k for k in keys if k in row and row[k] is not None), None)
    if key is None and field == "answer" and answer_from and answer_from in row:
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


def read_rows(path: fs.Path) -> Iterator[tuple[str, Any]]:
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
