"""benchmarks/cpu_steadiness.py: the machine's own CPU speed over time."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import cpu_steadiness  # noqa: E402

pytestmark = pytest.mark.unit


def test_a_short_probe_writes_every_cpu_alone_and_together(tmp_path):
    out = str(tmp_path / "steady")
    assert cpu_steadiness.main(["--rounds", "2", "--seconds", "0.05", "--window", "0.01",
                                "--pause", "0", "--out", out]) == 0
    doc = json.load(open(out + ".json"))
    cpus = sorted(os.sched_getaffinity(0))
    assert doc["cpus"] == cpus and len(doc["rounds"]) == 2
    for row in doc["rounds"]:
        assert row["steal_s"] >= 0 and row["foreign_cpu_s"] >= 0
        for column in ("alone", "together"):
            assert sorted(map(int, row[column])) == cpus
            assert all(rate > 0 for rate in row[column].values())
    table = open(out + ".md").read()
    assert table.count("| **spread** |") == 1 and "alone on CPU %d" % cpus[0] in table
    assert "--rounds 2" in doc["command"]
    assert sorted(os.sched_getaffinity(0)) == cpus   # the workers pinned themselves, not us


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        cpu_steadiness.main(["--rounds", "0"])


def test_docstring_examples():
    import doctest
    cpus = os.sched_getaffinity(0)
    result = doctest.testmod(cpu_steadiness)
    assert result.attempted > 0 and result.failed == 0
    assert os.sched_getaffinity(0) == cpus
