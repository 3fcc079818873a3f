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
import os
import sys

sys.modules["horovod"] = None  # the DDP path must not need Horovod

import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import loop_shapes  # noqa: E402  (tests/loop_shapes.py, shared with the mpirun script)

import omnihvd  # noqa: E402

shape, steps, adjust_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
B = 8 * size
dataset = loop_shapes.dataset(B, steps)
per_sample = loop_shapes.per_sample_seconds(rank)


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
loop_shapes.train(cb, sampler, loader, model, opt, shape=shape, steps=steps, rank=rank)
sys.stdout.write("rank %d LOOP-END-OK steps %d sizes %s\n" % (rank, cb.step, cb.batch_sizes))
sys.stdout.flush()
