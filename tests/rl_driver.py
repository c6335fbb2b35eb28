"""Runs a tiny RL job in its own process, for the trainer's process-level tests.

  python tests/rl_driver.py WORKDIR TOKENIZER_DIR DATA_FILE NUM_STEPS [key=value ...]

A random tiny model never writes a boxed answer, so every reward would be 0
and every advantage too; the driver's grader instead gives each completion a
deterministic pseudo-random reward (CRC32 of its text), so updates are real
and resumption is tested on params that actually move. It writes the SHA-256
of the final params to WORKDIR/params.<process_index>.sha256.
"""

from __future__ import annotations

import hashlib
import sys
import zlib

import jax
import numpy as np

from capo_jax.data.rewards import RewardHealth
from capo_jax.runtime import distributed


class HashGrader:
  """Reward 1 for completions whose CRC32 is odd: fixed, text-dependent, no math."""

  def score(self, completions, golds):
    del golds
    r = np.array([zlib.crc32(c.encode()) % 2 for c in completions], np.float32)
    return r, RewardHealth(total=len(r), correct=int(r.sum()))


QUESTIONS = [
  ("What is 2 + 3?", "5"),
  ("What is 7 - 4?", "3"),
  ("Compute 6 * 7.", "42"),
  ("What is 10 / 2?", "5"),
  ("What is 9 + 9?", "18"),
  ("What is 3 * 3?", "9"),
  ("What is 8 - 1?", "7"),
  ("What is 1 + 1?", "2"),
]


def write_assets(root) -> dict[str, str]:
  """A tiny HF tokenizer directory and a JSONL of ``QUESTIONS`` under ``root``."""
  import json  # pylint: disable=import-outside-toplevel

  import hf_utils  # pylint: disable=import-outside-toplevel

  tok = hf_utils.make_tokenizer_dir(root / "tok")
  data = root / "train.jsonl"
  data.write_text(
    "".join(
      json.dumps({"id": str(i), "problem": q, "answer": a}) + "\n"
      for i, (q, a) in enumerate(QUESTIONS)
    )
  )
  return {"tok": str(tok), "data": str(data), "root": str(root)}


def tiny_config(tokenizer_dir: str, data_file: str, num_steps: int):
  from configs import capo_qwen2p5_math_1p5b  # pylint: disable=import-outside-toplevel

  c = capo_qwen2p5_math_1p5b.get_config("shrink")
  c.tokenizer_path = tokenizer_dir
  c.data.train = data_file
  c.rollout.max_prompt_len = 256
  c.rollout.max_new_tokens = 8
  c.train.num_steps = num_steps
  c.optim.lr = 1e-3
  return c


def params_digest(params) -> str:
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    h.update(np.ascontiguousarray(leaf).tobytes())
  return h.hexdigest()


def train(c, workdir: str, **kwargs):
  """``capo_jax.run.loop.train`` of config ``c``, translated as the entry point does."""
  from capo_jax.run import loop  # pylint: disable=import-outside-toplevel
  from capo_jax.run.spec import RunSpec  # pylint: disable=import-outside-toplevel

  spec = RunSpec.from_config(c, policy_given=kwargs.get("policy") is not None)
  return loop.train(spec, str(workdir), **kwargs)


def main(argv: list[str]) -> None:
  workdir, tok, data_file, steps = argv[1], argv[2], argv[3], int(argv[4])
  distributed.maybe_initialize()
  from models.sharding import to_host  # pylint: disable=import-outside-toplevel

  c = tiny_config(tok, data_file, steps)
  for kv in argv[5:]:
    key, value = kv.split("=", 1)
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = type(node[leaf])(value) if not isinstance(node[leaf], bool) else value == "1"
  params = train(c, workdir, grader=HashGrader())
  with open(f"{workdir}/params.{jax.process_index()}.sha256", "w") as f:
    f.write(params_digest(jax.tree.map(to_host, params)))


if __name__ == "__main__":
  main(sys.argv)
