"""The one module that talks to other ranks.

Everything else receives plain data. Two backends share one small interface:

* :class:`MPIComm` -- mpi4py on a duplicate of the communicator Horovod runs on (MPI
  builds; the default). The duplicate keeps our messages apart from Horovod's own
  traffic on the same ranks. Works whether mpi4py or Horovod initialised MPI first:
  importing ``mpi4py.MPI`` after ``hvd.init()`` finds MPI initialised and leaves it
  alone; ``hvd.init()`` after mpi4py reuses mpi4py's initialisation.
* :class:`HorovodComm` -- Horovod's own allgather, for Gloo-controller and elastic
  runs where there may be no MPI world at all.
* :class:`LocalComm` -- one rank, no communication (single-process runs and tests).

The payload per adjustment is a handful of float64 per rank, gathered with a
non-blocking allgather that overlaps the next training step.
"""
import pickle
from typing import Any, List, Optional

import numpy as np

from .errors import ConfigError

__all__ = ["MPIComm", "HorovodComm", "LocalComm", "make_comm", "PendingGather"]


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

    def allgather_object(self, obj) -> List[Any]:
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

    def allgather_object(self, obj) -> List[Any]:
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

    def iallgather(self, values) -> PendingGather:
        import torch

        row = torch.as_tensor(np.asarray(values, dtype=np.float64).reshape(1, -1))
        handle = self._hvd.allgather_async(row, name=self._name())
        return PendingGather(lambda: self._hvd.synchronize(handle).numpy().copy())

    def allgather(self, values) -> np.ndarray:
        return self.iallgather(values).wait()

    def allgather_object(self, obj) -> List[Any]:
        return self._hvd.allgather_object(obj, name=self._name())


def make_comm(comm=None, *, rank: int, size: int):
    """The communicator for a callback on Horovod rank ``rank`` of ``size``.

    Args:
        comm: None (choose: LocalComm for one rank, MPIComm when Horovod runs on MPI,
            HorovodComm otherwise), an mpi4py communicator, or an object with the
            interface above.
        rank, size: Horovod's rank and size, to check the communicator against.

    Raises:
        ConfigError: the communicator's rank/size differ from Horovod's.
    """
    if comm is None:
        if size == 1:
            return LocalComm()
        import horovod.torch as hvd

        comm = MPIComm() if hvd.mpi_enabled() else HorovodComm()
    elif hasattr(comm, "Get_rank") and hasattr(comm, "Dup"):
        comm = MPIComm(comm)
    elif not all(hasattr(comm, a) for a in ("rank", "size", "allgather", "iallgather",
                                              "allgather_object")):
        raise ConfigError("comm must be None, an mpi4py communicator, or an object with rank, "
                          "size, allgather, iallgather and allgather_object; got %r" % (comm,))
    if comm.rank != rank or comm.size != size:
        raise ConfigError(
            "the communicator has rank %d of %d but Horovod has rank %d of %d; pass the "
            "communicator given to hvd.init(comm=...) as OmniLearnCallback(comm=...)"
            % (comm.rank, comm.size, rank, size))
    return comm
