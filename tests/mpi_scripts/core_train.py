"""Multi-rank check of the synchronous core, run under mpirun by tests/test_core_mpi.py.

Every rank trains a small float64 model with OmniLearnCallback + the sampler while
ranks are made slower by known factors (sleep per sample before opt.step()), so the
controller really moves the batch sizes. Rank 0 then replays the run in one process
on the union of every step's samples and checks, step for step, that the parameters
are equal: the weighted allreduce is exactly the global-batch gradient. It also
checks that each epoch handed out every sample exactly once, and that a
validation loader on the same callback (iterated after every epoch) neither
disturbs the training schedule nor misses a sample. The loss also trains a
temperature that is the optimizer's but not the model's: Horovod allreduces it, so
it must be weighted like the model's parameters. It is frozen for the first epoch
and unfrozen inside the second's first step (gradual unfreezing, after
on_batch_begin): it must get its weight from that step on.

Usage: core_train.py OP BPPS NUM_WORKERS [SLOWDOWNS [LOSS [N]]]
  OP: average|sum; BPPS: backward passes per step; SLOWDOWNS: "1,2,4" seconds/sample
  factors in units of 0.2 ms.
  LOSS: the loss each rank computes, and the single-process loss replayed:
    mse  mean squared error, each rank's mean (loss_reduction="mean", the default)
    sum  squared error summed over the rank's samples (loss_reduction="sum")
    ce   class-weighted cross-entropy with ignore_index: each rank's sum divided by
         cb.global_count of the weights of its non-ignored targets
         (loss_reduction="sum"); replayed as torch's weighted mean over the union
    bn   mse through a model with plain BatchNorm1d: replayed as "ghost batch norm",
         each rank's samples normalised as a batch of their own
  N: dataset size (default 245: 5 samples are left after 10 steps of 24, fewer than
     3 ranks x min_batch_size 2, so with drop_last=False that step is dropped).
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
loss_kind = sys.argv[5] if len(sys.argv) > 5 else "mse"
N = int(sys.argv[6]) if len(sys.argv) > 6 else 245
tune_split = len(sys.argv) > 7 and sys.argv[7] == "tune"   # probes change sizes too
torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
comm = MPI.COMM_WORLD

B, D, EPOCHS, MIN = 24, 5, 2, 2
NV = 58  # validation set: 2 steps of 24 and a partial step of 10
gen = torch.Generator().manual_seed(123)
X = torch.randn(N, D, generator=gen)
Y = (X @ torch.randn(D, 1, generator=gen)).squeeze(1) + 0.1 * torch.randn(N, generator=gen)
CLASSES, IGNORE = 3, -100
CLASS_WEIGHT = torch.tensor([1.0, 2.5, 0.5])
if loss_kind == "ce":  # labels from the targets; about one in five ignored
    Y = torch.bucketize(Y, torch.tensor([-0.5, 0.5]))
    Y[torch.rand(N, generator=gen) < 0.2] = IGNORE
dataset = torch.utils.data.TensorDataset(X, Y, torch.arange(N))
XV = torch.randn(NV, D, generator=gen)
val_set = torch.utils.data.TensorDataset(XV, torch.arange(NV))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(D, 8)
        self.norm = torch.nn.BatchNorm1d(8) if loss_kind == "bn" else torch.nn.Identity()
        self.out = torch.nn.Linear(8, CLASSES if loss_kind == "ce" else 1)
        self.unused = torch.nn.Linear(2, 2)  # never gets a gradient

    def forward(self, x):
        out = self.out(torch.tanh(self.norm(self.hidden(x))))
        return out if loss_kind == "ce" else out.squeeze(1)


def rank_loss(out, y):
    """This rank's loss, as the loop computes it."""
    if loss_kind == "sum":
        return torch.nn.functional.mse_loss(out, y, reduction="sum")
    if loss_kind == "ce":
        total = torch.nn.functional.cross_entropy(out, y, weight=CLASS_WEIGHT,
                                                  ignore_index=IGNORE, reduction="sum")
        return total / cb.global_count(CLASS_WEIGHT[y[y != IGNORE]].sum())
    return torch.nn.functional.mse_loss(out, y)


def replay_loss(model, parts):
    """The single-process loss of one (micro-)step over every rank's samples;
    ``model``: the replay's forward (its network times its temperature)."""
    idx = torch.tensor([i for p in parts for i in p])
    if loss_kind == "sum":
        return torch.nn.functional.mse_loss(model(X[idx]), Y[idx], reduction="sum")
    if loss_kind == "ce":
        return torch.nn.functional.cross_entropy(model(X[idx]), Y[idx], weight=CLASS_WEIGHT,
                                                 ignore_index=IGNORE)
    if loss_kind == "bn":  # ghost batch norm: each rank's samples form their own batch
        return sum(torch.nn.functional.mse_loss(model(X[p]), Y[p]) * len(p) / len(idx)
                   for p in parts)
    return torch.nn.functional.mse_loss(model(X[idx]), Y[idx])


def make_model():
    torch.manual_seed(7)
    return Net()


def scaled(net, temperature):
    """The loop's forward: the network's output times a trained temperature."""
    return lambda x: net(x) * temperature


LR = 0.05 / B if loss_kind == "sum" else 0.05  # a summed loss has B times the gradient
model = make_model()
temperature = torch.nn.Parameter(torch.ones(1))   # the optimizer's, not the model's
base = torch.optim.SGD([*model.parameters(), temperature], lr=LR, momentum=0.9)
op = hvd.Average if op_name == "average" else hvd.Sum
opt = hvd.DistributedOptimizer(base, named_parameters=[*model.named_parameters(),
                                                       ("temperature", temperature)],
                               op=op, backward_passes_per_step=bpps)
cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=3,
                               deadband=0.0, min_batch_size=MIN, tune_split=tune_split,
                               loss_reduction="sum" if loss_kind in ("sum", "ce") else "mean")
sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=5, drop_last=(op_name == "average"))
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers)
val_sampler = omnihvd.HeterogeneousBatchSampler(NV, cb, seed=9, drop_last=False)
val_loader = torch.utils.data.DataLoader(val_set, batch_sampler=val_sampler)
assert sampler.train and not val_sampler.train
per_sample = 0.0002 * slow[rank % len(slow)]
temperature.requires_grad_(False)   # frozen when the hooks are registered

log = []  # per optimizer step: list of micro-steps, each the global indices (this rank's)
epoch_indices = []
val_indices = []  # per epoch: this rank's validation indices
cb.on_train_begin()
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    cb.on_epoch_begin(epoch)
    if epoch == 1:
        frozen_steps = len(log)
    seen = []
    micro = []
    for x, y, idx in loader:
        cb.on_batch_begin(batch=(x, y, idx))  # checks len(x) against this step's size
        assert len(idx) == cb.batch_sizes_at(cb.step)[rank], (len(idx), cb.batch_sizes_at(cb.step))
        if epoch == 1 and not temperature.requires_grad:
            temperature.requires_grad_(True)   # unfrozen: Horovod allreduces it again
        if len(micro) == 0:
            opt.zero_grad()
        loss = rank_loss(scaled(model, temperature)(x), y)
        loss.backward()
        with cb.working():   # an emulated slower machine: work, after the backward pass
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
    model.eval()
    with torch.no_grad():  # a validation pass between epochs, while sizes keep moving
        seen_val = []
        for xv, iv in val_loader:
            model(xv)
            seen_val.extend(iv.tolist())
        val_indices.append(seen_val)
    model.train()
    if micro:  # an epoch ending inside an accumulation window is not part of this check
        raise SystemExit("choose N, B so epochs hold whole accumulation windows")
cb.on_train_end()

all_logs = comm.gather(log, root=0)
all_epochs = comm.gather(epoch_indices, root=0)
all_val = comm.gather(val_indices, root=0)
final = [p.detach().clone() for p in [*model.parameters(), temperature]]
history = cb.history
if rank == 0:
    # 1. every sample once per epoch
    for e in range(EPOCHS):
        union = sorted(i for r in range(size) for i in all_epochs[r][e])
        assert len(union) == len(set(union)), "epoch %d repeated a sample" % e
        full = (N // B) * B
        kept = op_name != "average" and N - full >= size * MIN  # the partial step's bounds
        expect = N if kept else full
        assert len(union) == expect, (e, len(union), expect)
        val = sorted(i for r in range(size) for i in all_val[r][e])
        assert val == list(range(NV)), "validation pass %d: %s" % (e, val)
    # 2. replay in one process on the union of each step's samples
    ref = make_model()
    ref_temperature = torch.nn.Parameter(torch.ones(1))
    ref_opt = torch.optim.SGD([*ref.parameters(), ref_temperature], lr=LR, momentum=0.9)
    for s in range(len(log)):
        ref_temperature.requires_grad_(s >= frozen_steps)
        ref_opt.zero_grad()
        for m in range(bpps):
            replay_loss(scaled(ref, ref_temperature),
                        [all_logs[r][s][m] for r in range(size)]).backward()
        ref_opt.step()
    worst = max(float((a - b.detach()).abs().max())
                for a, b in zip(final, [*ref.parameters(), ref_temperature]))
    sizes_seen = sorted({tuple(h["new_sizes"]) for h in history})
    print("steps %d, decisions %d, changes %d, sizes %s" % (
        len(log), len(history), cb.adjustments, sizes_seen[:6]))
    print("max |param - single-process param| = %.3g" % worst)
    assert worst < 1e-9, worst
    assert cb.adjustments >= 1, "the controller never moved the sizes"
    if tune_split:   # the search ran: some window was timed at a tilted split
        assert cb.cadence.tuner.searches >= 1 or cb.cadence.tuner.probing, "no search ran"
    for h in history: print(h["step"], h["sizes"], ["%.4f" % t for t in h["times"]], h["new_sizes"], h["effective_step"])
    print("loss %s, N %d: last step sizes %s" % (loss_kind, N, [len(all_logs[r][-1][-1]) for r in range(size)]))
    print("CORE-OK")
