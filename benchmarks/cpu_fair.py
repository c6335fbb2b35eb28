"""The two CPU peer benchmarks on equal threads, written as records of docs/results/benchmarks.json.

  python -m benchmarks.cpu_fair --tag before               # 2 threads each side (the default)
  python -m benchmarks.cpu_fair --tag after --threads 1    # after a change; 1 thread each
  python -m tools.results_tables                           # then rewrite docs/benchmarks.md

Runs ``benchmarks/sampling.py`` (capo_jax vs transformers ``generate``) and
``benchmarks/train_step.py`` (capo_jax vs a PyTorch loop), each in its own
process with ``--threads`` (both sides pinned to the same CPUs and thread
count: ``benchmarks/threads.py``) and an even number of rounds in alternated
order, then adds or replaces the records ``sampler_vs_transformers_<N>t_<tag>``
and ``train_step_vs_torch_<N>t_<tag>``: the median ratio of tokens/s (> 1:
capo_jax faster) with the range of the per-round ratios, the date, the CPU, the
load average before and after, and the commit. ``--no-record`` prints only.
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
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
RECORDS = REPO / "docs" / "results" / "benchmarks.json"
# The record each new one is filed in front of (the same claim measured earlier).
EARLIER = {"sampler": "sampler_vs_transformers", "train": "train_step_vs_torch"}


def _machine(load_before: float, box: str) -> str:
  """ "<n>-core <CPU model>, <box> (load average a-b)" for the record's machine field."""
  model = "CPU"
  with open("/proc/cpuinfo", encoding="utf-8") as f:
    for line in f:
      if line.startswith("model name"):
        model = line.split(":", 1)[1].strip().replace("(R)", "").replace(" Processor", "")
        break
  load_after = os.getloadavg()[0]
  lo, hi = sorted((load_before, load_after))
  return f"{os.cpu_count()}-core {model}, {box} (load average {lo:.1f}-{hi:.1f})"


def _commit() -> str:
  out = subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
  )
  return out.stdout.strip() or "unknown"


def _run(module: str, args: list[str], json_path: str) -> dict[str, Any]:
  cmd = [sys.executable, "-m", module, *args, "--json", json_path]
  print("running:", " ".join(cmd), flush=True)
  subprocess.run(cmd, cwd=REPO, check=True)
  return json.loads(pathlib.Path(json_path).read_text(encoding="utf-8"))


def _ratio(res: dict[str, Any], key: str) -> str:
  lo, hi = res[f"ratio_range_{key}"]
  return f"{res[f'ratio_{key}']:.2f}x (rounds {lo:.2f}-{hi:.2f}x)"


def _busy(check: dict[str, int]) -> str:
  return (
    f"{check['cpus']} CPUs by affinity, torch {check['torch_threads']} intra-op threads; busy "
    f"threads of a matmul: jax {check['jax_busy_threads']}, torch {check['torch_busy_threads']}"
  )


def sampler_record(res: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
  """The sampler's record from ``benchmarks/sampling.py --json``."""
  n = res["threads"]["threads"]
  rate = lambda who, mode: f"{res[f'{who}_{mode}_tokens_per_s']:,.0f}"  # noqa: E731
  return dict(
    id=f"sampler_vs_transformers_{n}t_{base['tag']}",
    what=f"sampler vs transformers `generate`, {n} thread(s) each ({base['tag']})",
    setup=(
      f"CPU, 27.7M-param Qwen2, {res['batch']} prompts x {res['prompt_len']}, "
      f"{res['new_tokens']} new tokens, {res['rounds']} rounds in alternated order; "
      f"commit {base['commit']}"
    ),
    command=base["command"],
    date=base["date"],
    machine=base["machine"],
    result=(
      f"T = 1 sampling {_ratio(res, 'vs_transformers_sample')}, greedy "
      f"{_ratio(res, 'vs_transformers_greedy')}"
    ),
    notes=(
      f"Tokens/s, capo_jax vs transformers: T = 1 {rate('capo_jax', 'sample')} vs "
      f"{rate('transformers', 'sample')}, greedy {rate('capo_jax', 'greedy')} vs "
      f"{rate('transformers', 'greedy')}; greedy row 0 equal to ours: "
      f"{res['greedy_row0_agreement']['transformers']:.0%}. Both sides {_busy(res['threads'])}. "
      "The machine was shared with other engineers' jobs, so absolute figures move; the "
      "per-round ratios of alternated runs are what counts."
    ),
    link=None,
  )


def train_record(res: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
  """The train step's record from ``benchmarks/train_step.py --json``."""
  n = res["threads"]["threads"]
  s = res["step_s"]
  tokens = res["batch"] * (res["prompt"] + res["completion"])
  return dict(
    id=f"train_step_vs_torch_{n}t_{base['tag']}",
    what=f"train step vs PyTorch, {n} thread(s) each ({base['tag']})",
    setup=(
      f"CPU, 27.7M params, {res['batch']} x {res['prompt'] + res['completion']} tokens, same "
      f"loss + AdamW, {res['repeats']} rounds of {res['block']}-step blocks in alternated "
      f"order; commit {base['commit']}"
    ),
    command=base["command"],
    date=base["date"],
    machine=base["machine"],
    result=f"{_ratio(res, 'vs_torch')} the tokens/s of torch",
    notes=(
      f"Per step (medians, each block's first step left out): capo_jax {s['capo_jax']:.2f} s "
      f"vs torch {s['torch']:.2f} s ({tokens / s['capo_jax']:,.0f} vs "
      f"{tokens / s['torch']:,.0f} tokens/s); float32 matmul peak measured alongside "
      f"{res['matmul_peak_flops'] / 1e9:.0f} GFLOP/s; first-step losses "
      f"{res['loss_diff']:.0e} apart. Both sides {_busy(res['threads'])}. The machine was "
      "shared with other engineers' jobs, so absolute figures move; the per-round ratios of "
      "alternated runs are what counts."
    ),
    link=None,
  )


def with_result_in_notes(record: dict[str, Any]) -> dict[str, Any]:
  """The record with its notes opening on its result (tests/test_docs.py: a result cell's
  figures are in the notes)."""
  return {**record, "notes": f"{record['result']}. {record['notes']}"}


def upsert(records: list[dict[str, Any]], new: dict[str, Any], before_id: str) -> None:
  """Replaces the record with ``new``'s id, or files ``new`` in front of ``before_id``."""
  ids = [r["id"] for r in records]
  if new["id"] in ids:
    records[ids.index(new["id"])] = new
  else:
    records.insert(ids.index(before_id) if before_id in ids else len(records), new)


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tag", required=True, help="what this checkout is, e.g. before / after")
  ap.add_argument("--threads", type=int, default=2, help="CPUs and threads of each side")
  ap.add_argument("--rounds", type=int, default=6, help="sampler rounds (even: as many orders)")
  ap.add_argument("--repeats", type=int, default=4, help="train-step rounds (even)")
  ap.add_argument("--box", default="shared with other engineers' jobs", help="for the record")
  ap.add_argument("--only", choices=("sampler", "train"), help="one of the two benchmarks")
  ap.add_argument("--no-record", action="store_true", help="print, write no record")
  args = ap.parse_args(argv)
  load_before, commit = os.getloadavg()[0], _commit()
  results: dict[str, dict[str, Any]] = {}
  t = ["--threads", str(args.threads)]
  with tempfile.TemporaryDirectory() as tmp:
    if args.only in (None, "sampler"):
      rounds = ["--rounds", str(args.rounds)]
      results["sampler"] = _run("benchmarks.sampling", t + rounds, f"{tmp}/s.json")
    if args.only in (None, "train"):
      repeats = ["--repeats", str(args.repeats)]
      results["train"] = _run("benchmarks.train_step", t + repeats, f"{tmp}/t.json")
  command = (
    f"python -m benchmarks.cpu_fair --tag {args.tag} --threads {args.threads} --rounds "
    f"{args.rounds} --repeats {args.repeats}"
  )
  base = dict(
    tag=args.tag,
    commit=commit,
    command=command,
    date=datetime.date.today().isoformat(),
    machine=_machine(load_before, args.box),
  )
  writers = {"sampler": sampler_record, "train": train_record}
  records = json.loads(RECORDS.read_text(encoding="utf-8"))
  for name, res in results.items():
    rec = with_result_in_notes(writers[name](res, base))
    print(json.dumps(rec, indent=1))
    upsert(records, rec, EARLIER[name])
  if not args.no_record:
    RECORDS.write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {RECORDS.relative_to(REPO)}; now run: python -m tools.results_tables")


if __name__ == "__main__":
  main()
