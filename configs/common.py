"""The base config every run file starts from: the paper's training settings.

Run files (``configs/<run>.py``) call :func:`get_base_config` and change what
differs. Every field can be overridden on the command line:
``--config.algo.tau=0.5``. The one config argument, ``shrink``
(``--config=...py:shrink``), turns any run into a tiny CPU run,
big_vision-style; any other argument is an error (:func:`wants_shrink`).
"""

from __future__ import annotations

import os

import ml_collections

# The paper's system prompt; configs import no JAX, so this is copied from
# capo_jax/data/prompts.py, and tests/test_prompts.py checks that the two agree.
SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


def get_base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  # Policy: a HF checkpoint directory (hub id resolved by the user beforehand),
  # or a models.config preset name with random weights (tests, benchmarks).
  c.model = ml_collections.ConfigDict()
  c.model.hf_path = ""
  c.model.preset = ""
  c.model.preset_overrides = ml_collections.ConfigDict()  # e.g. for tiny models
  c.model.param_dtype = "float32"  # master params
  c.model.compute_dtype = "bfloat16"
  c.model.remat = True
  # With remat, what each layer keeps for the backward: "full" (nothing: the forward runs
  # twice) or "projections" (its q / k / v / o / gate / up outputs: about a sixth fewer
  # train FLOPs, for activation memory that tools/memory_plan.py counts).
  c.model.remat_policy = "full"
  # LoRA (models/lora.py): rank > 0 trains adapters on the frozen base (which is
  # also the reference); alpha / rank scales the delta; targets from q,k,v,o,gate,up,down.
  c.model.lora_rank = 0
  c.model.lora_alpha = 32.0
  c.model.lora_targets = "q,k,v,o,gate,up,down"
  # The train / log-prob passes' attention: "auto" (splash on TPU, blocked flash
  # elsewhere), "reference" (full T x T scores), "xla", "flash", "splash" (models.attention).
  c.model.attention = "auto"
  # The G completions of a prompt share its forward in the log-prob passes and updates
  # (models.shared_prefix; packed rows only): a prompt laid once a chunk of completions.
  # shared_prompt_cols: the prompt keys splash reads a row (a multiple of 128).
  c.model.shared_prompts = False
  c.model.shared_prompt_cols = 512
  # Random weights (issue 31): without model.hf_path a run needs random_init=True and a
  # model.preset (tests, benchmarks, :shrink); anything else without weights is an error
  # naming model.hf_path. Ignored when hf_path is set (the weights are loaded).
  c.model.random_init = False
  c.tokenizer_path = ""  # defaults to model.hf_path
  # JAX's persistent compilation cache (capo_jax/runtime/compile_cache.py): empty = off;
  # a relative path lies under the workdir. Reruns and resumed runs skip their compiles.
  c.compilation_cache_dir = ""

  c.data = ml_collections.ConfigDict()
  c.data.train = "deepscaler"  # registry name or a file path (local or gs://)
  c.data.data_dir = ""  # defaults to $CAPO_DATA_DIR (local or gs://)
  c.data.skip_bad_rows = False
  # The paper's split: a fixed-seed 20k training subset and 240 held-out
  # validation questions, evaluated every eval.every_steps. 0 = all the rest / none.
  c.data.train_size = 20_000
  c.data.val_size = 240
  c.data.split_seed = 0
  # Benchmarks evaluated during training (eval.every_steps) besides the validation split.
  c.data.eval = ("math500", "aime24", "aime25", "amc23", "minerva_math", "olympiadbench")

  c.rollout = ml_collections.ConfigDict()
  c.rollout.num_prompts = 128  # Q per step
  c.rollout.num_samples = 8  # G
  c.rollout.max_prompt_len = 1024
  c.rollout.max_new_tokens = 3072
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0
  # Old log-probs (the ratio's denominator and the score s): a trainer forward
  # pass, or the sampler's own (cheaper; differs by sampler / trainer numerics).
  c.rollout.old_logprobs = "trainer"  # or "sampler"
  c.rollout.prompts_per_call = 0  # > 0: sample the Q prompts in chunks (bounds the KV cache)
  # > 0: continuous batching, this many rows decode at once over a KV cache of as
  # many slots (tools/memory_plan.py picks it); 0: all rows of a call at once.
  # The samples are the same either way.
  c.rollout.max_active_rows = 0
  # DAPO's dynamic sampling (capo_jax/rl/dynamic_sampling.py): keep drawing batches of Q
  # prompts, at most dynamic_max_draws per step, until Q groups are neither all right nor
  # all wrong (those have zero advantage). Off: the paper's runs.
  c.rollout.dynamic_sampling = False
  c.rollout.dynamic_max_draws = 3
  # The sampler / trainer mismatch (capo_jax/rl/mismatch.py, docs/mismatch.md). With
  # old_logprobs="trainer" every step logs mismatch/* (|log rho|, k3 KL, quantiles of
  # rho = pi_trainer_old / pi_sampler per token). is_correction reweights each token's
  # policy-gradient term by a detached w, at one of three levels: _token (rho_t), _seq
  # (the row's product exp(sum_t log rho_t), verl's "sequence") or _geo (the geometric
  # mean exp(mean_t log rho_t), verl's "geometric"): "none" (the paper's run);
  # "tis_token" / "tis_seq" / "tis_geo" w = min(rho, is_cap); "mis_token" / "mis_seq" /
  # "mis_geo" w = rho, tokens (rows) with rho outside [1/is_cap, is_cap] rejected
  # (mis_two_sided=False: only rho > is_cap); "icepop" w = rho_t, tokens outside
  # [icepop_low, icepop_high] rejected. A rejected token leaves the loss's numerator and
  # denominator. Needs old_logprobs="trainer" (with the sampler's, rho = 1).
  c.rollout.is_correction = "none"
  c.rollout.is_cap = 2.0
  c.rollout.mis_two_sided = True
  c.rollout.icepop_low = 0.5
  c.rollout.icepop_high = 5.0
  # True: rows that hit max_new_tokens (graded wrong: no final answer) leave the loss,
  # numerator and denominator; their advantages and CAPO's pairs are computed as usual.
  c.rollout.mask_truncated = False

  c.algo = ml_collections.ConfigDict()
  c.algo.name = "capo"  # one of ALGORITHMS
  c.algo.tau = 0.6
  c.algo.norm = "group"  # "group" | "pairs" | "none"
  c.algo.score = "mean_logprob"  # or "neg_ppl"
  c.algo.adaptive_tau = 0.0  # > 0: tau = this * mean within-group std of s
  c.algo.mask = "auto"  # CAPO noise mask: "auto" (CAPO only), "on", "off"
  c.algo.mask_high = 2.5
  c.algo.mask_low = 1.05
  c.algo.mask_mode = "partner"  # or "drop"
  # CDE: r = 2 correct - 1 plus the reward plug-ins' shaping, plus the bonus
  # omega * min(|r| / kappa, alpha * log-perplexity) in the first half of training.
  c.algo.cde_kappa = 3.0
  c.algo.cde_alpha = 1.0
  c.algo.cde_omega = 1.0
  # The std of GRPO's normalisation (grpo, gspo, simko, codapo, cde): "unbiased" (ddof 1,
  # as verl and TRL) or "population" (ddof 0; the recorded demo studies ran with it).
  c.algo.std = "unbiased"

  c.loss = ml_collections.ConfigDict()
  c.loss.eps_low = 0.2
  c.loss.eps_high = 0.2
  # "auto": the algorithm's own (token-mean for simko, as in SimKO's paper;
  # seq-mean-token-sum-norm for dr_grpo: each response's token sum over the constant
  # rollout.max_new_tokens, as in Dr.GRPO's code; seq-mean-token-mean otherwise),
  # or one of capo_jax.rl.losses.AGGS, which overrides it.
  c.loss.agg = "auto"
  c.loss.beta = 0.0  # KL to the reference
  c.loss.kl_estimator = "k3"
  c.loss.gspo_eps_low = 3e-4
  c.loss.gspo_eps_high = 4e-4
  c.loss.simko_alpha = 0.01
  c.loss.simko_k = 3
  c.loss.simko_lambda = 1.1
  c.loss.simko_quantile = 0.8

  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 1e-6
  c.optim.warmup_steps = 0
  c.optim.schedule = "constant"
  c.optim.weight_decay = 0.01
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.grad_clip = 1.0

  c.train = ml_collections.ConfigDict()
  c.train.num_steps = 600
  c.train.mini_batch_prompts = 64  # PPO mini-batch: 2 updates per step at Q=128
  c.train.ppo_epochs = 1
  c.train.micro_batch_size = 16  # rows per gradient-accumulation micro-batch
  c.train.logprob_chunk = 512  # tokens per chunk of the vocab projection; 0 = unchunked
  # Rows per call of the old / reference log-prob pass (0: all Q*G at once). 64
  # fits every slice of docs/tpu.md at 4k tokens (tools/aot_tpu.py).
  c.train.logprob_rows = 64
  c.train.max_consecutive_skips = 5
  # Sequence packing of the old / reference / train passes (capo_jax/rl/packing.py):
  # rows of pack_len tokens (0: max_prompt_len + max_new_tokens, the longest possible
  # sequence), pack_rows rows per micro-batch and per log-prob call (0: micro_batch_size,
  # the row count tools/memory_plan.py fits at that length).
  c.train.pack = True
  c.train.pack_len = 0
  c.train.pack_rows = 0
  # Packed rows per log-prob call (0: pack_rows, as the micro-batches): with
  # mesh.logprob_data_parallel a multiple of the chips.
  c.train.logprob_pack_rows = 0

  # Mesh axes; -1 takes the remaining devices. Rules live in capo_jax/runtime/mesh.py.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  # The sampler's own mesh over the same devices: data x a tensor group of this many chips
  # that split its weights (MLP / vocab; the attention's over the kv heads, the rest of the
  # group splitting the attention's rows). 0: one host's chips.
  c.mesh.sampling_tensor = 0
  # Gather the fsdp-split weights once per log-prob pass and per update: a compute-dtype
  # copy of the whole model over fsdp on every chip (params x 2 bytes / tensor), in place
  # of gathering each layer in every log-prob call and (twice, with remat) in every
  # micro-batch (with LoRA: the frozen base). docs/tpu.md has what it saves.
  c.mesh.gather_once = False
  # With gather_once and full fine-tuning: each chip keeps its rows' float32 gradient of
  # the whole model (params x 4 bytes / tensor) over an update's micro-batches, and the
  # update reduces them once, in place of a gradient all-reduce per micro-batch
  # (capo_jax/rl/local_grads.py; docs/tpu.md has what it saves).
  c.mesh.reduce_once = False
  # With gather_once and a tensor axis: the log-prob passes run data parallel over every
  # chip (tensor included) on a whole bf16 copy (params x 2 bytes a chip), so their calls
  # send nothing; the updates keep the mesh's split. A log-prob call's rows
  # (train.logprob_pack_rows, packed) must then be a multiple of the chips. docs/tpu.md
  # has what it saves.
  c.mesh.logprob_data_parallel = False

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 50
  c.checkpoint.keep = 2
  c.checkpoint.export_hf = True  # the final policy as a HF directory: <workdir>/export_hf
  c.checkpoint.export_hf_every = 0  # > 0: also <workdir>/exports/step_<N> every N steps

  c.log = ml_collections.ConfigDict()
  c.log.every_steps = 1  # metrics rows (JSONL, TensorBoard, W&B) every N steps
  c.log.samples_every_steps = 10
  c.log.num_samples_logged = 4
  c.log.wandb_project = ""  # set to mirror metrics and config to W&B (pip install wandb)
  c.log.wandb_entity = ""
  c.log.wandb_name = ""  # default: the workdir's name
  # (first, last): a jax.profiler trace of steps first..last (as logged, from 1) into
  # <workdir>/profile, for TensorBoard / xprof (docs/training.md); (): none.
  c.log.profile_steps = ()

  # Evaluation during training: the validation split and data.eval, with the
  # evaluator's metrics, logged as eval/<benchmark>/<metric>. Every 50 steps, as the
  # paper's curves (its Fig. 1b/c); also at step 0 and the end. The benchmark files must
  # be in data.data_dir (or on the hub); docs/training.md gives the cost (~28 training
  # steps' worth of sampling per evaluation at the paper's shape).
  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 50  # 0: no evaluation during training
  c.eval.num_samples = 16
  c.eval.max_new_tokens = 3072
  c.eval.temperature = 1.0
  c.eval.limit = 0  # questions per benchmark (0: all)
  c.eval.batch_size = 8  # questions per sampler call
  c.eval.max_active_rows = 0  # as rollout.max_active_rows, for the evaluator's calls
  c.eval.seed = 0  # the same draws at every evaluation

  # --- Rewards from the config (docs/rewards.md; capo_jax/data/reward_fns.py). ---
  # Every sample gets `correct` (binary: CAPO's pairs, the noise mask, AUC, accuracy) and
  # `reward` (scalar: the advantage input of GRPO, Dr.GRPO, GSPO, CoDaPO, CDE, SimKO).
  # The defaults are the paper's: both from the math grader, reward = correct.
  c.reward = ml_collections.ConfigDict()
  # The checker deciding `correct`: "auto" (the training dataset's registry checker:
  # math, or countdown for data.train="countdown"), "math", "countdown", or a plug-in
  # "package.module:function" / "path/to/file.py:function" taking (completion, gold) -> bool.
  c.reward.correct = "auto"
  # Reward plug-ins, each "package.module:function" or "path/to/file.py:function" taking
  # (completions, examples) of one question and returning one float per completion;
  # "correct" names the binary label. Empty: reward = correct. Else reward = sum_k w_k f_k.
  # No effect on CAPO's advantage (it pairs on `correct`; a run that sets it logs so).
  c.reward.fns = ()
  c.reward.weights = ()  # one per fn; empty: all 1.0
  # Deadline of one plug-in call (a checker's completion, a reward function's question);
  # past it the worker is killed, the call counted (reward/timeout, reward/fn_timeout).
  c.reward.timeout_s = 5.0
  # A plug-in worker is replaced after this many calls, or once its resident memory passes
  # this many MiB (read from /proc after each call; Linux), so a leaking plug-in cannot grow
  # it without bound. 0 = no limit.
  c.reward.worker_max_calls = 1000
  c.reward.worker_max_rss_mb = 2048.0
  # DAPO's overlong penalty on L generated tokens, L_max = rollout.max_new_tokens, buffer
  # L_b: 0 up to L_max - L_b, then linear down to -1 at L_max, added to the reward. 0 = off.
  # No effect on CAPO's advantage (the reward, not `correct`; a run that sets it logs so).
  c.reward.overlong_buffer = 0
  # The prompt (capo_jax/data/prompts.py), the same in training, evaluation during
  # training and every export's prompt.json. The defaults are the paper's: the
  # Qwen2.5-Math system prompt, the question alone as the user message.
  c.prompt = ml_collections.ConfigDict()
  c.prompt.system = SYSTEM_PROMPT  # "" sends no system message
  c.prompt.template = "{question}"  # the user message; must contain {question}
  # "auto": the tokenizer's chat template when it has one, else the Qwen format written
  # out in prompts.PROMPT_FORMAT; "on": the template or an error; "off": that format.
  c.prompt.chat_template = "auto"
  c.prompt.enable_thinking = "auto"  # Qwen3's template switch: "auto" (not passed), "on", "off"
  c.prompt.chat_template_kwargs = ml_collections.ConfigDict()  # more apply_chat_template kwargs
  return c


ARGS = ("shrink",)  # the config arguments a run file accepts after ``file.py:``


def wants_shrink(arg: str | None, config_file: str) -> bool:
  """Whether ``arg`` (the text after ``file.py:``) asks for the shrunk run.

  Raises ValueError naming the argument and the known ones for anything
  else, so ``--config=configs/<file>.py:bogus`` never silently runs the full size.
  """
  if arg is None or arg == "":
    return False
  if arg not in ARGS:
    name = os.path.basename(config_file)
    raise ValueError(
      f"unknown config argument {arg!r} in --config=configs/{name}:{arg}; "
      f"known: {', '.join(ARGS)} (or none)"
    )
  return True


def shrink(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A tiny random-model CPU run of the same algorithm (tests, smoke runs)."""
  c.model.hf_path = ""
  c.model.preset = "tiny"
  c.model.preset_overrides = ml_collections.ConfigDict({"vocab_size": 512})
  c.model.param_dtype = "float32"
  c.model.compute_dtype = "float32"
  c.model.remat = False
  c.model.random_init = True
  c.rollout.num_prompts = 4
  c.rollout.num_samples = 4
  c.rollout.max_prompt_len = 64
  c.rollout.max_new_tokens = 16
  c.rollout.max_active_rows = 8  # half the rows: the engine refills slots in every shrunk run
  c.train.num_steps = 2
  c.train.mini_batch_prompts = 2
  c.train.micro_batch_size = 8
  c.train.logprob_chunk = 0
  c.train.logprob_rows = 8  # two calls per pass: the chunked path runs in every test
  c.optim.lr = 1e-4
  c.checkpoint.every_steps = 1
  c.data.train_size, c.data.val_size = 0, 2
  c.eval.num_samples, c.eval.max_new_tokens, c.eval.limit, c.eval.batch_size = 4, 8, 2, 2
  c.eval.every_steps = 0  # a smoke run: evaluation (and its benchmark files) only when asked
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  return c
