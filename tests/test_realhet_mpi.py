"""benchmarks/realhet.py end to end, tiny: 2 real ranks of the example script, pinned
from outside and re-pinned after the first epoch, every mode; the JSON and table
exist and the harness left no process or cgroup behind. No timing assertions."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from mpirun import ROOT, kill_session, mpi_env, run_bounded

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import realhet  # noqa: E402

pytestmark = pytest.mark.mpi

HARNESS = os.path.join(ROOT, "benchmarks", "realhet.py")


def _alive(pid, words=("mpirun", "train_fashion_mnist", "no_such_script")):
    """Whether ``pid`` is still one of the run's processes (not a recycled pid)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            cmdline = f.read().decode("utf-8", "replace")
    except OSError:
        return False
    return any(w in cmdline for w in words)


def _leftovers(runs):
    """Processes and cgroups of these runs that still exist."""
    pids = [p for r in runs for p in r["pids"] + [r["mpirun_pid"]]]
    return ([p for p in pids if _alive(p)],
            [g for r in runs for g in r["groups"] if os.path.exists(g)])


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
        assert all(d.startswith("omnihvd: step ") for d in r["decisions"])
        assert [c["phase"] for c in r["changes"]] == [0, 1] and r["changes"][1]["after_epoch"] == 0
        # per rank, its threads' CPU (main thread first), read at most as late as the total
        threads = r["rank_thread_cpu_s"]
        assert len(threads) == 2 and all(t and t[0] > 0 for t in threads), threads
        assert all(sum(t) <= cpu + 0.05 for t, cpu in zip(threads, r["rank_cpu_s"])), r
        assert r["reniced_threads"] == [0, 0], r   # no --thread-nice: threads left alone
        assert r["aslr_off"] == [False, False], r  # no --no-aslr: randomisation as usual
        # the hypervisor's steal over the run, and between epoch lines (within the run's)
        steals = [e["steal_s"] for e in r["epochs"]]
        assert len(steals) == 3 and 0 <= min(steals) and sum(steals) <= r["steal_s"] + 0.02, r
    assert runs[0]["decisions"] == []   # plain Horovod: no omnihvd log
    # the callback's own cost per step, from the epoch line (plain has no callback)
    assert {e["overhead_ms"] for e in runs[0]["epochs"]} == {0.0}
    assert all(e["overhead_ms"] > 0 for e in runs[1]["epochs"]), runs[1]["epochs"]
    assert s["plain_s"] > 0 and s["omnihvd_s"] > 0
    table = open(str(out) + ".md").read()
    assert "| swap | `pin=0,1 \\| pin=1,0` |" in table
    assert _leftovers(runs) == ([], [])


def test_realhet_quota_run_cleans_up_its_groups(tmp_path):
    try:
        realhet.find_cpu_controller()
    except realhet.CpuLimitError as exc:
        pytest.skip(str(exc))
    if os.geteuid() != 0:
        pytest.skip("cgroups need root")
    out = tmp_path / "quota"
    cmd = [sys.executable, HARNESS, "--scenarios", "q=quota=0.9,0.4 | quota=0.4,0.9",
           "--repeats", "1", "--steps", "4", "--batch-per-rank", "8", "--modes", "omnihvd,seeded",
           "--lambdas", "1", "--thread-nice", "19", "--no-aslr", "--out", str(out)]
    env = mpi_env()
    env["PYTHONPATH"] = ROOT
    proc = run_bounded(cmd, 400, env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    (s,) = json.load(open(str(out) + ".json"))["scenarios"]
    run, *seeded = s["runs"]
    assert run["mode"] == "omnihvd" and run["error"] is None and len(run["groups"]) == 2, run
    # Horovod's background thread at least, in each rank, and the setting in the table
    assert s["thread_nice"] == 19 and min(run["reniced_threads"]) >= 1, run
    table = open(str(out) + ".md").read()
    assert "threads but the main one at nice 19" in table
    # --no-aslr: every rank of every run ran without address-space randomisation
    assert s["no_aslr"] and all(r["aslr_off"] == [True, True] for r in s["runs"]), s["runs"]
    assert "address-space randomisation off" in table
    # seeded: omnihvd started from each candidate (the last phase's proportional split,
    # then the first's); 12 steps end before its first adjustment, so the sizes stay
    assert [(r["mode"], r["split"]) for r in seeded] == [("seeded", [5, 11]), ("seeded", [11, 5])]
    assert all(r["error"] is None and r["final_sizes"] == r["split"] for r in seeded), seeded
    assert [v["split"] for v in s["seeded"]] == [[5, 11], [11, 5]]
    assert "mode `seeded`" in table
    assert _leftovers(s["runs"]) == ([], [])


@pytest.mark.parametrize("first,second", [(signal.SIGHUP, None), (signal.SIGINT, signal.SIGINT),
                                          (signal.SIGTERM, signal.SIGTERM)])
def test_realhet_signalled_removes_its_groups_and_ranks(tmp_path, first, second):
    # A closed terminal (SIGHUP) killed the harness at once and left mpirun, the ranks
    # and the groups; a second signal 20-30 ms after the first cut the clean-up short
    # (5 of 5 tries left every group), while it said they were removed.
    try:
        cpu = realhet.find_cpu_controller().mount   # where the harness makes its groups
    except realhet.CpuLimitError as exc:
        pytest.skip(str(exc))
    if os.geteuid() != 0:
        pytest.skip("cgroups need root")
    cmd = [sys.executable, HARNESS, "--scenarios", "q=quota=0.9,0.4", "--repeats", "1",
           "--steps", "400", "--batch-per-rank", "8", "--modes", "plain", "--retries", "0",
           "--out", str(tmp_path / "sig")]
    env = mpi_env()
    env["PYTHONPATH"] = ROOT
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    prefix = "%s%d-" % (realhet.GROUP_PREFIX, proc.pid)
    try:
        deadline, ranks = time.monotonic() + 200, []
        while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)   # until both ranks are in their groups
            groups = [os.path.join(cpu, g) for g in os.listdir(cpu) if g.startswith(prefix)]
            ranks = [int(pid) for g in groups for pid in open(os.path.join(g, "cgroup.procs"))]
        assert len(ranks) == 2, "the ranks never entered their groups"
        proc.send_signal(first)
        if second is not None:
            time.sleep(0.02)
            proc.send_signal(second)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
            proc.wait()
    assert proc.returncode != 0 and "interrupted (signal %d)" % first in out, out[-4000:]
    assert [g for g in os.listdir(cpu) if g.startswith(prefix)] == [], out[-4000:]
    assert [p for p in ranks if _alive(p)] == [], out[-4000:]


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
    assert proc.returncode == 1, proc.stdout[-4000:]   # every run of a scenario failed
    assert "every run failed in: one" in proc.stdout, proc.stdout[-4000:]
    assert "FAILED: " in proc.stdout and "; last output: " in proc.stdout, proc.stdout[-4000:]
    (s,) = json.load(open(str(out) + ".json"))["scenarios"]
    assert s["failed_runs"] == 1 and s["plain_s"] is None
    (run,) = s["runs"]
    assert run["rc"] != 0 and ("exited" in run["error"] or "0 of 2 epoch lines" in run["error"])
    assert _leftovers([run]) == ([], [])
    # run again with --merge over a good result: the failure does not replace it
    good = dict(s, plain_s=1.25, failed_runs=0)
    with open(str(out) + ".json", "w") as f:
        json.dump({"scenarios": [good]}, f)
    proc = run_bounded(cmd + ["--merge"], 200, env)
    assert proc.returncode == 1 and "earlier one result" in proc.stdout, proc.stdout[-4000:]
    (kept,) = json.load(open(str(out) + ".json"))["scenarios"]
    assert kept["plain_s"] == 1.25
