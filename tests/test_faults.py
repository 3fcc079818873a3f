"""omnihvd.faults: a rank that raises or dies ends the whole job, promptly, naming the rank.

Single-process tests check the hook; the ``mpi`` tests run
``tests/mpi_scripts/fault_train.py`` (a plain Horovod training loop) on 3 ranks under
a real ``mpirun`` and inject a failure into one rank. The bound on the time to exit is
the run's timeout: a job that is still running then is a hang, and the test fails.
"""
import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from mpirun import ROOT, kill_session, mpi_env
from omnihvd import faults
from omnihvd.errors import ConfigError

SCRIPT = os.path.join(ROOT, "tests", "mpi_scripts", "fault_train.py")
# Measured exits are 0.5-2 s after the failure (README, "Reliability"); the bounds are
# generous because the machine running the tests may be heavily loaded.
EXIT_BOUND_S = 60
STARTUP_S = 300


def record_abort(calls):
    def abort(code):
        calls.append(code)
    return abort


@pytest.fixture
def restore_excepthook():
    saved = sys.excepthook
    yield
    sys.excepthook = saved


def raise_and_report(exc):
    try:
        raise exc
    except type(exc):
        sys.excepthook(*sys.exc_info())


def test_hook_prints_traceback_then_names_rank_then_aborts(restore_excepthook):
    seen, calls, out = [], [], io.StringIO()
    sys.excepthook = lambda *info: seen.append(info[0])
    handle = faults.install_abort_on_exception(2, exit_code=7, abort=record_abort(calls),
                                               stream=out)
    assert handle.installed
    raise_and_report(RuntimeError("disk full"))
    assert seen == [RuntimeError]
    assert out.getvalue() == "omnihvd: rank 2 raised RuntimeError: disk full; aborting the job\n"
    assert calls == [7]


def test_abort_happens_even_if_previous_hook_fails(restore_excepthook):
    calls = []

    def broken_hook(*info):
        raise OSError("stderr closed")

    sys.excepthook = broken_hook
    faults.install_abort_on_exception(0, abort=record_abort(calls), stream=io.StringIO())
    with pytest.raises(OSError):
        raise_and_report(ValueError("x"))
    assert calls == [1]


def test_remove_restores_previous_hook_and_is_idempotent(restore_excepthook):
    previous = sys.excepthook
    calls = []
    with faults.install_abort_on_exception(0, abort=record_abort(calls)) as handle:
        assert sys.excepthook is not previous
    assert sys.excepthook is previous and not handle.installed
    handle.remove()
    assert sys.excepthook is previous


def test_removed_hook_under_a_newer_hook_only_forwards(restore_excepthook):
    seen, calls = [], []
    sys.excepthook = lambda *info: seen.append(info[0])
    handle = faults.install_abort_on_exception(0, abort=record_abort(calls))
    outer = sys.excepthook
    sys.excepthook = lambda *info: outer(*info)    # someone wraps ours
    handle.remove()
    raise_and_report(KeyError("k"))
    assert seen == [KeyError] and calls == []


def test_message_is_one_line():
    msg = faults.abort_message(3, ValueError, ValueError("a\nb"))
    assert "\n" not in msg and msg.startswith("omnihvd: rank 3 raised ValueError: a")


@pytest.mark.parametrize("kwargs, word", [
    (dict(rank=-1), "rank"), (dict(rank=1.0), "rank"), (dict(rank=True), "rank"),
    (dict(rank=0, exit_code=0), "exit_code"), (dict(rank=0, exit_code=256), "exit_code"),
    (dict(rank=0, abort="exit"), "abort"),
])
def test_bad_arguments_raise_config_error(kwargs, word, restore_excepthook):
    before = sys.excepthook
    with pytest.raises(ConfigError, match=word):
        faults.install_abort_on_exception(**kwargs)
    assert sys.excepthook is before


def test_abort_job_rejects_zero_exit_code():
    with pytest.raises(ConfigError, match="exit_code"):
        faults.abort_job(0)


def test_single_process_exits_despite_non_daemon_thread():
    # Without MPI, abort_job is os._exit: a thread that never ends cannot keep the
    # process alive after an uncaught exception (plain Python would wait forever).
    code = ("import threading, omnihvd.faults as f\n"
            "threading.Thread(target=threading.Event().wait).start()\n"
            "f.install_abort_on_exception(0, exit_code=3)\n"
            "raise RuntimeError('boom')\n")
    proc = subprocess.run([sys.executable, "-c", code], env=mpi_env(), timeout=60,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 3, proc.stdout
    assert "omnihvd: rank 0 raised RuntimeError: boom; aborting the job" in proc.stdout


def run_job(*args, np=3, env=None):
    """Run fault_train.py under mpirun; return (exit code, output, seconds from failure to exit).

    The job must end within EXIT_BOUND_S of the failing rank's "failing" line (and
    start within STARTUP_S); otherwise every process of its session (mpirun and its
    ranks, which OpenMPI puts in process groups of their own) is killed and the test
    fails, so a hang leaves nothing behind.
    """
    cmd = ["mpirun", "-np", str(np), "--oversubscribe", "--bind-to", "none",
           sys.executable, SCRIPT] + [str(a) for a in args]
    proc = subprocess.Popen(cmd, env=mpi_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, failed_at = [], []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "failing (" in line and not failed_at:
                failed_at.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + STARTUP_S
    while proc.poll() is None:
        if failed_at:
            deadline = min(deadline, failed_at[0] + EXIT_BOUND_S)
        if time.monotonic() > deadline:
            kill_session(proc.pid)
            proc.wait()
            reader.join(10)
            pytest.fail("job %s still running %s (hang):\n%s"
                        % (args, "%d s after the failure" % EXIT_BOUND_S if failed_at
                           else "after %d s, before any failure" % STARTUP_S,
                           "".join(lines)[-4000:]))
        time.sleep(0.2)
    ended = time.monotonic()
    reader.join(10)
    out = "".join(lines)
    assert failed_at, "the job ended before the failure was injected:\n" + out[-4000:]
    return proc.returncode, out, ended - failed_at[0]


@pytest.mark.mpi
def test_raising_rank_aborts_job_even_with_non_daemon_threads():
    # Without the hook this job never ends: every rank runs a non-daemon thread, so
    # rank 1 stays alive after its traceback and ranks 0 and 2 wait in the allreduce.
    rc, out, _ = run_job("raise", 1, 5, "--worker-thread", "all", "--abort-on-exception")
    assert rc != 0, out
    assert "omnihvd: rank 1 raised RuntimeError: injected failure on rank 1" in out, out
    # mpirun's own banner names the rank too, but OpenMPI 4.1 sometimes fails to
    # print it ("ORTE_ERROR_LOG: Data unpack would read past end of buffer").
    assert "MPI_ABORT was invoked on rank 1" in out or "ORTE_ERROR_LOG" in out, out


@pytest.mark.mpi
def test_raise_while_others_wait_in_mpi4py_collective_names_the_rank():
    # Plain exit here makes the other ranks crash inside MPI and mpirun then blames
    # one of them; the hook reports the rank that raised.
    rc, out, _ = run_job("raise", 2, 5, "--mpi4py", "--where", "mpi4py",
                         "--abort-on-exception")
    assert rc != 0, out
    assert "omnihvd: rank 2 raised RuntimeError" in out, out
    # mpirun's own banner names the rank too, but OpenMPI 4.1 sometimes fails to
    # print it ("ORTE_ERROR_LOG: Data unpack would read past end of buffer").
    assert "MPI_ABORT was invoked on rank 2" in out or "ORTE_ERROR_LOG" in out, out


@pytest.mark.mpi
def test_killed_rank_ends_job_and_is_named():
    rc, out, _ = run_job("kill", 1, 5, "--worker-thread", "all", "--abort-on-exception")
    assert rc != 0, out
    assert "process rank 1" in out and "signal 9" in out, out


@pytest.mark.mpi
def test_stuck_rank_ends_job_with_horovod_stall_shutdown():
    # The setting README "Reliability" recommends for a rank that is alive but stuck.
    # Not much shorter: on a loaded machine ranks can drift apart by seconds at
    # start-up, and a shutdown there would come before the injected hang.
    env = dict(HOROVOD_STALL_CHECK_TIME_SECONDS="5", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="10")
    rc, out, _ = run_job("hang", 1, 5, "--abort-on-exception", env=env)
    assert rc != 0, out
    assert "1!: [allreduce." in out, out    # the stall report marks rank 1
