"""One rank raises inside an omnihvd loop whose ``finally:`` calls ``cb.on_train_end()``.

Usage::

    fault_finally.py COMM

COMM is ``horovod`` (the callback's default transport) or ``mpi`` (``comm=
MPI.COMM_WORLD``). Every rank runs a non-daemon thread (a metrics uploader) that stops
only when training ends normally. Rank 1 raises right before ``on_batch_begin()`` of
step 9, a step that gathers (``adjust_every=5``): the other ranks post the gather
there, rank 1 never will. ``on_train_end()`` in the ``finally:`` must neither wait
for that gather nor take the abort-on-exception hook away: the job must end with
``omnihvd: rank 1 raised ...`` (it hung: the hook was gone and the thread kept rank 1
alive; with ``comm=`` the other ranks also waited for the gather for ever).
"""
import sys
import threading
import time

import torch
import horovod.torch as hvd

import omnihvd


def main():
    transport = sys.argv[1]
    comm = None
    if transport == "mpi":
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        hvd.init(comm=comm)
    else:
        hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    B = 8 * size
    data = torch.utils.data.TensorDataset(torch.randn(B * 40, 4), torch.randn(B * 40))
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=5, comm=comm)
    sampler = omnihvd.HeterogeneousBatchSampler(len(data), cb, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    done = threading.Event()
    threading.Thread(target=done.wait, name="uploader").start()
    try:
        cb.on_train_begin()
        for x, y in loader:
            if rank == 1 and cb.step == 9:
                print("rank %d: failing (raise) at step %d, t=%.3f" % (rank, cb.step, time.time()),
                      flush=True)
                raise RuntimeError("injected failure on rank %d at step %d" % (rank, cb.step))
            cb.on_batch_begin()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            opt.step()
            cb.on_batch_end()
        done.set()
    finally:
        cb.on_train_end()


if __name__ == "__main__":
    main()
