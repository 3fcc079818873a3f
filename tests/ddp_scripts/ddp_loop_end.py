"""How a DDP training loop ends, under torchrun: every shape must exit 0 on every rank.

Run by tests/test_ddp.py. The README-shaped loop on ranks of unequal speed (a sleep
per sample in forward), so the slower ranks finish their last step after the faster
ones have left the loop and exited; the last step ends an adjustment window, so a
gather is due exactly then. Horovod is hidden.

Usage: ddp_loop_end.py SHAPE STEPS ADJUST_EVERY
  SHAPE: no_train_end  the loop never calls cb.on_train_end() nor destroys the group
         slow_end      rank 0 spends 0.2 s between opt.step() and cb.on_batch_end()
                       in the last step
         blocking      no_train_end with nonblocking=False
"""
import sys

sys.modules["horovod"] = None  # the DDP path must not need Horovod

import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import omnihvd  # noqa: E402

shape, steps, adjust_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
B = 8 * size
N = B * steps
gen = torch.Generator().manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(N, 4, generator=gen),
                                         torch.randn(N, generator=gen))
per_sample = 0.0002 * (1 + rank)  # rank r is (r+1) times slower per sample


class Slow(torch.nn.Linear):
    def forward(self, x):
        time.sleep(per_sample * len(x))  # this rank's work: before the last bucket
        return super().forward(x)


torch.manual_seed(1)
model = torch.nn.parallel.DistributedDataParallel(Slow(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=B, adjust_every=adjust_every,
                                  nonblocking=(shape != "blocking"))
sampler = omnihvd.HeterogeneousBatchSampler(len(dataset), cb, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
cb.on_train_begin()
for epoch in range(1):
    sampler.set_epoch(epoch)
    cb.on_epoch_begin(epoch)
    for i, (x, y) in enumerate(loader):
        cb.on_batch_begin()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
        opt.step()
        if shape == "slow_end" and rank == 0 and i == steps - 1:
            time.sleep(0.2)
        cb.on_batch_end()
    cb.on_epoch_end(epoch)
sys.stdout.write("rank %d LOOP-END-OK steps %d sizes %s\n" % (rank, cb.step, cb.batch_sizes))
sys.stdout.flush()
