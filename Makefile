# `make setup` builds .venv with everything the project needs (idempotent); `make test` runs the suite.
PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test tiny-models clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml app/platform/cpu_torch_shim.py
	@test -x $(PY) || { echo "setup: creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "setup: installing ray-flowgrpo (editable, with the dev extra) into $(VENV)"
	$(PY) -m pip install --quiet --upgrade "pip>=24,<27"
	$(PY) -m pip install --quiet -e ".[dev]"
	@echo "setup: torchvision/torchaudio import shim (only installed on CPU-only torch)"
	$(PY) -m app.platform.install_cpu_shim
	@touch $(STAMP)
	@echo "setup: done ($(VENV))"

test: setup
	$(PY) -m pytest

tiny-models: setup
	$(PY) -m jobs.make_tiny_models --out .cache/tiny-qwen-image

clean-venv:
	rm -rf $(VENV)
