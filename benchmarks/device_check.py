"""One GPU check: the rollout engine's share of its bandwidth roofline, the packed train MFU.

  benchmarks/device_check.sh [PYTHON]                    # on the GPU machine: JSON under $OUT
  python -m benchmarks.device_check --out r.json         # the same without the shell's checks
  python -m benchmarks.device_check --cpu-smoke --out /tmp/r.json   # tiny, on CPU (a test)

Two parts, each the existing benchmark in its own process (so each gets the
whole GPU, and a part that fails or runs out of time leaves the other):

- decode: ``benchmarks/sampling_gpu.py --lengths`` at the length model of
  ``tools/rollout_sim.py`` (1,024 rows, prompt 512, cap 3,072, mean length 867,
  here geometric: see its ``long_tailed``), engine W = 256, Qwen2.5-1.5B shape
  in bfloat16, random weights. Its figure: useful tokens/s over the bandwidth
  roofline of the same schedule with each row reading only its own cache
  (weights once per step + own KV + prompt copies, over the HBM bandwidth).
  Target >= 0.60.
- train: ``benchmarks/train_step_gpu.py --pack --attention auto``: 32
  sequences of prompt 512 + geometric completions (mean 768, cap 3,072),
  packed into rows of 3,584 (4 per micro-batch), AdamW, remat; MFU = model FLOPs of the real tokens
  per second over the dense bf16 peak. Target >= 0.45.

The roofline's bandwidth and peak come from the device's name (``DEVICES``,
datasheet figures); an unknown GPU stops the check unless ``--device-kind``
names a known one. Written: ``--out`` with the summary, each part's status and
its full JSON. ``--budget-s`` bounds the whole run (device_check.sh: < 8 min).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
# (words the device name contains, HBM bytes/s, dense bf16 FLOP/s), the first match wins.
DEVICES: tuple[tuple[tuple[str, ...], float, float], ...] = (
  (("H200",), 4.8e12, 989e12),
  (("H100", "PCIE"), 2.0e12, 756e12),
  (("H100", "NVL"), 3.9e12, 835e12),
  (("H100",), 3.35e12, 989e12),  # SXM
)
TARGETS = {"decode": 0.60, "train": 0.45}
# Each part's share of --budget-s (the device probe takes the rest).
SHARES = {"decode": 0.52, "train": 0.40}
DECODE_ARGS = (
  "--lengths --prompts 128 --num-samples 8 --prompt-len 512 --new-tokens 3072 "
  "--mean-length 867 --max-active-rows 256 --rounds 1"
).split()
# Log-prob chunks of 256 positions: the padded old-policy pass's [32, 256, V] float32 logits
# are 5 GB (512: 10 GB, on an H100 beside 18 GB of float32 state and Adam moments).
TRAIN_ARGS = (
  "--pack --attention auto --batch 32 --prompt 512 --completion 3072 --chunk 256 --steps 3"
).split()
# The CPU smoke run: the same scripts' tiny shapes; W = all rows, so the decode roofline
# is the lockstep schedule's, which a test recomputes by hand.
SMOKE_ARGS = {
  "decode": "--lengths --small --rounds 1 --max-active-rows 16",
  "train": "--pack --small",
}


def roofline(device_kind: str) -> dict[str, float]:
  """HBM bandwidth and dense bf16 peak of a GPU by its name; ValueError if unknown."""
  name = device_kind.upper()
  for words, bandwidth, peak in DEVICES:
    if all(w in name for w in words):
      return {"bandwidth_bytes_per_s": bandwidth, "peak_flops": peak}
  known = ", ".join(" ".join(w) for w, _, _ in DEVICES)
  raise ValueError(
    f"benchmarks/device_check.py: no roofline for device {device_kind!r} (known: {known}); "
    "pass --device-kind with the nearest known one"
  )


def _run(part: str, args: list[str], timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
  """Runs one part's benchmark with ``--out``; its JSON, or why there is none."""
  module = {"decode": "benchmarks.sampling_gpu", "train": "benchmarks.train_step_gpu"}[part]
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / f"{part}.json"
    cmd = [sys.executable, "-m", module, *args, "--out", str(out)]
    print(f"[{part}] {' '.join(cmd)} (timeout {timeout_s:.0f} s)", flush=True)
    t0 = time.perf_counter()
    try:
      proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout_s, check=False)
      status = "ok" if proc.returncode == 0 else f"failed with exit code {proc.returncode}"
    except subprocess.TimeoutExpired:
      status = f"timed out after {timeout_s:.0f} s"
    wall = time.perf_counter() - t0
    result = json.loads(out.read_text(encoding="utf-8")) if out.exists() else None
  print(f"[{part}] {status} in {wall:.0f} s", flush=True)
  return {"status": status, "wall_s": wall, "result": result}


def summarize(decode: dict | None, train: dict | None) -> dict[str, Any]:
  """The two figures against their targets (None where a part gave no result)."""
  out: dict[str, Any] = {}
  if decode and decode["rounds"]:
    rnd = decode["rounds"][-1]  # the last timed rollout (the first call compiled)
    frac = rnd["useful_tokens_per_s"] / rnd["bound_own_tokens_per_s"]
    out["decode"] = {
      "useful_tokens_per_s": rnd["useful_tokens_per_s"],
      "roofline_tokens_per_s": rnd["bound_own_tokens_per_s"],
      "fraction_of_roofline": frac,
      "fraction_of_engine_reads_bound": rnd["useful_tokens_per_s"]
      / rnd["bound_engine_reads_tokens_per_s"],
      "mean_length": sum(rnd["lengths"]) / len(rnd["lengths"]),
      "target": TARGETS["decode"],
      "met": frac >= TARGETS["decode"],
    }
  if train:
    out["train"] = {
      "mfu": train["mfu"],
      "tokens_per_s": train["tokens_per_s"],
      "step_median_s": train["step_median_s"],
      "target": TARGETS["train"],
      "met": train["mfu"] >= TARGETS["train"],
    }
  return out


def _probe(env: dict[str, str]) -> tuple[str, str]:
  """The first device's platform and name, from a process of its own (that frees the GPU)."""
  code = "import jax; d = jax.devices()[0]; print(d.platform); print(d.device_kind)"
  out = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
  )
  platform, kind = out.stdout.strip().splitlines()[-2:]
  return platform, kind


def main(argv: list[str] | None = None) -> dict[str, Any]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True, help="the JSON to write")
  ap.add_argument("--budget-s", type=float, default=420.0, help="the whole run's time")
  ap.add_argument("--device-kind", help="use this device's roofline (default: the GPU's name)")
  ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (a test)")
  args = ap.parse_args(argv)
  t0 = time.perf_counter()
  env = dict(os.environ, PYTHONPATH=str(REPO))
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # one process at a time
  if args.cpu_smoke:  # no device to probe: the parts run on the CPU
    env["JAX_PLATFORMS"] = "cpu"
  platform, kind = ("cpu", "cpu") if args.cpu_smoke else _probe(env)
  if platform != "gpu" and not args.cpu_smoke:
    raise SystemExit(
      f"benchmarks/device_check.py: the first device is {platform} ({kind}), not a GPU; "
      "use a Python with jax[cuda] (or --cpu-smoke for the tiny CPU run)"
    )
  roof_name = args.device_kind or ("NVIDIA H100 80GB HBM3" if args.cpu_smoke else kind)
  roof = roofline(roof_name)
  bw = ["--bandwidth", repr(roof["bandwidth_bytes_per_s"])]
  peak = ["--peak", repr(roof["peak_flops"])]
  part_args = {
    "decode": (SMOKE_ARGS["decode"].split() if args.cpu_smoke else DECODE_ARGS) + bw,
    "train": (SMOKE_ARGS["train"].split() if args.cpu_smoke else TRAIN_ARGS) + peak,
  }
  parts = {}
  for part in ("decode", "train"):
    left = args.budget_s - (time.perf_counter() - t0)
    timeout = min(SHARES[part] * args.budget_s, left - 5)
    parts[part] = (
      _run(part, part_args[part], timeout, env)
      if timeout > 10
      else {"status": "skipped: no time left", "wall_s": 0.0, "result": None}
    )
  report = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "platform": platform,
    "device_kind": kind,
    "roofline_device": roof_name,
    **roof,
    "cpu_smoke": args.cpu_smoke,
    "summary": summarize(parts["decode"]["result"], parts["train"]["result"]),
    "parts": {p: {**v, "args": part_args[p]} for p, v in parts.items()},
    "wall_s": time.perf_counter() - t0,
  }
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
  print(json.dumps({"summary": report["summary"], "wall_s": report["wall_s"]}, indent=1))
  print(f"wrote {out}")
  return report


if __name__ == "__main__":
  main()
