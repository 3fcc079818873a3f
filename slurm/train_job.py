"""A small, complete omnihvd training job, run by the Slurm templates in this folder.

It trains a small classifier on a synthetic data set (seeded, the same on every
rank) through omnihvd's public contract -- ``OmniLearnCallback`` and
``HeterogeneousBatchSampler`` under ``hvd.DistributedOptimizer`` -- and prints what
a user (and tests/test_slurm.py) wants to see in the job log:

* one ``omnihvd-job: rank=...`` line per rank (rank, world size, node, restart count);
* ``omnihvd-job: step=...`` progress lines from rank 0;
* one ``omnihvd-job: decision ...`` line per balancing decision (``cb.history``);
* a last ``omnihvd-job: result {json}`` line from rank 0.

Checkpoint and resume (for slurm/checkpoint_requeue.sbatch): with ``--checkpoint
PATH``, SIGUSR1 (sent by Slurm's ``--signal`` before the time limit) makes every
rank stop at the same step; rank 0 saves the model, the optimizer, the callback's and
the sampler's state to PATH, and every rank exits with status 85, which the batch
script answers with ``scontrol requeue``. A requeued run (``SLURM_RESTART_COUNT`` > 0,
or a run outside Slurm) that finds PATH resumes from it; a first run ignores one (a
job id that a fresh Slurm controller gave out again). ``--resume FILE`` resumes from
FILE in any case (a resubmission where Slurm refused the requeue). Every rank must see PATH: a
rank that does not see it while another does is an error on every rank. SIGUSR1 is
caught from the script's first line on; anything else in the job step that gets it
(a wrapper script, a DataLoader worker started by "spawn" or "forkserver") must
ignore it, since Slurm signals every process of the step.

Emulated heterogeneity, for demonstrations and tests on identical (virtual) nodes:
``--ms-per-sample 1 --slow-nodes n2 --slowdown 3`` makes every rank sleep 1 ms per
sample of its batch, and the ranks on node n2 three times as long (``--slow-ranks``
picks ranks instead of nodes). The sleep comes before ``opt.step()``, where omnihvd
counts a rank's compute time, so omnihvd shifts work away from the slow ranks.

Replace this file with your own training script; keep the checkpoint contract above
if you use checkpoint_requeue.sbatch.
"""
import signal

# Caught before the slow imports below: the signal may come while they run, and its
# default action ends the process (and with it the requeue).
STOP = {"requested": False}
signal.signal(signal.SIGUSR1, lambda signum, frame: STOP.update(requested=True))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import omnihvd  # noqa: E402
from omnihvd.controller import DEFAULT_DEADBAND  # noqa: E402

REQUEUE_EXIT = 85  # "checkpoint written; requeue me" (common.sh's OMNIHVD_REQUEUE_EXIT)
PREFIX = "omnihvd-job:"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="global steps to train (default 40)")
    p.add_argument("--global-batch-size", type=int, default=128)
    p.add_argument("--samples", type=int, default=4096, help="synthetic data set size")
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--adjust-every", type=int, default=5, help="steps between rebalancing")
    p.add_argument("--deadband", type=float, default=DEFAULT_DEADBAND)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--checkpoint", help="checkpoint file: resume from it if present, "
                   "write it on SIGUSR1 and exit %d" % REQUEUE_EXIT)
    p.add_argument("--resume", help="resume from this checkpoint, whatever the restart count "
                   "(a resubmission of a job whose requeue was refused)")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds every rank sleeps per step (stretches a demo job)")
    p.add_argument("--ms-per-sample", type=float, default=0.0,
                   help="emulated compute: milliseconds each rank sleeps per sample")
    p.add_argument("--slow-nodes", default="",
                   help="comma-separated node names whose ranks are --slowdown times slower")
    p.add_argument("--slow-ranks", default="", help="comma-separated ranks, likewise")
    p.add_argument("--slowdown", type=float, default=3.0)
    return p.parse_args(argv)


def synthetic_data(samples, features, classes=10, seed=0):
    """A fixed, learnable classification set: labels from a random linear map."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    w = torch.randn(features, classes, generator=g)
    return TensorDataset(x, (x @ w).argmax(dim=1))


def node_name():
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def emit(text):
    # One write per line: mpirun tags every write with the rank, so a line written
    # in pieces would be split in the log.
    sys.stdout.write("%s %s\n" % (PREFIX, text))
    sys.stdout.flush()


def main(argv=None):
    args = parse_args(argv)
    stop = STOP

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    node = node_name()
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    slow = node in args.slow_nodes.split(",") or str(rank) in args.slow_ranks.split(",")
    emulated_per_sample = args.ms_per_sample / 1000.0 * (args.slowdown if slow else 1.0)

    # one GPU per rank where there are GPUs (--gpus-per-node with one rank per GPU)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    dataset = synthetic_data(args.samples, args.features)
    model = nn.Sequential(nn.Linear(args.features, 64), nn.ReLU(),
                          nn.Linear(64, 10)).to(device)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                   named_parameters=model.named_parameters())
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=args.global_batch_size,
                                   adjust_every=args.adjust_every, deadband=args.deadband)
    sampler = omnihvd.HeterogeneousBatchSampler(len(dataset), cb, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler)

    resumed_from = None
    source = args.resume or args.checkpoint
    if resume_from(source, restart, rank, size, asked=bool(args.resume)):
        # Every rank reads the same file (a shared file system), so all agree.
        state = torch.load(source, weights_only=False, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        cb.load_state_dict(state["callback"])
        sampler.load_state_dict(state["sampler"])
        resumed_from = cb.step
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)

    nodes = hvd.allgather_object(node)
    emit("rank=%d size=%d node=%s restart=%d slow=%s" % (rank, size, node, restart, slow))
    if rank == 0 and resumed_from is not None:
        emit("resumed step=%d batch_sizes=%s epoch=%d from %s"
             % (resumed_from, list(cb.batch_sizes), sampler.epoch, source))

    loss_fn = nn.CrossEntropyLoss()
    first_loss = last_loss = None
    checkpointed = False
    cb.on_train_begin()
    epoch = sampler.epoch
    while cb.step < args.steps and not checkpointed:
        sampler.set_epoch(epoch)
        cb.on_epoch_begin(epoch)
        for x, y in loader:
            cb.on_batch_begin()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            # Emulated slowness, spent before opt.step() inside cb.working(): omnihvd
            # counts it as this rank's compute, though it comes after the backward pass.
            if emulated_per_sample:
                with cb.working():
                    time.sleep(emulated_per_sample * len(y))
            opt.step()
            cb.on_batch_end()
            last_loss = hvd.allreduce(loss.detach(), name="omnihvd_job.loss").item()
            first_loss = last_loss if first_loss is None else first_loss
            if rank == 0 and (cb.step % args.log_every == 0 or cb.step == args.steps):
                emit("step=%d loss=%.4f batch_sizes=%s" % (cb.step, last_loss, list(cb.batch_sizes)))
            if args.step_sleep:
                time.sleep(args.step_sleep)
            # The signal reaches ranks at different moments: agree on this step.
            flags = hvd.allreduce(torch.tensor([float(stop["requested"])]), op=hvd.Sum,
                                  name="omnihvd_job.stop")
            if flags.item() > 0 and args.checkpoint:
                cb.on_train_end()  # settles an in-flight gather on every rank
                save_checkpoint(args.checkpoint, model, opt, cb, sampler, rank)
                checkpointed = True
                break
            if cb.step >= args.steps:
                break
        else:
            cb.on_epoch_end(epoch)
            epoch += 1

    cb.on_train_end()
    if checkpointed:
        sys.stdout.flush()
        sys.exit(REQUEUE_EXIT)
    # CPU seconds of each rank's process (start-up included): the job's real cost
    # on a shared machine, where wall time mostly measures the neighbours.
    cpu_seconds = hvd.allgather_object(round(time.process_time(), 2))
    if rank == 0:
        decisions = report_decisions(cb)
        sizes_by_node = {}
        for r, n in enumerate(nodes):
            sizes_by_node.setdefault(n, []).append(int(cb.batch_sizes[r]))
        emit("result " + json.dumps({
            "world_size": size, "nodes": nodes, "steps": int(cb.step),
            "batch_sizes": [int(b) for b in cb.batch_sizes], "sizes_by_node": sizes_by_node,
            "decisions": decisions, "first_loss": first_loss, "last_loss": last_loss,
            "restart": restart, "resumed_from": resumed_from, "cpu_seconds": cpu_seconds}))
    return 0


def resume_from(path, restart, rank, size, asked=False) -> bool:
    """Whether this run resumes from the checkpoint ``path`` (the same answer on every
    rank): ``asked`` (--resume), or a requeued run (or one outside Slurm) that finds
    it; only if every rank sees it."""
    requeued = asked or restart > 0 or "SLURM_JOB_ID" not in os.environ
    found = bool(path) and os.path.exists(path)
    if asked and not found:
        raise SystemExit("%s --resume %s: no such file on rank %d" % (PREFIX, path, rank))
    if found and not requeued and rank == 0:
        emit("ignoring %s: this job was not requeued (restart 0), so it is not this job's "
             "checkpoint (a job id given out again); starting from step 0" % path)
    seen = int(hvd.allreduce(torch.tensor([float(found)]), op=hvd.Sum,
                             name="omnihvd_job.checkpoint_seen").item())
    if 0 < seen < size:
        raise SystemExit("%s %d of %d ranks see the checkpoint %s: put OMNIHVD_CKPT_DIR on a "
                         "file system every node sees" % (PREFIX, seen, size, path))
    return found and requeued


def save_checkpoint(path, model, opt, cb, sampler, rank):
    """Rank 0 writes the checkpoint atomically; every rank waits until it is on disk."""
    if rank == 0:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                 "callback": cb.state_dict(), "sampler": sampler.state_dict()}
        tmp = path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
        emit("checkpoint step=%d batch_sizes=%s epoch=%d to %s"
             % (cb.step, list(cb.batch_sizes), sampler.epoch, path))
    hvd.barrier()


def report_decisions(cb):
    """Print the balancing decisions that changed the sizes; return their count."""
    count = 0
    for entry in cb.history:
        if not entry.get("changed"):
            continue
        count += 1
        emit("decision step=%s times_ms=%s sizes=%s -> new_sizes=%s" % (
            entry["step"], [round(1000 * float(t), 2) for t in entry["times"]],
            [int(b) for b in entry["sizes"]], [int(b) for b in entry["new_sizes"]]))
    return count


if __name__ == "__main__":
    sys.exit(main())
