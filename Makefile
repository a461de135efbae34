# tf_adasum developer commands. `make test` is all a fresh clone needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
EXTRAS := cpu,mpi,viz,eval,docs,test,ray

.PHONY: install system-deps test test-quick lint docs eval bench clean

install: $(STAMP)

$(STAMP): setup.py $(wildcard tf_adasum/native/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	$(PY) -W ignore::RuntimeWarning:runpy -m tf_adasum.native.build \
	  || echo "warning: the native CPU kernels were not built; Adasum's arithmetic will use XLA (slower)"
	$(PY) -W ignore::RuntimeWarning:runpy -m tf_adasum.engines.mpi_native --build \
	  || echo "warning: the native MPI ops were not built; the MPI engine will use its slower portable path"
	touch $(STAMP)

# Debian packages that some tests use: a one-machine Slurm cluster (tests/test_slurm.py).
# Installed as root where apt-get exists (.ci/run does this); elsewhere those tests skip, saying why.
SYSTEM_PACKAGES := slurm-wlm munge libpmix-dev
system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  [ -z "$$missing" ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends $$missing >/dev/null; } \
	  || echo "warning: could not install $$missing; the Slurm tests will be skipped"; \
	else echo "system-deps: needs root and apt-get; install $(SYSTEM_PACKAGES) yourself for the Slurm tests"; fi

test: install
	$(PY) -m pytest

test-quick: install
	$(PY) -m pytest -m "not slow and not multiworker and not mpi"

lint: install
	$(VENV)/bin/ruff check $(wildcard tf_adasum tests benchmarks examples)

# The documentation site into site/ (offline; warnings are errors). tests/test_docs.py builds it too
# and checks every link, image and API entry.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

eval: install
	$(VENV)/bin/tf-adasum eval

bench: install
	$(VENV)/bin/tf-adasum bench

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .hypothesis
