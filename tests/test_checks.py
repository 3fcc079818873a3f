"""The scalar checks every runtime module shares (omnihvd.checks): one wording.
Pure, single process."""
import math

import numpy as np
import pytest

from omnihvd.checks import check_choice, check_flag, check_int, check_number, is_int
from omnihvd.errors import ConfigError

pytestmark = pytest.mark.unit


def message(call, *args, **kw):
    with pytest.raises(ConfigError) as info:
        call(*args, **kw)
    return str(info.value)


@pytest.mark.parametrize("value", [0, 7, np.int64(7), np.int8(3)])
def test_ints_and_numpy_ints_pass_as_python_ints(value):
    assert check_int("n", value, 0) == int(value) and type(check_int("n", value, 0)) is int


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, "1", None, [1]])
def test_bools_floats_and_others_are_not_ints(value):
    assert not is_int(value)
    assert message(check_int, "n", value, 0) == "n must be an int >= 0, got %r" % (value,)


def test_the_int_message_says_the_bound_the_note_and_where():
    assert message(check_int, "adjust_every", 0, 1) == "adjust_every must be an int >= 1, got 0"
    assert message(check_int, "adjust_every", 0, 1, "rounds of one update per worker") == (
        "adjust_every must be an int >= 1 (rounds of one update per worker), got 0")
    assert message(check_int, "exit_code", 256, 1, maximum=255) == (
        "exit_code must be an int in 1..255, got 256")
    assert check_int("exit_code", 255, 1, maximum=255) == 255
    assert message(check_int, "batch_size", 0, 1, where="worker rank 2: ") == (
        "worker rank 2: batch_size must be an int >= 1, got 0")


def test_flags_are_true_or_false_only():
    assert check_flag("shuffle", True) is True and check_flag("shuffle", False) is False
    for value in (1, "no", None, np.bool_(True)):
        assert message(check_flag, "shuffle", value) == (
            "shuffle must be True or False, got %r" % (value,))


def test_choices_list_the_valid_ones():
    assert check_choice("timing", "median", ("sustained", "median")) == "median"
    assert message(check_choice, "staleness_lr", "x", (None, "inverse")) == (
        "staleness_lr must be one of None, inverse, got 'x'")


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf, -math.inf, True, "0.1", None])
def test_numbers_are_finite_and_at_least_the_minimum(value):
    assert message(check_number, "lr", value, 0) == "lr must be a number >= 0, got %r" % (value,)


def test_good_numbers_pass_as_floats():
    assert check_number("lr", 0, 0) == 0.0 and check_number("lr", np.float32(0.5), 0) == 0.5
    assert check_number("momentum", 2, 1.5) == 2.0
