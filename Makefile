# Two entry points, each doing all set-up on a fresh machine (Python 3.11, no GPU):
#   make run    install into .venv, then run the default workflow on config.yaml
#   make test   install into .venv, then run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= 2
# Nothing is fetched from the Hugging Face hub in the default run or the tests.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: install run test figures clean

$(BIN)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	@# pip byte-compiles on one core (48 s of a 93 s install); compileall on all of them (30 s on
	@# 2). Jobs must find the .pyc: with PYTHONDONTWRITEBYTECODE they never write them. One
	@# file of torch's tests is Python 3.12 syntax and fails, as it does (silently) under pip.
	$(BIN)/python -m compileall -q -j $(CORES) $(VENV)/lib > /dev/null || true
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/snakemake --cores $(CORES)

test: install
	$(BIN)/pytest -ra --durations=10 -n $(CORES) --dist loadfile

figures: install
	$(BIN)/snakemake --cores 1 figures

# Every output folder of the workflow, as dimattn.paths lays them out (results/README.md stays).
clean: install
	rm -rf $$($(BIN)/python -m dimattn.paths)
