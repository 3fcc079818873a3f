"""Local step timing: how long this rank works per step, excluding waiting for others.

In synchronous training every rank leaves the allreduce at the same moment, so the
full step time is the same everywhere and says nothing about who is slow. What
differs is the time up to the point where a rank starts waiting: data loading,
forward and backward. With Horovod that point is the entry to ``optimizer.step()``,
whose ``synchronize()`` blocks until every rank's gradients are reduced (the
allreduces themselves started asynchronously during backward).

The timer here knows nothing of torch: the callback calls :meth:`StepTimer.start`,
:meth:`StepTimer.mark_wait` and :meth:`StepTimer.stop`. :class:`TimingWindow` and
:func:`robust_step_time` turn a window of per-step samples into one robust figure
(median by default), dropping steps right after a size change and garbage
(NaN, negative, zero), so a single GC pause cannot move the batch sizes.
"""
import math
import time
from typing import Callable, List, Optional

import numpy as np

from .errors import ConfigError

__all__ = ["StepTimer", "TimingWindow", "robust_step_time", "SUMMARIES"]

SUMMARIES = ("median", "mean")


def robust_step_time(samples, method: str = "median", axis: Optional[int] = None):
    """Summarise step-time samples, ignoring entries that are not finite and positive.

    Args:
        samples: array-like of seconds (1-d, or n-d with ``axis``).
        method: ``"median"`` (robust: one outlier in three or more samples cannot
            move it) or ``"mean"`` (the reference implementation's raw average).
        axis: reduce along this axis (e.g. ``axis=0`` for a (steps, ranks) array).

    Returns:
        float (or array along the other axes); NaN where no valid sample exists.

    >>> robust_step_time([0.1, 0.1, 10.0, float("nan"), -1.0])
    0.1
    >>> robust_step_time([0.1, 0.3], method="mean")
    0.2
    """
    if method not in SUMMARIES:
        raise ConfigError("timing summary must be one of %s, got %r" % (SUMMARIES, method))
    arr = np.asarray(samples, dtype=np.float64)
    valid = np.where(np.isfinite(arr) & (arr > 0), arr, np.nan)
    if valid.size == 0:
        return float("nan")
    reduce = np.nanmedian if method == "median" else np.nanmean
    with np.errstate(all="ignore"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices -> NaN
            out = reduce(valid, axis=axis)
    return float(out) if np.ndim(out) == 0 else out


class TimingWindow:
    """Per-step samples since the last reset, with settle steps dropped.

    Args:
        settle_steps: samples to discard after each :meth:`reset` (the first steps
            at a new batch size pay for allocator growth, autotuning, cache misses).
        method: summary, see :func:`robust_step_time`.

    >>> w = TimingWindow(settle_steps=1)
    >>> for s in [5.0, 0.2, 0.21, 20.0, 0.19]: _ = w.add(s)
    >>> len(w), round(w.summary(), 6)
    (4, 0.205)
    """

    def __init__(self, settle_steps: int = 1, method: str = "median"):
        if isinstance(settle_steps, bool) or not isinstance(settle_steps, int) or settle_steps < 0:
            raise ConfigError("settle_steps must be an int >= 0, got %r" % (settle_steps,))
        if method not in SUMMARIES:
            raise ConfigError("timing summary must be one of %s, got %r" % (SUMMARIES, method))
        self.settle_steps = settle_steps
        self.method = method
        self._samples: List[float] = []
        self._skip = settle_steps

    def reset(self, settle: bool = True):
        """Start a new window (call when the batch size changes)."""
        self._samples = []
        self._skip = self.settle_steps if settle else 0

    def add(self, seconds) -> bool:
        """Offer one step's local time; returns whether it was kept."""
        if self._skip > 0:
            self._skip -= 1
            return False
        try:
            seconds = float(seconds)
        except (TypeError, ValueError):
            return False
        if not math.isfinite(seconds) or seconds <= 0:
            return False
        self._samples.append(seconds)
        return True

    def summary(self) -> float:
        """The robust step time of the window; NaN when it holds no sample."""
        return robust_step_time(self._samples, self.method) if self._samples else float("nan")

    def standard_error(self) -> float:
        """Standard error of :meth:`summary` from the window's spread (robust: MAD).

        0.0 with fewer than 3 samples (too few to judge noise), NaN with none.

        >>> w = TimingWindow(settle_steps=0)
        >>> for s in [1.0, 1.1, 0.9, 1.0]: _ = w.add(s)
        >>> round(w.standard_error(), 4)
        0.0465
        """
        n = len(self._samples)
        if n == 0:
            return float("nan")
        if n < 3:
            return 0.0
        x = np.asarray(self._samples)
        sigma = 1.4826 * float(np.median(np.abs(x - np.median(x))))
        factor = 1.2533 if self.method == "median" else 1.0  # efficiency of the median
        return factor * sigma / math.sqrt(n)

    def __len__(self):
        return len(self._samples)


class StepTimer:
    """Wall-clock time of one rank's local work in each step.

    ``start()`` at the beginning of the step's own work, ``mark_wait()`` where the
    rank begins waiting for others (the first call in a step counts, later ones are
    ignored: Horovod's optimizer may enter ``step()`` hooks more than once), and
    ``stop()`` at the end, which returns the local time, or None when the step was not
    started. If ``mark_wait()`` never came (a loop that does not call ``step()``), the
    whole interval counts.

    >>> clock = iter([0.0, 0.3, 0.9]).__next__
    >>> t = StepTimer(clock)
    >>> t.start(); t.mark_wait(); round(t.stop(), 6)
    0.3
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._begin: Optional[float] = None
        self._wait: Optional[float] = None
        self._excluded = 0.0

    def start(self, at: Optional[float] = None):
        self._begin = self._clock() if at is None else at
        self._wait = None
        self._excluded = 0.0

    def exclude(self, seconds: float):
        """Leave ``seconds`` out of the current step's local time: time spent inside
        the step waiting for other ranks (e.g. a small collective before backward).

        >>> clock = iter([0.0, 0.5]).__next__
        >>> t = StepTimer(clock)
        >>> t.start(); t.exclude(0.2); round(t.stop(), 6)
        0.3
        """
        if self._begin is not None and self._wait is None:
            self._excluded += float(seconds)

    def mark_wait(self):
        if self._begin is not None and self._wait is None:
            self._wait = self._clock()

    @property
    def running(self) -> bool:
        return self._begin is not None

    @property
    def marked(self) -> bool:
        """Whether the current step's wait point was already marked."""
        return self._wait is not None

    def stop(self) -> Optional[float]:
        if self._begin is None:
            return None
        end = self._wait if self._wait is not None else self._clock()
        local = end - self._begin - self._excluded
        self._begin = self._wait = None
        self._excluded = 0.0
        return local
