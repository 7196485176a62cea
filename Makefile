# Two entry points for a fresh machine: `make serve` (serve the default pair, answer a request)
# and `make test`. Both create .venv and install what they need into it.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints-cpu.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve generate test fuzz bench serve-config

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

# The long fuzz run: 5,000 hypothesis bodies per fuzz test plus schemathesis on /openapi.json.
fuzz: $(STAMP)
	SPECSERVE_FUZZ_EXAMPLES=$${SPECSERVE_FUZZ_EXAMPLES:-5000} $(PY) -m pytest -q tests/test_fuzz_api.py --hypothesis-show-statistics

serve-config: $(STAMP)
	$(VENV)/bin/specserve serve-config
