"""Asynchronous mode end to end: every update applied exactly once, balancing moves sizes.

Usage::

    async_exact.py NUM_SERVERS [--balance] [--speeds 1,1,3] [--loader WORKERS]

Each worker's "gradient" is a constant ``c_w`` (a power of two per worker, no
dependence on the parameters), so the final parameters are fully determined by the
sequence of applied updates: every server replays its own update log in float32 and
must land bit-for-bit on the parameters it holds, and the workers' final model must
equal the servers' shards. Workers run different numbers of steps (so they finish at
different times) and sleep ``batch * 2 ms / speed`` per step (emulated speeds).
With ``--loader``, workers take their batches from ``AsyncBatchSampler`` through a
DataLoader with that many loader processes (which cut batches ahead of the loop, at
older sizes) over a small dataset (epochs end in short batches), and every push must
be weighted by the size of the batch it came from.
Prints ``ASYNC-OK ...`` on rank 0 when every check passes.
"""
import argparse
import time

import numpy as np
import torch
from mpi4py import MPI

from omnihvd.asynchronous import AsyncBatchSampler, AsyncOmniLearnCallback

LR = 0.5
B = 48


def main():
    p = argparse.ArgumentParser()
    p.add_argument("num_servers", type=int)
    p.add_argument("--balance", action="store_true")
    p.add_argument("--speeds", default="1,1,3")
    p.add_argument("--idle", type=int, default=-1,
                   help="this worker enters and leaves `with cb:` without training")
    p.add_argument("--loader", type=int, default=None,
                   help="batches from AsyncBatchSampler through a DataLoader with this many "
                        "loader processes")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    torch.manual_seed(rank)  # different on every rank: rank 0's values must win
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    cb = AsyncOmniLearnCallback(model, global_batch_size=B, lr=LR, num_servers=args.num_servers,
                                balance=args.balance, adjust_every=2, settle_steps=1,
                                policy="proportional", deadband=0.05, idle_timeout=120)
    speeds = [float(s) for s in args.speeds.split(",")]
    if len(speeds) != cb.num_workers:
        raise SystemExit("--speeds needs %d values" % cb.num_workers)
    numel = cb.numel
    init = np.empty(numel, np.float32)
    if rank == 0:
        init[:] = torch.cat([q.detach().reshape(-1) for q in model.parameters()]).numpy()
    world.Bcast(init, root=0)

    with cb:
        if cb.is_server:
            report = cb.serve()
            lo, hi = cb.bounds[rank], cb.bounds[rank + 1]
            replay = init[lo:hi].copy()
            log = report["log"]
            for w, b, scale in zip(log["worker"], log["batch_size"], log["scale"]):
                c = np.float32(2.0 ** -(w - cb.num_servers))
                replay -= np.float32(LR * scale * (b / B)) * np.full(hi - lo, c, np.float32)
            assert np.array_equal(replay, cb._core.params), "server %d: replay differs" % rank
            result = {"report": {k: v for k, v in report.items() if k != "log"},
                      "shard": cb._core.params.copy(), "per_worker": {
                          w: log["worker"].count(w) for w in cb.workers}}
        elif cb.worker_index == args.idle:
            result = None   # leaving `with cb:` tells the servers it is done
        else:
            w = cb.worker_index
            steps = 12 + 10 * w  # workers finish at different times
            cb.on_train_begin()
            trained = []   # each push's batch size
            for step, batch in zip(range(steps), batches(cb, args.loader)):
                cb.on_batch_begin(step)
                for q in model.parameters():
                    q.grad = torch.full_like(q, 2.0 ** -w)
                time.sleep(batch * 0.002 / speeds[w])
                # Without a loader the last batch is a short one (as drop_last=False's
                # is): logs["size"] says so, and the servers' replay below checks its
                # b / B weight.
                logs = ({"size": max(1, batch // 2)} if step == steps - 1 and args.loader is None
                        else None)
                trained.append(logs["size"] if logs else batch)
                cb.on_batch_end(step, logs)
            pushed = [h["batch_size"] for h in cb.history]
            assert pushed == trained, "pushes weighted %s, batches %s" % (pushed, trained)
            cb.on_train_end()
            final = torch.cat([q.detach().reshape(-1) for q in model.parameters()]).numpy()
            result = {"pushes": steps, "final": final.copy(), "sizes": [h["batch_size"] for h in cb.history]}

    if result is None:
        final = torch.cat([q.detach().reshape(-1) for q in model.parameters()]).numpy()
        result = {"pushes": 0, "final": final.copy(), "sizes": []}
    everything = world.gather(result, root=0)
    if rank == 0:
        servers = everything[:cb.num_servers]
        workers = everything[cb.num_servers:]
        shards = np.concatenate([s["shard"] for s in servers])
        for i, w in enumerate(workers):
            assert np.array_equal(w["final"], shards), "worker %d final model differs" % i
            for s in servers:  # each server applied each worker's pushes exactly once
                assert s["per_worker"][cb.num_servers + i] == w["pushes"], (s["per_worker"], i)
        assert not np.array_equal(shards, init)
        rep = servers[0]["report"]
        assert rep["updates"] == sum(w["pushes"] for w in workers)
        staleness = rep["staleness"]
        print("ASYNC-OK updates=%d staleness=%s final_sizes=%s decisions=%d first_sizes=%s"
              % (rep["updates"], staleness, rep["batch_sizes"], len(rep["decisions"]),
                 [w["sizes"][:3] for w in workers]), flush=True)
        if args.balance:
            sizes = rep["batch_sizes"]
            fastest = int(np.argmax(speeds))
            assert any(d["changed"] for d in rep["decisions"]), rep["decisions"]
            if args.loader is not None:   # loader processes on these 2 cores: only noise
                return
            assert all(sizes[fastest] > sizes[i] for i in range(len(sizes)) if speeds[i] < speeds[fastest]), sizes
            print("ASYNC-BALANCED sizes=%s" % sizes, flush=True)


def batches(cb, loader_workers):
    """The size of each batch this worker trains, for ever."""
    if loader_workers is None:
        while True:
            yield cb.batch_size
    sampler = AsyncBatchSampler(50, cb, seed=0, drop_last=False)
    loader = torch.utils.data.DataLoader(range(50), batch_sampler=sampler,
                                         num_workers=loader_workers)
    for epoch in range(10 ** 6):
        sampler.set_epoch(epoch)
        for x in loader:
            yield len(x)


if __name__ == "__main__":
    main()
