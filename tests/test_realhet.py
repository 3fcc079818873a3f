"""benchmarks/realhet.py end to end, tiny: 2 real ranks of the example script, pinned
from outside and re-pinned after the first epoch, every mode; the JSON and table
exist and the harness left no process or cgroup behind. No timing assertions."""
import json
import os
import sys

import pytest
from mpirun import ROOT, mpi_env, run_bounded

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import realhet  # noqa: E402

HARNESS = os.path.join(ROOT, "benchmarks", "realhet.py")


def test_shares_and_candidate_splits():
    cpus = [0, 1]
    two_to_one = realhet.parse_spec("pin=0,1,1", cpus)
    assert realhet.shares(two_to_one[0], cpus) == [1.0, 0.5, 0.5]
    quota = realhet.parse_spec("quota=1,0.6,0.3", cpus)[0]
    assert realhet.shares(quota, cpus) == pytest.approx([1.0, 0.6, 0.3])
    crowded = realhet.parse_spec("quota=1,1,1", cpus)[0]   # 3 busy ranks on 2 CPUs
    assert realhet.shares(crowded, cpus) == pytest.approx([2 / 3] * 3)
    hl8 = realhet.parse_spec("quota=HL8", cpus)[0]
    assert hl8.quota == pytest.approx([6 / 32, 6 / 32, 4 / 32, 1.0])
    splits = realhet.candidate_splits(two_to_one, 192, [0.8, 1.0, 1.2], cpus)
    assert [96, 48, 48] in splits and all(sum(s) == 192 for s in splits) and len(splits) == 3
    dynamic = realhet.parse_spec("pin=0,1,1 | pin=1,0,1", cpus)
    assert realhet.candidate_splits(dynamic, 192, [1.0], cpus) == [[48, 96, 48], [96, 48, 48]]
    with pytest.raises(SystemExit, match="same number of ranks"):
        realhet.parse_spec("pin=0,1 | pin=0,1,1", cpus)
    with pytest.raises(SystemExit, match="cannot read"):
        realhet.parse_spec("pinned=0,1", cpus)


def _leftovers(runs):
    """Processes and cgroups of these runs that still exist."""
    pids = [p for r in runs for p in r["pids"] + [r["mpirun_pid"]]]
    return ([p for p in pids if os.path.exists("/proc/%d" % p)],
            [g for r in runs for g in r["groups"] if os.path.exists(g)])


@pytest.mark.mpi
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_realhet_smoke(tmp_path):
    out = tmp_path / "realhet"
    cmd = [sys.executable, HARNESS, "--scenarios", "swap=pin=0,1 | pin=1,0", "--repeats", "1",
           "--steps", "4", "--batch-per-rank", "8", "--lambdas", "1.5", "--out", str(out)]
    env = mpi_env()
    env["PYTHONPATH"] = ROOT
    proc = run_bounded(cmd, 400, env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    doc = json.load(open(str(out) + ".json"))
    (s,) = doc["scenarios"]
    assert s["scenario"] == "swap" and s["ranks"] == 2 and s["shares"] == [[1.0, 1.0], [1.0, 1.0]]
    assert doc["code_tree"] == ROOT and "realhet.py" in doc["command"]
    runs = s["runs"]
    assert [r["mode"] for r in runs] == ["plain", "omnihvd"]   # equal shares: no fixed split
    for r in runs:
        assert r["error"] is None, r
        assert [e["epoch"] for e in r["epochs"]] == [0, 1, 2]
        assert sum(r["final_sizes"]) == 16 and r["measured_s"] > 0
        assert [c["phase"] for c in r["changes"]] == [0, 1] and r["changes"][1]["after_epoch"] == 0
    assert s["plain_s"] > 0 and s["omnihvd_s"] > 0
    table = open(str(out) + ".md").read()
    assert "| swap | `pin=0,1 \\| pin=1,0` |" in table
    assert _leftovers(runs) == ([], [])


@pytest.mark.mpi
def test_realhet_quota_run_cleans_up_its_groups(tmp_path):
    try:
        realhet.cpulimits.find_cpu_controller()
    except realhet.cpulimits.CpuLimitError as exc:
        pytest.skip(str(exc))
    if os.geteuid() != 0:
        pytest.skip("cgroups need root")
    out = tmp_path / "quota"
    cmd = [sys.executable, HARNESS, "--scenarios", "q=quota=0.9,0.4 | quota=0.4,0.9",
           "--repeats", "1", "--steps", "4", "--batch-per-rank", "8", "--modes", "omnihvd",
           "--out", str(out)]
    env = mpi_env()
    env["PYTHONPATH"] = ROOT
    proc = run_bounded(cmd, 400, env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    (s,) = json.load(open(str(out) + ".json"))["scenarios"]
    (run,) = s["runs"]
    assert run["error"] is None and len(run["groups"]) == 2, run
    assert _leftovers([run]) == ([], [])


@pytest.mark.mpi
def test_realhet_reports_a_failed_run_and_cleans_up(tmp_path):
    # A script that does not exist: mpirun fails at once; the harness records the failed
    # run instead of waiting for ranks that never come.
    out = tmp_path / "bad"
    cmd = [sys.executable, HARNESS, "--scenarios", "one=pin=0,0", "--repeats", "1", "--steps",
           "2", "--batch-per-rank", "8", "--modes", "plain", "--script",
           os.path.join(ROOT, "tests", "no_such_script.py"), "--out", str(out)]
    env = mpi_env()
    env["PYTHONPATH"] = ROOT
    proc = run_bounded(cmd, 200, env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    (s,) = json.load(open(str(out) + ".json"))["scenarios"]
    assert s["failed_runs"] == 1 and s["plain_s"] is None
    assert "exited" in s["runs"][0]["error"]
    assert _leftovers(s["runs"]) == ([], [])
