"""Safe defaults (issue 31): the run files name their hub ids, random weights only on request,
and a model or tokenizer directory without its files is an error naming it and what it lacks.

The hub is never reached: a hub cache is laid out under a temporary ``HF_HOME`` and read
with ``HF_HUB_OFFLINE=1`` (in a subprocess, as huggingface_hub reads ``HF_HOME`` at import).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
import transformers

import hf_utils
from capo_jax.data import tokenizer as tk
from capo_jax.run import setup
from capo_jax.run import spec as spec_lib
from configs import common
from models import hf_weights

REPO = pathlib.Path(__file__).resolve().parent.parent
HUB_IDS = {
  "capo_qwen2p5_math_1p5b": "Qwen/Qwen2.5-Math-1.5B",
  "grpo_qwen2p5_math_1p5b": "Qwen/Qwen2.5-Math-1.5B",
  "capo_qwen2p5_math_7b": "Qwen/Qwen2.5-Math-7B",
  "grpo_qwen2p5_math_7b": "Qwen/Qwen2.5-Math-7B",
}


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory):
  """A tiny random Qwen2 HF directory with a tokenizer: what the hub cache will hold."""
  path = tmp_path_factory.mktemp("repo")
  hf_utils.make_hf_model(path, seed=3, vocab_size=400)
  hf_utils.make_tokenizer().save_pretrained(path)
  return path


@pytest.mark.parametrize("name", sorted(HUB_IDS))
def test_run_files_name_their_hub_ids_and_shrink_asks_for_random_weights(name):
  mod = importlib.import_module(f"configs.{name}")
  full, tiny = mod.get_config(), mod.get_config("shrink")
  assert full.model.hf_path == HUB_IDS[name] and not full.model.random_init
  assert tiny.model.hf_path == "" and tiny.model.random_init and tiny.model.preset == "tiny"
  spec_lib.RunSpec.from_config(tiny, num_devices=1)  # :shrink still validates


@pytest.mark.parametrize("name", ["capo_qwen2p5_math_1p5b", "grpo_qwen2p5_math_7b"])
def test_no_weights_and_no_random_init_is_an_error_naming_model_hf_path(name, tmp_path):
  """The issue's case: the 1.5B run file with its hf_path left empty and a tokenizer set."""
  c = importlib.import_module(f"configs.{name}").get_config()
  c.model.hf_path = ""
  c.tokenizer_path = str(hf_utils.make_tokenizer_dir(tmp_path / "tok"))
  with pytest.raises(
    spec_lib.ConfigError,
    match=r"config\.model\.hf_path='': no weights to "
    r"start from.*model\.random_init=True",
  ):
    spec_lib.RunSpec.from_config(c, num_devices=1)
  c.model.random_init = True  # asked for: random weights of the preset
  assert spec_lib.RunSpec.from_config(c, num_devices=8).model_config().hidden_size == (
    1536 if "1p5b" in name else 3584
  )


def test_random_init_needs_a_preset_and_initial_params_never_guesses():
  c = common.shrink(common.get_base_config())
  c.model.preset = ""
  with pytest.raises(spec_lib.ConfigError, match=r"config\.model\.preset='': model\.random_init"):
    spec_lib.RunSpec.from_config(c, num_devices=1)
  # A spec validated for a caller-given policy, then asked for its own weights.
  c = common.shrink(common.get_base_config())
  c.model.random_init = False
  spec = spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True)
  with pytest.raises(spec_lib.ConfigError, match=r"config\.model\.hf_path=''"):
    setup.initial_params(spec, spec.model_config(), None, None)


def _digest(params) -> str:
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    h.update(np.ascontiguousarray(np.asarray(leaf, np.float32)).tobytes())
  return h.hexdigest()


def test_run_file_resolves_its_hub_id_from_a_prepared_hf_home_offline(tiny_repo, tmp_path):
  """``configs/capo_qwen2p5_math_1p5b.py`` unchanged: the hub id comes from the cache."""
  hf_home = tmp_path / "hf_home"
  snapshot = hf_utils.write_hub_snapshot(hf_home / "hub", "Qwen/Qwen2.5-Math-1.5B", tiny_repo)
  code = textwrap.dedent("""
      import hashlib, json
      import jax, numpy as np
      from capo_jax.run import setup, spec as spec_lib
      from configs import capo_qwen2p5_math_1p5b, capo_qwen2p5_math_7b
      spec = spec_lib.RunSpec.from_config(capo_qwen2p5_math_1p5b.get_config(), num_devices=1)
      cfg = spec.model_config()
      params = setup.initial_params(spec, cfg, None, None)
      h = hashlib.sha256()
      for leaf in jax.tree.leaves(params):
        h.update(np.ascontiguousarray(np.asarray(leaf, np.float32)).tobytes())
      tok = setup.tokenizer_for(spec)
      out = {"hidden": cfg.hidden_size, "layers": cfg.num_layers, "digest": h.hexdigest(),
             "prompt": tok.encode_prompt("What is 1 + 2?")}
      try:
        spec_lib.RunSpec.from_config(capo_qwen2p5_math_7b.get_config(), num_devices=1)
      except spec_lib.ConfigError as e:
        out["miss"] = str(e)
      print("RESULT" + json.dumps(out))
  """)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
  env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  run = subprocess.run(
    [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
  )
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.split("RESULT")[-1])
  cfg, params = hf_weights.load_pretrained(snapshot)
  assert (out["hidden"], out["layers"]) == (64, 2) == (cfg.hidden_size, cfg.num_layers)
  assert out["digest"] == _digest(params)
  hf_tok = transformers.AutoTokenizer.from_pretrained(snapshot, local_files_only=True)
  want = hf_tok.apply_chat_template(
    [
      {"role": "system", "content": tk.SYSTEM_PROMPT},
      {"role": "user", "content": "What is 1 + 2?"},
    ],
    tokenize=False,
    add_generation_prompt=True,
  )
  assert out["prompt"] == hf_tok.encode(want, add_special_tokens=False)
  # The 7B id is not in the cache: the error names the field, the id and offline mode.
  assert "config.model.hf_path='Qwen/Qwen2.5-Math-7B'" in out["miss"]
  assert "HF_HUB_OFFLINE is set" in out["miss"]


def test_the_architecture_alone_fetches_only_config_json(monkeypatch, tmp_path):
  """The AOT compile's path (``policy_given``): a snapshot with config.json and nothing else."""
  hf_utils.offline_hub(monkeypatch, tmp_path / "hub")
  from models.config import PRESETS  # pylint: disable=import-outside-toplevel

  hf_utils.write_hub_snapshot(
    tmp_path / "hub",
    "Qwen/Qwen2.5-Math-7B",
    files={"config.json": json.dumps(PRESETS["qwen2p5_math_7b"]().to_hf())},
  )
  c = importlib.import_module("configs.capo_qwen2p5_math_7b").get_config()
  spec = spec_lib.RunSpec.from_config(c, num_devices=8, policy_given=True)
  assert spec.model_config().hidden_size == 3584
  with pytest.raises(
    spec_lib.ConfigError,
    match=r"config\.model\.hf_path='Qwen/Qwen2\.5-Math-"
    r"7B': model directory .* lacks model\.safetensors",
  ):
    spec_lib.RunSpec.from_config(c, num_devices=8)  # a run needs the weights too


def _copy_without(src: pathlib.Path, dest: pathlib.Path, *drop: str) -> pathlib.Path:
  shutil.copytree(src, dest, ignore=shutil.ignore_patterns(*drop))
  return dest


@pytest.mark.parametrize(
  "drop,lacks",
  [
    (("config.json",), r"lacks config\.json"),
    (("*.safetensors",), r"lacks model\.safetensors \(or model\.safetensors\.index\.json"),
    (("tokenizer.json",), r"lacks tokenizer file tokenizer\.json or vocab\.json \+ merges\.txt"),
  ],
)
def test_model_directory_without_its_files_is_named_with_what_it_lacks(
  tiny_repo, tmp_path, drop, lacks
):
  model_dir = _copy_without(tiny_repo, tmp_path / "model", *drop)
  c = common.shrink(common.get_base_config())
  c.model.hf_path = str(model_dir)
  d = re.escape(str(model_dir))
  with pytest.raises(
    spec_lib.ConfigError,
    match=rf"config\.model\.hf_path='{d}': "
    rf"model directory {d} {lacks}.*\(it holds ",
  ):
    spec_lib.RunSpec.from_config(c, num_devices=1)


def test_sharded_checkpoint_missing_a_shard_names_it(tmp_path):
  _, path = hf_utils.make_hf_model(tmp_path / "model", max_shard_size="200KB")
  index = json.loads((path / hf_weights.INDEX_FILE).read_text())
  shard = sorted(set(index["weight_map"].values()))[-1]
  (path / shard).unlink()
  c = common.shrink(common.get_base_config())
  c.model.hf_path, c.tokenizer_path = str(path), str(hf_utils.make_tokenizer_dir(tmp_path / "t"))
  with pytest.raises(spec_lib.ConfigError, match=rf"lacks {shard}"):
    spec_lib.RunSpec.from_config(c, num_devices=1)
  # The same check guards the weights' load when validation was skipped (a given policy).
  spec = spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True)
  with pytest.raises(
    spec_lib.ConfigError,
    match=rf"model directory {re.escape(str(path))} "
    rf"lacks {shard}",
  ):
    setup.initial_params(spec, spec.model_config(), None, None)


def test_tokenizer_directory_without_its_files_is_named_not_sentencepiece(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError) as e:
    tk.load_tokenizer(empty)
  msg = str(e.value)
  assert (
    f"tokenizer directory {empty} lacks tokenizer_config.json; tokenizer.json or "
    "vocab.json + merges.txt or tokenizer.model (it is empty)" == msg
  )
  assert "sentencepiece" not in msg.replace("tokenizer.model", "")
  only_config = _copy_without(
    hf_utils.make_tokenizer_dir(tmp_path / "tok"), tmp_path / "half", "tokenizer.json"
  )
  with pytest.raises(
    FileNotFoundError,
    match=r"lacks tokenizer\.json or vocab\.json \+ merges"
    r"\.txt or tokenizer\.model \(it holds .*tokenizer_config\.json",
  ):
    tk.load_tokenizer(only_config)
  c = common.shrink(common.get_base_config())
  c.tokenizer_path = str(empty)
  spec = spec_lib.RunSpec.from_config(c, num_devices=1)
  d = re.escape(str(empty))
  with pytest.raises(
    spec_lib.ConfigError,
    match=rf"config\.tokenizer_path='{d}': "
    rf"tokenizer directory {d} lacks",
  ):
    setup.tokenizer_for(spec)
