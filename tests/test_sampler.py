"""Fast single-process tests of HeterogeneousBatchSampler: n simulated ranks in one process.

Each simulated rank has its own schedule object (the role the callback plays on a real
rank); the ranks are stepped in lock-step and every schedule's ``current_step`` is
advanced after each global step, as ``OmniLearnCallback.on_batch_end`` does.
"""
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from omnihvd.controller import apportion, partial_split
from omnihvd.errors import ConfigError
from omnihvd.sampler import HeterogeneousBatchSampler, StaticSchedule

pytestmark = pytest.mark.single

PROPS = settings(derandomize=True, max_examples=60, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow])


class ChangingSchedule:
    """Sizes that change at given global steps: ``changes = {first_step: sizes}``.

    Deterministic in the step, like the callback's schedule: every simulated rank
    (and every DataLoader prefetch) sees the same sizes for the same step.
    """

    def __init__(self, changes, rank, current_step=0):
        self.changes = dict(changes)
        first = self.changes[0]
        self.rank, self.num_ranks = rank, len(first)
        self.global_batch_size = sum(first)
        self.current_step = current_step
        self.issued = []

    def sizes_at(self, step):
        return self.changes[max(s for s in self.changes if s <= step)]

    def issue(self, step, total):
        self.issued.append(step)
        sizes = self.sizes_at(step)
        return list(sizes) if total == self.global_batch_size else apportion(sizes, total)


def world(N, make_schedule, n, **kwargs):
    return [HeterogeneousBatchSampler(N, make_schedule(r), **kwargs) for r in range(n)]


def run_epoch(samplers, epoch=None, max_steps=None):
    """Lock-step one epoch (or ``max_steps`` of it); returns per-step lists of rank batches."""
    if epoch is not None:
        for s in samplers:
            s.set_epoch(epoch)
    steps = []
    iters = [iter(s) for s in samplers]
    while max_steps is None or len(steps) < max_steps:
        batches = [next(it, None) for it in iters]
        if all(b is None for b in batches):
            break
        assert None not in batches, "ranks ran different numbers of steps: %r" % (
            [b is None for b in batches],)
        steps.append(batches)
        for s in samplers:
            s.schedule.current_step += 1
    return steps


def flat(steps):
    return [i for step in steps for batch in step for i in batch]


def expected_coverage(N, B, n, drop_last):
    rest = N % B
    return N if (not drop_last and rest >= n) else N - rest


def check_epoch(steps, samplers, N, B, n, drop_last):
    seen = flat(steps)
    assert len(seen) == len(set(seen)), "a sample was handed out twice"
    assert len(seen) == expected_coverage(N, B, n, drop_last)
    assert set(seen) <= set(range(N))
    order = samplers[0].order().tolist()
    assert sorted(seen) == sorted(order[:len(seen)]), "not a prefix of the epoch's order"
    assert all(len(steps) == len(s) for s in samplers)  # __len__ agrees with the steps run
    for j, step in enumerate(steps):
        if (j + 1) * B <= N:
            assert sum(len(b) for b in step) == B  # full steps hold exactly B
        assert all(len(b) >= 1 for b in step)


# -------------------------------------------------------------- coverage


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("N,sizes", [
    (60, [2, 3, 5, 10]),    # N divisible by B
    (67, [2, 3, 5, 10]),    # 7 left over, more than ranks
    (62, [2, 3, 5, 10]),    # 2 left over, fewer than ranks: dropped either way
    (64, [2, 3, 5, 10]),    # exactly as many left over as ranks: one each
    (20, [2, 3, 5, 10]),    # exactly one step
    (10, [1, 1, 1]),        # one sample per rank
    (7, [7]),               # one rank
])
def test_static_sizes_cover_every_sample_once(N, sizes, drop_last):
    n, B = len(sizes), sum(sizes)
    samplers = world(N, lambda r: StaticSchedule(sizes, r), n, seed=5, drop_last=drop_last)
    for epoch in range(2):
        steps = run_epoch(samplers, epoch)
        check_epoch(steps, samplers, N, B, n, drop_last)
        for step in steps[:N // B]:
            assert [len(b) for b in step] == sizes


@given(data=st.data())
@PROPS
def test_changing_sizes_cover_every_sample_once(data):
    n = data.draw(st.integers(1, 5), "n")
    B = data.draw(st.integers(n, 40), "B")
    N = data.draw(st.integers(B, 8 * B), "N")
    drop_last = data.draw(st.booleans(), "drop_last")
    seed = data.draw(st.integers(0, 2 ** 62 - 1), "seed")

    def split():
        cuts = sorted(data.draw(st.lists(st.integers(1, B - 1), min_size=n - 1, max_size=n - 1,
                                         unique=True))) if n > 1 else []
        return [b - a for a, b in zip([0] + cuts, cuts + [B])]

    first_steps = data.draw(st.lists(st.integers(1, 30), max_size=4, unique=True), "changes")
    changes = {0: split(), **{s: split() for s in first_steps}}
    samplers = world(N, lambda r: ChangingSchedule(changes, r), n, seed=seed, drop_last=drop_last)
    for epoch in range(2):
        steps = run_epoch(samplers, epoch)
        check_epoch(steps, samplers, N, B, n, drop_last)
        base = samplers[0].schedule.current_step - len(steps)
        for j, step in enumerate(steps[:N // B]):
            assert [len(b) for b in step] == changes[max(
                s for s in changes if s <= base + j)], "sizes not applied at their step"


def test_size_change_takes_effect_at_the_scheduled_step_on_every_rank():
    changes = {0: [4, 4], 3: [2, 6], 5: [7, 1]}
    samplers = world(48, lambda r: ChangingSchedule(changes, r), 2, seed=0)
    steps = run_epoch(samplers, 0)
    assert [[len(b) for b in step] for step in steps] == \
        [[4, 4]] * 3 + [[2, 6]] * 2 + [[7, 1]]
    # the epoch after continues with the global step count (6, 7, ...)
    steps = run_epoch(samplers, 1)
    assert all([len(b) for b in step] == [7, 1] for step in steps)
    assert samplers[0].schedule.issued == list(range(12))


def test_partial_split_matches_apportion():
    samplers = world(23, lambda r: StaticSchedule([2, 6], r), 2, shuffle=False, drop_last=False)
    last = run_epoch(samplers, 0)[-1]
    assert [len(b) for b in last] == apportion([2, 6], 7)
    assert sorted(last[0] + last[1]) == list(range(16, 23))


class BoundedSchedule(ChangingSchedule):
    """A ChangingSchedule with the callback's per-rank bounds for the partial step."""

    def __init__(self, changes, rank, min_batch_size=1, max_batch_size=None, size_multiple=1):
        super().__init__(changes, rank)
        self.bounds = (min_batch_size, max_batch_size, size_multiple)
        self.read = []  # steps read by samplers that record nothing

    def issue(self, step, total, record=True):
        (self.issued if record else self.read).append(step)
        sizes = self.sizes_at(step)
        return list(sizes) if total == self.global_batch_size else partial_split(
            sizes, total, *self.bounds)

    def can_split(self, total):
        return partial_split(self.sizes_at(self.current_step), total, *self.bounds) is not None


def test_partial_step_below_the_minimum_is_dropped():
    # The issue's example: 4 ranks of minimum 2 cannot share the 5 samples left over
    # ([1, 1, 1, 2] would break BatchNorm); the step is dropped, like drop_last=True.
    samplers = world(2 * 64 + 5, lambda r: BoundedSchedule({0: [8, 8, 16, 32]}, r, 2), 4,
                     drop_last=False)
    steps = run_epoch(samplers, 0)
    assert len(steps) == 2 and all(len(s) == 2 for s in samplers)
    assert len(set(flat(steps))) == 128


def test_partial_step_within_the_bounds_hands_out_every_sample_once():
    samplers = world(2 * 64 + 9, lambda r: BoundedSchedule({0: [8, 8, 16, 32]}, r, 2), 4,
                     drop_last=False)
    steps = run_epoch(samplers, 0)
    assert [len(b) for b in steps[-1]] == [2, 2, 2, 3]
    assert sorted(flat(steps)) == list(range(2 * 64 + 9))


@given(data=st.data())
@PROPS
def test_partial_step_respects_the_bounds_or_is_dropped(data):
    n = data.draw(st.integers(1, 5), "n")
    k = data.draw(st.sampled_from([1, 1, 2, 4]), "size_multiple")
    lo = data.draw(st.integers(1, 4), "min_batch_size")
    B = k * data.draw(st.integers(max(n, -(-n * lo // k)), 20), "units")
    assume(partial_split([1] * n, B, lo, None, k) is not None)
    sizes = partial_split([1] * n, B, lo, None, k)
    N = data.draw(st.integers(B, 4 * B), "N")
    samplers = world(N, lambda r: BoundedSchedule({0: sizes}, r, lo, None, k), n,
                     seed=data.draw(st.integers(0, 1000), "seed"), drop_last=False)
    steps = run_epoch(samplers, 0)
    seen = flat(steps)
    assert len(seen) == len(set(seen)), "a sample was handed out twice"
    rest = N % B
    kept = rest >= n and partial_split(sizes, rest, lo, None, k) is not None
    assert len(seen) == (N if kept else N - rest)
    if kept:
        last = [len(b) for b in steps[-1]]
        assert sum(last) == rest and min(last) >= lo, last
        assert all(b % k == 0 for b in last[1:]) and last[0] % k == rest % k, last


def test_evaluation_sampler_records_nothing_in_the_schedule():
    schedules = [BoundedSchedule({0: [4, 4], 3: [2, 6]}, r) for r in range(2)]
    train = [HeterogeneousBatchSampler(40, s, drop_last=False) for s in schedules]
    val = [HeterogeneousBatchSampler(21, s, drop_last=False, train=False) for s in schedules]
    run_epoch(train, 0, max_steps=4)
    assert schedules[0].issued == [0, 1, 2, 3]
    for s in schedules:
        s.current_step = 4
    batches = [list(v) for v in val]
    # every batch of the evaluation pass has the current split; the partial one too
    assert [[len(b) for b in step] for step in zip(*batches)] == [[2, 6], [2, 6], [1, 4]]
    assert sorted(i for rank in batches for b in rank for i in b) == list(range(21))
    assert schedules[0].issued == [0, 1, 2, 3] and schedules[0].read == [4, 4, 4]
    assert val[0].position() == 0 and train[0].position() == 4


def test_unshuffled_order_is_the_dataset_order():
    s0, s1 = world(10, lambda r: StaticSchedule([2, 3], r), 2, shuffle=False)
    assert run_epoch([s0, s1], 0) == [[[0, 1], [2, 3, 4]], [[5, 6], [7, 8, 9]]]


# ----------------------------------------------------------------- ordering


def test_order_is_deterministic_from_seed_and_epoch():
    def epoch_batches(seed, epoch):
        return run_epoch(world(50, lambda r: StaticSchedule([3, 7], r), 2, seed=seed), epoch)

    assert epoch_batches(7, 0) == epoch_batches(7, 0)
    assert epoch_batches(7, 1) == epoch_batches(7, 1)
    assert epoch_batches(7, 0) != epoch_batches(7, 1)
    assert epoch_batches(7, 0) != epoch_batches(8, 0)
    # seed + epoch is what matters: ranks that agree on it agree on the order
    s = HeterogeneousBatchSampler(50, StaticSchedule([10]), seed=3)
    s.set_epoch(2)
    first = s.order().tolist()
    s.set_epoch(0)
    s.set_epoch(2)
    assert s.order().tolist() == first and sorted(first) == list(range(50))



def test_numpy_integers_are_taken_as_ints():
    # for epoch in np.arange(E): the check accepted np.int64, then torch's
    # Generator.manual_seed refused it when the epoch was iterated
    import json

    import numpy as np

    s = HeterogeneousBatchSampler(np.int64(20), StaticSchedule([4, 6], 1), seed=np.int64(3))
    plain = HeterogeneousBatchSampler(20, StaticSchedule([4, 6], 1), seed=3)
    for epoch in np.arange(2):
        s.set_epoch(epoch)
        plain.set_epoch(int(epoch))
        assert list(s) == list(plain)
    s.load_state_dict({**s.state_dict(), "step_in_epoch": np.int64(1), "epoch": np.int64(1)})
    assert list(s) == list(plain)[1:]
    json.dumps(s.state_dict())   # plain ints: a JSON checkpoint takes it

def test_every_epoch_has_a_different_order_and_reiteration_repeats_it():
    s = HeterogeneousBatchSampler(40, StaticSchedule([8]), seed=11)
    orders = []
    for epoch in range(4):
        s.set_epoch(epoch)
        a, b = list(s), list(s)  # iterating twice without set_epoch repeats the epoch
        assert a == b
        orders.append(tuple(a[0]))
    assert len(set(orders)) == 4


@pytest.mark.parametrize("epoch", [-1, 1.0, "1", True, None])
def test_set_epoch_rejects_bad_values(epoch):
    s = HeterogeneousBatchSampler(10, StaticSchedule([5]))
    with pytest.raises(ConfigError, match="epoch"):
        s.set_epoch(epoch)


# ----------------------------------------------------------------- resuming


def resume_world(N, sizes_for, n, state, global_step, **kwargs):
    samplers = world(N, lambda r: ChangingSchedule(sizes_for(n), r, current_step=global_step),
                     n, **kwargs)
    for s in samplers:
        s.load_state_dict(state)
        s.set_epoch(state["epoch"])  # same epoch: the position is kept
    return samplers


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("n_after", [3, 1, 2, 5])
@pytest.mark.parametrize("stop_at", [0, 1, 4, 6])
def test_mid_epoch_resume_hands_out_exactly_the_remaining_samples(stop_at, n_after, drop_last):
    N, B = 73, 10  # 7 full steps + 3 left over: a partial step for up to 3 ranks

    def sizes_for(n):
        return {0: apportion([1] * n, B), 2: apportion(list(range(1, n + 1)), B)}

    kwargs = dict(seed=123, drop_last=drop_last)
    before = world(N, lambda r: ChangingSchedule(sizes_for(3), r), 3, **kwargs)
    run_epoch(before, 0)                      # a complete epoch 0 first
    head = run_epoch(before, 1, max_steps=stop_at)
    states = [s.state_dict() for s in before]
    assert all(state == states[0] for state in states)  # identical on every rank
    state = states[0]
    assert state["epoch"] == 1 and state["step_in_epoch"] == stop_at

    global_step = before[0].schedule.current_step
    after = resume_world(N, sizes_for, n_after, state, global_step, **kwargs)
    total_steps = N // B + (0 if drop_last or N % B < n_after else 1)
    assert all(len(s) == total_steps - stop_at for s in after)
    tail = run_epoch(after)
    assert len(tail) == total_steps - stop_at

    epoch_order = before[0].order().tolist()
    got = flat(head) + flat(tail)
    assert len(got) == len(set(got)), "a sample was repeated across the resume"
    assert set(flat(head)) == set(epoch_order[:stop_at * B])
    assert set(flat(tail)) == set(epoch_order[stop_at * B:len(got)])
    # the last partial step follows the policy for the resumed run's rank count
    assert len(got) == expected_coverage(N, B, n_after, drop_last)

    # the next epoch starts from its beginning again
    nxt = run_epoch(after, 2)
    assert len(nxt) == total_steps
    check_epoch(nxt, after, N, B, n_after, drop_last)


def test_state_before_iterating_and_after_the_epoch():
    samplers = world(30, lambda r: StaticSchedule([2, 3], r), 2)
    assert samplers[0].state_dict()["step_in_epoch"] == 0
    run_epoch(samplers, 0)
    state = samplers[0].state_dict()
    assert state == {"epoch": 0, "step_in_epoch": 6, "seed": 0, "num_samples": 30,
                     "global_batch_size": 5, "shuffle": True, "drop_last": True}
    # resuming a finished epoch yields nothing more for it, then the next epoch is whole
    fresh = world(30, lambda r: StaticSchedule([2, 3], r), 2)
    for s in fresh:
        s.load_state_dict(state)
        s.set_epoch(0)
    assert run_epoch(fresh) == []
    assert len(run_epoch(fresh, 1)) == 6


def test_set_epoch_again_mid_pass_keeps_the_position():
    # it reset the position to 0 while the loop was at step 3: a checkpoint then would
    # have rerun those 3 steps' samples
    samplers = world(30, lambda r: StaticSchedule([2, 3], r), 2)
    run_epoch(samplers, 0, max_steps=3)
    for s in samplers:
        s.set_epoch(0)
    assert samplers[0].state_dict()["step_in_epoch"] == 3


def test_length_of_a_resumed_pass_holds_while_a_prefetching_loader_runs_ahead():
    # a DataLoader with workers draws the last batches ahead of the loop: len() went
    # from the pass's 4 steps to the whole epoch's 6 once the generator was exhausted
    state = {"epoch": 0, "step_in_epoch": 2, "seed": 0, "num_samples": 30,
             "global_batch_size": 5}
    sampler = world(30, lambda r: StaticSchedule([2, 3], r), 1)[0]
    sampler.load_state_dict(state)
    sampler.set_epoch(0)
    assert len(sampler) == 4
    drawn = list(sampler)          # all drawn ahead, none trained yet
    assert len(drawn) == 4 and len(sampler) == 4
    sampler.set_epoch(1)
    assert len(sampler) == 6


@pytest.mark.parametrize("option", ["shuffle", "drop_last"])
def test_a_checkpoint_of_another_shuffle_or_drop_last_is_refused(option):
    # with another shuffle, 5 of 20 samples of the interrupted epoch ran twice, 5 never
    made = world(30, lambda r: StaticSchedule([2, 3], r), 1)[0]
    run_epoch([made], 0, max_steps=2)
    other = world(30, lambda r: StaticSchedule([2, 3], r), 1, **{option: not getattr(made, option)})[0]
    with pytest.raises(ConfigError, match="sampler checkpoint has %s=" % option):
        other.load_state_dict(made.state_dict())


def test_a_finished_epoch_resumes_as_finished_where_its_partial_step_no_longer_fits():
    # 33 samples in steps of 5: two ranks keep the partial step of 3 (7 steps), five
    # ranks cannot split it (6): the epoch done on two is done on five
    two = world(33, lambda r: StaticSchedule([2, 3], r), 2, drop_last=False)
    run_epoch(two, 0)
    state = two[0].state_dict()
    assert state["step_in_epoch"] == 7
    five = world(33, lambda r: StaticSchedule([1, 1, 1, 1, 1], r), 5, drop_last=False)
    for s in five:
        s.load_state_dict(state)
        s.set_epoch(0)
    assert len(five[0]) == 0 and run_epoch(five) == []
    assert len(run_epoch(five, 1)) == 6


def test_state_is_a_plain_round_trippable_dict():
    s = HeterogeneousBatchSampler(30, StaticSchedule([5]), seed=9)
    s.set_epoch(3)
    it = iter(s)
    next(it), next(it)
    s.schedule.current_step = 2
    state = s.state_dict()
    other = HeterogeneousBatchSampler(30, StaticSchedule([5]), seed=9)
    other.load_state_dict(dict(state))
    assert other.state_dict() == state  # before iterating, the loaded position is reported


def test_load_then_other_epoch_starts_that_epoch_from_the_beginning():
    s = HeterogeneousBatchSampler(30, StaticSchedule([5]), seed=9)
    s.load_state_dict({"epoch": 2, "step_in_epoch": 4, "seed": 9, "num_samples": 30,
                       "global_batch_size": 5})
    assert len(s) == 2
    s.set_epoch(3)
    assert len(s) == 6 and len(list(s)) == 6


@pytest.mark.parametrize("key,value", [("num_samples", 31), ("seed", 1), ("global_batch_size", 6)])
def test_mismatched_checkpoint_is_a_config_error(key, value):
    s = HeterogeneousBatchSampler(30, StaticSchedule([2, 3]))
    state = dict(s.state_dict(), **{key: value})
    with pytest.raises(ConfigError, match=key):
        s.load_state_dict(state)


@pytest.mark.parametrize("state", [
    {},
    {"epoch": 0},
    {"step_in_epoch": 1},
    {"epoch": "zero", "step_in_epoch": 1},
    {"epoch": 0, "step_in_epoch": None},
    {"epoch": 0, "step_in_epoch": -1},
    {"epoch": 0, "step_in_epoch": 7},       # only 6 steps per epoch
])
def test_malformed_checkpoint_is_a_config_error(state):
    s = HeterogeneousBatchSampler(30, StaticSchedule([2, 3]))
    with pytest.raises(ConfigError):
        s.load_state_dict(state)
    assert s.state_dict()["step_in_epoch"] == 0 and s.epoch == 0  # unchanged


# ------------------------------------------------------------- construction


def test_fewer_samples_than_the_global_batch_is_a_config_error():
    with pytest.raises(ConfigError, match="global_batch_size"):
        HeterogeneousBatchSampler(9, StaticSchedule([5, 5]))
    assert len(HeterogeneousBatchSampler(10, StaticSchedule([5, 5]))) == 1


@pytest.mark.parametrize("seed", [-1, 2 ** 62, 2 ** 64, 1.5, "0", True, None])
def test_bad_seed_is_a_config_error(seed):
    with pytest.raises(ConfigError, match="seed"):
        HeterogeneousBatchSampler(10, StaticSchedule([5]), seed=seed)


def test_largest_seed_and_epochs_work():
    s = HeterogeneousBatchSampler(10, StaticSchedule([5]), seed=2 ** 62 - 1)
    s.set_epoch(1000)
    assert sorted(flat([list(s)])) == list(range(10))


@pytest.mark.parametrize("num_samples", [0, -5, 10.0, True, "10", None])
def test_bad_num_samples_is_a_config_error(num_samples):
    with pytest.raises(ConfigError, match="num_samples"):
        HeterogeneousBatchSampler(num_samples, StaticSchedule([1]))


def test_schedule_without_the_interface_is_a_config_error():
    with pytest.raises(ConfigError, match="schedule"):
        HeterogeneousBatchSampler(10, [5, 5])


# --------------------------------------------------------------- DataLoader


@pytest.mark.parametrize("num_workers", [0, 2])
def test_works_as_a_dataloader_batch_sampler(num_workers):
    N = 45
    changes = {0: [3, 5], 2: [6, 2], 4: [1, 7]}
    dataset = TensorDataset(torch.arange(N))
    per_rank = []
    for rank in range(2):
        schedule = ChangingSchedule(changes, rank)
        sampler = HeterogeneousBatchSampler(N, schedule, seed=4, drop_last=False)
        expected = list(sampler)   # the reference: iterating the sampler directly
        loader = DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers)
        got = []
        for (x,) in loader:  # workers prefetch: sizes still follow the step, not the fetch
            got.append(x.tolist())
            schedule.current_step += 1
        assert got == expected
        assert len(loader) == len(got) == 6
        per_rank.append(got)
    sizes = [[len(a), len(b)] for a, b in zip(*per_rank)]
    assert sizes == [[3, 5], [3, 5], [6, 2], [6, 2], [1, 7], apportion([1, 7], 5)]  # 5 left
    seen = [i for batches in per_rank for b in batches for i in b]
    assert sorted(seen) == list(range(N))


def test_static_schedule_interface():
    s = StaticSchedule([2, 3, 5], rank=2)
    assert (s.rank, s.num_ranks, s.global_batch_size, s.current_step) == (2, 3, 10, 0)
    assert s.issue(7, 10) == [2, 3, 5]
    got = s.issue(7, 4)
    assert sum(got) == 4 and all(b >= 1 for b in got)
