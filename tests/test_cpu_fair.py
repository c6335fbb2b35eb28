"""benchmarks/cpu_fair.py: the records it writes from the two benchmarks' JSON."""

from __future__ import annotations

import re

from benchmarks import cpu_fair
from tools import results_tables

CHECK = {
  "threads": 2,
  "cpus": 2,
  "torch_threads": 2,
  "jax_busy_threads": 2,
  "torch_busy_threads": 2,
}
SAMPLER = {
  "batch": 32,
  "prompt_len": 64,
  "new_tokens": 128,
  "rounds": 4,
  "threads": CHECK,
  "greedy_row0_agreement": {"transformers": 1.0},
  "capo_jax_sample_tokens_per_s": 1943.0,
  "transformers_sample_tokens_per_s": 636.0,
  "capo_jax_greedy_tokens_per_s": 1868.0,
  "transformers_greedy_tokens_per_s": 1071.0,
  "ratio_vs_transformers_sample": 1943.0 / 636.0,
  "ratio_range_vs_transformers_sample": [2.761, 3.384],
  "ratio_vs_transformers_greedy": 1868.0 / 1071.0,
  "ratio_range_vs_transformers_greedy": [1.6, 1.9],
}
TRAIN = {
  "batch": 8,
  "prompt": 64,
  "completion": 192,
  "repeats": 4,
  "block": 3,
  "threads": CHECK,
  "step_s": {"capo_jax": 2.0, "torch": 2.5},
  "ratio_vs_torch": 1.25,
  "ratio_range_vs_torch": [1.1, 1.4],
  "matmul_peak_flops": 160e9,
  "loss_diff": 3e-8,
}
BASE = {
  "tag": "before",
  "commit": "abc1234",
  "command": "python -m benchmarks.cpu_fair --tag before",
  "date": "2026-12-06",
  "machine": "2-core CPU, shared",
}


def test_records_quote_the_ratios_and_pass_the_docs_checks():
  sampler = cpu_fair.with_result_in_notes(cpu_fair.sampler_record(SAMPLER, BASE))
  train = cpu_fair.with_result_in_notes(cpu_fair.train_record(TRAIN, BASE))
  assert sampler["id"] == "sampler_vs_transformers_2t_before"
  # 1943 / 636 = 3.055; the rounds' range as given; 1868 / 1071 = 1.744.
  assert sampler["result"] == (
    "T = 1 sampling 3.06x (rounds 2.76-3.38x), greedy 1.74x (rounds 1.60-1.90x)"
  )
  assert train["result"] == "1.25x (rounds 1.10-1.40x) the tokens/s of torch"
  assert "1,024 vs 819 tokens/s" in train["notes"]  # 8 * 256 = 2,048 tokens over 2.0 and 2.5 s
  results_tables.check_records([sampler, train], results_tables.BENCHMARK_FIELDS, "benchmarks")
  for r in (sampler, train):  # tests/test_docs.py: the cell's figures are in the notes
    assert all(n in r["notes"] for n in re.findall(r"\d+(?:\.\d+)?", r["result"]))


def test_upsert_replaces_by_id_or_files_in_front_of_the_earlier_claim():
  records = [{"id": "a"}, {"id": "sampler_vs_transformers"}, {"id": "z"}]
  cpu_fair.upsert(records, {"id": "new", "v": 1}, "sampler_vs_transformers")
  assert [r["id"] for r in records] == ["a", "new", "sampler_vs_transformers", "z"]
  cpu_fair.upsert(records, {"id": "new", "v": 2}, "sampler_vs_transformers")
  assert [r.get("v") for r in records] == [None, 2, None, None]
  cpu_fair.upsert(records, {"id": "last"}, "missing")
  assert records[-1]["id"] == "last"
