"""Meshes of the 1.5B / 7B configs on common TPU slices, and the memory plan's arithmetic.

Each slice's mesh is built from the run config (plus the mesh flags the plan
proposes) with capo_jax.runtime.mesh in a subprocess that has as many fake CPU
devices as the slice has chips. The param shardings must keep every sharded
axis (nothing silently replicated), divide every sharded dimension, and the
per-chip bytes they imply must fit the chip's HBM per tools/memory_plan.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from tools import memory_terms, tpu_chips

REPO = pathlib.Path(__file__).resolve().parents[1]
MODELS = ("1.5B", "7B")
# Chips by hand: v4-N and v5p-N count TensorCores (2 per chip), v5e-N counts chips.
SLICE_CHIPS = {"v4-8": 4, "v4-32": 16, "v5e-16": 16, "v4-64": 32, "v5e-32": 32, "v5p-64": 32}


def _load_plan_module():
  spec = importlib.util.spec_from_file_location("memory_plan", REPO / "tools" / "memory_plan.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


mp = _load_plan_module()

_CHILD = r"""
import importlib.util, json, sys
import jax
from jax.sharding import NamedSharding
spec = importlib.util.spec_from_file_location("memory_plan", sys.argv[1])
mp = importlib.util.module_from_spec(spec); sys.modules["memory_plan"] = mp
spec.loader.exec_module(mp)
from capo_jax.runtime import mesh as mesh_lib
from models import qwen2

out = []
for model, slice_name in json.loads(sys.argv[2]):
  c = importlib.import_module(mp.CONFIGS[model]).get_config()
  run = mp.Run.from_config(c)
  p = mp.plan(run, mp.parse_slice(slice_name))
  c.mesh.data, c.mesh.tensor = p.data, p.tensor  # what p.mesh_overrides passes; fsdp stays -1
  mesh = mesh_lib.make_mesh({"data": c.mesh.data, "fsdp": c.mesh.fsdp, "tensor": c.mesh.tensor})
  shapes = qwen2.param_shapes(run.model)
  leaves = {}
  # The sampler's own mesh with the group the run picks on the slice (mesh.sampling_tensor
  # 0: one host's chips; here all fake devices are one process, so the slice's hosts are
  # the plan's), which the plan sizes the rollout by.
  smesh = mesh_lib.sampling_mesh(mesh, run.model, p.sampling_tensor)
  for rules_name, m in (("train", mesh), ("sampling", smesh)):
    rules = mesh_lib.RULES[rules_name]
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    got = jax.tree_util.tree_leaves_with_path(
      qwen2.param_specs(run.model, rules, m), is_leaf=is_spec
    )
    wanted = jax.tree_util.tree_leaves(qwen2.param_specs(run.model, rules), is_leaf=is_spec)
    leaves[rules_name] = [
        dict(path=jax.tree_util.keystr(path), shape=list(s.shape), spec=[
            None if a is None else [a] if isinstance(a, str) else list(a) for a in sp],
             wanted=[None if a is None else [a] if isinstance(a, str) else list(a) for a in w],
             shard=list(NamedSharding(m, sp).shard_shape(s.shape)))
        for (path, sp), w, s in zip(got, wanted, jax.tree_util.tree_leaves(shapes))]
  out.append(dict(model=model, slice=slice_name, devices=jax.device_count(),
                  mesh={k: int(v) for k, v in mesh.shape.items()}, plan_tensor=p.tensor,
                  plan_group=p.sampling_tensor,
                  smesh={k: int(v) for k, v in smesh.shape.items()},
                  fits=p.fits, terms=p.terms, hbm=p.slice.chip.hbm_gib * mp.GiB,
                  params=mp.param_counts(run.model)[0], reference=run.reference,
                  leaves=leaves))
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def meshes() -> dict[tuple[str, str], dict]:
  """One subprocess per chip count, each with that many fake CPU devices."""
  results = {}
  for chips in sorted(set(SLICE_CHIPS.values())):
    pairs = [(m, s) for s, n in SLICE_CHIPS.items() if n == chips for m in MODELS]
    env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=f"--xla_force_host_platform_device_count={chips}",
      PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    out = subprocess.run(
      [sys.executable, "-c", _CHILD, str(REPO / "tools" / "memory_plan.py"), json.dumps(pairs)],
      env=env,
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT"))
    for r in json.loads(line[len("RESULT") :]):
      results[(r["model"], r["slice"])] = r
  return results


CASES = [(m, s) for s in SLICE_CHIPS for m in MODELS]


@pytest.mark.parametrize("model,slice_name", CASES)
def test_mesh_axis_sizes(meshes, model, slice_name):
  r = meshes[(model, slice_name)]
  chips = SLICE_CHIPS[slice_name]
  assert r["devices"] == chips
  t = r["plan_tensor"]
  assert chips % t == 0
  assert r["mesh"] == {"data": 1, "fsdp": chips // t, "tensor": t}


@pytest.mark.parametrize("model,slice_name", CASES)
def test_param_shardings_divide_and_drop_nothing(meshes, model, slice_name):
  r = meshes[(model, slice_name)]
  for rules_name, leaves in r["leaves"].items():
    sharded = 0
    for leaf in leaves:
      where = f"{model} {slice_name} {rules_name} {leaf['path']}"
      assert leaf["spec"] == leaf["wanted"], f"{where}: a mesh axis was dropped (replicated)"
      for dim, axes, shard in zip(leaf["shape"], leaf["spec"], leaf["shard"]):
        ways = math.prod(r["mesh" if rules_name == "train" else "smesh"][a] for a in axes or [])
        assert dim % ways == 0 and shard == dim // ways, where
        sharded += ways > 1
    if rules_name == "train":
      assert sharded > 0, f"{model} {slice_name}: nothing is sharded"


@pytest.mark.parametrize("model,slice_name", CASES)
def test_sharded_params_fit_the_chip(meshes, model, slice_name):
  """Per-chip param elements from the actual shard shapes, times the bytes per
  element of each term, replace the plan's P / shards terms; the result must
  stay under the HBM whenever the plan says the run fits."""
  r = meshes[(model, slice_name)]
  train_elems = sum(math.prod(l["shard"]) for l in r["leaves"]["train"])
  sample_elems = sum(math.prod(l["shard"]) for l in r["leaves"]["sampling"])
  shards = r["mesh"]["fsdp"] * r["mesh"]["tensor"]
  # The plan divides P evenly; the few replicated norms / biases add < 1%.
  assert r["params"] / shards <= train_elems <= 1.01 * r["params"] / shards
  # The sampler's weights split over its own tensor group, the one the plan sized them by.
  group = r["smesh"]["tensor"] * r["smesh"]["tensor_q"]
  hosts = mp.parse_slice(slice_name).hosts
  assert group == r["plan_group"] == SLICE_CHIPS[slice_name] // hosts  # one host's chips
  want = memory_terms.sampling_weight_params(mp.load_run(model).model, group)
  assert want <= sample_elems <= 1.01 * want
  terms = r["terms"]
  planned = sum(
    terms[k]
    for k in (
      "params (f32 master)",
      "AdamW moments (2 x f32)",
      "reference (bf16)",
      "grads (2 x f32) + bf16 copy",
      "sampling weights (bf16)",
    )
  )
  per_elem = 4 + 8 + (2 if r["reference"] else 0) + (8 + 2)  # master, Adam, ref, grads + copy
  actual = train_elems * per_elem + sample_elems * 2
  assert actual == pytest.approx(planned, rel=0.01)
  upper = terms["peak"] - planned + actual
  if r["fits"]:
    assert upper <= r["hbm"], f"{model} on {slice_name}: {upper / 2**30:.1f} GiB per chip"
  else:
    assert terms["peak"] > 0.9 * r["hbm"]


def test_param_counts_match_the_hand_formula():
  for preset in ("qwen2p5_math_1p5b", "qwen2p5_math_7b"):
    cfg = getattr(mp.Qwen2Config, preset)()
    D, F, L, N, K, H, V = (
      cfg.hidden_size,
      cfg.intermediate_size,
      cfg.num_layers,
      cfg.num_heads,
      cfg.num_kv_heads,
      cfg.head_dim,
      cfg.vocab_size,
    )
    layer = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F + N * H + 2 * K * H + 2 * D
    total = V * D * (1 if cfg.tie_word_embeddings else 2) + L * layer + D
    assert mp.param_counts(cfg) == (total, layer)
  # The published sizes: 1.54 B and 7.62 B.
  assert mp.param_counts(mp.Qwen2Config.qwen2p5_math_1p5b())[0] / 1e9 == pytest.approx(1.54, 0.01)
  assert mp.param_counts(mp.Qwen2Config.qwen2p5_math_7b())[0] / 1e9 == pytest.approx(7.62, 0.01)


def test_kv_and_param_terms_by_hand():
  run = mp.load_run("1.5B")
  assert mp.kv_bytes_per_token(run.model) == 2 * 28 * 2 * 128 * 2
  assert mp.kv_bytes_per_token(mp.load_run("7B").model) == 2 * 28 * 4 * 128 * 2
  # The sampler's buckets hold at least the 1024 + 3072 tokens, at most twice that.
  slots = mp.kv_slots(run)
  assert 1024 + 3072 <= slots <= 2 * (1024 + 3072)
  P = mp.param_counts(run.model)[0]
  terms = mp.memory_terms(run, data=1, fsdp=16, tensor=1)
  assert terms["KV cache (W slots)"] == (128 * 8 // 16) * slots * 28672
  assert terms["prompt cache (Q rows)"] == (128 // 16) * 1024 * 28672
  # The engine's W slots: 256 of the 1024 rows at once, a quarter of the cache.
  quarter = mp.memory_terms(run, data=1, fsdp=16, tensor=1, slots=256)
  assert quarter["KV cache (W slots)"] == (256 // 16) * slots * 28672
  # Its tail loops: 64 slots (4 per chip), then 16 (1 per chip); with W = B too. The
  # plan counts the first tail loop's cache whole beside the large one.
  assert mp.tail_phases(256, 16) == (256, 64, 16)
  assert mp.tail_phases(1024, 16) == (1024, 256, 64)
  assert quarter["tail loop cache (W/4 slots)"] == (64 // 16) * slots * 28672
  assert terms["tail loop cache (W/4 slots)"] == (256 // 16) * slots * 28672
  assert mp.tail_phases(96, 16) == (96,)  # 24 slots would split the 16 shards unevenly
  one_loop = mp.memory_terms(run, data=1, fsdp=16, tensor=1, slots=96)
  assert one_loop["tail loop cache (W/4 slots)"] == 0
  assert terms["decode cache copy"] == 0  # the engine's loop keeps one cache
  assert terms["params (f32 master)"] == 4 * P / 16
  assert terms["AdamW moments (2 x f32)"] == 8 * P / 16
  assert terms["sampling weights (bf16)"] == 2 * P
  assert terms["boundary activations"] == 28 * 1 * 4096 * 1536 * 2
  assert terms["prefill scores"] == 8 * (12 * 1024 * 1024 * 6 + 151936 * 4)
  copying = mp.memory_terms(dataclasses.replace(run, decode_copies_cache=True), 1, 16, 1, 1, 96)
  assert copying["decode cache copy"] == one_loop["KV cache (W slots)"]
  # Two rollout calls halve the cache.
  half = mp.memory_terms(run, data=1, fsdp=16, tensor=1, rollout_chunks=2)
  assert half["KV cache (W slots)"] == terms["KV cache (W slots)"] / 2


def test_gather_once_holds_the_whole_model_in_place_of_two_layers():
  """``mesh.gather_once`` (the 1.5B run file's): a bf16 copy of every param per chip (the
  tied unembedding float32, as the update keeps it), split only over tensor, in place
  of two layers' gathered weights and the unembedding."""
  run = mp.load_run("1.5B")
  assert run.gather_once
  P, P_layer = mp.param_counts(run.model)
  V, D = 151936, 1536
  for tensor in (1, 2):
    once = mp.memory_terms(run, data=1, fsdp=16 // tensor, tensor=tensor)
    layered = mp.memory_terms(
      dataclasses.replace(run, gather_once=False), data=1, fsdp=16 // tensor, tensor=tensor
    )
    assert once["gathered weights (once, bf16)"] == (2 * (P - V * D) + 4 * V * D) / tensor
    assert once["gathered layers + unembed"] == 0
    assert layered["gathered weights (once, bf16)"] == 0
    assert layered["gathered layers + unembed"] == 2 * (2 * P_layer + V * D) / tensor
    extra = once["train phase"] - layered["train phase"]
    assert extra == pytest.approx((2 * P + 2 * V * D - 2 * (2 * P_layer + V * D)) / tensor)


def test_reduce_once_counts_8_bytes_a_param_in_the_train_phase():
  """``mesh.reduce_once`` (the 1.5B run file's): each chip's float32 sum of its rows'
  gradient and what the compiled program holds beside it, 8 bytes a param split only
  over tensor, in the train phase."""
  run = mp.load_run("1.5B")
  assert run.reduce_once and run.gather_once
  P, _ = mp.param_counts(run.model)
  for tensor in (1, 2):
    kw = dict(data=1, fsdp=16 // tensor, tensor=tensor)
    once = mp.memory_terms(run, **kw)
    per_step = mp.memory_terms(dataclasses.replace(run, reduce_once=False), **kw)
    assert once["reduce_once (f32 sums, 8 B/param as compiled)"] == 8 * P / tensor
    assert per_step["reduce_once (f32 sums, 8 B/param as compiled)"] == 0
    assert once["train phase"] - per_step["train phase"] == pytest.approx(8 * P / tensor)


def test_remat_projections_count_their_outputs_twice_by_hand():
  """``model.remat_policy="projections"``: per layer and token the q, k, v, o, gate and up
  outputs in bfloat16 and splash's output (bfloat16) and log-sum-exp (float32, a head),
  two copies as the compilers hold them; 1.5B on v4-32 (one 4,096-token row a chip):
  28 x 4,096 x (1,536 + 2 x 256 + 1,536 + 2 x 8,960 + 1,536 + 12 x 4 B / 2 B) x 2 B x 2."""
  run = mp.load_run("1.5B")
  model = dataclasses.replace(run.model, remat_policy="projections")
  kw = dict(data=1, fsdp=16, tensor=1)
  full = mp.memory_terms(run, **kw)
  saved = mp.memory_terms(dataclasses.replace(run, model=model), **kw)
  want = 28 * 4096 * (1536 + 2 * 256 + 1536 + 2 * 8960 + 1536 + 12 * 4 // 2) * 2 * 2
  assert saved[memory_terms.SAVED] == want and full[memory_terms.SAVED] == 0
  assert saved["train phase"] - full["train phase"] == pytest.approx(want)
  assert saved["rollout phase"] == full["rollout phase"]


def test_lockstep_rollout_seconds_by_hand():
  # The old sampler: every one of the 1024 rows reads all 1024 + 3072 columns for
  # as many steps as the longest row (3072: the length model truncates some).
  run = mp.load_run("1.5B")
  chip = tpu_chips.CHIPS["v5e"]
  got = mp.rollout_seconds(run, chip, fsdp=16, tensor=1, chunks=1, slots=0, read="kv_read_full")
  steps, rows, kv = 3072, 1024 // 16, 28672
  weights = 2 * mp.param_counts(run.model)[0]
  want = (steps * weights + (steps * rows * 4096 + 1024 * 1024 * 2 / 16) * kv) / (819e9)
  assert got == pytest.approx(want, rel=1e-9)
  # The engine with fewer slots reads less per step and must come out faster.
  assert mp.rollout_seconds(run, chip, 16, 1, 1, 256) < got


def test_rows_per_chip_replicates_axes_that_do_not_divide():
  rows_per_chip = memory_terms.rows_per_chip
  assert rows_per_chip(16, 1, 16) == 1
  assert rows_per_chip(16, 1, 32) == 16
  assert rows_per_chip(16, 2, 16) == 8
  assert rows_per_chip(1024, 1, 32) == 32


@pytest.mark.parametrize("name, group", [("1.5B", 2), ("1.5B", 8), ("7B", 4), ("7B", 8)])
def test_sampling_terms_follow_the_rule_table(name, group):
  """The plan's per-chip sampling weights and KV rows against the sampling rule table
  itself, on an abstract sampling mesh of 2 groups."""
  import jax
  from jax.sharding import AbstractMesh

  from capo_jax.runtime import mesh as mesh_lib
  from models import qwen2, sharding

  cfg = mp.load_run(name).model
  t_kv, t_q = mesh_lib.tensor_split(cfg, group)
  mesh = AbstractMesh((2, 1, t_kv, t_q), ("data", "fsdp", "tensor", "tensor_q"))
  specs = qwen2.param_specs(cfg, mesh_lib.SAMPLING_RULES, mesh)
  split = lambda spec: math.prod(  # noqa: E731
    mesh.shape[a] for d in spec if d is not None for a in ((d,) if isinstance(d, str) else d)
  )
  shapes = qwen2.param_shapes(cfg)
  per_chip = sum(jax.tree.leaves(jax.tree.map(lambda x, s: x.size / split(s), shapes, specs)))
  norms = sum(x.size for k, x in shapes["layers"].items() if "norm" in k) + cfg.hidden_size
  # The plan counts the (whole) norms as split: a few thousand params.
  got = memory_terms.sampling_weight_params(cfg, group)
  assert got == pytest.approx(per_chip - norms * (1 - 1 / group), rel=1e-12)
  # KV rows: the rows over the 2 groups, then over tensor_q ("attn_batch").
  rows_spec = sharding.logical_to_spec(("attn_batch",), mesh_lib.SAMPLING_RULES, (256,), mesh)
  assert memory_terms.attention_rows_per_chip(256, 2, cfg, group) == 256 // split(rows_spec)


def test_step_time_formula_by_hand():
  run = mp.load_run("1.5B")
  assert mp.step_time(run, 16, None, 1.0, 1.0) is None
  t = mp.step_time(run, 16, sample_tok_s=500.0, logprob_tok_s=4000.0, train_tok_s=1500.0)
  rows = 128 * 8
  expected = rows * 3072 / (16 * 500) + 2 * rows * 4096 / (16 * 4000) + rows * 4096 / (16 * 1500)
  assert t == pytest.approx(expected)


@pytest.mark.parametrize(
  "name,chips,hosts",
  [
    ("v4-8", 4, 1),
    ("v4-32", 16, 4),
    ("v5e-16", 16, 4),
    ("v5litepod-8", 8, 1),
    ("v5p-64", 32, 8),
    ("v6e-16", 16, 4),
  ],
)
def test_slice_parsing_agrees_with_the_launch_scripts(name, chips, hosts):
  sl = mp.parse_slice(name)
  assert (sl.chips, sl.hosts) == (chips, hosts)
  out = subprocess.run(
    [
      "bash",
      str(REPO / "launch" / "create_tpu.sh"),
      "--name=x",
      "--zone=us-central2-b",
      f"--accelerator={name}",
      "--dry-run",
    ],
    capture_output=True,
    text=True,
    timeout=30,
  )
  assert out.returncode == 0, out.stderr
  assert f"{sl.name}: {chips} chips on {hosts} worker(s)" in out.stderr
  with pytest.raises(ValueError, match="v4-12"):
    mp.parse_slice("v4-12")


def test_plans_avoid_replicated_micro_batches():
  for model in MODELS:
    run = mp.load_run(model)
    for name in mp.DEFAULT_SLICES:
      p = mp.plan(run, mp.parse_slice(name))
      if p.fits:
        assert run.micro_batch_size % (p.data * p.fsdp) == 0, (model, name, p.notes)


def test_main_prints_a_table_per_model(capsys, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["memory_plan.py", "--slices", "v5e-16,v4-32"])
  mp.main()
  text = capsys.readouterr().out
  assert text.count("== Qwen2.5-Math-") == 2
  assert "TODO(measured)" in text and "v5e-16" in text and "v4-32" in text
  assert "sampler tensor group" in text


def test_the_plan_takes_a_remat_policy(capsys, monkeypatch):
  """``--remat-policy projections``: the term in the train phase (9.85 GiB for 1.5B on
  v4-32, ``test_remat_projections_count_their_outputs_twice_by_hand``), and a v5e-16,
  which fits the run file's policy at 11.6 of 16 GiB (``memory_plan_all_rows``), no
  longer does."""
  argv = ["memory_plan.py", "--models", "1.5B", "--slices", "v4-32,v5e-16"]
  monkeypatch.setattr(sys, "argv", argv + ["--remat-policy", "projections"])
  mp.main()
  rows = [line.rsplit(None, 2) for line in capsys.readouterr().out.splitlines()]
  table = {r[0].strip(): r[1:] for r in rows if len(r) == 3}
  assert float(table[f"{memory_terms.SAVED} GiB"][0]) == pytest.approx(9.85, abs=0.01)
  assert table["fits (<= 90% of HBM)"] == ["yes", "NO"]


def test_the_samplers_group_is_the_runs_choice():
  """mesh.sampling_tensor 0: one host's chips, on 4-chip hosts and on one 8-chip host,
  whatever the kv heads (1.5B: 2, 7B: 4); else the run's own."""
  small, big = mp.load_run("1.5B"), mp.load_run("7B")
  assert mp.sampling_group(small, 16, 4) == 4 and mp.sampling_group(big, 16, 4) == 4
  assert mp.sampling_group(small, 8, 1) == 8 and mp.sampling_group(big, 8, 1) == 8
  assert mp.sampling_group(dataclasses.replace(big, sampling_tensor=1), 16, 4) == 1
  # Past the kv heads the group splits the attention's rows: 8 = 4 kv x 2 row halves.
  assert mp.sampling_group(dataclasses.replace(big, sampling_tensor=8), 16, 4) == 8
  with pytest.raises(ValueError, match="group of 3 chips: does not divide 16"):
    mp.sampling_group(dataclasses.replace(big, sampling_tensor=3), 16, 4)
  assert mp.plan(big, mp.parse_slice("v4-32")).sampling_tensor == 4


def test_rollout_terms_follow_the_samplers_mesh_by_hand():
  run = mp.load_run("1.5B")
  P, S = mp.param_counts(run.model)[0], mp.kv_slots(run)
  # 16 chips, train tensor 1, sampler group 2: rows over 8 groups, kv heads over 2.
  t = mp.memory_terms(run, data=1, fsdp=16, tensor=1, slots=512, group=2)
  assert t["sampling weights (bf16)"] == 2 * P / 2
  assert t["KV cache (W slots)"] == (512 // 8) * S * 28672 / 2
  assert t["prompt cache (Q rows)"] == (128 // 8) * 1024 * 28672 / 2
  assert t["prefill scores"] == (128 // 8) * (12 / 2 * 1024 * 1024 * 6 + 151936 / 2 * 4)
  assert t["params (f32 master)"] == 4 * P / 16  # the train mesh's, unchanged
  # A group of 4: 2 kv heads x 2 row halves. The attention's weights split over the 2 kv
  # heads, the rest over 4; the cache's rows over 4 groups x 2, its kv heads over 2: per
  # chip what pure data parallelism over the 16 chips holds.
  four = mp.memory_terms(run, data=1, fsdp=16, tensor=1, slots=512, group=4)
  D, N, K, H = 1536, 12, 2, 128
  attn = 28 * (2 * D * N * H + 2 * D * K * H + N * H + 2 * K * H)
  assert four["sampling weights (bf16)"] == pytest.approx(2 * (attn / 2 + (P - attn) / 4))
  assert four["KV cache (W slots)"] == (512 // 8) * S * 28672 / 2 == (512 // 16) * S * 28672
  # The prompt cache the same way: 128 prompts over 4 x 2, a kv head a chip (the TPU
  # compiler's 1.5B v4-32 decode and prefill hold it as bf16[16, 1024, 128] a layer).
  assert four["prompt cache (Q rows)"] == (128 // 8) * 1024 * 28672 / 2


@pytest.mark.parametrize(
  "name,mask,beta,expected",
  [
    ("capo", "auto", 0.0, True),
    ("grpo", "auto", 0.0, False),
    ("grpo", "on", 0.0, True),
    ("capo", "off", 0.0, False),
    ("grpo", "off", 0.1, True),
  ],
)
def test_reference_copy_only_when_the_mask_or_kl_needs_it(name, mask, beta, expected):
  from configs import common  # pylint: disable=import-outside-toplevel

  c = common.get_base_config()  # the trainer's rule reads a whole (validated) run config
  c.algo.name, c.algo.mask, c.loss.beta = name, mask, beta
  assert memory_terms._uses_reference(c) is expected
