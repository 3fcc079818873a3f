"""Train, checkpoint mid-epoch and die; or resume from that checkpoint. Run by tests/test_resume.py.

Usage::

    resume_train.py OUT (--sizes 4,8,12 | --speeds 1,2,4) [--workers W]
                    [--crash-at K | --resume CKPT [--uninterrupted-first]]

A small float64 MLP learns the first N Fashion-MNIST test images (global batch B,
two epochs, ``drop_last=False`` so each epoch ends with a partial step) with
OmniLearnCallback + HeterogeneousBatchSampler, and the checkpoint a user would
write: model, optimizer, ``cb.state_dict()``, ``sampler.state_dict()``.

* ``--sizes``: fixed per-rank sizes (``initial_batch_sizes``, never adjusted), so an
  interrupted and an uninterrupted run take identical steps.
* ``--speeds``: emulated relative speeds (omnihvd.tools.emulate, model mode); the
  controller moves the sizes every 3 steps. ``--workers``: DataLoader workers, which
  prefetch, so a decision is scheduled a few steps ahead (and may be pending in the
  checkpoint).
* ``--crash-at K``: after global step K, rank 0 writes OUT/ckpt.pt (the checkpoint)
  and OUT/before.pt (every rank's log so far), then rank 1 SIGKILLs itself; the
  others go on into step K+1 and wait there until mpirun ends the job (non-zero).
* ``--resume CKPT``: load the checkpoint, possibly on another number of ranks, and
  train to the end; OUT/result.pt. ``--uninterrupted-first``: before that, train
  the same configuration from scratch to the end in this job; OUT/uninterrupted.pt.

Logs, gathered on rank 0: per rank, a list of ``(global step, epoch, sizes of every
rank, this rank's sample indices)``; with the final parameters and ``cb.history``.
"""
import argparse
import os
import signal

import torch
import horovod.torch as hvd

import omnihvd
from omnihvd.tools.data import fashion_mnist
from omnihvd.tools.emulate import Emulator

N, B, EPOCHS, SEED = 245, 24, 2, 3


def save(obj, path):
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a reader never sees half a file


def train(args, dataset, resume=None, crash_at=None):
    """One training run from scratch (or from the checkpoint ``resume``)."""
    rank = hvd.rank()
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 12), torch.nn.Tanh(),
                                torch.nn.Linear(12, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters())
    if args.sizes:
        options = dict(initial_batch_sizes=[int(b) for b in args.sizes.split(",")],
                       adjust_every=10 ** 9)
    else:
        options = dict(adjust_every=3)
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, **options)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=SEED, drop_last=False)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=args.workers)
    emu = Emulator(args.speeds, rank, sample_cost=0.002) if args.speeds else None

    first_epoch = 0
    if resume:
        state = torch.load(resume, weights_only=False)
        model.load_state_dict(state["model"])
        # The Horovod optimizer, not the torch one it wraps: it holds the momentum.
        opt.load_state_dict(state["optimizer"])
        cb.load_state_dict(state["omnihvd"])
        sampler.load_state_dict(state["sampler"])
        first_epoch = state["sampler"]["epoch"]

    log = []
    cb.on_train_begin()
    for epoch in range(first_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        cb.on_epoch_begin(epoch)
        for xb, yb, idx in loader:
            cb.on_batch_begin()
            if emu:
                emu.start(cb.step)
            sizes = cb.batch_sizes_at(cb.step)
            assert len(idx) == sizes[rank], (len(idx), sizes, rank)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            if emu:
                with cb.working():   # the emulated speed: work, after the backward pass
                    emu.finish(len(idx))
            opt.step()
            log.append((cb.step, epoch, sizes, idx.tolist()))
            cb.on_batch_end()
            if cb.step == crash_at:
                crash(args.out, model, opt, cb, sampler, log)
        cb.on_epoch_end(epoch)
    cb.on_train_end()
    return {"logs": hvd.allgather_object(log), "history": cb.history, "world": hvd.size(),
            "params": [t.detach().clone() for t in model.parameters()]}


def crash(out, model, opt, cb, sampler, log):
    """Write the checkpoint on rank 0, then rank 1 dies as a crashing machine would."""
    checkpoint = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                  "omnihvd": cb.state_dict(), "sampler": sampler.state_dict()}
    logs = hvd.allgather_object(log)
    if hvd.rank() == 0:
        save(checkpoint, os.path.join(out, "ckpt.pt"))
        save({"logs": logs, "history": cb.history}, os.path.join(out, "before.pt"))
        # said before the barrier: once rank 1 dies mpirun kills the others, and a rank 0
        # descheduled between the barrier and a print after it never printed (3 ranks on 2
        # cores beside Horovod's polling threads), failing the test's check of this line
        print("rank 0: checkpoint written after step %d" % cb.step, flush=True)
    hvd.barrier()  # the files are complete, and said so, before anyone dies
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--sizes", help="fixed per-rank batch sizes, summing to %d" % B)
    how.add_argument("--speeds", help="emulated per-rank speeds; the sizes are rebalanced")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--crash-at", type=int, help="checkpoint after this global step, then die")
    p.add_argument("--resume", help="checkpoint to resume from")
    p.add_argument("--uninterrupted-first", action="store_true")
    args = p.parse_args()

    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    hvd.init()
    x, y = fashion_mnist("test", limit=N).tensors
    dataset = torch.utils.data.TensorDataset(x.double(), y, torch.arange(N))
    runs = []
    if args.uninterrupted_first:
        runs.append(("uninterrupted.pt", None))
    runs.append(("result.pt", args.resume))
    for name, resume in runs:
        result = train(args, dataset, resume=resume, crash_at=args.crash_at)
        if hvd.rank() == 0:
            save(result, os.path.join(args.out, name))
            print("RESUME-TRAIN %s: %d steps, %d size changes"
                  % (name, result["logs"][0][-1][0] + 1, sum(h["changed"] for h in result["history"])),
                  flush=True)


if __name__ == "__main__":
    main()
