"""The only part of asynchronous mode that talks MPI: sending and polling.

(Aborting the job is :func:`omnihvd.faults.fail_job`, shared with the synchronous
mode.)

Waiting uses ``Iprobe`` with a short, growing sleep (50 us up to 1 ms) instead of a
blocking receive: Open MPI's blocking calls spin a core at 100%, and a server plus
several workers often share fewer cores than ranks. The sleep adds at most a
millisecond per message, against update intervals of tens of milliseconds or more.

mpi4py is imported inside the functions, so importing this module does not
initialise MPI.
"""
import time
from typing import List, Optional, Tuple

import numpy as np

from .protocol import TAG_TO_SERVER, TAG_TO_WORKER, Message, decode

__all__ = ["Link"]

_MIN_NAP, _MAX_NAP = 5e-5, 1e-3


class Link:
    """Point-to-point messages on one communicator (the parameter server's duplicate).

    Args:
        comm: an ``mpi4py.MPI.Comm``.
        server: True on a server rank (it sends with TAG_TO_WORKER), False on a worker.
    """

    def __init__(self, comm, server: bool):
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self._tag = TAG_TO_WORKER if server else TAG_TO_SERVER
        self._sends: List[Tuple[object, np.ndarray]] = []

    def send(self, dest: int, buf: np.ndarray):
        """Start sending ``buf`` to ``dest``; the buffer is kept alive until it is sent."""
        req = self.comm.Isend([buf, self._mpi.BYTE], dest=dest, tag=self._tag)
        self._sends.append((req, buf))
        self._reap()

    def _reap(self):
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def wait_sends(self):
        """Block until every started send has completed."""
        for req, _ in self._sends:
            req.Wait()
        self._sends = []

    def _poll(self, source: int, tag: int, timeout: Optional[float]):
        status = self._mpi.Status()
        nap = _MIN_NAP
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.comm.Iprobe(source=source, tag=tag, status=status):
            if self._sends:
                self._reap()
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(nap)
            nap = min(nap * 2, _MAX_NAP)
        buf = np.empty(status.Get_count(self._mpi.BYTE), dtype=np.uint8)
        src = status.Get_source()
        self.comm.Recv([buf, self._mpi.BYTE], source=src, tag=tag)
        return src, decode(buf, source=src)

    def receive_any(self, timeout: Optional[float] = None) -> Optional[Tuple[int, Message]]:
        """Next message to a server from any rank: ``(source, Message)``, or None on timeout.

        Raises:
            ProtocolError: the bytes are not a well-formed message.
        """
        return self._poll(self._mpi.ANY_SOURCE, TAG_TO_SERVER, timeout)

    def receive_from(self, source: int, timeout: Optional[float] = None) -> Optional[Message]:
        """Next message to a worker from server ``source``, or None on timeout."""
        got = self._poll(source, TAG_TO_WORKER, timeout)
        return None if got is None else got[1]
