"""Alike ranks: ranks on the same kind of resources, held at equal batch sizes.

Ranks on one machine with the same CPUs, the same CPU quota and the same kind of
accelerator are *alike*: a user who knew the hardware would give them the same
batch size, and so does the controller -- as long as their measured times agree.
Without it their sizes drift apart wherever the time model cannot tell them apart:
ranks that share a core finish one after another, so a rank's time hardly grows
with its own size (a third of the rate on three ranks sharing a core) and a split
of 36/30 between two of them looks balanced within the noise. On this project's
2-core machine the three ranks sharing a core ended as far apart as 1.20x
(docs/real-heterogeneity.rst, "Alike ranks"). Ranks sharing a core cost the same
however they divide it, and ranks of equal speed each on their own CPUs are
fastest at equal sizes, so holding them equal costs nothing and spares the
controller a noisy choice.

So is the user's own split: ranks that ``initial_batch_sizes`` sets apart (by more
than one size unit, :func:`size_classes`) are never alike, whatever their
resources -- at unequal sizes their times cannot show whether they are alike.

The resources are a claim, not a fact: a rank may be slower than its kind says
(a sleep in the training script, a throttled GPU, a noisy neighbour pinned to one
core). Each decision therefore compares the members of a group at their equal
sizes: a member whose time differs from the group's median (relative to the
smaller of the two, so that faster counts as much as slower) by more than
:data:`OBVIOUS` in two windows in a row (twice that in the group's first), or by
more than :data:`TOLERANCE` on average over its last windows and significantly so,
leaves the group and is balanced on its own from then on (until the ranks'
resources change). One window is not enough for a
small difference: three ranks sharing a core measured up to 14% apart in single
windows at equal sizes, and not the same one each time. Ranks sharing a core can
also differ by their turn on it: in one of three 2:1:1 launches one of the pair
measured 7-9% slower at either size, window after window, and was let go.

Pure numpy and deterministic: the same tables give the same groups on every rank.

>>> groups = AlikeGroups()
>>> groups.update(kinds=[5.0, 7.0, 7.0, 7.0])
>>> groups.groups()
[[1, 2, 3]]
>>> groups.equal_shares([130, 45, 41, 40]).tolist()
[130.0, 42.0, 42.0, 42.0]
>>> groups.confirm(sizes=[130, 42, 42, 42], times=[0.05, 0.050, 0.051, 0.075])
[3]
>>> groups.groups()   # rank 3 is slower than its kind says
[[1, 2]]
"""
import zlib
from typing import List, Optional, Sequence

import numpy as np

from .lags import cpuset_key, host_key

__all__ = ["TOLERANCE", "WINDOWS", "MIN_WINDOWS", "OBVIOUS", "kind_key", "this_kind",
           "size_classes", "AlikeGroups"]

# A member leaves its group when its time differs from the group's median (beyond
# its difference in size) by more than TOLERANCE on average over its last WINDOWS
# windows (at least MIN_WINDOWS of them), significantly; or by more than OBVIOUS in
# two windows in a row, or twice OBVIOUS in the group's first window (a rank with
# two thirds of the CPU its kind says leaves at the first).
TOLERANCE = 0.05
WINDOWS = 8
MIN_WINDOWS = 3
OBVIOUS = 0.2


def kind_key(host: float, cpuset: float, cpu_cores: Optional[float],
             devices: Sequence[str] = (), size_class: Optional[int] = None) -> float:
    """A float-exact number that is the same on ranks with the same resources: the
    crc32 of the machine (:func:`omnihvd.lags.host_key`), its CPUs
    (:func:`omnihvd.lags.cpuset_key`), the CPU quota in cores (None: none) and the
    accelerators' names (``torch.cuda.get_device_name``; their indices left out: two
    GPUs of one model are alike), and the rank's class in the user's initial split
    (:func:`size_classes`; None: no split given).

    >>> kind_key(1.0, 5.0, 0.5) == kind_key(1.0, 5.0, 0.5) != kind_key(1.0, 5.0, 0.3)
    True
    >>> kind_key(1.0, 5.0, None, size_class=0) != kind_key(1.0, 5.0, None, size_class=1)
    True
    """
    cores = None if cpu_cores is None else round(float(cpu_cores), 4)
    key = (float(host), float(cpuset), cores, list(devices))
    if size_class is not None:
        key += (int(size_class),)
    return float(zlib.crc32(repr(key).encode()))


def this_kind(cpu_cores: Optional[float], devices: Sequence[str] = (),
              host: Optional[float] = None, cpuset: Optional[float] = None,
              size_class: Optional[int] = None) -> float:
    """:func:`kind_key` of this process: its machine (``host``, default
    :func:`omnihvd.lags.host_key`), the CPUs it may run on now (``cpuset``, default
    :func:`omnihvd.lags.cpuset_key`), ``cpu_cores``, ``devices`` and ``size_class``.

    >>> this_kind(None) == this_kind(None) != this_kind(0.5)
    True
    """
    return kind_key(host_key() if host is None else host,
                    cpuset_key() if cpuset is None else cpuset, cpu_cores, devices, size_class)


def size_classes(sizes: Sequence[int], unit: int = 1) -> List[int]:
    """Each rank's class in a split: sizes within ``unit`` of the next larger one
    (as rounding leaves an equal split) are one class, numbered from the smallest.

    >>> size_classes([14, 7, 3]), size_classes([34, 33, 33]), size_classes([16, 16, 8, 8])
    ([2, 1, 0], [0, 0, 0], [1, 1, 0, 0])
    """
    order = sorted(set(int(b) for b in sizes))
    classes, current = {}, 0
    for i, b in enumerate(order):
        if i and b - order[i - 1] > unit:
            current += 1
        classes[b] = current
    return [classes[int(b)] for b in sizes]


def _relative(value, ref):
    """How far ``value`` lies from ``ref``, relative to the smaller of the two: a rank
    1.5x faster than its group is as far from it as one 1.5x slower (0.5 and -0.5).

    >>> _relative(np.array([0.075, 0.05]), np.array([0.05, 0.075])).round(3).tolist()
    [0.5, -0.5]
    """
    return (value - ref) / np.minimum(value, ref)


def _group_medians(values, label, counts) -> np.ndarray:
    """The median of each group's ``values`` (``label``: each value's group, 0 to
    ``len(counts) - 1``; ``counts``: each group's number of values, all > 0), as
    ``np.median`` gives it for each group alone, for all groups in one pass.

    >>> _group_medians(np.array([3.0, 9.0, 1.0, 2.0, 5.0]), np.array([0, 1, 0, 0, 1]),
    ...                np.array([3, 2])).tolist()
    [2.0, 7.0]
    """
    ordered = values[np.lexsort((values, label))]   # by group, then by value
    first = np.cumsum(counts) - counts
    return (ordered[first + (counts - 1) // 2] + ordered[first + counts // 2]) / 2.0


class AlikeGroups:
    """Which ranks are alike, from their :func:`kind_key` and their measured times."""

    def __init__(self):
        self._kinds: Optional[np.ndarray] = None
        self._apart = set()    # ranks measured unlike their kind
        self._groups = None    # groups() of these kinds and _apart (None: not found yet)
        # each rank's last WINDOWS deviations from its group, newest in the last row
        # (NaN: none), one column per rank
        self._deviations: Optional[np.ndarray] = None

    def update(self, kinds):
        """The ranks' :func:`kind_key` of this window (None: no groups); a change of
        any rank's resources forgets what was measured of them."""
        k = None if kinds is None else np.asarray(kinds, dtype=np.float64)
        if k is None or self._kinds is None or not np.array_equal(k, self._kinds, equal_nan=True):
            self._apart, self._groups = set(), None
            self._deviations = None if k is None else np.full((WINDOWS, k.size), np.nan)
        self._kinds = k

    def groups(self) -> List[List[int]]:
        """The groups of two or more alike ranks, lowest rank first."""
        if self._groups is None:
            self._groups = self._find_groups()
        return [list(g) for g in self._groups]

    def _find_groups(self) -> List[List[int]]:
        if self._kinds is None:
            return []
        ranks = np.flatnonzero(~np.isnan(self._kinds))
        ranks = ranks[~np.isin(ranks, list(self._apart))]
        ranks = ranks[np.argsort(self._kinds[ranks], kind="stable")]   # by kind, then rank
        kinds = self._kinds[ranks]
        starts = np.flatnonzero(np.r_[True, kinds[1:] != kinds[:-1], True])
        found = [ranks[i:j].tolist() for i, j in zip(starts[:-1], starts[1:]) if j - i > 1]
        return sorted(found, key=lambda g: g[0])

    def confirm(self, sizes, times, significance: float = 3.0) -> List[int]:
        """Let the members whose times differ from their group's leave it; returns them.

        A member's *deviation* in one window is how far its time lies from the
        group's median time (a pair's: the other's), relative to the smaller of the
        two (a faster member as far as a slower one), beyond how far its size lies
        from the median size (sizes one apart, as rounding leaves
        alike ranks, explain up to that much: ranks sharing a core take the same
        time at either size, ranks each on their own CPUs proportionally more). It
        leaves when its deviation exceeds :data:`OBVIOUS` in two windows in a row
        the same way (twice that in the group's first window), or when the mean of
        its last :data:`WINDOWS` (at least :data:`MIN_WINDOWS`) exceeds
        :data:`TOLERANCE` and ``significance`` standard errors of that mean (from
        the windows' spread: one window's time strays by more than its own steps
        show, most of all on shared cores). One window is not enough after the
        first: in one 3:1:1:1 launch a disturbed window put one of the three 32%
        ahead of the others, once; and the first may stray: under HL8 quotas it put
        an equal-quota pair 22% apart.

        All members are judged at once (a group may hold thousands of ranks).

        Args:
            sizes, times: one window's sizes and mean local times, one per rank
                (single windows, not pooled ones: their deviations must be
                independent).
        """
        groups = self.groups()
        if not groups:
            return []
        b = np.asarray(sizes, dtype=np.float64)
        t = np.asarray(times, dtype=np.float64)
        members = np.concatenate([np.asarray(g) for g in groups])
        counts = np.array([len(g) for g in groups])
        label = np.repeat(np.arange(len(groups)), counts)   # each member's group
        first = np.repeat(np.cumsum(counts) - counts, counts)   # its group's first position
        # each member's reference: its group's median; a pair's other member (a pair's
        # median would halve every difference), at position 2 * first + 1 - its own
        pair = counts[label] == 2
        other = members[np.where(pair, 2 * first + 1 - np.arange(members.size), 0)]
        ref_t = np.where(pair, t[other], _group_medians(t[members], label, counts)[label])
        ref_b = np.where(pair, b[other], _group_medians(b[members], label, counts)[label])
        apart = _relative(t[members], ref_t)
        sized = np.abs(_relative(b[members], ref_b))
        deviation = np.copysign(np.maximum(np.abs(apart) - sized, 0.0), apart)
        seen = np.vstack([self._deviations[1:, members], deviation[None]])
        self._deviations[:, members] = seen
        with np.errstate(invalid="ignore", divide="ignore"):   # NaN: no deviation
            count = np.isfinite(seen).sum(axis=0)
            mean = np.nansum(seen, axis=0) / count
            spread = np.nansum((seen - mean) ** 2, axis=0) / np.maximum(count - 1, 1)
            error = np.where(count > 1, np.sqrt(spread) / np.sqrt(count), 0.0)
            last, before = np.abs(seen[-1]), np.abs(seen[-2])
            # beyond twice OBVIOUS in the group's first window (start-up strays), or
            # beyond it in the last two windows the same way (one disturbed window is
            # a pause, not a speed)
            obvious = np.where(count == 1, last > 2.0 * OBVIOUS,
                               (last > OBVIOUS) & (before > OBVIOUS) & (seen[-1] * seen[-2] > 0))
            leave = obvious | ((count >= MIN_WINDOWS) & (np.abs(mean) > TOLERANCE)
                               & (np.abs(mean) > significance * error))
        left = members[leave].tolist()
        self._apart.update(left)   # a member left alone is no group either
        if left:
            self._groups = None
        return left

    def state_dict(self) -> dict:
        """The kinds, who was let go and the deviations measured (JSON-friendly)."""
        deviations = []
        if self._deviations is not None:
            for r in range(self._deviations.shape[1]):
                column = self._deviations[:, r]
                if np.isfinite(column).any():
                    deviations.append([r, column[np.isfinite(column)].tolist()])
        return {"kinds": None if self._kinds is None else self._kinds.tolist(),
                "apart": sorted(self._apart), "deviations": deviations}

    def load_state_dict(self, state: dict, num_ranks: int):
        """Restore :meth:`state_dict` of ``num_ranks`` ranks; the next :meth:`update`
        with other kinds (other resources after a restart) forgets it.

        Raises:
            ValueError: a malformed state, or one of another number of ranks.
        """
        try:
            kinds = state["kinds"]
            kinds = None if kinds is None else np.asarray(kinds, dtype=np.float64)
            apart = {int(r) for r in state["apart"]}
            deviations = {int(r): [float(v) for v in d][-WINDOWS:]
                          for r, d in state["deviations"]}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError("malformed alike groups state (%r)" % (exc,)) from exc
        if kinds is not None and kinds.shape != (num_ranks,):
            raise ValueError("alike groups state: kinds of shape %s, not of %d ranks"
                             % (kinds.shape, num_ranks))
        if any(not 0 <= r < num_ranks for r in apart | set(deviations)):
            raise ValueError("alike groups state names ranks beyond %d" % num_ranks)
        table = np.full((WINDOWS, num_ranks), np.nan)
        for r, d in deviations.items():
            if d:
                table[WINDOWS - len(d):, r] = d
        self._kinds, self._apart, self._groups = kinds, apart, None
        self._deviations = None if kinds is None else table

    def equal_shares(self, sizes) -> np.ndarray:
        """``sizes`` with each group's members at the group's mean (to be rounded by
        :func:`omnihvd.controller.apportion`)."""
        shares = np.asarray(sizes, dtype=np.float64).copy()
        for group in self.groups():
            shares[group] = shares[group].mean()
        return shares
