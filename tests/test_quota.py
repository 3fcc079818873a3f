"""Balancing under CFS quotas (bursty CPU), in a pure closed loop: the real StepTimer
(fake wall and CPU clocks), the shared cadence, the estimator and the controller
against a model of the kernel's quota (tests/cfs_loop.py). No sleeping, no timing.
Reading the quota from cgroup files: tests/test_cpulimits.py."""
import numpy as np
import pytest

from cfs_loop import best_fixed_split, run_loop

pytestmark = pytest.mark.unit

PHASES = [0.0, 0.0031, 0.0077]   # ranks started at different points of the quota period
B = 96


@pytest.mark.parametrize("quotas", [[1.0, 0.6, 0.3], [0.3, 0.3, 1.0]])
def test_quota_ranks_reach_the_best_fixed_split(quotas):
    best_time, best = best_fixed_split(quotas, B, grid=8, steps=150, phases=PHASES)
    sizes, times = run_loop(quotas, B, 1200, phases=PHASES)
    tail = times[400:].mean()
    assert best_time / tail >= 0.97, (best, sizes[-1].tolist())
    # and it stays there: no oscillation in the second half
    assert np.ptp(sizes[600:], axis=0).max() <= 0.1 * B / len(quotas)


def test_without_the_quota_floor_sizes_oscillate_far_from_the_best_split():
    """Why StepTimer takes cpu_cores: a rank that idles while it waits refills its
    quota, measures its unthrottled speed at a small batch and is throttled at the
    batch that speed suggests. Every estimator fails on such times."""
    best_time, _ = best_fixed_split([1.0, 0.6, 0.3], B, grid=8, steps=150, phases=PHASES)
    for timing in ("sustained", "median", "mean"):
        _, times = run_loop([1.0, 0.6, 0.3], B, 1200, phases=PHASES, quota_aware=False,
                            timing=timing)
        assert best_time / times[400:].mean() < 0.8, timing


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equal_quotas_keep_equal_sizes(seed):
    sizes, _ = run_loop([0.5, 0.5, 0.5], B, 1500, phases=PHASES, seed=seed)
    tail = sizes[300:]
    ratio = tail.max(axis=1) / tail.min(axis=1)
    assert np.mean(ratio > 1.10) <= 0.05 and ratio.max() <= 1.15, ratio.max()
    mean = tail.mean(axis=0)
    assert mean.max() / mean.min() <= 1.05, mean
