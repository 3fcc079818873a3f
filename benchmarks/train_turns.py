"""omnihvd and fixed splits taking turns by epoch in one Horovod launch.

The training of examples/train_fashion_mnist.py (Fashion-MNIST, the small CNN, SGD
with momentum, Horovod's optimizer), with several ways of splitting the global batch
taking turns: epoch e trains with turn ``e mod k`` of ``--turns``. A turn is
``omnihvd`` (the callback with default options: balancing on, from where its last
epoch left it), ``tuned`` (the same with ``tune_split=True``, the example's ``--mode
tuned``), ``arrivals`` (the same with ``balance_arrivals=True``), ``means`` (the
same with ``balance_arrivals=False``: equal mean local times, the default since
2026-12-04 and so ``omnihvd`` again), a fixed split such as ``26,25,13,192``
(omnihvd's sampler and weighting, balancing off, like the example's ``--mode
fixed``), or ``gathered:`` and a split:
that split held by ``min_batch_size = max_batch_size = split`` while the callback's
windows, gathers and decisions run as with balancing on (what balancing costs apart
from where it puts the split). A balancing turn takes options after colons:
``omnihvd:adjust_every=50:gain=0.5``. Each turn has its own
callback, sampler and loader; a turn's callback is started for its epoch and ended
after it (``on_train_begin``/``on_train_end``), so the model and optimizer go on
while each turn's state waits for its next epoch.

Why: on a shared VM a launch runs in a fast or a slow mode that moves the same
split's time by up to 2x (docs/cpu-quotas.rst); turns in one launch share its mode,
so their times compare within the launch. ``benchmarks/realhet.py --modes alternate``
runs it under real heterogeneity. With ``OMNIHVD_STEP_TIMESTAMPS=FOLDER`` every rank
also records each step's moments there (``benchmarks/release_lags.py``). Rank 0
prints the example's line per epoch::

    mpirun -np 4 python benchmarks/train_turns.py --turns omnihvd/26,25,13,192 \\
        --epochs 8 --steps 100 --global-batch-size 256
"""
import argparse
import logging
import os
import sys
import time

import torch
import torch.nn.functional as F
import horovod.torch as hvd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import omnihvd  # noqa: E402
from omnihvd.tools.data import fashion_mnist  # noqa: E402
from omnihvd.tools.models import SmallCNN  # noqa: E402

from example_args import end_epoch  # noqa: E402
from release_lags import StepTimestamps  # noqa: E402
from train_fashion_mnist import evaluate  # noqa: E402


# turns that balance: their options
BALANCING = {"omnihvd": {}, "tuned": {"tune_split": True},
             "arrivals": {"balance_arrivals": True}, "means": {"balance_arrivals": False}}
GATHERED = "gathered:"


def parse_turns(text):
    """``omnihvd/26,25,13,192`` -> ``["omnihvd", [26, 25, 13, 192]]``.

    >>> parse_turns("omnihvd/tuned/3,1/gathered:3,1/omnihvd:gain=0.5")
    ['omnihvd', 'tuned', [3, 1], 'gathered:3,1', 'omnihvd:gain=0.5']
    """
    return [t if t.split(":")[0] in BALANCING or t.startswith(GATHERED)
            else [int(v) for v in t.split(",")] for t in text.split("/")]


def turn_options(turn):
    """The callback's options for a turn.

    >>> turn_options("gathered:3,1")["max_batch_size"], turn_options([3, 1])["adjust_every"]
    ([3, 1], 4611686018427387904)
    >>> turn_options("arrivals:adjust_every=50:gain=0.5:nonblocking=False")
    {'balance_arrivals': True, 'adjust_every': 50, 'gain': 0.5, 'nonblocking': False}
    """
    if isinstance(turn, list):   # a fixed split: no window ever closes
        return dict(initial_batch_sizes=turn, adjust_every=2 ** 62)
    if turn.startswith(GATHERED):   # the split held by its bounds, windows running
        split = [int(v) for v in turn[len(GATHERED):].split(",")]
        return dict(initial_batch_sizes=split, min_batch_size=split, max_batch_size=split)
    name, *overrides = turn.split(":")   # a balancing turn, options overridden
    options = dict(BALANCING[name])
    for item in overrides:
        key, value = item.split("=")
        options[key] = ({"True": True, "False": False}[value] if value in ("True", "False")
                        else int(value) if value.isdigit() else float(value))
    return options


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", required=True,
                   help="turns joined by /: omnihvd, tuned, arrivals, means (each with "
                        "options after colons, omnihvd:adjust_every=50), a split such as "
                        "26,25,13,192 or gathered:26,25,13,192")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--steps", type=int, required=True, help="steps per epoch")
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args(argv)
    args.turns_text = args.turns.split("/")   # each turn as given, for records
    args.turns = parse_turns(args.turns)
    args.checkpoint = None   # for example_args.end_epoch
    return args


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO if hvd.rank() == 0 else logging.WARNING,
                        format="%(message)s")
    torch.manual_seed(0)
    train = fashion_mnist("train", limit=args.steps * args.global_batch_size)
    test = fashion_mnist("test", limit=2000)
    model = SmallCNN()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    stamps = StepTimestamps(opt, hvd.rank())   # off unless OMNIHVD_STEP_TIMESTAMPS is set

    turns = []
    for turn in args.turns:
        cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=args.global_batch_size,
                                       **turn_options(turn))
        sampler = omnihvd.HeterogeneousBatchSampler(len(train), cb, seed=0)
        turns.append((cb, sampler, torch.utils.data.DataLoader(train, batch_sampler=sampler)))

    for epoch in range(args.epochs):
        cb, sampler, loader = turns[epoch % len(turns)]
        sampler.set_epoch(epoch)
        cb.on_train_begin()
        cb.on_epoch_begin(epoch)
        model.train()
        hvd.barrier()
        t0 = time.perf_counter()
        for x, y in loader:
            stamps.begin(len(y))
            cb.on_batch_begin()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            stamps.before_step()
            opt.step()
            stamps.after_step(cb)
            cb.on_batch_end()
        cb.on_epoch_end(epoch)
        stamps.end_epoch(epoch, args.turns_text[epoch % len(turns)])
        seconds = time.perf_counter() - t0
        cb.on_train_end()   # this turn waits for its next epoch
        end_epoch(args, epoch, seconds, evaluate(model, test), cb, loader, model, opt,
                  hvd.rank(), hvd.size())


if __name__ == "__main__":
    main()
