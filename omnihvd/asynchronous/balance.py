"""Batch-size control for asynchronous training: equalise the workers' update intervals.

With a parameter server there is no barrier, so there is no step time to equalise:
each worker pushes whenever its batch is done. What differs between workers is their
*update interval*, the time from one push to the next (compute on ``b_i`` samples plus
the round trip to the server). Unequal intervals mean fast workers push many fresh
updates while slow workers push few, stale ones. Giving each worker a batch
proportional to its speed makes every interval the same, so every worker pushes at the
same rate and staleness settles at ``workers - 1`` for everyone.

That is the synchronous problem with "step time" replaced by "update interval", so
the same :class:`omnihvd.cadence.Cadence` and :class:`omnihvd.controller.Controller`
(same policies, options, estimator and noise gate) decide; only the measurement
differs: one window per worker, since workers push at their own pace. One balancer runs on server 0, which sees every push;
the decision reaches each worker in the reply to its next push.

Also here: :func:`staleness_scale`, the optional staleness-aware learning rate.
"""
import math
from typing import List, Optional

from ..cadence import Cadence, close_window
from ..checks import check_choice, check_int
from ..controller import DEFAULT_DEADBAND, Controller, initial_split
from ..errors import ConfigError
from ..timing import DEFAULT_SUMMARY, TimingWindow

__all__ = ["IntervalBalancer", "staleness_scale", "STALENESS_LR_MODES"]

STALENESS_LR_MODES = (None, "inverse")


def staleness_scale(staleness: int, num_workers: int, mode: Optional[str] = None) -> float:
    """Learning-rate multiplier for one update of the given staleness.

    ``mode=None``: 1 (plain asynchronous SGD). ``mode="inverse"``:
    ``min(1, tau0 / staleness)`` with ``tau0 = max(1, num_workers - 1)``, the staleness
    every update has when workers take turns perfectly. Updates no staler than that
    keep the full rate; staler ones are damped in proportion (the 1/staleness rule of
    Zhang et al., "Staleness-aware Async-SGD", IJCAI 2016, normalised so that a
    balanced cluster keeps its learning rate).

    Raises:
        ConfigError: unknown mode, negative staleness.

    >>> [staleness_scale(t, 4, "inverse") for t in (0, 3, 6, 30)]
    [1.0, 1.0, 0.5, 0.1]
    """
    check_choice("staleness_lr", mode, STALENESS_LR_MODES)
    if staleness < 0:
        raise ConfigError("staleness must be >= 0, got %r" % (staleness,))
    if mode is None:
        return 1.0
    tau0 = max(1, int(num_workers) - 1)
    return min(1.0, tau0 / staleness) if staleness > 0 else 1.0


class IntervalBalancer:
    """Per-worker batch sizes that equalise update intervals (runs on server 0).

    Args:
        num_workers: number of workers.
        global_batch_size: B = sum of the workers' batch sizes, held exactly.
        balance: False keeps the initial sizes for the whole run (equal batches
            unless ``initial_batch_sizes`` says otherwise).
        initial_batch_sizes: one size per worker; default an equal split of B.
        adjust_every: decide after every ``adjust_every`` rounds, a round being
            ``num_workers`` updates (one per worker on average: as many gradients per
            decision as the synchronous callback's ``adjust_every`` steps).
        settle_steps: samples dropped per worker after each change of sizes.
        timing: summary of each worker's intervals (``"sustained"``, the default,
            ``"median"`` or ``"mean"``: see :func:`omnihvd.timing.robust_step_time`).
        policy, gain, deadband, min_batch_size, max_batch_size, history: as for
            :class:`omnihvd.controller.Controller`.

    Raises:
        ConfigError, InfeasibleError: bad options (as the controller raises them).

    >>> bal = IntervalBalancer(2, 60, adjust_every=1, settle_steps=0, policy="proportional")
    >>> bal.sizes
    [30, 30]
    >>> bal.record(0, 30, 0.4); bal.record(1, 30, 0.2)   # worker 1 is twice as fast
    >>> bal.after_update(), bal.after_update()
    (False, True)
    >>> bal.sizes
    [20, 40]
    """

    def __init__(self, num_workers: int, global_batch_size: int, *, balance: bool = True,
                 initial_batch_sizes=None, adjust_every: int = 20, settle_steps: int = 1,
                 timing: str = DEFAULT_SUMMARY, policy: str = "affine", gain: float = 1.0,
                 deadband: float = DEFAULT_DEADBAND, min_batch_size=1, max_batch_size=None,
                 history: int = 8):
        self.controller = Controller(num_workers, global_batch_size, policy=policy, gain=gain,
                                     deadband=deadband, min_batch_size=min_batch_size,
                                     max_batch_size=max_batch_size, history=history)
        check_int("adjust_every", adjust_every, 1, "rounds of one update per worker")
        self.num_workers = num_workers
        self.global_batch_size = global_batch_size
        self.balance = bool(balance)
        self.adjust_every = adjust_every
        # One decision per adjust_every rounds of num_workers updates each.
        self._cadence = Cadence(self.controller, adjust_every=adjust_every * num_workers,
                                settle_steps=settle_steps, timing=timing)
        self.sizes: List[int] = initial_split(num_workers, global_batch_size, self.controller.lo,
                                              self.controller.hi, initial_batch_sizes,
                                              member="worker")
        self._windows = [TimingWindow(settle_steps, timing) for _ in range(num_workers)]
        self._updates = 0   # since the last decision
        self._total = 0     # since the start: the cadence's step counter
        self._frozen = False
        self.history: List[dict] = []

    def record(self, worker: int, batch_size: int, interval_s: float):
        """Offer one push's update interval; pushes at a superseded size are ignored."""
        if batch_size == self.sizes[worker] and math.isfinite(interval_s) and interval_s > 0:
            self._windows[worker].add(interval_s)

    def freeze(self):
        """Stop deciding (once a worker has left, its interval means nothing)."""
        self._frozen = True

    def after_update(self, **info) -> bool:
        """Count one applied update; decide when due. Returns whether the sizes changed.

        Keyword arguments (e.g. the server's version and clock) are stored with the
        decision in :attr:`history`.
        """
        self._updates += 1
        self._total += 1
        if not self.balance or self._frozen:
            return False
        if self._updates < self._cadence.adjust_every:
            return False
        if any(len(w) == 0 for w in self._windows):
            return False  # a slow worker has not reported at its current size yet
        # There is no collective to keep in step here, so the window closes when
        # every worker has reported, and a change takes effect with the next replies.
        measured = [close_window(w) for w in self._windows]
        times = [m.time for m in measured]
        decision = self._cadence.decide(self._total, self.sizes, times,
                                        [m.error for m in measured], [m.count for m in measured])
        changed = decision.changed
        self.history.append(dict(info, sizes=list(self.sizes), times=times,
                                 new_sizes=list(decision.new_sizes or self.sizes),
                                 changed=changed))
        self._updates = 0
        for w in self._windows:
            w.reset(settle=changed)
        if changed:
            self.sizes = list(decision.new_sizes)
        return changed
