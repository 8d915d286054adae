# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch and torchvision first, as a matched pair: left to a plain `torch`
# requirement, pip would pick whatever build it finds. Override for your
# platform, e.g. `make install TORCH_PKGS="torch==2.5.1 torchvision==0.20.1"`.
TORCH_PKGS ?= torch==2.14.1 torchvision==0.29.1
STAMP  := $(VENV)/.installed

.PHONY: install run test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PKGS)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/vlft run

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	mkdir -p bench/results
	$(PY) -m pytest bench -q --benchmark-enable --benchmark-only \
	    --benchmark-json=bench/results/latest.json -p no:randomly
	$(PY) bench/report.py bench/results/latest.json > bench/results/latest.md
	cat bench/results/latest.md

clean:
	rm -rf $(VENV) runs .pytest_cache
