"""Multi-rank check of the synchronous core, run under mpirun by tests/test_core_mpi.py.

Every rank trains a small float64 model with OmniLearnCallback + the sampler while
ranks are made slower by known factors (sleep per sample before opt.step()), so the
controller really moves the batch sizes. Rank 0 then replays the run in one process
on the union of every step's samples and checks, step for step, that the parameters
are equal: the weighted allreduce is exactly the global-batch gradient. It also
checks that each epoch handed out every sample exactly once.

Usage: core_train.py OP BPPS NUM_WORKERS [SLOWDOWNS]
  OP: average|sum; BPPS: backward passes per step; SLOWDOWNS: "1,2,4" seconds/sample
  factors in units of 0.2 ms.
"""
import sys
import time

import numpy as np
import torch
import horovod.torch as hvd
from mpi4py import MPI

import omnihvd

op_name, bpps, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
slow = [float(s) for s in (sys.argv[4] if len(sys.argv) > 4 else "1,2,4").split(",")]
torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
comm = MPI.COMM_WORLD

N, B, D, EPOCHS = 245, 24, 5, 2
gen = torch.Generator().manual_seed(123)
X = torch.randn(N, D, generator=gen)
Y = (X @ torch.randn(D, 1, generator=gen)).squeeze(1) + 0.1 * torch.randn(N, generator=gen)
dataset = torch.utils.data.TensorDataset(X, Y, torch.arange(N))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(D, 8)
        self.out = torch.nn.Linear(8, 1)
        self.unused = torch.nn.Linear(2, 2)  # never gets a gradient

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x))).squeeze(1)


def make_model():
    torch.manual_seed(7)
    return Net()


model = make_model()
base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
op = hvd.Average if op_name == "average" else hvd.Sum
opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), op=op,
                               backward_passes_per_step=bpps)
cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=3,
                               deadband=0.0, min_batch_size=2)
sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=5, drop_last=(op_name == "average"))
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers)
per_sample = 0.0002 * slow[rank % len(slow)]

log = []  # per optimizer step: list of micro-steps, each the global indices (this rank's)
epoch_indices = []
cb.on_train_begin()
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    cb.on_epoch_begin(epoch)
    seen = []
    micro = []
    for x, y, idx in loader:
        cb.on_batch_begin()
        assert len(idx) == cb.batch_sizes_at(cb.step)[rank], (len(idx), cb.batch_sizes_at(cb.step))
        if len(micro) == 0:
            opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        time.sleep(per_sample * len(idx))
        micro.append(idx.tolist())
        seen.extend(idx.tolist())
        if len(micro) == bpps:
            opt.step()
            log.append(micro)
            micro = []
        cb.on_batch_end()
    cb.on_epoch_end(epoch)
    epoch_indices.append(seen)
    if micro:  # an epoch ending inside an accumulation window is not part of this check
        raise SystemExit("choose N, B so epochs hold whole accumulation windows")
cb.on_train_end()

all_logs = comm.gather(log, root=0)
all_epochs = comm.gather(epoch_indices, root=0)
final = [p.detach().clone() for p in model.parameters()]
history = cb.history
if rank == 0:
    # 1. every sample once per epoch
    for e in range(EPOCHS):
        union = sorted(i for r in range(size) for i in all_epochs[r][e])
        assert len(union) == len(set(union)), "epoch %d repeated a sample" % e
        full = (N // B) * B
        expect = full if op_name == "average" else N
        assert len(union) == expect, (e, len(union), expect)
    # 2. replay in one process on the union of each step's samples
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for s in range(len(log)):
        ref_opt.zero_grad()
        for m in range(bpps):
            idx = torch.tensor([i for r in range(size) for i in all_logs[r][s][m]])
            torch.nn.functional.mse_loss(ref(X[idx]), Y[idx]).backward()
        ref_opt.step()
    worst = max(float((a - b).abs().max()) for a, b in zip(final, ref.parameters()))
    sizes_seen = sorted({tuple(h["new_sizes"]) for h in history})
    print("steps %d, decisions %d, changes %d, sizes %s" % (
        len(log), len(history), cb.adjustments, sizes_seen[:6]))
    print("max |param - single-process param| = %.3g" % worst)
    assert worst < 1e-9, worst
    assert cb.adjustments >= 1, "the controller never moved the sizes"
    for h in history: print(h["step"], h["sizes"], ["%.4f" % t for t in h["times"]], h["new_sizes"], h["effective_step"])
    print("CORE-OK")
