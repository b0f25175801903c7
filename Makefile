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

# the second torch release, for the upgrade check: a CUDA build (~5.5 GB) that runs on the CPU.
# Kept outside the clone and reused by every later run on this machine (installing it takes
# 3-5 minutes); each run points it at this clone's kload (pip -e, seconds).
TORCH_NEXT ?= torch==2.14.1
VENV_NEXT  ?= $(HOME)/.cache/kload-dev/venv-$(subst ==,-,$(TORCH_NEXT))
NEXT_PY    := $(VENV_NEXT)/bin/python

# (under a lock: two runs on one machine make it once)
$(VENV_NEXT)/.installed:
	mkdir -p $(dir $(VENV_NEXT))
	flock $(VENV_NEXT).lock sh -c '[ -f $@ ] || { $(PYTHON) -m venv $(VENV_NEXT) && \
	  $(NEXT_PY) -m pip install -q --upgrade pip && $(NEXT_PY) -m pip install -q "$(TORCH_NEXT)" numpy pytest && \
	  touch $@; }'


.PHONY: install demo tools test test-quick pytest next-venv bench upgrade-check
install: $(VENV)/.installed

# this clone's kload, with its dependencies and IPython (the NVRTC cell test), in the second venv (every run:
# it may have served another clone)
next-venv: $(VENV_NEXT)/.installed
	flock $(VENV_NEXT).lock $(NEXT_PY) -m pip install -q -e ".[notebook]"

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# Debian's ccache (the compiler-launcher test), clangd (the `kload ide` test), redis-server
# (the remote-cache tests start their own, on loopback) and clang 19 (tests/test_clang.py: the
# second compiler), as command:package; installed when missing and we are root
tools:
	@for pair in ccache:ccache clangd:clangd redis-server:redis-server clang++-19:clang-19; do \
	  tool=$${pair%%:*}; package=$${pair#*:}; command -v $$tool >/dev/null || { [ "$$(id -u)" = 0 ] && \
	  command -v apt-get >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$package >/dev/null; } || \
	  echo "note: $$tool is not installed; its tests will be skipped"; done

# the whole suite (what .ci/run runs): pytest on two workers, and beside it the second venv's
# install and `make upgrade-check` (their compiles fill the cores pytest's waits leave idle);
# at the end, the wall time and the five slowest tests
test: $(VENV)/.installed tools
	@date +%s > .test-started
	$(MAKE) -j3 pytest upgrade-check
	@echo "make test: passed in $$(( $$(date +%s) - $$(cat .test-started) )) s; the five slowest tests:"
	@cat .test-slowest
	@rm -f .test-started

pytest: $(VENV)/.installed
	KLOAD_SLOWEST_FILE=.test-slowest $(PY) -m pytest -q tests -n 2 --dist loadfile --durations=25 --durations-min=5

# the quick part, to run while working (under 5 minutes): no test marked slow (docs/testing.md)
test-quick: $(VENV)/.installed
	$(PY) -m pytest -q tests -m "not slow" --durations=10

# one cache, two torch releases (tests/upgrade_check.py); the .cu of every binding style built
# and loaded under the CUDA build of torch (tests/cuda_check.py); NVRTC's tests, where NVRTC is.
# KLOAD_PCH=0: their caches are thrown away, so a precompiled header would be built for nothing;
# the split .cu's tests (tests/test_cuda_split.py) keep one cache for the file and its precompiled #include blocks
upgrade-check: $(VENV)/.installed next-venv
	KLOAD_PCH=0 $(PY) tests/upgrade_check.py $(PY) $(NEXT_PY)
	KLOAD_PCH=0 KLOAD_CACHE_DIR=$$(mktemp -d) $(NEXT_PY) tests/cuda_check.py
	KLOAD_PCH=0 KLOAD_CACHE_DIR=$$(mktemp -d) $(NEXT_PY) -m pytest -q -p no:cacheprovider tests/test_nvrtc.py
	$(NEXT_PY) -m pytest -q -p no:cacheprovider tests/test_cuda_split.py
	KLOAD_TORCH_FILES_TESTS=1 $(NEXT_PY) -m pytest -q -p no:cacheprovider tests/test_torch_pch.py

# the benchmarks; the bench extra brings matplotlib (the kernels' chart) and the peers live.py runs
bench: $(VENV)/.installed
	$(PY) -c "import matplotlib, cppimport, tvm_ffi" 2>/dev/null || $(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/loader.py
	$(PY) benchmarks/kernels.py
	$(PY) benchmarks/live.py
	$(PY) benchmarks/stable.py
	$(PY) benchmarks/clients.py
	$(PY) benchmarks/remote.py
