"""omnihvd.elastic.TorchState with the OmniLearnCallback, in a Horovod world of one rank.

Horovod's elastic runner does, on a failure: ``state.restore()``, re-initialise,
``state.on_reset()``, ``state.sync()``, enter the function again; on a membership
change it skips the restore (the state was just committed) and, when workers only
left, the sync. These tests drive the same calls on a real ``hvd.elastic`` state in
one process and check where the sampler and the callback continue; the real
elastic ``horovodrun`` runs, with worlds that change size, are in
``test_elastic_cluster.py``.
"""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import horovod.torch as hvd
import omnihvd
import omnihvd.elastic
from omnihvd.errors import ConfigError

pytestmark = [pytest.mark.single, pytest.mark.usefixtures("horovod")]

N, B = 64, 8


def build(**options):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=3, **options)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    data = TensorDataset(torch.arange(N), x, x.sum(1, keepdim=True))
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=3)
    loader = DataLoader(data, batch_sampler=sampler)
    return model, opt, cb, sampler, loader


def steps(model, opt, cb, batches, state, count, *, commit=True):
    """``count`` steps of the drop-in loop over the iterator ``batches``; returns the
    sample ids used."""
    used = []
    for ids, x, y in batches:
        cb.on_batch_begin((ids, x, y))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        cb.on_batch_end()
        used += ids.tolist()
        if commit:
            state.commit()
        if len(used) == count * B:
            break
    return used


def test_failure_rolls_back_to_the_commit_and_continues_the_epoch_there():
    model, opt, cb, sampler, loader = build()
    state = omnihvd.elastic.TorchState(model, opt, callback=cb, epoch=0)
    state.sync()                                   # what hvd.elastic.run does first
    cb.on_train_begin()
    sampler.set_epoch(0)
    batches = iter(loader)
    kept = steps(model, opt, cb, batches, state, 3)
    committed = [p.detach().clone() for p in model.parameters()]
    lost = steps(model, opt, cb, batches, state, 2, commit=False)   # then a worker fails
    assert cb.step == 5
    state.restore()                                # HorovodInternalError
    state.on_reset()
    state.sync()
    assert cb.step == 3
    assert all(torch.equal(a, b) for a, b in zip(committed, model.parameters()))
    cb.on_train_begin()                            # re-entry: the world is agreed again
    sampler.set_epoch(0)
    rest = steps(model, opt, cb, iter(loader), state, N // B - 3)
    assert rest[:2 * B] == lost                    # the rolled-back steps, redone
    assert sorted(kept + rest) == list(range(N))   # the epoch: every sample once
    assert [w["step"] for w in cb.worlds] == [0, 3]
    assert cb.worlds[0]["throughputs"] == [None]   # nothing measured at the start
    assert cb.worlds[1]["throughputs"][0] > 0      # its own measured samples/s
    assert all(w["batch_sizes"] == [B] for w in cb.worlds)
    cb.on_train_end()


def test_membership_change_continues_without_repeating_a_sample():
    model, opt, cb, sampler, loader = build()
    state = omnihvd.elastic.TorchState(model, opt, callback=cb, epoch=0)
    state.sync()
    cb.on_train_begin()
    sampler.set_epoch(0)
    first = steps(model, opt, cb, iter(loader), state, 5)
    state.on_reset()                 # HostsUpdatedInterrupt (workers left): no restore, no sync
    cb.on_train_begin()
    sampler.set_epoch(0)
    rest = steps(model, opt, cb, iter(loader), state, N // B - 5)
    assert sorted(first + rest) == list(range(N))
    assert cb.step == N // B and len(cb.worlds) == 2
    cb.on_train_end()


def test_the_reset_removes_the_hooks_and_entry_puts_them_back_once():
    model, opt, cb, sampler, loader = build()
    state = omnihvd.elastic.TorchState(model, opt, callback=cb)
    cb.on_train_begin()
    hooks = len(cb._hooks)
    state.on_reset()
    assert cb._hooks == []
    cb.on_train_begin()
    assert len(cb._hooks) == hooks
    cb.on_train_end()


def test_the_loader_before_entry_is_a_clear_error():
    model, opt, cb, sampler, loader = build()
    state = omnihvd.elastic.TorchState(model, opt, callback=cb)
    cb.on_train_begin()
    sampler.set_epoch(0)
    steps(model, opt, cb, iter(loader), state, 2)
    state.on_reset()
    next(iter(loader))               # the sampler hands out a step of the old world
    with pytest.raises(ConfigError, match="on_train_begin.*before iterating the loader"):
        cb.on_train_begin()


def test_elastic_job_without_the_omnihvd_state_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    model, opt, cb, sampler, loader = build()
    assert cb._abort_enabled is False    # a failed worker must leave alone
    with pytest.raises(ConfigError, match="omnihvd.elastic.TorchState"):
        cb.on_train_begin()


def test_initial_batch_sizes_do_not_fit_a_changing_world():
    model, opt, cb, sampler, loader = build(initial_batch_sizes=[B])
    with pytest.raises(ConfigError, match="initial_batch_sizes"):
        omnihvd.elastic.TorchState(model, opt, callback=cb)


def test_the_callback_must_be_an_omnilearn_callback():
    model, opt, cb, sampler, loader = build()
    with pytest.raises(ConfigError, match="OmniLearnCallback"):
        omnihvd.elastic.TorchState(model, opt, callback=object())
    omnihvd.elastic.TorchState(model, opt, callback=cb)
    with pytest.raises(ConfigError, match="already tracked"):
        omnihvd.elastic.TorchState(model, opt, callback=cb)
