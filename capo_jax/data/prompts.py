"""How a question becomes a prompt: the system message, the user template, chat-template options.

The default is the paper's (docs/algorithms.md, SPEC section 1): the Qwen2.5-Math
chain-of-thought system prompt and the question alone as the user message,

    <|im_start|>system\\nPlease reason step by step, and put your final answer within
    \\boxed{}.<|im_end|>\\n<|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n

rendered by the tokenizer's chat template when it has one ("auto"), else by the
same format written out here (``PROMPT_FORMAT``). ``config.prompt`` sets each
part (``capo_jax.run.spec`` builds a ``PromptFormat`` from it); the trainer, its
evaluation and ``python -m capo_jax.eval`` render with the same object, and every
HF export records it in ``prompt.json``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

# The Qwen2.5-Math chain-of-thought prompt the paper trains and evaluates with.
SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
_SYSTEM_BLOCK = "<|im_start|>system\n{system}<|im_end|>\n"
_USER_BLOCK = "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
PROMPT_FORMAT = _SYSTEM_BLOCK + _USER_BLOCK
QUESTION = "{question}"  # the one placeholder of a user template
MODES = ("auto", "on", "off")  # chat_template and enable_thinking
PROMPT_FILE = "prompt.json"  # what an export records of its prompt


class PromptError(ValueError):
  """A bad ``PromptFormat`` field; ``field`` names it (``spec.py`` prefixes ``config.prompt.``)."""

  def __init__(self, field: str, why: str) -> None:
    super().__init__(f"PromptFormat.{field}: {why}")
    self.field, self.why = field, why


@dataclasses.dataclass(frozen=True)
class PromptFormat:
  """A question -> prompt rule.

  Attributes:
    system: the system message; "" sends none (a chat template may then add
      its own default, as Qwen2.5's does).
    template: the user message; ``{question}`` is replaced by the question
      (plain text replacement, so LaTeX braces such as ``\\boxed{}`` need no escaping).
    chat_template: "auto" renders with the tokenizer's chat template when it has
      one, else ``PROMPT_FORMAT``; "on" requires the template; "off" always
      uses ``PROMPT_FORMAT``.
    enable_thinking: Qwen3's chat-template switch: "auto" passes nothing (the
      template's default), "on" / "off" pass ``enable_thinking=True`` / ``False``.
    chat_template_kwargs: further keyword arguments of ``apply_chat_template``,
      as sorted ``(name, value)`` pairs (JSON values).
  """

  system: str = SYSTEM_PROMPT
  template: str = QUESTION
  chat_template: str = "auto"
  enable_thinking: str = "auto"
  chat_template_kwargs: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self) -> None:
    if QUESTION not in self.template:
      raise PromptError(
        "template", f"{self.template!r} has no {QUESTION} placeholder (where the question goes)"
      )
    for field in ("chat_template", "enable_thinking"):
      if getattr(self, field) not in MODES:
        raise PromptError(field, f"expected one of {MODES}")
    names = [k for k, _ in self.chat_template_kwargs]
    if "enable_thinking" in names and self.enable_thinking != "auto":
      raise PromptError(
        "chat_template_kwargs",
        "sets enable_thinking, and so does enable_thinking; set it in one place",
      )
    for reserved in ("tokenize", "add_generation_prompt", "conversation"):
      if reserved in names:
        raise PromptError("chat_template_kwargs", f"{reserved!r} is the prompt renderer's")
    if self.chat_template == "off" and self.template_kwargs():
      raise PromptError(
        "chat_template",
        "'off' renders PROMPT_FORMAT, which takes no "
        f"chat-template options, but {sorted(self.template_kwargs())} are set",
      )

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> PromptFormat:
    """The inverse of ``to_json`` (a config's ``prompt`` section, or an export's prompt.json)."""
    d = dict(d)
    kwargs = d.pop("chat_template_kwargs", None) or {}
    return cls(**d, chat_template_kwargs=tuple(sorted(dict(kwargs).items())))

  def to_json(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "chat_template_kwargs": dict(self.chat_template_kwargs)}

  def template_kwargs(self) -> dict[str, Any]:
    """What ``apply_chat_template`` gets besides the messages and ``add_generation_prompt``."""
    kw = dict(self.chat_template_kwargs)
    if self.enable_thinking != "auto":
      kw["enable_thinking"] = self.enable_thinking == "on"
    return kw

  def user_message(self, question: str) -> str:
    return self.template.replace(QUESTION, question)

  def messages(self, question: str) -> list[dict[str, str]]:
    """The chat: the system message (when not "") and the user message."""
    system = [{"role": "system", "content": self.system}] if self.system else []
    return system + [{"role": "user", "content": self.user_message(question)}]

  def render_plain(self, question: str) -> str:
    """``PROMPT_FORMAT`` of the question, without a system block when ``system`` is ""."""
    # Concatenated, not str.format: questions and LaTeX carry braces of their own.
    head = _SYSTEM_BLOCK.replace("{system}", self.system) if self.system else ""
    return head + _USER_BLOCK.replace(QUESTION, self.user_message(question))

  def uses_template(self, hf_tokenizer: Any, name: str = "tokenizer") -> bool:
    """Whether prompts go through ``hf_tokenizer``'s chat template; raises ValueError
    when the settings need a template that ``hf_tokenizer`` lacks."""
    has = bool(getattr(hf_tokenizer, "chat_template", None))
    if self.chat_template == "off":
      return False
    if not has and (self.chat_template == "on" or self.template_kwargs()):
      why = (
        "chat_template='on'"
        if self.chat_template == "on"
        else f"chat-template options {sorted(self.template_kwargs())}"
      )
      raise ValueError(f"{name}: {why} but the tokenizer has no chat template")
    return has


def read_prompt_file(text: str, source: str) -> PromptFormat:
  """A ``PromptFormat`` from the JSON text of a prompt.json; errors name ``source``."""
  try:
    return PromptFormat.from_json(json.loads(text))
  except (ValueError, TypeError) as e:
    raise ValueError(f"{source}: not a prompt record ({e})") from e


# Command-line flags of ``python -m capo_jax.eval`` -> PromptFormat fields.
FLAGS = {
  "system_prompt": "system",
  "prompt_template": "template",
  "chat_template": "chat_template",
  "enable_thinking": "enable_thinking",
}


def add_flags(parser: Any) -> None:
  """The prompt flags of an argparse parser; each defaults to the policy's recorded prompt."""
  g = parser.add_argument_group(
    "prompt (default: the policy's recorded prompt, "
    f"{PROMPT_FILE} or its run's config.json, else the paper's)"
  )
  g.add_argument("--system_prompt", default=None, help="system message ('' sends none)")
  g.add_argument(
    "--prompt_template", default=None, help=f"user message; {QUESTION} is replaced by the question"
  )
  g.add_argument("--chat_template", default=None, choices=MODES)
  g.add_argument("--enable_thinking", default=None, choices=MODES, help="Qwen3's switch")


def from_flags(args: Any, recorded: Mapping[str, Any] | None) -> PromptFormat:
  """``recorded`` (a prompt.json dict, or None: the paper's) with the flags given on top."""
  base = PromptFormat.from_json(recorded) if recorded else PromptFormat()
  given = {
    field: getattr(args, flag)
    for flag, field in FLAGS.items()
    if getattr(args, flag, None) is not None
  }
  try:
    return dataclasses.replace(base, **given)
  except PromptError as e:
    flag = next((f for f, field in FLAGS.items() if field == e.field), e.field)
    raise ValueError(f"--{flag}: {e.why}") from e
