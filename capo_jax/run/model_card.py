"""The model card (README.md) and prompt record (prompt.json) of every HF export.

Each export (``<workdir>/exports/step_<N>/``, ``<workdir>/export_hf/``) carries a
hub model card: YAML front matter (``base_model``, ``library_name``, ``tags``), the
run (method and its settings, base model, steps, the config's SHA-256, the
package version and commit), the prompt the policy was trained with, and the
latest evaluation during training at or before the export's step (accuracy,
AUC-mean, AURC per benchmark; ``<workdir>/eval/step_<N>/results.json``), with
the step-0 evaluation of the base policy beside it. A checkpoint uploaded with
``hf upload`` then shows its calibration numbers on its hub page.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from capo_jax.data.prompts import PROMPT_FILE, PromptFormat
from capo_jax.eval import report
from capo_jax.run.spec import RunSpec
from capo_jax.runtime import fs, run_record
from models import hub

log = logging.getLogger(__name__)

CARD_FILE = "README.md"
EVAL_DIR = "eval"  # train_eval writes <workdir>/eval/step_<N>/results.json
METHODS = {
  "capo": "CAPO",
  "grpo": "GRPO",
  "dr_grpo": "Dr. GRPO",
  "gspo": "GSPO",
  "codapo": "CoDaPO",
  "cde": "CDE",
  "simko": "SimKO",
}
TAGS = ("capo-jax", "reinforcement-learning", "calibration", "math")


def config_hash(raw: Mapping[str, Any]) -> str:
  """SHA-256 of the resolved config as canonical JSON (sorted keys, no spaces): the
  ``config`` of ``<workdir>/config.json`` hashes to the same value."""
  text = json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def eval_steps(workdir: str) -> list[int]:
  """Steps with an evaluation (``<workdir>/eval/step_<N>/results.json``), ascending."""
  root = fs.join(workdir, EVAL_DIR)
  if not fs.is_dir(root):
    return []
  steps = [
    int(m.group(1)) for p in fs.path(root).iterdir() if (m := re.fullmatch(r"step_(\d+)", p.name))
  ]
  return sorted(s for s in steps if fs.is_file(fs.join(root, f"step_{s:06d}", "results.json")))


def load_eval(workdir: str, step: int) -> dict[str, Any]:
  return report.load_results(fs.join(workdir, EVAL_DIR, f"step_{step:06d}"))


def _num(value: Any) -> str:
  return "n/a" if value is None else f"{float(value):.4f}"


def eval_table(results: Mapping[str, Any]) -> str:
  """Markdown: benchmark, questions, samples per question, accuracy (mean@k over the
  k samples of each question), AUC-mean, AURC; 4 decimals, "n/a" where undefined."""
  lines = [
    "| benchmark | questions | samples | accuracy | AUC-mean | AURC |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for name, r in results["benchmarks"].items():
    k = r["samples_per_question"][0]
    lines.append(
      f"| {name} | {r['n_questions']} | {k} | {_num(r.get(f'mean@{k}'))} | "
      f"{_num(r.get('auc_mean'))} | {_num(r.get('aurc'))} |"
    )
  return "\n".join(lines)


def _front_matter(spec: RunSpec) -> str:
  lines = ["---"]
  base = spec.model.hf_path
  # The hub links base_model to a model page; a local or gs:// path would be no link.
  if base and hub.is_hub_id(base) and not os.path.exists(base):
    lines.append(f"base_model: {base}")
  lines += ["library_name: transformers", "pipeline_tag: text-generation", "tags:"]
  lines += [f"- {t}" for t in (*TAGS, spec.algo.name.replace("_", "-"))]
  return "\n".join(lines + ["---"])


def _run_rows(spec: RunSpec, workdir: str, step: int) -> list[tuple[str, str]]:
  est = spec.estimator()
  if not dataclasses.is_dataclass(est):
    raise TypeError(f"model_card: estimator {type(est).__name__} is not a dataclass (Estimator)")
  hp = ", ".join(f"{f.name}={getattr(est, f.name)}" for f in dataclasses.fields(est))
  method = (
    f"{METHODS.get(spec.algo.name, spec.algo.name)}: `algo.name={spec.algo.name}`"
    + (f", {hp}" if hp else "")
    + (", noise mask on" if spec.uses_noise_mask else "")
  )
  base = spec.model.hf_path or (
    f"random weights of preset `{spec.model.preset}`"
    if spec.model.random_init
    else "given by the caller"
  )
  rows = [
    ("method", method),
    ("base model", base),
    (
      "steps",
      f"{step} of {spec.train.num_steps} RL steps ({spec.rollout.num_prompts} "
      f"questions x {spec.rollout.num_samples} samples each)",
    ),
    ("training data", f"`{spec.data.train}`"),
    (
      "config",
      f"sha256 `{config_hash(spec.raw)}` of the resolved config "
      f"(`config` of the run's config.json)",
    ),
  ]
  path = fs.join(workdir, run_record.CONFIG_FILE)
  if fs.is_file(path):
    rec = json.loads(fs.read_text(path))
    rows.append(
      ("capo-jax", f"{rec.get('capo_jax_version')}, commit {rec.get('git_commit') or 'unknown'}")
    )
  if spec.model.lora_rank:
    rows.append(
      (
        "LoRA",
        f"rank {spec.model.lora_rank}, alpha {spec.model.lora_alpha}, merged into these weights",
      )
    )
  return rows


def _prompt_section(prompt: PromptFormat | None) -> list[str]:
  if prompt is None:
    return []
  out = [
    "## Prompt",
    "",
    f"Trained with this prompt (`{PROMPT_FILE}` in this directory); prompt the model the same way:",
    "",
    "- system: " + (f"`{prompt.system}`" if prompt.system else "none"),
    f"- user: `{prompt.template}`",
    f"- chat template: {prompt.chat_template}",
  ]
  if prompt.template_kwargs():
    out.append(f"- chat-template options: `{json.dumps(prompt.template_kwargs())}`")
  return out + [""]


def model_card(spec: RunSpec, workdir: str, step: int, prompt: PromptFormat | None) -> str:
  """The README.md of the export of ``step``: run, prompt, latest evaluation (at or
  before ``step``) and the step-0 evaluation of the base policy."""
  name = os.path.basename(str(workdir).rstrip("/")) or "policy"
  method = METHODS.get(spec.algo.name, spec.algo.name)
  of = f" of {spec.model.hf_path}" if spec.model.hf_path else ""
  out = [
    _front_matter(spec),
    "",
    f"# {name}: {method} fine-tune{of}, step {step}",
    "",
    "A policy trained with capo-jax by reinforcement learning "
    "with verifiable math rewards. Calibration numbers: AUC-mean is the mean over "
    "questions of the AUC of the confidence score (mean token log-prob) at telling "
    "right samples from wrong ones (higher is better); AURC is the area under the "
    "risk-coverage curve (lower is better).",
    "",
    "## Run",
    "",
    "| | |",
    "|---|---|",
  ]
  out += [f"| {k} | {v} |" for k, v in _run_rows(spec, workdir, step)]
  out += [""] + _prompt_section(prompt) + ["## Evaluation", ""]
  steps = [s for s in eval_steps(workdir) if s <= step]
  if not steps:
    out += [
      "No evaluation during training reached this step (`eval.every_steps`="
      f"{spec.eval.every_steps}); `python -m capo_jax.eval --policy=DIR` evaluates it."
    ]
  else:
    last = steps[-1]
    e = spec.eval
    out += [
      f"At step {last} (`eval/step_{last:06d}/results.json`), sampled at temperature "
      f"{e.temperature} with at most {e.max_new_tokens} new tokens"
      + (f", the first {e.limit} questions of each benchmark" if e.limit else "")
      + "; accuracy is mean@k over the k samples of each question.",
      "",
      eval_table(load_eval(workdir, last)),
    ]
    if steps[0] == 0 and last != 0:
      out += [
        "",
        "At step 0 (the base policy, the same sampling settings):",
        "",
        eval_table(load_eval(workdir, 0)),
      ]
  return "\n".join(out) + "\n"


def export_files(spec: RunSpec, workdir: str, step: int, tokenizer: Any) -> dict[str, str]:
  """``{file name: text}`` an export adds: README.md, and prompt.json when the tokenizer
  renders a ``PromptFormat`` (a HF tokenizer; the demo's renders its own)."""
  prompt = getattr(tokenizer, "prompt", None)
  prompt = prompt if isinstance(prompt, PromptFormat) else None
  files = {CARD_FILE: model_card(spec, workdir, step, prompt)}
  if prompt is not None:
    files[PROMPT_FILE] = json.dumps(prompt.to_json(), indent=1) + "\n"
  return files
