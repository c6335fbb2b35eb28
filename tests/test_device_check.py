"""benchmarks/device_check.py: the GPU roofline table, the summary, and its CPU smoke run
checked against hand-computed rooflines; benchmarks/threads.py: the thread pinning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks import device_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
  "kind, bandwidth, peak",
  [
    ("NVIDIA H100 80GB HBM3", 3.35e12, 989e12),
    ("NVIDIA H200", 4.8e12, 989e12),
    ("NVIDIA H100 PCIe", 2.0e12, 756e12),
    ("NVIDIA H100 NVL", 3.9e12, 835e12),
  ],
)
def test_roofline_by_device_name(kind, bandwidth, peak):
  assert device_check.roofline(kind) == {"bandwidth_bytes_per_s": bandwidth, "peak_flops": peak}


def test_roofline_unknown_device_names_it():
  with pytest.raises(ValueError, match="Tesla T4"):
    device_check.roofline("Tesla T4")


def test_summary_fractions_and_targets():
  decode = {
    "rounds": [
      {
        "useful_tokens_per_s": 1.0,
        "bound_own_tokens_per_s": 1.0,
        "bound_engine_reads_tokens_per_s": 1.0,
        "lengths": [1],
      },
      {
        "useful_tokens_per_s": 30.0,
        "bound_own_tokens_per_s": 50.0,
        "bound_engine_reads_tokens_per_s": 40.0,
        "lengths": [2, 4],
      },
    ]
  }
  train = {"mfu": 0.5, "tokens_per_s": 9.0, "step_median_s": 2.0}
  s = device_check.summarize(decode, train)
  assert s["decode"]["fraction_of_roofline"] == pytest.approx(0.6)  # the last round: 30 / 50
  assert s["decode"]["fraction_of_engine_reads_bound"] == pytest.approx(0.75)
  assert s["decode"]["mean_length"] == 3.0
  assert s["decode"]["met"] and s["train"]["met"]
  assert not device_check.summarize(None, {**train, "mfu": 0.44})["train"]["met"]
  assert "decode" not in device_check.summarize(None, None)


# Qwen2Config.tiny in bfloat16 (vocab 256, D 64, F 128, 2 layers, 4 heads of 16, 2 kv
# heads, tied): embedding 256*64 + per layer (q 64*64+64, k and v 64*32+32, o 64*64,
# MLP 3*64*128, 2 norms of 64) + final norm 64 = 90,688 params, 2 bytes each.
TINY_WEIGHT_BYTES = 2 * (256 * 64 + 2 * (4160 + 2 * 2080 + 4096 + 3 * 64 * 128 + 128) + 64)
TINY_KV_BYTES = 2 * 2 * 2 * 16 * 2  # k and v, 2 layers, 2 kv heads, 16 dims, bf16
H100 = (3.35e12, 989e12)


def _decode_bound_by_hand(lengths: list[int], prompt: int) -> float:
  """Useful tokens/s at the bandwidth bound when all rows decode at once, each reading its own
  cache: max(L) steps each reading the weights, sum over rows of P*l + l(l+1)/2 cached
  positions, the prompt cache read and written once per row."""
  kv_positions = sum(prompt * n + n * (n + 1) // 2 for n in lengths) + 2 * len(lengths) * prompt
  seconds = (max(lengths) * TINY_WEIGHT_BYTES + kv_positions * TINY_KV_BYTES) / H100[0]
  return sum(lengths) / seconds


def _train_flops_by_hand(prompts: list[int], completions: list[int]) -> float:
  """3 x the forward FLOPs per sequence of the smoke train model (vocab 1024, D 128, F 256,
  2 layers, 4 heads of 32, 2 kv heads): per layer q, o 2*128*128, k, v 2*128*64, MLP 3*128*256."""
  per_token = 2 * 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256)
  total = 0.0
  for p, c in zip(prompts, completions):
    t = p + c
    total += t * per_token + 2 * c * 128 * 1024 + 2 * 4 * t * t * 4 * 32
  return 3 * total


@pytest.mark.slow  # two tiny benchmarks with their compiles: ~1-2 min on 2 cores
def test_cpu_smoke_run_writes_the_fields_and_the_hand_rooflines(tmp_path):
  out = tmp_path / "check.json"
  report = device_check.main(["--cpu-smoke", "--out", str(out), "--budget-s", "400"])
  assert json.loads(out.read_text()) == json.loads(json.dumps(report))
  assert report["roofline_device"] == "NVIDIA H100 80GB HBM3"
  assert (report["bandwidth_bytes_per_s"], report["peak_flops"]) == H100
  assert {p: v["status"] for p, v in report["parts"].items()} == {"decode": "ok", "train": "ok"}

  decode = report["parts"]["decode"]["result"]
  assert decode["shape"]["weight_bytes"] == TINY_WEIGHT_BYTES
  assert decode["shape"]["kv_bytes"] == TINY_KV_BYTES
  rnd = decode["rounds"][-1]
  bound = _decode_bound_by_hand(rnd["lengths"], decode["prompt_len"])
  assert rnd["bound_own_tokens_per_s"] == pytest.approx(bound, rel=1e-9)
  summary = report["summary"]
  assert summary["decode"]["fraction_of_roofline"] == pytest.approx(
    rnd["useful_tokens_per_s"] / bound, rel=1e-9
  )

  train = report["parts"]["train"]["result"]
  flops = _train_flops_by_hand(train["prompt_lengths"], train["completion_lengths"])
  assert train["model_flops_per_step"] == pytest.approx(flops, rel=1e-12)
  assert summary["train"]["mfu"] == pytest.approx(flops / train["step_median_s"] / H100[1])
  assert set(summary["train"]) == {"mfu", "tokens_per_s", "step_median_s", "target", "met"}


def test_threads_pin_one_cpu_one_busy_thread_each():
  """pin(1) before JAX starts: a jitted matmul and a torch matmul each keep one thread busy
  and the process may use one CPU (measured in a fresh process: pinning needs JAX unstarted)."""
  code = textwrap.dedent("""
    import json
    from benchmarks import threads
    threads.pin(1)
    print(json.dumps(threads.check(1)))
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  out = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
  )
  check = json.loads(out.stdout.strip().splitlines()[-1])
  assert check == {
    "threads": 1,
    "cpus": 1,
    "torch_threads": 1,
    "jax_busy_threads": 1,
    "torch_busy_threads": 1,
  }


def test_threads_pin_refuses_after_jax_started():
  code = textwrap.dedent("""
    import jax
    jax.devices()
    from benchmarks import threads
    try:
      threads.pin(1)
    except RuntimeError as e:
      print("refused:", e)
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  out = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
  )
  assert "refused: benchmarks.threads.pin: JAX's backend already started" in out.stdout


def test_shell_script_refuses_a_missing_python_clearly(tmp_path):
  out = subprocess.run(
    [os.path.join(REPO, "benchmarks", "device_check.sh"), str(tmp_path / "no" / "python")],
    env=dict(os.environ, OUT=str(tmp_path)),
    capture_output=True,
    text=True,
    check=False,
  )
  assert out.returncode == 2
  assert "no Python at" in out.stderr and "jax[cuda]" in out.stderr
