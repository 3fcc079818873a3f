"""The drop-in path (omnihvd.Balancer) on real ranks: Horovod under mpirun, DDP under
torchrun. A loop that calls nothing of omnihvd, cuts each rank's batch into
sub-batches (ranks run different numbers of them) and allreduces a metric inside the
step; every step's gradient equals one process over the global batch (float64,
1e-12) and every epoch uses each sample once (tests/mpi_scripts/balancer_loop.py)."""
import json
import os

import pytest

from mpirun import mpirun
from torchrun import torchrun

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_scripts")
SCRIPT = os.path.join(HERE, "balancer_loop.py")
pytestmark = pytest.mark.mpi


def _report(out):
    line = [l for l in out.splitlines() if l.startswith("BALANCER-OK ")]
    assert line, out[-4000:]
    return json.loads(line[0][len("BALANCER-OK "):])


@pytest.mark.parametrize("backend,op,workers", [
    ("hvd", "average", 0),
    ("hvd", "sum", 2),
    ("ddp", "average", 0),
])
def test_sub_batches_of_unequal_count_give_the_global_batch_gradient(backend, op, workers):
    args = (backend, op, 4, workers)
    out = (mpirun(3, SCRIPT, *args) if backend == "hvd" else torchrun(3, SCRIPT, *args)).stdout
    report = _report(out)
    assert report["worst"] <= 1e-12
    # the ranks ran different numbers of sub-batches (what Horovod's
    # backward_passes_per_step refused): from the first step, whatever the timing
    assert report["unequal_passes"] > 0, report
