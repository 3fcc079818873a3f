"""Splitting for the last arrival: each rank's step-to-step noise, not only its mean.

A synchronous step ends when the *last* rank arrives at the allreduce, so its time
is ``max_i T_i``, the slowest of the ranks' local times in that step -- and the mean
of a maximum exceeds the maximum of the means whenever the ranks' times vary from
step to step. The controller's split makes the ranks' *mean* local times equal. That
is the fastest split when no rank's time varies, and when all vary alike. When they
differ -- ranks that share a core and time-slice it, ranks under a CPU quota that
stall at the end of each quota period, beside a rank alone on its cores -- the noisy
ranks arrive last more often than their mean says, and a split that gives them a
little less and the steady ranks a little more is faster.

At the best split moving one sample from one rank to another gains nothing: with
``c_i`` a rank's cost of one more sample, ``c_i * P_i`` is the same for every rank,
``P_i`` being how often rank i arrives last. A rank that is three times as fast per
sample as the others (c three times smaller) should arrive last three times as often
as each of them: in half of the steps when it is alone beside three others. Measured
on this project's 2-core machine (one rank alone on a core, three sharing the other;
benchmarks/results/realhet-arrivals-anatomy.md): at equal mean local times the lone
rank arrived last in 2% and 13% of the steps of two epochs, and each step's slowest
arrival came 8% after the slowest rank's mean (43.4 ms against 40.2); the
hand-picked splits that beat that split gave the lone rank more samples (at 154 it
arrived last in 87% of the steps: past the best).

It is off by default (``balance_arrivals=False``): paired with the default in one
launch on that machine, it moved the split as predicted and ran at 1.02 (0.99-1.05)
of it over 16 launches of 3:1:1:1 and 0.99 (0.96-1.07) over 5 under HL8 quotas with
core sets (docs/real-heterogeneity.rst): part of a step lies outside every local
time, and how it changes with the split no replay of local times can see.

The noise is taken from the steps themselves. Every window, each rank sends its
local time of each step (the last :data:`ARRIVAL_STEPS` of the window, aligned by
step: every rank sends the same steps), so every rank holds the same ``(steps,
ranks)`` table. :class:`ArrivalPool` keeps each rank's times relative to its own
mean in that window (the *relative residuals* ``T_si / mean_i - 1``) over the last
few windows. :func:`last_arrival_split` then predicts a candidate split's steps as
``(a_i + c_i b_i) * (1 + r_si)`` -- the controller's time model for the means, the
pooled residuals for the noise, each past step replayed -- and moves samples, from
the rank with the largest marginal cost to the one with the smallest, while the
mean of the replayed slowest arrival falls. With no noise it changes nothing: the
split of equal means is then the one with the least slowest arrival.

Pure numpy, deterministic: element-wise IEEE arithmetic, ``max``/``argmax`` (first
index on ties), numpy's fixed-order sums; the same table gives the same split on
every rank.

>>> import numpy as np
>>> from omnihvd.controller import TimeModel
>>> model = TimeModel(np.zeros(2), np.array([0.01, 0.01]))   # equal ranks, 10 ms/sample
>>> steady_and_noisy = np.array([[0.0, 0.3], [0.0, -0.3]] * 8)
>>> last_arrival_split([50, 50], model, steady_and_noisy, lo=[1, 1], hi=[100, 100])
[56, 44]

The noisy rank's slow steps, 30% over its mean, set the pace: 56 is about 1.3 * 44.

>>> last_arrival_split([50, 50], model, np.zeros((16, 2)), lo=[1, 1], hi=[100, 100])
[50, 50]
"""
from typing import List, Optional

import numpy as np

from .timing import speed_change_start

__all__ = ["ARRIVAL_STEPS", "ARRIVAL_WINDOWS", "MIN_MOVE_GAIN", "MIN_GAIN", "ArrivalPool",
           "relative_residuals", "expected_last_arrival", "last_arrival_split"]

# Steps per window each rank sends (the window's last ones). Fixed: the gathered
# row has the same length on every rank and in every window.
ARRIVAL_STEPS = 32
# Windows of residuals pooled: the noise of some 60-130 steps. Fewer steps give a
# noisy answer (the best split of 20 steps moved by 5% between windows of one run).
ARRIVAL_WINDOWS = 4
# Each move must shorten the replayed mean step by this fraction: ranks of equal
# speed and equal noise would otherwise trade samples on the sampling noise of the
# pooled steps.
MIN_MOVE_GAIN = 0.001
# The split for the last arrival must shorten the replayed step by this fraction, or
# the split of equal means stays: with a few percent of noise the best one lies a
# sample or two away and gains less than the next window's noise. (On this
# project's VM the gains replayed were 1-5%.)
MIN_GAIN = 0.005
# Rounds of the search at most (each moves samples or halves the step; each costs one
# replay of the pooled steps, (steps x ranks)): a bound on a decision's cost on
# thousands of ranks.
MAX_ROUNDS = 256
# Rows of the pool a rank must have a sample in, for its residuals to count (fewer:
# the rank's column is taken as steady).
MIN_SAMPLES = 3


def relative_residuals(arrivals) -> Optional[np.ndarray]:
    """Each rank's local time per step relative to its mean in the window, minus one.

    A rank whose speed changed inside the window (:func:`omnihvd.timing.speed_change_start`)
    is taken relative to the mean of its own part, before or after the change: a
    change is not noise.

    Args:
        arrivals: ``(steps, ranks)`` seconds; entries that are not finite and
            positive are missing.

    Returns:
        ``(steps, ranks)`` float64: ``T_si / mean_i - 1``, 0 where ``T_si`` is missing
        and in the column of a rank with fewer than 3 samples; None when no row has a
        sample.

    >>> relative_residuals([[1.0, 2.0], [3.0, float("nan")], [2.0, 2.0], [2.0, 2.0]]).tolist()
    [[-0.5, 0.0], [0.5, 0.0], [0.0, 0.0], [0.0, 0.0]]
    """
    arr = np.asarray(arrivals, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] == 0:
        return None
    seen = np.isfinite(arr) & (arr > 0)
    rows = seen.any(axis=1)
    if not rows.any():
        return None
    arr, seen = arr[rows], seen[rows]
    x = np.where(seen, arr, 0.0)
    after = np.arange(arr.shape[0])[:, None] >= speed_change_start(np.where(seen, arr, np.nan))
    out = np.zeros_like(x)
    for part in (~after, after):
        inside = seen & part
        n = inside.sum(axis=0)
        mean = np.sum(np.where(inside, x, 0.0), axis=0) / np.maximum(n, 1)
        usable = n >= MIN_SAMPLES
        out = np.where(inside & usable, x / np.where(usable, mean, 1.0) - 1.0, out)
    return out


class ArrivalPool:
    """The relative residuals of the last :data:`ARRIVAL_WINDOWS` windows.

    Same data in, same pool out, on every rank. :meth:`forget` it when a rank changes
    speed (its old noise no longer describes it) or the ranks change.

    >>> pool = ArrivalPool()
    >>> pool.add([[1.0, 1.0], [1.0, 3.0], [1.0, 2.0]])
    >>> pool.residuals().tolist()
    [[0.0, -0.5], [0.0, 0.5], [0.0, 0.0]]
    """

    def __init__(self, windows: int = ARRIVAL_WINDOWS):
        self.windows = int(windows)
        self._rows: List[np.ndarray] = []

    def add(self, arrivals):
        """Add one window's ``(steps, ranks)`` local times (see :func:`relative_residuals`)."""
        rows = relative_residuals(arrivals)
        if rows is not None:
            self._rows = (self._rows + [rows])[-self.windows:]

    def forget(self):
        self._rows = []

    def residuals(self) -> Optional[np.ndarray]:
        """The pooled ``(steps, ranks)`` residuals, None when empty."""
        return np.concatenate(self._rows) if self._rows else None

    def __len__(self):
        return sum(len(r) for r in self._rows)


def expected_last_arrival(sizes, model, residuals) -> float:
    """Mean over the pooled steps of the slowest rank's predicted local time.

    Args:
        sizes: one batch size per rank.
        model: :class:`omnihvd.controller.TimeModel` (``a_i + c_i b``, the means).
        residuals: ``(steps, ranks)`` relative residuals (:func:`relative_residuals`).

    >>> import numpy as np
    >>> from omnihvd.controller import TimeModel
    >>> m = TimeModel(np.zeros(2), np.array([0.01, 0.01]))
    >>> round(expected_last_arrival([50, 50], m, np.array([[0.0, 0.2], [0.0, -0.2]])), 6)
    0.55
    """
    b = np.asarray(sizes, dtype=np.float64)
    times = (model.intercept + model.slope * b) * (1.0 + residuals)
    return float(np.sum(np.max(times, axis=1)) / times.shape[0])


def last_arrival_split(sizes, model, residuals, *, lo, hi, size_multiple: int = 1,
                       min_move_gain: float = MIN_MOVE_GAIN,
                       min_gain: float = MIN_GAIN) -> List[int]:
    """The split near ``sizes`` with the least expected slowest arrival.

    Starting from ``sizes`` (the split of equal means, say), moves ``step`` samples at
    a time from the rank with the largest marginal cost ``c_i * E[(1 + r_i) [i
    arrives last]]`` to the one with the smallest (ties: the one that most rarely
    comes close to arriving last), keeping each move that shortens
    :func:`expected_last_arrival` by ``min_move_gain`` or more; ``step`` starts at a
    sixteenth of the mean size and halves when no move helps, down to
    ``size_multiple``. The total and every bound are kept; sizes stay multiples of
    ``size_multiple`` (plus rank 0's remainder) when they were. The moves are kept
    only when together they shorten the replayed step by ``min_gain``: a few percent
    of noise, or noise alike on every rank, leaves ``sizes`` as they are.

    Args:
        sizes: the starting split (valid within ``lo``/``hi``).
        model: :class:`omnihvd.controller.TimeModel` (the means), slopes > 0.
        residuals: ``(steps, ranks)`` relative residuals, or None (no change).
        lo, hi: per-rank bounds.
        size_multiple: move in multiples of this.
        min_move_gain: the least relative gain a move must bring.
        min_gain: the least relative gain all moves together must bring.

    Returns:
        list of int.
    """
    b = np.asarray(sizes, dtype=np.int64).copy()
    if residuals is None or residuals.shape[0] == 0 or not np.any(residuals):
        return b.tolist()
    lo = np.asarray(lo, dtype=np.int64)
    hi = np.asarray(hi, dtype=np.int64)
    k = int(size_multiple)
    n = b.size
    scale = 1.0 + residuals
    rows = np.arange(scale.shape[0])
    start = best = expected_last_arrival(b, model, residuals)
    first = b.copy()
    step = max(k, (int(b.sum()) // (16 * n)) // k * k)
    for _ in range(MAX_ROUNDS):   # each round moves or halves the step
        if step < k:
            break
        times = (model.intercept + model.slope * b) * scale
        last = np.argmax(times, axis=1)
        slowest = times[rows, last]
        share = np.bincount(last, weights=scale[rows, last], minlength=n)
        marginal = model.slope * share       # d expected_last_arrival / d b_i, times steps
        donors = np.flatnonzero(b - step >= lo)
        takers = np.flatnonzero(b + step <= hi)
        moved = False
        if donors.size and takers.size:
            give = int(donors[np.argmax(marginal[donors])])
            # how much earlier than the slowest each rank's latest step came, in samples
            slack = np.min(slowest[:, None] - times, axis=0) / model.slope
            order = np.lexsort((-slack[takers], marginal[takers]))
            take = int(next((t for t in takers[order] if t != give), give))
            if take != give:
                trial = b.copy()
                trial[give] -= step
                trial[take] += step
                value = expected_last_arrival(trial, model, residuals)
                if value < best * (1.0 - min_move_gain):
                    b, best, moved = trial, value, True
        if not moved:
            step //= 2
            if k > 1:
                step = step // k * k
    return (b if best <= (1.0 - min_gain) * start else first).tolist()
