# The two commands of README.rst. Both run the idempotent set-up first.
PY := .venv/bin/python
.PHONY: setup demo test test-fast clean

setup:
	bash tools/setup.sh

# README command 1: set-up, then the main job.
demo: setup
	bash benchmarks/run_demo.sh

# README command 2: set-up, then the whole test suite (.ci/run calls this).
test: setup
	$(PY) -m pytest -q tests

test-fast: setup
	$(PY) -m pytest -q tests -m "not mpi"

clean:
	rm -rf .venv build *.egg-info
