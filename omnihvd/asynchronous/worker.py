"""The worker's side of the parameter-server protocol: pull, push, done.

A worker talks to every server (one shard each) and keeps, per server, the version
of the shard it holds and its count of pushes. A push goes to every server at once;
each server answers with its updated shard ("push, then pull" in one round trip),
and server 0's answer also carries the batch size the worker must use next.
"""
import time
from typing import Optional, Sequence, Tuple

import numpy as np

from ..checks import check_int
from ..errors import ConfigError
from .protocol import (DONE, DTYPES, FINAL, HELLO, PARAMS, PUSH, STOPPED, Message, ProtocolError,
                       encode)

__all__ = ["WorkerClient"]


class WorkerClient:
    """Pull parameters from and push gradients to the servers.

    Args:
        link: :class:`omnihvd.asynchronous.transport.Link` (worker side).
        servers: ranks of the servers, in shard order.
        bounds: shard offsets (see :func:`omnihvd.asynchronous.protocol.shard_bounds`).
        layout: this worker's model fingerprint (checked by the servers at HELLO).
        timeout: seconds to wait for a reply before raising TimeoutError (None: forever).

    Raises:
        ConfigError: ``bounds`` does not match ``servers``.

    Every method raises ProtocolError when a reply is malformed, TimeoutError when a
    server does not answer in time.
    """

    def __init__(self, link, servers: Sequence[int], bounds: Sequence[int], layout: int,
                 timeout: Optional[float] = None):
        if len(bounds) != len(servers) + 1:
            raise ConfigError("bounds (%d offsets) must have one more entry than servers (%d)"
                              % (len(bounds), len(servers)))
        self.link = link
        self.rank = link.rank
        self.servers = list(servers)
        self.bounds = list(bounds)
        self.layout = int(layout)
        self.timeout = timeout
        self.params = np.zeros(self.bounds[-1], dtype=np.float32)
        self.versions = [0] * len(self.servers)
        self.pushes = 0
        self.batch_size = 0
        self._last_send: Optional[float] = None

    @property
    def numel(self) -> int:
        return self.bounds[-1]

    def _collect(self, kind: int, timeout: Optional[float]) -> np.ndarray:
        for s, server in enumerate(self.servers):
            msg = self.link.receive_from(server, timeout)
            if msg is None:
                raise TimeoutError("worker rank %d waited %.0f s for server rank %d to answer"
                                   % (self.rank, timeout, server))
            self._accept(s, server, msg, kind)
        return self.params

    def _accept(self, s: int, server: int, msg: Message, kind: int):
        lo, hi = self.bounds[s], self.bounds[s + 1]
        if msg.kind == STOPPED:
            raise RuntimeError("worker rank %d: server rank %d stopped on an error (its "
                               "traceback says which), so this worker stops too"
                               % (self.rank, server))
        if msg.kind != kind or msg.sender != server:
            raise ProtocolError("worker rank %d expected %s from server rank %d, got %s from "
                                "rank %d" % (self.rank, "PARAMS" if kind == PARAMS else "FINAL",
                                             server, msg.kind_name, msg.sender))
        if msg.payload.dtype != DTYPES[1] or msg.payload.size != hi - lo:
            raise ProtocolError("worker rank %d: server rank %d sent %d %s values, expected %d "
                                "float32" % (self.rank, server, msg.payload.size,
                                             msg.payload.dtype, hi - lo))
        self.params[lo:hi] = msg.payload
        self.versions[s] = msg.version
        if s == 0 and msg.batch_size > 0:
            self.batch_size = msg.batch_size

    def hello(self) -> Tuple[np.ndarray, int]:
        """First pull: returns ``(flat parameters, batch size to use)``."""
        for server in self.servers:
            self.link.send(server, encode(HELLO, self.rank, layout=self.layout))
        self._last_send = time.perf_counter()
        return self._collect(PARAMS, self.timeout), self.batch_size

    def push(self, grad: np.ndarray, batch_size: int) -> Tuple[np.ndarray, int]:
        """Send one gradient (flat float32, all parameters) computed on ``batch_size``
        samples; returns ``(fresh parameters, next batch size)``.

        Raises:
            ConfigError: wrong dtype, shape, or batch size (caught here, before sending).
        """
        grad = np.asarray(grad)
        if grad.dtype != np.float32 or grad.shape != (self.numel,):
            raise ConfigError("worker rank %d: gradient must be a flat float32 array of %d "
                              "elements, got %s %s" % (self.rank, self.numel, grad.dtype, grad.shape))
        check_int("batch_size", batch_size, 1, where="worker rank %d: " % self.rank)
        now = time.perf_counter()
        interval_us = int(round((now - self._last_send) * 1e6)) if self._last_send else 0
        for s, server in enumerate(self.servers):
            shard = grad[self.bounds[s]:self.bounds[s + 1]]
            self.link.send(server, encode(PUSH, self.rank, shard, seq=self.pushes,
                                          version=self.versions[s], batch_size=int(batch_size),
                                          interval_us=interval_us))
        self._last_send = now
        self.pushes += 1
        return self._collect(PARAMS, self.timeout), self.batch_size

    def done(self) -> np.ndarray:
        """Tell every server this worker stops; wait for the final parameters.

        Returns once every worker has finished (the servers answer DONE only then),
        with the parameters after the last update of the whole job. There is no
        timeout here: other workers may legitimately train for much longer, a rank
        that dies ends the whole job under mpirun, and a server that stops on an
        error (``idle_timeout``) sends STOPPED, which raises here.
        """
        for server in self.servers:
            self.link.send(server, encode(DONE, self.rank, seq=self.pushes))
        params = self._collect(FINAL, None)
        self.link.wait_sends()
        return params
