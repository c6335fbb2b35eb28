r"""Host <-> device transfers per RL step on the demo config, of two checkouts side by side.

  python -m benchmarks.transfers --warm_start_dir=/tmp/capo_demo/warm_start \
      --checkout=. --checkout=/path/to/older/checkout

Each checkout runs the demo's CAPO from a cached warm start (``make demo`` makes one)
for 2 and for 4 RL steps in a subprocess; the per-step figure is the difference
divided by 2, so start-up, compiles, the final evaluation and the checkpoint cancel.
Host -> device: every transfer JAX's transfer guard logs (``jax_transfer_guard=log``:
explicit ``device_put`` and the NumPy arguments of jitted calls alike). Device ->
host: every array the package reads back (``models.sharding.to_host`` and
``jax.device_get``, the two ways it reads device arrays; XLA:CPU does not log
those, and ``np.asarray`` reads a CPU buffer in place), and every scalar read
with ``float`` / ``int`` outside them. Scalars (0-d) are counted apart, and
``reads`` counts the blocking reads themselves (one ``device_get`` of a tree is one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

_DRIVER = r"""
import atexit, json, sys
import numpy as np
import jax
from jax._src import array as _array
import models.sharding
d2h, reads, inside = [], [0], [0]
def _note(x):
  if isinstance(x, jax.Array):
    d2h.append((list(x.shape), int(np.dtype(x.dtype).itemsize)))
def _reading(fn, leaves):
  # One blocking read; the scalars inside it are counted once, as its leaves.
  reads[0] += 1
  for x in leaves:
    _note(x)
  inside[0] += 1
  try:
    return fn()
  finally:
    inside[0] -= 1
# Every read-back of the package goes through models.sharding.to_host or
# jax.device_get (on CPU np.asarray reads a device buffer in place, unseen).
_to_host = models.sharding.to_host
def to_host(x):
  return _reading(lambda: _to_host(x), [x])
models.sharding.to_host = to_host
_device_get = jax.device_get
def device_get(tree):
  return _reading(lambda: _device_get(tree), jax.tree.leaves(tree))
jax.device_get = device_get
# Scalars read with float() / int() / bool().
_value = _array.ArrayImpl._value
def _counted(self):
  if self._npy_value is None and not self.shape and not inside[0]:
    reads[0] += 1
    d2h.append(([], 0))
  return _value.fget(self)
_array.ArrayImpl._value = property(_counted)
out_path = sys.argv[1]
atexit.register(lambda: json.dump({"d2h": d2h, "reads": reads[0]}, open(out_path, "w")))
jax.config.update("jax_transfer_guard", "log")
sys.argv = ["capo_jax.main"] + sys.argv[2:]
import runpy
runpy.run_module("capo_jax.main", run_name="__main__")
"""

_H2D = re.compile(r"host-to-device transfer: aval=ShapedArray\((\w+)\[([\d,]*)\]")
_SIZES = {
  "float32": 4,
  "int32": 4,
  "bool": 1,
  "uint32": 4,
  "float64": 8,
  "int64": 8,
  "bfloat16": 2,
  "int8": 1,
  "uint8": 1,
  "key<fry>": 8,
}


def _tally(items: list[tuple[list[int], int]]) -> dict[str, float]:
  arrays = [(s, b) for s, b in items if s]
  nbytes = lambda s, b: b * int(__import__("math").prod(s))  # noqa: E731
  return {
    "count": len(arrays),
    "bytes": sum(nbytes(s, b) for s, b in arrays),
    "scalars": len(items) - len(arrays),
  }


def run(checkout: str, warm_start_dir: str, steps: int) -> dict[str, dict[str, float]]:
  work = tempfile.mkdtemp(prefix="capo_transfers_")
  shutil.copytree(warm_start_dir, os.path.join(work, "warm_start"))
  d2h_file = os.path.join(work, "d2h.json")
  args = [
    sys.executable,
    "-c",
    _DRIVER,
    d2h_file,
    "--config=configs/demo.py",
    f"--workdir={work}",
    "--config.demo.methods=capo",
    f"--config.train.num_steps={steps}",
    "--config.demo.eval_questions=16",
    "--config.demo.eval_samples=2",
    "--config.checkpoint.every_steps=1000",
    "--config.log.samples_every_steps=0",
    "--config.compilation_cache_dir=",
  ]
  env = dict(
    os.environ,
    CAPO_HUGEPAGES="0",
    JAX_PLATFORMS="cpu",
    TF_CPP_MIN_LOG_LEVEL="0",
    PYTHONPATH=os.path.abspath(checkout),
  )
  proc = subprocess.run(args, cwd=checkout, env=env, capture_output=True, text=True, check=False)
  if proc.returncode:
    raise RuntimeError(f"{checkout}: the demo failed:\n{proc.stderr[-3000:]}")
  h2d = [
    ([int(x) for x in dims.split(",") if x], _SIZES.get(dt, 4))
    for dt, dims in _H2D.findall(proc.stderr)
  ]
  with open(d2h_file, encoding="utf-8") as f:
    got = json.load(f)
  shutil.rmtree(work, ignore_errors=True)
  return {
    "host_to_device": _tally(h2d),
    "device_to_host": {**_tally([tuple(x) for x in got["d2h"]]), "reads": got["reads"]},
  }


def per_step(checkout: str, warm_start_dir: str) -> dict[str, dict[str, float]]:
  two, four = run(checkout, warm_start_dir, 2), run(checkout, warm_start_dir, 4)
  return {d: {k: (four[d][k] - two[d][k]) / 2 for k in two[d]} for d in two}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--warm_start_dir", required=True)
  ap.add_argument("--checkout", action="append", default=[])
  ap.add_argument("--json", default="")
  args = ap.parse_args()
  out = {}
  for checkout in args.checkout or ["."]:
    out[checkout] = per_step(checkout, args.warm_start_dir)
    for d, t in out[checkout].items():
      reads = f", {t['reads']:5.1f} blocking reads" if "reads" in t else ""
      print(
        f"{checkout}: {d:<15} {t['count']:7.1f} arrays, {t['bytes'] / 1e6:8.3f} MB, "
        f"{t['scalars']:6.1f} scalars per step{reads}",
        flush=True,
      )
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
