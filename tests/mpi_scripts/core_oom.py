"""Out-of-memory handling under mpirun: rank 1 "has memory" for at most CAP samples.

Rank 1 raises torch.cuda.OutOfMemoryError (constructible on CPU) whenever its batch is
larger than CAP, reports it with cb.report_oom() and still calls opt.step(). The job
must finish (no hang), rank 1's size must end up <= CAP, and the sizes must still
sum to B. Prints "OOM-OK {json}" on rank 0.
"""
import json
import time

import torch
import horovod.torch as hvd

import omnihvd

CAP, B, STEPS = 12, 60, 40
torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
# Rank 1 is the fastest, so the controller wants to give it the most samples.
cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=5)
cb.on_train_begin()
ooms = 0
for step in range(STEPS):
    cb.on_batch_begin()
    b = cb.batch_size
    opt.zero_grad()
    try:
        if rank == 1 and b > CAP:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected: %d > %d)" % (b, CAP))
        model(torch.randn(b, 4)).pow(2).mean().backward()
        with cb.working():   # emulated speed: work, after the backward pass
            time.sleep(b * (0.0002 if rank == 1 else 0.002))
    except torch.cuda.OutOfMemoryError:
        ooms += 1
        cb.report_oom()
    opt.step()
    cb.on_batch_end()
cb.on_train_end()
counts = hvd.allgather_object(ooms)
if rank == 0:
    sizes = cb.batch_sizes
    assert sum(sizes) == B and sizes[1] <= CAP, sizes
    print("OOM-OK " + json.dumps({"sizes": sizes, "oom_events": counts,
                                  "caps": cb.controller.hi.tolist()}))
