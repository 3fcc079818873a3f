"""A loop that fetches the next batch between opt.step() and cb.on_batch_end() (apex's
data_prefetcher shape): ``begin; forward/backward; opt.step(); batch = next(it); end``.

usage: prefetch_loop.py LOADER_PROCESSES ADJUST_EVERY wrap|plain

With ``adjust_every=1, settle_steps=0`` the first gather (posted at on_batch_begin() of
step 0) is decided after the loop handed out one more step than it had shown. cb.wrap must
check each prefetched batch against its own step, not the one ending. Every rank
prints "PREFETCH-OK <adjustments> <distinct> <handed out>" for the last epoch.
"""
import sys
import time

import torch
import horovod.torch as hvd

import omnihvd

workers, adjust_every, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()
torch.manual_seed(0)
N, B = 200, 16
data = torch.utils.data.TensorDataset(torch.randn(N, 4), torch.randn(N, 1), torch.arange(N))
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=adjust_every,
                               deadband=0.0, alike_ranks=False, settle_steps=0)
sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=1, drop_last=False)
loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, num_workers=workers)
cb.on_train_begin()
seen = []
for epoch in range(3):
    sampler.set_epoch(epoch)
    cb.on_epoch_begin(epoch)
    batches = iter(cb.wrap(loader) if how == "wrap" else loader)
    batch = next(batches, None)
    while batch is not None:
        x, y, idx = batch
        cb.on_batch_begin()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with cb.working():   # emulated speed: work, after the backward pass
            time.sleep(0.001 * len(x) * (1 + 3 * rank))
        opt.step()
        batch = next(batches, None)
        cb.on_batch_end()
        if epoch == 2:
            seen += idx.tolist()
    cb.on_epoch_end(epoch)
cb.on_train_end()
handed = [i for part in hvd.allgather_object(seen) for i in part]
print("PREFETCH-OK %d %d %d" % (cb.adjustments, len(set(handed)), len(handed)), flush=True)
