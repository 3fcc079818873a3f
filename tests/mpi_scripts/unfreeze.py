"""Gradual unfreezing under mpirun, run by tests/test_core_mpi.py.

A float64 model trained by a loop that calls a method of the model (``model.body(x)``,
as timm's ``forward_head(forward_features(x))`` loops do), never ``model(x)``, so no
forward pre-hook of the model runs. Rank r is (r + 1) times slower per sample, so the
sizes move. Every step each rank checks every gradient against the gradient of the
mean loss over all ranks' samples of the step (gathered, recomputed here).

Usage: unfreeze.py CASE
  between  ``head`` trainable when the DistributedOptimizer is created, frozen when the
           callback registers its hooks, unfrozen between two steps (before
           on_batch_begin): it must be weighted from then on -> UNFREEZE-OK
  within   the same, unfrozen after on_batch_begin: its gradient could not be weighted
           -> a ConfigError on every rank
  before   ``head`` frozen when the DistributedOptimizer is created (Horovod never
           allreduces it), unfrozen between steps -> a ConfigError on every rank
  before_cb  the same, unfrozen before the callback registers its hooks -> a
           ConfigError on every rank at on_train_begin
"""
import sys
import time

import torch
import horovod.torch as hvd
from mpi4py import MPI

import omnihvd

case = sys.argv[1]
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
hvd.init()
rank, size = hvd.rank(), hvd.size()
B, N, STEPS = 24, 24 * 12, 12


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.head = torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)

    def body(self, x):   # what the loop calls instead of forward
        return self.head(torch.tanh(self.trunk(x))).squeeze(1)


model = Net()
if case in ("before", "before_cb"):
    model.head.requires_grad_(False)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
model.head.requires_grad_(case == "before_cb")
cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=2, deadband=0.0)
gen = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(N, 4, generator=gen), torch.randn(N, generator=gen))
sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=3)
loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)


def global_gradients(x, y):
    """The gradient of the mean loss over every rank's samples, at these parameters."""
    xs, ys = hvd.allgather(x), hvd.allgather(y)
    ref = Net()
    ref.load_state_dict(model.state_dict())
    for mine, theirs in zip(model.parameters(), ref.parameters()):
        theirs.requires_grad_(mine.requires_grad)
    torch.nn.functional.mse_loss(ref.body(xs), ys).backward()
    return [p.grad for p in ref.parameters()]


try:
    cb.on_train_begin()
    sampler.set_epoch(0)
    cb.on_epoch_begin(0)
    sizes = set()
    for i, (x, y) in enumerate(loader):
        if case in ("between", "before") and i == STEPS // 2:
            model.head.requires_grad_(True)
        cb.on_batch_begin()
        if case == "within" and i == STEPS // 2:
            model.head.requires_grad_(True)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model.body(x), y).backward()
        with cb.working():   # emulated speed: work, after the backward pass
            time.sleep(0.0003 * (rank + 1) * len(x))
        cb.mark_compute_end()
        opt.synchronize()
        want = global_gradients(x, y)
        for (name, p), g in zip(model.named_parameters(), want):
            if g is None:
                assert p.grad is None or not p.requires_grad, name
                continue
            err = float((p.grad - g).abs().max() / g.abs().max())
            assert err < 1e-9, (i, name, err, cb.batch_sizes)
        with opt.skip_synchronize():
            opt.step()
        sizes.add(tuple(cb.batch_sizes))
        cb.on_batch_end()
    cb.on_epoch_end(0)
    cb.on_train_end()
except omnihvd.ConfigError as exc:
    print("rank %d CONFIG-ERROR %s" % (rank, exc), flush=True)
    # wait for the others' own error: the first to exit would end the job (mpirun),
    # perhaps before a slower rank reached its check
    MPI.COMM_WORLD.Barrier()
    sys.exit(3)
assert len(sizes) > 1, sizes   # the sizes moved while the head trained
print("rank %d UNFREEZE-OK steps %d splits %d" % (rank, i + 1, len(sizes)), flush=True)
