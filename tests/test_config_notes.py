"""Config fields that do nothing for some methods say so (issue 42, item 9).

CAPO pairs on the binary ``correct``; reward plug-ins and DAPO's overlong penalty shape only the
scalar reward, which the baselines read. A CAPO run that sets them logs one line saying so, so a
comparison with shaping on does not silently treat CAPO and the baselines differently.
"""

import logging

import pytest

from capo_jax.run import checks
from capo_jax.run import spec as spec_lib
from configs import common

SHAPING = {
  "overlong": ("reward.overlong_buffer", 4),
  "plug-in": ("reward.fns", ("correct", "capo_jax.data.example_rewards:boxed_format")),
}


def _spec(algo: str, field: str | None = None, value=None) -> spec_lib.RunSpec:
  c = common.shrink(common.get_base_config())
  c.algo.name = algo
  if field is not None:
    section, name = field.split(".")
    c[section][name] = value
    if name == "fns":
      c.reward.weights = (1.0,) * len(value)
  return spec_lib.RunSpec.from_config(c, num_devices=1)


def _notes(caplog) -> list[str]:
  return [
    r.getMessage()
    for r in caplog.records
    if r.name == checks.__name__ and "change no advantage" in r.getMessage()
  ]


@pytest.mark.parametrize("kind", sorted(SHAPING))
def test_a_capo_run_with_reward_shaping_logs_one_line(kind, caplog):
  field, value = SHAPING[kind]
  with caplog.at_level(logging.WARNING, logger=checks.__name__):
    _spec("capo", field, value)
  notes = _notes(caplog)
  assert len(notes) == 1, notes
  assert "algo.name='capo'" in notes[0] and "pairs on `correct`" in notes[0]


@pytest.mark.parametrize("algo, kind", [("grpo", "overlong"), ("cde", "plug-in"), ("capo", None)])
def test_no_line_where_the_fields_act_or_are_unset(algo, kind, caplog):
  field, value = SHAPING[kind] if kind else (None, None)
  with caplog.at_level(logging.WARNING, logger=checks.__name__):
    _spec(algo, field, value)
  assert _notes(caplog) == []
