"""Timing under a real mpirun: data loading is this rank's work."""
import json
import os

import pytest

from mpirun import mpirun

pytestmark = pytest.mark.mpi

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_scripts")
SCRIPT = os.path.join(HERE, "data_loading.py")
B, N, RANKS = 48, 48 * 20, 3


def _run(mode, epochs):
    out = mpirun(RANKS, SCRIPT, mode, epochs, timeout=300).stdout
    line = [l for l in out.splitlines() if l.startswith("DATA ")]
    assert line, out[-3000:]
    return json.loads(line[0][len("DATA "):])


def _check_coverage(result, epochs):
    for epoch in range(epochs):
        union = sorted(i for rank in result["seen"] for i in rank[epoch])
        assert union == list(range(N)), "epoch %d: a sample was repeated or skipped" % epoch


def test_a_rank_with_a_slower_dataset_ends_with_fewer_samples():
    r = _run("wrap", 2)
    sizes = r["final_sizes"]
    assert sum(sizes) == B and r["changes"] >= 1, r
    # rank 1 reads 2 ms per sample, the others 0.3 ms: its share falls well
    # below the equal 16 and below every other rank's
    assert sizes[1] <= 0.6 * B / RANKS and sizes[1] < min(sizes[0], sizes[2]), sizes
    _check_coverage(r, 2)


def test_the_plain_contract_loop_keeps_working():
    r = _run("plain", 1)
    assert sum(r["final_sizes"]) == B
    _check_coverage(r, 1)
