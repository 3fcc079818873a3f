"""The drop-in path on real ranks: a loop that calls no omnihvd, Horovod or DDP.

Run by tests/test_balancer_mpi.py under mpirun (BACKEND hvd) or torchrun (ddp). The
loop is Horovod's imagenet example's: it takes its rank's batch from
``bal.loader(...)``, cuts it into sub-batches of SUB samples, divides each loss by
their number and accumulates (Horovod: ``backward_passes_per_step=2``; DDP: the
sub-batches before the last under ``model.no_sync()``), allreduces a metric inside
the step (before ``opt.step()``) and steps. The ranks start from an unequal split
(6, 4 and 2 sub-batches) and are slowed by known factors inside their model's forward
pass, so the controller moves the sizes on from there.

After every step each rank checks its gradient against one process over the whole
global batch (the union of every rank's samples, gathered), float64, tolerance
1e-12; each epoch must hand out every sample exactly once. Rank 0 prints
``BALANCER-OK`` with what the run saw.

Usage: balancer_loop.py BACKEND OP SUB WORKERS [DEVICE]
  BACKEND: hvd | ddp; OP: average | sum (Horovod's op; DDP: average);
  SUB: the sub-batch size (every share a multiple of it: size_multiple=SUB);
  WORKERS: the loader's worker processes; DEVICE: cpu (default) or cuda (every rank
  on the one GPU, DDP over gloo: benchmarks/gpu_checks.sh), or one device per rank,
  comma-separated and repeated cyclically: ``cuda,cpu,cpu`` puts rank 0 on the GPU
  and ranks 1 and 2 on the CPU (a mixed world: benchmarks/gpu_horovod.sh).
"""
import contextlib
import copy
import json
import math
import sys
import time

import torch

import omnihvd

backend, op_name, SUB, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
devices = (sys.argv[5] if len(sys.argv) > 5 else "cpu").split(",")
torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)

if backend == "hvd":
    import horovod.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    def gather(obj):
        return hvd.allgather_object(obj)

    def metric(value):   # Horovod's examples' Metric.update, once per step
        return hvd.allreduce(value, name="train_loss")
else:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()

    def gather(obj):
        out = [None] * size
        dist.all_gather_object(out, obj)
        return out

    def metric(value):
        value = value.clone()
        dist.all_reduce(value)
        return value / size

device = torch.device(devices[rank % len(devices)])   # this rank's
B, D, N, EPOCHS = 8 * SUB * size // 2, 5, 0, 2
N = 10 * B + SUB * size          # ten full steps and a partial one of SUB per rank
SLOW = [0.0004, 0.0012, 0.0024][:size]   # seconds per sample in the forward pass
gen = torch.Generator().manual_seed(7)
X = torch.randn(N, D, generator=gen)
Y = (X @ torch.randn(D, 1, generator=gen)).squeeze(1) + 0.1 * torch.randn(N, generator=gen)
dataset = torch.utils.data.TensorDataset(torch.arange(N), X, Y)


class Net(torch.nn.Module):
    def __init__(self, slow=0.0):
        super().__init__()
        self.hidden, self.out, self.slow = torch.nn.Linear(D, 8), torch.nn.Linear(8, 1), slow

    def forward(self, x):
        time.sleep(self.slow * len(x))   # this rank's speed: work inside its model
        return self.out(torch.tanh(self.hidden(x))).squeeze(1)


torch.manual_seed(0)
net = Net(SLOW[rank]).to(device)
if backend == "hvd":
    op = hvd.Sum if op_name == "sum" else hvd.Average
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05),
                                   named_parameters=net.named_parameters(), op=op,
                                   backward_passes_per_step=2)
    model = net
else:
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

# --- the README's lines -------------------------------------------------------------
START = [B // 2, B // 3, B - B // 2 - B // 3] if size == 3 else None   # 6, 4, 2 sub-batches
bal = omnihvd.Balancer(model, opt, global_batch_size=B, initial_batch_sizes=START,
                       size_multiple=SUB, adjust_every=3, advanced={"deadband": 0.0})
loader = bal.loader(dataset, num_workers=workers)
# -------------------------------------------------------------------------------------


def reference_grads(params, idx):
    """One process over the whole global batch of the step."""
    ref = Net().to(device)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), params):
            p.copy_(q)
    loss = torch.nn.functional.mse_loss(ref(X[idx].to(device)), Y[idx].to(device))
    return torch.autograd.grad(loss, list(ref.parameters()))


passes_seen, worst, steps, sizes_seen = set(), 0.0, 0, set()
for epoch in range(EPOCHS):
    loader.sampler.set_epoch(epoch)
    used = []
    for idx, x, y in loader:                      # the training loop: no omnihvd call
        x, y = x.to(device), y.to(device)
        before = [p.detach().clone() for p in net.parameters()]
        opt.zero_grad()
        chunks = math.ceil(len(x) / SUB)
        for i in range(0, len(x), SUB):           # sub-batches of SUB samples
            sync = i + SUB >= len(x) or backend == "hvd"
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = torch.nn.functional.mse_loss(model(x[i:i + SUB]), y[i:i + SUB])
                loss.div_(chunks)
                loss.backward()
        metric(loss.detach())                     # a collective inside the step
        opt.step()
        grads = [p.grad.detach().clone() for p in net.parameters()]
        everyone = gather(idx.tolist())
        union = [i for part in everyone for i in part]
        ref = reference_grads(before, union)
        err = max(float((g - r).abs().max() / r.abs().max().clamp(min=1e-300))
                  for g, r in zip(grads, ref))
        worst = max(worst, err)
        if err > 1e-12:
            raise SystemExit("rank %d step %d: gradient off by %.3g (sizes %s)"
                             % (rank, steps, err, [len(p) for p in everyone]))
        passes_seen.add(tuple(math.ceil(len(p) / SUB) for p in everyone))
        sizes_seen.add(tuple(len(p) for p in everyone))
        used.extend(union)
        steps += 1
    if sorted(used) != list(range(N)):
        raise SystemExit("epoch %d: samples not each used once (%d used, %d distinct)"
                         % (epoch, len(used), len(set(used))))
bal.close()
placed = gather(str(device))
if rank == 0:
    print("BALANCER-OK " + json.dumps({
        "steps": steps, "worst": worst, "sizes": sorted(sizes_seen), "devices": placed,
        "unequal_passes": sum(len(set(p)) > 1 for p in passes_seen)}), flush=True)
