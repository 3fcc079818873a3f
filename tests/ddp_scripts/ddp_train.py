"""DDP exactness and coverage under torchrun, run by tests/test_ddp.py.

Every rank trains a small float64 model wrapped in DistributedDataParallel with
DDPOmniLearnCallback and the sampler. The sizes change mid-run in two ways: a
schedule loaded from a checkpoint switches them at fixed steps (deterministic), and
rank 0 is slowed by a sleep per sample inside forward, so the controller moves them
too. After every backward each rank records its gradients; rank 0 then replays the
run in one process on the union of each step's samples and compares every step's
gradients and the final parameters (float64, max |diff| <= 1e-12), and checks that
each epoch handed out every sample exactly once. Horovod is made unimportable first:
the DDP path must not need it.

Usage: ddp_train.py NUM_WORKERS DROP_LAST(0|1)
"""
import sys

sys.modules["horovod"] = None  # any `import horovod...` now raises ImportError

import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import omnihvd  # noqa: E402
from omnihvd.comm import TorchDistComm  # noqa: E402

workers, drop_last = int(sys.argv[1]), bool(int(sys.argv[2]))
tune_split = len(sys.argv) > 3 and sys.argv[3] == "tune"   # its probes change sizes too
torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()

N, B, D, EPOCHS = 250 if not drop_last else 240, 24, 5, 3
gen = torch.Generator().manual_seed(123)
X = torch.randn(N, D, generator=gen)
Y = (X @ torch.randn(D, 1, generator=gen)).squeeze(1) + 0.1 * torch.randn(N, generator=gen)
dataset = torch.utils.data.TensorDataset(X, Y, torch.arange(N))
PER_SAMPLE = 0.003 if rank == 0 else 0.0  # seconds: rank 0 is the slow one


class Net(torch.nn.Module):
    def __init__(self, slow=0.0):
        super().__init__()
        self.hidden = torch.nn.Linear(D, 16)
        self.mid = torch.nn.Linear(16, 8)
        self.out = torch.nn.Linear(8, 1)
        self.slow = slow

    def forward(self, x):
        if self.slow:
            time.sleep(self.slow * len(x))  # inside the timed window, before backward
        return self.out(torch.tanh(self.mid(torch.tanh(self.hidden(x))))).squeeze(1)


def make_net(slow=0.0):
    torch.manual_seed(7)
    return Net(slow)


# A tiny bucket cap gives several buckets, so "the last bucket" is a real choice.
model = torch.nn.parallel.DistributedDataParallel(make_net(PER_SAMPLE), bucket_cap_mb=0.0005)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=B, adjust_every=3, deadband=0.0,
                                  min_batch_size=2, tune_split=tune_split)
# Deterministic size changes at steps 1 and 2, as a resumed checkpoint schedules them.
cb.load_state_dict({"version": 1, "global_batch_size": B, "num_ranks": size, "step": 0,
                    "epoch": 0, "batch_sizes": [8, 8, 8],
                    "changes": [(1, [4, 10, 10]), (2, [12, 6, 6])]})
sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=5, drop_last=drop_last)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers)

log, grads, sizes_seen, epoch_indices = [], [], [], []
cb.on_train_begin()
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    cb.on_epoch_begin(epoch)
    seen = []
    for x, y, idx in loader:
        cb.on_batch_begin()
        assert len(idx) == cb.batch_sizes_at(cb.step)[rank], (len(idx), cb.batch_sizes_at(cb.step))
        sizes_seen.append(cb.batch_sizes_at(cb.step))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        cb.on_batch_end()
        log.append(idx.tolist())
        seen.extend(idx.tolist())
    cb.on_epoch_end(epoch)
    epoch_indices.append(seen)
cb.on_train_end()

# omnihvd's communicator, not dist.all_gather_object: its works are held past exit
# (omnihvd.comm.hold_past_exit), so the ranks that exit while rank 0 replays cannot
# abort in gloo's teardown race.
comm = TorchDistComm()
all_logs = comm.allgather_object(log)
all_epochs = comm.allgather_object(epoch_indices)
final = [p.detach().clone() for p in model.parameters()]
if rank == 0:
    for e in range(EPOCHS):  # 1. every sample once per epoch
        union = sorted(i for r in range(size) for i in all_epochs[r][e])
        assert len(union) == len(set(union)), "epoch %d repeated a sample" % e
        expect = (N // B) * B if drop_last else N
        assert len(union) == expect, (e, len(union), expect)
    ref = make_net()  # 2. one process, the union of each step's samples
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    worst_grad = 0.0
    for s in range(len(log)):
        ref_opt.zero_grad()
        idx = torch.tensor([i for r in range(size) for i in all_logs[r][s]])
        torch.nn.functional.mse_loss(ref(X[idx]), Y[idx]).backward()
        worst_grad = max([worst_grad] + [float((g - p.grad).abs().max())
                                         for g, p in zip(grads[s], ref.parameters())])
        ref_opt.step()
    worst_param = max(float((a - b.detach()).abs().max()) for a, b in zip(final, ref.parameters()))
    distinct = sorted({tuple(v) for v in sizes_seen})
    result = {"steps": len(log), "max_grad_diff": worst_grad, "max_param_diff": worst_param,
              "distinct_sizes": distinct, "adjustments": cb.adjustments,
              "decisions": len(cb.history), "final_sizes": cb.batch_sizes,
              "horovod_imported": sys.modules.get("horovod") is not None}
    print("DDP-RESULT " + json.dumps(result), flush=True)
    assert worst_grad <= 1e-12 and worst_param <= 1e-12, result
    assert len(distinct) >= 3, result     # the scheduled changes really happened
    assert cb.adjustments >= 1, result    # and the controller moved the sizes
    print("DDP-OK", flush=True)
dist.destroy_process_group()
