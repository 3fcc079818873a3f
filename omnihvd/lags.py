"""Release lag: how much later after the allreduce a rank resumes than ranks on other CPUs.

A synchronous step ends for every rank when the gradients' allreduce completes, but
not every rank resumes at that moment: each must notice the completion, and ranks
that share a core do so one after another. On this project's 2-core machine (one
rank alone on a core, three sharing the other; per-step timestamps of every rank,
docs/real-heterogeneity.rst "Release lag") the three returned from the gradients'
synchronize 2.3-5.4 ms after the lone rank, on average and at every split tried,
in steps of 42-50 ms. That delay is in no rank's local time (which starts at
``on_batch_begin`` and takes the update after the synchronize as the next step's
work), yet it delays the rank's next arrival one for one: balancing local times
left the three co-located ranks arriving 4-5 ms after the lone one, and the split
whose *arrivals* were equal (the lone rank's local time 2-4 ms longer) was 5% faster.

So with ``release_lag=True`` the controller balances each rank's local time plus its
release lag. What is charged is the lag of a *group*: the ranks of one machine that
run on the same CPUs (their affinity, :func:`cpuset_key`), each charged the group's
mean lag behind the first rank of the machine on other CPUs. Within a group the
ranks take turns, and who goes first shifts with the split: a first version that
charged each rank its own place in the order (behind the machine's first rank) made
ranks of equal speed unequal where several ranks share every core (sleep-emulated
speeds on 4 ranks over 2 cores: 53 and 75 samples, 17% slower than plain Horovod),
while in 3:1:1:1 it ran at 1.04x (1.02-1.14) the controller without it
(docs/real-heterogeneity.rst, "Release lag"). Ranks that all share their CPUs, or
each have their own, are charged about nothing.

Ranks under CPU quotas are charged the same way. Under a quota a rank also resumes
late when its quota for the period is spent, and ranks of equal quotas on one core
resume in turns: the first version, charging each rank its own lag, put two ranks of
equal quotas at 17-27 and 24-28 samples (25-28 both without it) and ran at 0.985 of
the split without it (HL8 quotas with core sets). Charged by groups, over 15 launches
there the split ran at 1.007 (0.993-1.027) of the one without (without: 0.970 of the
best fixed split), and over 20 at 0.990 (0.976-1.001) of the best fixed split; with
quotas 100/60/30% and core sets at 0.997 (0.962-1.021), under HL4 quotas with core
sets at 0.996 (0.934-1.001) of the one without and 0.987 (0.972-0.997) of the best
fixed split over 25 launches (docs/real-heterogeneity.rst).

A rank is charged only what follows its own arrival (the moment it began to wait):
a rank still working when the others were released -- the last to arrive, whose
gradients' allreduce completed while it ran on after its backward pass (a sleep,
clipping, logging before ``opt.step()``) -- resumes late by time already in its
local time. Charged from the others' release, the slow one of 2 ranks on their own
cores (the example's ``--slowdown 1,3``, ``mpirun``'s default binding) was charged
its 0.08-0.36 s of work twice: the first decision went to 224/32 in 11 of 11 runs
and the second to 248/8 in 6 (192/64 balances); charged from its arrival, 0.2-1.3
ms, and 196-224 / 187-230 (noisy times: the full test suite ran beside them).

How it is measured: each rank notes the moment its synchronize returns (where its
update begins) and the moment it began to wait, on the clock ``time.perf_counter``
reads, which is the system's monotonic clock and the same for every process of one
machine (one boot). Every window, these moments of its steps are gathered aligned by
step (like :mod:`omnihvd.arrivals`), with each rank's machine (:func:`host_key`) and CPUs
(:func:`release_lags`). Ranks on different machines are not compared (their clocks
are not the same). :class:`LagPool` keeps each rank's last :data:`LAG_SAMPLES` lags;
its charge is their mean with the rarest slowest winsorised (a one-off pause is not a
lag). A lag above :data:`MAX_LAG` seconds is taken as a clock that is not shared
after all (a container with its own time namespace) and left out.

Pure numpy, deterministic: the same table gives the same charges on every rank.

>>> import numpy as np
>>> releases = np.array([[100.000, 100.004, 100.002],
...                      [100.050, 100.053, 100.055]])
>>> # rank 0 alone on its CPUs, ranks 1 and 2 sharing theirs: each charged their mean
>>> release_lags(releases, hosts=[7.0] * 3, cpusets=[1.0, 2.0, 2.0]).round(4).tolist()
[[0.0, 0.003, 0.003], [0.0, 0.004, 0.004]]
>>> release_lags(releases, hosts=[7.0] * 3, cpusets=[2.0] * 3).tolist()   # all on one set
[[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
"""
import functools
import os
import socket
import zlib
from typing import NamedTuple

import numpy as np

from .payload import digest
from .timing import _clip_rare

__all__ = ["LAG_SAMPLES", "MIN_LAGS", "MAX_LAG", "host_key", "cpuset_key", "release_lags",
           "Placement", "placement_groups", "LagPool"]

# Lags kept per rank: the steps of a few windows (one window sends up to 32).
LAG_SAMPLES = 64
# Fewer lags than this: the rank's lag is unknown (charged nothing).
MIN_LAGS = 8
# A larger lag means the clocks compared are not one clock: that step is left out.
MAX_LAG = 1.0


def host_key() -> float:
    """This machine's identity as a float-exact number: the crc32 of its boot id
    (the same in every container on one kernel, whose monotonic clock they share),
    or of its host name where there is no boot id.

    >>> host_key() == host_key() and 0 <= host_key() < 2 ** 32
    True
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            name = f.read().strip()
    except OSError:
        name = socket.gethostname() or str(os.getpid())
    return float(zlib.crc32(name.encode()))


def cpuset_key() -> float:
    """The CPUs this process may run on, as a float-exact number (the
    :func:`omnihvd.payload.digest` of their sorted list; 0 where the platform does
    not say).

    >>> cpuset_key() == cpuset_key() and 0 <= cpuset_key() < 2 ** 32
    True
    """
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is None:
        return 0.0
    return digest(sorted(affinity(0)))


def release_lags(releases, hosts, cpusets, arrived=None) -> np.ndarray:
    """Each rank's lag in each step: how much later than the first rank of its
    machine *on other CPUs* the ranks on its own CPUs resumed, on average (NaN where
    its release is missing or a lag exceeds :data:`MAX_LAG`).

    With ``arrived``, a rank's lag is counted from the later of that first release
    and its own arrival (the moment it began to wait): a rank that was still working
    when the others were released (the last to arrive, whose gradients' allreduce
    completed while it worked on after its backward pass) resumes late by time that
    is already in its local time, and is not charged it again.

    A group of ranks on the same CPUs takes turns on them, and the order of the turns
    shifts with the split: charging each its own place in the order made ranks of
    equal speed unequal (4 ranks over 2 shared cores). What the group as a whole
    resumes later than the ranks on other CPUs is what its placement costs, so every
    member is charged the group's mean. A group that resumed first, or that has no
    other CPUs beside it on its machine, has lag 0.

    Args:
        releases: ``(steps, ranks)`` release times, seconds on each machine's
            monotonic clock (NaN: none), aligned by step.
        hosts: one :func:`host_key` per rank.
        cpusets: one :func:`cpuset_key` per rank (a rank whose machine or CPUs are
            NaN is neither charged nor compared with).
        arrived: optional ``(steps, ranks)`` arrival moments of the same steps, on
            the same clocks (NaN: none; None: lags counted from the first release).
    """
    r = np.asarray(releases, dtype=np.float64)
    a = None if arrived is None else np.asarray(arrived, dtype=np.float64)
    if a is not None and a.shape != r.shape:
        a = None
    h = np.asarray(hosts, dtype=np.float64)
    c = np.asarray(cpusets, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] != h.size or c.shape != h.shape:
        return np.full(r.shape, np.nan)
    g = placement_groups(h, c)
    compared = _compared_lags(r, a, g) if g.columns.size else None
    if g.alone.size == 0 and g.columns.size == h.size and g.in_order:
        return compared.T
    lags = np.full(r.shape[::-1], np.nan)
    # a group alone on its machine resumes behind no other CPUs: lag 0
    lags[g.alone] = np.where(np.isfinite(r.T[g.alone]), 0.0, np.nan)
    if compared is not None:
        lags[g.columns] = compared
    return lags.T


def _compared_lags(r, a, g) -> np.ndarray:
    """:func:`release_lags` of the ranks ``g.columns`` (``(columns, steps)``): those
    with other CPUs on their machine."""
    # (ranks, steps), one row per rank compared: rows gather fast. At thousands of
    # ranks each new (ranks, steps) array costs more (fresh pages) than the
    # arithmetic on it, hence the few arrays, reused in place.
    x = r.T[g.columns]
    seen = np.isfinite(x)
    x[~seen] = np.inf   # no release: first of nothing, and no lag
    singles = g.group_starts.size == g.columns.size   # every group a single rank
    first_of_group = x if singles else _per_run(np.minimum, x, g.group_starts)
    first = _first_of_others(first_of_group, g)
    start = first if singles else first[g.group]
    if a is None:
        behind = x - start
    else:   # not before its own arrival (where known)
        behind = a.T[g.columns]
        behind[~np.isfinite(behind)] = np.nan
        np.fmax(start, behind, out=behind)
        behind[np.isnan(start)] = np.nan   # no other CPUs' release: no lag
        np.subtract(x, behind, out=behind)
    with np.errstate(invalid="ignore"):
        np.maximum(behind, 0.0, out=behind)
    if singles:   # a rank a group: its own lag
        compared = behind
    else:   # the group's mean, summed member after member, as the mean of each alone
        counted = np.isfinite(behind)
        behind[~counted] = 0.0
        total = _per_key(np.add, g.group, behind, 0.0)
        count = _per_run(np.add, counted, g.group_starts, dtype=np.int64)
        with np.errstate(invalid="ignore", divide="ignore"):
            compared = np.where(count > 0, total / np.maximum(count, 1), np.nan)[g.group]
        compared[~seen] = np.nan
    with np.errstate(invalid="ignore"):
        compared[~(compared <= MAX_LAG)] = np.nan   # NaN stays, too large becomes NaN
    return compared


def _first_of_others(first_of_group, g) -> np.ndarray:
    """Each group's first release of the *other* groups of its machine, per step
    (NaN: none): the machine's first, or its second for the one group first alone
    (``first_of_group``: ``(groups, steps)``, inf where none)."""
    best = _per_run(np.minimum, first_of_group, g.host_starts)   # (machines, steps)
    first = best[g.host_of_group]
    is_best = first_of_group == first
    alone_first = _per_run(np.add, is_best, g.host_starts, dtype=np.int64) == 1
    second = _per_run(np.minimum, np.where(is_best, np.inf, first_of_group), g.host_starts)
    groups, steps = np.nonzero(is_best & alone_first[g.host_of_group])
    first[groups, steps] = second[g.host_of_group[groups], steps]
    first[np.isinf(first)] = np.nan
    return first


class Placement(NamedTuple):
    """The ranks of :func:`release_lags` by group (the ranks of one machine on the
    same CPUs), as :func:`placement_groups` finds them."""

    alone: np.ndarray          # ranks of a group alone on its machine (lag 0)
    columns: np.ndarray        # the other ranks, by machine, then CPUs, then rank
    group: np.ndarray          # each column's group, 0, 1, ... (non-decreasing)
    group_starts: np.ndarray   # each group's first column
    host_of_group: np.ndarray  # each group's machine, 0, 1, ... (non-decreasing)
    host_starts: np.ndarray    # each machine's first group
    in_order: bool             # columns are the ranks in order (all compared)


def placement_groups(hosts, cpusets) -> Placement:
    """The ranks compared by :func:`release_lags`, grouped: once per placement (the
    same ``hosts`` and ``cpusets`` give the same, read-only :class:`Placement`: every
    window of a run but the first finds it cached). Ranks whose machine or CPUs are
    NaN are in neither ``alone`` nor ``columns``.

    >>> g = placement_groups([1.0, 1.0, 2.0, 1.0, 3.0], [5.0, 4.0, 4.0, 5.0, float("nan")])
    >>> g.alone.tolist(), g.columns.tolist(), g.group.tolist(), g.host_of_group.tolist()
    ([2], [1, 0, 3], [0, 1, 1], [0, 0])
    """
    h = np.asarray(hosts, dtype=np.float64)
    c = np.asarray(cpusets, dtype=np.float64)
    return _placement_groups(h.tobytes(), c.tobytes())


@functools.lru_cache(maxsize=4)
def _placement_groups(hosts: bytes, cpusets: bytes) -> Placement:
    h, c = np.frombuffer(hosts), np.frombuffer(cpusets)
    known = np.flatnonzero(np.isfinite(h) & np.isfinite(c))   # ranks with no machine: no lag
    # One pass over all ranks (a loop over the groups, each masking all ranks, made the
    # decision quadratic: 0.65 s at 4096 ranks): the ranks sorted by machine, then
    # CPUs, so that a group is a run of them and a machine a run of groups.
    columns = known[np.lexsort((c[known], h[known]))]
    new_host = np.r_[True, h[columns][1:] != h[columns][:-1]]
    new_group = new_host | np.r_[True, c[columns][1:] != c[columns][:-1]]
    group = np.cumsum(new_group) - 1
    host_of_group = np.cumsum(new_host[new_group]) - 1
    alone_group = np.bincount(host_of_group)[host_of_group] == 1 if columns.size else \
        np.zeros(0, dtype=bool)
    alone = alone_group[group] if columns.size else np.zeros(0, dtype=bool)
    kept = columns[~alone]
    kept_new_host = np.r_[True, h[kept][1:] != h[kept][:-1]]
    kept_new_group = kept_new_host | np.r_[True, c[kept][1:] != c[kept][:-1]]
    out = Placement(alone=np.sort(columns[alone]), columns=kept,
                    group=np.cumsum(kept_new_group) - 1,
                    group_starts=np.flatnonzero(kept_new_group),
                    host_of_group=np.cumsum(kept_new_host[kept_new_group]) - 1,
                    host_starts=np.flatnonzero(kept_new_host[kept_new_group]),
                    in_order=bool(np.array_equal(kept, np.arange(h.size))))
    for array in out[:-1]:
        array.flags.writeable = False   # shared by every call of this placement
    return out


def _per_run(ufunc, values, starts, dtype=None) -> np.ndarray:
    """``ufunc`` over each run of rows of ``values`` (run ``i`` from row ``starts[i]``
    to the next run's start), column by column: ``(len(starts), columns)``, in
    ``dtype`` (default: the values'). For the ufuncs whose result does not depend on
    the order of the rows (``np.minimum``, and ``np.add`` of integers); runs all of
    one length are one reshape."""
    size = values.shape[0] // starts.size
    if size * starts.size == values.shape[0] and np.all(np.diff(starts) == size):
        return ufunc.reduce(values.reshape(starts.size, size, -1), axis=1, dtype=dtype)
    return ufunc.reduceat(values, starts, axis=0, dtype=dtype)


def _per_key(ufunc, keys, values, initial) -> np.ndarray:
    """``ufunc`` over the rows of ``values`` of each key, column by column, row after
    row (a sum in the same order as each key's alone): ``(keys[-1] + 1, columns)``
    (``keys`` non-decreasing from 0), ``initial`` where a key has no row. One flat
    ``ufunc.at`` (``reduceat`` adds in another order)."""
    width = values.shape[1]
    out = np.full((int(keys[-1]) + 1) * width, initial)
    # as float64 (ufunc.at takes a slow path for other types, 20x slower for bools)
    ufunc.at(out, (keys[:, None] * width + np.arange(width)).ravel(),
             np.asarray(values, dtype=np.float64).ravel())
    return out.reshape(-1, width)


class LagPool:
    """Each rank's last :data:`LAG_SAMPLES` release lags, and the charge they make.

    Same tables in, same pool out, on every rank. :meth:`forget` it when the ranks
    or their placement change.

    >>> pool = LagPool(2)
    >>> pool.add(release_lags([[100.0, 100.004]] * 8, hosts=[1.0, 1.0], cpusets=[1.0, 2.0]))
    >>> pool.charges().round(4).tolist()
    [0.0, 0.004]
    """

    def __init__(self, num_ranks: int, samples: int = LAG_SAMPLES):
        self.num_ranks = int(num_ranks)
        self.samples = int(samples)
        # each rank's lags in a row, oldest first, in the last _held columns (the rows
        # move left as lags come in: no new array per window)
        self._lags = np.full((self.num_ranks, self.samples), np.nan)
        self._scratch = np.empty_like(self._lags)
        self.forget()

    def forget(self):
        self._lags[:] = np.nan
        self._held = 0
        self._charges = np.zeros(self.num_ranks)

    def add(self, lags):
        """Add one window's ``(steps, ranks)`` lags (:func:`release_lags`; NaN: none)."""
        lags = np.asarray(lags, dtype=np.float64)
        if lags.ndim == 2 and lags.shape[1] == self.num_ranks:
            new = lags.T[:, lags.shape[0] - min(lags.shape[0], self.samples):]
            steps = new.shape[1]
            if steps:
                self._lags[:, :self.samples - steps] = self._lags[:, steps:]
                self._lags[:, self.samples - steps:] = new
                self._held = min(self._held + steps, self.samples)
            self._charges = self._mean_lags()

    def _pooled(self) -> np.ndarray:
        """Each rank's held lags: ``(ranks, held)``, oldest first."""
        return self._lags[:, self.samples - self._held:]

    def counts(self) -> np.ndarray:
        """How many lags each rank holds."""
        return np.isfinite(self._pooled()).sum(axis=1)

    def charges(self) -> np.ndarray:
        """Seconds to add to each rank's local time: the mean of its pooled lags, the
        slowest tenth winsorised (:func:`omnihvd.timing.sustained_step_time`'s
        rule); 0 below :data:`MIN_LAGS` lags. Computed once per :meth:`add`."""
        return self._charges.copy()

    def _mean_lags(self) -> np.ndarray:
        if not self._held:
            return np.zeros(self.num_ranks)
        # a rank's lags in a row, clipped in a scratch array (at thousands of ranks a
        # new one costs more, in fresh pages, than the sort)
        clipped, counts = _clip_rare(self._pooled(), axis=1,
                                     out=self._scratch[:, self.samples - self._held:])
        clipped[np.isnan(clipped)] = 0.0   # np.nansum's sum, without its copy
        total = clipped.sum(axis=1)
        return np.where(counts >= MIN_LAGS, total / np.maximum(counts, 1), 0.0)
