"""The parameter server: one shard of the parameters, updated by asynchronous pushes.

:class:`ServerCore` is the whole server logic as a pure state machine, with no MPI:
it takes a decoded message and the rank it came from and returns the replies to
send. That keeps every rule testable in one process:

* each worker goes NEW -> (HELLO) -> ACTIVE -> (DONE) -> DONE; anything else is an
  error naming the worker rank;
* a PUSH must carry the next sequence number of its worker (a gap means an update
  was lost, a repeat that one would be applied twice), a version the server has
  issued, float32 data of exactly the shard's length, finite values, a batch >= 1;
* each accepted push is applied once, weighted by ``batch_size / global_batch_size``
  (so one push from every worker moves the model as far as one synchronous step on
  the global batch) and optionally by a staleness-aware factor;
* staleness = server version now - the version the worker computed on, recorded
  for every update;
* at DONE the worker's count of pushes must equal the server's count of applied
  updates from it; when every worker is done, each gets the FINAL shard.

:func:`serve` is the MPI pump around it (:mod:`omnihvd.asynchronous.transport`).
"""
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..checks import check_number
from ..errors import ConfigError
from .balance import IntervalBalancer, staleness_scale
from .protocol import (DONE, DTYPES, FINAL, HELLO, PARAMS, PUSH, STOPPED, Message,
                       ProtocolError, encode)

__all__ = ["ServerCore", "serve", "summarize_staleness"]

_NEW, _ACTIVE, _DONE = "new", "active", "done"
_F32 = DTYPES[1]


def summarize_staleness(values) -> dict:
    """Median, 95th percentile, max and mean of a list of staleness values.

    >>> summarize_staleness([0, 1, 1, 2, 9])
    {'count': 5, 'median': 1.0, 'p95': 7.6, 'max': 9, 'mean': 2.6}
    """
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"count": 0, "median": None, "p95": None, "max": None, "mean": None}
    return {"count": int(arr.size), "median": float(np.median(arr)),
            "p95": round(float(np.percentile(arr, 95)), 6), "max": int(arr.max()),
            "mean": round(float(arr.mean()), 6)}


class ServerCore:
    """State of one server: its shard, version, workers and the log of updates.

    Args:
        shard: this server's initial flat float32 parameters (copied).
        rank: this server's rank (the ``sender`` of its replies).
        worker_ranks: ranks of all workers.
        global_batch_size: B; an update from a batch of b samples is weighted b / B.
        lr: learning rate of the server's SGD.
        momentum, weight_decay: SGD options (weight decay is weighted like the gradient).
        staleness_lr: None or ``"inverse"`` (see :func:`staleness_scale`).
        layout: fingerprint every worker's HELLO must match.
        balancer: an :class:`IntervalBalancer` (server 0 only) or None; its sizes go
            to the workers in every reply. None: replies carry batch size 0 ("keep").
        clock: seconds, for the update log.

    Raises:
        ConfigError: bad options.
    """

    def __init__(self, shard, *, rank: int, worker_ranks: Sequence[int], global_batch_size: int,
                 lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 staleness_lr: Optional[str] = None, layout: int = 0,
                 balancer: Optional[IntervalBalancer] = None, clock=time.monotonic):
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            check_number(name, value, 0)
        if not worker_ranks:
            raise ConfigError("the parameter server needs at least one worker rank")
        staleness_scale(0, len(worker_ranks), staleness_lr)  # validates the mode
        self.params = np.array(shard, dtype=np.float32).reshape(-1)
        self.rank = rank
        self.workers = list(worker_ranks)
        self._index = {r: i for i, r in enumerate(self.workers)}
        self.global_batch_size = int(global_batch_size)
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.staleness_lr = staleness_lr
        self.layout = int(layout)
        self.balancer = balancer
        self._velocity = np.zeros_like(self.params) if momentum else None
        self._clock = clock
        self._t0 = clock()
        self.version = 0
        self.state = {r: _NEW for r in self.workers}
        self.applied = {r: 0 for r in self.workers}
        self.log: Dict[str, List] = {k: [] for k in
                                     ("worker", "seq", "batch_size", "staleness", "time", "scale")}

    # ------------------------------------------------------------ queries

    @property
    def finished(self) -> bool:
        """True once every worker has sent DONE."""
        return all(s == _DONE for s in self.state.values())

    def pending(self) -> List[int]:
        """Ranks of workers that have not sent DONE yet."""
        return [r for r, s in self.state.items() if s != _DONE]

    def report(self) -> dict:
        """Counts, staleness summary, the per-update log and the balancer's decisions."""
        return {
            "rank": self.rank, "numel": int(self.params.size), "version": self.version,
            "updates": int(sum(self.applied.values())),
            "applied": {str(r): n for r, n in self.applied.items()},
            "staleness": summarize_staleness(self.log["staleness"]),
            "log": {k: list(v) for k, v in self.log.items()},
            "decisions": list(self.balancer.history) if self.balancer else [],
            "batch_sizes": list(self.balancer.sizes) if self.balancer else None,
        }

    # ------------------------------------------------------------ messages

    def _reject(self, source, msg, problem):
        raise ProtocolError("server rank %d rejected %s from worker rank %d: %s"
                            % (self.rank, msg.kind_name, source, problem))

    def _reply(self, kind, worker):
        size = self.balancer.sizes[self._index[worker]] if self.balancer else 0
        return worker, encode(kind, self.rank, self.params, version=self.version, batch_size=size)

    def handle(self, msg: Message, source: int) -> List[Tuple[int, np.ndarray]]:
        """Apply one message from rank ``source``; return ``[(dest_rank, buffer), ...]``.

        Raises:
            ProtocolError: the message does not fit (unknown worker, wrong state,
                sequence gap or repeat, wrong dtype or length, version from the future,
                non-finite gradient, count mismatch at DONE). The message names this
                server, the worker rank and what was expected.
        """
        if source not in self._index:
            raise ProtocolError("server rank %d got %s from rank %d, which is not a worker "
                                "(workers: %s)" % (self.rank, msg.kind_name, source, self.workers))
        if msg.sender != source:
            self._reject(source, msg, "it claims to come from rank %d" % msg.sender)
        state = self.state[source]
        if msg.kind == HELLO:
            if state != _NEW:
                self._reject(source, msg, "the worker already said HELLO")
            if msg.layout != self.layout:
                self._reject(source, msg, "its model's parameter layout (fingerprint %d) differs "
                                          "from the server's (%d): build the same model on every "
                                          "rank" % (msg.layout, self.layout))
            self.state[source] = _ACTIVE
            return [self._reply(PARAMS, source)]
        if msg.kind == PUSH:
            if state != _ACTIVE:
                self._reject(source, msg, "the worker is %s (HELLO must come first, nothing "
                                          "after DONE)" % state)
            self._apply(msg, source)
            return [self._reply(PARAMS, source)]
        if msg.kind == DONE:
            if state != _ACTIVE:
                self._reject(source, msg, "the worker is %s" % state)
            if msg.seq != self.applied[source]:
                self._reject(source, msg, "the worker sent %d pushes but this server applied %d: "
                                          "updates were lost or duplicated"
                                          % (msg.seq, self.applied[source]))
            self.state[source] = _DONE
            if self.balancer:
                self.balancer.freeze()
            if self.finished:
                return [self._reply(FINAL, r) for r in self.workers]
            return []
        self._reject(source, msg, "servers accept only HELLO, PUSH and DONE")

    def _apply(self, msg: Message, source: int):
        expected = self.applied[source]
        if msg.seq != expected:
            what = "lost" if msg.seq > expected else "a repeat (it would be applied twice)"
            self._reject(source, msg, "sequence number %d, expected %d: an update was %s"
                         % (msg.seq, expected, what))
        if msg.payload.dtype != _F32:
            self._reject(source, msg, "gradient dtype %s, expected float32" % msg.payload.dtype)
        if msg.payload.size != self.params.size:
            self._reject(source, msg, "gradient shard has %d elements, expected %d (same model "
                                      "and number of servers on every rank?)"
                         % (msg.payload.size, self.params.size))
        if msg.version > self.version:
            self._reject(source, msg, "version %d is newer than the server's %d"
                         % (msg.version, self.version))
        if msg.batch_size < 1:
            self._reject(source, msg, "batch_size %d, expected >= 1" % msg.batch_size)
        grad = msg.payload
        if not np.all(np.isfinite(grad)):
            self._reject(source, msg, "the gradient holds NaN or infinity (diverged? lower lr)")
        staleness = self.version - msg.version
        scale = staleness_scale(staleness, len(self.workers), self.staleness_lr)
        weight = msg.batch_size / self.global_batch_size
        if self.weight_decay:
            grad = grad + np.float32(self.weight_decay) * self.params
        if self._velocity is not None:
            self._velocity *= np.float32(self.momentum)
            self._velocity += np.float32(weight) * grad
            self.params -= np.float32(self.lr * scale) * self._velocity
        else:
            self.params -= np.float32(self.lr * scale * weight) * grad
        self.version += 1
        self.applied[source] += 1
        now = self._clock() - self._t0
        for key, value in (("worker", source), ("seq", msg.seq), ("batch_size", msg.batch_size),
                           ("staleness", staleness), ("time", round(now, 6)), ("scale", scale)):
            self.log[key].append(value)
        if self.balancer:
            index = self._index[source]
            self.balancer.record(index, msg.batch_size, msg.interval_us * 1e-6)
            self.balancer.after_update(version=self.version, time=round(now, 6))


def serve(core: ServerCore, link, idle_timeout: Optional[float] = None) -> dict:
    """Run ``core`` until every worker is done; returns ``core.report()``.

    Args:
        core: the server state.
        link: a :class:`omnihvd.asynchronous.transport.Link` on the server's communicator.
        idle_timeout: seconds without any message after which the server gives up
            (a worker died without a word); None waits forever.

    Raises:
        ProtocolError: a rejected message (see :meth:`ServerCore.handle`).
        TimeoutError: ``idle_timeout`` passed; names the workers still pending.
        Either way every worker is first sent STOPPED, so that none waits for ever
        for this server (the job is not aborted when ``abort_on_exception=False``).
    """
    try:
        while not core.finished:
            got = link.receive_any(idle_timeout)
            if got is None:
                raise TimeoutError("server rank %d heard nothing for %.0f s; workers %s never "
                                   "sent DONE (did one die or stop calling on_train_end()?)"
                                   % (core.rank, idle_timeout, core.pending()))
            source, msg = got
            for dest, buf in core.handle(msg, source):
                link.send(dest, buf)
    except BaseException:   # Ctrl-C on the server too
        for worker in core.workers:
            link.send(worker, encode(STOPPED, core.rank))
        raise
    link.wait_sends()
    return core.report()
