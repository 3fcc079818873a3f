"""The shared adjustment cadence (omnihvd.cadence): pure, single process."""
import math

import numpy as np
import pytest

from omnihvd.cadence import Cadence, check_cadence, close_window
from omnihvd.controller import Controller
from omnihvd.errors import ConfigError

pytestmark = pytest.mark.unit


def cadence(n=2, B=60, **kw):
    kw.setdefault("adjust_every", 4)
    kw.setdefault("settle_steps", 1)
    return Cadence(Controller(n, B, policy="proportional"), **kw)


def test_windows_close_every_adjust_every_steps():
    cad = cadence(adjust_every=5)
    assert [s for s in range(20) if cad.gathers_at(s)] == [4, 9, 14, 19]


def test_a_change_of_sizes_opens_a_new_window_with_settle_steps():
    cad = cadence(settle_steps=2)
    cad.begin_step([30, 30])
    assert not cad.record(1.0) and not cad.record(1.0)  # the first window settles too
    cad.begin_step([30, 30])
    assert cad.record(1.0)
    cad.begin_step([20, 40])                           # new sizes: new window, settle again
    assert len(cad.window) == 0 and not cad.record(1.0)
    assert cad.window_sizes == [20, 40]


def test_close_window_summarises_and_empties_without_settling():
    cad = cadence(settle_steps=0)
    cad.begin_step([30, 30])
    for s in [0.2, 0.2, 0.2, 0.2]:
        cad.record(s)
    m = close_window(cad.window)
    assert m.time == pytest.approx(0.2) and m.error == 0.0 and m.count == 4
    assert len(cad.window) == 0 and cad.record(0.3)    # no settle: the sizes did not change


def test_decision_takes_effect_after_the_lookahead():
    cad = cadence()
    d = cad.decide(7, [30, 30], [0.4, 0.2], [0.0, 0.0], [3, 3], lookahead=2)
    assert d.changed and d.new_sizes == [20, 40] and d.effective_step == 10 and d.skipped is None
    assert cad.sizes_for(9, [30, 30]) == [30, 30] and cad.sizes_for(10, [30, 30]) == [20, 40]


def test_no_decision_while_a_change_is_not_measured_yet():
    cad = cadence(settle_steps=1)
    cad.decide(3, [30, 30], [0.4, 0.2], [0.0, 0.0], [3, 3], lookahead=5)   # effective at 9
    d = cad.decide(7, [30, 30], [0.4, 0.2], [0.0, 0.0], [3, 3])
    assert d.skipped and "step 9" in d.skipped and d.new_sizes is None and not d.changed
    assert cad.pending(9) is not None       # step 9 is the settle step at the new sizes
    assert cad.pending(10) is None          # step 10 is measured at them
    d = cad.decide(11, [20, 40], [0.2, 0.2], [0.0, 0.0], [2, 2])
    assert d.skipped is None and not d.changed and d.new_sizes == [20, 40]


def test_a_window_that_ends_before_its_deciding_step_is_judged_at_its_own_end():
    # the synchronous callback posts a gather at its step's start: the window ends a step
    # before the decision; a change first measured at the deciding step is not in it
    cad = cadence(settle_steps=1)
    cad.decide(3, [30, 30], [0.4, 0.2], [0.0, 0.0], [3, 3])                  # effective at 4
    d = cad.decide(5, [20, 40], [0.2, 0.2], [0.0, 0.0], [1, 1], measured_upto=4)
    assert d.skipped and "step 4" in d.skipped
    d = cad.decide(6, [20, 40], [0.3, 0.2], [0.0, 0.0], [1, 1], measured_upto=5)
    assert d.skipped is None and d.changed and d.effective_step == 7


def test_a_rank_without_valid_samples_skips_the_decision_naming_it():
    cad = cadence(n=3, B=30)
    for times, counts in (([0.1, math.nan, 0.1], [3, 0, 3]), ([0.1, 0.1, 0.1], [3, 3, 0]),
                          ([0.1, -1.0, 0.1], [3, 3, 3])):
        d = cad.decide(3, [10, 10, 10], times, [0.0] * 3, counts)
        assert d.skipped.startswith("no valid timing on rank(s)") and d.new_sizes is None
    assert "[1]" in cad.decide(3, [10, 10, 10], [0.1, math.nan, 0.1], None, [3, 0, 3]).skipped


def test_noise_gate_holds_differences_within_the_errors_except_for_mean():
    for timing, expect_change in (("sustained", False), ("median", False), ("mean", True)):
        cad = cadence(timing=timing)
        d = cad.decide(3, [30, 30], [0.21, 0.20], [0.01, 0.01], [10, 10])
        assert d.changed is expect_change, timing


def test_proposal_equal_to_what_is_scheduled_is_not_a_change():
    cad = cadence()
    assert cad.propose(3, [30, 30], [20, 40], lookahead=4).changed   # effective 8
    assert not cad.propose(5, [30, 30], [20, 40]).changed
    cad.forget_pending()
    assert cad.pending(5) is None


@pytest.mark.parametrize("kw, needle", [
    (dict(adjust_every=0, settle_steps=1), "adjust_every"),
    (dict(adjust_every=True, settle_steps=1), "adjust_every"),
    (dict(adjust_every=5, settle_steps=-1), "settle_steps"),
    (dict(adjust_every=5, settle_steps=1, lookahead=4), "exceed"),
    (dict(adjust_every=5, settle_steps=1, lookahead=-1), "lookahead"),
])
def test_bad_cadence_is_a_config_error(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        check_cadence(**kw)


def test_vector_windows_serve_many_simulated_ranks():
    cad = cadence(n=3, B=30, settle_steps=0)
    cad.begin_step(np.array([10, 10, 10]))
    for row in ([0.1, 0.2, np.nan], [0.1, 0.2, 0.3], [0.1, 0.2, np.inf]):
        cad.record(np.array(row))
    m = close_window(cad.window)
    np.testing.assert_allclose(m.time, [0.1, 0.2, 0.3])
    assert m.count.tolist() == [3, 3, 1]
    np.testing.assert_allclose(m.error, [0.0, 0.0, 0.0], atol=1e-12)
