# Each target creates .venv if missing and installs the project into it first.
# torch is pinned to the local 2.13.0 CPU wheel first so that nothing resolves a CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(FIND_LINKS) "torch==2.13.0"
	$(PY) -m pip install -q $(FIND_LINKS) -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m autopar.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=12 -m "not matrix"

# Errors, likely bugs and import order (ruff, configured in pyproject.toml); CI runs it first.
lint: $(VENV)/.installed
	$(PY) -m ruff check autopar tests bench

# Every model family's parity case (tests/test_parity.py, marker "matrix"): CI runs it after `make test`.
test-matrix: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=12 -m matrix

# The presets' profiles that ship with the package (tests/test_plan_cli.py checks they are current:
# rerun after a change to autopar/capture.py, traceable.py, cut.py, fxops.py, memory.py, roles.py,
# analysis.py or models.py, or to torch: the profile cache key hashes them).
profiles: $(VENV)/.installed
	$(PY) -c "from autopar.api import write_shipped_profiles as w; print(len(w()), 'preset profiles written')"

parity: $(VENV)/.installed
	$(PY) -m bench.parity_matrix

# torchtitan (the alternative bench/step_ratio.py measures against), without its dependencies.
$(VENV)/.bench-deps: $(VENV)/.installed bench/torchtitan_deps.txt
	$(PY) -m pip install -q --no-deps $(FIND_LINKS) -r bench/torchtitan_deps.txt
	touch $@

bench-deps: $(VENV)/.bench-deps

bench: $(VENV)/.bench-deps
	$(PY) -m bench.run_all

bench-quick: $(VENV)/.installed
	$(PY) -m bench.run_all --quick

.PHONY: install demo test test-matrix lint profiles parity bench bench-deps bench-quick
