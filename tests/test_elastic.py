"""omnihvd.elastic: the global batch is re-split when a Horovod elastic job changes size.

Single-process tests run several ElasticBatchSplit objects in threads, one per
simulated worker, with a real barrier-based allgather. The ``mpi`` tests run
``horovodrun`` in elastic mode (Gloo) on this machine: one shows why it hangs without
``--network-interface``, one runs 3 -> 2 -> 3 workers and compares the trained model
with a single-process replay of the same global batches.
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import threading

import pytest

from mpirun import ROOT, mpi_env
from omnihvd.elastic import ElasticBatchSplit, split_for_world
from omnihvd.errors import ConfigError, InfeasibleError, RankMismatchError
from mpirun import kill_session

SCRIPT = os.path.join(ROOT, "tests", "mpi_scripts", "elastic_train.py")
HOROVODRUN = [sys.executable, "-m", "horovod.runner.launch"]


# ------------------------------------------------------------------ split_for_world
def test_unknown_throughputs_split_equally():
    assert split_for_world(10, [None, None, None]) == [4, 3, 3]


def test_split_is_proportional_to_known_throughputs():
    assert split_for_world(64, [1.0, 1.0, 2.0, 4.0]) == [8, 8, 16, 32]


def test_newcomer_counts_as_median_known_worker():
    assert split_for_world(12, [30.0, 10.0, float("nan")]) == [6, 2, 4]
    assert split_for_world(12, [30.0, None, 10.0]) == [6, 4, 2]


def test_bounds_hold():
    sizes = split_for_world(20, [100.0, 1.0], min_batch_size=4, max_batch_size=15)
    assert sizes == [15, 5]


@pytest.mark.parametrize("throughputs", [[], [0.0, 1.0], [-1.0], [float("inf")], ["fast"], None])
def test_bad_throughputs_raise_config_error(throughputs):
    with pytest.raises(ConfigError, match="throughput"):
        split_for_world(8, throughputs)


def test_infeasible_bounds_raise():
    with pytest.raises(InfeasibleError):
        split_for_world(5, [1.0, 1.0, 1.0], min_batch_size=2)


# ------------------------------------------------------------- simulated workers
class World:
    """n simulated workers; ``allgather_object`` is a real collective between threads."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n)
        self.slots = [None] * n
        self.names = set()

    def gather_for(self, rank):
        def gather(obj, name):
            self.names.add(name)
            self.slots[rank] = obj
            self.barrier.wait(timeout=10)
            out = list(self.slots)
            self.barrier.wait(timeout=10)
            return out
        return gather


def begin_all(splits, world, step=None):
    """Run begin() on every worker at once; return {rank: sizes or exception}."""
    results = {}

    def run(rank, split):
        split._allgather_object = world.gather_for(rank)
        split._world = lambda: (rank, world.n)
        try:
            results[rank] = split.begin(step)
        except Exception as exc:  # checked by the caller
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r, s)) for r, s in enumerate(splits)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def measured(split, samples_per_second):
    for _ in range(5):
        split.observe(10, 10 / samples_per_second)
    return split


def test_shrink_resplits_by_measured_throughput_on_every_worker():
    splits = [ElasticBatchSplit(60) for _ in range(3)]
    assert begin_all(splits, World(3)) == {0: [20, 20, 20], 1: [20, 20, 20], 2: [20, 20, 20]}
    measured(splits[0], 300.0)
    measured(splits[1], 100.0)
    survivors = splits[:2]                  # worker 2 left
    for s in survivors:
        s.on_reset()
        assert s.stale
    result = begin_all(survivors, World(2))
    assert result == {0: [45, 15], 1: [45, 15]}
    assert [s.batch_size for s in survivors] == [45, 15]
    assert [s.offset for s in survivors] == [0, 45]
    assert survivors[1].history[-1]["throughputs"] == pytest.approx([300.0, 100.0])


def test_joining_worker_gets_the_median_share():
    old = [measured(ElasticBatchSplit(60), 300.0), measured(ElasticBatchSplit(60), 100.0)]
    for s in old:
        s.on_reset()
    result = begin_all(old + [ElasticBatchSplit(60)], World(3))
    assert set(map(tuple, result.values())) == {(30, 10, 20)}


def test_same_world_without_reset_keeps_split():
    splits = [ElasticBatchSplit(9) for _ in range(3)]
    begin_all(splits, World(3))
    measured(splits[0], 1000.0)                  # new measurements alone change nothing
    assert begin_all(splits, World(3)) == {0: [3, 3, 3], 1: [3, 3, 3], 2: [3, 3, 3]}


def test_disagreeing_global_batch_fails_on_every_worker():
    result = begin_all([ElasticBatchSplit(60), ElasticBatchSplit(64)], World(2))
    for r in (0, 1):
        assert isinstance(result[r], RankMismatchError)
        assert "rank 1 has (64, 1, None)" in str(result[r])


class Target:
    def __init__(self, throughput):
        self.throughput = throughput
        self.calls = []

    def local_throughput(self):
        return self.throughput

    def reset_world(self, rank, size, batch_sizes, step=None):
        self.calls.append((rank, size, batch_sizes, step))


def test_target_is_told_new_world_and_supplies_throughput():
    targets = [Target(200.0), Target(None), Target(float("nan"))]
    splits = [ElasticBatchSplit(12, target=t) for t in targets]
    begin_all(splits, World(3), step=7)
    assert [t.calls for t in targets] == [[(r, 3, [4, 4, 4], 7)] for r in range(3)]
    assert splits[0].local_throughput() == 200.0 and splits[2].local_throughput() is None


def test_observe_ignores_garbage_and_batch_size_needs_begin():
    s = ElasticBatchSplit(8)
    for b, t in [(4, float("nan")), (4, -1.0), (0, 1.0), ("x", 1.0), (4, float("inf"))]:
        s.observe(b, t)
    assert s.local_throughput() is None
    s.observe(4, 0.5)
    assert s.local_throughput() == 8.0
    with pytest.raises(RuntimeError, match="begin"):
        s.batch_size


@pytest.mark.parametrize("kwargs, word", [
    (dict(global_batch_size=0), "global_batch_size"),
    (dict(global_batch_size=8, min_batch_size=-1), "min_batch_size"),
    (dict(global_batch_size=8, max_batch_size=[4, 4]), "max_batch_size"),
    (dict(global_batch_size=8, window=0), "window"),
    (dict(global_batch_size=8, target=object()), "reset_world"),
])
def test_bad_arguments_raise_config_error(kwargs, word):
    with pytest.raises(ConfigError, match=word):
        ElasticBatchSplit(**kwargs)


def test_one_fixed_collective_name():
    splits = [ElasticBatchSplit(4) for _ in range(2)]
    world = World(2)
    begin_all(splits, world)
    assert world.names == {"omnihvd.elastic.split"}


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


@pytest.mark.mpi
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


@pytest.mark.mpi
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


@pytest.mark.mpi
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
