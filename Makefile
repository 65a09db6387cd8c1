# One entry point for set-up, tests, the demo and the benchmarks.
# Everything installs into a local virtual environment, so a fresh machine needs only Python.
# CPython before 3.12 (before 3.11.10 / 3.10.15 / 3.9.20 on those lines) can hang or kill a DataLoader worker
# forked in a distributed run (gh-112275: docs/reliability.md). The first interpreter free of it is used:
# python3, python3.12, python3.13, then pyenv's 3.12 or later; with none, python3 (the package then warns).
# Override with `make PYTHON=/path/to/python3`.
FORK_SAFE := import sys; v = sys.version_info; sys.exit(not (v >= (3, 12) or v[2] >= {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}.get(v[:2], 99)))
ifeq ($(origin PYTHON), undefined)
PYTHON := $(shell for p in python3 python3.12 python3.13 $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3 2>/dev/null); do $$p -c '$(FORK_SAFE)' >/dev/null 2>&1 && { echo $$p; exit; }; done; echo python3)
endif
PYTHON_VERSION := $(shell $(PYTHON) -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
VENV ?= .venv
# Pinned: an unpinned torch pulls several GB of CUDA wheels. Override with `make TORCH_SPEC=torch==X.Y.Z`.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# Each target installs what it needs, once (a stamp per set, inside the venv, so a rebuilt venv drops them):
# the package alone for `make demo` (DeepSpeed, installed, prints a line at every process start), the
# Trainer integration for `make demo-trainer`, the docs tooling for `make docs`, and everything the suite
# needs (test extras: transformers, trl, datasets, the docs tooling; and DeepSpeed) for `make test` and the rest.
BASE := $(VENV)/.base-$(PYTHON_VERSION)
STAMP := $(VENV)/.installed-$(PYTHON_VERSION)
TRAINER := $(VENV)/.trainer-$(PYTHON_VERSION)
DOCS := $(VENV)/.docs-$(PYTHON_VERSION)
# setup.py STREAMING, installed without their own requirements (which would replace torch, numpy, transformers).
STREAMING_SPEC := mosaicml-streaming==0.13.0 litdata==0.2.76 webdataset==1.0.2

.PHONY: install test test-full test-fast demo demo-trainer bench conformance docs docs-check torture soak programs dist clean

$(BASE): setup.py
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e .
	touch $(BASE)

$(STAMP): $(BASE)
	$(PY) -m pip install --quiet -e ".[test,deepspeed]"
	$(PY) -m pip install --quiet --no-deps $(STREAMING_SPEC)
	touch $(STAMP)

$(TRAINER): $(BASE)
	$(PY) -m pip install --quiet -e ".[transformers]"
	touch $(TRAINER)

$(DOCS): $(BASE)
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $(DOCS)

install: $(STAMP)

# Two pytest workers (pytest-xdist): the real multi-process launches one after another on one worker, every
# other test file whole on either (tests/conftest.py). `make test PYTEST_WORKERS=0` runs in one process.
PYTEST_WORKERS ?= 2
# The tests' folders (checkpoints by the thousand, each fsynced) live in memory where the machine has /dev/shm:
# an fsync there costs nothing, and what the tests check (which files, which bytes) is the same.
TEST_TMPDIR ?= $(shell test -d /dev/shm -a -w /dev/shm && echo /dev/shm || echo $${TMPDIR:-/tmp})
test: install
	TMPDIR=$(TEST_TMPDIR) $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup tests

# Every configuration of every property grid (make test runs a fixed sample of the large ones: tests/conftest.py),
# a resume from every save point and through both chains of resumes in every real-process scenario (make test:
# each kind of point and each chain from one scenario of each group of a launch, those with workers and those
# without: tests/mp_scenarios.py), and every launch's processes started from a fresh interpreter (make test
# forks most from a pre-imported one: tests/mp_zygote.py says what that changes).
test-full: install
	TMPDIR=$(TEST_TMPDIR) ACCELERATE_STATEFUL_GRID=full ACCELERATE_STATEFUL_LAUNCH=exec $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup tests

# A wheel for your own project's environment: pip install "dist/accelerate_stateful-<version>-py3-none-any.whl[transformers]"
dist: install
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w dist .

test-fast: install
	$(PY) -m pytest -q tests -m "not multiprocess"

demo: $(BASE)
	$(PY) examples/demo.py --self-check

# A 2-process 🤗 Trainer run SIGKILLed, then SIGTERMed, each time restarted with the same command; compared with an uninterrupted run.
demo-trainer: $(TRAINER)
	$(PY) examples/trainer.py --demo

# Hundreds of generated training programs (tests/lifecycle_programs.py) on 2 and 3 real processes, the ranks
# differing in what must not matter; the suite runs the first 9 of them (and 3 refusals).
# LIFECYCLE_MP_SEED picks another first seed.
programs: install
	TMPDIR=$(TEST_TMPDIR) LIFECYCLE_MP_LAUNCHES=$${LIFECYCLE_MP_LAUNCHES:-2:300:30,3:150:15} \
		$(PY) -m pytest -q -s tests/test_lifecycle_mp.py

# 50 kills at random instants (half aimed inside save_state), total_limit 1 then 3, a new seed each time.
torture: install
	TORTURE_KILLS=50 TORTURE_LIMITS=1,3 TORTURE_SEED=$${TORTURE_SEED:-$$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')} \
		$(PY) -m pytest -q -s tests/test_torture.py

# 100 short 2-process launches (every loader kind, workers, a checkpoint, end_training): none may hang at exit.
# Every process starts from a fresh interpreter, as a user's do.
# Then 300 short launches of the resume scenario sets (tests/mp_scenarios.py), one scenario each, rotating
# through every set: none may hang (the watchdog dumps every rank's and worker's stack) or fail.
# Then the elastic grid (tests/grid.py, docs/elastic.md): a language-model pipeline resumed across every ordered
# pair of (1-4 processes) x (0, 1, 2, 4 workers), 52 chains of 5 resumes in 91 launches; every chain exact.
# Then 300 random composable pipelines through random chains of topologies, in one process (tests/sources_fuzz.py).
soak: install
	rm -rf soak_out
	ACCELERATE_STATEFUL_LAUNCH=exec $(PY) tests/soak.py --kind exit --launches $${SOAK_LAUNCHES:-100} --out soak_out/exit
	ACCELERATE_STATEFUL_LAUNCH=exec $(PY) tests/soak.py --kind scenarios --per-launch 1 --launches $${SOAK_SCENARIO_LAUNCHES:-300} \
		--out soak_out/scenarios
	ACCELERATE_STATEFUL_LAUNCH=exec $(PY) tests/grid.py --out soak_out/grid
	$(PY) tests/sources_fuzz.py --cases $${SOAK_FUZZ_CASES:-300}

# The tables print; the results also go to bench_out/*.json, drawn into docs/figures/*.png (commit those).
bench: install
	mkdir -p bench_out
	$(PY) benchmarks/bench_loader.py --json bench_out/loader.json
	$(PY) benchmarks/bench_stream.py --json bench_out/stream.json
	$(PY) benchmarks/bench_capture.py --json bench_out/capture.json
	$(PY) benchmarks/bench_data_state.py --json bench_out/data_state.json
	$(PY) benchmarks/bench_trainer.py
	$(PY) benchmarks/bench_lm.py --json bench_out/lm.json
	$(PY) benchmarks/bench_worker_release.py
	$(PY) benchmarks/bench_preemption.py
	$(PY) benchmarks/plot.py bench_out docs/figures

# The resume-correctness table (benchmarks/conformance; not `nox -s conformance`, Accelerate's own tests): every
# loader killed and resumed the same ways, about 2.5 minutes on 2 cores. It rewrites the table in docs/benchmarks.md,
# docs/figures/conformance.png and benchmarks/conformance/expected.json, which the suite holds each release to.
conformance: install
	mkdir -p bench_out
	$(PY) benchmarks/conformance/run.py --json bench_out/conformance.json --markdown bench_out/conformance.md --expected
	$(PY) benchmarks/conformance/report.py bench_out/conformance.json docs/benchmarks.md docs/figures/conformance.png

# The site, into site/; strict: a broken link or reference, or a page missing from mkdocs.yml's nav, fails.
docs: $(DOCS)
	$(PY) tools/architecture.py docs/figures/architecture.png
	$(PY) tools/lifecycle_figure.py docs/figures/lifecycle.png
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The built site in headless Chromium: every page, figure and console; screenshots into site-check/.
docs-check: docs
	$(PY) tools/check_site.py site --screenshots site-check

clean:
	rm -rf $(VENV) demo_runs bench_out site site-check soak_out .pytest_cache dist build
