"""Arrival lead: how long after the others the rank with the most samples should arrive.

A synchronous step waits for its last arrival at the gradients' allreduce. The
controller balances the ranks' local times plus release lags: their arrivals *on
average*. Where the others' times vary from step to step (ranks sharing a core,
ranks under CPU quotas) the rank with the most samples, ``L``, then arrives last
less often than it should: on this project's 2-core machine (per-step timestamps
of every rank, docs/real-heterogeneity.rst "Arrival lead") it arrived last in 0-26%
of the steps with one rank alone on a core beside three sharing the other (holding
57% of the batch), and in 10-67% under HL8 quotas with core sets (holding 77-84%).

Making ``L`` arrive later by ``dg`` on average -- giving it more samples and the
others fewer -- moves its arrival by ``(1 - w_L) dg`` and theirs by ``-w_L dg``,
``w_L`` being its share of the global batch. So the mean slowest arrival changes by
``D = P_L - w_L`` per unit of lead, ``P_L`` being the fraction of steps in which
``L`` arrives last: the split is fastest where ``L`` arrives last in ``w_L`` of the
steps (``P_L = w_L``), not where its mean equals the others'.

With ``arrival_lead=True`` (the default) the controller charges ``L`` a negative time, its *lead*
``g``: balancing then lets it arrive ``g`` after the others on average. Every window
gathers each rank's arrival moment per step (when it began to wait for the others,
on the machine's monotonic clock, :mod:`omnihvd.lags`). ``P_L`` is counted over the
steps of the last :data:`LEAD_WINDOWS` windows that held the ranks together (with
``release_lag=True``, the default, which gathers the releases: see
:func:`arrival_offsets`), each step's lead shifted by as much
as the lead has moved since it ran. While ``D`` is below -:data:`SIGNIFICANCE`
standard errors the lead grows by :data:`LEAD_STEP` of ``L``'s local time, while
above, shrinks, between 0 and :data:`MAX_LEAD` of the local time; a move against
the previous one halves the step (down to :data:`MIN_LEAD_STEP`), the
:data:`RUN_TO_GROW`-th move in a row one way doubles it back, so that the lead
settles where ``P_L`` crosses ``w_L`` rather than swinging about it. Ranks that arrive last as often as their shares -- steady ranks,
ranks alike -- leave the lead where it is; no rank is led unless it holds
:data:`DOMINANCE` times the samples of every other (among ranks of about equal
shares the choice would be chance: under sleep-emulated equal speeds a lead passed
from rank to rank cost 2-5% against plain Horovod), and the search restarts when the
controller sees a rank change speed. Ranks on several machines are left alone (their
clocks are not one clock).

Pure numpy, deterministic: the same tables give the same lead on every rank.

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> arrived = 100.0 + rng.normal(0.0, 0.004, (20, 2)) + [0.0, -0.01]   # rank 1 ~10 ms early
>>> offsets = arrival_offsets(arrived, hosts=[1.0, 1.0])
>>> search = ArrivalLead()
>>> search.observe(offsets, sizes=[20, 80], times=[0.05, 0.05])
>>> round(search.lead, 4), search.charges(2).round(4).tolist()   # P_L = 0.05 < w_L = 0.8
(0.0025, [0.0, -0.0025])
"""
from typing import Optional

import numpy as np

__all__ = ["LEAD_WINDOWS", "LEAD_STEP", "MIN_LEAD_STEP", "DOMINANCE", "MAX_LEAD", "SIGNIFICANCE",
           "HELD_SLACK", "arrival_offsets", "lead_of", "ArrivalLead"]

# Windows of steps pooled (one window sends up to 32).
LEAD_WINDOWS = 4
# The largest move of the lead, as a fraction of L's local time; a move against the
# previous one halves it (down to MIN_LEAD_STEP), the RUN_TO_GROW-th move in a row
# one way doubles it back.
LEAD_STEP = 0.05
MIN_LEAD_STEP = LEAD_STEP / 16
RUN_TO_GROW = 3
# L is led only while it holds this many times the samples of any other rank: among
# ranks of about equal shares which one is "L" is chance, and a lead would only
# move samples between ranks of equal speed.
DOMINANCE = 1.5
# The lead's bound, as a fraction of L's local time. It is never negative: the lead
# lets L arrive after the others' mean because their spread makes their last arrival
# later than that mean. Where L is last more often than its share at balanced
# means, the others' arrivals come in lumps (CPU-quota periods: a few more samples
# change nothing until a rank misses its period, then cost a whole one), P_L - w_L
# is no derivative there: negative leads, found only under CPU quotas of 100/60/30%,
# ran at 0.984 of no lead there (4 launches; docs/real-heterogeneity.rst).
MAX_LEAD = 0.5
# Standard errors by which D = P_L - w_L must clear 0 for the lead to move.
SIGNIFICANCE = 3.0
# Two arrivals of one step this far apart (seconds) mean the clocks compared are not
# one clock: that step is left out.
MAX_SPREAD = 1.0
# A step in which a rank's synchronize returned more than this (seconds) before
# another rank arrived did not hold the ranks together: that step is left out.
HELD_SLACK = 0.002


def arrival_offsets(arrived, hosts, released=None) -> Optional[np.ndarray]:
    """Each rank's arrival relative to the step's last one (<= 0).

    Only steps that held the ranks together say who holds the others up. Where the
    allreduce completes before a rank arrives -- its gradients were all sent before
    work that comes after the backward pass, as under sleep emulation, which sleeps
    there -- the ranks do not wait for one another in that step, and the order of
    their arrivals sets nothing.

    Args:
        arrived: ``(steps, ranks)`` moments each rank began to wait for the others,
            seconds on its machine's monotonic clock (NaN: none).
        hosts: one :func:`omnihvd.lags.host_key` per rank.
        released: the same steps' moments each rank's synchronize returned (NaN:
            none; None: not known): a step in which one was more than
            :data:`HELD_SLACK` before another rank's arrival is left out.

    Returns:
        ``(steps, ranks)``, for the steps every rank has a moment of (and whose
        arrivals lie within :data:`MAX_SPREAD`); None when the ranks are on several
        machines or the table does not match them.

    >>> arrival_offsets([[1.0, 1.012, 1.004], [2.0, float("nan"), 2.0]], hosts=[3.0] * 3).round(3)
    array([[-0.012,  0.   , -0.008]])
    >>> arrival_offsets([[1.0, 1.012], [2.0, 2.012]], [3.0] * 2,
    ...                 released=[[1.013, 1.013], [2.001, 2.013]]).round(3)   # step 2: not held
    array([[-0.012,  0.   ]])
    """
    a = np.asarray(arrived, dtype=np.float64)
    h = np.asarray(hosts, dtype=np.float64)
    if a.ndim != 2 or a.shape[1] != h.size or h.size == 0 or not (
            np.all(h == h[0]) or np.all(np.isnan(h))):   # not one machine
        return None
    keep = np.isfinite(a).all(axis=1)
    if released is not None and np.shape(released) == a.shape:
        r = np.asarray(released, dtype=np.float64)
        first = np.where(np.isfinite(r), r, np.inf).min(axis=1)
        with np.errstate(invalid="ignore"):   # a step with a NaN arrival is out already
            keep &= ~(first < a.max(axis=1) - HELD_SLACK)
    a = a[keep]
    offsets = a - a.max(axis=1, keepdims=True)
    return offsets[offsets.min(axis=1) >= -MAX_SPREAD]


def lead_of(offsets, rank: int) -> np.ndarray:
    """Per step, how long after every other rank ``rank`` arrived (negative: before
    the last of them), from :func:`arrival_offsets`.

    >>> lead_of(np.array([[-0.01, 0.0, -0.004], [0.0, -0.002, -0.003]]), 1).tolist()
    [0.004, -0.002]
    """
    off = np.asarray(offsets, dtype=np.float64)
    return off[:, rank] - np.delete(off, rank, axis=1).max(axis=1)


class ArrivalLead:
    """The lead of the rank with the most samples, searched window by window.

    Same tables in, same lead out, on every rank. :meth:`forget` it when the ranks
    change.
    """

    def __init__(self, windows: int = LEAD_WINDOWS):
        self.windows = int(windows)
        self.forget()

    def forget(self):
        self._pool = []                   # (L's lead per step, the lead it ran at) per window
        self.rank: Optional[int] = None   # L: the rank led
        self.lead = 0.0                   # seconds
        # the next move's size, the last one's sign and how many moves ran that way
        self._step, self._last_move, self._run = LEAD_STEP, 0, 0
        self.change = 0.0                 # how much the last observe() moved the lead
        #                                   (from 0 for a new rank led)
        self.derivative = (float("nan"), float("nan"))   # D and its standard error

    def observe(self, offsets, sizes, times):
        """Move the lead from one window's :func:`arrival_offsets` (None: no move),
        measured at ``sizes`` with mean local times ``times``."""
        rank, before = self.rank, self.lead
        self._observe(offsets, sizes, times)
        # a new rank led starts from no lead
        self.change = self.lead - (before if self.rank == rank else 0.0)

    @property
    def moved(self) -> bool:
        """Whether the last :meth:`observe` moved the lead."""
        return self.change != 0.0

    def _observe(self, offsets, sizes, times):
        b = np.asarray(sizes, dtype=np.float64)
        if offsets is None or not len(offsets) or b.size < 2:
            return
        rank = int(np.argmax(b))
        if b[rank] < DOMINANCE * np.delete(b, rank).max():
            self.forget()   # no rank stands out: no lead
            return
        if rank != self.rank:
            self.forget()
            self.rank = rank
        self._pool = (self._pool + [(lead_of(offsets, rank), self.lead)])[-self.windows:]
        local = float(np.asarray(times, dtype=np.float64)[rank])
        if not np.isfinite(local) or local <= 0:
            return
        # each pooled step as if run at the current lead (a lead moves L's arrival
        # by as much, on average); L last on ties
        last = np.concatenate([steps + (self.lead - then) >= 0 for steps, then in self._pool])
        n, share = last.size, float(np.mean(last))
        derivative = share - b[rank] / b.sum()   # P_L - w_L
        error = float(np.sqrt((share * (1.0 - share) + 0.25 / n) / n))
        self.derivative = (derivative, error)
        if abs(derivative) <= SIGNIFICANCE * error:
            return
        move = 1 if derivative < 0 else -1       # later while L is last too rarely
        if move < 0 and self.lead <= 0.0:
            return   # never before the others' mean (NO_NEGATIVE_LEAD)
        self._run = self._run + 1 if move == self._last_move else 1
        if self._last_move and self._run == 1:
            self._step = max(self._step / 2.0, MIN_LEAD_STEP)   # crossed: bisect
        elif self._run >= RUN_TO_GROW:
            self._step = min(self._step * 2.0, LEAD_STEP)       # far off: speed up
        self._last_move = move
        self.lead = min(max(self.lead + move * self._step * local, 0.0), MAX_LEAD * local)

    def charges(self, num_ranks: int, lead: Optional[float] = None) -> np.ndarray:
        """Seconds to add to each rank's time: minus the lead (or ``lead``) for the
        rank led."""
        out = np.zeros(num_ranks)
        if self.rank is not None and self.rank < num_ranks:
            out[self.rank] = -(self.lead if lead is None else lead)
        return out
