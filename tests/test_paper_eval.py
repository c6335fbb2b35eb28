"""The paper's run files evaluate during training (issue 42, item 8).

The paper's Fig. 1b/c are curves over training steps on its benchmarks, so the run files
evaluate every 50 steps; a run whose benchmark files are missing stops at set-up with an error
naming the data directory it searched, not after its first 50 steps.
"""

import importlib
import json

import pytest

from capo_jax.run import spec as spec_lib
from capo_jax.run import train_eval
from configs import common

PAPER_RUN_FILES = (
  "capo_qwen2p5_math_1p5b",
  "capo_qwen2p5_math_7b",
  "grpo_qwen2p5_math_1p5b",
  "grpo_qwen2p5_math_7b",
)
PAPER_BENCHMARKS = {"math500", "aime24", "aime25", "amc23", "minerva_math", "olympiadbench"}


@pytest.mark.parametrize("name", PAPER_RUN_FILES)
def test_the_paper_run_files_evaluate_the_paper_benchmarks_every_50_steps(name):
  c = importlib.import_module(f"configs.{name}").get_config()
  assert c.eval.every_steps == 50
  assert set(c.data.eval) == PAPER_BENCHMARKS
  assert c.eval.num_samples == 16 and c.eval.temperature == 1.0  # SPEC 5
  # The shrunk smoke run evaluates only when asked, so it needs no benchmark files.
  assert importlib.import_module(f"configs.{name}").get_config("shrink").eval.every_steps == 0


def _spec(data_dir: str, names: tuple[str, ...]) -> spec_lib.RunSpec:
  c = common.shrink(common.get_base_config())
  c.eval.every_steps, c.data.data_dir, c.data.eval, c.eval.limit = 50, data_dir, names, 0
  return spec_lib.RunSpec.from_config(c, num_devices=1)


def test_missing_benchmark_files_name_the_data_directory(tmp_path, monkeypatch):
  monkeypatch.delenv("CAPO_DATA_DIR", raising=False)
  (tmp_path / "aime24.jsonl").write_text(
    json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}) + "\n"
  )
  spec = _spec(str(tmp_path), ("aime24", "aime25"))
  with pytest.raises(spec_lib.ConfigError) as info:
    train_eval.eval_benchmarks(spec, [])
  message = str(info.value)
  assert str(tmp_path) in message and "aime25.jsonl" in message
  assert "aime25" in message.split("could not be loaded")[0]
  assert "aime24.jsonl" not in message  # it was found
  assert "--config.eval.every_steps=0" in message

  monkeypatch.setenv("CAPO_DATA_DIR", "")
  with pytest.raises(spec_lib.ConfigError, match=r"no data directory \(config.data.data_dir "):
    train_eval.eval_benchmarks(_spec("", ("aime25",)), [])


def test_the_paper_benchmarks_load_from_the_shared_data(shared_data):
  spec = _spec(str(shared_data), tuple(sorted(PAPER_BENCHMARKS)))
  got = train_eval.eval_benchmarks(spec, [])
  assert set(got) == PAPER_BENCHMARKS
  for name, examples in got.items():  # every question of each file
    lines = (shared_data / f"{name}.jsonl").read_text().splitlines()
    assert len(examples) == sum(1 for line in lines if line.strip()), name
