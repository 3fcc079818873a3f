# The two commands of README.rst. Both run the idempotent set-up first.
# (.venv's python; before the set-up, test-unit runs on python3.)
PY = $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
.PHONY: setup setup-slurm demo test test-unit test-fast clean

setup:
	bash tools/setup.sh

# Slurm daemons and clients for tests/test_slurm.py (apt-get when missing).
setup-slurm:
	python3 tools/slurm_local.py install

# README command 1: set-up, then the main job.
demo: setup
	bash benchmarks/run_demo.sh

# README command 2: set-up, then the whole test suite (.ci/run calls this).
test: setup setup-slurm
	$(PY) -m pytest -q tests

# The test tiers (tests/conftest.py): unit needs only numpy, pytest and hypothesis, so
# it runs with any such Python (PY=python3 make test-unit); test-fast adds the
# single-process tests on the installed stack; make test runs every tier.
test-unit:
	$(PY) -m pytest -q tests -m unit

test-fast: setup
	$(PY) -m pytest -q tests -m "unit or single"

clean:
	rm -rf .venv build *.egg-info
