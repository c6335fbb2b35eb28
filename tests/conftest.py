"""Shared pytest setup: slow-test opt-in and the path to ../shared/data."""

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
SHARED_DATA = pathlib.Path(os.environ.get("CAPO_SHARED_DATA", REPO.parent / "shared" / "data"))


def pytest_addoption(parser: pytest.Parser) -> None:
  parser.addoption("--runslow", action="store_true", help="run tests marked slow")


def pytest_configure(config: pytest.Config) -> None:
  config.addinivalue_line(
    "markers",
    "tpu_aot: compiles for TPU topologies ahead of time; needs "
    "libtpu (tools/setup_aot_tpu.sh), skipped without it",
  )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  if config.getoption("--runslow"):
    return
  skip = pytest.mark.skip(reason="slow: pass --runslow to run")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def shared_data() -> pathlib.Path:
  """The benchmark files of ../shared/data; skips when a fresh clone lacks them."""
  if not SHARED_DATA.is_dir():
    pytest.skip(f"benchmark data not found at {SHARED_DATA} (set CAPO_SHARED_DATA)")
  return SHARED_DATA
