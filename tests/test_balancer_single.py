"""omnihvd.Balancer in one process (a Horovod world of one): the loop calls nothing,
steps begin at the loader's batch and end at opt.step(), the loader behaves as a
DataLoader with a DistributedSampler, bad input is a ConfigError, and a wait inside
the step between the model's passes is no work. Multi-rank exactness and balance:
test_balancer_mpi.py."""
import time

import pytest
import torch
from torch.utils.data import TensorDataset

import horovod.torch as hvd
import omnihvd
from omnihvd.errors import ConfigError

pytestmark = [pytest.mark.single, pytest.mark.usefixtures("horovod")]

N, B = 40, 8


class Slow(torch.nn.Module):
    """A linear model whose forward pass takes ``delay`` seconds more."""

    def __init__(self, delay=0.0):
        super().__init__()
        self.linear, self.delay = torch.nn.Linear(3, 1).double(), delay

    def forward(self, x):
        time.sleep(self.delay)
        return self.linear(x)


def dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=g, dtype=torch.float64)
    return TensorDataset(torch.arange(N), x, x.sum(1, keepdim=True))


def build(delay=0.0, passes=1, **options):
    torch.manual_seed(0)
    model = Slow(delay)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes)
    return model, opt, omnihvd.Balancer(model, opt, global_batch_size=B, **options)


def step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def one_epoch(loader, model, opt):
    """A pass of the plain loop; returns the sample indices it trained on."""
    seen = []
    for idx, x, y in loader:
        step(model, opt, x, y)
        seen += idx.tolist()
    return seen


def test_a_plain_loop_runs_one_step_per_batch_and_uses_every_sample():
    model, opt, bal = build()
    loader = bal.loader(dataset(), shuffle=True, seed=3)
    assert len(loader) == N // B and loader.batch_sampler is loader.sampler
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        seen = []
        for idx, x, y in loader:
            assert len(idx) == bal.batch_size == B   # one rank: the whole global batch
            step(model, opt, x, y)
            seen += idx.tolist()
        assert sorted(seen) == list(range(N))
    assert bal.step == 2 * N // B and bal.batch_sizes == [B]
    bal.close()


def test_a_batch_without_opt_step_still_ends_its_step():
    # a NaN guard's `continue` before backward: the next fetch ends the step
    model, opt, bal = build()
    loader = bal.loader(dataset())
    for i, (idx, x, y) in enumerate(loader):
        if i % 2:
            continue
        step(model, opt, x, y)
    assert bal.step == N // B
    bal.close()


def test_a_wait_between_the_model_passes_is_no_work():
    # a metric's allreduce between forward and backward, or after backward, waits for
    # the slowest rank: emulated by sleeps there; the forward pass's own 40 ms counts
    model, opt, bal = build(delay=0.04, advanced={"cpu_quota": None})
    loader = bal.loader(dataset())
    times = []
    for idx, x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        time.sleep(0.1)                    # waiting inside a collective
        loss.backward()
        time.sleep(0.1)                    # and after the backward pass
        opt.step()
        times.append(bal.callback.last_step_time)
    measured = [t for t in times[1:] if t is not None]
    assert measured and all(0.035 < t < 0.1 for t in measured), times
    bal.close()


def test_sub_batches_need_no_backward_passes_per_step_of_their_own():
    # Horovod would allreduce after 2 passes and refuse the third; the balancer lets
    # each rank run as many as its share needs, and gives the count back at close()
    model, opt, bal = build(passes=2)
    loader = bal.loader(dataset())
    for idx, x, y in loader:
        opt.zero_grad()
        for i in range(0, len(x), 2):      # 4 passes of 2 samples
            (torch.nn.functional.mse_loss(model(x[i:i + 2]), y[i:i + 2]) / 4).backward()
        opt.step()
    assert bal.step == N // B
    bal.close()
    assert opt.backward_passes_per_step == 2


def test_state_dict_resumes_the_sizes_and_the_loaders_place():
    model, opt, bal = build()
    loader = bal.loader(dataset())
    loader.sampler.set_epoch(1)
    for i, (idx, x, y) in enumerate(loader):
        step(model, opt, x, y)
        if i == 1:
            state = bal.state_dict()
            break
    bal.close()
    model, opt, again = build()
    rest = again.loader(dataset())
    again.load_state_dict(state)
    left = [idx.tolist() for idx, x, y in rest]
    assert again.step == 2 + len(left) and len(left) == N // B - 2
    again.close()


@pytest.mark.parametrize("kwargs,match", [
    ({"batch_size": 4}, "batch_size"),
    ({"sampler": [0, 1]}, "sampler"),
])
def test_the_loader_refuses_a_batch_size_or_sampler_of_its_own(kwargs, match):
    _, _, bal = build()
    with pytest.raises(ConfigError, match=match):
        bal.loader(dataset(), **kwargs)


def test_one_training_loader_per_balancer():
    _, _, bal = build()
    bal.loader(dataset())
    with pytest.raises(ConfigError, match="already has its training loader"):
        bal.loader(dataset())


@pytest.mark.parametrize("advanced,match", [
    ({"no_such_option": 1}, "no_such_option"),
    ([("gain", 1.0)], "must be a dict"),
    ({"global_batch_size": 4}, "pass it to Balancer itself"),
    ({"gain": 5.0}, "gain"),
])
def test_advanced_options_are_checked(advanced, match):
    with pytest.raises(ConfigError, match=match):
        build(advanced=advanced)


def test_a_plain_torch_optimizer_under_horovod_is_refused():
    model = Slow()
    with pytest.raises(ConfigError, match="hvd.DistributedOptimizer"):
        omnihvd.Balancer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         global_batch_size=B)


@pytest.mark.parametrize("where", ["before_step", "after_step"])
def test_a_break_mid_epoch_leaves_the_next_epoch_whole(where):
    model, opt, bal = build()
    loader = bal.loader(dataset())
    for i, (idx, x, y) in enumerate(loader):
        if i == 2 and where == "before_step":
            break
        step(model, opt, x, y)
        if i == 2:
            break
    loader.sampler.set_epoch(1)
    assert sorted(one_epoch(loader, model, opt)) == list(range(N))
    bal.close()


def test_a_peek_before_the_loop_costs_no_sample_of_the_epoch():
    model, opt, bal = build()
    loader = bal.loader(dataset())
    idx, x, y = next(iter(loader))        # a look at the data, no training
    assert len(idx) == B
    assert sorted(one_epoch(loader, model, opt)) == list(range(N))
    bal.close()
