"""The callback's size schedule as its samplers and users see it (omnihvd.schedule's
ScheduledSizes over a SizeSchedule) and how a checkpoint is put back into it
(omnihvd.checkpoint.restore). Pure, single process."""
import types

import pytest

from omnihvd.checkpoint import checked_state, restore
from omnihvd.controller import Controller, partial_split
from omnihvd.errors import ConfigError
from omnihvd.schedule import BatchSchedule, ScheduledSizes, SizeSchedule

pytestmark = pytest.mark.unit


class Owner(ScheduledSizes):
    """What OmniLearnCallback adds: rank, num_ranks, global_batch_size, a schedule."""

    def __init__(self, rank, sizes, controller):
        self.rank, self.num_ranks, self.global_batch_size = rank, len(sizes), sum(sizes)
        c = controller
        self.schedule = SizeSchedule(rank, len(sizes), sum(sizes), sizes,
                                     partial=lambda s, t, _: partial_split(s, t, c.lo, c.hi,
                                                                           c.size_multiple))


def test_the_owner_is_a_batch_schedule_and_shows_the_sizes_in_effect():
    owner = Owner(1, [10, 30], Controller(2, 40))
    assert isinstance(owner, BatchSchedule)
    assert (owner.step, owner.current_step, owner.batch_sizes, owner.batch_size) == (
        0, 0, [10, 30], 30)
    assert owner.issue(0, 40) == [10, 30] and owner.issue(1, 40) == [10, 30]
    owner.schedule.change(2, [20, 20])
    owner.schedule.advance()
    assert owner.step == 1 and owner.batch_sizes_at(2) == [20, 20] and owner.batch_size == 30


def test_partial_steps_follow_the_bounds_now():
    controller = Controller(2, 40, min_batch_size=4)
    owner = Owner(0, [20, 20], controller)
    assert owner.can_split(10) and sum(owner.issue(0, 10)) == 10
    assert not owner.can_split(7)          # both ranks need 4
    assert owner.issue(0, 7) is None


def test_only_one_training_sampler_drives_the_schedule():
    owner = Owner(0, [20, 20], Controller(2, 40))
    train, validation = types.SimpleNamespace(), types.SimpleNamespace()
    train.train = owner.register_sampler(train)        # as HeterogeneousBatchSampler does
    validation.train = owner.register_sampler(validation)
    assert (train.train, validation.train) == (True, False)
    assert owner.schedule.samplers == [train, validation]
    with pytest.raises(ConfigError, match="train=False"):
        owner.register_sampler(types.SimpleNamespace(), train=True)


def state(**kw):
    base = {"global_batch_size": 40, "num_ranks": 2, "step": 6, "batch_sizes": [15, 25],
            "changes": [(4, [15, 25]), (8, [12, 28])], "max_batch_size": [40, 30]}
    base.update(kw)
    return checked_state(base)


def test_restore_from_as_many_ranks_keeps_sizes_changes_and_caps():
    controller = Controller(2, 40)
    schedule = SizeSchedule(0, 2, 40, [20, 20])
    assert restore(state(), controller, schedule, [20, 20]) is True
    assert schedule.step == 6 and schedule.batch_sizes_at(6) == [15, 25]
    assert schedule.batch_sizes_at(8) == [12, 28] and schedule.upcoming() == [(8, [12, 28])]
    assert controller.hi.tolist() == [40, 30]


def test_restore_re_splits_sizes_this_runs_bounds_exclude():
    controller = Controller(2, 40, max_batch_size=[30, 22])
    schedule = SizeSchedule(0, 2, 40, [20, 20])
    restore(state(), controller, schedule, [20, 20])
    for step in (6, 8):
        sizes = schedule.batch_sizes_at(step)
        assert sum(sizes) == 40 and sizes[1] <= 22 and controller.valid(sizes)


def test_restore_from_another_number_of_ranks_starts_from_the_initial_split():
    controller = Controller(2, 40)
    controller.observe([20, 20], [1.0, 2.0])
    schedule = SizeSchedule(0, 2, 40, [20, 20])
    saved = checked_state({"global_batch_size": 40, "num_ranks": 4, "step": 9,
                           "batch_sizes": [10, 10, 10, 10], "max_batch_size": [5, 5, 5, 25]})
    assert restore(saved, controller, schedule, [16, 24]) is False
    assert schedule.step == 9 and schedule.batch_sizes_at(9) == [16, 24]
    assert controller.hi.tolist() == [40, 40]          # another world's caps do not apply
    assert controller.state_dict()["sizes"] == []      # nor its measured history
