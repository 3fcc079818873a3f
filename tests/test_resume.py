"""Checkpoint, kill, resume under a real mpirun, compared with an uninterrupted run.

tests/mpi_scripts/resume_train.py trains a small float64 MLP on 3 ranks with
OmniLearnCallback + HeterogeneousBatchSampler, writes the user's checkpoint (model,
optimizer, ``cb.state_dict()``, ``sampler.state_dict()``) mid-epoch after step K and
then loses a rank to SIGKILL, which ends the job. A new mpirun resumes from that
checkpoint. Every rank logs, per step, the sizes of all ranks and its own sample
indices, so the tests can check the whole run against the epoch's global order:

* with fixed sizes, the interrupted run takes exactly the steps of an uninterrupted
  one and ends with bit-identical parameters;
* with the sizes rebalanced (emulated speeds 1:2:4) and resumed on 3 or on 2 ranks,
  every step is a valid split of the same global batch at the same position of the
  epoch, and every sample is used exactly once per epoch across the crash.
"""
import os

import pytest
import torch

from mpirun import mpirun
from omnihvd.sampler import HeterogeneousBatchSampler, StaticSchedule

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_scripts", "resume_train.py")
N, B, EPOCHS, SEED = 245, 24, 2, 3          # as in resume_train.py
STEPS_PER_EPOCH = N // B + 1                 # 10 full steps and a partial one of N % B
# One allreduce per tensor (no fusion), so the reduction order cannot depend on timing
# and the interrupted and uninterrupted runs can be compared bit for bit.
ENV = {"HOROVOD_FUSION_THRESHOLD": "0"}
pytestmark = pytest.mark.mpi


def load(path):
    return torch.load(path, weights_only=False)


def crash_run(out, *args, crash_at):
    """Run to step ``crash_at``, checkpoint, lose rank 1; return the checkpointed logs."""
    proc = mpirun(3, SCRIPT, out, *args, "--crash-at", crash_at, env=ENV, check=False,
                  timeout=300)
    assert proc.returncode != 0, "the job survived the SIGKILL of rank 1:\n" + proc.stdout[-3000:]
    assert "rank 0: checkpoint written after step %d" % crash_at in proc.stdout, proc.stdout[-3000:]
    assert "process rank 1" in proc.stdout and "signal 9" in proc.stdout, proc.stdout[-3000:]
    assert not os.path.exists(os.path.join(out, "result.pt"))  # it really did not finish
    return load(os.path.join(out, "before.pt"))


def steps_of(logs):
    """{global step: (epoch, sizes, [indices of rank 0, 1, ...])}, checking ranks agree."""
    table = {}
    for rank, log in enumerate(logs):
        assert [s for s, *_ in log] == [s for s, *_ in logs[0]], "ranks ran different steps"
        for step, epoch, sizes, indices in log:
            table.setdefault(step, (epoch, sizes, []))
            assert table[step][:2] == (epoch, sizes), "ranks disagree on step %d" % step
            table[step][2].append(indices)
    return table


def epoch_order(epoch):
    sampler = HeterogeneousBatchSampler(N, StaticSchedule([B]), seed=SEED)
    sampler.set_epoch(epoch)
    return sampler.order().tolist()


def check_run(*segments):
    """Every step of the run, over the crash, against the epochs' global orders."""
    table = {}
    for logs in segments:
        part = steps_of(logs)
        assert not set(part) & set(table), "a step ran twice across the resume"
        table.update(part)
    assert sorted(table) == list(range(EPOCHS * STEPS_PER_EPOCH)), "steps skipped or extra"
    orders = [epoch_order(e) for e in range(EPOCHS)]
    for step, (epoch, sizes, indices) in table.items():
        position = step - epoch * STEPS_PER_EPOCH            # same position in the epoch
        assert 0 <= position < STEPS_PER_EPOCH, (step, epoch)
        total = B if position < N // B else N % B
        assert sum(sizes) == total and min(sizes) >= 1, (step, sizes)  # a valid split
        assert len(indices) == len(sizes), (step, sizes)
        first = position * B
        for rank, got in enumerate(indices):
            begin = first + sum(sizes[:rank])
            assert got == orders[epoch][begin:begin + sizes[rank]], (step, rank)
    for epoch in range(EPOCHS):
        used = [i for s, (e, _, ix) in table.items() if e == epoch for part in ix for i in part]
        assert sorted(used) == list(range(N)), "epoch %d: a sample repeated or skipped" % epoch
    return table


# ------------------------------------------------------------------ fixed sizes


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("resume_fixed"))
    before = crash_run(out, "--sizes", "4,8,12", crash_at=15)       # epoch 1, step 4 of 11
    proc = mpirun(3, SCRIPT, out, "--sizes", "4,8,12", "--resume", os.path.join(out, "ckpt.pt"),
                  "--uninterrupted-first", env=ENV, timeout=300)
    assert "RESUME-TRAIN result.pt" in proc.stdout, proc.stdout[-3000:]
    return (load(os.path.join(out, "ckpt.pt")), before, load(os.path.join(out, "result.pt")),
            load(os.path.join(out, "uninterrupted.pt")))


def test_checkpoint_holds_the_position_sizes_and_momentum(fixed):
    state, before, _, _ = fixed
    assert [len(log) for log in before["logs"]] == [15, 15, 15]
    assert state["omnihvd"]["step"] == 15 and state["omnihvd"]["batch_sizes"] == [4, 8, 12]
    assert (state["sampler"]["epoch"], state["sampler"]["step_in_epoch"]) == (1, 15 - STEPS_PER_EPOCH)
    assert state["optimizer"]["state"], "the checkpoint lacks the optimizer's momentum"


def test_resumed_run_equals_the_uninterrupted_run_bit_for_bit(fixed):
    _, before, resumed, uninterrupted = fixed
    # the same steps: same sizes and the same samples on every rank
    check_run(uninterrupted["logs"])
    table = check_run(before["logs"], resumed["logs"])
    assert table == steps_of(uninterrupted["logs"])
    assert resumed["logs"][0][0][:2] == (15, 1)  # resumed at step 15, in epoch 1
    for got, want in zip(resumed["params"], uninterrupted["params"]):
        assert torch.equal(got, want), float((got - want).abs().max())


# ----------------------------------------------------------------- rebalancing


CRASH = 5


@pytest.fixture(scope="module")
def balanced(tmp_path_factory):
    # Crash at step 5: the first decision (at step 4) moved the sizes, and with
    # DataLoader workers prefetching it takes effect a few steps later, so the
    # checkpoint holds a scheduled change that the resumed run must apply.
    out = str(tmp_path_factory.mktemp("resume_balanced"))
    before = crash_run(out, "--speeds", "1,2,4", "--workers", "2", crash_at=CRASH)
    state = load(os.path.join(out, "ckpt.pt"))["omnihvd"]
    assert state["changes"], "no change was pending at the checkpoint: %s" % state
    return out, before, state


@pytest.mark.parametrize("ranks,speeds", [(3, "1,2,4"), (2, "1,3")])
def test_rebalanced_run_resumed_on_3_or_2_ranks_uses_each_sample_once(balanced, ranks, speeds):
    out, before, state = balanced
    result_dir = os.path.join(out, "on%d" % ranks)
    os.makedirs(result_dir)
    mpirun(ranks, SCRIPT, result_dir, "--speeds", speeds, "--workers", "2",
           "--resume", os.path.join(out, "ckpt.pt"), env=ENV, timeout=300)
    resumed = load(os.path.join(result_dir, "result.pt"))
    assert resumed["world"] == ranks
    table = check_run(before["logs"], resumed["logs"])
    assert resumed["logs"][0][0][:2] == (CRASH, 0)
    assert all(len(table[s][1]) == ranks for s in range(CRASH, EPOCHS * STEPS_PER_EPOCH))
    if ranks == 3:   # the same world: the checkpoint's sizes, then its scheduled change
        assert table[CRASH][1] == state["batch_sizes"]
        (first, sizes), = state["changes"]
        assert all(table[s][1] == state["batch_sizes"] for s in range(CRASH, first))
        assert table[first][1] == sizes
    else:            # another world: an equal split of the same global batch, then rebalanced
        assert table[CRASH][1] == [12, 12]
        assert any(h["changed"] for h in resumed["history"]), "no rebalancing after the resume"
