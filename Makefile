# meshserve: `make test` sets up everything from nothing; `make run` serves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
STUBS  := protos/grpc_service_pb2.py
MODELS := build/models

.PHONY: venv proto test run lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

proto: $(STUBS)

$(STUBS): protos/grpc_service.proto protos/model_config.proto protos/routing.proto protos/compile.py $(STAMP)
	$(BIN)/python protos/compile.py

test: $(STUBS)
	$(BIN)/python -m pytest -q

$(MODELS)/mlp/config.pbtxt: deploy/toy_models.py $(STUBS)
	$(BIN)/python -m deploy.toy_models $(MODELS)

# The whole mesh: private Redis, $(WORKERS) workers, the router on 127.0.0.1:8001.
WORKERS ?= 2
run: $(STUBS) $(MODELS)/mlp/config.pbtxt
	$(BIN)/python -m deploy.launch --workers $(WORKERS) --model-repository $(MODELS) $(RUN_ARGS)

lint: $(STUBS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy common worker router quantize deploy benchmarks

bench: $(STUBS)
	$(BIN)/python -m benchmarks.worker
	$(BIN)/python -m benchmarks.router
	$(BIN)/python -m benchmarks.summary

clean:
	rm -rf $(VENV) build protos/*_pb2*.py protos/*_pb2*.pyi
