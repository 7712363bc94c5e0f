# `make setup` builds .venv with everything the project needs (idempotent); `make test` runs `make lint`, then the
# whole suite (CI); `make test-fast` leaves out the tests marked slow (within three minutes on a 2-core machine); `make train` runs
# the main job on the tiny CPU config.
PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# uv installs the same set of packages as pip (the same resolution, checked with `uv pip freeze`) in 1-2 minutes where
# pip took 9.5 on a 2-core machine. Bytecode is compiled at install, as pip did: where PYTHONDONTWRITEBYTECODE is set
# (CI) every process would otherwise compile its imports from source. pip's find-links (PIP_FIND_LINKS: a machine's
# local wheels, its CPU torch among them) carry over.
UV     := $(shell command -v uv)

.PHONY: setup lint test test-fast train tiny-models clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml app/platform/cpu_torch_shim.py
	@test -x $(PY) || { echo "setup: creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "setup: installing ray-flowgrpo (editable, with the dev extra) into $(VENV) with uv"
	@test -n "$(UV)" || $(PY) -m pip install --quiet "uv>=0.9,<1"
	$(or $(UV),$(VENV)/bin/uv) pip install --python $(PY) --quiet --compile-bytecode $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) -e ".[dev]"
	@echo "setup: torchvision/torchaudio import shim (only installed on CPU-only torch)"
	$(PY) -m app.platform.install_cpu_shim
	@touch $(STAMP)
	@echo "setup: done ($(VENV))"

# ruff: pyflakes, pycodestyle, import order, bugbear, pyupgrade (pyproject.toml [tool.ruff])
lint: setup
	$(VENV)/bin/ruff check .

# two pytest-xdist workers: the tests that start Ray on one, in order; the in-process ones (one thread each) beside
# them (tests/conftest.py)
test: setup lint
	$(PY) -m pytest -n 2 --dist loadgroup

test-fast: setup
	$(PY) -m pytest -n 2 --dist loadgroup -m "not slow"

# config overrides given on make's command line: every variable whose name has a dot (`make train
# rollout.engine=diffusers train.num_steps=4`); ARGS="key=value ..." works too
CONFIG_OVERRIDES := $(strip $(foreach v,$(.VARIABLES),$(if $(and $(findstring .,$(v)),$(filter command line,$(origin $(v)))),$(v)=$($(v)))))

# the main job on the tiny config (CPU, a few minutes; CONFIG=configs/tiny_bagel_cpu.yaml for BAGEL); a new run
# folder each time
CONFIG ?= configs/tiny_cpu.yaml
train: setup
	$(PY) -m jobs.train --config $(CONFIG) logging.dir=runs/$(basename $(notdir $(CONFIG)))/$$(date +%Y%m%d-%H%M%S) \
		$(CONFIG_OVERRIDES) $(ARGS)

tiny-models: setup
	$(PY) -m jobs.make_tiny_models --out .cache/tiny-qwen-image

clean-venv:
	rm -rf $(VENV)
