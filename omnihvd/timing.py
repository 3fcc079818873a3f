"""Local step timing: how long this rank works per step, excluding waiting for others.

In synchronous training every rank leaves the allreduce at the same moment, so the
full step time is the same everywhere and says nothing about who is slow. What
differs is the time up to the point where a rank starts waiting: data loading,
forward and backward. With Horovod that point is the entry to ``optimizer.step()``,
whose ``synchronize()`` blocks until every rank's gradients are reduced (the
allreduces themselves started asynchronously during backward).

Four things make the local time what the rank really costs (docs/timing.rst):

* **Device work.** On a GPU the host returns from ``backward()`` once the kernels are
  queued. :class:`StepTimer` takes an injected ``device_sync`` callable (the model's
  *compute* stream's ``synchronize``, see :mod:`omnihvd.device`) and calls it at the
  wait boundary, so the time ends when the device has finished this rank's work --
  and not later: the communication stream, where the wait for peers happens, is not
  synchronised. This module never imports torch.
* **Data loading.** :class:`TimedIterable` times each ``next()`` of a loader and adds
  it to the step it feeds (:meth:`StepTimer.add`); the step fed by the first
  ``next()`` of an iteration that starts the loader's workers is not timed.
* **CPU quotas.** A rank that idles while it waits for peers refills its CFS quota
  and measures its unthrottled speed at small batches. With ``cpu_cores`` set (the
  quota, :mod:`omnihvd.cpuquota`), a step lasts at least its CPU time over the quota.
* **Bursty CPU.** Under a CFS quota (``docker --cpus``, Kubernetes limits) a rank runs
  at full speed, then stalls until the next quota period. The window summary
  ``"sustained"`` (default) is the mean local time with only the rarest samples
  clipped (:func:`sustained_step_time`): it follows the sustained rate, where a
  median picks the unthrottled steps, and still ignores a rare GC pause.

:class:`TimingWindow` holds the samples between two gathers, dropping steps right
after a size change and garbage (NaN, negative, zero).
"""
import contextlib
import math
import time
import warnings
from typing import Callable, Iterable, List, Optional, Tuple

import numpy as np

from .checks import check_choice, check_int
from .errors import ConfigError

__all__ = ["StepTimer", "TimedIterable", "TimingWindow", "robust_step_time",
           "sustained_step_time", "speed_change_start", "SUMMARIES", "DEFAULT_SUMMARY",
           "RARE_FRACTION", "CHANGE_FRACTION", "CHANGE_SIGNIFICANCE"]

SUMMARIES = ("sustained", "median", "mean")
DEFAULT_SUMMARY = "sustained"
# The median absolute deviation times this estimates a normal standard deviation.
MAD_TO_SD = 1.4826
# Share of a window's slowest samples that "sustained" treats as rare pauses (GC, a
# slow read) and clips. Stalls more frequent than this are the rank's real rate.
RARE_FRACTION = 0.1
# A window whose samples step to a level at least CHANGE_FRACTION away, by at least
# CHANGE_SIGNIFICANCE standard errors, spans a change of speed; only the samples after
# the step (at least MIN_SEGMENT of them) describe the rank now. The fraction is the
# controller's default change_tolerance: smaller shifts, such as the slow drift of a
# rank's phase against its CFS quota period, are left to the window's average.
CHANGE_FRACTION = 0.25
CHANGE_SIGNIFICANCE = 5.0
MIN_SEGMENT = 3


def _check_method(method):
    check_choice("timing summary", method, SUMMARIES)


def _valid(samples) -> np.ndarray:
    arr = np.asarray(samples, dtype=np.float64)
    return np.where(np.isfinite(arr) & (arr > 0), arr, np.nan)


def _clip_rare(valid: np.ndarray, axis: int, out: Optional[np.ndarray] = None
               ) -> Tuple[np.ndarray, np.ndarray]:
    """Winsorise the rare slowest samples along ``axis``: each lane's ``k = ceil(0.1 n)``
    largest valid values are lowered to the next largest (no clipping below 3 samples).
    Returns the clipped array (NaN kept) and each lane's count n. With ``out`` (an
    array of ``valid``'s shape, ``axis`` last), the sorted and then the clipped values
    are written there, and it is returned: no new array of that size."""
    x = np.moveaxis(valid, axis, -1)
    n = np.sum(np.isfinite(x), axis=-1)
    k = np.where(n >= 3, np.ceil(RARE_FRACTION * n).astype(np.int64), 0)
    if out is None:
        ordered = np.sort(x, axis=-1)  # NaN sorts last
    else:
        ordered = out
        ordered[...] = x
        ordered.sort(axis=-1)
    index = np.clip(n - 1 - k, 0, None)[..., None]
    cap = np.take_along_axis(ordered, index, axis=-1)
    # NaN stays NaN (a lane's cap is NaN only if all its values are)
    clipped = np.minimum(x, cap, out=out)
    return np.moveaxis(clipped, -1, axis), n


def sustained_step_time(samples, axis: Optional[int] = None):
    """Mean local step time with rare pauses clipped, and its standard error.

    The mean is the sustained rate (a window's total local time over its steps), so
    a rank that runs at full speed and then stalls, as under a CFS quota, is charged
    for its stalls. Only the slowest ``ceil(10%)`` of the samples (with 3 or more) are
    winsorised to the next slowest value, so a stall that happens once (GC, a slow
    read) moves nothing, while stalls that recur in more than a tenth of the steps
    remain part of the estimate.

    Args:
        samples: seconds, 1-d, or n-d with ``axis`` (e.g. a ``(steps, ranks)``
            array with ``axis=0``); entries that are not finite and positive are
            ignored.
        axis: the axis of steps (None: flatten).

    Returns:
        ``(time, standard_error)``: floats (or arrays over the other axes). The
        error is the winsorised spread over ``sqrt(n)``: 0.0 with fewer than 3
        samples (too few to judge noise); both are NaN with no valid sample.

    >>> t, e = sustained_step_time([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 30.0])
    >>> round(t, 6)                  # one GC pause in ten steps: ignored
    1.0
    >>> t, e = sustained_step_time([2.0, 2.0, 9.0] * 4)   # a stall every third step
    >>> round(t, 6)                  # the sustained rate, where the median says 2.0
    4.333333
    """
    arr = np.asarray(samples, dtype=np.float64)
    if axis is None or arr.ndim == 1:
        return _sustained_1d(arr.ravel().tolist())
    valid = _valid(arr)
    if valid.size == 0:
        return float("nan"), float("nan")
    clipped, n = _clip_rare(valid, axis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN lanes -> NaN
        mean = np.nanmean(clipped, axis=axis)
        spread = np.nanstd(clipped, axis=axis, ddof=1)
        error = np.where(n >= 3, spread / np.sqrt(np.maximum(n, 1)), np.where(n > 0, 0.0, np.nan))
    if np.ndim(mean) == 0:
        return float(mean), float(error)
    return mean, error


def _sustained_1d(values):
    """:func:`sustained_step_time` of one rank's samples, in plain Python: a window
    holds some twenty numbers, where numpy's per-call overhead would dominate."""
    vals = sorted(v for v in values if v > 0 and math.isfinite(v))
    n = len(vals)
    if n == 0:
        return float("nan"), float("nan")
    if n < 3:
        return math.fsum(vals) / n, 0.0
    k = int(math.ceil(RARE_FRACTION * n))
    cap = vals[n - 1 - k]
    vals[n - k:] = [cap] * k
    mean = math.fsum(vals) / n
    spread = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / (n - 1))
    return mean, spread / math.sqrt(n)


def speed_change_start(samples):
    """Index of the first sample after a change of speed inside a window (0: none).

    A rank that slows down or speeds up mid-window (re-pinned, re-quota'd, a noisy
    neighbour arriving) would otherwise report a blend of its old and new speed --
    a point that fits neither, and that misleads the affine fit for rounds. The
    window is split where its two parts differ most (in pooled standard errors,
    after the rare pauses are clipped); the split counts as a change when the parts
    differ by at least ``CHANGE_SIGNIFICANCE`` standard errors and by
    ``CHANGE_FRACTION`` of the lower level, each part holding ``MIN_SEGMENT``
    samples or more. A lone pause or the up-and-down of a CFS quota is not a change:
    it widens the spread, and the test scales with it.

    Args:
        samples: seconds, ``(steps,)`` or ``(steps, lanes)``; entries that are not
            finite and positive are ignored.

    Returns:
        int, or one int per lane: the step index where the current speed begins.

    >>> speed_change_start([0.20, 0.21, 0.19, 0.20, 0.30, 0.31, 0.29, 0.30])
    4
    >>> speed_change_start([0.02, 0.11, 0.02, 0.11, 0.02, 0.11, 0.02, 0.11])  # bursty
    0
    """
    arr = _valid(samples)
    if arr.ndim <= 1:  # one lane (a scalar is a window of one sample)
        return _change_start_1d(arr.ravel().tolist())
    lanes = arr.reshape(arr.shape[0], int(np.prod(arr.shape[1:])))
    start = np.zeros(lanes.shape[1], dtype=np.int64)
    if lanes.shape[0] >= 2 * MIN_SEGMENT:
        clipped, total = _clip_rare(lanes, 0)
        seen = np.isfinite(clipped)
        x = np.where(seen, clipped, 0.0)
        n1, s1, q1 = np.cumsum(seen, axis=0), np.cumsum(x, axis=0), np.cumsum(x * x, axis=0)
        n2, s2, q2 = total - n1, s1[-1] - s1, q1[-1] - q1
        ok = seen & (n1 >= MIN_SEGMENT) & (n2 >= MIN_SEGMENT)   # split after row k
        with np.errstate(divide="ignore", invalid="ignore"):
            m1, m2 = s1 / n1, s2 / n2
            within = np.maximum(q1 - s1 * m1 + q2 - s2 * m2, 0.0) / np.maximum(total - 2, 1)
            shift = np.abs(m2 - m1)
            z = np.where(shift > 0, shift / np.sqrt(within * (1.0 / n1 + 1.0 / n2)), 0.0)
            ok &= shift >= CHANGE_FRACTION * np.minimum(m1, m2)
        z = np.where(ok, z, -1.0)
        best = np.argmax(z, axis=0)
        found = np.take_along_axis(z, best[None], axis=0)[0] >= CHANGE_SIGNIFICANCE
        start = np.where(found, best + 1, 0)
    return start.reshape(arr.shape[1:])


def _change_start_1d(values):
    """:func:`speed_change_start` of one rank's samples, in plain Python (the same
    sums in the same order, so the same answer): as for :func:`_sustained_1d`, a
    window of some twenty numbers is faster without numpy's per-call overhead."""
    x = [v if v > 0 and math.isfinite(v) else None for v in values]   # NaN > 0 is False
    ordered = sorted(v for v in x if v is not None)
    total = len(ordered)
    if len(x) < 2 * MIN_SEGMENT or total < 2 * MIN_SEGMENT:
        return 0
    cap = ordered[total - 1 - int(math.ceil(RARE_FRACTION * total))]
    x = [None if v is None else min(v, cap) for v in x]
    s_all = q_all = 0.0
    for v in x:
        if v is not None:
            s_all += v
            q_all += v * v
    n1, s1, q1 = 0, 0.0, 0.0
    best, best_z = 0, -1.0
    for k, v in enumerate(x):
        if v is None:
            continue
        n1, s1, q1 = n1 + 1, s1 + v, q1 + v * v
        n2 = total - n1
        if n1 < MIN_SEGMENT or n2 < MIN_SEGMENT:
            continue
        s2, q2 = s_all - s1, q_all - q1
        m1, m2 = s1 / n1, s2 / n2
        shift = abs(m2 - m1)
        if shift < CHANGE_FRACTION * min(m1, m2):
            continue
        within = max(q1 - s1 * m1 + q2 - s2 * m2, 0.0) / max(total - 2, 1)
        spread = math.sqrt(within * (1.0 / n1 + 1.0 / n2))
        z = 0.0 if shift == 0 else (shift / spread if spread > 0 else math.inf)
        if z > best_z:
            best, best_z = k, z
    return best + 1 if best_z >= CHANGE_SIGNIFICANCE else 0


def robust_step_time(samples, method: str = DEFAULT_SUMMARY, axis: Optional[int] = None):
    """Summarise step-time samples, ignoring entries that are not finite and positive.

    Args:
        samples: array-like of seconds (1-d, or n-d with ``axis``).
        method: ``"sustained"`` (default; :func:`sustained_step_time`), ``"median"``
            (one outlier in three or more samples cannot move it, nor can a stall in
            every other step) or ``"mean"`` (the reference implementation's raw average).
        axis: reduce along this axis (e.g. ``axis=0`` for a (steps, ranks) array).

    Returns:
        float (or array along the other axes); NaN where no valid sample exists.

    >>> robust_step_time([0.1, 0.1, 10.0, float("nan"), -1.0], "median")
    0.1
    >>> robust_step_time([0.1, 0.3], method="mean")
    0.2
    """
    _check_method(method)
    if method == "sustained":
        return sustained_step_time(samples, axis)[0]
    valid = _valid(samples)
    if valid.size == 0:
        return float("nan")
    reduce = np.nanmedian if method == "median" else np.nanmean
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices -> NaN
        out = reduce(valid, axis=axis)
    return float(out) if np.ndim(out) == 0 else out


def _standard_error(valid: np.ndarray, method: str, axis: int):
    """Standard error of ``method``'s summary along ``axis`` (NaN-aware)."""
    if method == "sustained":
        return sustained_step_time(valid, axis)[1]
    n = np.sum(np.isfinite(valid), axis=axis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        centre = np.nanmedian(valid, axis=axis)
        mad = np.nanmedian(np.abs(valid - np.expand_dims(centre, axis)), axis=axis)
    factor = 1.2533 if method == "median" else 1.0  # efficiency of the median
    error = factor * MAD_TO_SD * mad / np.sqrt(np.maximum(n, 1))
    return np.where(n >= 3, error, np.where(n > 0, 0.0, np.nan))


class TimingWindow:
    """Per-step samples since the last reset, with settle steps dropped.

    One window per rank (scalar samples), or one for many simulated ranks at once
    (each sample a vector with one entry per rank; invalid entries count as
    missing for that rank only).

    The robust summaries (``"sustained"``, ``"median"``) describe the rank's speed at
    the end of the window: samples before a change of speed inside it are left out
    (:func:`speed_change_start`). ``"mean"``, the reference implementation's rule,
    averages them all.

    Args:
        settle_steps: samples to discard after each :meth:`reset` (the first steps
            at a new batch size pay for allocator growth, autotuning, cache misses).
        method: summary, see :func:`robust_step_time`.

    >>> w = TimingWindow(settle_steps=1, method="median")
    >>> for s in [5.0, 0.2, 0.21, 20.0, 0.19]: _ = w.add(s)
    >>> len(w), round(w.summary(), 6)
    (4, 0.205)
    """

    def __init__(self, settle_steps: int = 1, method: str = DEFAULT_SUMMARY):
        self.settle_steps = check_int("settle_steps", settle_steps, 0)
        _check_method(method)
        self.method = method
        self._samples: List = []
        self._skip = settle_steps
        self._current: Optional[np.ndarray] = None   # _array(), until the next add

    def reset(self, settle: bool = True):
        """Start a new window (call when the batch size changes)."""
        self._samples = []
        self._current = None
        self._skip = self.settle_steps if settle else 0

    def add(self, seconds) -> bool:
        """Offer one step's local time (a number, or a vector of one per lane);
        returns whether anything was kept."""
        if self._skip > 0:
            self._skip -= 1
            return False
        self._current = None
        if np.ndim(seconds) > 0:
            row = _valid(seconds)
            self._samples.append(row)
            return bool(np.isfinite(row).any())
        try:
            seconds = float(seconds)
        except (TypeError, ValueError):
            return False
        if not math.isfinite(seconds) or seconds <= 0:
            return False
        self._samples.append(seconds)
        return True

    def _array(self) -> np.ndarray:
        """The samples that describe the rank's current speed (NaN: left out); the
        change scan runs once per window content, however many summaries are read."""
        if self._current is None:
            self._current = self._after_change()
        return self._current

    def _after_change(self) -> np.ndarray:
        arr = np.asarray(self._samples, dtype=np.float64)
        if self.method == "mean" or len(arr) < 2 * MIN_SEGMENT:
            return arr
        if arr.ndim == 1:
            return arr[_change_start_1d(self._samples):]
        start = speed_change_start(arr)
        before = np.arange(len(arr)).reshape((-1,) + (1,) * (arr.ndim - 1)) < start
        return np.where(before, np.nan, arr)

    def summary(self):
        """The robust step time of the window; NaN when it holds no sample."""
        if not self._samples:
            return float("nan")
        return robust_step_time(self._array(), self.method, axis=0)

    def standard_error(self):
        """Standard error of :meth:`summary` from the window's spread.

        ``"sustained"``: the winsorised standard deviation over sqrt(n);
        ``"median"``/``"mean"``: the robust (MAD) spread. 0.0 with fewer than 3
        samples (too few to judge noise), NaN with none.

        >>> w = TimingWindow(settle_steps=0, method="median")
        >>> for s in [1.0, 1.1, 0.9, 1.0]: _ = w.add(s)
        >>> round(w.standard_error(), 4)
        0.0465
        """
        if not self._samples:
            return float("nan")
        out = _standard_error(_valid(self._array()), self.method, 0)
        return float(out) if np.ndim(out) == 0 else out

    def measure(self):
        """``(summary, standard_error, counts)`` in one pass (what a rank gathers)."""
        if not self._samples:
            return float("nan"), float("nan"), 0
        arr = self._array()
        counts = self._counts(arr)
        if self.method == "sustained":
            return sustained_step_time(arr, axis=0) + (counts,)
        error = _standard_error(_valid(arr), self.method, 0)
        return (robust_step_time(arr, self.method, axis=0),
                float(error) if np.ndim(error) == 0 else error, counts)

    def counts(self):
        """Valid samples the summary uses: an int, or one per lane for vector samples."""
        return self._counts(self._array()) if self._samples else 0

    def _counts(self, arr):
        if arr.ndim == 1:
            return int(np.sum(np.isfinite(arr)))
        return np.sum(np.isfinite(arr), axis=0)

    def __len__(self):
        return len(self._samples)


class StepTimer:
    """Time of one rank's local work in each step: device work and CPU quota included.

    ``start()`` at the beginning of the step's own work, ``mark_wait()`` where the
    rank begins waiting for others (the first call in a step counts, later ones are
    ignored: Horovod's optimizer may enter ``step()`` hooks more than once), and
    ``stop()`` at the end, which returns the local time, or None when the step was not
    started. If ``mark_wait()`` never came (a loop that does not call ``step()``), the
    whole interval counts. :meth:`add` charges work done before ``start()`` (the
    loader's ``next()``) to the step that follows.

    Args:
        clock: wall seconds, monotonic (default ``time.perf_counter``).
        device_sync: None (CPU), or a callable that returns once the device has run
            everything this rank queued on its compute stream (see
            :func:`omnihvd.device.device_synchronizer`). ``mark_wait`` calls it, so
            the local time is the larger of host time and device time.
        cpu_cores: None, or the CPU cores the process may use under a CFS quota
            (:func:`omnihvd.cpuquota.cpu_quota_cores`; settable at any time). The step
            then lasts at least its CPU time over ``cpu_cores``: what it costs when
            the rank works without idle pauses to refill its quota, as at balance.
        cpu_clock: the process's CPU seconds (default ``time.process_time``), read
            only while ``cpu_cores`` is set.

    >>> clock = iter([0.0, 0.3, 0.9]).__next__
    >>> t = StepTimer(clock)
    >>> t.start(); t.mark_wait(); round(t.stop(), 6)
    0.3
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 device_sync: Optional[Callable[[], None]] = None,
                 cpu_cores: Optional[float] = None,
                 cpu_clock: Callable[[], float] = time.process_time):
        if device_sync is not None and not callable(device_sync):
            raise ConfigError("device_sync must be None or a callable, got %r" % (device_sync,))
        self._clock = clock
        self._cpu_clock = cpu_clock
        self.device_sync = device_sync
        self.cpu_cores = cpu_cores
        self._begin: Optional[float] = None
        self._wait: Optional[float] = None
        self._cpu: Optional[float] = None   # CPU clock at start, then CPU seconds at the mark
        self._cpu_marked = False
        self._extra = 0.0      # work before start() charged to this step (data loading)
        self._excluded = 0.0   # waiting inside the step, left out
        self._excluded_cpu = 0.0   # the CPU seconds that waiting burned, left out too
        self._paused: Optional[Tuple[float, Optional[float]]] = None   # (wall, CPU) at pause()
        self.host_seconds: Optional[float] = None  # the last step's host-side time

    def add(self, seconds: float):
        """Charge ``seconds`` of this rank's work done outside a step's window (the
        loader's ``next()`` before the step starts, the optimizer's update after its
        wait) to the step it feeds: the running one, else the next.

        Work while the running step's window is open (a batch fetched after
        ``start()``) is in its wall time already and is not added again. NaN stands
        for work of unknown cost (a loader's first ``next()``, which starts its
        workers): the step it feeds then has no local time (NaN).

        >>> clock = iter([0.0, 0.5, 1.0, 1.2]).__next__
        >>> t = StepTimer(clock)
        >>> t.add(0.25); t.start(); t.add(0.1); t.mark_wait(); round(t.stop(), 6)
        0.75
        >>> t.add(float("nan")); t.start(); t.mark_wait(); t.stop()
        nan
        """
        if seconds == seconds and self._begin is not None and self._wait is None:
            return   # inside the open window: counted by its wall time
        self._extra += seconds

    def discard_extra(self):
        """Forget work charged by :meth:`add` that no step has taken yet."""
        self._extra = 0.0

    def exclude(self, seconds: float, cpu_seconds: float = 0.0):
        """Leave ``seconds`` out of the current step's local time: time spent inside
        the step waiting for other ranks (e.g. a small collective before backward),
        and ``cpu_seconds`` out of its CPU time (what the wait burned: MPI polls).

        >>> clock = iter([0.0, 0.5]).__next__
        >>> t = StepTimer(clock)
        >>> t.start(); t.exclude(0.2); round(t.stop(), 6)
        0.3
        """
        if self._begin is not None and self._wait is None:
            self._excluded += float(seconds)
            self._excluded_cpu += float(cpu_seconds)

    @contextlib.contextmanager
    def excluding(self):
        """Leave what runs inside the ``with`` block out of the current step's local
        time (:meth:`exclude`): its wall time, and its CPU time, which would
        otherwise come back through the CPU-quota floor (``cpu_cores``).

        >>> clock, cpu = iter([0.0, 0.1, 0.4, 0.5]).__next__, iter([0.0, 0.1, 0.4, 0.5]).__next__
        >>> t = StepTimer(clock, cpu_cores=0.5, cpu_clock=cpu)
        >>> t.start()
        >>> with t.excluding():
        ...     pass                    # 0.3 s of waiting, busy-polling the CPU
        >>> t.mark_wait(); round(t.stop(), 6)   # 0.2 s of work, 0.2 CPU s over 0.5 cores
        0.4
        """
        wall = self._clock()
        cpu = self._cpu_clock() if self._cpu is not None else None
        try:
            yield
        finally:
            self.exclude(self._clock() - wall, 0.0 if cpu is None else self._cpu_clock() - cpu)

    def pause(self):
        """The rank's own work in the running step stops here until :meth:`resume`
        (or the wait boundary): the time between, and its CPU time, is left out
        (:meth:`exclude`). With ``device_sync`` the device first runs what was
        queued, so its work stays in. Later calls before ``resume()`` do nothing.

        omnihvd pauses when the model's forward or backward pass ends and resumes
        when the next one begins (:mod:`omnihvd.segments`): what the loop does
        between -- a metric's allreduce waiting for the slowest rank -- is no work.

        >>> clock = iter([0.0, 0.2, 0.7, 0.8]).__next__
        >>> t = StepTimer(clock)
        >>> t.start(); t.pause(); t.resume(); t.mark_wait(); round(t.stop(), 6)
        0.3
        """
        if self._paused is None and self._begin is not None and self._wait is None:
            if self.device_sync is not None:
                self.device_sync()
            self._paused = (self._clock(), self._cpu_clock() if self._cpu is not None else None)

    def resume(self):
        """The rank's own work begins again (see :meth:`pause`)."""
        if self._paused is not None:
            wall, cpu = self._paused
            self._paused = None
            self.exclude(self._clock() - wall, 0.0 if cpu is None else self._cpu_clock() - cpu)

    @contextlib.contextmanager
    def working(self):
        """Count what runs inside the ``with`` block as this rank's work, also where
        the timer is paused between the model's passes: work the model's hooks do
        not see, such as an emulated slower device's sleep.

        >>> clock = iter([0.0, 0.1, 0.2, 0.5, 0.6, 0.6]).__next__
        >>> t = StepTimer(clock)
        >>> t.start(); t.pause()
        >>> with t.working():
        ...     pass                    # 0.3 s of emulated work
        >>> t.mark_wait(); round(t.stop(), 6)
        0.4
        """
        paused = self.paused
        self.resume()
        try:
            yield
        finally:
            if paused:
                self.pause()

    def start(self, at: Optional[float] = None):
        self._begin = self._clock() if at is None else at
        self._wait = None
        self._paused = None
        self._excluded = self._excluded_cpu = 0.0
        self.host_seconds = None
        self._cpu = self._cpu_clock() if self.cpu_cores else None
        self._cpu_marked = False

    def mark_wait(self):
        if self._begin is not None and self._wait is None:
            self.resume()   # a pause up to here (the loop's own collectives) is no work
            now = self._clock()
            if self._cpu is not None:  # before the device sync, which may spin
                self._cpu, self._cpu_marked = self._cpu_clock() - self._cpu, True
            self.host_seconds = now - self._begin
            if self.device_sync is not None:
                self.device_sync()  # the compute stream only: not the wait for peers
                now = self._clock()
            self._wait = now

    @property
    def paused(self) -> bool:
        """Whether the running step is between :meth:`pause` and :meth:`resume`."""
        return self._paused is not None

    @property
    def running(self) -> bool:
        return self._begin is not None

    @property
    def wait_began(self) -> Optional[float]:
        """The clock's reading where the running step began to wait for the others
        (after the device sync), None before :meth:`mark_wait`."""
        return self._wait

    @property
    def marked(self) -> bool:
        """Whether the current step's wait point was already marked."""
        return self._wait is not None

    def local(self) -> Optional[float]:
        """The running step's local time so far: up to the mark once marked."""
        if self._begin is None:
            return None
        end = self._wait if self._wait is not None else self._clock()
        paused = end - self._paused[0] if self._paused is not None else 0.0
        seconds = end - self._begin - self._excluded - paused
        if self._cpu is not None and self.cpu_cores:
            cpu = self._cpu if self._cpu_marked else self._cpu_clock() - self._cpu
            seconds = max(seconds, (cpu - self._excluded_cpu) / self.cpu_cores)
        return seconds + self._extra

    def stop(self) -> Optional[float]:
        local = self.local()
        if local is not None:
            self._begin = self._wait = self._cpu = self._paused = None
            self._extra = self._excluded = self._excluded_cpu = 0.0
        return local


class TimedIterable:
    """An iterable (a DataLoader) whose every ``next()`` is charged to ``charge``.

    The first ``next()`` of each iteration of a loader with worker processes
    (``num_workers > 0``) is charged as NaN, so that the step it feeds is not timed:
    it waits for the workers to start (or, persistent, to refill their prefetch
    queues), a one-off cost per epoch rather than a per-step rate. Without workers
    it is an ordinary batch and charged as such. Time between steps that is not a
    ``next()`` (evaluation, checkpoints, logging on rank 0) is never charged.

    Args:
        iterable: what to iterate (``len()`` is passed through).
        charge: called with the seconds each ``next()`` took (NaN: unknown).
        restart: called when a new iteration begins (drops charges of an iteration
            left early, e.g. by ``break``).
        seen: called with each item before it is yielded (the callback checks its
            length at the next ``on_batch_begin``).
        clock: seconds (default ``time.perf_counter``).
        ended: called when an iteration reaches the end of ``iterable``.

    >>> seen = []
    >>> clock = iter([0.0, 1.0, 1.0, 1.5, 2.0, 2.25, 3.0]).__next__
    >>> data = TimedIterable([10, 20, 30], seen.append, clock=clock)
    >>> list(data), seen
    ([10, 20, 30], [1.0, 0.5, 0.25])
    """

    def __init__(self, iterable: Iterable, charge: Callable[[float], None],
                 restart: Optional[Callable[[], None]] = None,
                 seen: Optional[Callable[[object], None]] = None,
                 clock: Callable[[], float] = time.perf_counter,
                 ended: Optional[Callable[[], None]] = None):
        self.iterable = iterable
        self._charge = charge
        self._restart = restart
        self._seen = seen
        self._ended = ended
        self._clock = clock

    def __len__(self):
        return len(self.iterable)

    def __getattr__(self, name):  # sampler, dataset, batch_size ... of the loader
        if name == "iterable":
            raise AttributeError(name)
        return getattr(self.iterable, name)

    def __iter__(self):
        if self._restart is not None:
            self._restart()
        it = iter(self.iterable)
        # a loader's workers start (or refill) during its first next()
        starting = (getattr(self.iterable, "num_workers", 0) or 0) > 0
        while True:
            begin = self._clock()
            try:
                item = next(it)
            except StopIteration:
                if self._ended is not None:
                    self._ended()
                return
            elapsed = self._clock() - begin
            self._charge(float("nan") if starting else elapsed)
            starting = False
            if self._seen is not None:
                self._seen(item)
            yield item
