"""Fast single-process tests of omnihvd.timing (pure numpy, a fake clock: no sleeping)."""
import math
import warnings

import numpy as np
import pytest

from omnihvd.errors import ConfigError
from omnihvd.timing import (StepTimer, TimedIterable, TimingWindow, _change_start_1d,
                            robust_step_time, speed_change_start, sustained_step_time)

pytestmark = pytest.mark.unit


def fake_clock(*readings):
    """A clock returning ``readings`` in turn; fails loudly if read once too often."""
    it = iter(readings)

    def clock():
        try:
            return next(it)
        except StopIteration:
            raise AssertionError("clock read more often than expected") from None

    return clock


# ------------------------------------------------------------ robust_step_time


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf"), -1.0, 0.0, -0.0])
def test_invalid_samples_are_ignored(garbage):
    clean = [0.2, 0.3, 0.4]
    assert robust_step_time(clean + [garbage], "median") == pytest.approx(0.3)
    assert robust_step_time(clean + [garbage], method="mean") == pytest.approx(0.3)


def test_only_invalid_or_no_samples_give_nan_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for samples in ([], [float("nan")], [0.0, -2.0, float("inf")]):
            for method in ("median", "mean"):
                assert math.isnan(robust_step_time(samples, method))


@pytest.mark.parametrize("position", [0, 2, 5])
def test_one_100x_outlier_does_not_move_the_median(position):
    clean = [0.25] * 5
    spiked = clean[:position] + [25.0] + clean[position:]
    assert robust_step_time(spiked, "median") == 0.25
    # ... whereas the mean is dragged far away by it
    assert robust_step_time(spiked, method="mean") > 4.0


def test_outlier_keeps_median_within_the_clean_samples():
    rng = np.random.default_rng(3)
    for _ in range(50):
        clean = rng.uniform(0.1, 0.2, size=rng.integers(3, 12))
        spiked = np.append(clean, 100 * clean.max())
        assert clean.min() <= robust_step_time(spiked, "median") <= clean.max()


def test_mean_method():
    assert robust_step_time([0.1, 0.3], method="mean") == pytest.approx(0.2)
    assert robust_step_time([0.1, 0.2, 0.6, float("nan"), -1], method="mean") == pytest.approx(0.3)


def test_returns_python_float_for_1d_input():
    out = robust_step_time(np.array([0.1, 0.2, 0.3]), "median")
    assert type(out) is float and out == pytest.approx(0.2)


def test_axis0_reduces_a_steps_by_ranks_array_per_rank():
    nan = float("nan")
    times = np.array([
        # rank0 rank1 rank2 rank3
        [0.10, 0.20, nan, 0.40],
        [0.10, 0.20, -1.0, 0.40],
        [9.00, 0.20, 0.0, 0.40],
        [0.10, 0.60, nan, 0.40],
        [0.10, 0.20, nan, 0.40],
    ])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the all-invalid column must not warn
        med = robust_step_time(times, "median", axis=0)
        mean = robust_step_time(times, method="mean", axis=0)
    assert med.shape == (4,)
    np.testing.assert_allclose(med[[0, 1, 3]], [0.10, 0.20, 0.40])
    assert math.isnan(med[2])
    np.testing.assert_allclose(mean[[0, 1, 3]], [9.4 / 5, 1.4 / 5, 0.40])
    assert math.isnan(mean[2])
    # axis=1 summarises each step over ranks instead
    np.testing.assert_allclose(robust_step_time(times[:2], "median", axis=1), [0.20, 0.20])


@pytest.mark.parametrize("method", ["max", "MEDIAN", "", None])
def test_unknown_method_is_a_config_error(method):
    with pytest.raises(ConfigError, match="median"):
        robust_step_time([0.1], method=method)


# ----------------------------------------------------------------- TimingWindow


def test_window_drops_settle_steps_then_keeps_valid_samples():
    w = TimingWindow(settle_steps=2, method="median")
    assert [w.add(s) for s in [5.0, 4.0, 0.2, 0.3, 0.25]] == [False, False, True, True, True]
    assert len(w) == 3 and w.summary() == pytest.approx(0.25)


def test_window_rejects_garbage_without_counting_it():
    w = TimingWindow(settle_steps=0)
    for bad in [float("nan"), float("inf"), -0.1, 0.0, None, "fast", object()]:
        assert w.add(bad) is False
    assert len(w) == 0 and math.isnan(w.summary())
    assert w.add(np.float32(0.5)) is True and w.add("0.25") is True  # numbers as strings/numpy
    assert len(w) == 2


def test_window_summary_is_robust_to_a_gc_pause():
    w = TimingWindow(settle_steps=0, method="median")
    for s in [0.2, 0.2, 30.0, 0.2, 0.2]:
        w.add(s)
    assert w.summary() == 0.2
    m = TimingWindow(settle_steps=0, method="mean")
    for s in [0.2, 0.4]:
        m.add(s)
    assert m.summary() == pytest.approx(0.3)


def test_window_reset_clears_and_settles_again():
    w = TimingWindow(settle_steps=1)
    w.add(1.0), w.add(0.5), w.add(0.7)
    assert len(w) == 2
    w.reset()
    assert len(w) == 0 and math.isnan(w.summary())
    assert w.add(0.9) is False  # settle step after the reset
    assert w.add(0.3) is True
    w.reset(settle=False)
    assert len(w) == 0 and w.add(0.4) is True and w.summary() == 0.4


def test_window_without_settle_steps_keeps_the_first_sample():
    w = TimingWindow(settle_steps=0)
    assert w.add(0.1) is True and w.summary() == 0.1


@pytest.mark.parametrize("settle", [-1, 1.5, True, "1", None])
def test_window_rejects_bad_settle_steps(settle):
    with pytest.raises(ConfigError, match="settle_steps"):
        TimingWindow(settle_steps=settle)


def test_window_rejects_bad_method():
    with pytest.raises(ConfigError, match="median"):
        TimingWindow(method="p90")


# ----------------------------------------------------- a change inside a window


def _noisy(level, n, cv, rng):
    return level * (1.0 + cv * rng.standard_normal(n))


def test_speed_change_start_finds_a_step_in_level():
    rng = np.random.default_rng(0)
    for at in (3, 7, 10, 17):  # both parts hold at least MIN_SEGMENT = 3 samples
        x = np.r_[_noisy(0.17, at, 0.02, rng), _noisy(0.26, 20 - at, 0.02, rng)]
        assert speed_change_start(x) == at
        assert speed_change_start(x[::-1] * 1.0) == 20 - at  # a speed-up as well


def test_speed_change_start_ignores_noise_pauses_and_quota_bursts():
    """Stationary windows are not cut (false alarms cost only samples; we count them)."""
    rng = np.random.default_rng(1)
    cases = {
        "noise": lambda: _noisy(0.2, 20, 0.1, rng),
        "pause": lambda: np.r_[_noisy(0.2, 19, 0.02, rng), [6.0]][rng.permutation(20)],
        "pause late": lambda: np.r_[_noisy(0.2, 17, 0.02, rng), [6.0, 0.2, 0.2]],
        "quota bursts": lambda: np.where(rng.random(20) < 0.3, 0.11, 0.02) * _noisy(1, 20, 0.05, rng),
        "heavy tail": lambda: 0.1 + rng.exponential(0.05, 20),
    }
    for name, draw in cases.items():
        alarms = sum(speed_change_start(draw()) > 0 for _ in range(1000))
        assert alarms <= 15, (name, alarms)
    assert speed_change_start(np.full(20, 0.2)) == 0  # no spread, no step: no change
    assert speed_change_start([0.2, 0.3, 0.2, 0.3, 0.2]) == 0  # too short to split


def test_speed_change_start_per_lane_with_missing_entries():
    x = np.full((12, 3), 0.2)
    x[6:, 0] = 0.3          # lane 0 changes at step 6
    x[[1, 8], 0] = np.nan   # with two missing samples
    x[:, 2] = np.nan        # lane 2 has none at all
    assert speed_change_start(x).tolist() == [6, 0, 0]


def test_speed_change_start_of_windows_too_small_to_split():
    # a scalar, an empty window and one with no steps yet answer "no change"
    assert speed_change_start(0.3) == 0
    assert speed_change_start([]) == 0
    assert speed_change_start(np.zeros((0, 3))).tolist() == [0, 0, 0]
    assert speed_change_start(np.full((4, 2, 2), 0.2)).shape == (2, 2)


def test_the_scalar_change_scan_answers_as_the_lane_scan_does():
    # one rank's window runs the plain-Python scan; many lanes run numpy's
    rng = np.random.default_rng(2)
    cuts = 0
    for _ in range(2000):
        n = int(rng.integers(1, 40))
        x = rng.uniform(0.01, 1) * (1 + rng.choice([0.02, 0.1, 0.3]) * rng.standard_normal(n))
        if rng.random() < 0.5:
            x[int(rng.integers(0, n + 1)):] *= rng.choice([0.5, 0.8, 1.3, 2.0])
        if rng.random() < 0.3:
            x[rng.integers(0, n)] = rng.choice([np.nan, -1.0, np.inf, 30.0])
        lanes = speed_change_start(np.stack([x, x], axis=1)).tolist()
        assert lanes == [_change_start_1d(x.tolist())] * 2 == [speed_change_start(x)] * 2, x
        cuts += lanes[0] > 0
    assert cuts > 200   # the comparison covered windows with a change, not only zeros


def test_window_summaries_follow_each_new_sample():
    # the tail after a change is kept between reads and dropped at every add: each
    # read equals a fresh window's over the same samples
    w, seen = TimingWindow(settle_steps=0, method="sustained"), []
    for s in [0.2] * 10 + [0.3] * 6:
        w.add(s)
        seen.append(s)
        fresh = TimingWindow(settle_steps=0, method="sustained")
        for kept in seen:
            fresh.add(kept)
        assert w.summary() == fresh.summary() and w.counts() == fresh.counts()
        assert w.measure() == fresh.measure()
    assert w.summary() == pytest.approx(0.3) and w.counts() == 6
    w.reset(settle=False)
    assert w.counts() == 0 and math.isnan(w.summary())


@pytest.mark.parametrize("method", ["sustained", "median"])
def test_window_describes_the_speed_after_a_change(method):
    w = TimingWindow(settle_steps=0, method=method)
    for s in [0.2] * 10 + [0.3] * 10:
        w.add(s)
    t, e, n = w.measure()
    assert t == pytest.approx(0.3) and w.summary() == pytest.approx(0.3)
    assert n == 10 == w.counts() and e == pytest.approx(0.0) == w.standard_error()
    v = TimingWindow(settle_steps=0, method=method)  # many lanes: each its own cut
    for s in [0.2] * 10 + [0.3] * 10:
        v.add(np.array([s, 0.25, s if len(v) < 15 else np.nan]))
    t, e, n = v.measure()
    assert np.allclose(t, [0.3, 0.25, 0.3]) and n.tolist() == [10, 20, 5]


def test_window_mean_keeps_every_sample_as_the_reference_does():
    w = TimingWindow(settle_steps=0, method="mean")
    for s in [0.2] * 10 + [0.3] * 10:
        w.add(s)
    assert w.summary() == pytest.approx(0.25) and w.counts() == 20


# ------------------------------------------------------------------- StepTimer


def test_timer_counts_up_to_the_first_mark():
    t = StepTimer(fake_clock(10.0, 10.25, 11.0))
    t.start()
    assert t.running and not t.marked
    t.mark_wait()   # 10.25: compute ends here
    assert t.marked
    t.mark_wait()   # a second entry into step(): ignored, the clock is not even read
    t.mark_wait()
    assert t.stop() == pytest.approx(0.25)
    assert not t.running and not t.marked


def test_timer_without_mark_counts_until_stop():
    t = StepTimer(fake_clock(1.0, 1.75))
    t.start()
    assert t.stop() == pytest.approx(0.75)


def test_timer_stop_without_start_returns_none():
    t = StepTimer(fake_clock())
    assert t.stop() is None
    t.mark_wait()  # no step running: nothing is marked and the clock is not read
    assert not t.marked and t.stop() is None


def test_timer_restart_forgets_the_previous_mark():
    t = StepTimer(fake_clock(0.0, 0.1, 5.0, 5.5))
    t.start(); t.mark_wait()
    t.start()  # a new step before stop(): begins at 5.0 with no mark
    assert not t.marked
    assert t.stop() == pytest.approx(0.5)


def test_timer_start_at_an_explicit_time():
    t = StepTimer(fake_clock(3.0))
    t.start(at=2.0)
    t.mark_wait()
    assert t.stop() == pytest.approx(1.0)


def test_timer_consecutive_steps_are_independent():
    t = StepTimer(fake_clock(0.0, 0.2, 1.0, 1.3, 2.0, 2.6))
    t.start(); t.mark_wait()
    first = t.stop()
    t.start(); t.mark_wait()
    second = t.stop()
    t.start()
    third = t.stop()
    assert [first, second, third] == pytest.approx([0.2, 0.3, 0.6])


# ------------------------------------------------------- device time (fake clock)


class FakeDevice:
    """A device whose queue drains at ``rate`` seconds of work per second of a shared
    fake clock: the host 'launches' work instantly, ``synchronize`` advances the clock
    to when the queue is empty."""

    def __init__(self, clock):
        self.clock = clock
        self.busy_until = 0.0
        self.syncs = 0

    def launch(self, seconds):
        self.busy_until = max(self.busy_until, self.clock.now) + seconds

    def synchronize(self):
        self.syncs += 1
        self.clock.now = max(self.clock.now, self.busy_until)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_device_sync_makes_the_local_time_include_queued_device_work():
    clock = FakeClock()
    dev = FakeDevice(clock)
    host_only, device = StepTimer(clock), StepTimer(clock, device_sync=dev.synchronize)
    for work in (0.010, 0.040):
        for timer in (host_only, device):
            timer.start()
            clock.now += 0.001          # the host launches forward and backward
            dev.launch(work)
            timer.mark_wait()
            clock.now += 0.5            # waiting for peers: never part of the local time
            dev.synchronize()
            # launched at 0.001 into the step, done 'work' later; the host alone sees 0.001
            assert timer.stop() == pytest.approx(0.001 + work if timer is device else 0.001)
    assert device.host_seconds == pytest.approx(0.001)  # the host part is kept apart


def test_device_sync_never_shortens_host_bound_steps():
    clock = FakeClock()
    dev = FakeDevice(clock)
    t = StepTimer(clock, device_sync=dev.synchronize)
    t.start()
    dev.launch(0.002)
    clock.now += 0.050                  # the host is the bottleneck (Python, data)
    t.mark_wait()
    assert t.stop() == pytest.approx(0.050)   # max(host, device)


def test_device_sync_runs_once_per_step_at_the_first_mark():
    clock = FakeClock()
    dev = FakeDevice(clock)
    t = StepTimer(clock, device_sync=dev.synchronize)
    t.mark_wait()                       # no step running: no sync
    t.start(); t.mark_wait(); t.mark_wait(); t.stop()
    t.start(); t.stop()                 # no mark (a loop without step()): no sync either
    assert dev.syncs == 1


def test_device_sync_must_be_callable():
    with pytest.raises(ConfigError, match="device_sync"):
        StepTimer(device_sync="cuda")


# ------------------------------------------------------------- data loading


def test_charged_work_is_added_to_the_next_step_only():
    t = StepTimer(fake_clock(1.0, 1.5, 2.0, 2.25))
    t.add(0.25); t.add(0.125)           # two next() calls before the step
    t.start(); t.mark_wait()
    assert t.stop() == pytest.approx(0.875)
    t.start(); t.mark_wait()
    assert t.stop() == pytest.approx(0.25)   # consumed by the step that took it


def test_discard_extra_drops_charges_of_an_abandoned_iteration():
    t = StepTimer(fake_clock(0.0, 0.5))
    t.add(3.0)
    t.discard_extra()
    t.start(); t.mark_wait()
    assert t.stop() == pytest.approx(0.5)


def test_timed_iterable_charges_every_next_of_a_loader_without_workers():
    charged, restarts = [], []
    ticks = iter(np.arange(0.0, 100.0, 0.5)).__next__   # each reading 0.5 s later
    data = TimedIterable([1, 2, 3], charged.append, restart=lambda: restarts.append(1), clock=ticks)
    assert list(data) == [1, 2, 3] and list(data) == [1, 2, 3]
    # the first next() too: it is an ordinary batch (it was left out, while the step
    # it fed was timed without it: 1 ms against 47 for a data-bound rank's others)
    assert charged == [0.5] * 6 and len(restarts) == 2   # StopIteration free
    assert len(data) == 3


def test_timed_iterable_leaves_the_step_fed_by_a_starting_worker_pool_untimed():
    class Loader(list):
        num_workers = 2
    charged = []
    ticks = iter(np.arange(0.0, 100.0, 0.5)).__next__
    assert list(TimedIterable(Loader([1, 2, 3]), charged.append, clock=ticks)) == [1, 2, 3]
    assert np.isnan(charged[0]) and charged[1:] == [0.5, 0.5]


def test_a_step_fed_by_work_of_unknown_cost_has_no_local_time():
    t = StepTimer(fake_clock(0.0, 0.5, 1.0, 1.25))
    t.add(float("nan")); t.start(); t.mark_wait()
    assert np.isnan(t.stop())
    t.start(); t.mark_wait()   # the next step is timed again
    assert t.stop() == pytest.approx(0.25)
    t = StepTimer(fake_clock(0.0, 0.5))
    t.start(); t.add(float("nan")); t.mark_wait()   # fetched inside the window
    assert np.isnan(t.stop())


def test_a_wait_left_out_burns_no_cpu_quota_time():
    # cb.global_count's allgather under a quota: MPI polls while it waits, and the CPU
    # floor brought the wait back (a fast rank at 0.5 core: 74.8 ms against the slow
    # rank's 44.8). Work 0.1 s (0.1 CPU s), then 0.3 s waiting that burns 0.3 CPU s.
    readings = [0.0, 0.1, 0.4, 0.4]
    t = StepTimer(fake_clock(*readings), cpu_cores=0.5, cpu_clock=fake_clock(*readings))
    t.start()
    with t.excluding():
        pass
    t.mark_wait()
    assert t.stop() == pytest.approx(0.2)   # 0.1 CPU s over 0.5 cores, not 0.4 / 0.5


def test_a_batch_fetched_inside_the_window_counts_once():
    # a loop that fetches after on_batch_begin: the wall interval has the next() in it
    # already (it was added again: 70 ms reported for 46 ms of work)
    t = StepTimer(fake_clock(0.0, 0.5))
    t.start(); t.add(0.2); t.mark_wait()
    assert t.stop() == pytest.approx(0.5)
    t = StepTimer(fake_clock(1.0, 1.5))
    t.add(0.2); t.start(); t.mark_wait()   # fetched before the window: added
    assert t.stop() == pytest.approx(0.7)


def test_timed_iterable_passes_the_loaders_attributes_through():
    class Loader(list):
        batch_sampler = "the sampler"
    data = TimedIterable(Loader([1]), lambda s: None)
    assert data.batch_sampler == "the sampler"
    with pytest.raises(AttributeError):
        data.no_such_thing


# ------------------------------------------------- sustained rate (bursty CPU)


def cfs_trace(work, quota, steps, *, period=0.010, gap=0.0005, phase=0.0, pause_every=None,
              pause=0.0):
    """Local times of a rank under a CFS quota: each step needs ``work`` CPU seconds;
    the rank may run ``quota * period`` per period, then stalls to the period's end.
    Between steps it idles ``gap`` (waiting for peers costs no quota)."""
    t, used, current, out = phase, 0.0, None, []
    budget = quota * period
    for k in range(steps):
        begin, left = t, work
        if pause_every and k % pause_every == pause_every - 1:
            left += pause
        while left > 1e-15:
            index = math.floor(t / period + 1e-12)
            if index != current:
                current, used = index, 0.0
            end = (index + 1) * period
            if used >= budget - 1e-15:
                t = end
                continue
            run = min(left, budget - used, end - t)
            used, t, left = used + run, t + run, left - run
        out.append(t - begin)
        t += gap
    return np.array(out)


def test_cfs_trace_is_bursty_like_a_quota_run():
    trace = cfs_trace(0.001, 0.3, 400)
    assert np.median(trace) < 0.0011                   # most steps run unthrottled ...
    assert trace.mean() > 2.5 * np.median(trace)       # ... but the stalls dominate the rate
    full = cfs_trace(0.002, 1.0, 50)
    np.testing.assert_allclose(full, 0.002)


@pytest.mark.parametrize("quota, work", [(0.3, 0.001), (0.3, 0.002), (0.5, 0.002),
                                         (0.6, 0.0037), (0.9, 0.002)])
def test_sustained_follows_the_quota_rate_where_the_median_does_not(quota, work):
    trace = cfs_trace(work, quota, 2000)
    truth = trace.mean()                               # the long-run local time per step
    windows = trace.reshape(-1, 20)                    # one window per adjustment
    sustained = np.array([sustained_step_time(w)[0] for w in windows])
    assert np.max(np.abs(sustained / truth - 1)) < 0.10, (quota, work)
    if quota < 0.9:  # the median picks the fast (or the stalled) steps, not the rate
        median = np.median(windows, axis=1)
        assert abs(np.median(median) / truth - 1) > 0.10, (quota, work)


def test_sustained_ignores_rare_pauses():
    rng = np.random.default_rng(0)
    clean = 0.010 * rng.lognormal(0, 0.05, size=(50, 20))
    paused = clean.copy()
    paused[:, 7] = 0.5                                 # one GC pause per window of 20
    paused[::5, 13] = 0.3                              # and a second in every fifth window
    for w_clean, w_paused in zip(clean, paused):
        t_clean, _ = sustained_step_time(w_clean)
        t_paused, e_paused = sustained_step_time(w_paused)
        assert abs(t_paused / t_clean - 1) < 0.03
        assert e_paused < 0.1 * t_paused               # the pause does not blow up the error
    assert np.mean(paused) > 2 * np.mean(clean)        # where the plain mean is dragged away


def test_sustained_keeps_equal_speed_ranks_within_ten_percent():
    """Equal quotas, different phases of the quota period: each rank's window
    estimates stay within 10% of the others' (the median's are far apart from the
    sustained rate and the means of single windows swing with the stalls)."""
    traces = [cfs_trace(0.0023, 0.5, 1900, phase=p) for p in (0.0, 0.0031, 0.0077)]
    per_rank = np.array([[sustained_step_time(w)[0] for w in t.reshape(-1, 19)] for t in traces])
    long_run = per_rank.mean(axis=1)
    assert long_run.max() / long_run.min() < 1.10


def test_sustained_standard_error_reflects_a_bimodal_window():
    t, e = sustained_step_time([0.002, 0.009] * 10)
    assert t == pytest.approx(0.0055, rel=0.05)
    assert 0.0005 < e < 0.002                            # wide: the noise gate must see it
    t, e = sustained_step_time([0.002] * 20)
    assert e == pytest.approx(0.0, abs=1e-12)


def test_sustained_with_few_samples_is_the_plain_mean_and_zero_error():
    assert sustained_step_time([0.2]) == (0.2, 0.0)
    t, e = sustained_step_time([0.2, 0.4])
    assert t == pytest.approx(0.3) and e == 0.0
    t, e = sustained_step_time([])
    assert math.isnan(t) and math.isnan(e)


def test_sustained_per_rank_axis_matches_one_rank_at_a_time():
    rng = np.random.default_rng(1)
    x = rng.lognormal(0, 0.3, size=(19, 5))
    x[3, 2] = np.nan
    t, e = sustained_step_time(x, axis=0)
    for r in range(5):
        tr, er = sustained_step_time(x[:, r])
        assert t[r] == pytest.approx(tr) and e[r] == pytest.approx(er)


def test_default_summary_is_sustained_everywhere():
    w = TimingWindow(settle_steps=0)
    assert w.method == "sustained"
    for s in [0.002, 0.002, 0.009] * 4:
        w.add(s)
    assert w.summary() == pytest.approx(sustained_step_time([0.002, 0.002, 0.009] * 4)[0])
    assert w.standard_error() == pytest.approx(sustained_step_time([0.002, 0.002, 0.009] * 4)[1])


def test_timer_cost_per_step_without_a_device_is_small():
    """Not a timed assertion: it counts the clock readings per step (2 on CPU)."""
    readings = []

    def clock():
        readings.append(1)
        return float(len(readings))

    t = StepTimer(clock)
    t.start(); t.mark_wait(); t.stop()
    assert len(readings) == 2


# ----------------------------------------------------------------- CPU quota


def test_cpu_quota_floor_charges_cpu_time_over_the_quota():
    wall, cpu = FakeClock(), FakeClock()
    t = StepTimer(wall, cpu_cores=0.5, cpu_clock=cpu)
    t.start()
    wall.now += 0.010; cpu.now += 0.008          # ran unthrottled on a refilled quota
    t.mark_wait()
    wall.now += 1.0; cpu.now += 0.2               # waiting (and polling) is not counted
    assert t.stop() == pytest.approx(0.016)       # 8 ms of CPU at half a core
    t.start()
    wall.now += 0.030; cpu.now += 0.004           # throttled or waiting on I/O: wall wins
    t.mark_wait()
    assert t.stop() == pytest.approx(0.030)


def test_cpu_clock_is_read_before_the_device_sync_and_only_with_a_quota():
    wall, cpu = FakeClock(), FakeClock()

    def spinning_sync():                          # cudaStreamSynchronize may spin the CPU
        wall.now += 0.005; cpu.now += 0.005
    t = StepTimer(wall, device_sync=spinning_sync, cpu_cores=0.25, cpu_clock=cpu)
    t.start(); wall.now += 0.001; cpu.now += 0.001
    t.mark_wait()
    assert t.stop() == pytest.approx(0.006)       # max(device 6 ms, 1 ms CPU / 0.25)

    def no_cpu_reads():
        raise AssertionError("CPU clock read without a quota")
    t = StepTimer(wall, cpu_clock=no_cpu_reads)
    t.start(); wall.now += 0.002; t.mark_wait()
    assert t.stop() == pytest.approx(0.002)


def test_clip_rare_into_a_scratch_array_gives_the_same_bits():
    from omnihvd.timing import _clip_rare
    rng = np.random.default_rng(2)
    values = rng.exponential(1.0, (30, 17))
    values[rng.random(values.shape) < 0.2] = np.nan
    want, n = _clip_rare(values, axis=1)
    out = np.empty_like(values)
    got, m = _clip_rare(values, axis=1, out=out)
    assert np.shares_memory(got, out) and m.tolist() == n.tolist()
    assert got.tobytes() == want.tobytes()
