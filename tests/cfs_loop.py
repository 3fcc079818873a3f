"""A closed loop of synchronous ranks under CFS quotas, timed by omnihvd's StepTimer
and driven by its cadence and controller (pure; used by tests/test_quota.py).

Each rank needs ``a + c*b`` CPU seconds per step (times a little noise); in every
``period`` it may run ``quota * period`` seconds and then stalls until the period
ends. All ranks start a step together (they left the previous allreduce together),
a step lasts until the slowest rank's local work ends plus ``comm``, and a rank
that waits for the others is idle: waiting costs no quota, so it refills.
"""
import math

import numpy as np

from omnihvd.cadence import Cadence, close_window
from omnihvd.controller import Controller, initial_split
from omnihvd.timing import StepTimer


class QuotaRank:
    """One rank's CFS state, its wall and CPU clocks, and an omnihvd StepTimer."""

    def __init__(self, quota, period=0.010, phase=0.0, quota_aware=True):
        self.budget = quota * period
        self.period = period
        self.phase = phase
        self.index, self.used = None, 0.0
        self.wall = self.cpu = 0.0
        self.timer = StepTimer(clock=lambda: self.wall, cpu_clock=lambda: self.cpu,
                               cpu_cores=quota if quota_aware and quota < 1 else None)

    def run(self, work):
        """Run ``work`` CPU seconds from the current wall time; returns the wall seconds."""
        t = begin = self.wall + self.phase
        while work > 1e-15:
            index = math.floor(t / self.period + 1e-12)
            if index != self.index:
                self.index, self.used = index, 0.0
            end = (index + 1) * self.period
            if self.used >= self.budget - 1e-15:
                t = end
                continue
            run = min(work, self.budget - self.used, end - t)
            self.used, t, work, self.cpu = self.used + run, t + run, work - run, self.cpu + run
        self.wall += t - begin
        return t - begin

    def step(self, start, work):
        """One step from wall time ``start``: (local time measured, wall seconds worked)."""
        self.wall = start
        self.timer.start()
        wall = self.run(work)
        self.timer.mark_wait()
        return self.timer.stop(), wall


def run_loop(quotas, global_batch_size, steps, *, timing="sustained", fixed=None, a=0.0002,
             c=0.0001, comm=0.0003, adjust_every=20, phases=None, quota_aware=True, seed=0):
    """Run ``steps`` steps; returns (sizes per step (steps, n), step times (steps,))."""
    n = len(quotas)
    rng = np.random.default_rng(seed)
    phases = [0.0] * n if phases is None else phases
    ranks = [QuotaRank(q, phase=p, quota_aware=quota_aware) for q, p in zip(quotas, phases)]
    ctl = Controller(n, global_batch_size, deadband=0.05)
    cadence = Cadence(ctl, adjust_every=adjust_every, settle_steps=1, timing=timing)
    sizes = np.asarray(fixed if fixed is not None else
                       initial_split(n, global_batch_size, ctl.lo, ctl.hi), dtype=np.int64)
    t = 0.0
    all_sizes, step_times = np.empty((steps, n), dtype=np.int64), np.empty(steps)
    for k in range(steps):
        if fixed is None:
            sizes = np.asarray(cadence.sizes_for(k, sizes), dtype=np.int64)
        cadence.begin_step(sizes)
        work = (a + c * sizes) * rng.lognormal(0.0, 0.02, n)
        measured = [r.step(t, w) for r, w in zip(ranks, work)]
        cadence.record(np.array([m for m, _ in measured]))
        if fixed is None and cadence.gathers_at(k):
            m = close_window(cadence.window)
            cadence.decide(k, sizes, m.time, m.error, m.count)
        all_sizes[k] = sizes
        step_times[k] = max(w for _, w in measured) + comm
        t += step_times[k]
    return all_sizes, step_times


def best_fixed_split(quotas, global_batch_size, *, grid=4, steps=300, **kw):
    """The fixed split of least mean step time over a grid of splits (3 ranks)."""
    best = None
    B = global_batch_size
    for b0 in range(grid, B, grid):
        for b1 in range(grid, B - b0, grid):
            split = [b0, b1, B - b0 - b1]
            _, times = run_loop(quotas, B, steps, fixed=split, **kw)
            mean = float(times[steps // 6:].mean())
            if best is None or mean < best[0]:
                best = (mean, split)
    return best
