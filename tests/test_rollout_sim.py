"""The scheduler simulation of tools/rollout_sim.py, on a case counted by hand."""

from __future__ import annotations

import dataclasses

import numpy as np

from capo_jax.sampling import plans, slots
from tools import rollout_sim as rl


def test_simulation_mirrors_the_engines_tail_loops():
  assert (rl.Shape.shrink, rl.Shape.max_loops) == (plans.SHRINK, plans.MAX_PHASES)


def test_refill_chunks_mirror_the_engine():
  assert rl.Shape.refill_chunk == slots.REFILL_CHUNK
  chunks = lambda P, n: rl.refill_chunks(rl.Shape(prompt_len=P, prompt_tokens=n))  # noqa: E731
  assert chunks(1024, 200) == (2, 128)  # the step estimate's prompts
  assert chunks(1024, 0) == chunks(1024, 2000) == (8, 128)  # the whole prompt
  assert chunks(64, 10) == (1, 64) and chunks(200, 10) == (1, 200)  # 128 does not divide P


def test_tail_loop_reads_counted_by_hand():
  # 2 slots, rows of 1, 1, 1 and 8 tokens, no prompt, 1-column blocks, halving.
  shape = dataclasses.replace(rl.Shape(), rows=4, samples=1, prompt_len=0, cap=8, block=1, shrink=2)
  lengths = np.array([1, 1, 1, 8])
  # Steps 1-2: two slots, each read up to the longest active row (1 column);
  # rows 2 and 3 start after step 1. Once row 2 ends (step 2) no row waits and
  # row 3 alone fits in one slot: steps 3-9 read 2, 3, ... 8 columns of 1 slot.
  sim = rl.simulate(lengths, shape, 2)
  assert sim["steps"] == 9
  assert sim["kv_read"] == 2 * 1 + 2 * 1 + sum(range(2, 9))
  assert sim["gathered"] == 1 * 8  # the one-slot cache, prompt + cap columns
  # Per engine loop: its steps, and the blocks a layer's block loop runs, summed.
  assert sim["phase_steps"] == [2, 7] and sim["phase_blocks"] == [1 + 1, sum(range(2, 9))]
  one_loop = rl.simulate(lengths, dataclasses.replace(shape, max_loops=1), 2)
  assert one_loop["kv_read"] == 2 * 1 + 2 * 1 + 2 * sum(range(2, 9))
  assert one_loop["gathered"] == 0


def test_every_row_in_a_slot_still_has_its_tail_loops():
  # 4 slots for 4 rows of 1, 1, 2 and 8 tokens, no prompt, 1-column blocks, halving.
  shape = dataclasses.replace(rl.Shape(), rows=4, samples=1, prompt_len=0, cap=8, block=1, shrink=2)
  lengths = np.array([1, 1, 2, 8])
  # Step 1: four slots, one column each; rows 0 and 1 end, the 2 left fit in 2 slots.
  # Step 2: two slots, 2 columns each; row 2 ends, row 3 alone fits in one slot:
  # steps 3-8 read 3, 4, ... 8 columns of 1 slot.
  sim = rl.simulate(lengths, shape, 4)
  assert sim["steps"] == 8 and sim["phase_slots"] == [4, 2, 1]
  assert sim["phase_steps"] == [1, 1, 6]
  assert sim["kv_read"] == 4 * 1 + 2 * 2 + sum(range(3, 9))
  assert sim["gathered"] == 2 * 8 + 1 * 8
  # More slots than rows: the same engine. None: the lockstep decode, all 4 rows for 8 steps.
  assert rl.simulate(lengths, shape, 9) == sim
  lockstep = rl.simulate(lengths, shape, None)
  assert lockstep["steps"] == 8 and lockstep["kv_read"] == 4 * sum(range(1, 9))
