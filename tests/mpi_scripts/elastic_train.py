"""The omnihvd drop-in under Horovod elastic: the world shrinks from 3 to 2 and grows back.

Run by tests/test_elastic_cluster.py under::

    horovodrun -np 3 --min-np 2 --max-np 3 --network-interface lo \
        --host-discovery-script "cat HOSTS_FILE" python elastic_train.py HOSTS_FILE

The training loop is the normal one -- OmniLearnCallback, HeterogeneousBatchSampler,
a DataLoader, a plain mean loss (no hand scaling) -- inside ``@hvd.elastic.run`` with
``omnihvd.elastic.TorchState``. Rank 0 drives the membership: at step
``--shrink-at`` it writes ``localhost:2`` to HOSTS_FILE (Horovod then removes worker
localhost[2]); ``--grow-after`` steps after the world has shrunk it writes
``localhost:3`` (Horovod starts a new worker), and the job ends
``--steps-after-growth`` steps after the world is back to 3. With ``--kill-at S`` the worker on
host ``--kill-host`` instead dies by SIGKILL at step S (Horovod then blacklists that
host, so give it a host name of its own). Each worker sleeps in proportion to its
batch (by slot): heterogeneous workers, so the callback rebalances too.

Every step the workers gather the sample ids they trained on into the state (so a
rolled-back step is rolled back there too). At the end rank 0 replays the same
global batches in one process and prints ``RESULT {json}``: the ids of every
step, whether each step's ids are the replay's, the largest parameter difference,
and ``cb.worlds``. A sample lost, repeated or mis-weighted across the changes shows.
"""
import argparse
import json
import os
import signal
import time

import torch
import horovod.torch as hvd

import omnihvd
import omnihvd.elastic

N, D, SEED = 2400, 8, 100
# Emulated compute cost per sample (seconds) by worker slot: heterogeneous workers.
COST = {"0": 0.0004, "1": 0.0008, "2": 0.0016}


def dataset():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, D, generator=g)
    y = x @ torch.randn(D, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)
    return torch.utils.data.TensorDataset(torch.arange(N), x, y)


def new_model():
    torch.manual_seed(0)
    return torch.nn.Linear(D, 1)


def reference(steps, B, lr):
    """One process, the whole global batch of every step: the same sampler order."""
    data = dataset()
    model = new_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sampler = omnihvd.HeterogeneousBatchSampler(N, omnihvd.StaticSchedule([B]), seed=SEED)
    batches = []
    epoch = 0
    while len(batches) < steps:
        sampler.set_epoch(epoch)
        batches += list(sampler)
        epoch += 1
    for idx in batches[:steps]:
        _, x, y = data[idx]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, batches[:steps]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("hosts_file")
    p.add_argument("--global-batch", type=int, default=48)
    p.add_argument("--shrink-at", type=int, default=None)
    p.add_argument("--grow-after", type=int, default=30)
    p.add_argument("--steps-after-growth", type=int, default=20,
                   help="steps the world of 3 trains after it has grown back")
    p.add_argument("--min-steps", type=int, default=150)
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--adjust-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--kill-at", type=int, default=None,
                   help="the worker on host --kill-host kills itself (SIGKILL) at this step")
    p.add_argument("--kill-host", default="127.0.0.1")
    args = p.parse_args()
    B = args.global_batch

    hvd.init()
    slot = os.environ.get("HOROVOD_LOCAL_RANK", "0")
    data = dataset()
    model = new_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                   named_parameters=model.named_parameters())
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B,
                                   adjust_every=args.adjust_every)
    sampler = omnihvd.HeterogeneousBatchSampler(N, cb, seed=SEED)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    # ``used``: (step, sizes, ids of the global batch) of every step; a tuple, so that
    # Horovod's commit/restore snapshot it (a list would be shared, not copied).
    state = omnihvd.elastic.TorchState(model, opt, callback=cb, epoch=0, used=(), done=False)
    plan = {"shrunk_at": None, "grown": False, "regrown_at": None}   # rank 0's own

    @hvd.elastic.run
    def train(state):
        cb.on_train_begin()
        print("worker %s: rank %d of %d from step %d, sizes %s"
              % (slot, hvd.rank(), hvd.size(), cb.step, cb.batch_sizes), flush=True)
        while not state.done:
            sampler.set_epoch(state.epoch)
            cb.on_epoch_begin(state.epoch)
            for ids, x, y in loader:
                cb.on_batch_begin((ids, x, y))
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                with cb.working():   # emulated speed: work, after the backward pass
                    time.sleep(COST.get(slot, 0.001) * len(ids))
                if cb.step == args.kill_at and os.environ.get("HOROVOD_HOSTNAME") == args.kill_host:
                    print("rank %d on %s: killing itself at step %d"
                          % (hvd.rank(), args.kill_host, cb.step), flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                opt.step()
                step, sizes = cb.step, cb.batch_sizes
                cb.on_batch_end()
                every = hvd.allgather_object(ids.tolist(), name="ids")
                state.used = state.used + ((step, sizes, sum(every, [])),)
                if hvd.rank() == 0 and args.shrink_at is not None:
                    drive_membership(cb.step, plan, args)
                # Every worker must agree on when to stop: rank 0 decides.
                finished = cb.step >= args.min_steps and (
                    args.shrink_at is None or (plan["regrown_at"] is not None and cb.step
                                               >= plan["regrown_at"] + args.steps_after_growth))
                state.done = hvd.broadcast_object(
                    hvd.rank() == 0 and (finished or cb.step >= args.max_steps),
                    root_rank=0, name="done")
                state.commit()
                if state.done:
                    break
            else:
                state.epoch += 1
        cb.on_train_end()

    train(state)
    if hvd.rank() == 0:
        ref, batches = reference(cb.step, B, args.lr)
        with torch.no_grad():
            diff = max(float((a - b).abs().max()) for a, b in
                       zip(model.parameters(), ref.parameters()))
        used = [list(u) for u in state.used]
        print("RESULT " + json.dumps({
            "steps": cb.step, "used": used, "steps_per_epoch": N // B, "num_samples": N,
            "same_batches": [u[2] for u in used] == batches and
                            [u[0] for u in used] == list(range(cb.step)),
            "worlds": cb.worlds, "adjustments": cb.adjustments,
            "max_param_diff": diff}), flush=True)


def drive_membership(step, plan, args):
    if plan["shrunk_at"] is None and step == args.shrink_at:
        write_hosts(args.hosts_file, 2)
        plan["shrunk_at"] = -1
    elif plan["shrunk_at"] == -1 and hvd.size() == 2:
        plan["shrunk_at"] = step
    elif (not plan["grown"] and plan["shrunk_at"] not in (None, -1)
          and step >= plan["shrunk_at"] + args.grow_after):
        write_hosts(args.hosts_file, 3)
        plan["grown"] = True
    elif plan["grown"] and plan["regrown_at"] is None and hvd.size() == 3:
        plan["regrown_at"] = step


def write_hosts(path, slots):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("localhost:%d\n" % slots)
    os.replace(tmp, path)    # the discovery script never reads a half-written file
    print("rank 0: discovery now reports localhost:%d (step file %s)" % (slots, path), flush=True)


if __name__ == "__main__":
    main()
