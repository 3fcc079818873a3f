"""Asynchronous mode under faults: one rank misbehaves, the job must end promptly.

Usage::

    async_fail.py MODE NUM_SERVERS

MODE:
  raise       worker 1 raises RuntimeError at its 3rd step (inside ``with cb:``)
  bad_shape   worker 1 pushes a gradient shard of the wrong length
  duplicate   worker 1 sends the same PUSH twice (same sequence number)
  options     the last rank passes another global_batch_size (error at construction)
  model       the last rank builds another model (error at construction)
  interrupt   worker 1 raises KeyboardInterrupt (Ctrl-C) at its 3rd step
  exit        worker 1 calls sys.exit(0) at its 3rd step
  raise_noabort  as raise, with abort_on_exception=False: the servers give up after
              their idle_timeout (3 s) and tell the workers, who raise too

Healthy workers run thousands of 5 ms steps (tens of seconds), so a job that does
not abort promptly runs into the test's mpirun timeout. Construction errors are
printed as ``rank R: ERROR <type>: <message>`` and the script exits normally.
"""
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from omnihvd.asynchronous import AsyncOmniLearnCallback
from omnihvd.asynchronous.protocol import PUSH, encode
from omnihvd.errors import OmniHvdError


def main():
    mode, num_servers = sys.argv[1], int(sys.argv[2])
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    last = rank == size - 1
    width = 4 if (mode == "model" and last) else 3
    model = torch.nn.Sequential(torch.nn.Linear(5, width), torch.nn.Linear(width, 2))
    batch = 40 if (mode == "options" and last) else 32
    try:
        noabort = mode == "raise_noabort"
        cb = AsyncOmniLearnCallback(model, global_batch_size=batch, lr=0.01,
                                    num_servers=num_servers, balance=False,
                                    idle_timeout=3 if noabort else 300,
                                    abort_on_exception=not noabort)
    except OmniHvdError as exc:
        # One write per line: ranks' output must not interleave within a line.
        sys.stdout.write("rank %d: ERROR %s: %s\n" % (rank, type(exc).__name__, exc))
        sys.stdout.flush()
        return
    with cb:
        if cb.is_server:
            cb.serve()
            return
        cb.on_train_begin()
        x, y = torch.randn(8, 5), torch.randn(8, 2)
        for step in range(40 if noabort else 4000):
            cb.on_batch_begin()
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            time.sleep(0.005)
            if cb.worker_index == 1 and step == 2:
                print("rank %d: misbehaving (%s) at t=%.3f" % (rank, mode, time.time()), flush=True)
                inject(mode, cb)
            cb.on_batch_end()
        cb.on_train_end()


def inject(mode, cb):
    client = cb._client
    server = cb.servers[0]
    n = cb.bounds[1] - cb.bounds[0]
    header = dict(seq=client.pushes, version=client.versions[0], batch_size=cb.batch_size)
    if mode in ("raise", "raise_noabort"):
        raise RuntimeError("injected failure in worker %d" % cb.worker_index)
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "exit":
        sys.exit(0)
    if mode == "bad_shape":
        cb._link.send(server, encode(PUSH, cb.rank, np.zeros(n - 3, np.float32), **header))
    elif mode == "duplicate":
        header["seq"] = client.pushes - 1
        cb._link.send(server, encode(PUSH, cb.rank, np.zeros(n, np.float32), **header))
    time.sleep(60)  # the server must abort the job; never reached otherwise


if __name__ == "__main__":
    main()
