"""Fast single-process tests of ``size_multiple`` (omnihvd.controller, pure numpy).

The multiple rule: every size is a multiple of k, except rank 0's, which is a
multiple of k plus ``total mod k``; so the sizes always sum to the total exactly,
and when k divides it every size is a multiple of k. Property tests in
test_controller.py's style (hypothesis, derandomized); small cases are checked
against a brute-force enumeration of every split.
"""
import itertools

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from omnihvd.controller import (
    Controller,
    TimeModel,
    apportion,
    is_valid_split,
    partial_split,
    rebalance,
    resolve_bounds,
    solve_time_model,
    unit_bounds,
)
from omnihvd.errors import ConfigError, InfeasibleError
from test_controller import FEW, PROPS, bounds, expand, seconds

pytestmark = pytest.mark.unit

multiples = st.sampled_from([1, 2, 3, 4, 8, 16])


@st.composite
def problem(draw, max_ranks=8, max_batch=300):
    """(n, B, k, lo, hi): bounds as ints, lists or None."""
    n = draw(st.integers(1, max_ranks), "n")
    B = draw(st.integers(n, max_batch), "B")
    k = draw(multiples, "k")
    lo, hi = draw(bounds(n, B))
    return n, B, k, lo, hi


def check(out, B, k, lo, hi):
    n = len(out)
    lo_v, hi_v = np.array(expand(lo, n, B, 1)), np.minimum(expand(hi, n, B, B), B)
    assert isinstance(out, list) and all(type(v) is int for v in out), out
    assert sum(out) == B, (out, B)
    assert all(l <= v <= h for v, l, h in zip(out, lo_v, hi_v)), (out, lo_v, hi_v)
    assert all(v % k == 0 for v in out[1:]) and out[0] % k == B % k, (out, k)
    assert is_valid_split(out, B, lo_v, hi_v, k)


def exists_valid_split(B, k, lo, hi):
    """Brute force: is there any split of B following the multiple rule in the bounds?"""
    ranges = [range(l, h + 1) for l, h in zip(lo, hi)]
    return any(sum(c) == B and is_valid_split(c, B, lo, hi, k)
               for c in itertools.product(*ranges))


@PROPS
@given(problem(), st.data())
def test_apportion_follows_the_multiple_rule_and_sums_to_B(p, data):
    n, B, k, lo, hi = p
    targets = data.draw(st.lists(st.floats(0, 1e6), min_size=n, max_size=n))
    try:
        out = apportion(targets, B, lo, hi, size_multiple=k)
    except InfeasibleError:
        lo_v, hi_v = resolve_bounds(n, B, lo, hi)
        with pytest.raises(InfeasibleError):
            unit_bounds(lo_v, hi_v, B, k)
        return
    check(out, B, k, lo, hi)


@FEW
@given(st.integers(1, 3), st.integers(1, 30), multiples, st.data())
def test_infeasible_exactly_when_no_split_exists(n, B, k, data):
    assume(B >= n)
    lo = data.draw(st.lists(st.integers(1, 8), min_size=n, max_size=n))
    hi = [data.draw(st.integers(v, 30)) for v in lo]
    try:
        out = apportion([1.0] * n, B, lo, hi, size_multiple=k)
    except InfeasibleError:
        assert not exists_valid_split(B, k, lo, [min(h, B) for h in hi])
        return
    assert exists_valid_split(B, k, lo, [min(h, B) for h in hi])
    check(out, B, k, lo, hi)


@PROPS
@given(problem(), st.data())
def test_rebalance_and_solve_follow_the_multiple_rule(p, data):
    n, B, k, lo, hi = p
    lo_v, hi_v = resolve_bounds(n, B, lo, hi)
    try:
        unit_bounds(lo_v, hi_v, B, k)
    except InfeasibleError:
        return  # covered above
    start = apportion([1.0] * n, B, lo, hi, size_multiple=k)
    times = data.draw(st.lists(seconds, min_size=n, max_size=n))
    deadband = data.draw(st.sampled_from([0.0, 0.1]))
    check(rebalance(start, times, B, min_batch_size=lo, max_batch_size=hi, deadband=deadband,
                    size_multiple=k), B, k, lo, hi)
    a = np.array(data.draw(st.lists(st.floats(0, 10), min_size=n, max_size=n)))
    c = np.array(data.draw(st.lists(st.floats(1e-4, 10), min_size=n, max_size=n)))
    check(solve_time_model(TimeModel(a, c), B, min_batch_size=lo, max_batch_size=hi,
                           size_multiple=k), B, k, lo, hi)


@FEW
@given(st.integers(2, 6), st.integers(1, 12), multiples, st.sampled_from(["affine", "proportional"]),
       st.data())
def test_controller_decisions_follow_the_multiple_rule(n, units, k, policy, data):
    B = k * units + data.draw(st.integers(0, k - 1), "remainder")
    assume(units >= n - (1 if B % k else 0))  # every rank but a remainder-only rank 0 needs a unit
    ctl = Controller(n, B, policy=policy, size_multiple=k)
    sizes = ctl.split([1.0] * n)
    check(sizes, B, k, 1, None)
    for _ in range(5):
        speeds = np.array(data.draw(st.lists(st.floats(0.1, 10), min_size=n, max_size=n)))
        times = 0.01 + np.array(sizes) / speeds
        sizes = ctl.decide(sizes, times.tolist())
        check(sizes, B, k, 1, None)


def test_multiple_of_k_gives_multiples_of_k_everywhere():
    assert apportion([1, 1, 2, 4], 64, size_multiple=8) == [8, 8, 16, 32]
    assert apportion([1, 1, 2, 4], 64, size_multiple=16) == [16, 16, 16, 16]
    ctl = Controller(4, 64, size_multiple=8)
    assert ctl.decide([16, 16, 16, 16], [4.0, 4.0, 2.0, 1.0]) == [8, 8, 16, 32]


def test_remainder_goes_to_rank_0():
    # 36 = 4 units of 8 + 4: rank 0 takes the 4 on top of its units
    assert apportion([1, 1, 2, 4], 36, size_multiple=8) == [4, 8, 8, 16]
    assert apportion([1, 1, 1], 10, size_multiple=4) == [2, 4, 4]
    assert apportion([1], 5, size_multiple=8) == [5]   # one rank: B itself


def test_size_multiple_one_is_the_plain_split():
    for targets, B in (([1, 1, 2, 4], 64), ([3, 1, 1], 11), ([0.2, 0.5, 0.3], 97)):
        assert apportion(targets, B, size_multiple=1) == apportion(targets, B)


def test_deadband_never_keeps_a_split_that_breaks_the_rule():
    # [9, 7] sums to B but is not a split in multiples of 4: it must change
    out = rebalance([9, 7], [1.0, 1.0], 16, deadband=0.5, size_multiple=4)
    assert out == [8, 8]


def test_partial_split_honours_the_multiple_rule():
    assert partial_split([8, 8, 16, 32], 40, size_multiple=8) == [8, 8, 8, 16]
    out = partial_split([8, 8, 16, 32], 37, size_multiple=8)
    assert sum(out) == 37 and all(v % 8 == 0 for v in out[1:]) and out[0] % 8 == 5
    assert partial_split([8, 8, 16, 32], 21, size_multiple=8) is None  # 4 ranks need 2 units


@pytest.mark.parametrize("call,error,pattern", [
    (lambda: apportion([1, 1], 8, size_multiple=0), ConfigError, "size_multiple must be >= 1"),
    (lambda: apportion([1, 1], 8, size_multiple=2.0), ConfigError, "size_multiple must be an integer"),
    (lambda: apportion([1, 1], 8, size_multiple=True), ConfigError, "size_multiple must be an integer"),
    (lambda: apportion([1, 1], 8, size_multiple=8), InfeasibleError, "size_multiple 8"),
    (lambda: apportion([1, 1], 16, [1, 5], [16, 6], size_multiple=4), InfeasibleError,
     r"rank 1's size to be a multiple of 4, and none lies in its bounds \[5, 6\]"),
    (lambda: Controller(3, 24, size_multiple=16), InfeasibleError, "size_multiple 16"),
])
def test_bad_or_infeasible_size_multiple_is_a_clear_error(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()
