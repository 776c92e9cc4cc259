# Two entry points, each doing all set-up on a fresh machine (Python 3.11, no GPU):
#   make run    install into .venv, then run the default workflow on config.yaml
#   make test   install into .venv, then run the whole test suite
#   make full   the same for configs/cpu-full.yaml, in its own working directory (tiers/cpu-full)
#   make figures [TIER=cpu-full]  every table and figure of a tier from published/<tier>/ alone
#   make publish [TIER=cpu-full]  after a complete run: its summaries and tables to published/<tier>/
#   make findings  docs/findings.md from published/ and reference/claims.yaml
#   make rehearsal  the paper DAG's dress rehearsal (configs/rehearsal.yaml)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= 2
# Nothing is fetched from the Hugging Face hub in the default run or the tests.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
# The venv is ours: each module's byte-code is written the first time a job imports it, so only
# what the jobs import is compiled (about 4,000 of the venv's 17,740 files), once.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install run full test rehearsal figures publish findings clean

# Each tier but the default runs in a working directory of its own (dimattn.workflow.tiers), laid out like
# the repository root by links, so that no two configs share a results/ folder.
TIER ?= default
ifeq ($(TIER),default)
TIER_DIR := .
TIER_ARGS :=
else
TIER_DIR := tiers/$(TIER)
TIER_ARGS := --directory $(TIER_DIR) --configfile configs/$(TIER).yaml
endif

$(BIN)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	@# No byte-compiling at install: pip's took 48 s of a 93 s install (one core), compileall of
	@# the whole venv 26 s on 2 cores; the jobs write the .pyc of what they import (above).
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/snakemake --cores $(CORES)

tiers/%/.linked:
	@test -f configs/$*.yaml || { echo "no tier $*: configs/$*.yaml is missing" >&2; exit 2; }
	mkdir -p tiers/$*
	for f in config.yaml configs reference published; do ln -sfn ../../$$f tiers/$*/$$f; done
	touch $@

full: install tiers/cpu-full/.linked
	$(BIN)/snakemake --cores $(CORES) --directory tiers/cpu-full --configfile configs/cpu-full.yaml

test: install
	$(BIN)/pytest -ra --durations=10 -n $(CORES) --dist loadfile

# The paper DAG at a size two CPUs run, against a local stand-in Hub, through profiles/slurm where
# the machine can host the one-node test cluster (tests/e2e/test_rehearsal.py): beyond make test's
# 10-minute budget beside the rest of the suite, so a target of its own, which CI runs (.ci/run).
rehearsal: install
	DIMATTN_REHEARSAL=1 $(BIN)/pytest -ra tests/e2e/test_rehearsal.py

figures: install $(if $(filter default,$(TIER)),,tiers/$(TIER)/.linked)
	$(BIN)/snakemake figures --cores $(CORES) $(TIER_ARGS) --config figures_from=published

publish: install
	$(BIN)/python -m dimattn.reporting.published publish $(TIER) --workdir $(TIER_DIR)

# docs/findings.md from every published tier and reference/claims.yaml; the README's tiers table.
findings: install
	$(BIN)/snakemake --cores 1 findings
	$(BIN)/python -m dimattn.reporting.published readme

# Every output folder of the workflow, as dimattn.workflow.paths lays them out (results/README.md stays).
clean: install
	rm -rf $$($(BIN)/python -m dimattn.workflow.paths)
