"""Splitting the global batch over a changed set of workers (Horovod elastic).

When workers leave or join, the same global batch B is split over the new world:
each worker reports the samples/s it measured itself (a survivor is the same
process, so it keeps its measurements; a newcomer has none) and its own memory cap,
and every worker computes the same split from the same gathered reports. A worker
with no measurement counts as the median known one; with no measurement anywhere
the split is equal. Pure Python and numpy: no torch, horovod or mpi4py (the
collective and the Horovod state object are in :mod:`omnihvd.elastic`).

>>> reports = [world_report((12, 1, 12, 1), 5, 30.0, 12, "a[0]"),
...            world_report((12, 1, 12, 1), 5, 10.0, 12, "a[1]"),
...            world_report((12, 1, 12, 1), 5, None, 12, "b[0]")]
>>> agree_on_world(reports).batch_sizes
[6, 2, 4]
"""
import math
import os
import socket
from collections import deque
from typing import List, NamedTuple, Optional

import numpy as np

from .controller import apportion
from .errors import ConfigError, RankMismatchError
from .timing import sustained_step_time

__all__ = ["JOIN_NAME", "ThroughputMeter", "World", "agree_on_world", "split_for_world",
           "worker_label", "world_report"]

# The one collective on (re)entry; a fixed name, so that old and new workers match.
JOIN_NAME = "omnihvd.elastic.join"


def split_for_world(global_batch_size, throughputs, *, min_batch_size=1, max_batch_size=None,
                    size_multiple=1):
    """Batch sizes for a (new) world, proportional to known throughputs.

    Args:
        global_batch_size: B, held exactly.
        throughputs: one entry per rank of the new world: samples/s, or None/NaN
            where unknown (a worker that just joined). Unknown entries get the median
            of the known ones; with none known the split is equal.
        min_batch_size, max_batch_size, size_multiple: bounds and multiple rule, as
            in :func:`omnihvd.controller.apportion` (int or per-rank list).

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
    return apportion(targets, global_batch_size, min_batch_size, max_batch_size, size_multiple)


class ThroughputMeter:
    """This worker's sustained samples/s over its last ``window`` steps.

    Kept across membership changes (the worker is the same process; older steps age
    out), estimated per sample with the estimator every other decision uses
    (:func:`omnihvd.timing.sustained_step_time`).

    >>> m = ThroughputMeter(window=4)
    >>> m.value() is None
    True
    >>> for b, t in [(10, 0.5), (20, 1.0), (0, 1.0), (10, float("nan"))]: m.observe(b, t)
    >>> m.value()
    20.0
    """

    def __init__(self, window: int = 20):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError("window must be an int >= 1, got %r" % (window,))
        self._per_sample = deque(maxlen=window)

    def observe(self, batch_size, seconds):
        """One step's local compute time at ``batch_size``; garbage is ignored."""
        try:
            b, t = float(batch_size), float(seconds)
        except (TypeError, ValueError):
            return
        if math.isfinite(b) and math.isfinite(t) and b > 0 and t > 0:
            self._per_sample.append(t / b)

    def value(self) -> Optional[float]:
        """Samples/s, or None before any valid step."""
        if not self._per_sample:
            return None
        per_sample, _ = sustained_step_time(list(self._per_sample))
        return float(1.0 / per_sample)


def world_report(config, step, throughput, cap, worker) -> dict:
    """What one worker contributes to the gather on (re)entry.

    Args:
        config: the options every worker must share, ``(global_batch_size,
            min_batch_size, max_batch_size, size_multiple)`` (ints; max None or int).
        step: the global step training resumes from (after Horovod's state sync).
        throughput: this worker's measured samples/s, or None.
        cap: this worker's own memory cap (its ``max_batch_size``, lowered after
            out-of-memory errors).
        worker: a label for messages and the record (host and local rank).
    """
    return {"config": tuple(config), "step": int(step), "throughput": throughput,
            "cap": int(cap), "worker": str(worker)}


def worker_label() -> str:
    """``host[local rank]`` of this worker, as horovodrun names it."""
    return "%s[%s]" % (os.environ.get("HOROVOD_HOSTNAME", socket.gethostname()),
                       os.environ.get("HOROVOD_LOCAL_RANK", "?"))


class World(NamedTuple):
    """The agreed split of a (new) world: the same on every worker."""

    step: int                  # the step the split starts at
    batch_sizes: List[int]     # one per rank, summing to B
    caps: List[int]            # each rank's max_batch_size in this world
    throughputs: list          # what each rank reported (None: unknown)
    workers: List[str]


def agree_on_world(reports) -> World:
    """The split every worker computes from the gathered :func:`world_report` list.

    Raises:
        RankMismatchError: the workers disagree on the options or on the step
            (the message lists each worker's values).
        InfeasibleError: the bounds and caps hold no split of B.
    """
    configs = [r["config"] for r in reports]
    if any(c != configs[0] for c in configs):
        raise RankMismatchError(
            "workers disagree on (global_batch_size, min_batch_size, max_batch_size, "
            "size_multiple): %s; every worker must use the same values"
            % ", ".join("rank %d (%s) has %r" % (i, r["worker"], c)
                        for i, (r, c) in enumerate(zip(reports, configs))))
    steps = [r["step"] for r in reports]
    if any(s != steps[0] for s in steps):
        raise RankMismatchError(
            "workers resume from different steps (%s): the callback's state was not synced; "
            "track it in omnihvd.elastic.TorchState(model, optimizer, callback=cb)"
            % ", ".join("rank %d has %d" % (i, s) for i, s in enumerate(steps)))
    B, lo, hi, k = configs[0]
    top = B if hi is None else min(hi, B)
    caps = [min(top, r["cap"]) for r in reports]
    throughputs = [r["throughput"] for r in reports]
    sizes = split_for_world(B, throughputs, min_batch_size=lo, max_batch_size=caps,
                            size_multiple=k)
    return World(steps[0], sizes, caps, throughputs, [r["worker"] for r in reports])
