"""Asynchronous mode under a real mpirun: exactness, sharding, balancing, faults.

Every launch has a timeout well below what a hang would take: the fault scripts'
healthy workers train for tens of seconds, so a job that did not abort promptly
runs into it.
"""
import os

import pytest

from mpirun import mpirun

HERE = os.path.dirname(os.path.abspath(__file__))
EXACT = os.path.join(HERE, "mpi_scripts", "async_exact.py")
FAIL = os.path.join(HERE, "mpi_scripts", "async_fail.py")

pytestmark = pytest.mark.mpi


def test_one_server_three_workers_balanced_every_update_applied_once():
    out = mpirun(4, EXACT, 1, "--balance", "--speeds", "1,1,3", timeout=180).stdout
    assert "ASYNC-OK" in out and "ASYNC-BALANCED" in out, out


def test_two_servers_shard_the_parameters():
    out = mpirun(4, EXACT, 2, "--speeds", "1,2", timeout=180).stdout
    assert "ASYNC-OK updates=34 " in out, out  # workers push 12 and 22 times


def test_each_push_is_weighted_by_its_own_batch_with_a_prefetching_loader():
    # two loader processes cut batches ahead of the loop at older sizes, and epochs of
    # 50 samples end in short batches: every push must carry its own batch's size
    out = mpirun(4, EXACT, 1, "--balance", "--speeds", "1,1,3", "--loader", "2",
                 timeout=180).stdout
    assert "ASYNC-OK" in out, out


def test_a_worker_that_never_trains_still_lets_the_job_end():
    # it leaves `with cb:` without on_train_begin: the servers must not wait for it
    # (idle_timeout is 120 s, past this test's limit), and it gets the final model
    out = mpirun(4, EXACT, 2, "--speeds", "1,2", "--idle", "1", timeout=100).stdout
    assert "ASYNC-OK updates=12 " in out, out


@pytest.mark.parametrize("mode,expect", [
    # the one abort line of omnihvd.faults.fail_job, as in the synchronous mode
    ("raise", ["omnihvd: rank 2 (worker 1) raised RuntimeError: injected failure in worker 1; "
               "aborting the job"]),
    ("bad_shape", ["omnihvd: rank 0 (server 0) raised omnihvd.asynchronous.protocol."
                   "ProtocolError: server rank 0 rejected PUSH from worker rank 2: gradient "
                   "shard has 23 elements, expected 26", "; aborting the job"]),
    ("duplicate", ["server rank 0 rejected PUSH from worker rank 2: sequence number 1, expected "
                   "2: an update was a repeat"]),
    # not Exceptions: they left `with cb:` unreported and the job waited idle_timeout
    ("interrupt", ["omnihvd: rank 2 (worker 1) raised KeyboardInterrupt; aborting the job"]),
    ("exit", ["omnihvd: rank 2 (worker 1) raised SystemExit: 0; aborting the job"]),
])
def test_a_failing_or_misbehaving_worker_aborts_the_job_naming_the_rank(mode, expect):
    proc = mpirun(4, FAIL, mode, 1, timeout=120, check=False)
    assert proc.returncode != 0, proc.stdout
    for text in expect:
        assert text in proc.stdout, proc.stdout[-4000:]


def test_without_abort_a_server_that_gives_up_stops_the_waiting_workers():
    # abort_on_exception=False: worker 1 (rank 3) raises and leaves; the others finish
    # and wait in on_train_end() for the final parameters, which never come: the
    # servers' idle_timeout (3 s) must end them too, not leave them waiting for ever
    proc = mpirun(4, FAIL, "raise_noabort", 2, timeout=90, check=False)
    assert proc.returncode != 0, proc.stdout
    for text in ["RuntimeError: injected failure in worker 1",
                 "TimeoutError: server rank 0 heard nothing for 3 s; workers [3]",
                 "TimeoutError: server rank 1 heard nothing for 3 s; workers [3]",
                 "RuntimeError: worker rank 2: server rank 0 stopped on an error"]:
        assert text in proc.stdout, proc.stdout[-4000:]


@pytest.mark.parametrize("mode,expect", [
    ("options", "rank 2 has global_batch_size=40 but rank 0 has 32"),
    ("model", "rank 2 has model_layout="),
])
def test_ranks_that_disagree_on_options_or_model_all_get_the_same_error(mode, expect):
    out = mpirun(3, FAIL, mode, 1, timeout=120).stdout
    for rank in range(3):  # counted, not split by line: mpirun may interleave ranks' output
        assert "rank %d: ERROR RankMismatchError" % rank in out, out
    assert out.count(expect) == 3, out
