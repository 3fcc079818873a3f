"""Bad input under a real mpirun: timing garbage on one rank never moves the sizes, and
ranks resumed from different checkpoints all raise (``mpi_scripts/badinput_mpi.py``).
"""
import json
import math
import os
import re

import pytest

from mpirun import mpirun
from omnihvd.errors import RankMismatchError

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_scripts", "badinput_mpi.py")

pytestmark = pytest.mark.mpi


# ---------------------------------------------------------------- under mpirun


@pytest.fixture(scope="module")
def multi_rank():
    return mpirun(3, SCRIPT, timeout=240).stdout


def test_timing_garbage_on_one_rank_never_moves_the_sizes(multi_rank):
    line = [l for l in multi_rank.splitlines() if l.startswith("TIMING ")]
    assert line, multi_rank[-3000:]
    runs = json.loads(line[0][len("TIMING "):])
    median = runs["median"]
    # decided at the end of the step after each window (history counts steps from 1)
    assert [h["step"] for h in median] == [8, 16, 24, 32]
    # every window kept the same split, and every valid sample of rank 1 was counted
    for h in median:
        assert h["sizes"] == h["new_sizes"] == [8, 8, 8] and h["changed"] is False, h
    assert [h["samples"] for h in median] == [[6, 6, 6], [8, 4, 8], [8, 0, 8], [8, 8, 8]]
    # one 100x step (slower or faster) does not reach the summary; nor NaN, -1, 0, inf
    for h in (median[0], median[1], median[3]):
        assert h["times"] == [0.05, 0.05, 0.05] and "skipped" not in h, h
    # a window with no valid sample on a rank is skipped, naming the rank
    assert "rank(s) [1]" in median[2]["skipped"] and math.isnan(median[2]["times"][1])
    # control: the same 100x step under timing="mean" does move the sizes
    mean, = runs["mean"]
    assert mean["changed"] is True and mean["new_sizes"][1] < 8, mean


def test_ranks_resumed_from_different_checkpoints_all_raise(multi_rank):
    # mpirun may splice one rank's line into another's: split at each "RANK r"
    errors = re.findall(r"RANK (\d) ERROR (\w+): (.*?)(?=RANK \d|\n|$)", multi_rank)
    assert sorted(r for r, _, _ in errors) == ["0", "1", "2"], multi_rank[-3000:]
    for _, kind, message in errors:
        assert kind == RankMismatchError.__name__, message
        assert "resume" in message and "rank 0 has (10," in message and "rank 2 has (12," in message


def test_ranks_resumed_with_different_schedules_or_histories_all_raise_at_once(multi_rank):
    # one step, one split, but rank 1 restored another scheduled change and rank 2
    # another measured history: caught at on_train_begin, not steps later
    errors = re.findall(r"RANK (\d) CHANGES-ERROR (\w+): (.*?)(?=RANK \d|\n|$)", multi_rank)
    assert sorted(r for r, _, _ in errors) == ["0", "1", "2"], multi_rank[-3000:]
    for _, kind, message in errors:
        assert kind == RankMismatchError.__name__ and "resume" in message, message
        assert "[(12, [10, 7, 7])]" in message and "[(12, [9, 8, 7])]" in message, message


SAMPLER_SCRIPT = os.path.join(os.path.dirname(SCRIPT), "sampler_diverged.py")


@pytest.mark.parametrize("mode", ["late", "epoch", "resume", "same"])
def test_samplers_that_diverge_after_the_start_are_caught_at_the_next_gather(mode):
    # before: a sampler created after on_train_begin with seed = rank, or set_epoch(epoch
    # + rank), repeated samples silently (73 of 96 distinct); one rank loading a position
    # hung the job
    out = mpirun(2, SAMPLER_SCRIPT, mode, timeout=120).stdout
    lines = re.findall(r"RANK (\d) (NO ERROR|ERROR (\w+): (.*?))(?=RANK \d|\n|$)", out)
    assert sorted(r for r, *_ in lines) == ["0", "1"], out[-3000:]
    for _, verdict, kind, message in lines:
        if mode == "same":
            assert verdict == "NO ERROR", out[-3000:]
        else:
            assert kind == RankMismatchError.__name__ and "training sampler" in message, message
