"""A memory cap lowered just before an epoch's last, partial step, on ranks whose
loaders prefetch to different depths (rank 0: 2 loader processes, rank 1: none).

Rank 0 reports an out-of-memory error at step 5; the decision at the end of that step
lowers its cap. Rank 0's loader cut the partial step 6 before that decision, rank 1's
cuts it after: both must cut it with the same bounds (the caps hold from the decision's
effective step), so the ranks agree on its sizes, the gradient weights sum to the
number of ranks and no sample is handed out twice. Prints "OOM-PARTIAL-OK" on rank 0.
"""
import torch
import horovod.torch as hvd

import omnihvd

torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.manual_seed(0)
B, N = 16, 16 * 6 + 14          # steps 0-5 full, step 6 partial (14 samples)
data = torch.utils.data.TensorDataset(torch.randn(N, 4), torch.randn(N, 1), torch.arange(N))
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, initial_batch_sizes=[12, 4],
                               adjust_every=6, alike_ranks=False)
sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=0, drop_last=False)
loader = torch.utils.data.DataLoader(data, batch_sampler=sampler,
                                     num_workers=2 if rank == 0 else 0)
cb.on_train_begin()
seen = []
sampler.set_epoch(0)
cb.on_epoch_begin(0)
for x, y, idx in cb.wrap(loader):
    cb.on_batch_begin()
    if rank == 0 and cb.step == 5:
        cb.report_oom()
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
    caps = cb.history[-1].get("caps") if cb.history else None
    print("OOM-PARTIAL-OK" if not problems and caps else "OOM-PARTIAL-BAD %s caps %s"
          % (problems, caps), flush=True)
