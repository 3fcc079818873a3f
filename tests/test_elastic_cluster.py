"""omnihvd.elastic under a real elastic ``horovodrun`` (Gloo) on this machine.

One test shows why it hangs without ``--network-interface``, one runs 3 -> 2 -> 3
workers and compares the trained model with a single-process replay of the same
global batches, one SIGKILLs a worker.
"""
import json
import math
import os
import subprocess
import sys
import tempfile

import pytest

from mpirun import ROOT, kill_session, mpi_env

SCRIPT = os.path.join(ROOT, "tests", "mpi_scripts", "elastic_train.py")
HOROVODRUN = [sys.executable, "-m", "horovod.runner.launch"]

pytestmark = pytest.mark.cluster


# --------------------------------------------------------------- real horovodrun
def horovodrun(args, timeout):
    """Run horovodrun; on timeout kill its whole session and fail."""
    proc = subprocess.Popen(HOROVODRUN + args, env=mpi_env(), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, _ = proc.communicate()
        pytest.fail("horovodrun %s still running after %d s:\n%s" % (args, timeout, out[-5000:]))
    return proc.returncode, out


def test_single_host_elastic_without_network_interface_waits_for_two_hosts():
    # The "hang without output": horovodrun needs two hosts to detect common network
    # interfaces unless --network-interface is given; with one host it waits for
    # --elastic-timeout (600 s by default) and only then says so.
    with tempfile.TemporaryDirectory() as tmp:
        hosts = os.path.join(tmp, "hosts")
        with open(hosts, "w") as f:
            f.write("localhost:3\n")
        rc, out = horovodrun(["-np", "3", "--min-np", "2", "--max-np", "3", "--elastic-timeout",
                              "3", "--host-discovery-script", "cat " + hosts,
                              sys.executable, "-c", "pass"], timeout=120)
    assert rc != 0, out
    assert "at least two hosts are available" in out, out


def test_elastic_shrink_and_grow_keeps_global_batch_semantics():
    B = 48
    with tempfile.TemporaryDirectory() as tmp:
        hosts = os.path.join(tmp, "hosts")
        with open(hosts, "w") as f:
            f.write("localhost:3\n")
        rc, out = horovodrun(["-np", "3", "--min-np", "2", "--max-np", "3",
                              "--network-interface", "lo", "--elastic-timeout", "120",
                              "--host-discovery-script", "cat " + hosts,
                              sys.executable, SCRIPT, hosts, "--global-batch", str(B),
                              "--shrink-at", "20", "--grow-after", "20", "--min-steps", "100"],
                             timeout=400)
    assert rc == 0, out[-5000:]
    lines = [l for l in out.splitlines() if "RESULT " in l]
    assert lines, out[-5000:]
    result = json.loads(lines[-1].split("RESULT ", 1)[1])
    assert [h["size"] for h in result["history"]] == [3, 2, 3], result
    log = result["log"]                           # (first step, sizes) of each split used
    assert [len(sizes) for _, sizes in log] == [3, 2, 3], log
    assert all(sum(sizes) == B for _, sizes in log), log
    assert [first for first, _ in log] == sorted(first for first, _ in log) and log[0][0] == 0
    # Worker 1 measured its own speed before the shrink; the split used it.
    assert result["history"][1]["throughputs"][1] is not None, result
    # Every step used exactly the B samples of one global order, weighted b_i/B:
    # the model equals a one-process replay of the same global batches.
    assert result["max_param_diff"] < 1e-5, result
    assert math.isfinite(result["max_param_diff"])


def test_elastic_worker_killed_job_continues_on_the_rest_with_resplit_batch():
    # Horovod blacklists the host of a failed worker, so the worker to kill gets a host
    # name of its own: 127.0.0.1 and localhost are two "hosts" of this one machine.
    B = 48
    with tempfile.TemporaryDirectory() as tmp:
        hosts = os.path.join(tmp, "hosts")
        with open(hosts, "w") as f:
            f.write("localhost:2\n127.0.0.1:1\n")
        rc, out = horovodrun(["-np", "3", "--min-np", "2", "--max-np", "3",
                              "--network-interface", "lo", "--elastic-timeout", "120",
                              "--gloo-timeout-seconds", "10",
                              "--host-discovery-script", "cat " + hosts,
                              sys.executable, SCRIPT, hosts, "--global-batch", str(B),
                              "--kill-at", "15", "--kill-host", "127.0.0.1",
                              "--min-steps", "60"], timeout=400)
    assert rc == 0, out[-5000:]
    assert "on 127.0.0.1: killing itself at step 15" in out, out[-5000:]
    lines = [l for l in out.splitlines() if "RESULT " in l]
    assert lines, out[-5000:]
    result = json.loads(lines[-1].split("RESULT ", 1)[1])
    assert [h["size"] for h in result["history"]] == [3, 2], result
    assert [len(sizes) for _, sizes in result["log"]] == [3, 2], result
    assert all(sum(sizes) == B for _, sizes in result["log"]), result
    assert result["log"][1][0] <= 15, result      # rolled back to the last commit
    assert result["max_param_diff"] < 1e-5, result
