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
         break_mid      breaks between opt.step() and cb.on_batch_end() of step 10
                        (a gather in flight), then runs a second epoch
         blocking       no_train_end with nonblocking=False
"""
import os
import sys
import time

import torch
import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import loop_shapes  # noqa: E402  (tests/loop_shapes.py, shared with the DDP script)

import omnihvd  # noqa: E402

shape, steps, adjust_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()

B = 8 * size
dataset = loop_shapes.dataset(B, steps)
torch.manual_seed(1)
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=adjust_every,
                               nonblocking=(shape != "blocking"))
sampler = omnihvd.HeterogeneousBatchSampler(len(dataset), cb, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
per_sample = loop_shapes.per_sample_seconds(rank)


def emulated_work(seconds):
    with cb.working():   # emulated speed: work, though after the backward pass
        time.sleep(seconds)


loop_shapes.train(cb, sampler, loader, model, opt, shape=shape, steps=steps, rank=rank,
                  before_step=lambda samples: emulated_work(per_sample * samples))
if shape == "train_end":
    cb.on_train_end()
if shape == "late_last" and rank == size - 1:
    time.sleep(0.5)
print("rank %d LOOP-END-OK steps %d sizes %s" % (rank, cb.step, cb.batch_sizes), flush=True)
