# The README's two commands, each doing its own set-up on a fresh machine:
#   make demo     venv + runtime install when missing, then the embedded CPU demo (the cued
#                 testbed: warm start, GRPO, CAPO, the cued study's checks on this run)
#   make test     venv + test install when missing, then the default test suite
# Re-running is cheap: an install step reruns only when its requirements file changed.

VENV ?= .venv
PYTHON ?= python3
# Not the arithmetic demo's /tmp/capo_demo: its GRPO and CAPO checkpoints would be resumed.
WORKDIR ?= /tmp/capo_demo_cued
PY := $(VENV)/bin/python

.PHONY: demo test install clean-venv

$(VENV)/.runtime: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q -e . --no-deps
	touch $@

$(VENV)/.test: $(VENV)/.runtime requirements-test.txt
	$(PY) -m pip install -q -r requirements-test.txt
	touch $@

install: $(VENV)/.runtime

demo: $(VENV)/.runtime
	$(PY) -m capo_jax.main --config=configs/cued.py --workdir=$(WORKDIR)

test: $(VENV)/.test
	$(PY) -m pytest -q -n 2 tests

clean-venv:
	rm -rf $(VENV)
