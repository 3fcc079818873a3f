"""Keep the global batch split across the ranks of a Horovod elastic job.

With ``horovodrun --min-np/--max-np --host-discovery-script`` (Gloo), workers come
and go during training. After each change Horovod re-initialises itself on the new
set of workers; omnihvd must then split the same global batch B over the new world
size n, or the learning-rate semantics change and samples are lost or repeated.

How it fits Horovod's elastic protocol (horovod/common/elastic.py ``run_fn``):

* Surviving workers get ``HostsUpdatedInterrupt`` or ``HorovodInternalError``,
  re-initialise Horovod, run the state's reset callbacks, then sync the state from
  rank 0 and re-enter the training function. New workers only sync and enter it.
  So a reset callback must not run collectives (a new worker would not join them):
  :meth:`ElasticBatchSplit.on_reset` only marks the split stale.
* Every worker, old or new, enters the training function: the split is agreed there,
  by :meth:`ElasticBatchSplit.begin`, one small allgather on every (re)entry.

The new split is throughput-informed: each surviving worker reports the samples per
second it measured itself (it keeps them across the reset, being the same process);
a new worker has none and is assumed as fast as the median known one. With no
measurement anywhere the split is equal. :func:`split_for_world` is the pure rule.

Running on one host needs ``--network-interface lo`` (or the host's interface):
without it horovodrun waits for two distinct hosts to detect common interfaces and,
with one host, sits silent until ``--elastic-timeout`` (600 s by default) ends it.
"""
import math
import os
import socket
from collections import deque
from typing import Callable, List, Optional

import numpy as np

from .controller import apportion
from .errors import ConfigError, RankMismatchError
from .timing import sustained_step_time

__all__ = ["ElasticBatchSplit", "split_for_world"]

# The one collective of this module; a fixed name, so old and new workers match.
_GATHER_NAME = "omnihvd.elastic.split"


def split_for_world(global_batch_size, throughputs, *, min_batch_size=1, max_batch_size=None):
    """Batch sizes for a (new) world, proportional to known throughputs.

    Args:
        global_batch_size: B, held exactly.
        throughputs: one entry per rank of the new world: samples/s, or None/NaN
            where unknown (a worker that just joined). Unknown entries get the median
            of the known ones; with none known the split is equal.
        min_batch_size, max_batch_size: int bounds (or None for no upper bound),
            as in :func:`omnihvd.controller.apportion`.

    Returns:
        list of int, one per rank, summing to ``global_batch_size``.

    Raises:
        ConfigError: empty ``throughputs``, a known throughput that is not > 0, or
        bounds that are malformed; InfeasibleError: bounds no split can meet.

    >>> split_for_world(12, [None, None, None])
    [4, 4, 4]
    >>> split_for_world(12, [30.0, 10.0, float("nan")])
    [6, 2, 4]
    """
    if not isinstance(throughputs, (list, tuple, np.ndarray)) or len(throughputs) == 0:
        raise ConfigError("throughputs must be a non-empty list (one entry per rank), got %r"
                          % (throughputs,))
    values = []
    for r, x in enumerate(throughputs):
        if x is None or (isinstance(x, float) and math.isnan(x)):
            values.append(math.nan)
            continue
        try:
            x = float(x)
        except (TypeError, ValueError):
            raise ConfigError("throughputs[%d] must be a number of samples/s or None, got %r"
                              % (r, throughputs[r])) from None
        if not (math.isfinite(x) and x > 0):
            raise ConfigError("throughputs[%d]=%r: a known throughput must be finite and > 0 "
                              "(pass None when unknown)" % (r, throughputs[r]))
        values.append(x)
    known = [x for x in values if not math.isnan(x)]
    fill = float(np.median(known)) if known else 1.0
    targets = [fill if math.isnan(x) else x for x in values]
    return apportion(targets, global_batch_size, min_batch_size, max_batch_size)


class ElasticBatchSplit:
    """Re-splits a fixed global batch whenever a Horovod elastic job changes size.

    Create it on every worker before the ``@hvd.elastic.run`` function, ``attach`` it
    to the elastic state, call :meth:`begin` first thing inside that function, and
    :meth:`observe` each step's local compute time (or let ``target`` measure).

    Args:
        global_batch_size: B, samples per step over all workers; held exactly.
        min_batch_size: int, the smallest batch any worker may get (default 1).
        max_batch_size: int or None: the largest (memory cap), the same for all.
        window: how many recent steps the local throughput is estimated from (kept
            across resets: the worker is the same process, and older steps age out),
            with the estimator every other decision uses
            (:func:`omnihvd.timing.sustained_step_time`, per sample).
        target: optional object told about every new split, with
            ``reset_world(rank, size, batch_sizes, step=None)`` (e.g. the
            OmniLearnCallback); if
            it has ``local_throughput()`` (samples/s or None), that replaces
            :meth:`observe`.
        allgather_object, world: Horovod's ``allgather_object(obj, name=)`` and a
            function returning ``(rank, size)``; defaults use ``horovod.torch``.
            Tests pass fakes.

    Raises:
        ConfigError: malformed arguments.

    Example::

        hvd.init()
        split = omnihvd.elastic.ElasticBatchSplit(global_batch_size=96)
        state = hvd.elastic.TorchState(model, opt, step=0)
        split.attach(state)

        @hvd.elastic.run
        def train(state):
            split.begin()                       # agree on the split (collective)
            while state.step < steps:
                b = split.batch_size            # this worker's share of B
                t0 = time.perf_counter()
                ...forward/backward on b samples...
                split.observe(b, time.perf_counter() - t0)
                opt.step(); state.step += 1; state.commit()
    """

    def __init__(self, global_batch_size, *, min_batch_size=1, max_batch_size=None,
                 window=20, target=None, allgather_object: Optional[Callable] = None,
                 world: Optional[Callable] = None):
        for name, value, lowest in (("global_batch_size", global_batch_size, 1),
                                    ("min_batch_size", min_batch_size, 0),
                                    ("window", window, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ConfigError("%s must be an int >= %d, got %r" % (name, lowest, value))
        if max_batch_size is not None and (isinstance(max_batch_size, bool) or not isinstance(
                max_batch_size, int) or max_batch_size < max(min_batch_size, 1)):
            raise ConfigError("max_batch_size must be None or an int >= min_batch_size (%d); "
                              "per-rank lists do not fit an elastic job, whose ranks change; "
                              "got %r" % (min_batch_size, max_batch_size))
        if target is not None and not callable(getattr(target, "reset_world", None)):
            raise ConfigError("target must have a reset_world(rank, size, batch_sizes, step) "
                              "method, got %s" % type(target).__name__)
        self.global_batch_size = global_batch_size
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.target = target
        self._allgather_object = allgather_object
        self._world = world
        self._samples = deque(maxlen=window)   # (batch size, seconds) of recent steps
        self._stale = True
        self.rank: Optional[int] = None
        self.size: Optional[int] = None
        self.batch_sizes: Optional[List[int]] = None
        self.history: List[dict] = []

    # ---------------------------------------------------------------- wiring
    def attach(self, state):
        """Register :meth:`on_reset` with a ``hvd.elastic`` state object."""
        state.register_reset_callbacks([self.on_reset])

    def on_reset(self):
        """Horovod reset callback: the world changed; no collective may run here."""
        self._stale = True

    @property
    def stale(self) -> bool:
        """True until :meth:`begin` has agreed on a split for the current world."""
        return self._stale

    @property
    def batch_size(self) -> int:
        """This worker's share of the global batch (after :meth:`begin`)."""
        if self.batch_sizes is None:
            raise RuntimeError("ElasticBatchSplit.begin() has not run yet: call it first thing "
                               "inside the @hvd.elastic.run function")
        return self.batch_sizes[self.rank]

    @property
    def offset(self) -> int:
        """Where this worker's slice starts within the step's B samples."""
        return sum(self.batch_sizes[:self.rank])

    # ------------------------------------------------------------ measuring
    def observe(self, batch_size, seconds):
        """Record one step's local compute time (not the time waiting for others).

        Garbage (non-finite or non-positive values) is ignored.
        """
        try:
            b, t = float(batch_size), float(seconds)
        except (TypeError, ValueError):
            return
        if math.isfinite(b) and math.isfinite(t) and b > 0 and t > 0:
            self._samples.append((b, t))

    def local_throughput(self) -> Optional[float]:
        """Sustained samples/s of this worker's recent steps, or None before any."""
        if self.target is not None and callable(getattr(self.target, "local_throughput", None)):
            x = self.target.local_throughput()
            return None if x is None or not (math.isfinite(x) and x > 0) else float(x)
        if not self._samples:
            return None
        per_sample, _ = sustained_step_time([t / b for b, t in self._samples])
        return 1.0 / per_sample

    # --------------------------------------------------------------- agreeing
    def begin(self, step=None) -> List[int]:
        """Agree on the split for the current world; call on every worker on each entry.

        Collective (one ``allgather_object``): call it first thing inside the
        ``@hvd.elastic.run`` function, on every worker, every time that function
        starts. The split is recomputed only when the world changed (reset, first
        call); otherwise the call still gathers, so that all workers always run the
        same collectives.

        Args:
            step: the global step training resumes from (``state.step`` after Horovod's
                sync; after a failure it is the last committed step), passed on to
                ``target.reset_world``; None when the target needs none.

        Returns:
            list of int: every worker's batch size (the same on all), summing to B.

        Raises:
            RankMismatchError: workers disagree on B or the bounds (the message lists
            each worker's values).
        """
        rank, size = self._current_world()
        report = {"config": (self.global_batch_size, self.min_batch_size, self.max_batch_size),
                  "throughput": self.local_throughput(),
                  "worker": "%s[%s]" % (os.environ.get("HOROVOD_HOSTNAME", socket.gethostname()),
                                        os.environ.get("HOROVOD_LOCAL_RANK", "?")),
                  "sizes": self.batch_sizes if not self._stale else None}
        gather = self._allgather_object or _horovod_allgather_object
        reports = gather(report, name=_GATHER_NAME)
        if len(reports) != size:
            raise RuntimeError("allgather_object returned %d reports for a world of %d"
                               % (len(reports), size))
        configs = [r["config"] for r in reports]
        if any(c != configs[0] for c in configs):
            raise RankMismatchError(
                "workers disagree on (global_batch_size, min_batch_size, max_batch_size): %s; "
                "every worker must use the same values"
                % ", ".join("rank %d has %r" % (i, c) for i, c in enumerate(configs)))
        current = [r["sizes"] for r in reports]
        if self.batch_sizes is not None and size == self.size and all(
                s == current[0] and s is not None for s in current):
            sizes = list(current[0])   # nothing changed anywhere: keep the split
        else:
            throughputs = [r["throughput"] for r in reports]
            sizes = split_for_world(self.global_batch_size, throughputs,
                                    min_batch_size=self.min_batch_size,
                                    max_batch_size=self.max_batch_size)
            self.history.append({"size": size, "workers": [r["worker"] for r in reports],
                                 "throughputs": throughputs, "batch_sizes": sizes})
        self.rank, self.size, self.batch_sizes = rank, size, sizes
        self._stale = False
        if self.target is not None:
            self.target.reset_world(rank, size, list(sizes), step=step)
        return list(sizes)

    def _current_world(self):
        if self._world is not None:
            return self._world()
        import horovod.torch as hvd

        return hvd.rank(), hvd.size()


def _horovod_allgather_object(obj, name):
    import horovod.torch as hvd

    return hvd.allgather_object(obj, name=name)
