"""Tuning the split by the measured step time itself (``tune_split=True``).

The controller balances *local* times: at its split every rank's own work takes
equally long. That is the fastest split when what a rank costs the job is its
local time. On shared cores it is not quite: ranks that share a core also share
the work around the allreduce (Horovod's background thread, MPI's progress, the
reductions), which lies outside every rank's local time, so the co-located ranks
cost the job more than they measure. On this project's 2-core test machine
(one rank alone on a core, three sharing the other) a hand-picked split with more
samples on the lone rank was about 8% faster than the split of equal local times
(benchmarks/results/realhet-steady.md).

A :class:`TiltSearch` finds that correction from the quantity that matters, the
step period every rank sees (one step's wall time, waiting included). The
controller's split is *tilted* by one number: at tilt ``alpha`` the controller
equalises ``t_i * w_i`` (:func:`tilt_weights`), which scales each rank's share of
equal local times by ``1 + alpha`` times its throughput's distance from the mean
(relative to the farthest rank's), before the split is scaled back to B. Tilt 0 is the
plain controller; a positive tilt gives the fast ranks more, a negative one less.

While the controller holds its split, the search times windows at ``alpha + s``
and ``alpha - s`` in the order + - - + between two windows at ``alpha`` (the one
that found the controller calm, and one after), so that a slow drift of the
machine cancels. It moves ``alpha`` by ``s`` towards the better side when that
side's period is shorter than the centre's by more than ``significance`` standard
errors (from the windows' own spread, or from how far apart the two centre windows
of recent searches fell, whichever is larger); otherwise it holds (at the best split, both sides are slower: the step time
is the slowest rank's, a V around the best split) and, once it holds at the finest
distance, probes again after twice as many calm windows as before, so a split at
its best is probed ever more rarely.
Every decision follows from the gathered periods alone, so every rank reaches the
same tilt.

The probe distance ``s`` goes coarse to fine: the first search probes at
``max_step``, where a period difference stands out of the noise of a shared
machine; a hold or a reversal halves ``s`` (down to ``step``), and a second move
the same way doubles it (up to ``max_step``). A tilt far from 0 is then reached in
a few searches rather than one ``step`` per search: under HL8's CPU quotas the
best fixed split lay near tilt 0.8, eight searches of 0.1 (benchmarks/RESULTS.md).

Pure Python and numpy: no torch, horovod or mpi4py.

>>> search = TiltSearch(step=0.2, max_step=0.2, pairs=1)
>>> search.after_decision(False, period=1.0, error=0.01)  # calm at tilt 0: probe +
0.2
>>> search.measured(period=0.90, error=0.01)  # at tilt +0.2: faster; next probe -
-0.2
>>> search.measured(period=1.05, error=0.01)  # at tilt -0.2: slower; the centre again
0.0
>>> search.measured(period=1.00, error=0.01)  # search over: + beat the centre, move
>>> search.tilt
0.2
"""
import math
from typing import List, Optional, Tuple

import numpy as np

from .checks import check_int, check_number
from .errors import ConfigError

__all__ = ["TiltSearch", "tilt_weights"]

MIN_SHARE_FACTOR = 0.05   # the least a negative tilt multiplies a rank's share by
DRIFT_SEARCHES = 8        # searches whose centre windows estimate the noise between windows


def tilt_weights(batch_sizes, times, tilt: float) -> np.ndarray:
    """The factors ``1 / (1 + tilt * d_i / max_j |d_j|)`` the controller multiplies
    local times by, with ``d_i = x_i / mean(x) - 1``.

    ``x_i = b_i / t_i`` is rank i's throughput, so ``d_i`` is how far it lies from
    the mean. Balancing ``t_i * w_i`` instead of ``t_i`` scales each rank's share
    of equal local times by ``1 + tilt * d_i / max_j |d_j|`` before the split is
    scaled back to B: by ``1 + tilt`` for the rank farthest above the mean (more
    for a fast rank with a positive tilt), the others in proportion to their
    distance. The
    denominator is kept at least 0.05. Only ``+ - * /``, ``abs``, ``max`` and
    numpy's fixed-order sum: every rank computes the same bits on any processor
    (no ``exp`` or ``log``, whose last bit may differ between CPUs). At tilt 0, or
    with equal throughputs, every weight is exactly 1.

    >>> tilt_weights([30, 30], [1.0, 0.5], 0.0).tolist()
    [1.0, 1.0]
    >>> tilt_weights([30, 30], [1.0, 0.5], 0.5).round(3).tolist()
    [2.0, 0.667]
    """
    b = np.asarray(batch_sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    x = b / t
    deviation = x / (x.sum() / x.size) - 1.0
    scale = float(np.abs(deviation).max())
    if tilt == 0.0 or scale == 0.0:
        return np.ones_like(t)
    return 1.0 / np.maximum(1.0 + tilt * (deviation / scale), MIN_SHARE_FACTOR)


def _usable(period: float) -> bool:
    return math.isfinite(period) and period > 0


def _relative(error: float, period: float) -> float:
    return error / period if math.isfinite(error) and error >= 0 else 0.0


def _mean_of(seen, sign) -> Tuple[float, float]:
    """Mean log period of the windows at ``sign`` and its standard error."""
    rows = [(log_period, e) for s, log_period, e in seen if s == sign]
    return (float(np.mean([lp for lp, _ in rows])),
            math.sqrt(sum(e * e for _, e in rows)) / len(rows))


class TiltSearch:
    """Finds the tilt of the controller's split with the shortest measured period.

    Args:
        step: the finest probe distance and move of the tilt (default 0.1: the share
            of the rank farthest from the mean speed moves by about 10%).
        max_step: the coarsest, where the search starts (default 0.4); equal to
            ``step`` for a fixed distance.
        pairs: pairs of probe windows per search (default 2: + - - +, then the
            centre again).
        significance: standard errors by which the probes' mean log periods must
            differ to move (default 1.5).
        max_tilt: the tilt stays within ``[-max_tilt, max_tilt]`` (default 1).
        max_wait: at most this many calm windows between two searches (default 32).

    The owner (:class:`omnihvd.cadence.Cadence`) calls :meth:`after_decision` after
    each controller decision at the current tilt, runs a window at each tilt it
    returns, and hands each such window's period to :meth:`measured`.

    Raises:
        ConfigError: malformed options.
    """

    def __init__(self, step: float = 0.1, pairs: int = 2, significance: float = 1.5,
                 max_tilt: float = 1.0, max_wait: int = 32, max_step: float = 0.4):
        self.step = check_number("step", step)
        self.max_step = check_number("max_step", max_step)
        self.significance = check_number("significance", significance)
        self.max_tilt = check_number("max_tilt", max_tilt)
        if not 0 < self.step <= self.max_step <= self.max_tilt:
            raise ConfigError("need 0 < step <= max_step <= max_tilt, got step %r, max_step %r, "
                              "max_tilt %r" % (step, max_step, max_tilt))
        self.pairs = check_int("pairs", pairs, 1)
        self.max_wait = check_int("max_wait", max_wait, 1)
        self.tilt = 0.0
        self.searches = 0       # finished searches (moves and holds)
        self.distance = self.max_step   # how far the next search probes and moves
        self._last_move = 0     # the sign of the last search's move; 0 after a hold
        self._wait = 1          # calm windows needed before the next search
        self._calm = 0
        self._plan: List[int] = []                   # signs of the probes still to run
        self._seen: List[Tuple[int, float, float]] = []  # (sign, log period, rel. error)
        self._apart: List[float] = []   # |log difference| of each search's two centre windows

    @property
    def probing(self) -> bool:
        """Whether a search is under way (the next window is a probe's)."""
        return bool(self._plan)

    def after_decision(self, changed: bool, period: float = float("nan"),
                       error: float = float("nan")) -> Optional[float]:
        """After a controller decision at the current tilt, from a window at the
        current split with this ``period`` (and standard error): the first probe's
        tilt when a search starts now, else None.

        A change of sizes means the controller is still moving (or the hardware
        changed): the search waits until it holds again.
        """
        if self._plan:
            raise RuntimeError("after_decision during a search: report the probe first")
        if changed or not _usable(period):
            self._calm = 0
            return None
        self._calm += 1
        if self._calm < self._wait:
            return None
        self._seen = [(0, math.log(period), _relative(error, period))]
        self._plan = [s for k in range(self.pairs) for s in ((1, -1) if k % 2 == 0 else (-1, 1))]
        self._plan.append(0)   # the centre again: the search is timed from both ends
        return self._probe_tilt()

    def measured(self, period: float, error: float) -> Optional[float]:
        """The period (and its standard error) of the search's window just run; the
        next window's tilt, or None when the search is over (:attr:`tilt` updated).

        A window without a usable period (not finite, or not > 0) abandons the
        search: the tilt stays.
        """
        if not self._plan:
            raise RuntimeError("measured without a search under way")
        if not _usable(period):
            self._end(soon=False)
            return None
        self._seen.append((self._plan.pop(0), math.log(period), _relative(error, period)))
        if self._plan:
            return self._probe_tilt()
        centre = _mean_of(self._seen, 0)
        sides = {sign: _mean_of(self._seen, sign) for sign in (1, -1)}
        best = min(sides, key=lambda sign: sides[sign][0])
        gain = centre[0] - sides[best][0]   # how much shorter the better side's period is
        moved = gain > self.significance * max(math.hypot(centre[1], sides[best][1]),
                                               self._between_windows())
        if moved:
            self.tilt = float(np.clip(self.tilt + best * self.distance, -self.max_tilt,
                                      self.max_tilt))
        finest = self.distance == self.step
        self._refine(best if moved else 0)
        self._end(soon=moved or not finest)   # a coarse hold refines at once
        return None

    def _refine(self, move: int):
        """The next search's distance after a search that moved by ``move`` (a sign,
        0 for a hold): twice as far after a second move the same way, half as far
        after a hold or a reversal, within ``[step, max_step]``."""
        if move != 0 and move == self._last_move:
            self.distance = min(2.0 * self.distance, self.max_step)
        elif move == 0 or move == -self._last_move:
            self.distance = max(0.5 * self.distance, self.step)
        self._last_move = move

    def _between_windows(self) -> float:
        """The standard error of the centre-minus-side difference from how much one
        window's period moves against the next on this machine, which a window's own
        spread does not show (the load of shared cores drifts over seconds): read off
        how far the two centre windows of each search fell apart (the last
        :data:`DRIFT_SEARCHES` searches, this one included)."""
        centre = [log_period for sign, log_period, _ in self._seen if sign == 0]
        self._apart = (self._apart + [abs(centre[-1] - centre[0])])[-DRIFT_SEARCHES:]
        # median |difference of two windows| = 0.6745 * sqrt(2) * one window's deviation
        one_window = float(np.median(self._apart)) / (0.6745 * math.sqrt(2.0))
        return one_window * math.sqrt(1.0 / 2 + 1.0 / self.pairs)   # 2 centre, `pairs` side

    def abandon(self):
        """Drop a search under way (the controller moved, the world changed)."""
        self._plan, self._seen, self._calm = [], [], 0

    def _probe_tilt(self) -> float:
        return float(np.clip(self.tilt + self._plan[0] * self.distance, -self.max_tilt,
                             self.max_tilt))

    def _end(self, soon: bool):
        self.searches += 1
        # After a move or a coarse hold, search again soon; after a hold at the
        # finest distance, wait twice as long.
        self._wait = 1 if soon else min(2 * self._wait, self.max_wait)
        self.abandon()

    def state_dict(self):
        return {"tilt": self.tilt, "wait": self._wait, "distance": self.distance}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict`'s tilt, wait and probe distance (a search under
        way starts again, and the noise between windows is learnt again). A state
        without a distance (saved before there was one) resumes at ``step``: its
        tilt was found by searches at that distance."""
        try:
            tilt, wait = float(state["tilt"]), int(state["wait"])
            distance = float(state.get("distance", self.step))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError("tuning state must hold a tilt and a wait, got %r" % (state,)) \
                from exc
        if not (math.isfinite(tilt) and abs(tilt) <= self.max_tilt) or wait < 1 \
                or not math.isfinite(distance):
            raise ConfigError("tuning state out of range: %r" % (state,))
        self.tilt, self._wait = tilt, min(wait, self.max_wait)
        self.distance = min(max(distance, self.step), self.max_step)
        self._last_move = 0
        self.abandon()
