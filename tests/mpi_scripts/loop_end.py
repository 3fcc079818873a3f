"""How a training loop ends, under mpirun: every shape must exit 0 on every rank.

Run by tests/test_loop_end.py. The loop is the README's drop-in loop on ranks of
unequal speed (sleep per sample before opt.step()), so the slower ranks finish their
last step after the faster ones have left the loop and started to shut down.

Usage: loop_end.py SHAPE STEPS ADJUST_EVERY
  SHAPE: no_train_end   the loop never calls cb.on_train_end()
         train_end      it does
         break          every rank breaks out of the epoch at the same step
         late_last      the last rank does extra work after its last step
         slow_end       rank 0 spends 0.2 s between opt.step() and cb.on_batch_end()
                        in the last step (logging, metrics, a checkpoint)
         blocking       no_train_end with nonblocking=False
"""
import sys
import time

import torch
import horovod.torch as hvd

import omnihvd

shape, steps, adjust_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()

B = 8 * size
N = B * steps
gen = torch.Generator().manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(N, 4, generator=gen),
                                         torch.randn(N, generator=gen))
torch.manual_seed(1)
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=adjust_every,
                               nonblocking=(shape != "blocking"))
sampler = omnihvd.HeterogeneousBatchSampler(len(dataset), cb, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
per_sample = 0.0002 * (1 + rank)  # rank r is (r+1) times slower per sample

cb.on_train_begin()
for epoch in range(1):
    sampler.set_epoch(epoch)
    cb.on_epoch_begin(epoch)
    for i, (x, y) in enumerate(loader):
        if shape == "break" and i == steps // 2 + 1:
            break
        cb.on_batch_begin()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
        time.sleep(per_sample * len(x))
        opt.step()
        if shape == "slow_end" and rank == 0 and i == steps - 1:
            time.sleep(0.2)
        cb.on_batch_end()
    cb.on_epoch_end(epoch)
if shape == "train_end":
    cb.on_train_end()
if shape == "late_last" and rank == size - 1:
    time.sleep(0.5)
print("rank %d LOOP-END-OK steps %d sizes %s" % (rank, cb.step, cb.batch_sizes), flush=True)
