"""The adjustment cadence, written once: window -> settle -> gather -> decide -> effect.

Every place that decides batch sizes -- the synchronous callback, the asynchronous
balancer on server 0, the simulator -- runs this rhythm:

1. **window**: each rank offers its local time of every step to a
   :class:`~omnihvd.timing.TimingWindow`; a change of sizes starts a new window
   whose first ``settle_steps`` samples are dropped (:meth:`Cadence.begin_step`);
2. **gather**: every ``adjust_every``-th step (:meth:`Cadence.gathers_at`) closes the
   window (:func:`close_window`: time, standard
   error, sample count, then an empty window; with ``arrivals``, also the local time
   of each of the window's last steps, and with ``releases`` the moment each step's
   synchronize returned, aligned by step) and the ranks exchange their measurements.
   The synchronous callback closes the window of the steps before it at the
   gathering step's start, posts the allgather there and completes it at the same
   step's end: it then waits for no more than the gradients' allreduce does;
3. **decide**: every rank runs :meth:`Cadence.decide` on the same gathered numbers,
   so every rank reaches the same verdict: nothing while a change is pending (its
   samples would describe the old sizes), nothing when a rank has no valid sample,
   otherwise the controller's decision with the noise gate (standard errors) for the
   robust summaries;
4. **effect**: new sizes start at ``step + 1 + lookahead``, the first step no rank
   has handed out yet (``lookahead`` > 0 with a prefetching DataLoader).

Pure Python and numpy: no torch, horovod or mpi4py.

>>> from omnihvd.controller import Controller
>>> cad = Cadence(Controller(2, 60, policy="proportional"), adjust_every=4, settle_steps=0)
>>> for step in range(4):
...     cad.begin_step([30, 30]); _ = cad.record(0.4 if step % 2 else 0.2)
>>> cad.gathers_at(3), close_window(cad.window).count
(True, 4)
>>> d = cad.decide(3, [30, 30], [0.4, 0.2], [0.0, 0.0], [4, 4])
>>> d.new_sizes, d.effective_step
([20, 40], 4)
"""
from typing import List, NamedTuple, Optional, Sequence

import numpy as np

from .arrivals import ARRIVAL_STEPS
from .checks import check_int
from .controller import int_list
from .errors import ConfigError
from .lags import release_lags
from .lead import arrival_offsets
from .timing import DEFAULT_SUMMARY, TimingWindow, _valid
from .tuning import TiltSearch

__all__ = ["Cadence", "Decision", "Measurement", "close_window", "check_cadence"]


class Measurement(NamedTuple):
    """One window's summary, as a rank contributes it to the gather."""

    time: object    # summary step time, seconds (NaN: no valid sample); array per lane
    error: object   # its standard error (the noise gate's input)
    count: object   # valid samples in the window
    period: float = float("nan")        # median step period (wall time, waits included)
    period_error: float = float("nan")  # its standard error
    # local time of each of the window's last steps (NaN: none), aligned by step on
    # every rank: (steps,), or (steps, lanes); None when not kept
    arrivals: Optional[np.ndarray] = None
    # the same steps' release times: when the gradients' synchronize returned, on the
    # machine's monotonic clock (omnihvd.lags)
    releases: Optional[np.ndarray] = None
    # the same steps' arrival moments: when the rank began to wait for the others, on
    # the same clock (omnihvd.lead)
    arrived_at: Optional[np.ndarray] = None


class Decision(NamedTuple):
    """What :meth:`Cadence.decide` concluded (the same on every rank)."""

    step: int                       # the step whose end the decision follows
    sizes: List[int]                # the sizes the times were measured at
    new_sizes: Optional[List[int]]  # None when skipped
    changed: bool                   # new sizes differ from those in effect or scheduled
    effective_step: Optional[int]   # first step of the new sizes (when changed)
    skipped: Optional[str]          # why no decision was taken


def close_window(window: TimingWindow) -> Measurement:
    """Summarise ``window`` and empty it (no settle: the sizes did not change)."""
    out = Measurement(*window.measure())
    window.reset(settle=False)  # each adjustment sees only fresh steps
    return out


def check_cadence(adjust_every, settle_steps, lookahead=None):
    """Validate the cadence's integers; ConfigError names the one that is wrong.

    With a known ``lookahead`` (the simulator's), ``adjust_every`` must also exceed
    ``lookahead + settle_steps``, or the gather after each change would hold no sample
    at the new sizes (from ``lookahead + settle_steps + 2`` on, every gather decides:
    a window ends the step before its gather).
    """
    check_int("adjust_every", adjust_every, 1)
    check_int("settle_steps", settle_steps, 0)
    if lookahead is not None:
        check_int("lookahead", lookahead, 0)
    if lookahead is not None and adjust_every <= lookahead + settle_steps:
        raise ConfigError("adjust_every (%d) must exceed the look-ahead plus settle_steps (%d), or "
                          "the first gather after each change has no sample at the new "
                          "sizes; raise adjust_every" % (adjust_every, lookahead + settle_steps))


def _median_period(periods, period_errors):
    """The window's period and error: the median rank's (the ranks wait for each
    other, so their periods differ by little more than noise); NaN when absent."""
    if periods is None:
        return float("nan"), float("nan")
    p = np.asarray(periods, dtype=np.float64)
    e = np.full_like(p, np.nan) if period_errors is None else np.asarray(period_errors,
                                                                        dtype=np.float64)
    if not np.all(np.isfinite(p)):
        return float("nan"), float("nan")
    middle = int(np.argsort(p, kind="stable")[(p.size - 1) // 2])
    return float(p[middle]), float(e[middle])


class Cadence:
    """The shared adjustment rhythm around one :class:`~omnihvd.controller.Controller`.

    Args:
        controller: decides the sizes (its bounds, policy, dead band and noise gate).
        adjust_every: steps per window (one gather and one decision each).
        settle_steps: samples dropped after each change of sizes.
        timing: the window summary, see :func:`omnihvd.timing.robust_step_time`.
            The noise gate applies to ``"sustained"`` and ``"median"``; ``"mean"``
            (the reference implementation's rule) runs without it.
        tune_split: also tune the split by the measured step period
            (:class:`omnihvd.tuning.TiltSearch`; its windows need
            :meth:`record_period` and the gathered periods in :meth:`decide`).
        arrivals: also keep each step's local time, aligned by step (the last
            :data:`~omnihvd.arrivals.ARRIVAL_STEPS` of each window, settle steps
            left out), for the split for the slowest arrival
            (:mod:`omnihvd.arrivals`; the gathered table goes to :meth:`decide`).
            For synchronous training, where a step waits for its last rank.
        releases: also keep each step's release time (:meth:`record_release`) and
            arrival moment (:meth:`record_arrived`), aligned by step like
            ``arrivals``, for each rank's release lag (:mod:`omnihvd.lags`; the
            gathered tables go to :meth:`decide`).
        arrived_at: also keep each step's arrival moment, for the arrival lead
            (:mod:`omnihvd.lead`).

    Raises:
        ConfigError: malformed options.
    """

    def __init__(self, controller, *, adjust_every: int = 20, settle_steps: int = 1,
                 timing: str = DEFAULT_SUMMARY, tune_split: bool = False,
                 arrivals: bool = False, releases: bool = False, arrived_at: bool = False):
        check_cadence(adjust_every, settle_steps)
        self.controller = controller
        self.adjust_every = int(adjust_every)
        self.settle_steps = int(settle_steps)
        self.timing = timing
        self.window = TimingWindow(self.settle_steps, timing)
        # step periods are timed only for the search (nothing per step without it)
        self.tuner = TiltSearch() if tune_split else None
        self.periods = TimingWindow(self.settle_steps, "median") if tune_split else None
        self._window_sizes: Optional[List[int]] = None
        self._window_key = None
        # per-step series kept since the window opened, one slot per step (NaN: none),
        # the first settle_steps after a change of sizes left out: "arrivals" (local
        # times), "releases" and "arrived_at" (the lead's, and the release lags' too),
        # as asked for
        self._series = {name: [] for name, kept in (("arrivals", arrivals),
                                                     ("releases", releases),
                                                     ("arrived_at", arrived_at or releases))
                        if kept}
        self._lead = bool(arrived_at)   # arrival moments also give the arrival lead
        self._since_change = 0  # steps since the sizes changed
        self._pending: Optional[tuple] = None  # (effective step, sizes) not yet measured

    # -------------------------------------------------------------- measuring
    def begin_step(self, sizes: Sequence[int]):
        """The sizes in effect for the step about to run; a change opens a new window."""
        # A cheap key: this runs every step (tuple for a few ranks, bytes for the
        # simulator's vectors of thousands).
        key = sizes.astype(np.int64).tobytes() if isinstance(sizes, np.ndarray) else tuple(sizes)
        if key != self._window_key:
            self.window.reset(settle=True)
            if self.periods is not None:
                self.periods.reset(settle=True)
            self._window_key = key
            self._window_sizes = [int(b) for b in sizes]
            self._since_change = 0
            for series in self._series.values():
                series.clear()
        self._since_change += 1
        if self._since_change > self.settle_steps:
            for series in self._series.values():
                series.append(np.nan)   # this step's slot: record(), record_release()

    def _fill(self, name: str, seconds):
        """Put ``seconds`` in the running step's slot of series ``name`` (if kept and
        the step is not a settle step)."""
        series = self._series.get(name)
        if series and self._since_change > self.settle_steps:
            series[-1] = seconds

    def record(self, seconds) -> bool:
        """Offer the running step's local time; returns whether it was kept."""
        self._fill("arrivals", seconds)
        return self.window.add(seconds)

    def record_release(self, seconds: float):
        """Offer the moment the running step's gradients' synchronize returned
        (``time.perf_counter()``; kept only with ``releases``)."""
        self._fill("releases", seconds)

    def record_arrived(self, seconds: float):
        """Offer the moment the running step began to wait for the others
        (``time.perf_counter()``; kept with ``arrived_at`` or ``releases``)."""
        self._fill("arrived_at", seconds)

    def record_period(self, seconds) -> bool:
        """Offer a step's period: its wall time, waiting for the others included
        (what :class:`~omnihvd.tuning.TiltSearch` minimises); ignored (False)
        without ``tune_split``."""
        return self.periods is not None and self.periods.add(seconds)

    def close(self) -> Measurement:
        """Summarise the window (local times, and periods under ``tune_split``) and
        empty it."""
        measured = close_window(self.window)._replace(
            **{name: self._close_series(name) for name in self._series})
        if self.periods is None:
            return measured
        period, period_error, _ = self.periods.measure()
        self.periods.reset(settle=False)
        return measured._replace(period=period, period_error=period_error)

    def _close_series(self, name: str) -> np.ndarray:
        """The window's last ARRIVAL_STEPS per-step values of series ``name`` (NaN where
        missing), emptied."""
        slots = self._series[name][-ARRIVAL_STEPS:]
        self._series[name] = []
        if not slots:
            return np.empty(0)
        lanes = max((np.size(v) for v in slots), default=1)
        out = np.full((len(slots), lanes), np.nan)
        for row, value in zip(out, slots):
            row[:] = value
        out = _valid(out)   # NaN where not finite and positive, as the window ignores
        return out[:, 0] if lanes == 1 and np.ndim(slots[0]) == 0 else out

    def gathers_at(self, step: int) -> bool:
        """Whether step ``step`` (0-based, global) closes a window and gathers."""
        return (step + 1) % self.adjust_every == 0

    @property
    def window_sizes(self) -> Optional[List[int]]:
        """The sizes the current window's samples were measured at."""
        return None if self._window_sizes is None else list(self._window_sizes)

    # --------------------------------------------------------------- deciding
    def pending(self, step: int) -> Optional[tuple]:
        """``(effective_step, sizes)`` of a decided change not yet measured at ``step``."""
        if self._pending is not None and step >= self._pending[0] + self.settle_steps:
            self._pending = None
        return self._pending

    def sizes_for(self, step: int, current: Sequence[int]) -> List[int]:
        """The sizes of ``step`` given those in effect before it (for a caller with no
        schedule of its own, like the simulator)."""
        if self._pending is not None and step >= self._pending[0]:
            return list(self._pending[1])
        return [int(b) for b in current]

    def decide(self, step: int, sizes, times, errors=None, counts=None, *,
               measured_upto: Optional[int] = None, lookahead: int = 0, periods=None,
               period_errors=None, arrivals=None, releases=None, hosts=None, cpusets=None,
               arrived_at=None, kinds=None) -> Decision:
        """Decide from one gather; every rank gets the same result from the same data.

        Args:
            step: the step whose end the decision follows.
            sizes: the sizes the window was measured at (one per rank).
            measured_upto: the window's last step (default ``step``; the synchronous
                callback posts the gather at ``step``'s start, so ``step - 1``): a
                change not yet timed by then leaves nothing to decide on.
            times, errors, counts: the gathered measurements (one per rank).
            lookahead: steps beyond ``step`` some rank has already handed out.
            periods, period_errors: the gathered step periods and their errors (one
                per rank; used under ``tune_split``, whose window is the median rank's).
            arrivals: the gathered ``(steps, ranks)`` local times of single steps
                (None: the split balances mean times only).
            releases, hosts, cpusets: the gathered ``(steps, ranks)`` release
                times of the same steps, each rank's machine and its CPUs (None: no
                rank is charged a release lag, :mod:`omnihvd.lags`).
            arrived_at: the gathered ``(steps, ranks)`` arrival moments of the same
                steps (with ``hosts``: the arrival lead, :mod:`omnihvd.lead`; None:
                no lead).
            kinds: each rank's :func:`omnihvd.alike.kind_key` (None: no rank is
                held equal to another).

        Returns:
            :class:`Decision`; when ``changed``, the caller applies ``new_sizes`` from
            ``effective_step`` on.
        """
        sizes = int_list(sizes)
        if self.pending(step if measured_upto is None else measured_upto) is not None:
            return Decision(step, sizes, None, False, None,
                            "a change from step %d is not measured yet" % self._pending[0])
        times = np.asarray(times, dtype=np.float64)
        bad = ~(np.isfinite(times) & (times > 0))
        if counts is not None:
            bad |= np.asarray(counts) <= 0
        if bad.any():
            return Decision(step, sizes, None, False, None, "no valid timing on rank(s) %s"
                            % np.flatnonzero(bad).tolist())
        use_errors = errors is not None and self.timing != "mean"
        lags = None if releases is None or hosts is None or cpusets is None else release_lags(
            releases, hosts, cpusets, arrived_at)
        offsets = (None if arrived_at is None or hosts is None or not self._lead
                   else arrival_offsets(arrived_at, hosts, releases))
        tuner = self.tuner
        if tuner is None:
            new = self.controller.decide(sizes, times, errors if use_errors else None,
                                         arrivals=arrivals, lags=lags, offsets=offsets,
                                         kinds=kinds)
            return self.propose(step, sizes, new, lookahead=lookahead)
        period = _median_period(periods, period_errors)
        if tuner.probing:
            # a search's window: its local times still teach the controller's model
            self.controller.observe(sizes, times, arrivals, lags, offsets, kinds)
            probe = tuner.measured(*period)
        else:
            new = self.controller.decide(sizes, times, errors if use_errors else None,
                                         tilt=tuner.tilt, arrivals=arrivals, lags=lags,
                                         offsets=offsets, kinds=kinds)
            decision = self.propose(step, sizes, new, lookahead=lookahead)
            probe = tuner.after_decision(decision.changed, *period)
            if probe is None:
                return decision
        split = self.controller.split_at(tuner.tilt if probe is None else probe)
        return self.propose(step, sizes, split, lookahead=lookahead)

    def decide_gathered(self, step: int, got, *, measured_upto: Optional[int] = None
                        ) -> Decision:
        """:meth:`decide` on everything one gather holds (``got``: a
        :class:`omnihvd.payload.Gathered`, as :func:`omnihvd.payload.read_gathered`
        reads it)."""
        return self.decide(step, got.sizes, got.times, got.errors, got.counts,
                           measured_upto=measured_upto, lookahead=got.lookahead,
                           periods=got.periods, period_errors=got.period_errors,
                           arrivals=got.arrivals, releases=got.releases, hosts=got.hosts,
                           cpusets=got.cpusets, arrived_at=got.arrived_at, kinds=got.kinds)

    def propose(self, step: int, sizes, new, *, lookahead: int = 0) -> Decision:
        """Schedule ``new`` (decided, or forced by lowered memory caps) after ``step``."""
        sizes, new = int_list(sizes), int_list(new)
        current = list(self._pending[1]) if self._pending is not None else sizes
        changed = new != current
        effective = step + 1 + max(int(lookahead), 0)
        if changed:
            self._pending = (effective, new)
        return Decision(step, sizes, new, changed, effective if changed else None, None)

    def forget_pending(self):
        """Drop the record of a scheduled change (after a checkpoint restore), and a
        search of the split under way."""
        self._pending = None
        if self.tuner is not None:
            self.tuner.abandon()
