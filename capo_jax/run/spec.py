"""The run description: an ml_collections config translated once into a frozen ``RunSpec``.

``RunSpec.from_config`` is called at the run's entry point (``capo_jax.main``,
``tools/aot_tpu.py``, the demo's study); everything below takes the spec,
or the section of it it needs, never the ConfigDict. Every check of the
configuration happens at that call (a field's own here, the checks across fields in
``capo_jax.run.checks``), with a message that names the field and the value:
nothing fails an hour into a run because of a typo in a config file.

The sections mirror the config's (``configs/common.py`` documents each field):
``model``, ``data``, ``rollout``, ``algo``, ``loss``, ``optim``, ``train``,
``mesh``, ``checkpoint``, ``log``, ``eval``, ``prompt``. A field's name is the same in
both, so ``spec.rollout.num_samples`` is ``--config.rollout.num_samples``.
Sections the library does not know (the demo's ``demo``) are kept, as plain
dicts, in ``RunSpec.extra`` for their owner to translate.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections

from capo_jax.data import reward_fns as reward_lib
from capo_jax.data.prompts import PromptError, PromptFormat
from capo_jax.rl import algorithms, losses, mismatch
from capo_jax.rl import rollout as rollout_lib  # the name rollout is a RunSpec field
from capo_jax.rl.algorithms import ALGORITHMS
from capo_jax.rl.optim import OptimConfig
from capo_jax.rl.train_state import TrainConfig
from capo_jax.run import checks
from capo_jax.run.sections import (
  SECTIONS,
  TOP_LEVEL,
  Algo,
  Checkpoint,
  ConfigError,
  Data,
  Eval,
  Log,
  Loss,
  Mesh,
  Model,
  Optim,
  Prompt,
  Reward,
  Rollout,
  Train,
  build,
  estimator_fields,
  fail,
  loss_fields,
  section,
)
from capo_jax.runtime import fs
from capo_jax.runtime import mesh as mesh_lib
from models import hub, lora
from models.config import PRESETS, Qwen2Config


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One run, validated. ``raw`` is the resolved config as JSON (``config.json``)."""

  seed: int
  tokenizer_path: str
  compilation_cache_dir: str
  model: Model
  data: Data
  rollout: Rollout
  algo: Algo
  loss: Loss
  optim: Optim
  train: Train
  mesh: Mesh
  checkpoint: Checkpoint
  log: Log
  eval: Eval
  reward: Reward
  prompt: Prompt
  raw: Mapping[str, Any] = dataclasses.field(compare=False, repr=False)
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @classmethod
  def from_config(
    cls,
    c: ml_collections.ConfigDict | Mapping[str, Any],
    *,
    num_devices: int | None = None,
    policy_given: bool = False,
  ) -> RunSpec:
    """Translates and validates a run config; raises ConfigError naming the first bad field.

    ``policy_given``: the caller supplies the initial policy (the demo's warm
    start, the AOT compile's abstract params), so no model source is needed.
    ``num_devices``: the devices the mesh spans (default: ``jax.device_count()``).
    """
    raw = (
      json.loads(c.to_json_best_effort())
      if isinstance(c, ml_collections.ConfigDict)
      else json.loads(json.dumps(dict(c)))
    )
    missing = [k for k in (*TOP_LEVEL, *SECTIONS) if k not in raw]
    if missing:
      fail(missing[0], None, "missing (start run files from configs/common.get_base_config())")
    extra = {k: v for k, v in raw.items() if k not in TOP_LEVEL and k not in SECTIONS}
    spec = cls(
      **{k: raw[k] for k in TOP_LEVEL},
      **{k: section(k, cls_, raw[k]) for k, cls_ in SECTIONS.items()},
      raw=raw,
      extra=extra,
    )
    spec.validate(num_devices=num_devices, policy_given=policy_given)
    return spec

  def with_overrides(self, overrides: Mapping[str, Any], **kwargs: Any) -> RunSpec:
    """A new spec with dotted fields (``{"algo.mask": "off"}``) changed, validated again."""
    raw = json.loads(json.dumps(self.raw))
    for dotted, value in overrides.items():
      *path, last = dotted.split(".")
      node = raw
      for key in path:
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
          fail(dotted, value, "no such config section")
      if last not in node:
        fail(dotted, value, "no such config field")
      node[last] = list(value) if isinstance(value, tuple) else value
    return RunSpec.from_config(raw, **kwargs)

  def validate(self, *, num_devices: int | None = None, policy_given: bool = False) -> None:
    """Raises ConfigError naming the first bad field (the checks: ``capo_jax.run.checks``)."""
    if self.algo.name not in ALGORITHMS:
      fail("algo.name", self.algo.name, f"unknown algorithm; expected one of {tuple(ALGORITHMS)}")
    checks.batch(self.rollout, self.train)
    checks.algo(self.algo)
    checks.reward(self.reward, self.checker, self.algo.name, self.rollout.max_new_tokens)
    self.mismatch_spec()
    checks.model(self.model, self.tokenizer_path, policy_given)
    if self.model.shared_prompts and not self.train.pack:
      fail("model.shared_prompts", True, "needs packed rows (config.train.pack=True)")
    if self.model.shared_prompt_cols < 128 or self.model.shared_prompt_cols % 128:
      fail("model.shared_prompt_cols", self.model.shared_prompt_cols, "expected a multiple of 128")
    self.lora_config()
    checks.reduce_once(self.mesh, lora=self.lora_config() is not None)
    self.prompt_format()
    checks.outputs(self.data, self.eval, self.log, self.checkpoint)
    n = jax.device_count() if num_devices is None else num_devices
    shards = checks.mesh(self.mesh.sizes(), n)
    checks.logprob_data_parallel(
      self.mesh, self.lora_config() is not None, self.logprob_rows_per_call, n, self.train.pack
    )
    checks.row_shards(self.packing_shape()[1], shards)
    # The typed algorithms check their fields: every one the config sets, used or not.
    for part, fields in (
      ("algo", estimator_fields(self.algo)),
      ("loss", loss_fields(self.loss)),
    ):
      for cls, kwargs in fields.items():
        build(cls, kwargs, part)
    self.train_config()  # dataclass checks (loss, optimizer) with field names

  @property
  def checker(self) -> str:
    """``reward.correct`` with "auto" resolved for ``data.train``."""
    return reward_lib.checker_name(self.reward.correct, str(self.data.train))

  def reward_fns(self) -> reward_lib.RewardFns | None:
    """The scalar reward's plug-ins and penalty; None when reward = correct (the default)."""
    w = self.reward
    if not w.fns and not w.overlong_buffer:
      return None
    return reward_lib.RewardFns(
      fns=w.fns,
      weights=tuple(float(x) for x in w.weights) or (1.0,) * len(w.fns),
      timeout_s=w.timeout_s,
      max_len=self.rollout.max_new_tokens,
      overlong_buffer=w.overlong_buffer,
      worker_max_calls=w.worker_max_calls,
      worker_max_rss_mb=float(w.worker_max_rss_mb),
    )

  # ------------------------------------------------------- derived settings

  @property
  def uses_noise_mask(self) -> bool:
    """``algo.mask``: "auto" masks for CAPO only; "on" / "off" force it (ablations)."""
    return self.algo.mask == "on" or (self.algo.mask == "auto" and self.algo.name == "capo")

  @property
  def needs_reference(self) -> bool:
    """Reference log-probs are computed only when the KL term or the mask uses them."""
    return self.loss.beta > 0 or self.uses_noise_mask

  @property
  def loss_aggregation(self) -> str:
    """``loss.agg``, with "auto" resolved for ``algo.name``."""
    return ALGORITHMS[self.algo.name].agg if self.loss.agg == "auto" else self.loss.agg

  @property
  def simko_k(self) -> int:
    """The policy loss's top-K (SimKO's K: the old pass returns the top-K log-probs); 0 for
    the other losses."""
    return self.policy_loss().top_k

  def estimator(self) -> algorithms.Estimator:
    """``algo.name``'s advantage estimator, its fields from ``config.algo``."""
    cls = ALGORITHMS[self.algo.name].estimator
    return build(cls, estimator_fields(self.algo).get(cls, {}), "algo")

  def policy_loss(self) -> losses.PolicyLoss:
    """``algo.name``'s policy loss, its fields from ``config.loss``."""
    cls = ALGORITHMS[self.algo.name].loss
    return build(cls, loss_fields(self.loss).get(cls, {}), "loss")

  @property
  def num_updates(self) -> int:
    """Optimizer updates over the run (PPO mini-batches x epochs x RL steps)."""
    return max(self.updates_per_step * self.train.num_steps, 1)

  @property
  def updates_per_step(self) -> int:
    return self.rollout.num_prompts // self.train.mini_batch_prompts * self.train.ppo_epochs

  @property
  def rows_per_update(self) -> int:
    return self.train.mini_batch_prompts * self.rollout.num_samples

  def lora_config(self) -> lora.LoraConfig | None:
    """``model.lora_rank`` > 0: adapters on a frozen base (``models.lora``); 0: full training."""
    m = self.model
    if m.lora_rank < 0:
      fail("model.lora_rank", m.lora_rank, "must be >= 0 (0: no LoRA, train every param)")
    if m.lora_rank == 0:
      return None
    if m.lora_alpha <= 0:
      fail("model.lora_alpha", m.lora_alpha, "must be > 0 (the delta is scaled by alpha / rank)")
    names = [t.strip() for t in str(m.lora_targets).split(",") if t.strip()]
    bad = [t for t in names if t not in lora.TARGETS]
    if bad or not names:
      fail(
        "model.lora_targets",
        m.lora_targets,
        f"unknown target(s) {bad}; expected a comma-separated subset of {lora.ALL_TARGETS}",
      )
    return lora.LoraConfig(int(m.lora_rank), float(m.lora_alpha), tuple(names))

  def packing_shape(self) -> tuple[int, int]:
    """(row length, rows per micro-batch) of the train batches (``rl.batch``).

    Packed (``train.pack``): ``train.pack_len`` tokens (0: the longest sequence) and
    ``train.pack_rows`` rows (0: ``micro_batch_size``). Unpacked: one sequence per row
    of ``max_prompt_len + max_new_tokens`` tokens, ``micro_batch_size`` rows.
    """
    t, r = self.train, self.rollout
    longest = r.max_prompt_len + r.max_new_tokens
    if not t.pack:
      return longest, t.micro_batch_size
    if t.pack_len < 0 or t.pack_rows < 0:
      fail("train.pack_len / pack_rows", (t.pack_len, t.pack_rows), "must be >= 0 (0: default)")
    if t.pack_len and t.pack_len < longest:
      fail(
        "train.pack_len",
        t.pack_len,
        f"a packed row must hold the longest sequence, "
        f"rollout.max_prompt_len + max_new_tokens = {longest}",
      )
    return t.pack_len or longest, t.pack_rows or t.micro_batch_size

  @property
  def logprob_rows_per_call(self) -> int:
    """Model rows per call of the old / reference log-prob pass."""
    if self.train.pack:
      return self.train.logprob_pack_rows or self.packing_shape()[1]
    return self.train.logprob_rows or self.rollout.num_prompts * self.rollout.num_samples

  def train_config(self) -> TrainConfig:
    """The jitted step's static configuration."""
    l, o = self.loss, self.optim
    try:
      loss_cfg = losses.LossConfig(
        eps_low=l.eps_low,
        eps_high=l.eps_high,
        agg=self.loss_aggregation,
        beta=l.beta,
        kl_estimator=l.kl_estimator,
        max_len=self.rollout.max_new_tokens,
      )
      optim = OptimConfig(
        learning_rate=o.lr,
        warmup_steps=o.warmup_steps,
        schedule=o.schedule,
        total_steps=self.num_updates,
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        grad_clip=o.grad_clip,
      )
    except ValueError as e:
      raise ConfigError(f"config.loss / config.optim: {e}") from e
    return TrainConfig(
      policy_loss=self.policy_loss(),
      loss=loss_cfg,
      optim=optim,
      logprob_chunk_size=self.train.logprob_chunk,
      lora=self.lora_config(),
      gather_once=self.mesh.gather_once,
      reduce_once=self.mesh.reduce_once,
    )

  def advantage_spec(self) -> rollout_lib.AdvantageSpec:
    """The static configuration of ``rollout.score_rollout``."""
    a = self.algo
    return rollout_lib.AdvantageSpec(
      estimator=self.estimator(),
      noise_mask=self.uses_noise_mask,
      mask_high=a.mask_high,
      mask_low=a.mask_low,
      mask_mode=a.mask_mode,
      num_steps=self.train.num_steps,
    )

  def rollout_spec(self) -> rollout_lib.RolloutSpec:
    """What ``rollout.collect`` needs besides the programs: advantages, log-probs, draws."""
    r = self.rollout
    return rollout_lib.RolloutSpec(
      num_samples=r.num_samples,
      max_prompt_len=r.max_prompt_len,
      adv=self.advantage_spec(),
      old_from_sampler=r.old_logprobs == "sampler",
      simko_k=self.simko_k,
      prompts_per_call=r.prompts_per_call,
      dynamic_max_draws=r.dynamic_max_draws if r.dynamic_sampling else 1,
      mismatch=self.mismatch_spec(),
    )

  def mismatch_spec(self) -> mismatch.MismatchSpec:
    """The mismatch metrics (measured unless the old log-probs are the sampler's), the
    IS correction and ``mask_truncated`` (``capo_jax.rl.mismatch``)."""
    r = self.rollout
    if r.is_correction not in mismatch.CORRECTIONS:
      fail("rollout.is_correction", r.is_correction, f"expected one of {mismatch.CORRECTIONS}")
    if r.is_correction != "none" and r.old_logprobs == "sampler":
      fail(
        "rollout.is_correction",
        r.is_correction,
        "needs rollout.old_logprobs='trainer' "
        "(with the sampler's old log-probs rho = 1: nothing to correct)",
      )
    if not r.is_cap > 0:
      fail("rollout.is_cap", r.is_cap, "must be > 0")
    if not isinstance(r.mis_two_sided, bool):
      fail("rollout.mis_two_sided", r.mis_two_sided, "must be true or false")
    if r.is_correction.startswith("mis") and r.mis_two_sided and not r.is_cap > 1:
      fail(
        "rollout.is_cap",
        r.is_cap,
        "two-sided MIS keeps rho in [1/is_cap, is_cap]: "
        "needs is_cap > 1 (or rollout.mis_two_sided=False)",
      )
    if not 0 <= r.icepop_low < r.icepop_high:
      fail(
        "rollout.icepop_low / icepop_high",
        (r.icepop_low, r.icepop_high),
        "need 0 <= icepop_low < icepop_high",
      )
    return mismatch.MismatchSpec(
      measure=r.old_logprobs == "trainer",
      correction=r.is_correction,
      cap=float(r.is_cap),
      mis_two_sided=r.mis_two_sided,
      low=float(r.icepop_low),
      high=float(r.icepop_high),
      mask_truncated=bool(r.mask_truncated),
    )

  def model_config(self) -> Qwen2Config:
    """The policy's architecture: from ``model.hf_path`` when set (it wins over
    ``model.preset``, which the run configs set for shape checks), else the preset."""
    m = self.model
    kw = dict(
      param_dtype=m.param_dtype,
      compute_dtype=m.compute_dtype,
      remat=m.remat,
      remat_policy=m.remat_policy,
      attention=m.attention,
      shared_prompts=m.shared_prompts,
      shared_prompt_cols=m.shared_prompt_cols,
    )
    try:
      if m.hf_path:  # config.json alone: the AOT compile needs no weights
        return Qwen2Config.from_hf(fs.local_copy(hub.resolve_file(m.hf_path, "config.json")), **kw)
      return PRESETS[m.preset](**{**dict(m.preset_overrides or {}), **kw})
    except (ValueError, TypeError) as e:
      raise ConfigError(f"config.model: {e}") from e
    except FileNotFoundError as e:
      raise ConfigError(f"config.model.hf_path={m.hf_path!r}: {e}") from e

  def prompt_format(self) -> PromptFormat:
    """``config.prompt`` as the tokenizer's ``PromptFormat``; errors name the field."""
    p = self.prompt
    kwargs = p.chat_template_kwargs or {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
      fail("prompt.chat_template_kwargs", kwargs, "expected a dict of keyword arguments")
    try:
      return PromptFormat(
        system=str(p.system),
        template=str(p.template),
        chat_template=p.chat_template,
        enable_thinking=p.enable_thinking,
        chat_template_kwargs=tuple(sorted(dict(kwargs).items())),
      )
    except PromptError as e:
      fail(f"prompt.{e.field}", getattr(p, e.field), e.why)
      raise  # unreachable: fail raises

  def make_mesh(self, devices: Any = None) -> jax.sharding.Mesh:
    return mesh_lib.make_mesh(self.mesh.sizes(), devices=devices)
