"""Per-step cost of omnihvd's timing on a CPU: the timer, the CPU-quota floor, the
loader wrapper, and the whole callback's own code per step (one process).

Usage::

    .venv/bin/python benchmarks/timing_cost.py [--steps 200000]

Prints one line per figure (microseconds per step, best of 5 repeats).
"""
import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnihvd.timing import StepTimer, TimedIterable  # noqa: E402


def best(fn, steps, repeats=5):
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(steps)
        out.append((time.perf_counter() - start) / steps)
    return min(out)


def timer_loop(timer):
    def run(steps):
        for _ in range(steps):
            timer.start()
            timer.mark_wait()
            timer.local()
            timer.stop()
    return run


def loader_loop(steps):
    sink = StepTimer()
    for _ in TimedIterable(range(steps), sink.add, restart=sink.discard_extra):
        pass


def bare_loop(steps):
    for _ in range(steps):
        pass


def callback_overhead(steps):
    """Mean seconds per step inside OmniLearnCallback's hooks (its own counter), one
    rank, a 4->1 linear model, adjust_every=20."""
    import torch
    import horovod.torch as hvd

    import omnihvd
    from omnihvd.tools import harness

    hvd.init()
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=8)
    x = torch.randn(8, 4)
    with harness.steps(cb, batches=itertools.repeat(x), max_steps=steps) as run:
        for step in run:
            opt.zero_grad()
            model(step.batch).sum().backward()
            opt.step()
    return cb.overhead_per_step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200000)
    parser.add_argument("--callback-steps", type=int, default=2000)
    args = parser.parse_args(argv)
    plain = best(timer_loop(StepTimer()), args.steps)
    quota = best(timer_loop(StepTimer(cpu_cores=0.5)), args.steps)
    loader = best(loader_loop, args.steps) - best(bare_loop, args.steps)
    print("StepTimer start/mark/local/stop, CPU model (no device sync): %.2f us per step"
          % (1e6 * plain))
    print("... with the CPU-quota floor (process_time twice):            %.2f us per step"
          % (1e6 * quota))
    print("TimedIterable, per next() beyond a bare iterator:             %.2f us per step"
          % (1e6 * loader))
    print("OmniLearnCallback hooks, 1 rank, adjust_every=20:             %.1f us per step"
          % (1e6 * callback_overhead(args.callback_steps)))


if __name__ == "__main__":
    main()
