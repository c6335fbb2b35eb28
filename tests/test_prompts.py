"""config.prompt: the system message, user template and chat-template options of every prompt.

The reference for a rendered prompt is transformers' own ``apply_chat_template`` on a
hand-built message list (or, for the paper's default, the SPEC's string verbatim).
"""

from __future__ import annotations

import json

import pytest
import transformers

import hf_utils
from capo_jax.data import prompts
from capo_jax.data import tokenizer as tk
from capo_jax.eval import cli as eval_cli
from capo_jax.run import setup
from capo_jax.run import spec as spec_lib
from capo_jax.runtime import run_record
from configs import common

# SPEC section 1, verbatim.
PAPER = (
  "<|im_start|>system\nPlease reason step by step, and put your final answer within "
  "\\boxed{}.<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
)
# Qwen3's generation prompt, cut down: enable_thinking=False writes an empty think block.
QWEN3_TEMPLATE = hf_utils.CHAT_TEMPLATE.replace(
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
  "{% if enable_thinking is defined and enable_thinking is false %}"
  "{{ '<think>\n\n</think>\n\n' }}{% endif %}"
  "{% if style is defined %}{{ '[' + style + ']' }}{% endif %}{% endif %}",
)
QUESTION = "What is $\\frac{1}{2} + x$ if {x} = 1?"  # braces of its own


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("tok")
  qwen3 = hf_utils.make_tokenizer()
  qwen3.chat_template = QWEN3_TEMPLATE
  qwen3.save_pretrained(root / "qwen3")
  return {
    "qwen2": str(hf_utils.make_tokenizer_dir(root / "qwen2")),
    "qwen3": str(root / "qwen3"),
    "none": str(hf_utils.make_tokenizer_dir(root / "none", chat_template=False)),
  }


def _spec(tok_dir: str, **prompt) -> spec_lib.RunSpec:
  c = common.shrink(common.get_base_config())
  c.tokenizer_path = tok_dir
  for k, v in prompt.items():
    c.prompt[k] = v
  return spec_lib.RunSpec.from_config(c, num_devices=1)


def test_the_default_is_the_papers_prompt(tok_dirs):
  assert common.SYSTEM_PROMPT == prompts.SYSTEM_PROMPT  # configs copy it (no JAX import)
  spec = _spec(tok_dirs["qwen2"])
  assert spec.prompt_format() == prompts.PromptFormat()
  for name in ("qwen2", "none"):  # the chat template and the written-out format agree
    tok = setup.tokenizer_for(_spec(tok_dirs[name]))
    assert tok.use_chat_template == (name == "qwen2")
    assert tok.render_prompt(QUESTION) == PAPER.replace("{question}", QUESTION)


@pytest.mark.parametrize(
  "fields,kwargs",
  [
    (
      dict(
        system="You are a careful solver.",
        template="Problem: {question}\nThink, then answer in \\boxed{}.",
      ),
      {},
    ),
    (dict(enable_thinking="off"), dict(enable_thinking=False)),
    (dict(enable_thinking="on", system=""), dict(enable_thinking=True)),
    (
      dict(chat_template_kwargs={"style": "terse"}, template="Q: {question} ({question})"),
      dict(style="terse"),
    ),
  ],
)
def test_rendered_prompt_is_transformers_apply_chat_template(tok_dirs, fields, kwargs):
  tok = setup.tokenizer_for(_spec(tok_dirs["qwen3"], **fields))
  system = fields.get("system", prompts.SYSTEM_PROMPT)
  user = fields.get("template", "{question}").replace("{question}", QUESTION)
  messages = ([{"role": "system", "content": system}] if system else []) + [
    {"role": "user", "content": user}
  ]
  hf = transformers.AutoTokenizer.from_pretrained(tok_dirs["qwen3"], local_files_only=True)
  want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
  assert tok.render_prompt(QUESTION) == want
  assert tok.encode_prompt(QUESTION) == tok.hf.encode(want, add_special_tokens=False)


def test_enable_thinking_off_writes_the_empty_think_block(tok_dirs):
  """A hand-written expectation, independent of transformers."""
  tok = setup.tokenizer_for(
    _spec(tok_dirs["qwen3"], system="S", template="Q: {question}", enable_thinking="off")
  )
  assert tok.render_prompt("1+1?") == (
    "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n"
    "Q: 1+1?<|im_end|>\n<|im_start|>assistant\n"
    "<think>\n\n</think>\n\n"
  )


def test_written_out_format_without_a_template(tok_dirs):
  tok = setup.tokenizer_for(
    _spec(
      tok_dirs["qwen2"], chat_template="off", system="", template="{question} Answer in \\boxed{}."
    )
  )
  assert not tok.use_chat_template
  assert tok.render_prompt("2+2?") == (
    "<|im_start|>user\n2+2? Answer in \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"
  )


@pytest.mark.parametrize(
  "fields,needle",
  [
    (dict(template="Solve this."), r"config\.prompt\.template='Solve this\.': .*\{question\}"),
    (dict(chat_template="maybe"), r"config\.prompt\.chat_template='maybe'"),
    (dict(enable_thinking="yes"), r"config\.prompt\.enable_thinking='yes'"),
    (dict(chat_template="off", enable_thinking="off"), r"config\.prompt\.chat_template='off'"),
    (
      dict(enable_thinking="on", chat_template_kwargs={"enable_thinking": False}),
      r"config\.prompt\.chat_template_kwargs=.*set it in one place",
    ),
    (dict(chat_template_kwargs={"tokenize": True}), r"config\.prompt\.chat_template_kwargs="),
  ],
)
def test_bad_prompt_fields_fail_at_start_naming_the_field(tok_dirs, fields, needle):
  with pytest.raises(spec_lib.ConfigError, match=needle):
    _spec(tok_dirs["qwen2"], **fields)


def test_template_options_need_a_chat_template(tok_dirs):
  for fields in (dict(enable_thinking="off"), dict(chat_template="on")):
    with pytest.raises(
      spec_lib.ConfigError,
      match=r"config\.prompt / config\.tokenizer_path="
      r".*no chat template",
    ):
      setup.tokenizer_for(_spec(tok_dirs["none"], **fields))


def test_config_json_records_the_prompt(tok_dirs, tmp_path):
  fields = dict(
    system="S",
    template="Q: {question}",
    enable_thinking="off",
    chat_template_kwargs={"style": "terse"},
  )
  spec = _spec(tok_dirs["qwen3"], **fields)
  run_record.record(spec.raw, str(tmp_path), resuming=False)
  recorded = json.loads((tmp_path / "config.json").read_text())["config"]["prompt"]
  assert recorded == {**fields, "chat_template": "auto"}
  # What an export and the evaluator read back is the same PromptFormat.
  assert prompts.PromptFormat.from_json(recorded) == spec.prompt_format()
  assert prompts.PromptFormat.from_json(spec.prompt_format().to_json()) == spec.prompt_format()


def test_evaluator_uses_the_recorded_prompt_unless_flags_say_otherwise(tok_dirs, tmp_path):
  """``python -m capo_jax.eval --policy=<export>``: the export's prompt.json, then flags."""
  _, model_dir = hf_utils.make_hf_model(tmp_path / "policy", vocab_size=400)
  tk.HFTokenizer.from_pretrained(tok_dirs["qwen3"]).hf.save_pretrained(model_dir)
  recorded = prompts.PromptFormat(system="S", template="Q: {question}", enable_thinking="off")
  (model_dir / prompts.PROMPT_FILE).write_text(json.dumps(recorded.to_json()))
  bench = tmp_path / "one.jsonl"
  bench.write_text(json.dumps({"id": "q", "problem": "What is 1 + 2?", "answer": "3"}) + "\n")
  flags = [
    f"--policy={model_dir}",
    f"--benchmarks={bench}",
    "--num_samples=1",
    "--max_new_tokens=2",
    "--batch_size=1",
    "--dtype=float32",
    "--no_progress",
    "--no_plots",
  ]
  got = eval_cli.main(flags + [f"--out={tmp_path / 'a'}"])["config"]["prompt"]
  assert prompts.PromptFormat.from_json(got) == recorded
  got = eval_cli.main(
    flags + [f"--out={tmp_path / 'b'}", "--system_prompt=", "--enable_thinking=auto"]
  )["config"]["prompt"]
  assert prompts.PromptFormat.from_json(got) == prompts.PromptFormat(
    system="", template="Q: {question}"
  )
  with pytest.raises(ValueError, match=r"--prompt_template: .*\{question\}"):
    eval_cli.main(flags + [f"--out={tmp_path / 'c'}", "--prompt_template=Solve."])
