"""A step-level simulator of n heterogeneous ranks, driving the real controller.

Rehearse a cluster before spending allocation hours on it: each simulated rank i
takes ``a_i + b_i / x_i`` seconds of local compute per step (a fixed cost plus its
batch over its throughput), times a random factor (timing noise); a step lasts as
long as the slowest rank plus a ring allreduce. Batch sizes are chosen by the code a
real run uses: :class:`omnihvd.cadence.Cadence` (the window, settle steps, the
estimator of :mod:`omnihvd.timing` with its standard errors, when to gather, the
noise gate, when a change takes effect) around :class:`omnihvd.controller.Controller`
(policies, gain, dead band, bounds, integer apportioning); without the callback's
release lags, arrival lead and alike ranks, which rest on real clocks and shared
CPUs (:class:`Control`). Every ``adjust_every``
steps the window closes, the summaries are "gathered" and the decision takes effect
``1 + latency_steps`` steps later (``latency_steps``: the look-ahead of a prefetching
DataLoader, 0 without one). Ranks are numpy vectors, so 10,000 ranks run in
seconds; the controller's own cost is what is left.

Speed profiles (relative speed 1.0 = a 12-core worker of the paper):

* ``hl1``, ``hl2``, ``hl4``, ``hl8``: the paper's static heterogeneity levels, cores
  per worker 12/12/12/12, 12/12/8/16, 9/9/6/24, 6/6/4/32, tiled over n ranks;
* ``dynamic``: the paper's schedule HL1 -> HL2 -> HL4 -> HL8 -> HL4 -> HL2 -> HL1;
* ``noisy``: a base level where a random fraction of ranks runs ``slowdown`` times
  slower, re-drawn every ``slow_period`` steps (noisy neighbours, throttling);
* ``drift``: every rank's speed follows a mean-reverting random walk (log scale).

Efficiency is ideal / simulated step time, with the same allreduce cost in both:
the noise-free ideal is the continuous split that equalises ``a_i + b_i / x_i``
(``B / sum(x)`` when ``a = 0``); the same-noise ideal applies this step's noise to
that split, so it isolates what the controller loses from what noise alone costs.
When the ranks' noise differs, the split for the last arrival
(``Control.balance_arrivals``, :mod:`omnihvd.arrivals`) can beat that split: its
same-noise efficiency may then exceed 1.

Example::

    >>> res = simulate(Cluster(ranks=8), "hl4", global_batch_size=256, steps=200)
    >>> res.summary()["steady"]["efficiency"] > 0.9
    True
"""
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional

import numpy as np

from ..cadence import Cadence, check_cadence
from ..controller import (DEFAULT_DEADBAND, POLICIES, Controller, TimeModel, apportion, initial_split,
                          resolve_bounds, solve_time_model)
from ..checks import check_int
from ..errors import ConfigError
from ..timing import DEFAULT_SUMMARY, SUMMARIES
from .cli import positive
from .levels import DYNAMIC_LEVELS, LEVEL_CORES, level_speeds
from .metrics import ideal_step_time, split_time

__all__ = [
    "HL_LEVELS",
    "DYNAMIC_SCHEDULE",
    "PROFILES",
    "Cluster",
    "Control",
    "reference_control",
    "SpeedProfile",
    "make_profile",
    "ring_allreduce_seconds",
    "noise_label",
    "simulate",
    "SimulationResult",
    "configure_parser",
    "run",
]

# The paper's heterogeneity levels (omnihvd.tools.levels), by their lower-case profile names.
HL_LEVELS = {name.lower(): cores for name, cores in LEVEL_CORES.items()}
DYNAMIC_SCHEDULE = tuple(name.lower() for name in DYNAMIC_LEVELS)
PROFILES = tuple(HL_LEVELS) + ("dynamic", "noisy", "drift")
# Bounds that keep the random factors finite: a coefficient of variation of the
# timing noise (log-normal: sigma 3 at 100) and the drift's log-speed step.
MAX_CV = 100.0
MAX_DRIFT = 1.0

# Float64 fields each rank contributes to the callback's timing allgather.
from ..payload import PAYLOAD_FIELDS as SUMMARY_FIELDS  # noqa: E402


@dataclass
class Cluster:
    """The simulated hardware.

    Args:
        ranks: n.
        throughput: samples/s of one rank at relative speed 1.0.
        overhead: fixed seconds per step at relative speed 1.0 (``a_i`` scales with
            1/speed: a slower worker is slower at everything).
        noise: coefficient of variation of the per-step, per-rank multiplicative
            noise (log-normal, mean 1); 0.1 = 10% timing noise. One number, or one
            per rank (ranks on a shared core vary more than one alone on its core).
        gradient_bytes: bytes allreduced per step (100e6 ~ ResNet-50 in fp32).
        bandwidth: bytes/s per link of the ring.
        latency: seconds per message of the ring.
        unseen: per rank (or one for all), the fraction of its local time that also
            delays the step without showing in its local time: the work around the
            allreduce on cores a rank shares with others (what
            ``tune_split`` finds from the step period). 0: local times tell all.
    """

    ranks: int = 4
    throughput: float = 100.0
    overhead: float = 0.02
    noise: object = 0.0
    gradient_bytes: float = 100e6
    bandwidth: float = 12.5e9
    latency: float = 5e-6
    unseen: object = 0.0

    def check(self):
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ConfigError("ranks must be an integer >= 1, got %r" % (self.ranks,))
        for name, lowest, strict in (("throughput", 0.0, True), ("overhead", 0.0, False),
                                     ("gradient_bytes", 0.0, False),
                                     ("bandwidth", 0.0, True), ("latency", 0.0, False)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)
                    and (value > lowest if strict else value >= lowest)):
                raise ConfigError("%s must be a finite number %s 0, got %r"
                                  % (name, ">" if strict else ">=", value))
        for name, most, what in (("noise", MAX_CV, "number within 0..%g (a coefficient of "
                                  "variation)" % MAX_CV), ("unseen", math.inf,
                                                           "finite number >= 0")):
            value = getattr(self, name)
            try:
                arr = np.asarray(value, dtype=np.float64)
            except (TypeError, ValueError):
                arr = np.full(2, np.nan)
            if arr.shape not in ((), (self.ranks,)) or not np.all(
                    np.isfinite(arr) & (arr >= 0) & (arr <= most)):
                raise ConfigError("%s must be one %s or one per rank, got %r"
                                  % (name, what, value))


@dataclass
class Control:
    """The controller settings of a run; the defaults are omnihvd's, but for three
    of the callback's options that rest on real clocks, which simulated ranks do not
    have: ``release_lag``, ``arrival_lead`` and ``alike_ranks`` (on by default in
    :class:`omnihvd.OmniLearnCallback`) are off here, as if set to False. They
    matter where ranks share CPUs (:mod:`omnihvd.lags`, :mod:`omnihvd.lead`,
    :mod:`omnihvd.alike`), which a simulated rank's ``a_i + b_i / x_i`` does not model.

    Args:
        policy: ``"affine"`` or ``"proportional"`` (see :class:`Controller`).
        deadband, gain, min_batch_size, max_batch_size, history: as in :class:`Controller`.
        adjust_every: steps between decisions.
        settle_steps: samples dropped after each size change.
        timing: ``"sustained"``, ``"median"`` or ``"mean"`` (see
            :func:`omnihvd.timing.robust_step_time`).
        latency_steps: steps a prefetching DataLoader has handed out beyond the one
            that gathers (0: the new sizes start at the next step, as in a run whose
            loader does not prefetch).
        tune_split: also tune the split by the step period (:mod:`omnihvd.tuning`).
        balance_arrivals: split for each step's slowest arrival (:mod:`omnihvd.arrivals`).
    """

    policy: str = "affine"
    deadband: float = DEFAULT_DEADBAND
    gain: float = 1.0
    adjust_every: int = 20
    settle_steps: int = 1
    timing: str = DEFAULT_SUMMARY
    latency_steps: int = 0
    min_batch_size: object = 1
    max_batch_size: object = None
    history: int = 8
    tune_split: bool = False
    balance_arrivals: bool = False

    def check(self):
        if self.policy not in POLICIES:
            raise ConfigError("policy must be one of %s, got %r" % (", ".join(POLICIES), self.policy))
        if self.timing not in SUMMARIES:
            raise ConfigError("timing must be one of %s, got %r" % (", ".join(SUMMARIES), self.timing))
        check_cadence(self.adjust_every, self.settle_steps, self.latency_steps)


def reference_control(steps_per_epoch: int = 100) -> Control:
    """The released reference code's policy: proportional, once per epoch, dead band 0.2,
    raw mean of the epoch's times.

    >>> reference_control(50).adjust_every
    50
    """
    return Control(policy="proportional", deadband=0.2, adjust_every=steps_per_epoch, timing="mean")


def ring_allreduce_seconds(ranks: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Ring allreduce time: ``2(n-1)/n * bytes / bandwidth + 2(n-1) * latency``.

    >>> ring_allreduce_seconds(4, 1e9, 1e9, 0.0)
    1.5
    >>> ring_allreduce_seconds(1, 1e9, 1e9, 1.0)
    0.0
    """
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * nbytes / bandwidth + 2.0 * (ranks - 1) * latency


# ------------------------------------------------------------------ speed profiles


def hl_speeds(level: str, ranks: int) -> np.ndarray:
    """Relative speeds (cores / 12) of a static level tiled over ``ranks``.

    >>> hl_speeds("hl8", 5).tolist()
    [0.5, 0.5, 0.3333333333333333, 2.6666666666666665, 0.5]
    """
    if level not in HL_LEVELS:
        raise ConfigError("heterogeneity level must be one of %s, got %r"
                          % (", ".join(HL_LEVELS), level))
    return np.asarray(level_speeds(level, ranks), dtype=np.float64)


class SpeedProfile:
    """Relative speed of every rank at every step.

    :meth:`stream` yields one ``(n,)`` array per step, in order (some profiles are
    random walks, so steps cannot be skipped). :attr:`change_steps` lists the steps
    at which the speeds jump (phases for the convergence measure), or is None when
    they change continuously.
    """

    def __init__(self, name, base, change_steps, stream_fn):
        self.name = name
        self.base = base
        self.change_steps = change_steps
        self._stream_fn = stream_fn

    def stream(self, steps):
        return self._stream_fn(steps)

    @classmethod
    def constant(cls, name, speeds) -> "SpeedProfile":
        """Every rank at the same speed for the whole run.

        >>> p = SpeedProfile.constant("3:1", [3.0, 1.0])
        >>> [s.tolist() for s in p.stream(2)], p.change_steps
        ([[3.0, 1.0], [3.0, 1.0]], [0])
        """
        speeds = np.asarray(speeds, dtype=np.float64)
        return cls(name, speeds, [0], lambda steps: (speeds for _ in range(steps)))


def make_profile(name: str, ranks: int, steps: int, *, seed: int = 0, base: str = "hl1",
                 phase_steps: Optional[int] = None, slow_fraction: float = 0.1,
                 slowdown: float = 2.0, slow_period: int = 200, drift: float = 0.02,
                 reversion: float = 0.01) -> SpeedProfile:
    """Build one of :data:`PROFILES`.

    Args:
        name: ``hl1`` .. ``hl8``, ``dynamic``, ``noisy`` or ``drift``.
        ranks, steps: size of the run.
        seed: random profiles (``noisy``, ``drift``) are a function of it.
        base: level under ``noisy`` and ``drift``.
        phase_steps: steps per level of ``dynamic`` (default: steps / 7).
        slow_fraction, slowdown, slow_period: ``noisy``: that fraction of ranks runs
            ``slowdown`` times slower, re-drawn every ``slow_period`` steps.
        drift, reversion: ``drift``: per-step standard deviation of log-speed and the
            pull back towards the base speed per step.

    Raises:
        ConfigError: unknown name or out-of-range option.

    >>> p = make_profile("dynamic", 4, 70)
    >>> p.change_steps
    [0, 10, 20, 30, 40, 50, 60]
    """
    if name not in PROFILES:
        raise ConfigError("profile must be one of %s, got %r" % (", ".join(PROFILES), name))
    if not (0.0 <= slow_fraction <= 1.0 and 0 < slowdown < float("inf") and slow_period >= 1):
        raise ConfigError("noisy profile needs 0 <= slow_fraction <= 1, a finite slowdown > 0 "
                          "and slow_period >= 1; got %r, %r, %r"
                          % (slow_fraction, slowdown, slow_period))
    if not (0.0 <= drift <= MAX_DRIFT and 0.0 <= reversion <= 1.0):
        raise ConfigError("drift must be within 0..%g (a log-speed step of 1 multiplies a "
                          "rank's speed by up to e per step) and 0 <= reversion <= 1; got %r, %r"
                          % (MAX_DRIFT, drift, reversion))
    if phase_steps is not None:
        check_int("phase_steps", phase_steps, 1, "steps per level of the dynamic profile")
    rng = np.random.default_rng([seed, 1])
    if name in HL_LEVELS:
        return SpeedProfile.constant(name, hl_speeds(name, ranks))
    base_speeds = hl_speeds(base, ranks)
    if name == "dynamic":
        phase = phase_steps or max(1, steps // len(DYNAMIC_SCHEDULE))
        levels = [hl_speeds(level, ranks) for level in DYNAMIC_SCHEDULE]

        def dynamic(steps_):
            for t in range(steps_):
                yield levels[min(t // phase, len(levels) - 1)]
        starts = [k * phase for k in range(len(levels)) if k * phase < steps]
        return SpeedProfile(name, levels[0], starts, dynamic)
    if name == "noisy":
        periods = -(-steps // slow_period)
        slow_count = max(1, int(round(slow_fraction * ranks))) if slow_fraction > 0 else 0
        slowed = np.ones((periods, ranks))
        for k in range(periods):
            slowed[k, rng.choice(ranks, size=slow_count, replace=False)] = 1.0 / slowdown

        def noisy(steps_):
            for t in range(steps_):
                yield base_speeds * slowed[min(t // slow_period, periods - 1)]
        return SpeedProfile(name, base_speeds, list(range(0, steps, slow_period)), noisy)

    def drifting(steps_):
        walk_rng = np.random.default_rng([seed, 1])
        log_base = np.log(base_speeds)
        log_speed = log_base.copy()
        for _ in range(steps_):
            yield np.exp(log_speed)
            log_speed += reversion * (log_base - log_speed) + drift * walk_rng.standard_normal(ranks)
    return SpeedProfile(name, base_speeds, None, drifting)


# -------------------------------------------------------------------- simulation


def noise_label(noise) -> str:
    """``Cluster.noise`` in percent: ``"10%"``, or one figure per rank ``"5/5/30%"``.

    >>> noise_label(0.1), noise_label([0.05, 0.05, 0.3])
    ('10%', '5/5/30%')
    """
    return "/".join("%g" % round(100 * v, 6) for v in np.atleast_1d(noise)) + "%"


def _noise_factors(rng, cv, ranks):
    """Log-normal factors with mean 1 and coefficient of variation ``cv`` (one, or
    one per rank)."""
    cv = np.broadcast_to(np.asarray(cv, dtype=np.float64), (ranks,))
    if not np.any(cv):
        return np.ones(ranks)
    sigma = np.sqrt(np.log1p(cv * cv))
    return np.exp(rng.standard_normal(ranks) * sigma - 0.5 * sigma * sigma)


@dataclass
class SimulationResult:
    """Everything a run produced. Per-step arrays have one entry per step.

    Attributes:
        step_time: simulated seconds of each step (slowest rank + allreduce).
        ideal_time: noise-free ideal step time (continuous equal-time split + allreduce).
        oracle_time: the same split (equal means) under this step's noise (+ allreduce).
        equal_time: equal batch sizes under this step's noise (+ allreduce).
        balance: noise-free compute balance of the current sizes,
            ``T_ideal / max_i(a_i + b_i / x_i)``: 1.0 when perfectly balanced.
        best_balance: the best balance an integer split can reach, per phase.
        tracked_ranks, tracked_sizes: batch-size trajectories ``(steps, k)`` of a few
            representative ranks.
        decisions: one dict per controller call: step, effective_step, changed,
            seconds and cpu_seconds (wall and thread CPU time of ``Controller.decide``;
            CPU time is the steadier figure on a shared machine).
        final_sizes: every rank's sizes after the last step.
    """

    ranks: int
    global_batch_size: int
    profile: str
    cluster: dict
    control: dict
    step_time: np.ndarray
    ideal_time: np.ndarray
    oracle_time: np.ndarray
    equal_time: np.ndarray
    balance: np.ndarray
    change_steps: Optional[List[int]]
    best_balance: List[float]
    tracked_ranks: List[int]
    tracked_sizes: np.ndarray
    decisions: List[dict] = field(default_factory=list)
    final_sizes: List[int] = field(default_factory=list)
    allreduce_seconds: float = 0.0

    @property
    def steps(self):
        return int(self.step_time.size)

    def convergence(self, tol: float = 0.05) -> List[dict]:
        """Per phase: steps and size changes until the balance stays within ``tol``.

        A phase has converged at the first step from which the noise-free balance
        stays at or above ``(1 - tol) * best_balance`` until the phase ends; it is
        reached at the first step where it gets there at all (under noise a later
        round may leave again). Profiles with continuous drift have no phases and
        return ``[]``.

        Returns:
            list of dicts ``{start, steps, adjustments, decisions, reached,
            reached_adjustments}``: steps from the phase start; None where the phase
            never settles (never gets there).
        """
        if self.change_steps is None:
            return []
        bounds = list(self.change_steps) + [self.steps]
        out = []
        for k, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            ok = self.balance[start:end] >= (1.0 - tol) * self.best_balance[k]
            # first index after the last failure
            bad = np.flatnonzero(~ok)
            first = start if bad.size == 0 else start + int(bad[-1]) + 1
            settled = first < end
            made = [d for d in self.decisions if start <= d["step"] < (first if settled else end)]
            hits = np.flatnonzero(ok)
            reach = start + int(hits[0]) if hits.size else None
            before = [d for d in self.decisions
                      if reach is not None and start <= d["step"] < reach and d["changed"]]
            out.append({
                "start": int(start),
                "steps": int(first - start) if settled else None,
                "adjustments": sum(1 for d in made if d["changed"]) if settled else None,
                "decisions": len(made) if settled else None,
                "reached": None if reach is None else reach - start,
                "reached_adjustments": None if reach is None else len(before),
            })
        return out

    def summary(self, steady_fraction: float = 0.25, tol: float = 0.05) -> dict:
        """Headline figures; "steady" averages over the last ``steady_fraction`` of steps.

        Efficiencies are ratios of summed times over the window (time-weighted).
        """
        lo = min(self.steps - 1, int(self.steps * (1.0 - steady_fraction)))
        total = float(np.sum(self.step_time[lo:]))
        seconds = np.array([d["seconds"] for d in self.decisions]) if self.decisions else np.zeros(1)
        cpu = np.array([d["cpu_seconds"] for d in self.decisions]) if self.decisions else np.zeros(1)
        conv = self.convergence(tol)
        settled = [c for c in conv if c["steps"] is not None]
        return {
            "ranks": self.ranks,
            "global_batch_size": self.global_batch_size,
            "profile": self.profile,
            "steps": self.steps,
            "policy": self.control["policy"],
            "noise": np.asarray(self.cluster["noise"], dtype=np.float64).tolist(),
            "allreduce_seconds": self.allreduce_seconds,
            "allgather_bytes": self.ranks * SUMMARY_FIELDS * 8,
            "decisions": len(self.decisions),
            "adjustments": sum(1 for d in self.decisions if d["changed"]),
            "decision_ms": {"median": 1e3 * float(np.median(seconds)),
                            "max": 1e3 * float(np.max(seconds)),
                            "cpu_median": 1e3 * float(np.median(cpu)),
                            "cpu_min": 1e3 * float(np.min(cpu))},
            "steady": {
                "from_step": lo,
                "efficiency": float(np.sum(self.ideal_time[lo:])) / total,
                "efficiency_same_noise": float(np.sum(self.oracle_time[lo:])) / total,
                "speedup_vs_equal": float(np.sum(self.equal_time[lo:])) / total,
                "balance": float(np.mean(self.balance[lo:])),
                "mean_step_time": total / (self.steps - lo),
            },
            "overall_efficiency": float(np.sum(self.ideal_time) / np.sum(self.step_time)),
            "convergence_tol": tol,
            "convergence": conv,
            "converged_phases": "%d/%d" % (len(settled), len(conv)),
            "max_steps_to_converge": max((c["steps"] for c in settled), default=None),
            "max_adjustments_to_converge": max((c["adjustments"] for c in settled), default=None),
            "max_steps_to_reach": (None if any(c["reached"] is None for c in conv)
                                   else max((c["reached"] for c in conv), default=None)),
            "max_adjustments_to_reach": (None if any(c["reached"] is None for c in conv) else
                                         max((c["reached_adjustments"] for c in conv), default=None)),
        }

    def to_dict(self, every: int = 1) -> dict:
        """JSON-ready summary plus per-step series (every ``every``-th step)."""
        sl = slice(None, None, max(1, int(every)))
        with np.errstate(divide="ignore", invalid="ignore"):
            series = {
                "step": list(range(self.steps))[sl],
                "step_time": self.step_time[sl].tolist(),
                "efficiency": (self.ideal_time / self.step_time)[sl].tolist(),
                "efficiency_same_noise": (self.oracle_time / self.step_time)[sl].tolist(),
                "equal_split_efficiency": (self.ideal_time / self.equal_time)[sl].tolist(),
                "balance": self.balance[sl].tolist(),
            }
        return {
            "summary": self.summary(),
            "cluster": self.cluster,
            "control": self.control,
            "series": series,
            "tracked_ranks": self.tracked_ranks,
            "tracked_sizes": self.tracked_sizes[sl].T.tolist(),
            "decisions": self.decisions,
            "final_sizes": self.final_sizes,
        }


def simulate(cluster: Cluster, profile, *, global_batch_size: int, steps: int,
             control: Optional[Control] = None, seed: int = 0, initial_batch_sizes=None,
             track: int = 8) -> SimulationResult:
    """Run ``steps`` training steps of the simulated cluster under the real controller.

    Args:
        cluster: the hardware, see :class:`Cluster`.
        profile: a :class:`SpeedProfile` or a profile name (built by
            :func:`make_profile` with default options and ``seed``).
        global_batch_size: B; every split sums to it.
        steps: number of steps.
        control: controller settings (default: omnihvd's, :class:`Control`).
        seed: seeds the noise (and a named random profile); same seed, same result.
        initial_batch_sizes: starting split (default: equal).
        track: how many ranks' batch-size trajectories to keep (distinct base
            speeds first).

    Returns:
        :class:`SimulationResult`.

    Raises:
        ConfigError, InfeasibleError: bad settings, or bounds that admit no split.

    >>> r = simulate(Cluster(ranks=4), "hl8", global_batch_size=64, steps=100)
    >>> r.final_sizes, sum(r.final_sizes)
    ([7, 7, 4, 46], 64)
    """
    cluster.check()
    control = control or Control()
    control.check()
    n = cluster.ranks
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError("steps must be an integer >= 1, got %r" % (steps,))
    if isinstance(profile, str):
        profile = make_profile(profile, n, steps, seed=seed)
    if profile.base.size != n:
        raise ConfigError("profile has %d ranks but the cluster has %d" % (profile.base.size, n))
    B = int(global_batch_size)
    lo, hi = resolve_bounds(n, B, control.min_batch_size, control.max_batch_size)
    ctl = Controller(n, B, policy=control.policy, gain=control.gain, deadband=control.deadband,
                     min_batch_size=lo, max_batch_size=hi, history=control.history)
    sizes = np.asarray(initial_split(n, B, lo, hi, initial_batch_sizes), dtype=np.int64)
    cadence = Cadence(ctl, adjust_every=control.adjust_every, settle_steps=control.settle_steps,
                      timing=control.timing, tune_split=control.tune_split,
                      arrivals=control.balance_arrivals)
    unseen = 1.0 + np.asarray(cluster.unseen, dtype=np.float64)
    equal = np.asarray(apportion(np.ones(n), B, lo, hi), dtype=np.float64)

    # Representative ranks: the first of each distinct base speed, then the others.
    _, firsts = np.unique(profile.base, return_index=True)
    tracked = sorted(firsts.tolist())[:track]
    tracked += [r for r in range(n) if r not in tracked][:max(0, track - len(tracked))]
    tracked = sorted(tracked)

    comm = ring_allreduce_seconds(n, cluster.gradient_bytes, cluster.bandwidth, cluster.latency)
    noise_rng = np.random.default_rng([seed, 2])
    out = {k: np.empty(steps) for k in ("step", "ideal", "oracle", "equal", "balance")}
    tracked_sizes = np.empty((steps, len(tracked)), dtype=np.int64)
    change_steps = profile.change_steps
    best_balance = []
    decisions = []

    for t, speed in enumerate(profile.stream(steps)):
        measured = None
        if cadence.gathers_at(t):   # as the callback: the window of the steps before t
            measured, measured_sizes = cadence.close(), cadence.window_sizes or sizes.tolist()
        pending = cadence.pending(t)
        if pending is not None and pending[0] == t:
            sizes = np.asarray(pending[1], dtype=np.int64)
        cadence.begin_step(sizes)
        x = cluster.throughput * speed
        a = cluster.overhead / speed
        nominal = a + sizes / x
        factors = _noise_factors(noise_rng, cluster.noise, n)
        local = nominal * factors
        ideal = ideal_step_time(B, x, a)
        out["step"][t] = float((local * unseen).max()) + comm
        out["ideal"][t] = ideal + comm
        out["oracle"][t] = ideal * float(factors.max()) + comm
        out["equal"][t] = float(np.max((a + equal / x) * factors)) + comm
        out["balance"][t] = ideal / float(nominal.max())
        tracked_sizes[t] = sizes[tracked]
        if change_steps is not None and t in change_steps:
            best = solve_time_model(TimeModel(a, 1.0 / x), B, min_batch_size=lo, max_batch_size=hi)
            best_balance.append(ideal / float(split_time(best, x, a)))
        cadence.record(local)
        cadence.record_period(out["step"][t])
        if measured is not None:
            start, cpu = time.perf_counter(), time.thread_time()
            decision = cadence.decide(t, measured_sizes, measured.time, measured.error,
                                      measured.count, measured_upto=t - 1,
                                      lookahead=control.latency_steps,
                                      periods=[measured.period],
                                      period_errors=[measured.period_error],
                                      arrivals=measured.arrivals)
            seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
            if decision.skipped is None:
                decisions.append({"step": t, "effective_step": decision.effective_step,
                                  "changed": decision.changed, "seconds": seconds,
                                  "cpu_seconds": cpu})
    pending = cadence.pending(steps)
    if pending is not None:  # decided, not yet applied: the sizes the run goes on with
        sizes = np.asarray(pending[1], dtype=np.int64)
    return SimulationResult(
        ranks=n, global_batch_size=B, profile=profile.name, cluster=asdict(cluster),
        control={k: (v.tolist() if isinstance(v, np.ndarray) else v)
                 for k, v in asdict(control).items()},
        step_time=out["step"], ideal_time=out["ideal"], oracle_time=out["oracle"],
        equal_time=out["equal"], balance=out["balance"], change_steps=change_steps,
        best_balance=best_balance, tracked_ranks=tracked, tracked_sizes=tracked_sizes,
        decisions=decisions, final_sizes=[int(v) for v in sizes], allreduce_seconds=comm)


# ------------------------------------------------------------------------ plotting


def plot(results, path: str, labels=None):
    """Write a PNG: efficiency over time (top) and batch-size trajectories (bottom).

    Args:
        results: one :class:`SimulationResult` or a list (overlaid, e.g. omnihvd vs
            the reference policy on the same scenario and seed).
        path: output file.
        labels: one label per result (default: the policy names).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [results] if isinstance(results, SimulationResult) else list(results)
    labels = labels or [r.control["policy"] for r in results]
    fig, axes = plt.subplots(1 + len(results), 1, figsize=(9, 3.2 * (1 + len(results))),
                             sharex=True)
    first = results[0]
    steps = np.arange(first.steps)
    ax = axes[0]
    for res, label in zip(results, labels):
        ax.plot(steps, res.ideal_time / res.step_time, lw=0.8, label="%s: vs noise-free ideal" % label)
    ax.plot(steps, first.oracle_time / first.step_time, lw=0.6, alpha=0.7, color="grey",
            label="%s: vs same-noise ideal" % labels[0])
    ax.plot(steps, first.ideal_time / first.equal_time, lw=0.8, ls="--", color="black",
            label="equal batch sizes")
    ax.set_ylabel("efficiency (ideal / step time)")
    ax.set_ylim(0, 1.05)
    ax.set_title("%d ranks, B=%d, profile %s, noise %s"
                 % (first.ranks, first.global_batch_size, first.profile,
                    noise_label(first.cluster["noise"])))
    ax.legend(fontsize=7, loc="lower right")
    for res, label, ax in zip(results, labels, axes[1:]):
        for j, rank in enumerate(res.tracked_ranks):
            ax.step(steps, res.tracked_sizes[:, j], where="post", lw=0.9, label="rank %d" % rank)
        ax.set_ylabel("batch size (%s)" % label)
        ax.legend(fontsize=7, ncol=4, loc="upper left")
    for ax in axes:
        for s in (first.change_steps or [])[1:]:
            ax.axvline(s, color="grey", lw=0.5, ls=":")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI


def configure_parser(parser):
    """Options of ``omnihvd simulate``."""
    cl = Cluster()
    co = Control()
    g = parser.add_argument_group("cluster")
    g.add_argument("--ranks", "-n", type=int, default=64, help="number of ranks (default 64)")
    g.add_argument("--global-batch-size", "-B", type=positive(int), default=None,
                   help="global batch (default 32 per rank)")
    g.add_argument("--steps", type=int, default=1400, help="steps to simulate (default 1400)")
    g.add_argument("--profile", choices=PROFILES, default="dynamic",
                   help="speed profile (default: the paper's dynamic schedule)")
    g.add_argument("--base", choices=tuple(HL_LEVELS), default="hl1",
                   help="level under the noisy and drift profiles (default hl1)")
    g.add_argument("--phase-steps", type=positive(int), default=None, help="dynamic: steps per level")
    g.add_argument("--slow-fraction", type=float, default=0.1, help="noisy: fraction slowed")
    g.add_argument("--slowdown", type=positive(float), default=2.0, help="noisy: slow-down factor")
    g.add_argument("--slow-period", type=int, default=200, help="noisy: steps between re-draws")
    g.add_argument("--drift", type=float, default=0.02, help="drift: log-speed step std")
    g.add_argument("--reversion", type=float, default=0.01,
                   help="drift: pull back towards the base speed per step (default 0.01; "
                        "0.1: the speed forgets itself within some ten steps)")
    g.add_argument("--noise", type=float, default=0.1,
                   help="timing noise, coefficient of variation (default 0.1)")
    g.add_argument("--throughput", type=float, default=cl.throughput,
                   help="samples/s of a 12-core rank (default %(default)s)")
    g.add_argument("--overhead", type=float, default=cl.overhead,
                   help="fixed seconds per step of a 12-core rank (default %(default)s)")
    g.add_argument("--gradient-bytes", type=float, default=cl.gradient_bytes,
                   help="bytes allreduced per step (default %(default)g)")
    g.add_argument("--bandwidth", type=float, default=cl.bandwidth,
                   help="link bandwidth, bytes/s (default %(default)g)")
    g.add_argument("--latency", type=float, default=cl.latency,
                   help="per-message latency, s (default %(default)g)")
    c = parser.add_argument_group("controller")
    c.add_argument("--policy", choices=POLICIES, default=co.policy)
    c.add_argument("--deadband", type=float, default=co.deadband)
    c.add_argument("--gain", type=float, default=co.gain)
    c.add_argument("--adjust-every", type=int, default=co.adjust_every)
    c.add_argument("--settle-steps", type=int, default=co.settle_steps)
    c.add_argument("--timing", choices=SUMMARIES, default=co.timing)
    c.add_argument("--latency-steps", type=int, default=co.latency_steps,
                   help="look-ahead of a prefetching loader: steps beyond the next one "
                        "before new sizes start (default 0)")
    c.add_argument("--min-batch-size", type=int, default=1)
    c.add_argument("--max-batch-size", type=int, default=None)
    c.add_argument("--reference", action="store_true",
                   help="use the reference policy instead (proportional, once per epoch, "
                        "dead band 0.2, mean)")
    c.add_argument("--compare", action="store_true",
                   help="also run the reference policy on the same scenario and plot both")
    c.add_argument("--steps-per-epoch", type=int, default=100,
                   help="epoch length of the reference policy (default 100)")
    o = parser.add_argument_group("output")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--out", default="simulate-out", help="directory for JSON and PNG")
    o.add_argument("--every", type=positive(int), default=1, help="keep every k-th step in the JSON series")


def run(args) -> int:
    """Run ``omnihvd simulate``: writes OUT/simulate.json and OUT/simulate.png."""
    B = args.global_batch_size or 32 * args.ranks
    cluster = Cluster(ranks=args.ranks, throughput=args.throughput, overhead=args.overhead,
                      noise=args.noise, gradient_bytes=args.gradient_bytes,
                      bandwidth=args.bandwidth, latency=args.latency)
    ours = Control(policy=args.policy, deadband=args.deadband, gain=args.gain,
                   adjust_every=args.adjust_every, settle_steps=args.settle_steps,
                   timing=args.timing, latency_steps=args.latency_steps,
                   min_batch_size=args.min_batch_size, max_batch_size=args.max_batch_size)
    ref = reference_control(args.steps_per_epoch)
    ref.min_batch_size, ref.max_batch_size = args.min_batch_size, args.max_batch_size
    runs = [("reference", ref)] if args.reference else [("omnihvd", ours)]
    if args.compare and not args.reference:
        runs.append(("reference", ref))
    results = []
    for _, control in runs:
        profile = make_profile(args.profile, args.ranks, args.steps, seed=args.seed, base=args.base,
                               phase_steps=args.phase_steps, slow_fraction=args.slow_fraction,
                               slowdown=args.slowdown, slow_period=args.slow_period,
                               drift=args.drift, reversion=args.reversion)
        results.append(simulate(cluster, profile, global_batch_size=B, steps=args.steps,
                                control=control, seed=args.seed))
    try:   # after the checks of every option: a bad one leaves no folder behind
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        raise ConfigError("cannot create the --out folder %s: %s" % (args.out, exc.strerror)) \
            from None
    doc = {name: res.to_dict(args.every) for (name, _), res in zip(runs, results)}
    json_path = os.path.join(args.out, "simulate.json")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    png_path = os.path.join(args.out, "simulate.png")
    plot(results, png_path, labels=[name for name, _ in runs])
    for (name, _), res in zip(runs, results):
        s = res.summary()
        print("%-9s %d ranks, B=%d, %s, noise %s: steady efficiency %.3f (same-noise %.3f), "
              "speed-up vs equal %.2fx, %d adjustments in %d decisions, decide median %.2f ms, "
              "converged phases %s (max %s steps)"
              % (name, s["ranks"], s["global_batch_size"], s["profile"], noise_label(s["noise"]),
                 s["steady"]["efficiency"], s["steady"]["efficiency_same_noise"],
                 s["steady"]["speedup_vs_equal"], s["adjustments"], s["decisions"],
                 s["decision_ms"]["median"], s["converged_phases"], s["max_steps_to_converge"]))
    print("wrote %s and %s" % (json_path, png_path))
    return 0
