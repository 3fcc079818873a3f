"""Fast single-process tests of omnihvd.timing (pure numpy, a fake clock: no sleeping)."""
import math
import warnings

import numpy as np
import pytest

from omnihvd.errors import ConfigError
from omnihvd.timing import StepTimer, TimingWindow, robust_step_time

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
