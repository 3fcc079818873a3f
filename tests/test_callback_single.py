"""Fast single-process tests of OmniLearnCallback in a Horovod world of one rank.

``hvd.init()`` in plain pytest (no mpirun) gives size 1; that is enough to check the
option validation, the training-loop protocol, timing with an explicit
``synchronize()``, checkpoints and hook removal. Multi-rank behaviour (weights other
than 1, size changes, errors on one rank) is the mpirun tier's job.
"""
import contextlib
import copy
import logging
import math
import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import horovod.torch as hvd
import omnihvd
from omnihvd.errors import ConfigError, InfeasibleError, OmniHvdError

pytestmark = [pytest.mark.single, pytest.mark.usefixtures("horovod")]

N, B = 64, 8


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + 0.1
    return TensorDataset(x, y)


def build(op=None, **options):
    """A fresh model, its Horovod optimizer and a callback with ``options``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    kwargs = {} if op is None else {"op": op}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), **kwargs)
    options.setdefault("global_batch_size", B)
    cb = omnihvd.OmniLearnCallback(model, opt, **options)
    return model, opt, cb


def fit(model, opt, cb, x, y):
    """One step's work inside the pair, then on_batch_end()."""
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    cb.on_batch_end()


def train(model, opt, cb, sampler, dataset, epochs, *, explicit_sync=False, mark=False,
          max_steps=None, first_epoch=0):
    """The README's loop; returns every batch's sample indices in order."""
    seen = []
    indexed = TensorDataset(torch.arange(len(dataset)), *dataset.tensors)
    loader = DataLoader(indexed, batch_sampler=sampler)
    cb.on_train_begin()
    for epoch in range(first_epoch, first_epoch + epochs):
        sampler.set_epoch(epoch)
        cb.on_epoch_begin(epoch)
        for idx, x, y in loader:
            cb.on_batch_begin()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if explicit_sync:  # Horovod's gradient-clipping pattern
                if mark:
                    cb.mark_compute_end()
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            cb.on_batch_end()
            seen.append(idx.tolist())
            if max_steps is not None and len(seen) == max_steps:
                return seen
        cb.on_epoch_end(epoch)
    return seen


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize("value", [0, -8, 8.0, True, "8", None])
def test_bad_global_batch_size(value):
    with pytest.raises(ConfigError, match="global_batch_size"):
        build(global_batch_size=value)


@pytest.mark.parametrize("sizes,needle", [
    ([4, 4], "one per rank"),        # wrong length: 2 entries, 1 rank
    ([], "one per rank"),
    ([7], "sum to 7"),               # wrong sum
    ([9], "sum to 9"),
    (8, "list of 1 ints"),           # not a list
    ([8.5], "list of 1 ints"),       # not whole
    (["8"], "list of 1 ints"),
])
def test_bad_initial_batch_sizes(sizes, needle):
    with pytest.raises(ConfigError, match=needle):
        build(initial_batch_sizes=sizes)


def test_bounds_that_exclude_every_split_are_infeasible():
    # With one rank the only split is [B]; bounds excluding it fail before the
    # initial sizes are checked (out-of-bounds initial sizes on several ranks are
    # covered under mpirun).
    with pytest.raises(InfeasibleError, match="max_batch_size"):
        build(max_batch_size=4)
    with pytest.raises(OmniHvdError, match="min_batch_size"):
        build(min_batch_size=9)
    with pytest.raises(InfeasibleError):
        build(initial_batch_sizes=[8], max_batch_size=[7])


@pytest.mark.parametrize("options,needle", [
    ({"policy": "pid"}, "policy"),
    ({"policy": None}, "policy"),
    ({"timing": "p90"}, "timing"),
    ({"adjust_every": 0}, "adjust_every"),
    ({"adjust_every": 2.0}, "adjust_every"),
    ({"adjust_every": True}, "adjust_every"),
    ({"settle_steps": -1}, "settle_steps"),
    ({"deadband": -0.1}, "deadband"),
    ({"gain": 0.0}, "gain"),
    ({"min_batch_size": 0}, "min_batch_size"),
    ({"max_batch_size": [8, 8]}, "max_batch_size"),
])
def test_bad_options(options, needle):
    with pytest.raises(ConfigError, match=needle):
        build(**options)


def test_plain_torch_optimizer_is_rejected():
    model = torch.nn.Linear(2, 1)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="hvd.DistributedOptimizer"):
        omnihvd.OmniLearnCallback(model, plain, global_batch_size=B)


def test_adasum_is_rejected():
    with pytest.raises(ConfigError, match="Adasum"):
        build(op=hvd.Adasum)


def test_model_must_be_a_module():
    _, opt, _ = build()
    with pytest.raises(ConfigError, match="model"):
        omnihvd.OmniLearnCallback(object(), opt, global_batch_size=B)


def test_errors_are_value_errors():
    assert issubclass(ConfigError, ValueError) and issubclass(InfeasibleError, OmniHvdError)
    with pytest.raises(ValueError):
        build(policy="nope")


# ------------------------------------------------------------- sizes, protocol


def test_batch_size_and_batch_sizes():
    _, _, cb = build()
    assert cb.batch_size == B and cb.batch_sizes == [B]
    assert (cb.rank, cb.num_ranks, cb.global_batch_size, cb.step) == (0, 1, B, 0)
    _, _, cb = build(initial_batch_sizes=[B], min_batch_size=2, max_batch_size=[B])
    assert cb.batch_sizes == [B]


@pytest.mark.parametrize("nonblocking", [True, False])
def test_training_loop_runs_and_history_records_decisions(data, nonblocking, caplog):
    model, opt, cb = build(adjust_every=2, nonblocking=nonblocking)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=1)
    with caplog.at_level(logging.INFO, logger="omnihvd"):
        batches = train(model, opt, cb, sampler, data, epochs=2)
    cb.on_train_end()
    steps = 2 * N // B
    assert cb.step == steps and len(batches) == steps
    assert all(len(b) == B for b in batches)
    for epoch in range(2):
        chunk = batches[epoch * N // B:(epoch + 1) * N // B]
        assert sorted(i for b in chunk for i in b) == list(range(N))
    # adjustments are posted every 2 steps (non-blocking: in the step's on_batch_begin,
    # with the window of the steps before it) and decided at the end of that same step,
    # so none is in flight when the loop ends.
    want = list(range(2, steps + 1, 2))
    assert [h["step"] for h in cb.history] == want
    if nonblocking:   # the first window holds step 0 alone, a settle step
        assert cb.history[0]["skipped"] == "no valid timing on rank(s) [0]"
    for h in cb.history[nonblocking:]:
        assert h["sizes"] == [B] and h["new_sizes"] == [B]
        assert h["changed"] is False and h["effective_step"] is None
        assert "skipped" not in h, h
        assert len(h["times"]) == 1 and math.isfinite(h["times"][0]) and h["times"][0] > 0
        assert h["samples"][0] >= 1
        assert h["decision_s"] >= 0
    assert cb.adjustments == 0
    assert cb.batch_sizes == [B]
    assert any("global batch %d" % B in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("every, said", [(5, "adjust every 5 steps"),
                                          (2 ** 62, "adjust never (adjust_every=%d)" % 2 ** 62)])
def test_start_line_says_how_often_sizes_change(data, caplog, every, said):
    model, opt, cb = build(adjust_every=every)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb)
    with caplog.at_level(logging.INFO, logger="omnihvd"):
        train(model, opt, cb, sampler, data, epochs=1)
    cb.on_train_end()
    assert [r.getMessage().endswith(said) for r in caplog.records if "global batch" in
            r.getMessage()] == [True]


def test_overhead_leaves_out_the_waits_for_the_other_ranks(data):
    # A rank that reaches on_train_begin 0.3 s before its peers, and gathers that take
    # 20 ms more, read all of it as omnihvd's own cost (150 ms "per step")
    for nonblocking in (True, False):
        model, opt, cb = build(adjust_every=2, nonblocking=nonblocking)
        comm = cb._comm
        slow_object, slow_gather, slow_pending = (comm.allgather_object, comm.allgather,
                                                  comm.iallgather)

        def late_object(obj, **kw):
            time.sleep(0.3)
            return slow_object(obj, **kw)

        def late_pending(values):
            pending = slow_pending(values)
            waiting = pending.wait
            pending.wait = lambda: (time.sleep(0.02), waiting())[1]
            return pending

        comm.allgather_object, comm.iallgather = late_object, late_pending
        if not nonblocking:   # (a world of one's iallgather calls its allgather)
            comm.allgather = lambda values: (time.sleep(0.02), slow_gather(values))[1]
        train(model, opt, cb, omnihvd.HeterogeneousBatchSampler(N, cb), data, epochs=1)
        cb.on_train_end()
        assert len(cb.history) >= 2
        assert cb.overhead_seconds < 0.005 * cb.step, (nonblocking, cb.overhead_seconds)


def test_the_gather_is_posted_before_its_steps_work_with_the_steps_before_it(data):
    # Posted after the step's work (at opt.step()), the gather made every rank wait there
    # for the slowest rank's work of that step, which the allreduce does not; so it is
    # posted in on_batch_begin, before the forward pass, with the window of the steps
    # before it, and completed (and decided on) in the same step's on_batch_end.
    model, opt, cb = build(adjust_every=4, settle_steps=1)
    events = []
    model.register_forward_pre_hook(lambda module, args: events.append(("forward", cb.step)))
    comm, posted = cb._comm, []
    post = comm.iallgather

    def recorded(values):
        events.append(("post", cb.step))
        posted.append(list(values))
        return post(values)

    comm.iallgather = recorded
    train(model, opt, cb, omnihvd.HeterogeneousBatchSampler(N, cb), data, epochs=1)
    cb.on_train_end()
    steps = [step for what, step in events if what == "post"]
    assert steps == [3, 7]
    for step in steps:
        assert events.index(("post", step)) + 1 == events.index(("forward", step))
    # steps 0-2 (the first settles) and 3-6: each gather's window ends before its step
    assert [row[1] for row in posted] == [2, 4]
    assert [record["step"] for record in cb.history] == [4, 8]


def test_a_gathering_step_begun_again_keeps_its_gather_and_window():
    # a NaN guard's `continue` after on_batch_begin: the step runs again. Its first
    # on_batch_begin posted the gather on every rank; posting again would gather twice
    # on a rank that alone skipped (a mismatch) and throw the window away.
    model, opt, cb = build(adjust_every=5, settle_steps=1)
    comm, posts = cb._comm, []
    post = comm.iallgather
    comm.iallgather = lambda values: (posts.append(cb.step), post(values))[1]
    x = torch.randn(B, 4, dtype=torch.float64)
    cb.on_train_begin()
    again = True
    while cb.step < 10:
        cb.on_batch_begin()
        if cb.step == 4 and again:
            again = False
            continue
        fit(model, opt, cb, x, x[:, :1])
    cb.on_train_end()
    assert posts == [4, 9]
    assert [h["samples"] for h in cb.history] == [[3], [5]]
    assert all("skipped" not in h for h in cb.history), cb.history


def test_a_loop_without_the_sampler_or_a_check_is_warned_once(data, caplog):
    # a DataLoader(batch_size=B/n) with a DistributedSampler keeps equal sizes while the
    # callback weights the gradient for its own: warned, since nothing can check it
    x, y = data.tensors
    for checked in (False, True):
        model, opt, cb = build(adjust_every=2)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="omnihvd"):
            cb.on_train_begin()
            for step in range(4):
                batch = (x[:cb.batch_size], y[:cb.batch_size])
                cb.on_batch_begin(batch=batch if checked else None)
                fit(model, opt, cb, *batch)
            cb.on_train_end()
        said = [r for r in caplog.records if "no HeterogeneousBatchSampler" in r.getMessage()]
        assert len(said) == (0 if checked else 1), (checked, said)


@pytest.mark.parametrize("replaced_at", [3, 6])
def test_a_batch_fetched_in_place_of_the_steps_own_is_refused(data, replaced_at):
    # A NaN guard inside the step (xb = next(it)) after the step's own batch was checked
    # at on_batch_begin: the replacement is not the next step's, fetched ahead -- the
    # loop fetches again (step 3), or the loader ends (step 6 takes the epoch's last,
    # partial batch), before the next step begins
    x, y = data.tensors
    model, opt, cb = build(adjust_every=4)
    sampler = omnihvd.HeterogeneousBatchSampler(60, cb, drop_last=False)   # 7 x 8, then 4
    loader = DataLoader(TensorDataset(x[:60], y[:60]), batch_sampler=sampler)
    cb.on_train_begin()
    batches = iter(cb.wrap(loader))
    with pytest.raises(ConfigError, match="trained in place of the step's own .* or skipped"):
        for i, (xb, yb) in enumerate(batches):
            cb.on_batch_begin()
            if i == replaced_at:
                xb, yb = next(batches)
            fit(model, opt, cb, xb, yb)
    cb.on_train_end()


def test_batches_checked_at_on_batch_end_are_not_warned_about(data, caplog):
    # no sampler, each batch fetched just after on_batch_begin: checked at on_batch_end
    x, y = data.tensors
    model, opt, cb = build(adjust_every=4)
    batches = iter(cb.wrap(DataLoader(TensorDataset(x, y), batch_size=B)))
    with caplog.at_level(logging.WARNING, logger="omnihvd"):
        cb.on_train_begin()
        for step in range(3):
            cb.on_batch_begin(batch=step)   # a Keras-style index: the wrapped batch counts
            fit(model, opt, cb, *next(batches))
        cb.on_train_end()
    assert not [r for r in caplog.records if "no HeterogeneousBatchSampler" in r.getMessage()]


def test_first_window_drops_its_settle_steps(data):
    model, opt, cb = build(adjust_every=4, settle_steps=2, nonblocking=False)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb)
    train(model, opt, cb, sampler, data, epochs=1)
    assert len(cb.history) == 2
    assert cb.history[0]["samples"] == [2]  # steps 1-2 of the first 4 settle
    assert cb.history[1]["samples"][0] >= 2


@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
def test_single_rank_trains_exactly_like_plain_sgd(data, op):
    # The gradient weight for one rank is n*b/B = b/B = 1 under both ops: parameters
    # follow plain SGD on the same batches exactly.
    model, opt, cb = build(op=op, adjust_every=3)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=2, drop_last=False)
    batches = train(model, opt, cb, sampler, data, epochs=2)
    cb.on_train_end()
    x, y = data.tensors
    for idx in batches:
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x[idx]), y[idx]).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q), (p, q)


def test_gradient_weight_is_one_inside_a_step(data):
    model, opt, cb = build()
    cb.on_train_begin()
    x, y = data.tensors[0][:B], data.tensors[1][:B]
    reference = copy.deepcopy(model)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    cb.on_batch_begin()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    opt.step()
    cb.on_batch_end()
    cb.on_train_end()


# ------------------------------------------------------- explicit synchronize


@pytest.mark.parametrize("cpus, warned", [(2, 1), (1, 0)])
def test_a_quota_over_more_cpus_than_it_fills_warns_once(data, caplog, monkeypatch, cpus,
                                                         warned):
    # 0.3 cores over 2 CPUs: MPI's polling thread spends the quota beside the
    # training thread (docs/cpu-quotas.rst); on 1 CPU the two share it
    import omnihvd.boundary

    monkeypatch.setattr(omnihvd.boundary, "cpu_quota_cores", lambda: 0.3)
    monkeypatch.setattr(omnihvd.boundary, "usable_cpus", lambda: cpus)
    model, opt, cb = build(adjust_every=2)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb)
    with caplog.at_level(logging.WARNING, logger="omnihvd"):
        train(model, opt, cb, sampler, data, epochs=2)   # a quota re-read at each adjustment
    found = [r.getMessage() for r in caplog.records if "CPU quota" in r.getMessage()]
    assert len(found) == warned, found
    assert not found or ("rank 0: a CPU quota of 0.30 cores over 2 CPUs" in found[0]
                         and "--cpuset-cpus" in found[0])
    assert cb._timer.cpu_cores == 0.3


@pytest.mark.parametrize("mark", [False, True])
def test_explicit_synchronize_after_the_backward_pass_is_no_work(data, caplog, mark):
    # Horovod's clipping loop (synchronize, clip, skip_synchronize): the timer pauses
    # when the backward pass ends, so the wait inside synchronize() is left out and
    # every step's time is kept, with or without mark_compute_end()
    model, opt, cb = build(adjust_every=2, nonblocking=False)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb)
    with caplog.at_level(logging.WARNING, logger="omnihvd"):
        train(model, opt, cb, sampler, data, epochs=1, explicit_sync=True, mark=mark)
    assert not [r for r in caplog.records if "mark_compute_end" in r.getMessage()]
    assert len(cb.history) == 4 and cb.step == N // B
    assert cb.history[0]["samples"] == [1]  # 2 steps, the first one settles
    assert all(h["samples"] == [2] and "skipped" not in h and h["times"][0] > 0
               for h in cb.history[1:]), cb.history


def test_explicit_synchronize_unseen_drops_samples_and_warns_once(data, caplog, monkeypatch):
    # a torch whose autograd engine has no callback queue: the end of the backward
    # pass is not seen, so a step whose synchronize() ran before step() holds a wait
    monkeypatch.setattr("omnihvd.segments.after_backward", lambda callback: False)
    model, opt, cb = build(adjust_every=2, nonblocking=False)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb)
    with caplog.at_level(logging.WARNING, logger="omnihvd"):
        train(model, opt, cb, sampler, data, epochs=1, explicit_sync=True, mark=False)
    warnings = [r for r in caplog.records if "mark_compute_end" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert len(cb.history) == 4
    for h in cb.history:
        assert h["samples"] == [0] and math.isnan(h["times"][0])
        assert "skipped" in h and h["changed"] is False and h["new_sizes"] == [B]
    assert cb.step == N // B  # training itself went on normally



@pytest.mark.parametrize("pattern", ["mark_before", "mark_after", "no_mark"])
@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("unseen", [False, True])
def test_gradscaler_steps_are_timed_to_the_synchronize_or_dropped(data, caplog, monkeypatch,
                                                                  pattern, overflow, unseen):
    """Horovod's GradScaler loop (synchronize, unscale_, skip_synchronize, scaler.step):
    marked before synchronize() every step's time is kept, also when the scaler skips
    step() (an overflow leaves Horovod's flag set: it must not read as the next step's
    synchronize); marked after it, or unmarked, every time includes the wait and is
    dropped with one warning, also when no step() ran to see the flag -- where the
    end of the backward pass is unseen (``unseen``); where it is seen, the wait in
    synchronize() is in no step's time whatever the mark."""
    if unseen:
        monkeypatch.setattr("omnihvd.segments.after_backward", lambda callback: False)
    model, opt, cb = build(adjust_every=2, nonblocking=False)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb)
    scaler = torch.amp.GradScaler("cpu", init_scale=math.inf if overflow else 2.0 ** 10)
    w0 = model.weight.detach().clone()
    cb.on_train_begin()
    with caplog.at_level(logging.WARNING, logger="omnihvd"):
        for x, y in DataLoader(data, batch_sampler=sampler):
            cb.on_batch_begin()
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if pattern == "mark_before":
                cb.mark_compute_end()
            opt.synchronize()
            if pattern == "mark_after":
                cb.mark_compute_end()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            cb.on_batch_end()
    cb.on_train_end()
    assert torch.equal(model.weight, w0) == overflow   # every step skipped, or none
    warnings = [r for r in caplog.records if "mark_compute_end" in r.getMessage()]
    assert len(cb.history) == 4 and cb.step == N // B
    if pattern == "mark_before" or not unseen:
        assert not warnings
        assert all("skipped" not in h and h["samples"] == [2] for h in cb.history[1:])
    else:
        assert len(warnings) == 1 and "just before opt.synchronize()" in warnings[0].getMessage()
        assert all(h["samples"] == [0] and "skipped" in h for h in cb.history), cb.history


# ------------------------------------------------------------------ checkpoints


def test_state_dict_round_trip(data):
    model, opt, cb = build(adjust_every=2)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=3)
    train(model, opt, cb, sampler, data, epochs=1, max_steps=5)
    state = cb.state_dict()
    assert state["step"] == 5 and state["num_ranks"] == 1 and state["batch_sizes"] == [B]
    assert state["global_batch_size"] == B and state["controller"]["sizes"]
    cb.on_train_end()

    _, _, fresh = build(adjust_every=2)
    fresh.load_state_dict(copy.deepcopy(state))
    assert fresh.step == 5 and fresh.epoch == 0 and fresh.batch_sizes == [B]
    assert fresh.state_dict() == state
    assert fresh.controller.model() is not None  # the measured history came along


def test_callback_and_sampler_resume_mid_epoch_with_the_remaining_samples(data):
    model, opt, cb = build(adjust_every=2)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=4)
    train(model, opt, cb, sampler, data, epochs=1)            # epoch 0
    head = train(model, opt, cb, sampler, data, epochs=1, first_epoch=1, max_steps=3)
    cb_state, sampler_state = cb.state_dict(), sampler.state_dict()
    assert sampler_state["step_in_epoch"] == 3
    cb.on_train_end()

    model2, opt2, cb2 = build(adjust_every=2)
    cb2.load_state_dict(cb_state)
    sampler2 = omnihvd.HeterogeneousBatchSampler(N, cb2, seed=4)
    sampler2.load_state_dict(sampler_state)
    tail = train(model2, opt2, cb2, sampler2, data, epochs=1, first_epoch=1)
    cb2.on_train_end()
    assert len(tail) == N // B - 3 and cb2.step == 2 * N // B
    got = [i for b in head + tail for i in b]
    assert sorted(got) == list(range(N))


def test_checkpoint_of_another_rank_count_is_re_split():
    _, _, cb = build()
    state = {"version": 1, "global_batch_size": B, "num_ranks": 3, "step": 40, "epoch": 2,
             "batch_sizes": [1, 2, 5], "changes": [(45, [2, 2, 4])],
             "controller": {"policy": "affine", "sizes": [[1, 2, 5]], "times": [[1.0, 1.0, 1.0]]}}
    cb.load_state_dict(state)
    assert cb.step == 40 and cb.epoch == 2
    assert cb.batch_sizes == [B] and cb.batch_sizes_at(45) == [B]
    assert cb.controller.model() is None  # another world's timings are dropped


def test_checkpoint_whose_split_does_not_sum_to_its_batch_is_rejected():
    _, _, cb = build()
    with pytest.raises(ConfigError, match="do not sum"):
        cb.load_state_dict({"global_batch_size": B, "num_ranks": 1, "step": 3, "batch_sizes": [7]})
    assert cb.step == 0


def test_checkpoint_with_another_global_batch_is_a_config_error():
    _, _, cb = build()
    with pytest.raises(ConfigError, match="global_batch_size"):
        cb.load_state_dict({"global_batch_size": 2 * B, "num_ranks": 1, "step": 0,
                            "batch_sizes": [2 * B]})
    assert cb.step == 0


@pytest.mark.parametrize("state", [
    {},
    {"global_batch_size": B, "num_ranks": 1, "step": 0},
    {"global_batch_size": B, "num_ranks": 1, "step": "x", "batch_sizes": [B]},
    {"global_batch_size": B, "num_ranks": 1, "step": 0, "batch_sizes": None},
])
def test_malformed_checkpoint_is_a_config_error(state):
    _, _, cb = build()
    with pytest.raises(ConfigError, match="state_dict"):
        cb.load_state_dict(state)


def test_load_after_training_started_is_a_config_error():
    _, _, cb = build()
    state = cb.state_dict()
    cb.on_train_begin()
    with pytest.raises(ConfigError, match="before on_train_begin"):
        cb.load_state_dict(state)
    cb.on_train_end()


# ---------------------------------------------------------------------- hooks


def hook_counts(model, opt):
    # torch keeps tensor hooks in ``_backward_hooks`` and optimizer hooks in
    # ``_optimizer_step_pre_hooks`` and ``_post_hooks``; read them to see what is there.
    return ([len(p._backward_hooks or {}) for p in model.parameters()],
            len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks))


def test_on_train_end_removes_every_hook(data):
    model, opt, cb = build(adjust_every=2)
    assert hook_counts(model, opt) == ([0, 0], 0)
    cb.on_train_begin()
    cb.on_train_begin()  # idempotent: no second set of hooks
    assert hook_counts(model, opt) == ([1, 1], 2)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb)
    train(model, opt, cb, sampler, data, epochs=1, max_steps=3)  # leaves a gather in flight
    cb.on_train_end()
    assert hook_counts(model, opt) == ([0, 0], 0)
    cb.on_train_end()  # harmless twice
    # restarting registers them again, once
    cb.on_batch_begin()
    assert hook_counts(model, opt) == ([1, 1], 2)
    cb.close()
    assert hook_counts(model, opt) == ([0, 0], 0)


def test_with_cb_ends_the_training_on_the_way_out(data):
    model, opt, cb = build(adjust_every=2, abort_on_exception=True)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb)
    with cb as same:
        assert same is cb
        cb.on_train_begin()
        train(model, opt, cb, sampler, data, epochs=1, max_steps=3)   # a gather in flight
        assert hook_counts(model, opt) == ([1, 1], 2)
    assert hook_counts(model, opt) == ([0, 0], 0) and cb._pending is None
    assert cb._abort_handle is None
    # an exception leaves the block: it propagates, and the abort hook stays for it
    cb.on_train_begin()
    with pytest.raises(KeyError):
        with cb:
            raise KeyError("boom")
    assert hook_counts(model, opt) == ([0, 0], 0) and cb._abort_handle is not None
    cb.on_train_begin()
    cb.on_train_end()
    assert cb._abort_handle is None


def test_unfreezing_in_a_one_rank_run_is_no_error(data):
    # On one rank Horovod hooks (and allreduces) nothing: its empty registry is no sign
    # of a parameter frozen when the optimizer was created (a false ConfigError once)
    model, opt, cb = build(adjust_every=2)
    assert opt._requires_update == set()
    model.bias.requires_grad_(False)
    cb.on_train_begin()
    model.bias.requires_grad_(True)
    before = model.bias.detach().clone()
    train(model, opt, cb, omnihvd.HeterogeneousBatchSampler(N, cb), data, epochs=1,
          max_steps=3)
    cb.on_train_end()
    assert not torch.equal(before, model.bias)   # it trained


def test_step_after_train_end_is_not_timed(data):
    model, opt, cb = build(adjust_every=1, nonblocking=False)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb)
    train(model, opt, cb, sampler, data, epochs=1, max_steps=2)
    cb.on_train_end()
    before = len(cb.history)
    x, y = data.tensors
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x[:B]), y[:B]).backward()
    opt.step()  # no hook left to call into the callback
    assert len(cb.history) == before and cb.step == 2


# ------------------------------------------------------- hardening (issue 11)


def test_a_second_callback_on_one_model_waits_for_the_first_to_end():
    # Both callbacks' hooks would weight every gradient twice.
    model, opt, first = build()
    first.on_train_begin()
    second = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B)
    with pytest.raises(ConfigError, match="on_train_end"):
        second.on_train_begin()
    first.on_train_end()
    second.on_train_begin()
    second.on_train_end()
    first.on_train_begin()   # a callback may start again once the other has ended
    first.on_train_end()


def one_update(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def started(data):
    """A fresh model, optimizer and callback, started, and an iterator of its batches."""
    model, opt, cb = build()
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=0)
    batches = iter(DataLoader(data, batch_sampler=sampler))
    cb.on_train_begin()
    return model, opt, cb, batches


@pytest.mark.parametrize("where", ["before_the_first", "between_two"])
def test_a_backward_pass_outside_the_hook_pair_is_refused(data, where):
    # Its gradients would keep another step's weights (Horovod allreduces them at the
    # next step() or synchronize()). Not refused at opt.step(): hvd.broadcast_optimizer_state
    # calls the base optimizer's step() itself, with no backward pass.
    model, opt, cb, batches = started(data)
    if where == "between_two":
        cb.on_batch_begin()
        one_update(model, opt, *next(batches))
        cb.on_batch_end()
    hvd.broadcast_optimizer_state(opt, root_rank=0)      # its own step() is no batch
    with pytest.raises(ConfigError, match="outside a cb.on_batch_begin"):
        one_update(model, opt, *next(batches))           # never began
    cb.on_train_end()
    one_update(model, opt, *next(batches))   # the hooks are off: plain Horovod again


def test_an_on_batch_end_without_its_begin_is_refused(data):
    model, opt, cb, batches = started(data)
    cb.on_batch_begin()
    one_update(model, opt, *next(batches))
    cb.on_batch_end()
    with pytest.raises(ConfigError, match="on_batch_begin"):
        cb.on_batch_end()
    cb.on_train_end()


def test_several_updates_per_batch_and_on_batch_end_before_step_are_kept(data):
    model, opt, cb, batches = started(data)
    x, y = next(batches)
    cb.on_batch_begin()
    for _ in range(3):                                   # e.g. PPO's epochs over one batch
        one_update(model, opt, x, y)
    cb.on_batch_end()
    x, y = next(batches)
    cb.on_batch_begin()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    cb.on_batch_end()
    opt.step()                                           # after on_batch_end
    assert cb.step == 2
    cb.on_train_end()


def test_training_on_a_loader_the_schedule_does_not_follow_is_refused(data):
    # A validation sampler created first drives the schedule; the training sampler,
    # read only, hands out sizes that a prefetching loader makes stale.
    model, opt, cb = build()
    val_sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=1)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=0)
    assert val_sampler.train and not sampler.train
    cb.on_train_begin()
    with pytest.raises(ConfigError, match="train=False"):
        for x, y in DataLoader(data, batch_sampler=sampler):
            cb.on_batch_begin()
            one_update(model, opt, x, y)
            cb.on_batch_end()
    assert cb.step == 1   # at the second step: the first may fetch after on_batch_begin
    cb.on_train_end()


def test_a_pass_left_early_leaves_no_stale_sizes_for_the_next_epoch():
    # Breaking on the epoch's short last batch ("skip the partial batch") left its
    # sizes handed out but never run; the next epoch's step of the same index then
    # took them: 2 samples instead of B.
    n = 4 * B + 2
    dataset = TensorDataset(torch.arange(n), torch.randn(n, 4, dtype=torch.float64),
                            torch.randn(n, 1, dtype=torch.float64))
    model, opt, cb = build()
    sampler = omnihvd.HeterogeneousBatchSampler(n, cb, seed=0, drop_last=False)
    loader = DataLoader(dataset, batch_sampler=sampler)
    cb.on_train_begin()
    seen = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for idx, x, y in loader:
            if epoch == 0 and len(idx) < cb.batch_size:
                break
            cb.on_batch_begin(batch=(idx, x, y))
            one_update(model, opt, x, y)
            cb.on_batch_end()
            seen.append((epoch, len(idx)))
    cb.on_train_end()
    assert [size for e, size in seen if e == 0] == [B] * 4
    assert [size for e, size in seen if e == 1] == [B] * 4 + [2]


def test_a_checkpoint_between_step_and_on_batch_end_is_refused(data):
    # The model holds the step's update but the step is not counted: a resume from
    # that state would run the step again.
    model, opt, cb, batches = started(data)
    cb.on_batch_begin()
    one_update(model, opt, *next(batches))
    with pytest.raises(ConfigError, match="after cb.on_batch_end"):
        cb.state_dict()
    cb.on_batch_end()
    assert cb.state_dict()["step"] == 1
    cb.on_batch_begin()                      # on_batch_end before opt.step(): counted
    x, y = next(batches)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    cb.on_batch_end()
    opt.step()
    assert cb.state_dict()["step"] == 2
    cb.on_train_end()


def test_wrap_times_the_training_loader_and_leaves_an_evaluation_loader_as_it_is(data):
    # An evaluation loader's next() between training steps is no step's work.
    model, opt, cb = build()
    train_loader = DataLoader(data, batch_sampler=omnihvd.HeterogeneousBatchSampler(N, cb))
    val_loader = DataLoader(data, batch_sampler=omnihvd.HeterogeneousBatchSampler(N, cb))
    assert cb.wrap(val_loader) is val_loader
    assert cb.wrap(train_loader) is not train_loader
    assert len(list(cb.wrap(train_loader))) == len(train_loader)


def test_wrap_refuses_a_loader_that_yields_batches_out_of_order(data):
    # in_order=False: a step trained another step's batch with this step's weights
    # (0.091 off a single-process replay over a run), silently without cb.wrap
    model, opt, cb = build()
    loader = DataLoader(data, batch_sampler=omnihvd.HeterogeneousBatchSampler(N, cb),
                        num_workers=2, in_order=False)
    with pytest.raises(ConfigError, match="in_order=False"):
        cb.wrap(loader)


def test_a_loop_that_fetches_after_on_batch_begin_is_kept(data):
    model, opt, cb, batches = started(data)
    for _ in range(4):
        cb.on_batch_begin()
        one_update(model, opt, *next(batches))
        cb.on_batch_end()
    cb.on_train_end()


def build_with(model, op=None, **options):
    kwargs = {} if op is None else {"op": op}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), **kwargs)
    options.setdefault("global_batch_size", B)
    return opt, omnihvd.OmniLearnCallback(model, opt, **options)


@pytest.mark.parametrize("sync", [hvd.SyncBatchNorm, torch.nn.SyncBatchNorm])
def test_synchronised_batchnorm_is_refused_with_the_fix(sync):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), sync(3), torch.nn.Linear(3, 1))
    with pytest.raises(ConfigError) as info:
        build_with(model)
    message = str(info.value)
    assert "synchronised batch normalisation (1: SyncBatchNorm)" in message, message
    assert "torch.nn.BatchNorm1d" in message and "GroupNorm" in message, message


def test_batchnorm_raises_the_minimum_batch_to_two(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    with caplog.at_level(logging.INFO, logger="omnihvd"):
        _, cb = build_with(model)
    assert cb.controller.lo.tolist() == [2]
    assert any("BatchNorm" in r.getMessage() and "min_batch_size raised" in r.getMessage()
               for r in caplog.records)
    _, cb = build_with(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)),
                       min_batch_size=3)
    assert cb.controller.lo.tolist() == [3]  # a larger minimum is kept
    _, cb = build_with(torch.nn.Linear(4, 3))
    assert cb.controller.lo.tolist() == [1]  # no BatchNorm: unchanged
    with pytest.raises(InfeasibleError, match="BatchNorm"):
        build_with(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)),
                   global_batch_size=1)


def test_batchnorm_never_gets_a_one_sample_last_step(data):
    # 65 samples, B = 8: one sample is left for the last step; with drop_last=False
    # it would be a batch of 1, which BatchNorm1d refuses in training. The floor of 2
    # makes the sampler drop it, and training runs through.
    x, y = data.tensors
    dataset = TensorDataset(torch.cat([x, x[:1]]), torch.cat([y, y[:1]]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                                torch.nn.Linear(3, 1)).double()
    opt, cb = build_with(model)
    sampler = omnihvd.HeterogeneousBatchSampler(65, cb, drop_last=False)
    assert len(sampler) == 8
    batches = train(model, opt, cb, sampler, dataset, epochs=1)
    cb.on_train_end()
    assert [len(b) for b in batches] == [8] * 8
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        model(x[:1])  # what the floor protects against


def test_partial_step_respects_min_batch_size(data):
    _, _, cb = build(min_batch_size=4)
    assert len(omnihvd.HeterogeneousBatchSampler(N + 3, cb, drop_last=False)) == N // B
    kept = omnihvd.HeterogeneousBatchSampler(N + 5, cb, drop_last=False, train=False)
    assert len(kept) == N // B + 1 and [len(b) for b in kept][-1] == 5


@pytest.mark.parametrize("options,needle", [
    ({"loss_reduction": "none"}, "loss_reduction"),
    ({"loss_reduction": None}, "loss_reduction"),
    ({"size_multiple": 0}, "size_multiple"),
    ({"size_multiple": 2.5}, "size_multiple"),
    ({"history_size": 0}, "history_size"),
    ({"history_size": None}, "history_size"),
])
def test_bad_hardening_options(options, needle):
    with pytest.raises(ConfigError, match=needle):
        build(**options)
    # one rank holds B whatever the multiple: rank 0 takes the remainder
    assert build(size_multiple=16)[2].batch_sizes == [B]


@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum])
def test_sum_reduced_loss_trains_exactly_like_plain_sgd(data, op):
    model, opt, cb = build(op=op, loss_reduction="sum", adjust_every=3)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=2)
    x, y = data.tensors
    cb.on_train_begin()
    for idx in sampler:
        cb.on_batch_begin(batch=x[idx])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx], reduction="sum").backward()
        opt.step()
        cb.on_batch_end()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x[idx]), y[idx], reduction="sum").backward()
        ref_opt.step()
    cb.on_train_end()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q), (p, q)


def test_global_count_sums_the_count_and_checks_it():
    _, _, cb = build(loss_reduction="sum")
    cb.on_train_begin()
    cb.on_batch_begin()
    assert cb.global_count(torch.tensor(5)) == 5.0 and cb.global_count(2.5) == 2.5
    for bad in (-1, float("nan"), float("inf"), "x", torch.ones(2)):
        with pytest.raises(ConfigError, match="rank 0 passed count"):
            cb.global_count(bad)
    with pytest.raises(ConfigError, match="0 on every rank"):
        cb.global_count(0)
    cb.on_train_end()
    _, _, mean = build()
    with pytest.raises(ConfigError, match="loss_reduction='sum'"):
        mean.global_count(3)


def test_batch_of_another_size_is_a_clear_error(data):
    x, y = data.tensors
    _, _, cb = build()
    cb.on_batch_begin(batch=(x[:B], y[:B]))   # the right size
    cb.on_batch_end()
    cb.on_batch_begin(batch=3)                # a Keras-style batch index: ignored
    cb.on_batch_end()
    cb.on_batch_begin(batch={"x": x[:B]})
    cb.on_batch_end()
    with pytest.raises(ConfigError, match=r"rank 0 got a batch of 5 samples at step 3.*is 8.*"
                                          r"batch_sampler="):
        cb.on_batch_begin(batch=[x[:5], y[:5]])
    cb.on_train_end()



@pytest.mark.parametrize("shape", ["every_batch", "skip_one", "fetch_after_begin",
                                   "fetch_after_begin_skip_one", "time_major", "unchecked"])
def test_wrapped_batches_are_checked_against_their_step(data, shape):
    # 60 samples, B=8, drop_last=False: 7 steps of 8 and a last one of 4. A loop
    # that skips a batch (a NaN guard's `continue`) runs that 4-sample batch as a
    # step of 8, whose weights assume 8: a ConfigError, before or after the step.
    x, y = data.tensors
    dataset = TensorDataset(x[:60], y[:60])
    model, opt, cb = build()
    sampler = omnihvd.HeterogeneousBatchSampler(60, cb, drop_last=False)
    loader = DataLoader(dataset, batch_sampler=sampler)
    if shape == "time_major":
        loader = [(xb.T, yb) for xb, yb in loader]      # (features, samples): 4 x b
    wrapped = cb.wrap(loader, check=(shape != "unchecked"))
    cb.on_train_begin()
    ran = 0
    with pytest.raises(ConfigError, match="got a batch of") if shape in (
            "skip_one", "fetch_after_begin_skip_one", "time_major") else contextlib.nullcontext():
        if shape.startswith("fetch_after_begin"):
            batches = iter(wrapped)
            for i in range(sampler.steps_per_epoch):
                cb.on_batch_begin()
                xb, yb = next(batches)
                if shape.endswith("skip_one") and i == 2:
                    xb, yb = next(batches)   # the third batch skipped
                one_update(model, opt, xb, yb)
                cb.on_batch_end()
                ran += 1
        else:
            for i, (xb, yb) in enumerate(wrapped):
                if shape == "skip_one" and i == 2:
                    continue
                cb.on_batch_begin()
                one_update(model, opt, xb.T if shape == "time_major" else xb, yb)
                cb.on_batch_end()
                ran += 1
    expected = {"every_batch": 8, "unchecked": 8, "skip_one": 6, "time_major": 0,
                "fetch_after_begin": 8, "fetch_after_begin_skip_one": 6}[shape]
    assert ran == expected and cb.step == expected
    cb.on_train_end()

def test_evaluation_loader_does_not_disturb_the_training_schedule(data):
    # Before: the validation sampler issued steps of its own, and its partial last
    # step (5 samples) became the size of a training step.
    x, y = data.tensors
    model, opt, cb = build(adjust_every=2)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=1)
    val = omnihvd.HeterogeneousBatchSampler(13, cb, drop_last=False)
    assert sampler.train and not val.train
    seen = []
    cb.on_train_begin()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for idx in sampler:
            cb.on_batch_begin(batch=x[idx])  # checks every training batch's size
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
            opt.step()
            cb.on_batch_end()
            seen.append(len(idx))
        with torch.no_grad():
            val_batches = [model(x[idx]) for idx in val]
        assert [len(v) for v in val_batches] == [8, 5]
    cb.on_train_end()
    assert seen == [B] * (2 * N // B) and cb.batch_sizes == [B]
    with pytest.raises(ConfigError, match="train=False"):
        omnihvd.HeterogeneousBatchSampler(N, cb, train=True)


class NoFlagSGD(torch.optim.SGD):
    """A one-rank stand-in for a Horovod optimizer that lacks the private
    ``_synchronized`` flag (another Horovod version): op, synchronize, step."""

    op = hvd.Average
    backward_passes_per_step = 1

    def synchronize(self):
        pass


def test_optimizer_without_synchronized_flag_warns_once_and_trains(data, caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    opt = NoFlagSGD(model.parameters(), lr=0.05)
    assert not hasattr(opt, "_synchronized")
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=2,
                                   nonblocking=False)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb)
    with caplog.at_level(logging.WARNING, logger="omnihvd"):
        train(model, opt, cb, sampler, data, epochs=1)
        cb.on_train_end()
        cb.on_train_begin()
    warnings = [r for r in caplog.records if "_synchronized" in r.getMessage()]
    assert len(warnings) == 1 and "mark_compute_end" in warnings[0].getMessage()
    assert all("skipped" not in h for h in cb.history)  # the times are kept
    cb.on_train_end()


def test_history_keeps_the_last_decisions_and_counts_all(data):
    model, opt, cb = build(adjust_every=1, nonblocking=False, history_size=3)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb)
    train(model, opt, cb, sampler, data, epochs=1)
    cb.on_train_end()
    assert [h["step"] for h in cb.history] == [N // B - 2, N // B - 1, N // B]


# ------------------------------------------------------ what the local time holds


class SlowUpdateSGD(torch.optim.SGD):
    """SGD whose update costs ``UPDATE_S`` of this rank's own work."""
    UPDATE_S = 0.05

    def step(self, closure=None):
        import time
        time.sleep(self.UPDATE_S)
        return super().step(closure)


def test_the_optimizer_update_counts_as_local_work_and_the_wait_does_not(data, monkeypatch):
    # The base optimizer's update runs after Horovod's synchronize(): it is this rank's
    # own per-step cost (more on a slow or shared CPU), so it is charged to the step
    # that follows; synchronize() itself (waiting for the peers) is not.
    import time

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    opt = hvd.DistributedOptimizer(SlowUpdateSGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=2,
                                   settle_steps=0, nonblocking=False)
    synchronize = opt.synchronize

    def waiting_synchronize():
        time.sleep(0.5)   # as if the peers were late
        return synchronize()

    monkeypatch.setattr(opt, "synchronize", waiting_synchronize)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb)
    train(model, opt, cb, sampler, data, epochs=1)
    times = [h["times"][0] for h in cb.history]
    assert len(times) == 4
    # every window but the first holds steps that follow an update
    assert all(SlowUpdateSGD.UPDATE_S <= t < 0.5 for t in times[1:]), times
    assert cb._update_began is None
    cb.on_train_end()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


@pytest.mark.parametrize("explicit_sync, mark, quota", [(False, False, None), (True, True, None),
                                                       (True, False, None), (False, False, 1.0)])
def test_each_steps_release_is_when_the_synchronize_returned(data, monkeypatch, explicit_sync,
                                                             mark, quota):
    # omnihvd.lags: a step's release time is where its update begins, after the
    # synchronize; a step whose local time already holds the synchronize (no mark)
    # has none; a rank under a CPU quota has them too
    import time

    import numpy as np

    model, opt, cb = build(adjust_every=2, settle_steps=0, nonblocking=False, cpu_quota=quota,
                           release_lag=True)
    synchronize, returned = opt.synchronize, []

    def noted_synchronize():
        out = synchronize()
        returned.append(time.perf_counter())
        return out

    monkeypatch.setattr(opt, "synchronize", noted_synchronize)
    gathered = []
    decide = cb.cadence.decide

    def spy(*args, **kwargs):
        gathered.append(kwargs.get("releases"))
        return decide(*args, **kwargs)

    monkeypatch.setattr(cb.cadence, "decide", spy)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb)
    train(model, opt, cb, sampler, data, epochs=1, explicit_sync=explicit_sync, mark=mark)
    cb.on_train_end()
    # an unmarked synchronize() after the backward pass is in the pause that follows
    # it (omnihvd.segments): the step keeps its time and its release, as when marked
    releases = np.concatenate(gathered)[:, 0]
    assert len(releases) == len(returned) == N // B
    # just after the synchronize returned (explicit: after the clipping, too)
    assert all(0 <= r - t < 0.1 for r, t in zip(releases, returned)), (releases, returned)
    assert cb.history[-1]["lag_charges"] == [0.0]   # one rank: the first to resume
