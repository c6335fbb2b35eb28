"""Hub ids ("owner/name") resolved through ``huggingface_hub.snapshot_download``, offline.

No test touches the network: the download function is replaced by a stand-in
that "downloads" from local folders, filtering with huggingface_hub's own
pattern matcher; the one run of the real ``snapshot_download`` is in offline
mode (``HF_HUB_OFFLINE=1``) against a hub cache laid out under ``HF_HOME``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_utils
from capo_jax.eval import cli as eval_cli
from capo_jax.run import setup
from capo_jax.run import spec as spec_lib
from capo_jax.runtime import fs, policy_io
from configs import common
from models import hf_weights, hub, qwen2

REPO = pathlib.Path(__file__).resolve().parent.parent
HUB_ID = "Qwen/Tiny-Qwen3"


class StandIn:
  """``snapshot_download`` over local "repos": copies the files its patterns allow."""

  def __init__(self, repos: dict[str, pathlib.Path], cache: pathlib.Path):
    self.repos, self.cache, self.calls = repos, cache, []

  def __call__(self, repo_id: str, **kw):
    from huggingface_hub.utils import filter_repo_objects  # pylint: disable=import-outside-toplevel

    self.calls.append((repo_id, kw))
    if repo_id not in self.repos:
      raise RuntimeError(f"404 Client Error: Repository Not Found for url .../{repo_id}")
    src = self.repos[repo_id]
    dest = self.cache / repo_id.replace("/", "--")
    names = sorted(
      os.path.relpath(os.path.join(d, f), src) for d, _, fs_ in os.walk(src) for f in fs_
    )
    for name in filter_repo_objects(names, allow_patterns=kw.get("allow_patterns")):
      (dest / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy(src / name, dest / name)
    return str(dest)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
  """A Qwen3 HF directory with a tokenizer and files a snapshot must leave behind."""
  path = tmp_path_factory.mktemp("repo")
  model, _ = hf_utils.make_hf_model(
    path, seed=2, arch="qwen3", head_dim=32, vocab_size=400, max_shard_size="200KB"
  )  # sharded: an index + shards
  hf_utils.make_tokenizer().save_pretrained(path)
  (path / "pytorch_model.bin").write_bytes(b"not fetched")
  (path / "README.md").write_text("not fetched")
  return model, path


@pytest.fixture
def stand_in(repo, tmp_path, monkeypatch):
  fake = StandIn({HUB_ID: repo[1]}, tmp_path / "hub-cache")
  monkeypatch.setattr(hub, "_download", fake)
  monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
  monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
  return fake


def test_load_pretrained_by_hub_id_fetches_weights_config_and_tokenizer_only(repo, stand_in):
  model, src = repo
  cfg, params = hf_weights.load_pretrained(HUB_ID)
  [(repo_id, kw)] = stand_in.calls
  assert repo_id == HUB_ID and kw["local_files_only"] is False
  assert "cache_dir" not in kw  # the hub cache of HF_HOME / HF_HUB_CACHE
  fetched = sorted(os.listdir(stand_in.cache / "Qwen--Tiny-Qwen3"))
  assert "pytorch_model.bin" not in fetched and "README.md" not in fetched
  assert {"config.json", hf_weights.INDEX_FILE, "tokenizer.json"} <= set(fetched)
  assert sum(f.endswith(".safetensors") for f in fetched) > 1
  assert cfg.model_type == "qwen3"
  tokens, mask = hf_utils.left_padded_batch(np.random.default_rng(0), [6, 3], 400)
  ours = np.asarray(jax.jit(qwen2.forward, static_argnums=1)(params, cfg, tokens, mask))
  ref = hf_utils.hf_logits(model, tokens, mask)
  assert np.abs(ours - ref)[mask.astype(bool)].max() <= 1e-4


def test_local_paths_and_urls_never_reach_the_hub(repo, stand_in, tmp_path, monkeypatch):
  assert hub.resolve(repo[1]) == os.fspath(repo[1])
  (tmp_path / "Qwen").mkdir()  # a local "owner/name" folder wins over the hub id
  (tmp_path / "Qwen" / "Tiny-Qwen3").mkdir()
  monkeypatch.chdir(tmp_path)
  assert hub.resolve(HUB_ID) == HUB_ID
  assert hub.resolve("gs://bucket/models/Qwen") == "gs://bucket/models/Qwen"
  assert not stand_in.calls


def test_offline_mode_reads_only_the_cache(stand_in, monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  hub.resolve(HUB_ID)
  assert stand_in.calls[-1][1]["local_files_only"] is True


def test_errors_name_the_local_path_and_the_hub_id(stand_in, tmp_path):
  missing = "no-such-owner/no-such-model"
  with pytest.raises(FileNotFoundError) as e:
    hf_weights.load_pretrained(missing)
  msg = str(e.value)
  assert os.path.abspath(missing) in msg and f"hub id {missing!r}" in msg
  assert "Repository Not Found" in msg
  # Not shaped like a hub id: the error says so, and the hub is not asked.
  for path in (str(tmp_path / "absent"), "a/b/c", "just-a-name"):
    with pytest.raises(FileNotFoundError, match="does not exist, and it is not a Hugging Face"):
      hub.resolve(path)
  assert [c[0] for c in stand_in.calls] == [missing]
  with pytest.raises(ValueError, match="fs.model_dir"):
    hf_weights.load_pretrained("gs://bucket/Qwen2.5-Math-1.5B")


def test_trainer_config_takes_a_hub_id(repo, stand_in):
  """``--config.model.hf_path=Qwen/...``: validation, architecture, weights, tokenizer."""
  c = common.shrink(common.get_base_config())
  c.model.hf_path = HUB_ID
  spec_lib.RunSpec.from_config(c, num_devices=1)
  cfg = spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True).model_config()
  assert cfg == hf_weights.load_pretrained(repo[1])[0]
  params = setup.initial_params(spec_lib.RunSpec.from_config(c, num_devices=1), cfg, None, None)
  want = hf_weights.load_params(cfg, repo[1])
  jax.tree.map(np.testing.assert_array_equal, params, want)
  tok = setup.tokenizer_for(spec_lib.RunSpec.from_config(c, num_devices=1))
  assert tok.encode("What is 1 + 2?") == hf_utils.make_tokenizer().encode("What is 1 + 2?")
  c.model.hf_path = "no-such-owner/no-such-model"
  with pytest.raises(
    spec_lib.ConfigError,
    match=r"config\.model\.hf_path=.*neither a local "
    r"directory .* nor a model fetched from the Hugging Face hub",
  ):
    spec_lib.RunSpec.from_config(c, num_devices=1)


def test_evaluate_policy_by_hub_id(repo, stand_in, tmp_path):
  """``python -m capo_jax.eval --policy=Qwen/...``, through ``load_policy``."""
  snapshot = str(stand_in.cache / "Qwen--Tiny-Qwen3")
  pol = policy_io.load_policy(HUB_ID, dtype=jnp.float32)
  assert pol.source == HUB_ID and pol.cfg.model_type == "qwen3"
  assert pol.tokenizer_dir == snapshot == fs.model_dir(HUB_ID)
  jax.tree.map(np.testing.assert_array_equal, pol.params, hf_weights.load_pretrained(repo[1])[1])
  bench = tmp_path / "one.jsonl"
  bench.write_text(json.dumps({"id": "q", "problem": "What is 1 + 2?", "answer": "3"}) + "\n")
  results = eval_cli.main(
    [
      f"--policy={HUB_ID}",
      f"--benchmarks={bench}",
      "--num_samples=1",
      "--max_new_tokens=2",
      "--batch_size=1",
      "--dtype=float32",
      "--no_progress",
      "--no_plots",
      f"--out={tmp_path / 'out'}",
    ]
  )
  assert results["config"]["policy"] == HUB_ID and results["config"]["tokenizer"] == snapshot
  assert len((tmp_path / "out" / "samples.jsonl").read_text().splitlines()) == 1


def test_real_snapshot_download_honours_hf_home_and_offline_mode(repo, tmp_path):
  """The real ``snapshot_download``, offline, against a hub cache under ``HF_HOME``."""
  commit = "0123456789abcdef0123456789abcdef01234567"
  store = tmp_path / "hf_home" / "hub" / "models--Qwen--Tiny-Qwen3"
  (store / "refs").mkdir(parents=True)
  (store / "refs" / "main").write_text(commit)
  shutil.copytree(repo[1], store / "snapshots" / commit)
  code = textwrap.dedent(f"""
      import json, sys
      from models import hub
      out = {{"hit": hub.resolve({HUB_ID!r})}}
      try:
        hub.resolve("Qwen/Not-Cached")
      except FileNotFoundError as e:
        out["miss"] = str(e)
      print(json.dumps(out))
  """)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
  env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
  run = subprocess.run(
    [sys.executable, "-c", code],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  out = json.loads(run.stdout.strip().splitlines()[-1])
  assert out["hit"] == str(store / "snapshots" / commit)
  assert (
    "Qwen/Not-Cached" in out["miss"]
    and "local hub cache (HF_HUB_OFFLINE is set)" in out["miss"]
    and "does not exist" in out["miss"]
  )


@pytest.mark.slow  # ~80 s on the shared 2-core box: sampler, logprob and train-step compiles
def test_rl_run_from_a_qwen3_hub_id(repo, stand_in, tmp_path):
  """The trainer end to end on ``model.hf_path=Qwen/...`` (a Qwen3, tokenizer included):
  one CAPO step updates the policy and the export reloads as a Qwen3."""
  import rl_driver  # pylint: disable=import-outside-toplevel

  c = common.shrink(common.get_base_config())
  c.model.hf_path, c.tokenizer_path = HUB_ID, ""  # the tokenizer comes from the snapshot
  c.data.train = str(tmp_path / "train.jsonl")
  pathlib.Path(c.data.train).write_text(
    "".join(
      json.dumps({"id": str(i), "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
      for i in range(8)
    )
  )
  c.rollout.max_prompt_len, c.rollout.max_new_tokens, c.train.num_steps = 256, 8, 1
  c.optim.lr = 1e-3
  workdir = tmp_path / "run"
  params = rl_driver.train(c, str(workdir), grader=rl_driver.HashGrader())
  base = hf_weights.load_pretrained(repo[1])[1]
  moved = jax.tree.map(
    lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), params, base
  )
  assert moved["layers"]["q_norm"] > 0 and moved["layers"]["q_kernel"] > 0
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert rows[-1]["step"] == 1 and rows[-1]["grad_norm"] > 0
  exported = json.loads((workdir / "export_hf" / "config.json").read_text())
  assert exported["model_type"] == "qwen3" and exported["architectures"] == ["Qwen3ForCausalLM"]
