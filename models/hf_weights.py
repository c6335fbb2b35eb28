"""Hugging Face Qwen2 / Qwen3 checkpoints <-> capo-jax params, without torch.

Reads ``model.safetensors`` or a sharded ``model.safetensors.index.json``
directory (float32 / bfloat16 / float16 tensors) lazily through
``safetensors.safe_open(framework="numpy")``: each of our params is built with
``jax.make_array_from_callback``, so every device (and host) only reads the
slices its shard needs, one layer at a time, stacked on the leading L axis.
Writes the same layout back, so ``transformers.AutoModelForCausalLM`` loads
an exported directory. Which HF tensor each param is, and in what layout:
``models.hf_layout``.

    cfg, params = load_pretrained("/ckpt/Qwen2.5-Math-1.5B", dtype=jnp.bfloat16)
    save_pretrained(cfg, params, "/out/step_100")
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from models import hf_layout, hub, qwen2, sharding
from models.config import Qwen2Config
from models.qwen2 import Params

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Non-persistent buffers some old checkpoints still carry; recomputed, never loaded.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_LOG_BYTES = 256 * 2**20  # loads above this size log per-parameter progress


# --- reading -----------------------------------------------------------------


class _ArraySlice:
  """A numpy array behind the ``get_shape()`` / ``[slices]`` API of safetensors slices."""

  def __init__(self, array: Any):
    self._a = np.asarray(array)

  def get_shape(self) -> list[int]:
    return list(self._a.shape)

  def __getitem__(self, idx: Any) -> np.ndarray:
    return self._a[idx]


def _check_tensors(cfg: Qwen2Config, tensors: Mapping[str, Any], source: str) -> None:
  """Raises naming every missing, unexpected or mis-shaped tensor."""
  expected = hf_layout.expected_tensors(cfg)
  problems = []
  for name, shape in expected.items():
    if name not in tensors:
      problems.append(f"missing tensor {name} (expected shape {list(shape)})")
    elif tuple(tensors[name].get_shape()) != shape:
      problems.append(
        f"tensor {name} has shape {list(tensors[name].get_shape())}, expected {list(shape)}"
      )
  for name in tensors:
    if name in expected or _IGNORED.fullmatch(name):
      continue
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
      continue  # checked against the embedding in _check_tied
    problems.append(f"unexpected tensor {name} (shape {list(tensors[name].get_shape())})")
  if problems:
    raise ValueError(
      f"{source} does not match the config ({len(problems)} problems):\n  " + "\n  ".join(problems)
    )


def _check_tied(cfg: Qwen2Config, tensors: Mapping[str, Any], source: str) -> None:
  """A tied checkpoint may carry lm_head.weight; it must then equal the embedding."""
  if not cfg.tie_word_embeddings or "lm_head.weight" not in tensors:
    return
  head, embed = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
  if tuple(head.get_shape()) != tuple(embed.get_shape()):
    raise ValueError(
      f"{source}: tied checkpoint has lm_head.weight of shape "
      f"{list(head.get_shape())}, embedding {list(embed.get_shape())}"
    )
  rows = embed.get_shape()[0]
  for start in range(0, rows, 8192):  # chunked, to bound host memory on big vocabularies
    sl = slice(start, min(start + 8192, rows))
    if not np.array_equal(np.asarray(head[sl, :]), np.asarray(embed[sl, :])):
      raise ValueError(
        f"{source}: tie_word_embeddings=true but lm_head.weight differs from "
        f"model.embed_tokens.weight (rows {sl.start}:{sl.stop}); set "
        "tie_word_embeddings=false in config.json"
      )


def _read_view(
  src: Any, m: hf_layout.TensorMap, cfg: Qwen2Config, our_idx: tuple[slice, ...]
) -> np.ndarray:
  """Our-layout slice ``our_idx`` of one HF tensor, reading only a covering slice."""
  view = m.view(cfg)
  view_idx: list[slice] = [slice(None)] * len(view)
  for i, p in enumerate(m.perm):
    view_idx[p] = our_idx[i]
  bounds = [s.indices(n) for s, n in zip(view_idx, view)]
  hf_idx, post, shape, j = [], [], [], 0
  for g in m.groups:
    (a0, a1, step), *rest = bounds[j : j + g]
    if step != 1 or any(r[2] != 1 for r in rest):
      raise ValueError(f"{m.hf_name}: strided shard index {view_idx} is not supported")
    inner = int(np.prod(view[j + 1 : j + g]))  # elements of the trailing factors
    hf_idx.append(slice(a0 * inner, a1 * inner))
    shape += [a1 - a0, *view[j + 1 : j + g]]
    post += [slice(None)] + [slice(r[0], r[1]) for r in rest]
    j += g
  block = np.asarray(src[tuple(hf_idx)]).reshape(shape)[tuple(post)]
  return block.transpose(m.perm)


def _build(cfg: Qwen2Config, tensors: Mapping[str, Any], shardings: Any, source: str) -> Params:
  shapes = qwen2.param_shapes(cfg)
  if shardings is None:
    device = jax.local_devices()[0]
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), shapes)
  elif callable(shardings):
    shardings = shardings(cfg)
  # jax's types leave PyTreeDef unresolved (a jaxlib extension class), so mypy sees no __ne__.
  if jax.tree.structure(shardings) != jax.tree.structure(shapes):  # type: ignore[operator]
    raise ValueError(
      f"shardings tree {jax.tree.structure(shardings)} does not match the params "
      f"tree {jax.tree.structure(shapes)}"
    )
  dtype = np.dtype(cfg.weight_dtype)
  leaves = hf_layout.leaves(cfg)
  total = (
    sum(
      np.prod(hf_layout.hf_shape(m, cfg)) * (cfg.num_layers if p[0] == "layers" else 1)
      for p, m in leaves
    )
    * dtype.itemsize
  )
  level = logging.INFO if total >= _LOG_BYTES else logging.DEBUG
  log.log(
    level, "loading %d params (%.2f GB as %s) from %s", len(leaves), total / 1e9, dtype, source
  )
  t0 = time.perf_counter()
  out: Params = {"layers": {}}
  for i, (path, m) in enumerate(leaves):
    shape_struct = shapes[path[0]] if len(path) == 1 else shapes["layers"][path[1]]
    sh = shardings[path[0]] if len(path) == 1 else shardings["layers"][path[1]]
    memo: dict[Any, np.ndarray] = {}

    def callback(idx, m=m, path=path, memo=memo):
      key = tuple((s.start, s.stop, s.step) for s in idx)
      if key not in memo:  # replicated shards ask for the same slice once per device
        if path[0] == "layers":
          lo, hi, _ = idx[0].indices(cfg.num_layers)
          block = np.stack(
            [_read_view(tensors[m.hf_name.format(l=l)], m, cfg, idx[1:]) for l in range(lo, hi)]
          )
        else:
          block = _read_view(tensors[m.hf_name], m, cfg, idx)
        memo[key] = np.ascontiguousarray(block.astype(dtype))
      return memo[key]

    arr = jax.make_array_from_callback(shape_struct.shape, sh, callback)
    if len(path) == 1:
      out[path[0]] = arr
    else:
      out["layers"][path[1]] = arr
    log.log(
      level,
      "loaded %s %s (%d/%d, %.1fs)",
      "/".join(path),
      list(arr.shape),
      i + 1,
      len(leaves),
      time.perf_counter() - t0,
    )
  return out


def params_from_state_dict(
  cfg: Qwen2Config, state_dict: Mapping[str, Any], shardings: Any = None
) -> Params:
  """Params (in ``cfg.param_dtype``) from HF-named arrays, e.g. ``{k: v.numpy()}``.

  Raises ``ValueError`` naming each missing, unexpected or mis-shaped tensor.
  """
  tensors = {k: _ArraySlice(v) for k, v in state_dict.items()}
  _check_tensors(cfg, tensors, "state dict")
  _check_tied(cfg, tensors, "state dict")
  return _build(cfg, tensors, shardings, "state dict")


@contextlib.contextmanager
def open_checkpoint(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
  """Lazy safetensors slices of every tensor of a HF checkpoint directory, by name."""
  path = os.fspath(path)
  index_path = os.path.join(path, INDEX_FILE)
  if os.path.exists(index_path):
    with open(index_path, encoding="utf-8") as f:
      try:
        weight_map = json.load(f)["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{index_path}: not a safetensors index ({e!r})") from e
    files = sorted(set(weight_map.values()))
  elif os.path.exists(os.path.join(path, SINGLE_FILE)):
    weight_map, files = None, [SINGLE_FILE]
  else:
    raise FileNotFoundError(
      f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)"
    )
  with contextlib.ExitStack() as stack:
    tensors: dict[str, Any] = {}
    for name in files:
      shard = stack.enter_context(safe_open(os.path.join(path, name), framework="numpy"))
      for key in shard.keys():
        tensors[key] = shard.get_slice(key)
    if weight_map is not None:
      for key, fname in weight_map.items():
        if key not in tensors:
          raise ValueError(f"{index_path}: tensor {key} is mapped to {fname}, which lacks it")
    yield tensors


def load_params(cfg: Qwen2Config, path: str | os.PathLike, shardings: Any = None) -> Params:
  """Params of the checkpoint at ``path`` for a given config, in ``cfg.param_dtype``.

  ``shardings``: None (first local device), a pytree of ``jax.sharding.Sharding``
  matching the params, or a function ``cfg -> that pytree``.
  """
  source = os.fspath(path)
  with open_checkpoint(path) as tensors:
    _check_tensors(cfg, tensors, source)
    _check_tied(cfg, tensors, source)
    return _build(cfg, tensors, shardings, source)


def load_pretrained(
  path: str | os.PathLike,
  dtype: Any = jnp.float32,
  shardings: Any = None,
  *,
  compute_dtype: Any = None,
  **cfg_overrides: Any,
) -> tuple[Qwen2Config, Params]:
  """Config and params of a HF Qwen2 / Qwen3 checkpoint: a local directory or a hub id
  ("Qwen/Qwen2.5-Math-1.5B", fetched into the hub cache by ``models.hub.resolve``).

  Params are stored in ``dtype``; activations use ``compute_dtype`` (default:
  the same). ``cfg_overrides`` (e.g. ``remat=True``) go to ``Qwen2Config.from_hf``.
  """
  path = hub.resolve(path)
  if "://" in path:  # safetensors reads local files; the gs:// layer lives in capo_jax
    raise ValueError(f"load_pretrained({path!r}): copy a URL first (capo_jax.runtime.fs.model_dir)")
  name = lambda d: jnp.dtype(d).name
  cfg = Qwen2Config.from_hf(
    path, param_dtype=name(dtype), compute_dtype=name(compute_dtype or dtype), **cfg_overrides
  )
  return cfg, load_params(cfg, path, shardings)


# --- writing -----------------------------------------------------------------


def state_dict_from_params(
  cfg: Qwen2Config, params: Params, dtype: Any = None
) -> dict[str, np.ndarray]:
  """HF-named numpy arrays (in ``dtype``, default ``cfg.param_dtype``) of params."""
  np_dtype = np.dtype(dtype or cfg.weight_dtype)
  out = {}
  for path, m in hf_layout.leaves(cfg):
    x = params[path[0]] if len(path) == 1 else params["layers"][path[1]]
    inverse = tuple(np.argsort(m.perm))
    x = sharding.to_host(x).astype(np_dtype)
    hf_shape = hf_layout.hf_shape(m, cfg)
    if path[0] == "layers":
      for l in range(cfg.num_layers):
        out[m.hf_name.format(l=l)] = np.ascontiguousarray(x[l].transpose(inverse).reshape(hf_shape))
    else:
      out[m.hf_name] = np.ascontiguousarray(x.transpose(inverse).reshape(hf_shape))
  return out


def _parse_size(size: int | str) -> int:
  if isinstance(size, int):
    return size
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, re.IGNORECASE)
  if not match:
    raise ValueError(f"max_shard_size={size!r}: expected bytes or e.g. '500MB', '2GiB'")
  unit = (match.group(2) or "B").upper()
  scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[
    unit
  ]
  return int(float(match.group(1)) * scale)


def save_pretrained(
  cfg: Qwen2Config,
  params: Params,
  path: str | os.PathLike,
  *,
  max_shard_size: int | str = "5GB",
  dtype: Any = None,
  generation_config: Mapping[str, Any] | None = None,
  extra_config: Mapping[str, Any] | None = None,
) -> None:
  """Writes a HF directory (config.json + safetensors) that transformers loads.

  Tensors are written in ``dtype`` (default ``cfg.param_dtype``), split into
  ``model-0000i-of-0000n.safetensors`` files plus an index when their total
  exceeds ``max_shard_size``. ``extra_config`` (e.g. ``{"eos_token_id": ...}``)
  is merged into config.json; ``generation_config`` is written when given.
  Every process must call it (sharded params are gathered); process 0 writes.
  """
  limit = _parse_size(max_shard_size)
  np_dtype = np.dtype(dtype or cfg.weight_dtype)
  state = state_dict_from_params(cfg, params, np_dtype)
  if jax.process_index() != 0:
    return
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  config = cfg.to_hf()
  config["torch_dtype"] = config["dtype"] = np_dtype.name
  config.update(extra_config or {})
  _write_json(os.path.join(path, "config.json"), config)
  if generation_config is not None:
    _write_json(os.path.join(path, "generation_config.json"), dict(generation_config))
  shards: list[list[str]] = [[]]
  size = 0
  for name, x in state.items():
    if shards[-1] and size + x.nbytes > limit:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += x.nbytes
  meta = {"format": "pt"}
  if len(shards) == 1:
    save_file(state, os.path.join(path, SINGLE_FILE), metadata=meta)
    return
  weight_map = {}
  for i, names in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file({n: state[n] for n in names}, os.path.join(path, fname), metadata=meta)
    weight_map.update({n: fname for n in names})
  total = sum(x.nbytes for x in state.values())
  _write_json(
    os.path.join(path, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map}
  )
  log.info(
    "wrote %d tensors (%.2f GB) in %d files to %s", len(state), total / 1e9, len(shards), path
  )


def _write_json(path: str, obj: Any) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
    f.write("\n")
