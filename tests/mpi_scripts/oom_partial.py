"""A memory cap lowered just before an epoch's last, partial step, on ranks whose
loaders prefetch to different depths (rank 0: 2 loader processes, rank 1: none).

Rank 0 reports an out-of-memory error at step 4; the gather posted as step 5 begins
carries it, and the decision at the end of step 5 lowers its cap. Rank 0's loader cut
the partial step 6 before that decision, rank 1's cuts it after: both must cut it with
the same bounds (the caps hold from the decision's effective step), so the ranks agree
on its sizes, the gradient weights sum to the number of ranks and no sample is handed
out twice. Prints "OOM-PARTIAL-OK" on rank 0.

With the argument "multiple" (size_multiple=4, B=24, a partial step of 19 samples and
rank 0's cap halved at step 0) the lowered caps leave no split for the partial step:
every rank must drop it alike (it crashed on the rank that asked late).
"""
import sys

import torch
import horovod.torch as hvd

import omnihvd

torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.manual_seed(0)
multiple = sys.argv[1:] == ["multiple"]
B = 24 if multiple else 16
N = B * 6 + (19 if multiple else 14)   # steps 0-5 full, step 6 partial
OOM_STEP, SHRINK = (0, 0.5) if multiple else (4, 0.8)
data = torch.utils.data.TensorDataset(torch.randn(N, 4), torch.randn(N, 1), torch.arange(N))
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
options = (dict(initial_batch_sizes=[12, 12], min_batch_size=4, size_multiple=4, adjust_every=2)
           if multiple else dict(initial_batch_sizes=[12, 4], adjust_every=6))
cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, alike_ranks=False, **options)
sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=0, drop_last=False)
loader = torch.utils.data.DataLoader(data, batch_sampler=sampler,
                                     num_workers=2 if rank == 0 else 0)
cb.on_train_begin()
seen = []
sampler.set_epoch(0)
cb.on_epoch_begin(0)
for x, y, idx in cb.wrap(loader):
    cb.on_batch_begin()
    if rank == 0 and cb.step == OOM_STEP:
        cb.report_oom(shrink=SHRINK)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    seen.append((cb.step, cb.batch_sizes_at(cb.step), cb._gradient_weight.value, idx.tolist()))
    cb.on_batch_end()
cb.on_train_end()
every = hvd.allgather_object(seen)
if rank == 0:
    problems = []
    for rows in zip(*every):
        step = rows[0][0]
        if any(r[1] != rows[0][1] for r in rows):
            problems.append("step %d: sizes %s" % (step, [r[1] for r in rows]))
        if abs(sum(r[2] for r in rows) - size) > 1e-9:
            problems.append("step %d: weights %s" % (step, [r[2] for r in rows]))
        handed = [i for r in rows for i in r[3]]
        if len(set(handed)) != len(handed):
            problems.append("step %d: %d of %d samples distinct"
                            % (step, len(set(handed)), len(handed)))
    caps = [h["caps"] for h in cb.history if "caps" in h]
    if len(every[0]) != (6 if multiple else 7):
        problems.append("%d steps ran" % len(every[0]))
    print("OOM-PARTIAL-OK" if not problems and caps else "OOM-PARTIAL-BAD %s caps %s"
          % (problems, caps), flush=True)
