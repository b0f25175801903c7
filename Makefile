# The two set-up commands (README): `make demo` and `make test`. Each creates the
# virtual environment on first use, so a fresh machine needs nothing else.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is pinned here (CI installs exactly this); pyproject accepts torch>=2.4
TORCH  ?= torch==2.13.0
export MAX_JOBS ?= 2

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]" "$(TORCH)"   # the pin again: no test dependency may swap torch
	touch $@

# the second torch release, for the upgrade check: a CUDA build (~5.5 GB) that runs on the CPU
VENV_NEXT  ?= .venv-next
TORCH_NEXT ?= torch==2.14.1

$(VENV_NEXT)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_NEXT)
	$(VENV_NEXT)/bin/python -m pip install -q --upgrade pip
	$(VENV_NEXT)/bin/python -m pip install -q "$(TORCH_NEXT)" numpy
	$(VENV_NEXT)/bin/python -m pip install -q -e .
	touch $@

.PHONY: install demo test bench upgrade-check
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# Debian's ccache (the compiler-launcher test), clangd (the `kload ide` test) and redis-server
# (the remote-cache tests start their own, on loopback): installed when missing and we are root
test: $(VENV)/.installed
	@for tool in ccache clangd redis-server; do command -v $$tool >/dev/null || { [ "$$(id -u)" = 0 ] && \
	  command -v apt-get >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$tool >/dev/null; } || \
	  echo "note: $$tool is not installed; its test will be skipped"; done
	$(PY) -m pytest -q tests
	$(MAKE) upgrade-check

# one cache, two torch releases (tests/upgrade_check.py), then the .cu of every binding
# style built and loaded under the CUDA build of torch (tests/cuda_check.py)
upgrade-check: $(VENV)/.installed $(VENV_NEXT)/.installed
	$(PY) tests/upgrade_check.py $(PY) $(VENV_NEXT)/bin/python
	KLOAD_CACHE_DIR=$$(mktemp -d) $(VENV_NEXT)/bin/python tests/cuda_check.py

# the benchmarks; the bench extra brings matplotlib (the kernels' chart) and the peers live.py runs
bench: $(VENV)/.installed
	$(PY) -c "import matplotlib, cppimport, tvm_ffi" 2>/dev/null || $(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/loader.py
	$(PY) benchmarks/kernels.py
	$(PY) benchmarks/live.py
	$(PY) benchmarks/stable.py
	$(PY) benchmarks/clients.py
	$(PY) benchmarks/remote.py
