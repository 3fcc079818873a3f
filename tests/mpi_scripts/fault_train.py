"""A plain Horovod training loop in which one rank fails at a given step.

Usage::

    fault_train.py MODE FAIL_RANK FAIL_STEP [--abort-on-exception] [--steps N]
                   [--mpi4py] [--where compute|mpi4py] [--worker-thread all|failing]

MODE is ``raise`` (the rank raises RuntimeError), ``kill`` (the rank sends itself
SIGKILL), ``hang`` (the rank stops, alive, in a non-collective wait) or ``none``.
Every rank prints ``rank R: ...`` lines; the failing one prints the wall-clock time
of the failure so a test can measure the time from failure to job exit.
"""
import argparse
import os
import signal
import threading
import time

import torch
import horovod.torch as hvd


def inject(mode, rank, step):
    print("rank %d: failing (%s) at step %d, t=%.3f" % (rank, mode, step, time.time()),
          flush=True)
    if mode == "raise":
        raise RuntimeError("injected failure on rank %d at step %d" % (rank, step))
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        threading.Event().wait()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["raise", "kill", "hang", "none"])
    p.add_argument("fail_rank", type=int)
    p.add_argument("fail_step", type=int)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--abort-on-exception", action="store_true",
                   help="install omnihvd.faults.install_abort_on_exception() after hvd.init")
    p.add_argument("--mpi4py", action="store_true",
                   help="also do an mpi4py allreduce after each step")
    p.add_argument("--where", choices=["compute", "mpi4py"], default="compute",
                   help="fail in the compute part of the step (the others then wait in "
                        "Horovod's allreduce) or just before the mpi4py allreduce")
    p.add_argument("--worker-thread", choices=["all", "failing"],
                   help="run a non-daemon background thread (like a metrics uploader) that "
                        "stops only when training ends normally, on all ranks or the failing one")
    args = p.parse_args()

    hvd.init()
    rank = hvd.rank()
    handle = None
    if args.abort_on_exception:
        from omnihvd.faults import install_abort_on_exception
        handle = install_abort_on_exception(rank)
    comm = None
    if args.mpi4py:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    done = threading.Event()
    if args.worker_thread == "all" or (args.worker_thread == "failing"
                                       and rank == args.fail_rank):
        threading.Thread(target=done.wait, name="uploader").start()
    print("rank %d: started pid %d" % (rank, os.getpid()), flush=True)
    for step in range(args.steps):
        fail = rank == args.fail_rank and step == args.fail_step
        if fail and args.where == "compute":
            inject(args.mode, rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if fail and args.where == "mpi4py":
            inject(args.mode, rank, step)
        if comm is not None:
            comm.allreduce(step)
        time.sleep(0.01)
    done.set()
    if handle is not None:
        handle.remove()
    print("rank %d: finished %d steps" % (rank, args.steps), flush=True)


if __name__ == "__main__":
    main()
