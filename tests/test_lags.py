"""Release lag: how much later than its machine's first rank a rank resumes after the
allreduce (omnihvd.lags), and how the controller and the cadence use it. Pure, single
process."""
import math
import os

import numpy as np
import pytest

from omnihvd.cadence import Cadence
from omnihvd.controller import Controller
from omnihvd.errors import ConfigError
from omnihvd.lags import (LAG_SAMPLES, MAX_LAG, MIN_LAGS, LagPool, _first_of_others, _per_run,
                          cpuset_key, host_key, placement_groups, release_lags)
from omnihvd.timing import _clip_rare

pytestmark = pytest.mark.unit

NAN = float("nan")


def test_a_group_on_the_same_cpus_is_charged_its_mean_lag_behind_the_others():
    # ranks 0-2 on machine 1: rank 0 alone on its CPUs, ranks 1 and 2 sharing theirs;
    # rank 3 alone on machine 2 (another clock: never compared)
    releases = [[50.000, 50.003, 50.001, 80.000],
                [50.040, 50.041, 50.047, 80.030]]
    lags = release_lags(releases, hosts=[1.0, 1.0, 1.0, 2.0], cpusets=[5.0, 6.0, 6.0, 5.0])
    assert lags.round(4).tolist() == [[0.0, 0.002, 0.002, 0.0], [0.0, 0.004, 0.004, 0.0]]


def test_ranks_that_all_share_their_cpus_have_no_lag():
    # the order in which they take turns is no rank's cost
    releases = [[10.000, 10.005, 10.002], [10.040, 10.041, 10.049]]
    lags = release_lags(releases, hosts=[1.0] * 3, cpusets=[4.0] * 3)
    assert lags.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_a_missing_release_or_a_clock_not_shared_gives_no_lag():
    releases = [[NAN, 10.002, 10.001],               # rank 0 has none: the others still count
                [10.0, 10.0 + 2 * MAX_LAG, 10.001]]  # rank 1's clock is another one
    lags = release_lags(releases, hosts=[3.0] * 3, cpusets=[1.0, 2.0, 3.0])
    assert math.isnan(lags[0, 0]) and lags[0, 1:].round(4).tolist() == [0.001, 0.0]
    assert math.isnan(lags[1, 1]) and lags[1, 2].round(4) == 0.001
    # a step in which no rank on other CPUs has a release says nothing
    lags = release_lags([[NAN, 10.002]], hosts=[1.0, 1.0], cpusets=[1.0, 2.0])
    assert np.isnan(lags).all()
    malformed = release_lags([[1.0, 2.0]], hosts=[1.0], cpusets=[1.0])
    assert malformed.shape == (1, 2) and np.isnan(malformed).all()


def _lags_group_by_group(releases, hosts, cpusets, arrived=None):
    """release_lags' rule written out one rank at a time (the reference)."""
    r, h, c = np.asarray(releases, float), np.asarray(hosts, float), np.asarray(cpusets, float)
    a = None if arrived is None else np.asarray(arrived, float)
    lags = np.full(r.shape, NAN)
    for s in range(r.shape[0]):
        for i in range(r.shape[1]):
            if not (math.isfinite(r[s, i]) and math.isfinite(h[i]) and math.isfinite(c[i])):
                continue
            others = [j for j in range(r.shape[1]) if h[j] == h[i] and c[j] != c[i]
                      and math.isfinite(c[j])]
            if not others:
                lags[s, i] = 0.0
                continue
            first = min((r[s, j] for j in others if math.isfinite(r[s, j])), default=NAN)
            behind = []
            for j in range(r.shape[1]):   # the group: same machine, same CPUs
                if h[j] == h[i] and c[j] == c[i] and math.isfinite(r[s, j]):
                    start = first
                    if a is not None and math.isfinite(a[s, j]):
                        start = max(first, a[s, j]) if math.isfinite(first) else NAN
                    if math.isfinite(start):
                        behind.append(max(r[s, j] - start, 0.0))
            lag = sum(behind) / len(behind) if behind else NAN
            lags[s, i] = lag if lag <= MAX_LAG else NAN
    return lags


@pytest.mark.parametrize("seed", range(4))
def test_the_lags_of_many_machines_at_once_are_each_groups_own(seed):
    # release_lags works on all ranks at once (sorted by machine and CPUs, reduceat):
    # it must give what the rule gives rank by rank -- ties, missing releases and
    # arrivals, machines with one group, a clock that is not shared, unknown CPUs
    rng = np.random.default_rng(seed)
    for _ in range(300):
        n, steps = int(rng.integers(1, 14)), int(rng.integers(1, 5))
        hosts = rng.integers(0, 3, n).astype(float)
        cpusets = rng.integers(0, 3, n).astype(float)
        if rng.random() < 0.1:
            (hosts if rng.random() < 0.5 else cpusets)[rng.integers(0, n)] = NAN
        releases = 100 + rng.uniform(0, 0.01, (steps, n)) * (1 if rng.random() < 0.9 else 300)
        if rng.random() < 0.1:
            releases[:] = 100.0
        releases[rng.random((steps, n)) < 0.15] = NAN
        arrived = None
        if rng.random() < 0.5:
            arrived = releases - rng.uniform(-0.005, 0.01, (steps, n))
            arrived[rng.random((steps, n)) < 0.15] = NAN
        got = release_lags(releases, hosts, cpusets, arrived)
        want = _lags_group_by_group(releases, hosts, cpusets, arrived)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_the_cpuset_key_follows_the_affinity(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1, 0}, raising=False)
    key = cpuset_key()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cpuset_key() == key == float(int(key))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1}, raising=False)
    assert cpuset_key() != key


def test_the_host_key_is_a_float_exact_machine_identity():
    key = host_key()
    assert key == host_key() and key == float(int(key)) and 0 <= key < 2 ** 32


def test_a_rank_is_charged_its_mean_lag_once_it_has_enough():
    pool = LagPool(2)
    pool.add([[0.0, 0.004]] * (MIN_LAGS - 1))
    assert pool.charges().tolist() == [0.0, 0.0]
    pool.add([[0.0, 0.002]])
    assert pool.charges().round(5).tolist() == [0.0, round((7 * 0.004 + 0.002) / 8, 5)]
    assert pool.counts().tolist() == [MIN_LAGS, MIN_LAGS]


def test_a_rare_pause_is_not_a_lag():
    pool = LagPool(2)
    pool.add([[0.0, 0.003]] * 19 + [[0.0, 0.5]])   # one step in twenty: a pause
    assert pool.charges().round(4).tolist() == [0.0, 0.003]


def test_the_pool_keeps_the_latest_lags_and_forgets():
    pool = LagPool(2)
    pool.add([[0.0, 0.009]] * LAG_SAMPLES)
    pool.add([[0.0, 0.002]] * LAG_SAMPLES)
    assert pool.charges().round(4).tolist() == [0.0, 0.002]
    pool.add([[0.001, 0.002, 0.003]])    # another world's table is ignored
    assert pool.counts().tolist() == [LAG_SAMPLES, LAG_SAMPLES]
    pool.forget()
    assert pool.counts().tolist() == [0, 0] and pool.charges().tolist() == [0.0, 0.0]


def shared_core_lags(steps=30):
    """Rank 0 alone on its core resumes first; ranks 1-3 share a core and resume
    2-6 ms later, in turn."""
    return [[0.0] + [0.002 * (1 + (s + r) % 3) for r in range(3)] for s in range(steps)]


@pytest.mark.parametrize("policy", ["affine", "proportional"])
def test_the_rank_that_resumes_first_gets_more_samples(policy):
    sizes, times = [128, 43, 43, 42], [0.040] * 4   # equal local times
    plain, lagged = Controller(4, 256, policy=policy), Controller(4, 256, policy=policy)
    assert plain.decide(sizes, times) == sizes      # balanced: nothing to do
    got = lagged.decide(sizes, times, lags=shared_core_lags())
    assert lagged.lag_charges().round(4).tolist() == [0.0, 0.004, 0.004, 0.004]
    # the three arrive 4 ms (10%) after the lone rank: it takes samples off them
    assert got[0] > 128 and sum(got) == 256 and all(b < 43 for b in got[1:])


def test_lags_alike_keep_the_split_of_equal_local_times():
    lags = [[0.002 * ((s + r) % 4) for r in range(4)] for s in range(40)]   # in turn
    ctl = Controller(4, 256)
    got = ctl.decide([64] * 4, [0.02] * 4, lags=lags)
    assert ctl.lag_charges().round(6).tolist() == [0.003] * 4 and got == [64] * 4


def test_the_noise_gate_weighs_local_time_plus_lag():
    ctl = Controller(2, 100)
    for _ in range(3):   # local times equal within their noise; rank 1 resumes 10 ms late
        got = ctl.decide([50, 50], [0.050, 0.0502], [0.001, 0.001], lags=[[0.0, 0.010]] * 8)
    assert got[0] > 50


def test_malformed_lags_are_a_config_error():
    with pytest.raises(ConfigError, match=r"lags must be a \(steps, 2\) table"):
        Controller(2, 100).decide([50, 50], [0.05, 0.05], lags=[0.001, 0.002])


def test_forgetting_the_history_forgets_the_lags():
    ctl = Controller(2, 100)
    ctl.decide([50, 50], [0.05, 0.05], lags=[[0.0, 0.004]] * 8)
    ctl.forget()
    assert ctl.lag_charges().tolist() == [0.0, 0.0]


def test_the_cadence_keeps_each_steps_release_and_decides_with_the_lags():
    cad = Cadence(Controller(2, 60), adjust_every=4, settle_steps=1, releases=True)
    cad.begin_step([30, 30])             # a settle step: no slot
    cad.record(0.5), cad.record_release(99.0)
    for step in range(1, 4):
        cad.begin_step([30, 30])
        cad.record(0.1)
        if step != 2:
            cad.record_release(100.0 + step)
    measured = cad.close()
    assert measured.arrivals is None
    assert measured.releases[[0, 2]].tolist() == [101.0, 103.0]
    assert math.isnan(measured.releases[1])
    # a release that comes after its window was gathered is dropped, not carried over
    cad.record_release(104.0)
    cad.begin_step([30, 30])
    releases = cad.close().releases
    assert releases.shape == (1,) and math.isnan(releases[0])
    # the gathered table: rank 1 resumes 5 ms after rank 0 on other CPUs of its machine
    table = [[100.0 + s, 100.005 + s] for s in range(MIN_LAGS)]
    cad.decide(7, [30, 30], [0.1, 0.1], [0.0, 0.0], [4, 4], releases=table, hosts=[1.0, 1.0],
               cpusets=[1.0, 2.0])
    assert cad.controller.lag_charges().round(4).tolist() == [0.0, 0.005]


def test_without_releases_the_cadence_keeps_none():
    cad = Cadence(Controller(2, 60), adjust_every=4, settle_steps=0)
    cad.begin_step([30, 30])
    cad.record(0.1), cad.record_release(5.0)
    assert cad.close().releases is None


def test_a_rank_that_arrives_after_the_others_resumed_is_not_charged_its_own_work():
    # rank 1 (its own CPUs) sleeps after its backward pass: its gradients' allreduce
    # completes meanwhile, rank 0 resumes at 100.000, rank 1 arrives at 100.080 and
    # resumes 0.5 ms later. The 80 ms are in its local time already.
    releases = [[100.000 + s, 100.0805 + s] for s in range(MIN_LAGS)]
    arrived = [[99.990 + s, 100.080 + s] for s in range(MIN_LAGS)]
    hosts, cpusets = [1.0, 1.0], [1.0, 2.0]
    assert release_lags(releases, hosts, cpusets).round(4).tolist() == [[0.0, 0.0805]] * MIN_LAGS
    lags = release_lags(releases, hosts, cpusets, arrived=arrived)
    assert lags.round(4).tolist() == [[0.0, 0.0005]] * MIN_LAGS
    # a rank that waited, then resumed late, is charged as before
    waited = [[99.990 + s, 99.995 + s] for s in range(MIN_LAGS)]
    assert release_lags(releases, hosts, cpusets, arrived=waited).round(4).tolist() == \
        [[0.0, 0.0805]] * MIN_LAGS
    # an unknown arrival (NaN) counts from the first release, as without arrivals
    unknown = [[NAN, NAN]] * MIN_LAGS
    assert release_lags(releases, hosts, cpusets, arrived=unknown).round(4).tolist() == \
        [[0.0, 0.0805]] * MIN_LAGS


def test_the_cadence_keeps_arrival_moments_for_the_release_lags_without_the_lead():
    cad = Cadence(Controller(2, 60), adjust_every=4, settle_steps=0, releases=True)
    cad.begin_step([30, 30])
    cad.record(0.1), cad.record_arrived(5.0), cad.record_release(5.1)
    measured = cad.close()
    assert measured.arrived_at.tolist() == [5.0] and measured.releases.tolist() == [5.1]
    releases = [[100.000 + s, 100.0805 + s] for s in range(MIN_LAGS)]
    arrived = [[99.990 + s, 100.080 + s] for s in range(MIN_LAGS)]
    cad.decide(7, [30, 30], [0.1, 0.1], [0.0, 0.0], [4, 4], releases=releases,
               hosts=[1.0, 1.0], cpusets=[1.0, 2.0], arrived_at=arrived)
    assert cad.controller.lag_charges().round(4).tolist() == [0.0, 0.0005]
    assert cad.controller.arrival_lead() == 0.0   # arrived_at=False: no lead


def test_the_pool_charges_each_rank_its_own_winsorised_mean():
    # the pool holds each rank's lags in a row (sorted row by row): every rank must
    # get the rule applied to its own column of the windows added, the last
    # LAG_SAMPLES steps of them
    rng = np.random.default_rng(5)
    for _ in range(40):
        n = int(rng.integers(1, 30))
        pool, added = LagPool(n), np.empty((0, n))
        for _ in range(int(rng.integers(1, 7))):
            lags = rng.exponential(0.003, (int(rng.integers(0, 33)), n))
            lags[rng.random(lags.shape) < 0.2] = NAN
            pool.add(lags)
            added = np.concatenate([added, lags])[-LAG_SAMPLES:]
        want = []
        for column in added.T:
            kept = np.sort(column[np.isfinite(column)])
            if kept.size < MIN_LAGS:
                want.append(0.0)
                continue
            k = math.ceil(0.1 * kept.size)
            want.append(float(np.mean(np.minimum(kept, kept[kept.size - 1 - k]))))
        np.testing.assert_allclose(pool.charges(), want, rtol=1e-12, atol=0)
        assert pool.counts().tolist() == np.isfinite(added).sum(axis=0).tolist()


def test_the_placement_is_grouped_once_and_shared_read_only():
    hosts, cpusets = [3.0, 1.0, 1.0, 2.0, 1.0, NAN], [7.0, 5.0, 4.0, 9.0, 5.0, 1.0]
    g = placement_groups(hosts, cpusets)
    # machine 1 holds two groups (CPUs 4: rank 2; CPUs 5: ranks 1 and 4); machines 2
    # and 3 one each (alone: lag 0); rank 5 has no machine (neither)
    assert g.alone.tolist() == [0, 3] and g.columns.tolist() == [2, 1, 4]
    assert g.group.tolist() == [0, 1, 1] and g.group_starts.tolist() == [0, 1]
    assert g.host_of_group.tolist() == [0, 0] and g.host_starts.tolist() == [0]
    assert not g.in_order
    assert placement_groups(np.array(hosts), np.array(cpusets)) is g   # cached
    with pytest.raises(ValueError):
        g.columns[0] = 9
    assert placement_groups([1.0, 1.0], [4.0, 5.0]).in_order


def test_per_run_reduces_runs_of_equal_and_unequal_length():
    values = np.arange(24.0).reshape(8, 3)[::-1].copy()
    for starts in (np.array([0, 2, 4, 6]), np.array([0, 1, 5])):
        ends = np.r_[starts[1:], len(values)]
        want = [values[i:j].min(axis=0) for i, j in zip(starts, ends)]
        assert _per_run(np.minimum, values, starts).tolist() == np.array(want).tolist()
        flags = values > 10
        got = _per_run(np.add, flags, starts, dtype=np.int64)
        assert got.dtype == np.int64
        assert got.tolist() == [flags[i:j].sum(axis=0).tolist() for i, j in zip(starts, ends)]


@pytest.mark.parametrize("per_machine", [1, 2, 3])
def test_each_group_gets_the_first_release_of_the_other_groups_of_its_machine(per_machine):
    rng = np.random.default_rng(per_machine)
    for _ in range(50):
        machines, steps = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        # groups per machine: all equal (one reshape) or not (reduceat)
        sizes = rng.integers(2, 5, machines) if rng.random() < 0.5 else np.full(machines, 3)
        hosts = np.repeat(np.arange(machines), sizes * per_machine).astype(float)
        cpusets = np.concatenate([np.repeat(np.arange(s), per_machine) for s in sizes]) + 0.0
        g = placement_groups(hosts, cpusets)
        first_of_group = rng.integers(0, 4, (g.group_starts.size, steps)).astype(float)
        first_of_group[rng.random(first_of_group.shape) < 0.2] = np.inf
        got = _first_of_others(first_of_group.copy(), g)
        for k in range(first_of_group.shape[0]):
            others = [j for j in range(first_of_group.shape[0])
                      if j != k and g.host_of_group[j] == g.host_of_group[k]]
            want = first_of_group[others].min(axis=0)
            want[np.isinf(want)] = NAN
            np.testing.assert_array_equal(got[k], want)


@pytest.mark.parametrize("seed", range(3))
def test_the_lags_of_machines_alike_are_each_groups_own(seed):
    # machines of as many ranks and groups (the reshape path), in rank order or not
    rng = np.random.default_rng(seed)
    for _ in range(40):
        machines, per, steps = int(rng.integers(1, 5)), int(rng.integers(1, 5)), 3
        hosts = np.repeat(np.arange(machines), per * 2).astype(float)
        cpusets = np.tile(np.repeat([1.0, 2.0], per) if rng.random() < 0.5
                          else np.arange(2.0 * per), machines)
        order = rng.permutation(hosts.size) if rng.random() < 0.5 else np.arange(hosts.size)
        hosts, cpusets = hosts[order], cpusets[order]
        releases = 100 + rng.uniform(0, 0.01, (steps, hosts.size))
        releases[rng.random(releases.shape) < 0.1] = NAN
        arrived = None if rng.random() < 0.5 else releases - rng.uniform(-0.005, 0.01,
                                                                      releases.shape)
        got = release_lags(releases, hosts, cpusets, arrived)
        want = _lags_group_by_group(releases, hosts, cpusets, arrived)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_the_pool_charges_what_the_mean_of_each_rank_alone_gives_bit_for_bit():
    # the pool moves its rows in place and clips in a scratch array: the charges must
    # be the very bits of np.nansum over each rank's clipped lags, oldest first
    rng = np.random.default_rng(11)
    n = 50
    pool, added = LagPool(n), np.empty((0, n))
    for steps in (5, 20, 3, 40, 20, 0, 20):
        lags = rng.exponential(0.003, (steps, n))
        lags[rng.random(lags.shape) < 0.1] = NAN
        pool.add(lags)
        added = np.concatenate([added, lags])[-LAG_SAMPLES:]
        clipped, counts = _clip_rare(added.T.copy(), axis=1)
        want = np.where(counts >= MIN_LAGS, np.nansum(clipped, axis=1) / np.maximum(counts, 1),
                        0.0)
        assert pool.charges().tobytes() == want.tobytes()
        assert pool.counts().tolist() == counts.tolist()
