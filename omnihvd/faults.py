"""Make a failing rank end the whole job, promptly and with its rank named.

What plain Horovod 0.28.1 + OpenMPI 4.1.4 already does (measured on 3 ranks, see
docs/reliability.rst): when a rank is killed, ``mpirun`` notices the dead
process and ends the job in about a second; when a rank raises and its interpreter
exits, the other ranks get ``HorovodInternalError`` and the job ends in about two
seconds. It hangs forever when the raising rank cannot exit: any non-daemon thread
(a metrics uploader, a checkpoint writer) keeps the interpreter alive after the
traceback, so that rank never leaves and never joins the next allreduce, and the other
ranks wait in it for good.

:func:`install_abort_on_exception` closes that gap: an uncaught exception on a rank
prints its traceback, then ``omnihvd: rank R raised ...; aborting the job`` and calls
``MPI_Abort`` on ``COMM_WORLD``, which makes ``mpirun`` kill every rank at once. Python
calls ``sys.excepthook`` before it waits for threads or runs ``atexit`` handlers, so
nothing the user left running can delay it.

:func:`fail_job` is the one way omnihvd ends a job for an exception, in both modes:
the hook above calls it for an uncaught exception of a synchronous job, and
:class:`omnihvd.asynchronous.AsyncOmniLearnCallback` for an exception in one of its
hooks (or its ``with`` block), where the other ranks may be waiting on this one.

A rank that is stuck but alive (a deadlocked data loader, ranks disagreeing on which
tensors to reduce) is Horovod's stall inspector's job: launch with
``HOROVOD_STALL_CHECK_TIME_SECONDS`` and ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` set.
"""
import os
import sys
import traceback

from .checks import check_int
from .errors import ConfigError

__all__ = ["AbortHandle", "abort_job", "abort_message", "fail_job", "install_abort_on_exception"]


def abort_job(exit_code=1, comm=None):
    """End every rank of the job now; never returns.

    Under ``mpirun`` (MPI initialised, more than one rank) this is
    ``MPI.COMM_WORLD.Abort(exit_code)``, or ``comm.Abort(exit_code)`` when a
    communicator is given: ``mpirun`` kills all ranks and exits non-zero. Otherwise
    (one process, or a Gloo launch by ``horovodrun`` where MPI is not initialised)
    only this process exits, with ``os._exit`` so that non-daemon threads cannot keep
    it alive; Gloo peers then fail their next collective.

    Args:
        exit_code: the process exit status, 1 to 255.
        comm: an mpi4py communicator to abort (e.g. a duplicate of COMM_WORLD); None:
            COMM_WORLD when MPI is initialised.

    Raises:
        ConfigError: ``exit_code`` out of range (checked before anything is ended).
    """
    _check_exit_code(exit_code)
    if comm is not None:
        comm.Abort(exit_code)
    mpi = _initialized_mpi()
    if mpi is not None and mpi.COMM_WORLD.Get_size() > 1:
        mpi.COMM_WORLD.Abort(exit_code)
    os._exit(exit_code)


def _check_exit_code(exit_code):
    check_int("exit_code", exit_code, 1, "non-zero, so the job fails", maximum=255)


def _initialized_mpi():
    """The ``mpi4py.MPI`` module if MPI is initialised in this process, else None.

    Importing ``mpi4py.MPI`` normally initialises MPI; in a process that never used
    MPI (a Gloo launch) that would start a singleton MPI job just to exit, so the
    import is told not to.
    """
    try:
        import mpi4py
    except ImportError:
        return None
    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False
    from mpi4py import MPI
    if MPI.Is_initialized() and not MPI.Is_finalized():
        return MPI
    return None


class AbortHandle:
    """Returned by :func:`install_abort_on_exception`; ``remove()`` uninstalls the hook.

    Also a context manager: the hook is removed when the ``with`` block ends.
    """

    def __init__(self, hook, previous):
        self._hook = hook
        self._previous = previous

    @property
    def installed(self):
        """True while this handle's hook is the active ``sys.excepthook``."""
        return sys.excepthook is self._hook

    def remove(self):
        """Restore the hook that was active before; a no-op when called again.

        If another hook was installed on top of this one since, that hook stays (it
        chains to this one, which then only forwards to the previous hook).
        """
        if sys.excepthook is self._hook:
            sys.excepthook = self._previous
        self._hook.active = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False


class _AbortHook:
    """The ``sys.excepthook`` replacement: report, then end the job."""

    def __init__(self, rank, exit_code, abort, stream, previous):
        self.rank = rank
        self.exit_code = exit_code
        self.abort = abort
        self.stream = stream
        self.previous = previous
        self.active = True

    def __call__(self, exc_type, exc, tb):
        if not self.active:
            self.previous(exc_type, exc, tb)
            return
        # Whatever fails in the previous hook, the job must still end.
        try:
            self.previous(exc_type, exc, tb)  # prints the traceback
        finally:
            fail_job(self.rank, exc, exit_code=self.exit_code, abort=self.abort,
                     stream=self.stream, traceback_shown=True)


def abort_message(rank, exc_type, exc, role=None):
    """The one line printed before aborting, e.g.

    >>> abort_message(1, RuntimeError, RuntimeError("boom"))
    'omnihvd: rank 1 raised RuntimeError: boom; aborting the job'
    >>> abort_message(2, KeyError, KeyError("w"), role="worker 1")
    "omnihvd: rank 2 (worker 1) raised KeyError: 'w'; aborting the job"
    """
    text = "".join(traceback.format_exception_only(exc_type, exc)).strip().replace("\n", " ")
    who = "rank %d" % rank if role is None else "rank %d (%s)" % (rank, role)
    return "omnihvd: %s raised %s; aborting the job" % (who, text)


def fail_job(rank, exc, *, role=None, comm=None, exit_code=1, abort=None, stream=None,
             traceback_shown=False):
    """Report ``exc`` naming this rank, then end every rank of the job; never returns.

    The one abort path of omnihvd, synchronous and asynchronous: the traceback
    (unless already shown), then the line of :func:`abort_message`, then
    ``abort(exit_code)``. Whatever fails while reporting, the job still ends.

    Args:
        rank: this process's rank, named in the message.
        exc: the exception that ends the job.
        role: what the rank does, named after it (``"worker 1"``), or None.
        comm: the communicator to abort (see :func:`abort_job`).
        exit_code: the job's exit status, 1 to 255.
        abort: callable taking the exit code, default :func:`abort_job` on ``comm``;
            tests pass a fake (which may return).
        stream: where the report goes; ``sys.stderr`` at the time of the call when None.
        traceback_shown: the caller has printed the traceback already (the excepthook).

    Raises:
        ConfigError: ``exit_code`` out of range (before anything is printed or ended).
    """
    _check_exit_code(exit_code)
    try:
        out = stream if stream is not None else sys.stderr
        if not traceback_shown:
            out.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        out.write(abort_message(rank, type(exc), exc, role) + "\n")
        out.flush()
        sys.stdout.flush()
    finally:
        if abort is None:
            abort_job(exit_code, comm)
        else:
            abort(exit_code)


def install_abort_on_exception(rank, *, exit_code=1, abort=None, stream=None):
    """Make an uncaught exception on this rank end the whole job at once.

    Wraps ``sys.excepthook``: the previous hook still prints the traceback, then one
    line ``omnihvd: rank R raised <exception>; aborting the job`` goes to ``stream``
    and ``abort(exit_code)`` ends the job (default :func:`abort_job`, i.e.
    ``MPI_Abort`` under ``mpirun``). Call it on every rank after ``hvd.init()``;
    ``OmniLearnCallback(abort_on_exception=True)`` does so at ``on_train_begin``.

    Exceptions raised in other threads are not covered (``threading.excepthook``):
    a dying helper thread does not end a Python program either.

    Do not use it under Horovod elastic (``horovodrun --min-np``): there a failing
    worker must die alone so the others can carry on without it.

    Args:
        rank: this process's rank, named in the message (``hvd.rank()``).
        exit_code: the job's exit status, 1 to 255.
        abort: callable taking the exit code; it must not return. Tests pass a fake.
        stream: where the message goes; ``sys.stderr`` at the time of the exception
            when None.

    Returns:
        AbortHandle: ``handle.remove()`` restores the previous ``sys.excepthook``.

    Raises:
        ConfigError: ``rank`` is not an int >= 0, ``exit_code`` is not in 1..255, or
        ``abort`` is not callable.

    Example::

        hvd.init()
        handle = omnihvd.faults.install_abort_on_exception(hvd.rank())
        train()              # an exception on any rank now ends all ranks
        handle.remove()
    """
    check_int("rank", rank, 0, "pass hvd.rank()")
    _check_exit_code(exit_code)
    if abort is None:
        abort = abort_job
    elif not callable(abort):
        raise ConfigError("abort must be a callable taking the exit code, got %r" % (abort,))
    previous = sys.excepthook
    hook = _AbortHook(rank, exit_code, abort, stream, previous)
    sys.excepthook = hook
    return AbortHandle(hook, previous)
