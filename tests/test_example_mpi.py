"""examples/train_fashion_mnist.py on 3 real ranks in each of its modes. The runs end
on an adjustment step (20 steps, adjust_every 20), so omnihvd's last gather is still
open when the loop ends while ranks evaluate for different times: the first rank to
exit shuts Horovod down on the others, and the gather must not be waited for after
MPI is finalised (it was, and the job died with "MPI_Wait() called after
MPI_FINALIZE")."""
import json
import os
import re
import sys

import pytest
from mpirun import ROOT, mpirun

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import step_anatomy  # noqa: E402

pytestmark = pytest.mark.mpi

EXAMPLE = os.path.join(ROOT, "examples", "train_fashion_mnist.py")
LINE = re.compile(r"^epoch 0: [\d.]+ s, test accuracy [\d.]+, batch sizes \[(.*)\]", re.M)


@pytest.mark.parametrize("mode, sizes", [
    (["--mode", "omnihvd"], None),
    (["--mode", "plain"], [16, 16, 16]),
    (["--mode", "fixed", "--split", "24,12,12"], [24, 12, 12]),
])
def test_example_modes_end_cleanly(mode, sizes):
    proc = mpirun(3, EXAMPLE, "--epochs", "1", "--global-batch-size", "48", "--steps", "20",
                  *mode, timeout=300)
    found = [[int(v) for v in m.split(",")] for m in LINE.findall(proc.stdout)]
    assert len(found) == 1 and sum(found[0]) == 48, proc.stdout[-3000:]
    if sizes is not None:
        assert found[0] == sizes
    assert "MPI_FINALIZE" not in proc.stdout


def test_turns_of_omnihvd_and_a_fixed_split_share_one_launch():
    # benchmarks/train_turns.py (realhet --modes alternate): epoch e trains with turn
    # e mod 3; the fixed turn keeps its split, and so does the gathered one, whose
    # windows close (every 20 steps) with its bounds holding the split; omnihvd keeps
    # the global batch, and the callbacks started and ended around each epoch leave
    # nothing behind at exit.
    proc = mpirun(3, os.path.join(ROOT, "benchmarks", "train_turns.py"), "--turns",
                  "omnihvd/24,12,12/gathered:20,14,14", "--epochs", "6", "--steps", "10",
                  "--global-batch-size", "48", timeout=300)
    ends = re.findall(r"^epoch (\d): [\d.]+ s, test accuracy [\d.]+, batch sizes \[(.*)\]",
                      proc.stdout, re.M)
    sizes = [[int(v) for v in text.split(",")] for _, text in ends]
    assert [int(e) for e, _ in ends] == list(range(6)), proc.stdout[-3000:]
    assert sizes[1] == sizes[4] == [24, 12, 12] and sum(sizes[0]) == sum(sizes[3]) == 48
    assert sizes[2] == sizes[5] == [20, 14, 14]
    assert "MPI_FINALIZE" not in proc.stdout


def test_train_turns_docstring_examples():
    # the turn syntax: fixed splits, gathered:SPLIT, balancing turns with options
    import doctest
    import train_turns
    failed, attempted = doctest.testmod(train_turns, verbose=False)
    assert attempted >= 3 and failed == 0


def test_example_records_the_step_anatomy(tmp_path):
    """OMNIHVD_EXAMPLE_ANATOMY: every rank writes its steps, and the timestamps nest
    (a step's period holds its body before step() and its time inside step())."""
    folder = tmp_path / "anatomy"
    mpirun(3, EXAMPLE, "--epochs", "1", "--global-batch-size", "48", "--steps", "12",
           "--mode", "fixed", "--split", "24,12,12", timeout=300,
           env={"OMNIHVD_EXAMPLE_ANATOMY": str(folder)})
    names = sorted(os.listdir(folder))
    assert len(names) == 3 and all(n.startswith("anatomy-fixed-24_12_12-") for n in names), names
    for rank, (name, samples) in enumerate(zip(names, (24, 12, 12))):
        assert name.endswith("-e0-r%d.json" % rank)
        with open(folder / name) as f:
            steps = json.load(f)
        assert len(steps) == 12 and {s["samples"] for s in steps} == {samples}
        assert all(s["local_s"] > 0 and s["before_step_s"] > 0 and s["in_step_s"] > 0
                   for s in steps)
        assert steps[-1]["period_s"] is None
        assert all(s["period_s"] >= s["before_step_s"] + s["in_step_s"] for s in steps[:-1])
    summary = step_anatomy.summarize(str(folder), skip=2)
    (run,) = summary.values()
    assert [r["samples"] for r in run["ranks"]] == [24, 12, 12]


def test_example_starts_omnihvd_from_a_given_split():
    # 10 steps end before the first adjustment (step 20): the sizes are the start split
    proc = mpirun(3, EXAMPLE, "--epochs", "1", "--global-batch-size", "48", "--steps", "10",
                  "--start-split", "24,12,12", timeout=300)
    assert [m for m in LINE.findall(proc.stdout)] == ["24, 12, 12"], proc.stdout[-3000:]


@pytest.mark.parametrize("argv, error", [
    (["--split", "1,2"], "--split goes with --mode fixed"),
    (["--mode", "fixed", "--split", "1,2", "--start-split", "1,2"],
     "--start-split goes with --mode omnihvd or tuned"),
    (["--mode", "fixed", "--split", "a,b"], "argument --split: expected a positive int, got 'a'"),
    (["--slowdown", "1,0"], "argument --slowdown: expected a positive float, got '0'"),
    (["--steps", "0"], "argument --steps: expected a positive int, got '0'"),
    (["--checkpoint", "/nonexistent/ck.pt"], "the folder '/nonexistent' does not exist"),
])
def test_example_rejects_a_split_for_the_wrong_mode(argv, error):
    import subprocess

    proc = subprocess.run([sys.executable, EXAMPLE, *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and error in proc.stderr


def test_example_resumed_from_an_epochs_end_goes_on_with_the_next_epoch(tmp_path):
    # A checkpoint written at the end of epoch 0: the resumed run trains epoch 1 only
    # (it ran epoch 0 again, with no steps, before).
    import subprocess

    ck = str(tmp_path / "ck.pt")
    runs = [subprocess.run([sys.executable, EXAMPLE, "--steps", "3", "--global-batch-size",
                            "32", "--epochs", str(epochs), "--checkpoint", ck],
                           capture_output=True, text=True, timeout=300) for epochs in (1, 2)]
    epochs = [re.findall(r"^epoch (\d+):", run.stdout, re.M) for run in runs]
    assert all(run.returncode == 0 for run in runs) and epochs == [["0"], ["1"]], runs
