# The two commands: `make up` (the main job) and `make test` (every test).
# Both create .venv when it is missing. torch==2.13.0 is installed first when no
# torch is importable: a looser spec on a machine without torch pulls a multi-GB CUDA build.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.tandem-installed
# inference-perf needs Python >= 3.12 and pins its own transformers: it gets a venv of its
# own, made with the first Python >= 3.12 found (pyenv's included); with none, its test skips.
PERF_VENV ?= .venv-perf
PERF_PY   ?= $(shell for p in python3.12 python3.13 $(HOME)/.pyenv/versions/3.1[2-9]*/bin/python3; \
	do $$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && echo $$p && break; done)
PERF_STAMP := $(PERF_VENV)/.inference-perf-installed
# pip byte-compiles every installed module by default (for .venv-perf, 48 of its ~85 s on a
# 2-core box); Python compiles a module on its first import instead, and only those used.
PIP_INSTALL := -m pip install -q --no-compile
# ...which holds only where Python may write its bytecode cache. With PYTHONDONTWRITEBYTECODE
# set (many CI images and shells set it) every process compiles torch, sympy and the rest
# from source again: 4.3 s instead of 2.0 s for `import torch` on a 2-core EPYC, paid by each
# of the suite's worker processes and by `make up`'s. Make's commands run without it.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv install model proto up test bench clean perf-venv

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(STAMP): $(VPY) pyproject.toml
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) $(PIP_INSTALL) $(TORCH)
	$(VPY) $(PIP_INSTALL) -e '.[dev]'
	@touch $(STAMP)

venv install: $(STAMP)

$(PERF_STAMP):
	@if [ -n "$(PERF_PY)" ]; then \
		$(PERF_PY) -m venv $(PERF_VENV) && \
		$(PERF_VENV)/bin/python $(PIP_INSTALL) 'inference-perf>=0.7,<0.8' && touch $@; \
	else echo "no Python >= 3.12 here: inference-perf not installed (its test skips)"; fi

perf-venv: $(PERF_STAMP)

model: $(STAMP)
	$(VENV)/bin/tandem fetch-model

# Generated gRPC code is rebuilt from proto/*.proto (tests/proto checks it is not stale).
proto: $(STAMP)
	$(VPY) -m proto.build

up: model proto
	$(VENV)/bin/tandem up

test: model proto perf-venv
	$(VPY) -m pytest -q -ra --durations=25

bench: model proto
	$(VPY) bench/bench_engine.py
	$(VPY) bench/bench_kvtransfer.py
	$(VPY) bench/bench_handoff.py

clean:
	rm -rf $(VENV) $(PERF_VENV) build *.egg-info
