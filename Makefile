# Two commands (see README): `make run` and `make test`. Each sets up .venv first.
PYTHON ?= python3.11
VENV ?= .venv
# The CPU build of torch; a plain `torch` requirement would pull a multi-GB CUDA build.
# GPU users: install their CUDA torch into the venv first, or set TORCH=torch.
TORCH ?= torch==2.13.0
SNAKEMAKE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup run test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet "$(TORCH)"
	$(VENV)/bin/pip install --quiet -e ".[test]"
	touch $@

run: setup
	$(VENV)/bin/snakemake --cores all $(SNAKEMAKE_ARGS)

test: setup
	$(VENV)/bin/pytest $(PYTEST_ARGS)

clean:
	rm -rf results .snakemake
