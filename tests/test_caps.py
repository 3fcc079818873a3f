"""Memory caps after out-of-memory errors (omnihvd.caps). Pure, single process."""
import math

import pytest

from omnihvd.caps import lowered_cap, tighten_caps
from omnihvd.controller import Controller
from omnihvd.errors import ConfigError, InfeasibleError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("size, floor, cap, shrink, expected", [
    (40, 1, 64, 0.8, 32),    # shrink times the failed size
    (40, 1, 20, 0.8, 20),    # a lower cap waiting for the gather is kept
    (3, 2, 64, 0.5, 2),      # never below min_batch_size
    (10, 1, 64, 0.15, 1),
])
def test_the_lowered_cap(size, floor, cap, shrink, expected):
    assert lowered_cap(size, floor, cap, shrink, rank=0) == expected


@pytest.mark.parametrize("shrink", [0, 1, 1.5, -0.2, math.nan, True, "0.5", None])
def test_shrink_must_be_a_number_in_the_open_unit_interval(shrink):
    with pytest.raises(ConfigError) as info:
        lowered_cap(40, 1, 64, shrink, rank=0)
    assert str(info.value) == "shrink must be a number in (0, 1), got %r" % (shrink,)


def test_a_rank_at_its_minimum_has_nothing_to_shed():
    with pytest.raises(InfeasibleError, match="rank 3 ran out of memory at batch size 2, "
                                              "already its min_batch_size"):
        lowered_cap(2, 2, 64, 0.8, rank=3)


def test_caps_only_ever_lower_the_bounds():
    c = Controller(3, 90)
    assert not tighten_caps(c, [90, 90, 90]) and c.hi.tolist() == [90, 90, 90]
    assert tighten_caps(c, [90, 25, 90]) and c.hi.tolist() == [90, 25, 90]
    assert not tighten_caps(c, [90, 50, 90]) and c.hi.tolist() == [90, 25, 90]
    split = c.split([1, 1, 1])  # an equal target, re-split within the new cap
    assert sum(split) == 90 and split[1] == 25


def test_caps_that_cannot_hold_the_global_batch_are_infeasible():
    c = Controller(2, 60)
    with pytest.raises(InfeasibleError):
        tighten_caps(c, [20, 20])
