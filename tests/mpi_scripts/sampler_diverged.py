"""Training samplers that diverge after on_train_begin (the cross-rank check there has
passed) must be caught at the next gather on every rank, never a hang or silently
repeated samples.

usage: sampler_diverged.py MODE
  late    the sampler is created after on_train_begin, with seed = rank
  epoch   set_epoch(epoch + rank)
  resume  rank 0 alone loads a mid-epoch position after on_train_begin
  same    control: every rank alike (no error)

Every rank prints "RANK r ERROR Kind: message" or "RANK r NO ERROR".
"""
import sys

import torch
import horovod.torch as hvd

import omnihvd

mode = sys.argv[1]
torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()
N, B = 96, 8
data = torch.utils.data.TensorDataset(torch.randn(N, 4), torch.randn(N, 1))
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=2,
                               abort_on_exception=False)
sampler = None
if mode != "late":
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=0)
cb.on_train_begin()
if mode == "late":
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=rank)
if mode == "resume" and rank == 0:
    sampler.load_state_dict(dict(sampler.state_dict(), step_in_epoch=3))
loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
try:
    for epoch in range(2):
        sampler.set_epoch(epoch + (rank if mode == "epoch" else 0))
        cb.on_epoch_begin(epoch)
        for x, y in cb.wrap(loader):
            cb.on_batch_begin()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            cb.on_batch_end()
    line = "RANK %d NO ERROR\n" % rank
except Exception as exc:   # noqa: BLE001 -- reported, the test reads it
    line = "RANK %d ERROR %s: %s\n" % (rank, type(exc).__name__, exc)
sys.stdout.write(line)
sys.stdout.flush()
