# The two commands: `make up` (the main job) and `make test` (every test).
# Both create .venv when it is missing. torch==2.13.0 is installed first when no
# torch is importable: a looser spec on a machine without torch pulls a multi-GB CUDA build.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.tandem-installed

.PHONY: venv install model proto up test bench clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip

$(STAMP): $(VPY) pyproject.toml
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

venv install: $(STAMP)

model: $(STAMP)
	$(VENV)/bin/tandem fetch-model

# Generated gRPC code is rebuilt from proto/*.proto (tests/proto checks it is not stale).
proto: $(STAMP)
	$(VPY) -m proto.build

up: model proto
	$(VENV)/bin/tandem up

test: model proto
	$(VPY) -m pytest -q -ra --durations=25

bench: model proto
	$(VPY) bench/bench_engine.py
	$(VPY) bench/bench_kvtransfer.py
	$(VPY) bench/bench_handoff.py

clean:
	rm -rf $(VENV) build *.egg-info
