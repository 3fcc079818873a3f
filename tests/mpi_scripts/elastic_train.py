"""A plain Horovod elastic training loop whose world shrinks from 3 to 2 and grows back.

Run by tests/test_elastic.py under::

    horovodrun -np 3 --min-np 2 --max-np 3 --network-interface lo \
        --host-discovery-script "cat HOSTS_FILE" python elastic_train.py HOSTS_FILE

Rank 0 drives the membership: at step ``--shrink-at`` it writes ``localhost:2`` to
HOSTS_FILE (Horovod then removes worker localhost[2]); ``--grow-after`` steps after
the world has shrunk it writes ``localhost:3`` (Horovod starts a new worker). With
``--kill-at S`` the worker on host ``--kill-host`` instead dies by SIGKILL at step S
(Horovod then blacklists that host, so give it a host name of its own). Every
step each worker takes its slice of the step's B samples of one global order, as
split by omnihvd.elastic.ElasticBatchSplit, and weights its loss by n*b_i/B, so the
averaged gradient is that of the whole global batch. At the end rank 0 replays the
same steps in one process and prints ``RESULT {json}`` with the largest parameter
difference: any sample lost, repeated or mis-weighted across the changes shows there.
"""
import argparse
import json
import os
import signal
import time

import torch
import horovod.torch as hvd

from omnihvd.elastic import ElasticBatchSplit

N, D = 4800, 8
# Emulated compute cost per sample (seconds) by worker slot: heterogeneous workers.
COST = {"0": 0.0004, "1": 0.0008, "2": 0.0016}


def dataset():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, D, generator=g)
    y = x @ torch.randn(D, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)
    return x, y


def order(epoch):
    return torch.randperm(N, generator=torch.Generator().manual_seed(100 + epoch))


def step_indices(step, B):
    epoch, j = divmod(step, N // B)
    return order(epoch)[j * B:(j + 1) * B]


def new_model():
    torch.manual_seed(0)
    return torch.nn.Linear(D, 1)


def reference(steps, B, lr):
    x, y = dataset()
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for s in range(steps):
        idx = step_indices(s, B)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    return model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("hosts_file")
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--shrink-at", type=int, default=None)
    p.add_argument("--grow-after", type=int, default=30)
    p.add_argument("--min-steps", type=int, default=150)
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--kill-at", type=int, default=None,
                   help="the worker on host --kill-host kills itself (SIGKILL) at this step")
    p.add_argument("--kill-host", default="127.0.0.1")
    args = p.parse_args()
    B = args.global_batch

    hvd.init()
    slot = os.environ.get("HOROVOD_LOCAL_RANK", "0")
    x, y = dataset()
    model = new_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                   named_parameters=model.named_parameters())
    split = ElasticBatchSplit(B)
    # ``log``: (first step, sizes) of every split in use; a tuple, so that Horovod's
    # commit/restore snapshot it (a list would be shared, not copied).
    state = hvd.elastic.TorchState(model, opt, step=0, log=(), done=False)
    split.attach(state)
    plan = {"shrunk_at": None, "grown": False}    # rank 0's own bookkeeping

    @hvd.elastic.run
    def train(state):
        sizes = split.begin(state.step)
        print("worker %s: rank %d of %d from step %d, sizes %s"
              % (slot, hvd.rank(), hvd.size(), state.step, sizes), flush=True)
        if not state.log or list(state.log[-1][1]) != sizes:
            state.log = state.log + ((state.step, tuple(sizes)),)
        while not state.done:
            b = split.batch_size
            idx = step_indices(state.step, B)[split.offset:split.offset + b]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx]) * (hvd.size() * b / B)
            loss.backward()
            time.sleep(COST.get(slot, 0.001) * b)
            split.observe(b, time.perf_counter() - t0)
            if state.step == args.kill_at and os.environ.get("HOROVOD_HOSTNAME") == args.kill_host:
                print("rank %d on %s: killing itself at step %d"
                      % (hvd.rank(), args.kill_host, state.step), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            state.step += 1
            if hvd.rank() == 0 and args.shrink_at is not None:
                drive_membership(state, plan, args)
            # Every worker must agree on when to stop: rank 0 decides.
            finished = state.step >= args.min_steps and (
                args.shrink_at is None or (plan["grown"] and hvd.size() == 3))
            state.done = hvd.broadcast_object(
                hvd.rank() == 0 and (finished or state.step >= args.max_steps),
                root_rank=0, name="done")
            state.commit()

    train(state)
    if hvd.rank() == 0:
        ref = reference(state.step, B, args.lr)
        with torch.no_grad():
            diff = max(float((a - b).abs().max()) for a, b in
                       zip(model.parameters(), ref.parameters()))
        print("RESULT " + json.dumps({"steps": state.step, "log": state.log,
                                      "history": split.history, "max_param_diff": diff}),
              flush=True)


def drive_membership(state, plan, args):
    if plan["shrunk_at"] is None and state.step == args.shrink_at:
        write_hosts(args.hosts_file, 2)
        plan["shrunk_at"] = -1
    elif plan["shrunk_at"] == -1 and hvd.size() == 2:
        plan["shrunk_at"] = state.step
    elif (not plan["grown"] and plan["shrunk_at"] not in (None, -1)
          and state.step >= plan["shrunk_at"] + args.grow_after):
        write_hosts(args.hosts_file, 3)
        plan["grown"] = True


def write_hosts(path, slots):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("localhost:%d\n" % slots)
    os.replace(tmp, path)    # the discovery script never reads a half-written file
    print("rank 0: discovery now reports localhost:%d (step file %s)" % (slots, path), flush=True)


if __name__ == "__main__":
    main()
