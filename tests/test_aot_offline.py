"""The ahead-of-time compile needs no weights, only the architecture (issue 46, item 9)."""

import importlib

import pytest

from capo_jax.run import aot
from capo_jax.run import spec as spec_lib
from configs import common


def test_the_aot_compile_of_a_run_file_needs_no_hub(monkeypatch):
  """Issue 46 item 9: an uncached hub id falls back to the run file's preset, in one line."""
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never the network; the id is in no cache
  c = importlib.import_module("configs.capo_qwen2p5_math_1p5b").get_config()
  c.model.hf_path = "capo-jax-tests/no-such-model"
  spec = spec_lib.RunSpec.from_config(c, num_devices=1, policy_given=True)
  with pytest.raises(spec_lib.ConfigError, match="config.json not found locally"):
    spec.model_config()  # what the compile hit before
  lines: list[str] = []
  arch = aot.architecture_spec(spec, lines.append)
  assert len(lines) == 1 and "'qwen2p5_math_1p5b'" in lines[0] and "no-such-model" in lines[0]
  cfg = arch.model_config()
  # Qwen2.5-Math-1.5B's published config.json: 28 layers, hidden 1536, 12 / 2 heads.
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (28, 1536, 12, 2)
  local = spec_lib.RunSpec.from_config(common.shrink(common.get_base_config()), num_devices=1)
  assert aot.architecture_spec(local, lines.append) is local and len(lines) == 1
