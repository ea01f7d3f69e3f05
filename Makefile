# One-command set-up: `make test` and `make demo` create .venv and install everything on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
EXTRAS := torch,fast,sklearn,io,dask,study,gpu,dev

.PHONY: setup test study demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# the CPU build of torch; any other spec would pull a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	# build the C++ executor and compile the kernels now rather than at the first calls
	$(BIN)/python -m normkit.backends.cpu --dtypes all
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 tests

study: $(STAMP)
	$(BIN)/normkit study

demo: $(STAMP)
	$(BIN)/normkit demo

bench: $(STAMP)
	$(BIN)/normkit bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
