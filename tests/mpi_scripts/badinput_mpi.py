"""Bad input that only several ranks can show. Run by tests/test_bad_input.py.

Usage: badinput_mpi.py   (under mpirun -np 3)

1. Timing garbage on one rank must not move the batch sizes.

Three equally fast ranks, global batch 24, so the split stays [8, 8, 8] unless
something moves it; adjustments every 8 steps, the default dead band (0.01) and
timing summary "median" (the default is "sustained"). The step times the callback sees are injected, not
measured: on a shared 2-core machine measured times vary by more than the dead band,
which would make the test flaky, and what is under test is what the callback, the
gather and the controller do with the numbers. A StepTimer subclass reports, for
every step of every rank, the time of a rank of speed 1 (10 ms + 5 ms per sample),
except on rank 1, one kind of garbage per window (a window ends the step before the
one that gathers and decides: steps 7, 15, 23 and 31):

    window 1 (steps 0-6)    step 4 takes 100x as long
    window 2 (steps 7-14)   NaN, -1, 0 and +inf at steps 10, 12, 13 and 14
    window 3 (steps 15-22)  NaN at every step
    window 4 (steps 23-30)  step 26 takes 1/100 as long

A control run repeats window 1 with ``timing="mean"``: there the 100x step must
move the sizes, or the test could not tell robust timing from an injection that
did nothing.

Rank 0 prints ``TIMING {"median": history, "mean": history}`` (cb.history as JSON).

2. Ranks resumed from different checkpoints (each rank loads a callback state of
another step) must all raise at ``on_train_begin``, not train inconsistently. Each
rank prints ``RANK r ERROR <type>: <message>`` (or ``RANK r NO ERROR``).
"""
import json
import math
import sys

import torch
import horovod.torch as hvd

import omnihvd
from omnihvd.timing import StepTimer

B, ADJUST = 24, 8
INJECT = {4: lambda t: 100 * t,
          10: lambda t: math.nan, 12: lambda t: -1.0, 13: lambda t: 0.0, 14: lambda t: math.inf,
          **{s: (lambda t: math.nan) for s in range(15, 23)},
          26: lambda t: t / 100}


def step_time(batch_size):
    return 0.010 + 0.005 * batch_size


class InjectedTimer(StepTimer):
    """A StepTimer whose local() (what the callback records) reports ``value`` (set
    before each step) instead of the clock."""

    value = None

    def local(self):
        measured = super().local()
        return None if measured is None else self.value


def run(timing, steps):
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=ADJUST,
                                   timing=timing)
    timer = cb._timer = InjectedTimer()  # the callback has no public way to take a timing
    x, y = torch.randn(B, 6), torch.randn(B, 1)
    cb.on_train_begin()
    while cb.step < steps:
        b = cb.batch_size
        cb.on_batch_begin()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[:b]), y[:b]).backward()
        timer.value = step_time(b)
        if rank == 1 and cb.step in INJECT:
            timer.value = INJECT[cb.step](timer.value)
        opt.step()
        cb.on_batch_end()
    cb.on_train_end()
    return cb.history


def mismatched_checkpoints(what):
    """``what``: "step" (each rank another step) or "changes" (one step, but rank 1
    has another scheduled split and rank 2 another measured history)."""
    rank = hvd.rank()
    model = torch.nn.Linear(6, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B)
    state = {"global_batch_size": B, "num_ranks": 3, "step": 10 + rank, "batch_sizes": [8, 8, 8]}
    if what == "changes":
        slower = 0.1 * (rank == 2)
        state.update(step=10, changes=[(12, [10, 7, 7] if rank == 1 else [9, 8, 7])],
                     controller={"sizes": [[8, 8, 8]], "times": [[0.1, 0.1, 0.1 + slower]]})
    cb.load_state_dict(state)
    tag = "ERROR" if what == "step" else "CHANGES-ERROR"
    try:
        cb.on_train_begin()
        line = "RANK %d NO %s\n" % (rank, tag)
    except ValueError as exc:
        line = "RANK %d %s %s: %s\n" % (rank, tag, type(exc).__name__, exc)
    sys.stdout.write(line)  # one write: print() writes the text and its newline apart
    sys.stdout.flush()


def main():
    hvd.init()
    torch.set_num_threads(1)
    histories = {"median": run("median", 4 * ADJUST),  # decisions at steps 8, 16, 24, 32
                 "mean": run("mean", ADJUST)}          # the first decision only
    if hvd.rank() == 0:
        print("TIMING " + json.dumps(histories), flush=True)
    mismatched_checkpoints("step")
    mismatched_checkpoints("changes")


if __name__ == "__main__":
    main()
