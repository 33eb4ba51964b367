# One-command setup + run. `make train` / `make test` create .venv with Python 3.12 on first use.
SHELL := /bin/bash
PY312 ?= $(shell command -v python3.12 2>/dev/null || (PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null))
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup train test test-fast dry-run lint clean

$(VENV)/.installed: pyproject.toml
	@bash scripts/setup_venv.sh
	@touch $@

setup: $(VENV)/.installed

# The main job: the tiny GLM-5-style model on mock data, CPU, 30 steps, wandb offline.
train: setup
	$(PY) train.py model=glm5_tiny precision=fp32 train.steps=30 logging.mode=offline $(ARGS)

dry-run: setup
	$(PY) train.py train.dry_run=true $(ARGS)

# Lint: ruff (pinned in the `test` extra) with the rules of pyproject.toml's [tool.ruff].
lint: setup
	$(PY) -m ruff check .

# The test suite CI runs (GPU tests skip on CPU; SLURM tests need scripts/slurm_local.sh); about
# 35 min on 2 CPU cores (docs/benchmarks.md). Runs quiet (-q); a -q in ARGS is dropped, as pytest's
# -q -q would drop the summary line (`make test ARGS="tests/test_sweep.py -q"`).
test: setup
	$(PY) -m pytest -q $(filter-out -q --quiet,$(ARGS))

clean:
	rm -rf $(VENV) runs multirun outputs
