r"""Command line: ``python -m capo_jax.main --config=configs/<run>.py --workdir=DIR``.

Config fields are overridden with dotted flags (``--config.algo.tau=0.5``);
``--config=configs/<run>.py:shrink`` runs the tiny CPU variant. Re-running
the same command with the same workdir resumes from its last checkpoint.

On Linux the command first re-executes itself once with glibc's transparent
huge pages for the host heap (``capo_jax/hugepages.py``; ``CAPO_HUGEPAGES=0``
turns it off): XLA:CPU maps each step's temporaries afresh, and huge pages make
that cheaper, with the same results (the measured effect: ``docs/training.md``).
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX is imported: glibc reads the tunable at start
  from capo_jax import hugepages

  hugepages.reexec_with_hugepages()

import logging  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from absl import app, flags
from ml_collections import config_flags

from capo_jax.run.spec import RunSpec
from capo_jax.runtime import compile_cache, distributed

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Run config file (configs/*.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (local or gs://).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.getLogger().setLevel(logging.INFO)
  logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-save chatter
  distributed.maybe_initialize()
  config, workdir = _CONFIG.value, _WORKDIR.value
  if workdir is None:  # a required flag: absl rejects its absence before main
    raise app.UsageError("--workdir is required")
  # The one translation of the config: everything below takes the spec.
  if "demo" in config:  # the embedded demo: warm start, then RL, then the report
    from capo_jax.demo import run as demo_run  # pylint: disable=import-outside-toplevel

    spec = demo_run.spec_of(config)
    compile_cache.enable(spec.compilation_cache_dir, workdir)
    demo_run.run(spec, workdir)
    return
  spec = RunSpec.from_config(config)
  compile_cache.enable(spec.compilation_cache_dir, workdir)
  from capo_jax.run import loop  # pylint: disable=import-outside-toplevel

  loop.train(spec, workdir)


if __name__ == "__main__":
  app.run(main)
