"""The split for the slowest arrival (omnihvd.arrivals), its place in the controller,
the cadence and the simulator. Pure, single process."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnihvd.arrivals import (ARRIVAL_STEPS, ARRIVAL_WINDOWS, ArrivalPool, expected_last_arrival,
                              last_arrival_split, relative_residuals)
from omnihvd.cadence import Cadence
from omnihvd.controller import Controller, TimeModel
from omnihvd.errors import ConfigError
from omnihvd.tools.simulate import Cluster, Control, SpeedProfile, simulate

pytestmark = pytest.mark.unit


def model(slopes, intercepts=None):
    slopes = np.asarray(slopes, dtype=np.float64)
    return TimeModel(np.zeros_like(slopes) if intercepts is None
                     else np.asarray(intercepts, dtype=np.float64), slopes)


def noise(rng, steps, spreads):
    """Relative residuals: each rank's own spread, mean 0 over the steps."""
    r = rng.normal(0.0, 1.0, (steps, len(spreads))) * np.asarray(spreads)
    return r - r.mean(axis=0)


# ------------------------------------------------------------- the split itself

def test_without_noise_the_split_of_equal_means_stays():
    m = model([0.01, 0.003, 0.003, 0.003])
    for sizes in ([64, 64, 64, 64], [130, 42, 42, 42], [1, 85, 85, 85]):
        assert last_arrival_split(sizes, m, np.zeros((40, 4)), lo=[1] * 4, hi=[256] * 4) == sizes
    assert last_arrival_split([64, 64], model([1, 1]), None, lo=[1, 1], hi=[128, 128]) == [64, 64]


def test_noisy_ranks_get_less_and_the_steady_rank_more():
    """One rank alone on a core (steady, 3x as fast per sample) and three sharing the
    other (time-sliced: noisy): the steady rank takes more than at equal means."""
    rng = np.random.default_rng(0)
    m = model([0.001, 0.003, 0.003, 0.003])
    equal_means = [128, 43, 43, 42]
    r = noise(rng, 80, [0.02, 0.12, 0.12, 0.12])
    new = last_arrival_split(equal_means, m, r, lo=[1] * 4, hi=[256] * 4)
    assert new[0] > equal_means[0] + 5 and sum(new) == 256
    assert expected_last_arrival(new, m, r) < 0.98 * expected_last_arrival(equal_means, m, r)


def test_noise_alike_on_equal_ranks_leaves_them_equal():
    """Equal speeds, equal noise: no rank should arrive last more than another, and
    the pooled steps' sampling noise must not shuffle samples around."""
    for seed in range(20):
        r = noise(np.random.default_rng(seed), 80, [0.1] * 4)
        new = last_arrival_split([64] * 4, model([0.004] * 4), r, lo=[1] * 4, hi=[256] * 4)
        assert max(new) / min(new) <= 1.1, (seed, new)


def test_a_small_gain_leaves_the_split():
    r = noise(np.random.default_rng(1), 80, [0.0, 0.01, 0.01, 0.01])
    m = model([0.001, 0.003, 0.003, 0.003])
    assert last_arrival_split([128, 43, 43, 42], m, r, lo=[1] * 4, hi=[256] * 4) == [128, 43, 43, 42]
    assert last_arrival_split([128, 43, 43, 42], m, r, lo=[1] * 4, hi=[256] * 4,
                              min_gain=0.0) != [128, 43, 43, 42]


def brute_force_best(total, m, r, lo):
    best = None
    for head in itertools.product(range(lo, total), repeat=len(m.slope) - 1):
        last = total - sum(head)
        if last < lo:
            continue
        value = expected_last_arrival(list(head) + [last], m, r)
        if best is None or value < best:
            best = value
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_split_is_near_the_best_of_all_splits(seed):
    rng = np.random.default_rng(seed)
    m = model(rng.uniform(0.5, 3.0, 3), rng.uniform(0.0, 5.0, 3))
    r = noise(rng, 48, rng.uniform(0.0, 0.3, 3))
    new = last_arrival_split([20, 20, 20], m, r, lo=[1] * 3, hi=[60] * 3, min_gain=0.0)
    assert expected_last_arrival(new, m, r) <= 1.01 * brute_force_best(60, m, r, 1)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 6), seed=st.integers(0, 10 ** 6), k=st.sampled_from([1, 2, 4]),
       spread=st.floats(0.0, 0.5))
def test_total_bounds_multiples_and_determinism_hold(n, seed, k, spread):
    rng = np.random.default_rng(seed)
    B = 64 * n + 3                                   # rank 0 also takes B mod k
    units = (B // k) // n
    start = [units * k] * n
    start[0] += B - sum(start)
    lo = [k] * n
    lo[0] = k + B % k
    hi = [B] * n
    m = model(rng.uniform(0.001, 0.01, n), rng.uniform(0.0, 0.05, n))
    r = noise(rng, 40, rng.uniform(0.0, spread, n))
    new = last_arrival_split(start, m, r, lo=lo, hi=hi, size_multiple=k)
    assert sum(new) == B
    assert all(lo[i] <= new[i] <= hi[i] for i in range(n))
    assert all((b - (B % k if i == 0 else 0)) % k == 0 for i, b in enumerate(new))
    assert new == last_arrival_split(start, m, r.copy(), lo=lo, hi=hi, size_multiple=k)
    assert expected_last_arrival(new, m, r) <= expected_last_arrival(start, m, r)


# ------------------------------------------------------------- residuals and pool

def test_a_change_of_speed_inside_the_window_is_not_noise():
    before, after = [0.10] * 10, [0.20] * 10
    steps = np.array([before + after, [0.1] * 20]).T
    assert np.abs(relative_residuals(steps)).max() == pytest.approx(0.0, abs=1e-12)


def test_missing_steps_and_ranks_with_too_few_count_as_steady():
    steps = np.array([[0.1, np.nan], [0.3, 0.2], [0.2, np.nan], [np.nan, np.nan]])
    r = relative_residuals(steps)
    assert r.shape == (3, 2)                          # the empty row is dropped
    assert r[:, 0].tolist() == pytest.approx([-0.5, 0.5, 0.0])
    assert r[:, 1].tolist() == [0.0, 0.0, 0.0]        # one sample only
    assert relative_residuals(np.full((3, 2), np.nan)) is None


def test_the_pool_keeps_the_last_windows_and_forgets():
    pool = ArrivalPool()
    for w in range(ARRIVAL_WINDOWS + 2):
        pool.add(np.array([[1.0, 1.0 + w], [1.0, 3.0 + w], [1.0, 2.0 + w]]))
    assert len(pool) == 3 * ARRIVAL_WINDOWS
    pool.forget()
    assert pool.residuals() is None and len(pool) == 0


# ------------------------------------------------------------- in the controller

def three_to_one_rounds(ctl, rounds, seed, sizes=(128, 43, 43, 42), arrivals=True):
    """Rounds of a steady rank 3x as fast per sample beside three noisy ones."""
    rng = np.random.default_rng(seed)
    slopes = np.array([0.001, 0.003, 0.003, 0.003])
    sizes = list(sizes)
    for _ in range(rounds):
        mean = slopes * np.asarray(sizes)
        steps = mean * (1.0 + noise(rng, 20, [0.02, 0.12, 0.12, 0.12]))
        sizes = ctl.decide(sizes, steps.mean(axis=0), steps.std(axis=0) / math.sqrt(20),
                           arrivals=steps if arrivals else None)
    return sizes


def test_the_controller_gives_the_steady_rank_more_only_with_arrivals():
    with_arrivals = three_to_one_rounds(Controller(4, 256), 8, seed=0)
    without = three_to_one_rounds(Controller(4, 256), 8, seed=0, arrivals=False)
    assert with_arrivals[0] >= without[0] + 5, (with_arrivals, without)
    assert abs(without[0] - 128) <= 3


def test_two_controllers_fed_the_same_rounds_agree():
    assert (three_to_one_rounds(Controller(4, 256), 6, seed=3)
            == three_to_one_rounds(Controller(4, 256), 6, seed=3))


def test_a_change_of_speed_empties_the_pool():
    ctl = Controller(2, 60)
    steps = np.array([[0.1, 0.1], [0.1, 0.3]] * 5)
    ctl.decide([30, 30], [0.1, 0.2], [0.0, 0.03], arrivals=steps)
    ctl.decide([30, 30], [0.1, 0.2], [0.0, 0.03], arrivals=steps)
    assert len(ctl._arrivals) == 20
    ctl.decide([30, 30], [0.1, 0.6], [0.0, 0.03], arrivals=steps * [1, 3])  # rank 1: 3x slower
    assert len(ctl._arrivals) == 10                   # only the window after the change


def test_malformed_arrivals_are_refused():
    with pytest.raises(ConfigError, match="arrivals"):
        Controller(2, 60).decide([30, 30], [0.1, 0.1], arrivals=np.ones((5, 3)))


# ------------------------------------------------------------- in the cadence

def test_the_cadence_keeps_each_steps_time_aligned_by_step():
    cad = Cadence(Controller(2, 60), adjust_every=6, settle_steps=1, arrivals=True)
    cad.begin_step([30, 30])          # a settle step: not kept
    cad.record(0.5)
    for t in (0.1, None, 0.3, -1.0, 0.5):
        cad.begin_step([30, 30])
        if t is not None:             # None: this step's time was dropped (no record)
            cad.record(t)
    got = cad.close().arrivals
    assert got.shape == (5,)
    assert got[[0, 2, 4]].tolist() == [0.1, 0.3, 0.5] and np.isnan(got[[1, 3]]).all()
    cad.begin_step([20, 40])          # new sizes: a new window, settling again
    cad.record(0.4)
    cad.begin_step([20, 40])
    cad.record(0.2)
    assert cad.close().arrivals.tolist() == [0.2]


def test_the_cadence_sends_the_last_steps_of_a_long_window():
    cad = Cadence(Controller(1, 60), adjust_every=100, settle_steps=0, arrivals=True)
    for s in range(ARRIVAL_STEPS + 8):
        cad.begin_step([60])
        cad.record(1.0 + s)
    assert cad.close().arrivals.tolist() == [1.0 + s for s in range(8, ARRIVAL_STEPS + 8)]


def test_without_arrivals_the_cadence_keeps_none():
    cad = Cadence(Controller(2, 60), adjust_every=2, settle_steps=0)
    cad.begin_step([30, 30])
    cad.record(0.1)
    assert cad.close().arrivals is None


def test_vector_lanes_give_a_steps_by_lanes_table():
    cad = Cadence(Controller(3, 60), adjust_every=2, settle_steps=0, arrivals=True)
    for row in ([0.1, 0.2, 0.3], [0.4, np.nan, 0.6]):
        cad.begin_step([20, 20, 20])
        cad.record(np.array(row))
    got = cad.close().arrivals
    assert got.shape == (2, 3) and got[0].tolist() == [0.1, 0.2, 0.3] and np.isnan(got[1, 1])


# ------------------------------------------------------------- in the simulator

def mean_step(noise_cv, balance_arrivals, seed, speeds=(3, 1, 1, 1)):
    r = simulate(Cluster(ranks=4, noise=noise_cv, overhead=0.002, throughput=2000),
                 SpeedProfile.constant("speeds", list(speeds)), global_batch_size=256,
                 steps=1200, seed=seed, control=Control(balance_arrivals=balance_arrivals))
    return float(r.step_time[400:].mean()), r


def test_in_the_simulator_steadier_ranks_take_more_and_the_step_is_shorter():
    for seed in (0, 1, 2):
        on, run = mean_step([0.02, 0.15, 0.15, 0.15], True, seed)
        off, _ = mean_step([0.02, 0.15, 0.15, 0.15], False, seed)
        assert on < 0.99 * off, (seed, on / off)   # 0.984-0.988 at seeds 0-3
        assert run.final_sizes[0] > 136, run.final_sizes


def test_in_the_simulator_equal_noisy_ranks_stay_within_ten_percent():
    for seed in (0, 1):
        _, run = mean_step(0.1, True, seed, speeds=(1, 1, 1, 1))
        late = run.tracked_sizes[300:]
        assert (late.max(axis=1) / late.min(axis=1)).max() <= 1.1, seed
