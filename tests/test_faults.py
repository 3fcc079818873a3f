"""omnihvd.faults: a rank that raises or dies ends the whole job, promptly, naming the rank.

Single-process tests of the hook and the abort message, with a fake abort; the real
jobs under ``mpirun`` are in ``test_faults_mpi.py``.
"""
import io
import subprocess
import sys

import pytest

from mpirun import mpi_env
from omnihvd import faults
from omnihvd.errors import ConfigError

pytestmark = pytest.mark.unit


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


# ---------------------------------------------------------------- fail_job


class Aborted(BaseException):
    """Stands for the end of the process (a real Abort never returns)."""


class FakeComm:
    def __init__(self):
        self.aborted = []

    def Abort(self, code):
        self.aborted.append(code)
        raise Aborted(code)


def test_fail_job_prints_traceback_then_one_line_naming_rank_and_role():
    out, calls = io.StringIO(), []
    try:
        raise KeyError("w")
    except KeyError as exc:
        faults.fail_job(3, exc, role="worker 1", exit_code=5, abort=record_abort(calls),
                        stream=out)
    text = out.getvalue()
    assert text.startswith("Traceback (most recent call last):") and "raise KeyError" in text
    assert text.endswith("\nomnihvd: rank 3 (worker 1) raised KeyError: 'w'; aborting the job\n")
    assert calls == [5]


def test_fail_job_aborts_the_given_communicator_even_if_reporting_fails():
    class Closed(io.StringIO):
        def write(self, text):
            raise OSError("stderr closed")

    comm = FakeComm()
    with pytest.raises(Aborted):
        faults.fail_job(0, RuntimeError("x"), comm=comm, exit_code=9, stream=Closed())
    assert comm.aborted == [9]


def test_fail_job_refuses_a_bad_exit_code_before_ending_anything():
    comm, out = FakeComm(), io.StringIO()
    with pytest.raises(ConfigError, match="exit_code"):
        faults.fail_job(0, RuntimeError("x"), comm=comm, exit_code=0, stream=out)
    assert comm.aborted == [] and out.getvalue() == ""
