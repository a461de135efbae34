# tf_adasum developer commands. `make test` is all a fresh clone needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
EXTRAS := cpu,mpi,viz,eval,docs,test

.PHONY: install test test-quick lint docs eval bench clean

install: $(STAMP)

$(STAMP): setup.py $(wildcard tf_adasum/native/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	$(PY) -W ignore::RuntimeWarning:runpy -m tf_adasum.native_build \
	  || echo "warning: the native CPU kernels were not built; Adasum's arithmetic will use XLA (slower)"
	$(PY) -W ignore::RuntimeWarning:runpy -m tf_adasum.engines.mpi_native --build \
	  || echo "warning: the native MPI ops were not built; the MPI engine will use its slower portable path"
	touch $(STAMP)

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
