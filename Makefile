# Two commands do all the set-up on a fresh machine:
#   make train   install, then run the default training job
#   make test    install, then run the test suite (this is what CI runs)
#   make gpu-check  on a GPU machine: the cuda tests and a short GPU benchmark, one JSON line (no venv, no
#                   download: the machine's own Python with torch; on a CPU-only machine it says so and exits 0)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install train test test-unit lint bench gpu-check clean

$(STAMP): pyproject.toml setup.py $(wildcard native/*.cpp native/*.h native/torch/*.cpp)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch is pinned first so that no other requirement can pull a (multi-GB) CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q setuptools wheel pybind11
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/infinity train

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests

test-unit: $(STAMP)
	$(PY) -m pytest -q -m unit tests

bench: $(STAMP)
	$(PY) tools/bench_adam.py --json

# The venv's Python where there is one, else the machine's (a GPU image's torch; nothing is installed from the net).
gpu-check:
	@$(if $(wildcard $(PY)),$(PY),$(PYTHON)) tools/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info infinity/_native*.so infinity/_host_allocator*.so
