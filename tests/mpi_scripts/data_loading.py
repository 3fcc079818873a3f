"""Data loading counts as local work: under mpirun, a rank whose dataset is slower
per sample ends with fewer samples (tests/test_timing_mpi.py).

Every rank trains the same tiny model; rank ``SLOW`` reads its samples from a
dataset that takes ``SLOW_READ`` seconds per sample (slow storage), the others from
the same data at ``FAST_READ`` seconds per sample. The fast read is not zero on
purpose: with a model this small, a free read leaves the equal ranks' step time
with no part that grows with the batch, so any split between them is as good as
any other and the controller follows the scheduler's noise (on 2 shared cores one
of them drifted to a single sample; CI failure on 251277d). The loop is the public contract's, iterating
``cb.wrap(loader)`` (mode ``wrap``) or the plain ``loader`` (mode ``plain``).

Usage: data_loading.py MODE EPOCHS
Rank 0 prints ``DATA {json}``: final sizes, decisions, and per rank the sorted
indices it consumed in each epoch (to check coverage).
"""
import json
import sys
import time

import torch
import horovod.torch as hvd

import omnihvd

SLOW, SLOW_READ, FAST_READ, B, N = 1, 0.002, 0.0003, 48, 48 * 20


class Samples(torch.utils.data.Dataset):
    def __init__(self, delay):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)
        self.delay = delay

    def __len__(self):
        return N

    def __getitem__(self, i):
        time.sleep(self.delay)  # the read
        return self.x[i], self.y[i], i


def main():
    mode, epochs = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=5,
                                   policy="proportional")
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=3)
    loader = torch.utils.data.DataLoader(Samples(SLOW_READ if rank == SLOW else FAST_READ),
                                         batch_sampler=sampler)
    seen = []
    cb.on_train_begin()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        cb.on_epoch_begin(epoch)
        consumed = []
        for x, y, idx in (cb.wrap(loader) if mode == "wrap" else loader):
            cb.on_batch_begin()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            cb.on_batch_end()
            consumed += idx.tolist()
        cb.on_epoch_end(epoch)
        seen.append(sorted(consumed))
    cb.on_train_end()
    everyone = hvd.allgather_object(seen)
    if rank == 0:
        print("DATA " + json.dumps({"final_sizes": cb.batch_sizes, "changes": cb.adjustments,
                                    "seen": everyone}), flush=True)


if __name__ == "__main__":
    main()
