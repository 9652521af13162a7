# Two commands do everything on a fresh clone (Python 3.11+, pip and make):
#   make run    set up, then run the main job on the embedded default (no server needed)
#   make test   set up, then run the test suite
PYTHON ?= python3
VENV ?= .venv
# the CPU build of PyTorch is enough for the default job; on a GPU worker use the CUDA build of your choice,
# e.g. make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH ?= torch==2.13.0
# optional extras beyond dev and team, comma-separated: on a GPU machine `make setup EXTRAS=gpu` adds bitsandbytes
# (QLoRA), FlashAttention and NVML
EXTRAS ?=
CONFIG ?= configs/default.yaml
BIN := $(VENV)/bin
# the suite in three processes on two cores: much of a slow test waits rather than computes (process starts,
# servers, heartbeats, a worker's silence), and a third process uses that time (about 26 min on 2 cores; the longest
# tests start first, so that all three end together: tests/scheduling.py)
# the slowest 25 tests are listed at the end, so that a slow run says where its time went
PYTEST_ARGS ?= -n 3 --durations=25

.PHONY: setup run test lint mlflow-ui prefect-ui clean

comma := ,
# one stamp per set of extras: asking for another set installs it into the same environment
STAMP := $(VENV)/.installed$(if $(EXTRAS),-$(subst $(comma),-,$(EXTRAS)))

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[dev,team$(if $(EXTRAS),$(comma)$(EXTRAS))]"
	touch $@

run: setup
	$(BIN)/llmops data init
	$(BIN)/llmops run $(CONFIG)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check llmops tests bench
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit/test_architecture.py

# the local UIs listen on loopback only: they have no login
mlflow-ui: setup
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/.llmops/mlflow/mlflow.db --host 127.0.0.1 --port 5000

prefect-ui: setup
	PREFECT_HOME=$(CURDIR)/.llmops/prefect $(BIN)/prefect server start --host 127.0.0.1 --port 4200

clean:
	rm -rf .llmops
