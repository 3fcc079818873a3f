"""A rank that raises mid-training ends the whole torchrun job, run by tests/test_ddp.py.

Rank 1 starts a non-daemon thread (like a metrics uploader), so its interpreter
could not exit on its own after the traceback, then raises at step 4 while the
other ranks wait for it in DDP's allreduce. DDPOmniLearnCallback's abort handler
must end rank 1 at once; torchrun then ends the others and exits non-zero.

Usage: ddp_fail.py
"""
import sys

sys.modules["horovod"] = None  # the DDP path must not need Horovod

import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import omnihvd  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
N, B = 240, 24
gen = torch.Generator().manual_seed(0)
dataset = torch.utils.data.TensorDataset(torch.randn(N, 4, generator=gen),
                                         torch.randn(N, generator=gen))
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=B, adjust_every=2)
sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
if rank == 1:
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=False).start()  # never set: keeps rank 1 alive

cb.on_train_begin()
for epoch in range(100):
    sampler.set_epoch(epoch)
    for x, y in loader:
        cb.on_batch_begin()
        if rank == 1 and cb.step == 4:
            raise RuntimeError("injected failure at step %d" % cb.step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
        opt.step()
        cb.on_batch_end()
        time.sleep(0.01)
cb.on_train_end()
print("RANK %d FINISHED (should not happen)" % rank, flush=True)
