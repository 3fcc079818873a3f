"""The callbacks' options (omnihvd.options): checked, resolved and agreed across ranks.
Pure, single process: the messages are the ones OmniLearnCallback raised before the
checks moved here, so users see the same text."""
import logging
import math

import numpy as np
import pytest

from omnihvd.errors import ConfigError, InfeasibleError, RankMismatchError
from omnihvd.options import (Options, agreed_error, check_agreement, option_values,
                             resolve_options)

pytestmark = pytest.mark.unit


def test_defaults_resolve_to_an_equal_split_and_the_controller_bounds():
    options, controller = resolve_options(4, global_batch_size=64)
    assert options.initial_batch_sizes == [16, 16, 16, 16]
    assert options.min_batch_size == [1] * 4 and options.max_batch_size == [64] * 4
    assert (options.adjust_every, options.settle_steps, options.policy) == (20, 1, "affine")
    assert (options.deadband, options.gain, options.timing) == (0.01, 1.0, "sustained")
    assert controller.lo.tolist() == options.min_batch_size
    assert controller.hi.tolist() == options.max_batch_size


def test_resolving_twice_gives_equal_options():
    kw = dict(global_batch_size=96, initial_batch_sizes=[16, 32, 48], max_batch_size=[40, 40, 60],
              deadband=0.1, gain=0.5, adjust_every=7, policy="proportional", settle_steps=2,
              timing="median", nonblocking=False, size_multiple=8, loss_reduction="sum",
              history_size=5)
    first, second = resolve_options(3, **kw)[0], resolve_options(3, **kw)[0]
    assert first == second and first.initial_batch_sizes == [16, 32, 48]
    assert first.max_batch_size == [40, 40, 60] and first.size_multiple == 8


def test_agreed_options_leave_out_the_per_rank_ones_and_keep_field_order():
    options, _ = resolve_options(2, global_batch_size=8, device_sync=None, cpu_quota=2.0)
    agreed = options.agreed()
    assert "device_sync" not in agreed and "cpu_quota" not in agreed
    assert list(agreed) == [f for f in Options._fields if f not in ("device_sync", "cpu_quota")]
    assert (options.device_sync, options.cpu_quota) == (None, 2.0)


def test_numpy_integers_are_ints_and_come_back_as_python_ints():
    options, _ = resolve_options(2, global_batch_size=np.int64(8), adjust_every=np.int32(3))
    assert type(options.global_batch_size) is int and type(options.adjust_every) is int


@pytest.mark.parametrize("option, value, message", [
    ("global_batch_size", 0, "global_batch_size must be an int >= 1, got 0"),
    ("global_batch_size", 8.0, "global_batch_size must be an int >= 1, got 8.0"),
    ("global_batch_size", True, "global_batch_size must be an int >= 1, got True"),
    ("adjust_every", 0, "adjust_every must be an int >= 1, got 0"),
    ("policy", "pid", "policy must be one of affine, proportional, got 'pid'"),
    ("timing", None, "timing must be one of sustained, median, mean, got None"),
    ("nonblocking", "no", "nonblocking must be True or False, got 'no'"),
    ("device_sync", 3, "device_sync must be 'auto', None or a callable, got 3"),
    ("cpu_quota", 0, "cpu_quota must be 'auto', None or a number of cores > 0, got 0"),
    ("cpu_quota", math.inf, "cpu_quota must be 'auto', None or a number of cores > 0, got inf"),
    ("cpu_quota", True, "cpu_quota must be 'auto', None or a number of cores > 0, got True"),
    ("loss_reduction", "none", "loss_reduction must be one of mean, sum, got 'none'"),
    ("history_size", 0, "history_size must be an int >= 1, got 0"),
    ("settle_steps", -1, "settle_steps must be an int >= 0, got -1"),
    ("settle_steps", 1.0, "settle_steps must be an int >= 0, got 1.0"),
])
def test_a_bad_option_is_named_with_its_value(option, value, message):
    with pytest.raises(ConfigError) as info:
        resolve_options(2, **dict({"global_batch_size": 8}, **{option: value}))
    assert str(info.value) == message


@pytest.mark.parametrize("kw, needle", [
    (dict(gain=0.0), "gain"), (dict(deadband=-0.1), "deadband"),
    (dict(min_batch_size=0), "min_batch_size"), (dict(max_batch_size=[8, 8, 8]), "max_batch_size"),
    (dict(initial_batch_sizes=[3, 4]), "sum to 7, not global_batch_size 8"),
    # a dict gives its keys (0 and 1 once read "[0, 1] sum to 1"): refused as a dict
    (dict(initial_batch_sizes={0: 3, 1: 5}), r"must be a list of 2 ints .* got \{0: 3, 1: 5\}"),
    (dict(gain=2.5), "gain must be in"),
    (dict(size_multiple=0), "size_multiple"),
])
def test_the_controllers_checks_still_apply(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        resolve_options(2, global_batch_size=8, **kw)


def test_batchnorm_raises_the_floor_to_two_and_says_so_once(caplog):
    with caplog.at_level(logging.INFO, logger="omnihvd"):
        options, controller = resolve_options(2, global_batch_size=8, batchnorm_layers=["bn1"],
                                              log_floor=True)
        resolve_options(2, global_batch_size=8, batchnorm_layers=["bn1"])  # not rank 0
    assert options.min_batch_size == [2, 2] and controller.lo.tolist() == [2, 2]
    assert [r.getMessage() for r in caplog.records if "BatchNorm" in r.getMessage()] == [
        "omnihvd: the model has BatchNorm layers (bn1): min_batch_size raised to 2 (a batch "
        "of one sample has no batch statistics)"]
    assert resolve_options(2, global_batch_size=8)[0].min_batch_size == [1, 1]
    assert resolve_options(2, global_batch_size=8, min_batch_size=3,
                           batchnorm_layers=["bn1"])[0].min_batch_size == [3, 3]


def test_a_batchnorm_floor_that_leaves_no_split_says_why():
    resolve_options(4, global_batch_size=6)  # feasible at the default floor of 1
    with pytest.raises(InfeasibleError, match="raised to 2 because the model has BatchNorm"):
        resolve_options(4, global_batch_size=6, batchnorm_layers=["bn"])


def test_option_values_takes_exactly_the_options_from_a_constructors_arguments():
    arguments = dict(self=object(), model=None, optimizer=None, comm=None,
                     abort_on_exception=None, hvd=None,
                     **{name: i for i, name in enumerate(Options._fields)})
    assert option_values(arguments) == {name: i for i, name in enumerate(Options._fields)}


def test_agreed_error_when_no_rank_failed():
    assert agreed_error([None, None, None], None, "OmniLearnCallback") is None


def test_the_same_value_error_everywhere_keeps_its_own_type_and_message():
    error = InfeasibleError("no split")
    assert agreed_error(["InfeasibleError: no split"] * 3, error, "X") is error


@pytest.mark.parametrize("reports, error", [
    ([None, "ConfigError: bad gain", None], None),                      # one rank failed
    (["ConfigError: a", "ConfigError: b"], ConfigError("a")),          # different failures
    (["TypeError: boom", "TypeError: boom"], TypeError("boom")),        # not a ValueError
])
def test_other_failures_become_one_config_error_naming_each_rank(reports, error):
    merged = agreed_error(reports, error, "OmniLearnCallback")
    assert isinstance(merged, ConfigError) and merged is not error
    failed = [r for r, m in enumerate(reports) if m is not None]
    assert str(merged).startswith("OmniLearnCallback rejected its configuration on %d of %d "
                                  "ranks (" % (len(failed), len(reports)))
    for r in failed:
        assert "rank %d: %s" % (r, reports[r]) in str(merged)


def test_check_agreement_names_every_key_that_differs_with_every_ranks_value():
    check_agreement([{"a": 1, "b": [2]}, {"a": 1, "b": [2]}])
    with pytest.raises(RankMismatchError) as info:
        check_agreement([{"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 5, "c": 4}])
    text = str(info.value)
    assert "b: rank 0 has 2, rank 1 has 5" in text and "c: rank 0 has 3, rank 1 has 4" in text
    assert "a:" not in text
