"""Every shape of training loop ends cleanly under a real mpirun (issue: a slower rank
used MPI after the first rank's exit had made Horovod finalise it, and segfaulted).

The ranks run at speeds 1 : 1/2 : 1/3, so they reach the end of the loop at different
moments; ``slow_end`` reproduced the crash on every run before the fix (rank 0 spent
0.2 s after its last ``opt.step()`` and then called MPI after MPI_FINALIZE).
"""
import os

import pytest

from mpirun import mpirun

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_scripts")
pytestmark = pytest.mark.mpi

SHAPES = ["no_train_end", "train_end", "break", "late_last", "slow_end", "blocking", "break_mid"]


@pytest.mark.parametrize("shape", SHAPES)
def test_loop_ends_cleanly_on_every_rank(shape):
    # 60 steps, a decision every 10: the last step of the loop ends an adjustment window,
    # so a gather is due exactly when the first rank leaves.
    proc = mpirun(3, os.path.join(HERE, "loop_end.py"), shape, 60, 10, timeout=120, check=False)
    out = proc.stdout
    assert proc.returncode == 0, "exit %d:\n%s" % (proc.returncode, out[-4000:])
    done = [l for l in out.splitlines() if "LOOP-END-OK" in l]
    assert len(done) == 3, out[-4000:]
    want_steps = {"break": 31, "break_mid": 9 + 60}.get(shape, 60)
    assert all(" steps %d " % want_steps in l for l in done), done
    # every rank ends with the same split (the same decisions, in the same order)
    assert len({l.split(" sizes ")[1] for l in done}) == 1, done
