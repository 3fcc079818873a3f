"""A million steps in one process: the callback's memory and per-step work stay flat.

The callback's hooks are driven directly (no model step, no Horovod collective) in
a simulated world of 3 ranks: Horovod's rank and size are patched for the test
only, and a fake communicator answers each gather with rows for all 3 ranks whose
step times follow speeds that swap every few adjustments -- so the sizes keep
changing all run long, and every change adds to the schedule and the history.

Flat memory, two ways: the deep size of the callback's own state is the same at
200k, 600k and 1M steps; and tracemalloc, over the last 100k steps, sees no growth
of the memory allocated in that stretch and still alive (before the fix, each
decision's record stayed). Flat per-step cost, without timing anything: the
structures a step scans -- the size schedule, the issued-steps map, the history,
the controller's rounds -- keep a bounded length.
"""
import gc
import sys
import tracemalloc
import types

import numpy as np
import pytest
import torch

import horovod.torch as hvd
import omnihvd
from omnihvd.comm import PendingGather

pytestmark = pytest.mark.single

RANKS, B, ADJUST, STEPS, KEEP = 3, 60, 1000, 1_000_000, 20
SPEEDS = ([1.0, 2.0, 4.0], [4.0, 1.0, 2.0])  # samples per ms, swapped every 2 decisions


class FakeWorld:
    """Rank 0's communicator in a world of 3: the other ranks report the same
    bookkeeping as rank 0 and step times ``sizes / speeds``."""

    rank, size = 0, RANKS

    def __init__(self):
        self.gathers = 0
        self.sizes = None  # set by the test: a callable giving the current split

    def allgather(self, values):
        row = np.asarray(values, dtype=np.float64)
        rows = np.tile(row, (RANKS, 1))
        speeds = SPEEDS[(self.gathers // 2) % 2]
        self.gathers += 1
        sizes = np.asarray(self.sizes(), dtype=np.float64)
        rows[:, 0] = 1e-3 * (0.5 + sizes / np.asarray(speeds))  # time
        rows[:, 2] = sizes                                      # size measured at
        rows[:, 5] = B                                          # memory cap
        rows[:, 6] = 0.0                                        # standard error
        return rows

    def iallgather(self, values):
        result = self.allgather(values)
        return PendingGather(lambda: result)

    def allgather_object(self, obj):
        return [obj] * RANKS


@pytest.fixture
def world(monkeypatch):
    hvd.init()
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    monkeypatch.setattr(hvd, "size", lambda: RANKS)
    monkeypatch.setattr(hvd, "rank", lambda: 0)
    comm = FakeWorld()
    cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=B, adjust_every=ADJUST,
                                   settle_steps=0, comm=comm, abort_on_exception=False,
                                   history_size=KEEP)
    comm.sizes = lambda: cb.cadence.window_sizes or cb.batch_sizes
    return cb, (model, opt, comm)


def bounded_state(cb):
    return (len(cb.schedule._changes), len(cb.schedule._issued), len(cb.history),
            len(cb.controller._sizes))


def deep_size(root, skip):
    """Bytes of every object reachable from ``root``, not through ``skip``."""
    seen = {id(o) for o in skip}
    stack, total = [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType,
                                               types.BuiltinFunctionType)):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def test_a_million_steps_keep_memory_and_per_step_work_flat(world):
    cb, outside = world
    cb.on_train_begin()
    sizes, traced = {}, {}
    for step in range(1, STEPS + 1):
        cb.issue(cb.step + 1, B)  # a sampler prefetching one step ahead
        cb.on_batch_begin()
        cb.on_batch_end()
        if step % 100_000 == 0:
            assert bounded_state(cb) <= (3, 2, KEEP, 8), (step, bounded_state(cb))
        if step in (200_000, 600_000, STEPS):
            sizes[step] = (deep_size(cb, outside), bounded_state(cb))
        if step == STEPS - 100_000:
            tracemalloc.start()
        if step in (STEPS - 50_000, STEPS):
            traced[step] = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    cb.on_train_end()
    assert cb.step == STEPS and sum(cb.batch_sizes) == B
    # the sizes really kept moving: without pruning, each change stays in the schedule
    assert cb.adjustments > STEPS // ADJUST // 4, cb.adjustments
    assert len(cb.history) == KEEP and cb.history[-1]["step"] == STEPS
    (b1, s1), (b2, s2), (b3, s3) = (sizes[k] for k in sorted(sizes))
    assert max(b1, b2, b3) - min(b1, b2, b3) < 2048, (sizes, s1, s2, s3)
    # 50 decisions (about 25 changes) later, no more memory allocated since is alive
    t1, t2 = (traced[k] for k in sorted(traced))
    assert t2 - t1 < 16 * 1024, traced
