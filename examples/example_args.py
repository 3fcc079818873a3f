"""What the two Fashion-MNIST examples (Horovod and DDP) share: their command-line
options, the plain-mode loader, the resume, the slowdown, the per-epoch line and the
opt-in step anatomy (:class:`StepAnatomy`).

Kept apart from both so that the DDP example needs no Horovod import; the omnihvd
lines of the training loop stay in each example, where a reader looks for them.
"""
import argparse
import json
import os
import time

import torch

from omnihvd.tools.cli import positive

MODES = ("omnihvd", "tuned", "plain", "fixed")


def balancer_options(args) -> dict:
    """``omnihvd.Balancer``'s keyword options for ``--mode`` (any mode but plain)."""
    if args.mode == "fixed":   # the given sizes, never adjusted: no adjustment step is reached
        return dict(initial_batch_sizes=args.split, adjust_every=2 ** 62)
    options = dict(advanced={"tune_split": True}) if args.mode == "tuned" else {}
    if args.start_split is not None:
        options["initial_batch_sizes"] = args.start_split
    return options


def positive_list(kind):
    """An argparse type: comma-separated values of ``kind`` > 0 (``128,64,64``)."""
    one = positive(kind)
    return lambda text: [one(v) for v in text.split(",")]


def writable_path(text):
    """An argparse type: a file path whose folder exists (checked before training)."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError("the folder %r does not exist" % folder)
    return text


def parse_args(description):
    """Parse and check the examples' options (``--mode``, ``--split``, ``--steps``, ...)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=positive(int), default=1)
    p.add_argument("--global-batch-size", type=positive(int), default=256)
    p.add_argument("--lr", type=positive(float), default=0.05)
    p.add_argument("--limit", type=positive(int), default=None,
                   help="use only the first N training images")
    p.add_argument("--steps", type=positive(int), default=None,
                   help="epochs of this many steps (the first steps*global-batch-size images)")
    p.add_argument("--mode", choices=MODES, default="omnihvd")
    p.add_argument("--split", type=positive_list(int), default=None,
                   help="--mode fixed: per-rank sizes, e.g. 128,64,64")
    p.add_argument("--start-split", type=positive_list(int), default=None,
                   help="--mode omnihvd or tuned: start from these sizes, not the equal split")
    p.add_argument("--slowdown", type=positive_list(float), default=None,
                   help="per-rank slowdown factors, e.g. 1,1,2,4")
    p.add_argument("--checkpoint", type=writable_path, default=None)
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the model's initial weights and the order of the training data")
    args = p.parse_args()
    if args.steps is not None:
        args.limit = args.steps * args.global_batch_size
    if (args.mode == "fixed") != (args.split is not None):
        p.error("--split goes with --mode fixed, and --mode fixed needs --split")
    if args.start_split is not None and args.mode not in ("omnihvd", "tuned"):
        p.error("--start-split goes with --mode omnihvd or tuned (--mode fixed takes --split)")
    if args.checkpoint and args.mode == "plain":
        p.error("--checkpoint needs omnihvd's sampler (--mode omnihvd, tuned or fixed) to "
                "resume mid-training")
    return args


def plain_loader(train, global_batch_size, rank, size, seed=0):
    """``--mode plain``: equal batches from a DistributedSampler, no omnihvd at all."""
    if global_batch_size % size:
        raise SystemExit("--mode plain splits --global-batch-size %d equally: make it a "
                         "multiple of the %d ranks" % (global_batch_size, size))
    sampler = torch.utils.data.distributed.DistributedSampler(
        train, num_replicas=size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    loader = torch.utils.data.DataLoader(train, batch_size=global_batch_size // size,
                                         sampler=sampler, drop_last=True)
    return sampler, loader


def resume(path, net, opt, bal, loader, map_location=None) -> int:
    """Load ``--checkpoint`` when it exists; returns the epoch to start from. ``bal``:
    the ``omnihvd.Balancer`` (None in plain mode), ``loader`` its loader."""
    if not (path and os.path.exists(path)):
        return 0
    state = torch.load(path, weights_only=False, map_location=map_location)
    net.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    if bal is None:
        return 0
    bal.load_state_dict(state["omnihvd"])           # omnihvd: sizes, time model, place
    done = len(loader) == 0                         # saved at the epoch's end
    return state["omnihvd"]["sampler"]["epoch"] + (1 if done else 0)


def slow_down(model, args, rank):
    """``--slowdown``: this rank's model runs that many times slower. Each forward pass
    sleeps, inside the pass as a slower device would take longer, (factor - 1) times
    three times its own duration (the forward and the backward pass it leads to)."""
    factors = args.slowdown
    factor = factors[rank % len(factors)] if factors else 1.0
    if factor <= 1:
        return
    began = []
    model.register_forward_pre_hook(lambda module, inputs: began.append(time.perf_counter()))
    model.register_forward_hook(lambda module, inputs, output: time.sleep(
        (factor - 1) * 3 * (time.perf_counter() - began.pop())))


def end_epoch(args, epoch, seconds, accuracy, omni, loader, net, opt, rank, size):
    """Rank 0 prints the epoch's line (benchmarks/realhet.py reads it) and saves
    ``--checkpoint``. ``omni``: the ``omnihvd.Balancer`` (or a callback; None in plain
    mode)."""
    if rank != 0:
        return
    sizes = omni.batch_sizes if omni is not None else [loader.batch_size] * size
    cb = getattr(omni, "callback", omni)
    overhead = 1000 * cb.overhead_per_step if cb is not None else 0.0
    print("epoch %d: %.3f s, test accuracy %.3f, batch sizes %s, overhead %.2f ms/step"
          % (epoch, seconds, accuracy, sizes, overhead), flush=True)
    if getattr(args, "checkpoint", None):
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                    "omnihvd": None if omni is None else omni.state_dict()}, args.checkpoint)


ANATOMY_ENV = "OMNIHVD_EXAMPLE_ANATOMY"


class StepAnatomy:
    """Where each step's time goes on this rank, for ``benchmarks/step_anatomy.py``.

    Off (every method does nothing) unless the environment variable
    ``OMNIHVD_EXAMPLE_ANATOMY`` names a folder. Then, per step, it keeps the batch's
    samples, omnihvd's local time (``cb.last_step_time``), the loop body before
    ``opt.step()`` (forward, backward, the callback's ``on_batch_begin``), the time
    inside ``opt.step()`` (waiting for the other ranks, the allreduce, the update) and
    the period from this step's start to the next one's; at the end of each epoch it
    writes them to ``FOLDER/anatomy-MODE[-SPLIT]-JOB-eEPOCH-rRANK.json``. JOB is the
    launcher's job id (``PMIX_NAMESPACE``, else the parent process: one ``mpirun`` on
    one node), so that the ranks of one run share it.
    """

    def __init__(self, args, rank):
        self.folder = os.environ.get(ANATOMY_ENV) or None
        split = "-" + "_".join(map(str, args.split)) if args.split else ""
        job = os.environ.get("PMIX_NAMESPACE") or str(os.getppid())
        self._name = "anatomy-%s%s-%s" % (args.mode, split, job)
        self._rank = rank
        self._steps = []
        self._begin = self._entry = self._last_begin = None

    def begin(self):
        """At the top of the loop body, after the loader's ``next()``."""
        if self.folder:
            self._begin = time.perf_counter()

    def before_step(self):
        """Just before ``opt.step()``."""
        if self.folder:
            self._entry = time.perf_counter()

    def after_step(self, samples, cb):
        """Just after ``opt.step()``: record the step."""
        if not self.folder:
            return
        exit_ = time.perf_counter()
        if self._steps:  # the previous step's period ends where this one began
            self._steps[-1]["period_s"] = self._begin - self._last_begin
        self._steps.append({"samples": int(samples),
                            "local_s": None if cb is None else cb.last_step_time,
                            "before_step_s": self._entry - self._begin,
                            "in_step_s": exit_ - self._entry, "period_s": None})
        self._last_begin = self._begin

    def end_epoch(self, epoch):
        """Write the epoch's steps and start over (the next epoch's first period is
        not the loop's: evaluation and the barrier lie between)."""
        if not self.folder:
            return
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, "%s-e%d-r%d.json" % (self._name, epoch, self._rank))
        with open(path, "w") as f:
            json.dump(self._steps, f)
        self._steps, self._last_begin = [], None
