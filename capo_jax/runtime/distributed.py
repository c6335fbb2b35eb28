"""Multi-host start-up: JAX's own SPMD runtime, nothing home-made.

``maybe_initialize()`` calls ``jax.distributed.initialize`` when the
environment describes a multi-process job, and does nothing on one host:

* explicit: ``JAX_COORDINATOR_ADDRESS`` (host:port), ``JAX_NUM_PROCESSES`` and
  ``JAX_PROCESS_ID`` (used by the 2-process CPU test and by hand-made clusters);
* Cloud TPU pod slices (``TPU_WORKER_HOSTNAMES`` lists several workers) and
  SLURM jobs with several tasks: JAX detects the coordinator itself.
"""

from __future__ import annotations

import logging
import os

import jax

from capo_jax.runtime import peers

log = logging.getLogger(__name__)


def _env_int(name: str, default: int | None = None) -> int:
  value = os.environ.get(name, "")
  if not value and default is not None:
    return default
  try:
    return int(value)
  except ValueError as e:
    raise ValueError(f"environment variable {name}={value!r} is not an integer") from e


def maybe_initialize() -> bool:
  """Initialises jax.distributed when needed; True when it did.

  ``CAPO_HEARTBEAT_TIMEOUT_S`` (default 100, JAX's) is how long JAX's coordination
  service waits for a silent process before it aborts the others; ``CAPO_PEER_STALE_S``
  (default 20) how long before ``peers.PeerWatch`` names the silent peer in the log.
  """
  timeout_s = _env_int("CAPO_HEARTBEAT_TIMEOUT_S", 100)
  coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if coordinator:
    num, pid = _env_int("JAX_NUM_PROCESSES"), _env_int("JAX_PROCESS_ID")
    # CPU devices of different processes talk through gloo; the option only
    # concerns the CPU backend, so it is harmless on TPU / GPU. (Asking for
    # the backend here would initialise it too early.)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=coordinator,
      num_processes=num,
      process_id=pid,
      heartbeat_timeout_seconds=timeout_s,
    )
  elif len(os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",")) > 1 or _slurm_tasks() > 1:
    jax.distributed.initialize(heartbeat_timeout_seconds=timeout_s)
  else:
    return False
  log.info(
    "jax.distributed: process %d of %d, %d local / %d global devices",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
  stale_s = _env_int("CAPO_PEER_STALE_S", 20)
  from jax._src import distributed  # pylint: disable=import-outside-toplevel  (its KV store)

  peers.PeerWatch(
    distributed.global_state.client,
    jax.process_index(),
    jax.process_count(),
    interval_s=min(5.0, stale_s / 4),
    stale_s=stale_s,
    heartbeat_timeout_s=timeout_s,
  ).start()
  return True


def _slurm_tasks() -> int:
  try:
    return int(os.environ.get("SLURM_NTASKS", "1"))
  except ValueError:
    return 1


def is_main_process() -> bool:
  return jax.process_index() == 0
