# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch and torchvision first, as a matched pair: left to a plain `torch`
# requirement, pip would pick whatever build it finds. Override for your
# platform, e.g. `make install TORCH_PKGS="torch==2.5.1 torchvision==0.20.1"`.
TORCH_PKGS ?= torch==2.14.1 torchvision==0.29.1
STAMP  := $(VENV)/.installed
# Every package at the version the suite was last green with (constraints.txt, pip -c): a fresh clone and CI
# test the same code whatever the registry has published since. `make test-latest` leaves them out.
CONSTRAINTS ?= constraints.txt
PIP_INSTALL = $(PY) -m pip install --quiet $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
# bitsandbytes (the qlora extra) in a folder of its own, not the venv: where it is importable every
# `import peft` loads it (about 1.2 s per process, and a warning on stderr). `make test` runs the
# 4-bit tests (tests/test_qlora.py) in a second pass with it on PYTHONPATH.
QLORA_SITE := $(VENV)/qlora-site
QLORA_PKGS ?= bitsandbytes>=0.48
# trl, for the side-by-side checks against TRL only (tests/test_dpo_trl.py, tests/test_preference_trl.py,
# bench/test_objectives.py), in a folder of its own without its dependencies: the venv's torch, transformers,
# peft, accelerate and datasets stay as they are, and vlft never imports it.
TRL_SITE := $(VENV)/trl-site
TRL_PKGS ?= trl==1.16.*

# The device check runs on a machine with an accelerator and that machine's own Python (with torch,
# transformers, peft, pluggy, click and pytest installed); here it uses the venv and stops where it
# needs a device. Nothing is installed and no metadata is written: the built-in plugins register directly
# (vlft/plugins.py), so the checkout first on PYTHONPATH is vlft. DEVICE_ARGS: --quick,
# --skip-scale, --list (the time budget), --timeout-factor N.
DEVICE_PY   ?= $(if $(wildcard $(PY)),$(PY),python3)
DEVICE_OUT  ?= device-check-results
DEVICE_ARGS ?=
# `make device-rehearsal`, by hand (not CI): the device machine's stack in a venv outside the checkout.
REHEARSAL_VENV   ?= /work/rehearsal-venv
REHEARSAL_PYTHON ?= python3.12

.PHONY: install run lint test test-latest constraints bench device-check device-rehearsal clean

$(STAMP): pyproject.toml Makefile examples/vlft-example-plugin/pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PIP_INSTALL) $(TORCH_PKGS)
	$(PIP_INSTALL) -e '.[dev]'
	$(PIP_INSTALL) -e examples/vlft-example-plugin
	rm -rf $(QLORA_SITE)
	$(PIP_INSTALL) --no-deps --target $(QLORA_SITE) '$(QLORA_PKGS)'
	rm -rf $(TRL_SITE)
	$(PIP_INSTALL) --no-deps --target $(TRL_SITE) '$(TRL_PKGS)'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/vlft run

# ruff (lint, and the format check) on the whole tree and pyright (basic) on vlft/ and plugins/, as pyproject.toml
# configures them; `make test` runs it first. Each noqa or pyright ignore left in the code names its reason.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright -p pyproject.toml --pythonpath $(PY)

# The suite in TEST_WORKERS processes (pytest-xdist), a test file per worker (--dist loadfile: a file's shared
# runs, its module fixtures, are built once); tests/conftest.py gives each worker its share of the threads.
# TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
	PYTHONPATH=$(abspath $(QLORA_SITE)) VLFT_REQUIRE_QLORA=1 $(PY) -m pytest -q tests/test_qlora.py \
	    bench/test_memory.py -k 'qlora or nf4'
	PYTHONPATH=$(abspath $(TRL_SITE)) VLFT_REQUIRE_TRL=1 $(PY) -m pytest -q tests/test_dpo_trl.py \
	    tests/test_preference_trl.py bench/test_objectives.py

# The suite on the newest versions pyproject.toml allows (no constraints, the newest matched torch pair), in a
# venv of its own: a new transformers shows up here as a failing run, its version named in pytest's header,
# not as a broken fresh clone. Once it is green, `make constraints VENV=.venv-latest` moves the pins to it.
LATEST_VENV ?= .venv-latest
test-latest:
	$(MAKE) test VENV=$(LATEST_VENV) CONSTRAINTS= TORCH_PKGS="torch torchvision"

# constraints.txt from $(VENV) as it is installed now (vlft itself and the example plugin left out).
constraints: $(STAMP)
	{ sed -n '1,/^[^#]/p' constraints.txt | grep '^#'; \
	  $(PY) -m pip freeze --exclude-editable | grep -v '^-e'; \
	  PYTHONPATH=$(abspath $(QLORA_SITE)):$(abspath $(TRL_SITE)) $(PY) -m pip list --format=freeze \
	    --path $(QLORA_SITE) --path $(TRL_SITE); } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# LoRA against OFT on the embedded default, trained to convergence (make run's settings), in one report:
# the table of the field report this project starts from. COMPARE_BACKEND=cuda (or ascend) on a device
# machine; run it twice with different backends into one COMPARE_OUT to compare platforms.
COMPARE_BACKEND ?= cpu
COMPARE_OUT     ?= runs/compare
compare: $(STAMP)
	$(VENV)/bin/vlft run --quiet --backend $(COMPARE_BACKEND) --method lora --output $(COMPARE_OUT)/lora-$(COMPARE_BACKEND)
	$(VENV)/bin/vlft run --quiet --backend $(COMPARE_BACKEND) --method oft --output $(COMPARE_OUT)/oft-$(COMPARE_BACKEND)
	$(VENV)/bin/vlft report $(COMPARE_OUT)/*-*/ --output $(COMPARE_OUT)/report
	@echo "report: $(COMPARE_OUT)/report/report.md"

bench: $(STAMP)
	mkdir -p bench/results
	PYTHONPATH=$(abspath $(TRL_SITE)) $(PY) -m pytest bench -q --benchmark-enable --benchmark-only \
	    --benchmark-json=bench/results/latest.json -p no:randomly
	PYTHONPATH=$(abspath $(QLORA_SITE)) $(PY) -m pytest bench/test_memory.py -k nf4 -q --benchmark-enable \
	    --benchmark-only --benchmark-json=bench/results/nf4.json -p no:randomly
	$(PY) bench/report.py bench/results/latest.json bench/results/nf4.json > bench/results/latest.md
	cat bench/results/latest.md

device-check:
	$(DEVICE_PY) bench/device_check.py --out $(DEVICE_OUT) $(DEVICE_ARGS)

device-rehearsal:
	REHEARSAL_VENV=$(REHEARSAL_VENV) REHEARSAL_PYTHON=$(REHEARSAL_PYTHON) bash bench/device_rehearsal.sh

clean:
	rm -rf $(VENV) $(LATEST_VENV) runs .pytest_cache
