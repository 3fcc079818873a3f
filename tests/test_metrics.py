"""omnihvd.tools.metrics (the ideal step time, a split's balance) and omnihvd.tools.levels (the
paper's heterogeneity levels): the one definition each, used by the simulator, the
emulator, the run logs and the benchmarks."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnihvd.tools import emulate, levels, metrics, simulate, telemetry
from omnihvd.errors import ConfigError

pytestmark = pytest.mark.unit


@given(st.lists(st.floats(1.0, 1e4), min_size=1, max_size=16), st.integers(1, 10 ** 5),
       st.floats(0.0, 0.1))
@settings(max_examples=200, deadline=None)
def test_the_ideal_split_equalises_every_rank(x, B, fixed):
    a = [fixed / (k + 1) for k in range(len(x))]
    T = metrics.ideal_step_time(B, x, a)
    sizes = [(T - ak) * xk for ak, xk in zip(a, x)]   # continuous split at time T
    assert math.isclose(sum(sizes), B, rel_tol=1e-9)
    assert math.isclose(metrics.balance(sizes, x, a, global_batch_size=B), 1.0, rel_tol=1e-9)


def test_balance_of_equal_batches_on_unequal_ranks():
    # speeds 1:1:2:4, no fixed cost: equal batches take B/4 / 1, the ideal B / 8
    assert metrics.balance([16, 16, 16, 16], [1.0, 1.0, 2.0, 4.0]) == 0.5
    assert metrics.split_time([16, 16, 16, 16], [1.0, 1.0, 2.0, 4.0]) == 16.0


def test_broadcasts_over_steps():
    x = np.array([[1.0, 3.0], [2.0, 2.0]])
    assert metrics.ideal_step_time(8, x).tolist() == [2.0, 2.0]
    assert metrics.balance(np.array([[2, 6], [4, 4]]), x).tolist() == [1.0, 1.0]


def test_measured_ideal_skips_unusable_times_and_checks_lengths():
    assert metrics.measured_ideal_step_time([10, 10], [1.0, float("nan")]) == 2.0
    assert math.isnan(metrics.measured_ideal_step_time([10], [0.0]))
    with pytest.raises(ConfigError, match="2 sizes and 1 times"):
        metrics.measured_ideal_step_time([1, 2], [1.0])
    assert telemetry.ideal_step_time is metrics.measured_ideal_step_time


def test_levels_are_defined_once_and_shared():
    assert levels.LEVEL_CORES["HL8"] == (6, 6, 4, 32)
    assert all(math.isclose(sum(s), 4.0) for s in levels.LEVELS.values())
    assert emulate.LEVELS is levels.LEVELS and emulate.DYNAMIC_LEVELS is levels.DYNAMIC_LEVELS
    assert simulate.HL_LEVELS == {k.lower(): v for k, v in levels.LEVEL_CORES.items()}
    assert simulate.DYNAMIC_SCHEDULE == tuple(k.lower() for k in levels.DYNAMIC_LEVELS)
    assert simulate.hl_speeds("hl2", 5).tolist() == list(levels.level_speeds("HL2", ranks=5))


@pytest.mark.parametrize("call, fragment", [
    (lambda: levels.level_speeds("HL3"), "'HL3'"),
    (lambda: levels.level_speeds(4), "level 4"),
    (lambda: levels.level_speeds("HL4", ranks=0), "ranks"),
    (lambda: emulate.level_speeds(None), "level None"),
])
def test_bad_levels_raise_config_error(call, fragment):
    with pytest.raises(ConfigError, match=fragment):
        call()
