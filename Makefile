# Two entry points for a fresh machine: `make serve` (serve the default pair, answer a request)
# and `make test`. Both create .venv and install what they need into it.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints-cpu.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve generate test bench serve-config

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c $(CONSTRAINTS) -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/specserve serve --demo

generate: $(STAMP)
	$(VENV)/bin/specserve generate

test: $(STAMP)
	$(PY) -m pytest -q

serve-config: $(STAMP)
	$(VENV)/bin/specserve serve-config
