# Two entry points for a fresh machine: `make serve` (serve the default pair, answer a request)
# and `make test`. Both create .venv and install what they need into it.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints-cpu.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve generate test fuzz soak reliability stat-full bench serve-config gpu-check

# uv installs in seconds what pip installs in minutes. It reads no pip configuration, so the wheel
# folder pip is pointed at (where a machine keeps its CPU torch wheel) is handed to it; elsewhere
# UV_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu finds that wheel (docs/testing.md).
# Unlike pip, uv writes no bytecode unless told: where PYTHONDONTWRITEBYTECODE is set (as on CI
# machines), every process would then compile torch's and transformers' sources at each import,
# and each of a Serve app's replicas imports them.
UV_VERSION := 0.13.9
FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) $(if $(FIND_LINKS),--find-links $(FIND_LINKS)) \
		-c $(CONSTRAINTS) -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/specserve serve --demo

generate: $(STAMP)
	$(VENV)/bin/specserve generate

# Two pytest-xdist workers: most tests run one torch thread, and a Serve test spends much of its
# time waiting on replicas. Every Ray test runs on one worker, in order (tests/conftest.py).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# The long fuzz run: 5,000 hypothesis bodies per fuzz test plus schemathesis on /openapi.json.
fuzz: $(STAMP)
	SPECSERVE_FUZZ_EXAMPLES=$${SPECSERVE_FUZZ_EXAMPLES:-5000} $(PY) -m pytest -q tests/test_fuzz_api.py --hypothesis-show-statistics

# Ten minutes of mixed greedy, sampled, streamed, chat and dropped requests at 4 streams against
# the default pair: zero errors, per-process RSS growth <= 10% after warm-up (writes bench-out/soak.json;
# the published run is bench/results/soak-cpu-2core.json).
soak: $(STAMP)
	$(PY) -m specserve.bench.soak --duration-s $${SOAK_S:-600} --streams 4

# The slow tests CI leaves out (docs/testing.md): node loss on a multi-node `ray start` cluster, served
# tensor-parallel groups, the other conformance apps, online learning served end to end. One pytest
# process per module (tests/run_each_module.py): a Ray driver reads its auth mode once per process.
reliability: $(STAMP)
	$(PY) tests/run_each_module.py -q -m slow

serve-config: $(STAMP)
	$(VENV)/bin/specserve serve-config

# The full-size statistical runs (marker stat_full) whose CI-sized versions `make test` runs:
# 20,000 sampled requests through generate(), 3,000 structured-output requests, 1,500 penalized ones.
stat-full: $(STAMP)
	$(PY) -m pytest -q -m stat_full

# The prepared GPU check (docs/testing.md, "The GPU check"): the machine's own python3 (the one with
# torch), no .venv; wheels in .whl/ (made by the recipe there) are installed first into a scratch folder
# that comes first on PYTHONPATH. Without CUDA it runs its CPU smoke. GPU_CHECK_ARGS: e.g. --out $$OUT.
GPU_CHECK_SITE ?= /tmp/specserve-gpu-check-site
gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then \
		$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
			--target $(GPU_CHECK_SITE) .whl/*.whl || exit 1; fi
	PYTHONPATH=$(GPU_CHECK_SITE)$${PYTHONPATH:+:$$PYTHONPATH} SPECSERVE_VIA_MAKE=1 PYTHONUNBUFFERED=1 \
		$(PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)
