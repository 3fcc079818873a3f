"""The one module that talks to other ranks.

Everything else receives plain data. Three backends share one small interface:

* :class:`HorovodComm` -- Horovod's own allgather (the default with several ranks,
  MPI or Gloo, elastic or not). Its background thread runs the gather in order with
  the gradient allreduces and completes it before it handles a shutdown, so a gather
  never outlives Horovod. That matters at the end of a run: the first rank to exit
  shuts Horovod down everywhere, and when ``hvd.init()`` initialised MPI, Horovod's
  background thread finalises MPI on every rank -- an mpi4py call that a slower rank
  makes after that crashes the process.
* :class:`MPIComm` -- mpi4py on a duplicate of a communicator the user passes
  (``OmniLearnCallback(comm=...)``, the one given to ``hvd.init(comm=...)``). Then
  mpi4py initialised MPI, Horovod does not finalise it, and mpi4py finalises it only
  when its own process exits. Needs ``MPI_THREAD_MULTIPLE`` (Horovod's background
  thread uses MPI at the same time); without it :func:`make_comm` falls back to
  :class:`HorovodComm` with a warning.
* :class:`LocalComm` -- one rank, no communication (single-process runs and tests).
* :class:`TorchDistComm` -- torch.distributed on a process group (the DDP backend,
  :mod:`omnihvd.ddp`): gloo on CPU, NCCL on GPUs; no Horovod or MPI involved. Every
  gloo collective it (or the DDP hook) posts is handed to :func:`hold_past_exit`.

The payload per adjustment is a handful of float64 per rank, posted as the gathering
step begins and completed at the end of the same step.
"""
import atexit
import collections
import ctypes
import logging
import pickle
from typing import Any, List, Optional

import numpy as np

from .errors import ConfigError

__all__ = ["MPIComm", "HorovodComm", "LocalComm", "TorchDistComm", "make_comm", "agree_on_comm",
           "PendingGather", "hold_past_exit"]

log = logging.getLogger("omnihvd")

#: How many of the newest gloo collectives :func:`hold_past_exit` keeps.
HELD_WORKS = 1024  # a step of a large model has hundreds of buckets
_held_works: "collections.deque" = collections.deque(maxlen=HELD_WORKS)


def hold_past_exit(work, *objects):
    """Reference a gloo work (and the tensors it uses) until the process has ended.

    gloo runs each collective on a worker thread of its own, and that thread drops
    its reference to the work only after the rank waiting for it has moved on. When
    that is the last reference and the interpreter has begun to finalise, freeing the
    work's Python-side state (the tensors it holds, the thread-local state captured
    inside ``backward()``) needs the GIL, which a finalising interpreter no longer
    grants: the process aborts with ``terminate called without an active exception``
    (torch 2.13, about one gloo process in ten that exits right after a collective;
    plain DDP does it too). So omnihvd keeps its newest :data:`HELD_WORKS` works here,
    and at exit keeps them for good, so the worker's release is never the last one.
    The held tensors are the gather's few bytes and DDP's own bucket views.

    Example::

        work = dist.all_reduce(buffer, async_op=True)
        hold_past_exit(work, buffer)
    """
    _held_works.append((work, objects))


@atexit.register
def _keep_held_works_forever():
    # Runs before finalisation; one extra reference the interpreter never returns.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_held_works))


class PendingGather:
    """A posted non-blocking allgather; :meth:`wait` returns the ``(size, k)`` array."""

    def __init__(self, wait_fn, keep=()):
        self._wait_fn = wait_fn
        self._keep = keep  # buffers an in-flight MPI request still reads or writes
        self._result: Optional[np.ndarray] = None

    def wait(self) -> np.ndarray:
        if self._result is None:
            self._result = self._wait_fn()
        return self._result


class LocalComm:
    """A world of one rank."""

    rank, size = 0, 1

    def allgather(self, values) -> np.ndarray:
        return np.asarray(values, dtype=np.float64).reshape(1, -1).copy()

    def iallgather(self, values) -> PendingGather:
        result = self.allgather(values)
        return PendingGather(lambda: result)

    def allgather_object(self, obj, name: Optional[str] = None) -> List[Any]:
        return [pickle.loads(pickle.dumps(obj))]


class MPIComm:
    """mpi4py communicator for omnihvd's small collectives.

    Args:
        comm: an mpi4py communicator over the same ranks, in the same order, as
            Horovod's (default ``MPI.COMM_WORLD``). It is duplicated (collective).
    """

    def __init__(self, comm=None):
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()

    def allgather(self, values) -> np.ndarray:
        return self.iallgather(values).wait()

    def iallgather(self, values) -> PendingGather:
        send = np.ascontiguousarray(values, dtype=np.float64).ravel()
        recv = np.empty((self.size, send.size), dtype=np.float64)
        request = self._comm.Iallgather(send, recv)

        def wait():
            request.Wait()
            return recv

        return PendingGather(wait, keep=(send, recv))

    def allgather_object(self, obj, name: Optional[str] = None) -> List[Any]:
        return self._comm.allgather(obj)

    def abort(self, code: int = 1):
        self._comm.Abort(code)

    def free(self):
        if self._comm is not None and self._comm != self._MPI.COMM_NULL:
            self._comm.Free()
            self._comm = None


class HorovodComm:
    """Horovod's allgather as the transport (Gloo controller, elastic runs)."""

    def __init__(self):
        import horovod.torch as hvd

        self._hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()
        self._count = 0

    def _name(self):
        self._count += 1
        return "omnihvd.gather.%d" % self._count

    def iallgather(self, values, name: str = "omnihvd.timing") -> PendingGather:
        import torch

        row = torch.as_tensor(np.asarray(values, dtype=np.float64).reshape(1, -1))
        # A fixed name: at most one such gather is in flight, and a recurring name
        # lets Horovod's response cache skip the negotiation.
        handle = self._hvd.allgather_async(row, name=name)
        return PendingGather(lambda: self._hvd.synchronize(handle).numpy().copy())

    def allgather(self, values) -> np.ndarray:
        # its own name: it may run while the step's timing gather is in flight
        # (cb.global_count() inside a step that gathers)
        return self.iallgather(values, name="omnihvd.values").wait()

    def allgather_object(self, obj, name: Optional[str] = None) -> List[Any]:
        """All ranks' ``obj``. ``name``: a fixed name for a gather that ranks of
        different histories must match (Horovod elastic: a new worker's counter
        differs from a survivor's); default: a counted one."""
        return self._hvd.allgather_object(obj, name=name or self._name())


class TorchDistComm:
    """torch.distributed collectives on one process group (DDP runs under torchrun).

    Args:
        group: the process group, e.g. a DDP model's ``process_group``; None for the
            default group. ``torch.distributed`` must be initialised.

    With the NCCL backend the payload travels as a CUDA tensor on the current device
    (call ``torch.cuda.set_device(local_rank)`` first, as DDP needs anyway); with gloo
    it stays on the CPU.
    """

    def __init__(self, group=None):
        import torch
        import torch.distributed as dist

        self._torch, self._dist, self._group = torch, dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        nccl = dist.get_backend(group) == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else None

    def iallgather(self, values) -> PendingGather:
        return self._post_gather(np.array(values, dtype=np.float64).ravel())

    def _post_gather(self, array: np.ndarray) -> PendingGather:
        torch = self._torch
        send = torch.from_numpy(array).to(self._device)
        recv = torch.empty(self.size * send.numel(), dtype=send.dtype, device=self._device)
        # all_gather_single is the newer name (torch 2.13) of all_gather_into_tensor.
        gather = getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor
        work = gather(recv, send, group=self._group, async_op=True)
        if self._device is None:  # gloo: its worker thread may release the work last
            hold_past_exit(work, send, recv)

        def wait():
            work.wait()
            return recv.view(self.size, -1).cpu().numpy().copy()

        return PendingGather(wait, keep=(send, recv))

    def allgather(self, values) -> np.ndarray:
        return self.iallgather(values).wait()

    def allgather_object(self, obj, name: Optional[str] = None) -> List[Any]:
        # Pickled bytes padded to the longest, gathered like the timings: torch's own
        # all_gather_object would post works that hold_past_exit cannot reach.
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        lengths = self.allgather([len(data)])[:, 0].astype(int)
        padded = np.zeros(int(lengths.max()), dtype=np.uint8)
        padded[:len(data)] = data
        rows = self._post_gather(padded).wait()
        return [pickle.loads(rows[r, :n].tobytes()) for r, n in enumerate(lengths)]


def _comm_kind(comm, rank: int, size: int) -> str:
    """What :func:`make_comm` builds from ``comm``: ``"default"``, ``"mpi4py"`` or
    ``"custom"``, checked against Horovod's ``rank`` and ``size`` without a collective.

    Raises:
        ConfigError: not a communicator, or one of another rank or size.
    """
    if comm is None:
        return "default"
    if hasattr(comm, "Get_rank") and hasattr(comm, "Dup"):
        kind, got = "mpi4py", (comm.Get_rank(), comm.Get_size())
    elif all(hasattr(comm, a) for a in ("rank", "size", "allgather", "iallgather",
                                         "allgather_object")):
        kind, got = "custom", (comm.rank, comm.size)
    else:
        raise ConfigError("comm must be None, an mpi4py communicator, or an object with rank, "
                          "size, allgather, iallgather and allgather_object; got %r" % (comm,))
    if got != (rank, size):
        raise ConfigError(
            "the communicator has rank %d of %d but Horovod has rank %d of %d; pass the "
            "communicator given to hvd.init(comm=...) as OmniLearnCallback(comm=...)"
            % (got + (rank, size)))
    return kind


def agree_on_comm(comm, rank: int, size: int, gather):
    """Check ``comm`` on every rank before any rank makes a collective on it (an
    mpi4py communicator is duplicated: a rank alone in that waits for ever).

    Args:
        comm, rank, size: as for :func:`make_comm`.
        gather: ``obj -> [every rank's obj]`` over another transport (Horovod's).

    Raises:
        ConfigError: on every rank, when ``comm`` is bad on any rank or not of one
            kind on all.

    >>> agree_on_comm(None, 0, 2, gather=lambda obj: [obj, ("ok", "mpi4py")])
    Traceback (most recent call last):
    ...
    omnihvd.errors.ConfigError: comm= must be of one kind on every rank: rank 0 default, rank 1 mpi4py
    """
    try:
        report = ("ok", _comm_kind(comm, rank, size))
    except ConfigError as exc:
        report = ("error", str(exc))
    reports = gather(report)
    for r, (status, text) in enumerate(reports):
        if status == "error":
            raise ConfigError("comm= on rank %d: %s" % (r, text))
    if len({text for _, text in reports}) > 1:
        raise ConfigError("comm= must be of one kind on every rank: %s"
                          % ", ".join("rank %d %s" % (r, t) for r, (_, t) in enumerate(reports)))


def make_comm(comm=None, *, rank: int, size: int):
    """The communicator for a callback on Horovod rank ``rank`` of ``size``.

    Args:
        comm: None (LocalComm for one rank, HorovodComm otherwise), an mpi4py
            communicator (MPIComm; HorovodComm when MPI lacks MPI_THREAD_MULTIPLE),
            or an object with the interface above.
        rank, size: Horovod's rank and size, to check the communicator against.

    Raises:
        ConfigError: the communicator's rank/size differ from Horovod's.
    """
    kind = _comm_kind(comm, rank, size)
    if kind == "default":
        return LocalComm() if size == 1 else HorovodComm()
    if kind == "custom":
        return comm
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        log.warning("omnihvd: rank %d: MPI provides thread level %d, not MPI_THREAD_MULTIPLE; "
                    "mpi4py calls beside Horovod's background thread are unsafe, so omnihvd "
                    "gathers through Horovod instead", rank, MPI.Query_thread())
        return HorovodComm()
    return MPIComm(comm)
