"""Alike ranks (omnihvd.alike): ranks on the same resources held at equal sizes while
their times agree, and how the controller and the cadence apply it. Pure, single
process."""
import numpy as np
import pytest

from omnihvd.alike import (MIN_WINDOWS, OBVIOUS, TOLERANCE, WINDOWS, AlikeGroups, kind_key,
                           this_kind)
from omnihvd.cadence import Cadence
from omnihvd.controller import Controller
from omnihvd.payload import digest

pytestmark = pytest.mark.unit

ALONE, SHARED = 1.0, 2.0   # kinds: rank 0 alone on a core, ranks 1-3 sharing the other


def test_kind_key_tells_resources_apart_and_nothing_else():
    both, one = digest([0, 1]), digest([0])   # cpuset_key's digests of the CPUs
    base = kind_key(1.0, both, 0.5, ["NVIDIA H100"])
    assert base == kind_key(1.0, both, 0.5, ["NVIDIA H100"]) == float(int(base))
    assert base != kind_key(2.0, both, 0.5, ["NVIDIA H100"])      # another machine
    assert base != kind_key(1.0, one, 0.5, ["NVIDIA H100"])       # other CPUs
    assert base != kind_key(1.0, both, 0.3, ["NVIDIA H100"])      # another quota
    assert base != kind_key(1.0, both, None, ["NVIDIA H100"])     # no quota
    assert base != kind_key(1.0, both, 0.5, ["Tesla V100"])       # another GPU model
    assert this_kind(0.5, host=1.0) == this_kind(0.5, host=1.0) != this_kind(0.5, host=2.0)
    assert this_kind(0.5, host=1.0, cpuset=both) != this_kind(0.5, host=1.0, cpuset=one)


def test_groups_are_the_kinds_held_by_two_or_more_ranks():
    groups = AlikeGroups()
    assert groups.groups() == []
    groups.update([3.0, 5.0, 3.0, 4.0, 5.0, float("nan"), float("nan")])
    assert groups.groups() == [[0, 2], [1, 4]]        # NaN: not compared
    groups.update(None)
    assert groups.groups() == []
    assert groups.equal_shares([10, 20]).tolist() == [10.0, 20.0]


def confirmed(groups, sizes, times, windows):
    """What ``windows`` windows of the same ``times`` make leave (per window)."""
    return [groups.confirm(sizes, times) for _ in range(windows)]


def test_a_small_steady_difference_leaves_after_enough_windows():
    groups = AlikeGroups()
    groups.update([7.0] * 4)
    slower = 1.0 + 1.6 * TOLERANCE
    assert confirmed(groups, [30] * 4, [0.05, 0.05, 0.05, 0.05 * slower], MIN_WINDOWS) == (
        [[]] * (MIN_WINDOWS - 1) + [[3]])
    assert groups.groups() == [[0, 1, 2]]
    groups.update([7.0] * 4)   # and stays out while the kinds stay
    assert groups.groups() == [[0, 1, 2]]


def test_within_tolerance_or_within_the_windows_spread_a_member_stays():
    groups = AlikeGroups()
    groups.update([7.0] * 3)
    near = 1.0 + 0.8 * TOLERANCE
    assert confirmed(groups, [30] * 3, [0.05, 0.05, 0.05 * near], WINDOWS) == [[]] * WINDOWS
    # 8% apart on average, but swinging from window to window (a shared core)
    noisy = AlikeGroups()
    noisy.update([7.0] * 3)
    for apart in (1.19, 0.96, 1.18, 0.97, 1.15, 1.05):   # mean +8%, se 4%
        assert noisy.confirm([30] * 3, [0.05, 0.05, 0.05 * apart]) == []


def test_an_obvious_difference_leaves_at_once_and_a_new_kind_forgives():
    groups = AlikeGroups()
    groups.update([7.0, 7.0])
    # a pair's members are each as far from the other: both leave, and no group is left
    assert groups.confirm([30, 30], [0.05, 0.05 * (1.0 + 2.4 * OBVIOUS)]) == [0, 1]
    assert groups.groups() == []
    groups.update([8.0, 8.0])      # re-pinned: their resources changed, compared afresh
    assert groups.groups() == [[0, 1]]


@pytest.mark.parametrize("factor", [1.0 + 2.4 * OBVIOUS, 1.0 / (1.0 + 2.4 * OBVIOUS)])
def test_a_faster_member_leaves_as_soon_as_a_slower_one(factor):
    # 1.48x faster is as obvious as 1.48x slower (0.05 / 1.48 is only 32% below 0.05)
    groups = AlikeGroups()
    groups.update([7.0] * 4)
    assert groups.confirm([30] * 4, [0.05, 0.05, 0.05, 0.05 * factor]) == [3]
    assert groups.groups() == [[0, 1, 2]]


def test_one_disturbed_window_is_not_enough():
    groups = AlikeGroups()
    groups.update([7.0] * 3)
    # the first window (start-up) strays up to twice the obvious
    assert groups.confirm([30] * 3, [0.05, 0.05, 0.05 * (1.0 + 1.8 * OBVIOUS)]) == []
    pause = 1.0 - 1.5 * OBVIOUS   # one window, one rank far ahead of the others
    assert groups.confirm([30] * 3, [0.05, 0.05, 0.05 * pause]) == []
    assert confirmed(groups, [30] * 3, [0.05] * 3, WINDOWS) == [[]] * WINDOWS
    # a second window in a row the same way is a speed: it leaves
    assert groups.confirm([30] * 3, [0.05, 0.05, 0.05 * pause]) == []
    assert groups.confirm([30] * 3, [0.05, 0.05, 0.05 * pause]) == [2]


def test_a_difference_in_size_explains_as_much_difference_in_time():
    groups = AlikeGroups()
    groups.update([7.0, 7.0])
    assert confirmed(groups, [33, 30], [0.055, 0.05], WINDOWS) == [[]] * WINDOWS
    apart = AlikeGroups()
    apart.update([7.0, 7.0])
    assert confirmed(apart, [30, 30], [0.055, 0.05], MIN_WINDOWS)[-1] == [0, 1]


def shared_core_times(sizes, rng, noise=0.03):
    """Local times of rank 0 alone on a core and ranks 1-3 sharing the other (processor
    sharing: the rank with the least work finishes first, then the rest share the core
    among fewer), 12 us per sample on a whole core, 2 ms fixed, ``noise`` relative."""
    b = np.asarray(sizes, dtype=np.float64)
    work = 12e-6 * b[1:]
    order = np.argsort(work, kind="stable")
    shared, done, m = np.empty(3), 0.0, 3
    for k, r in enumerate(order):
        shared[r] = done + (m - k) * work[r]
        done += work[r]
    times = np.concatenate([[0.002 + 12e-6 * b[0]], 0.002 + shared])
    return times * (1.0 + rng.normal(0.0, noise, 4))


def run(kinds, sizes=(64, 64, 64, 64), rounds=30, seed=0, times=shared_core_times, **kw):
    ctl = Controller(4, 256)
    rng = np.random.default_rng(seed)
    sizes = list(sizes)
    for _ in range(rounds):
        t = times(sizes, rng, **kw)
        sizes = ctl.decide(sizes, t, errors=0.03 * t / np.sqrt(20), kinds=kinds)
    return ctl, sizes


def test_ranks_sharing_a_core_are_held_equal_where_their_times_hardly_tell_them_apart():
    # the shared core's ranks take about the same time at nearby sizes
    t = shared_core_times([130, 36, 40, 50], np.random.default_rng(1), noise=0.0)
    assert t[3] / t[1] < 1.1   # 39% more samples, under 10% more time
    _, alone = run(None, sizes=(130, 36, 40, 50), noise=0.06)
    ctl, held = run([ALONE, SHARED, SHARED, SHARED], sizes=(130, 36, 40, 50), noise=0.06)
    assert max(held[1:]) - min(held[1:]) <= 1 and ctl.alike_groups() == [[1, 2, 3]]
    # and the split between the cores is as balanced as without the groups
    assert abs(held[0] - alone[0]) <= 0.05 * alone[0]


def test_a_rank_slower_than_its_kind_is_balanced_on_its_own():
    def emulated(sizes, rng):   # four ranks of one kind, rank 3 slowed 1.5x (a sleep)
        t = 0.002 + 12e-6 * np.asarray(sizes, dtype=np.float64) * [1.0, 1.0, 1.0, 1.5]
        return t * (1.0 + rng.normal(0.0, 0.01, 4))
    ctl, sizes = run([SHARED] * 4, times=emulated, rounds=10)
    assert ctl.alike_groups() == [[0, 1, 2]]
    assert max(sizes[:3]) - min(sizes[:3]) <= 1
    assert sizes[3] < 0.75 * sizes[0]   # fewer samples: balanced, not held equal


def test_split_at_holds_alike_ranks_equal_too():
    ctl = Controller(3, 90)
    ctl.decide([30, 30, 30], [0.3, 0.2, 0.2], kinds=[1.0, 2.0, 2.0])
    probe = ctl.split_at(0.25)
    assert probe[1] == probe[2]


def test_kinds_of_another_number_of_ranks_are_refused():
    with pytest.raises(ValueError, match="kinds must be one number per rank"):
        Controller(3, 90).decide([30, 30, 30], [0.3, 0.2, 0.2], kinds=[1.0, 2.0])


def test_the_cadence_passes_the_kinds_through():
    cad = Cadence(Controller(3, 90), adjust_every=1, settle_steps=0)
    cad.decide(0, [30, 30, 30], [0.3, 0.2, 0.2], [0.001] * 3, [5] * 3, kinds=[1.0, 2.0, 2.0])
    assert cad.controller.alike_groups() == [[1, 2]]


class _MemberByMember:
    """AlikeGroups.confirm's rule written out one member at a time (the reference)."""

    def __init__(self, kinds):
        self.kinds, self.apart, self.seen = list(kinds), set(), {}

    def groups(self):
        found = {}
        for rank, kind in enumerate(self.kinds):
            if rank not in self.apart and kind == kind:   # NaN: not compared
                found.setdefault(kind, []).append(rank)
        return sorted((g for g in found.values() if len(g) > 1), key=lambda g: g[0])

    def confirm(self, sizes, times):
        left = []
        for group in self.groups():
            for r in group:
                ref = [o for o in group if o != r] if len(group) == 2 else group
                ref_t = np.median([times[o] for o in ref])
                ref_b = np.median([sizes[o] for o in ref])
                apart = (times[r] - ref_t) / min(times[r], ref_t)
                sized = abs(sizes[r] - ref_b) / min(sizes[r], ref_b)
                deviation = np.copysign(max(abs(apart) - sized, 0.0), apart)
                seen = self.seen[r] = (self.seen.get(r, []) + [deviation])[-WINDOWS:]
                mean = np.mean(seen)
                error = np.std(seen, ddof=1) / np.sqrt(len(seen)) if len(seen) > 1 else 0.0
                if len(seen) == 1:
                    obvious = abs(seen[0]) > 2 * OBVIOUS
                else:
                    obvious = (abs(seen[-1]) > OBVIOUS and abs(seen[-2]) > OBVIOUS
                               and seen[-1] * seen[-2] > 0)
                if obvious or (len(seen) >= MIN_WINDOWS and abs(mean) > TOLERANCE
                               and abs(mean) > 3.0 * error):
                    left.append(r)
        self.apart.update(left)
        return left


@pytest.mark.parametrize("seed", range(3))
def test_every_member_of_every_group_is_judged_as_if_alone(seed):
    # confirm() judges all members of all groups at once (thousands of ranks): it must
    # let go whom the rule lets go member by member -- pairs, medians of larger groups,
    # unequal sizes, NaN kinds, a state saved and loaded on the way
    rng = np.random.default_rng(seed)
    let_go = 0
    for _ in range(150):
        n = int(rng.integers(2, 14))
        kinds = rng.integers(0, 4, n).astype(float)
        kinds[rng.random(n) < 0.1] = float("nan")
        groups, reference = AlikeGroups(), _MemberByMember(kinds)
        groups.update(kinds)
        for _ in range(int(rng.integers(1, 14))):
            sizes = rng.integers(20, 24, n)
            times = sizes * 0.001 * rng.lognormal(0, rng.choice([0.02, 0.1, 0.3]), n)
            left = groups.confirm(sizes, times)
            assert left == reference.confirm(sizes.tolist(), times.tolist())
            assert groups.groups() == reference.groups()
            let_go += len(left)
            if rng.random() < 0.2:
                restored = AlikeGroups()
                restored.load_state_dict(groups.state_dict(), n)
                groups = restored
                groups.update(kinds)   # the same kinds: nothing forgotten
    assert let_go > 100   # the case was exercised


def test_a_group_of_thousands_lets_go_only_its_slow_member():
    n = 4000
    groups = AlikeGroups()
    groups.update([1.0] * (n - 2) + [2.0, 2.0])   # one large group and a pair
    times = np.full(n, 0.05)
    times[1234] = 0.05 * (1 + 3 * OBVIOUS)        # obvious from the first window
    times[n - 1] = 0.05 * (1 + 0.5 * OBVIOUS)     # the pair: within twice OBVIOUS
    assert groups.confirm([32] * n, times) == [1234]
    assert [len(g) for g in groups.groups()] == [n - 3, 2]


def test_the_groups_are_the_ranks_of_one_kind_not_let_go():
    # found in one pass over thousands of ranks and kept until the kinds or the
    # members let go change: the rule, rank by rank
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        kinds = rng.integers(0, 6, n).astype(float)
        kinds[rng.random(n) < 0.1] = np.nan
        groups = AlikeGroups()
        groups.update(kinds)
        for _ in range(2):
            found = {}
            for rank, kind in enumerate(kinds.tolist()):
                if rank not in groups._apart and kind == kind:
                    found.setdefault(kind, []).append(rank)
            assert groups.groups() == sorted((g for g in found.values() if len(g) > 1),
                                             key=lambda g: g[0])
            sizes = rng.integers(20, 40, n)
            times = sizes * rng.choice([0.001, 0.003], n)   # some members far off
            for _ in range(3):
                groups.confirm(sizes, times)
