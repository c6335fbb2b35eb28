"""Tests of capo_jax.data: loading and registry (datasets), bad rows (rows), iterator (order)."""

from __future__ import annotations

import json
import re
import sys

import pytest

from capo_jax.data import datasets as data
from capo_jax.data import order


def _readme_counts(shared_data) -> dict[str, int]:
  """Row counts from the data README's table (the independent reference)."""
  text = (shared_data / "README.md").read_text(encoding="utf-8")
  return {
    m.group(1): int(m.group(2))
    for m in re.finditer(r"^\| (\w+)\.jsonl \| (\d+) \|", text, re.MULTILINE)
  }


def test_every_file_loads_with_readme_row_count(shared_data) -> None:
  counts = _readme_counts(shared_data)
  assert len(counts) == 8, counts
  for stem, want in counts.items():
    ds = data.load_examples(shared_data / f"{stem}.jsonl")
    assert len(ds) == want and ds.num_skipped == 0, stem
    assert len({e.id for e in ds}) == want, f"{stem}: ids not unique"
  by_name = {
    "math500": 500,
    "aime24": 30,
    "aime25": 30,
    "amc23": 40,
    "minerva_math": 272,
    "olympiadbench": 675,
    "deepscaler": counts["deepscaler_sample"],
    "math_train": counts["math_train_sample"],
  }
  for name, want in by_name.items():
    assert len(data.load_examples(name, data_dir=shared_data)) == want, name


def test_fields_match_the_raw_rows(shared_data, monkeypatch) -> None:
  monkeypatch.setenv("CAPO_DATA_DIR", str(shared_data))
  ds = data.load_examples("olympiadbench")
  with open(shared_data / "olympiadbench.jsonl", encoding="utf-8") as f:
    raw = [json.loads(line) for line in f]
  for ex, row in zip(ds, raw):
    assert (ex.id, ex.problem, ex.answer) == (
      row["id"],
      row["problem"].strip(),
      row["answer"].strip(),
    )
    assert ex.meta["answer_type"] == row["answer_type"] and "problem" not in ex.meta


def _write(path, lines: list[str]) -> None:
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")


GOOD = json.dumps({"id": "a", "problem": "1+1?", "answer": "2"})


@pytest.mark.parametrize(
  "bad,reason",
  [
    ('{"id": "b", "problem": "x", "answer": ', "invalid JSON"),
    (json.dumps({"id": "b", "problem": "x"}), "missing field 'answer'"),
    (json.dumps({"id": "b", "problem": "x", "answer": "  "}), "empty 'answer'"),
    (json.dumps({"id": "b", "answer": "3"}), "missing field 'problem'"),
    (json.dumps(["not", "an", "object"]), "expected a JSON object"),
  ],
)
def test_bad_row_error_names_file_and_line(tmp_path, bad: str, reason: str) -> None:
  path = tmp_path / "train.jsonl"
  _write(path, [GOOD, "", bad, GOOD.replace('"a"', '"c"')])  # the bad row is line 3
  with pytest.raises(data.DataError, match=re.escape(f"{path}:3: {reason}")):
    data.load_examples(path)
  ds = data.load_examples(path, skip_bad=True)
  assert [e.id for e in ds] == ["a", "c"] and ds.num_skipped == 1
  assert ds.skipped[0].startswith(f"{path}:3:")


def test_skip_mode_counts_every_bad_row(tmp_path) -> None:
  path = tmp_path / "mixed.jsonl"
  rows = [GOOD, "{oops", json.dumps({"problem": "p"}), GOOD, "null", b"\xff\xfe".decode("latin1")]
  _write(path, rows)
  ds = data.load_examples(path, skip_bad=True)
  assert len(ds) == 2 and ds.num_skipped == 4


def test_field_map_and_alternative_keys(tmp_path) -> None:
  path = tmp_path / "q.jsonl"
  _write(
    path,
    [
      json.dumps({"question": "Q1", "final_answer": ["$x$"], "n": 1}),
      json.dumps({"question": "Q2", "final_answer": 27.0}),
    ],
  )
  ds = data.load_examples(path)
  assert [(e.id, e.problem, e.answer) for e in ds] == [("q/0", "Q1", "$x$"), ("q/1", "Q2", "27")]
  assert ds[0].meta == {"n": 1}
  path2 = tmp_path / "custom.json"
  path2.write_text(json.dumps({"rows": [{"key": 7, "prompt": "P", "target": "T"}]}))
  ds2 = data.load_examples(path2, field_map={"id": "key", "problem": "prompt", "answer": "target"})
  assert [(e.id, e.problem, e.answer) for e in ds2] == [("7", "P", "T")]
  with pytest.raises(data.DataError, match=re.escape(f"{path2}: row 0: missing field 'answer'")):
    data.load_examples(path2, field_map={"problem": "prompt", "answer": "nope"})


def test_json_syntax_error_names_line(tmp_path) -> None:
  path = tmp_path / "broken.json"
  path.write_text('[\n{"problem": "p", "answer": "1"},\n{"problem": }\n]')
  with pytest.raises(data.DataError, match=re.escape(f"{path}:3: invalid JSON")):
    data.load_examples(path)


def test_parquet(tmp_path) -> None:
  path = tmp_path / "d.parquet"
  try:
    import pyarrow  # noqa: F401
  except ImportError:
    path.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pyarrow"):
      data.load_examples(path)
    pytest.skip("pyarrow not installed: checked the error only")
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.table({"problem": ["p1", "p2"], "answer": ["1", "2"]}), path)
  assert [e.answer for e in data.load_examples(path)] == ["1", "2"]


def test_registry_names_and_hub_fallback_errors(tmp_path, monkeypatch) -> None:
  assert {
    "math500",
    "aime24",
    "aime25",
    "amc23",
    "minerva_math",
    "olympiadbench",
    "deepscaler",
    "math_train",
  } <= set(data.REGISTRY)
  monkeypatch.delenv("CAPO_DATA_DIR", raising=False)
  assert data.resolve("aime24") is data.REGISTRY["aime24"]
  _write(tmp_path / "aime24.jsonl", [GOOD])
  assert data.resolve("aime24", tmp_path) == tmp_path / "aime24.jsonl"
  monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
  with pytest.raises(ImportError, match="'datasets'.*not installed"):
    data.load_examples("math500", data_dir=tmp_path)
  with pytest.raises(FileNotFoundError, match="not a dataset name"):
    data.load_examples("no_such_set")


# -- PromptIterator ---------------------------------------------------------------------------


def _examples(n: int) -> list[data.Example]:
  return [data.Example(id=str(i), problem=f"p{i}", answer=str(i)) for i in range(n)]


def _ids(batch: list[data.Example]) -> list[int]:
  return [int(e.id) for e in batch]


def test_each_epoch_is_a_fresh_permutation() -> None:
  n, bs = 10, 4  # batches straddle epoch ends
  it = order.PromptIterator(_examples(n), bs, seed=3)
  stream = [i for _ in range(15) for i in _ids(it.next_batch())]  # 60 items = 6 epochs
  epochs = [stream[k * n : (k + 1) * n] for k in range(6)]
  for ep in epochs:
    assert sorted(ep) == list(range(n))
  assert len({tuple(ep) for ep in epochs}) > 1
  assert it.state() == {"epoch": 6, "position": 0, "seed": 3, "num_examples": n}
  other = order.PromptIterator(_examples(n), bs, seed=4)
  assert [_ids(other.next_batch()) for _ in range(3)] != [stream[0:4], stream[4:8], stream[8:12]]


def test_state_restore_is_exact_across_epochs() -> None:
  it = order.PromptIterator(_examples(13), 5, seed=11)
  for _ in range(7):
    it.next_batch()
  saved = json.loads(json.dumps(it.state()))  # as stored in a checkpoint
  expected = [_ids(it.next_batch()) for _ in range(9)]
  fresh = order.PromptIterator(_examples(13), 5, seed=0)
  fresh.restore(saved)
  assert [_ids(fresh.next_batch()) for _ in range(9)] == expected
  with pytest.raises(ValueError, match="for 13 examples, this dataset has 12"):
    order.PromptIterator(_examples(12), 5, seed=11).restore(saved)


def test_multi_host_shares_form_the_global_batch() -> None:
  exs, bs, procs = _examples(37), 8, 4
  single = order.PromptIterator(exs, bs, seed=5)
  hosts = [
    order.PromptIterator(exs, bs, seed=5, process_index=p, process_count=procs)
    for p in range(procs)
  ]
  for _ in range(12):
    shares = [_ids(h.next_batch()) for h in hosts]
    assert all(len(s) == bs // procs for s in shares)
    assert [i for s in shares for i in s] == _ids(single.next_batch())
  assert len({str(h.state()) for h in hosts}) == 1
  with pytest.raises(ValueError, match="multiple of process_count"):
    order.PromptIterator(exs, 6, seed=0, process_count=4)
