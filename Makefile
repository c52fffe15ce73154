# mpidtensor: development environment, tests, demo and benchmark.
#
#   make test            create .venv if needed, run pytest at 1, 2, 3 and 4 ranks
#   make demo            examples/train_fsdp_tp.py (FSDP x TP training), then the
#                        redistribution tour examples/demo.py, at 4 ranks
#   make bench           benchmarks/bench_record.py at 4 ranks (table, JSON, plot)
#   make venv MPI=system build mpi4py against the site MPI (the mpicc/mpiexec on
#                        PATH, e.g. after `module load`) instead of the mpich wheel;
#                        `make clean` first to switch an existing .venv back
#   make clean           remove .venv and build/cache files

PYTHON ?= python3
VENV   ?= .venv
MPI    ?= mpich
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(MPI)

ifeq ($(MPI),system)
  MPIEXEC ?= mpiexec
  EXTRAS  := test
else
  MPIEXEC ?= $(VENV)/bin/mpiexec
  EXTRAS  := mpich,test
endif

TEST_SIZES   ?= 1 2 3 4
TEST_TIMEOUT ?= 900# seconds for one world size (whole mpiexec run)
CASE_TIMEOUT ?= 120# seconds for one test (pytest-timeout)
PYTEST_ARGS  ?=

# Ranks may outnumber cores (4 ranks on 2 cores here): one torch thread per rank,
# and MPICH's progress loop naps (usleep) after a run of empty polls, which kept
# tiny collectives fastest when other jobs share the cores (docs/mpi-settings.md).
export OMP_NUM_THREADS ?= 1
export MPIR_CVAR_CH4_PROGRESS_THROTTLE ?= 1

.PHONY: venv test demo bench clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
ifeq ($(MPI),system)
	$(PY) -m pip uninstall -q -y mpich
	$(PY) -m pip install -q --no-binary mpi4py --no-cache-dir --force-reinstall --no-deps 'mpi4py>=4'
endif
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

test: $(STAMP)
	@for n in $(TEST_SIZES); do \
	  echo "== pytest on $$n rank(s)"; \
	  timeout $(TEST_TIMEOUT) $(MPIEXEC) -n $$n $(PY) -m pytest -q --with-mpi \
	    --timeout=$(CASE_TIMEOUT) $(PYTEST_ARGS) tests </dev/null \
	    || { rc=$$?; echo "== pytest failed on $$n rank(s) (exit $$rc)"; exit $$rc; }; \
	done

demo: $(STAMP)
	$(MPIEXEC) -n 4 $(PY) examples/train_fsdp_tp.py
	$(MPIEXEC) -n 4 $(PY) examples/demo.py

# The benchmark of record (benchmarks/bench_record.py); the `bench` extra brings matplotlib for its plot.
BENCH_STAMP := $(VENV)/.installed-bench-$(MPI)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[$(EXTRAS),bench]'
	touch $@

BENCH_ARGS ?=# e.g. --quick (4K and 256K only) or --check-only (checks, no timing)

bench: $(BENCH_STAMP)
	$(MPIEXEC) -n 4 $(PY) benchmarks/bench_record.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
