"""The OmniLearnCallback under a real elastic ``horovodrun`` (Gloo) on this machine.

One test shows why it hangs without ``--network-interface``, one runs 3 -> 2 -> 3
workers and one SIGKILLs a worker; both train through the normal drop-in
(tests/mpi_scripts/elastic_train.py) and check that every step used B distinct
samples of the epoch's order, each sample once per epoch across the changes, and
that the model equals a one-process replay of the same global batches.
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


def run_elastic(hosts_lines, script_args, extra=()):
    with tempfile.TemporaryDirectory() as tmp:
        hosts = os.path.join(tmp, "hosts")
        with open(hosts, "w") as f:
            f.write(hosts_lines)
        rc, out = horovodrun(["-np", "3", "--min-np", "2", "--max-np", "3",
                              "--network-interface", "lo", "--elastic-timeout", "120", *extra,
                              "--host-discovery-script", "cat " + hosts,
                              sys.executable, SCRIPT, hosts, *script_args], timeout=400)
    assert rc == 0, out[-5000:]
    lines = [l for l in out.splitlines() if "RESULT " in l]
    assert lines, out[-5000:]
    return json.loads(lines[-1].split("RESULT ", 1)[1]), out


def check_exact_and_each_sample_once(result, B):
    """Every step: B distinct samples, the replay's; every epoch: each sample once."""
    used = result["used"]                    # (step, sizes, ids of the global batch)
    assert [u[0] for u in used] == list(range(result["steps"])), [u[0] for u in used]
    for step, sizes, ids in used:
        assert sum(sizes) == B and len(ids) == B and len(set(ids)) == B, (step, sizes)
    per_epoch = result["steps_per_epoch"]
    for first in range(0, len(used), per_epoch):
        ids = [i for _, _, step_ids in used[first:first + per_epoch] for i in step_ids]
        assert len(ids) == len(set(ids)), "a sample repeated within the epoch from step %d" % first
        if first + per_epoch <= len(used):    # a whole epoch: every sample, once
            assert sorted(ids) == list(range(result["num_samples"])), first
    assert result["same_batches"], "the global batches differ from the one-process replay"
    # The averaged gradient was that of the whole global batch on every step, across
    # the changes: the model equals a one-process replay of the same global batches.
    assert math.isfinite(result["max_param_diff"])
    assert result["max_param_diff"] < 1e-5, result["max_param_diff"]


def test_elastic_shrink_and_grow_keeps_global_batch_semantics():
    B = 48
    result, out = run_elastic("localhost:3\n", ["--global-batch", str(B), "--shrink-at", "20",
                                                  "--grow-after", "20", "--min-steps", "60"])
    worlds = result["worlds"]                    # rank 0's record of every (re)entry
    assert [w["size"] for w in worlds] == [3, 2, 3], worlds
    assert [w["step"] for w in worlds] == sorted(w["step"] for w in worlds)
    assert worlds[0]["step"] == 0 and worlds[0]["batch_sizes"] == [16, 16, 16], worlds
    assert all(sum(w["batch_sizes"]) == B for w in worlds), worlds
    # Survivors keep their own measured speed; the newcomer counts as the median.
    assert None not in worlds[1]["throughputs"], worlds[1]
    assert worlds[2]["throughputs"][2] is None and None not in worlds[2]["throughputs"][:2]
    # Worker localhost[0] sleeps a quarter as long per sample as localhost[2]: the
    # callback moved samples towards it, before and after the changes.
    assert result["adjustments"] >= 1, result["adjustments"]
    by_step = {step: sizes for step, sizes, _ in result["used"]}
    last = by_step[result["steps"] - 1]
    assert len(last) == 3 and last[0] > last[2], last
    # ... and kept balancing in the new world: the newcomer, 4x slower than worker 0,
    # started at the median share and was given fewer samples from its timings.
    assert last[2] < worlds[2]["batch_sizes"][2], (last, worlds[2])
    # The sizes of every step were those of the world it ran in.
    for w, nxt in zip(worlds, worlds[1:] + [None]):
        end = nxt["step"] if nxt else result["steps"]
        assert all(len(by_step[s]) == w["size"] for s in range(w["step"], end)), w
    check_exact_and_each_sample_once(result, B)


def test_elastic_worker_killed_job_continues_on_the_rest_with_resplit_batch():
    # Horovod blacklists the host of a failed worker, so the worker to kill gets a host
    # name of its own: 127.0.0.1 and localhost are two "hosts" of this one machine.
    B = 48
    result, out = run_elastic("localhost:2\n127.0.0.1:1\n",
                              ["--global-batch", str(B), "--kill-at", "15",
                               "--kill-host", "127.0.0.1", "--min-steps", "60"],
                              extra=("--gloo-timeout-seconds", "10"))
    assert "on 127.0.0.1: killing itself at step 15" in out, out[-5000:]
    worlds = result["worlds"]
    assert [w["size"] for w in worlds] == [3, 2], worlds
    assert worlds[1]["step"] <= 15, worlds      # rolled back to the last commit
    assert None not in worlds[1]["throughputs"], worlds
    check_exact_and_each_sample_once(result, B)
