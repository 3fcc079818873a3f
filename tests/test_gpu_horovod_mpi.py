"""The CPU side of benchmarks/gpu_horovod.sh's balance part: gpu_horovod_balance.py
under mpirun on two CPU ranks (``--device cpu``: rank 1 slowed by a host sleep of 1 ms
per sample), omnihvd.Balancer against plain Horovod in one launch.

On a shared 2-core machine the fixed cost of a step varies severalfold with the load,
so this checks the plumbing and the split (the slow rank ends with at most 45% of the
batch against plain Horovod's half) and reports the step times; the step-time part of
the verdict is for the GPU machine's quiet cores (benchmarks/gpu_horovod.sh)."""
import json
import os

import pytest

from mpirun import mpirun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_horovod_balance.py")
pytestmark = pytest.mark.mpi


def test_the_slow_cpu_rank_gets_fewer_samples_than_plain_horovod_gives_it():
    proc = mpirun(2, SCRIPT, "--device", "cpu", "--steps", "24", "--adjust-every", "3",
                  timeout=240, check=False)
    out = proc.stdout
    line = [l for l in out.splitlines() if l.startswith("RESULT ")]
    assert line, out[-4000:]
    results = json.loads(line[0][len("RESULT "):])
    assert set(results) == {"omnihvd", "plain"}, results   # no "host" run on the CPU
    omni, plain = results["omnihvd"], results["plain"]
    assert sum(omni["sizes"]) == sum(plain["sizes"]) == 256
    assert plain["sizes"] == [128, 128] and omni["adjustments"] >= 1, results
    assert omni["sizes"][1] <= 0.45 * 256, results
    verdict = [l for l in out.splitlines() if l.startswith(("PASS", "FAIL"))]
    assert verdict and proc.returncode == (0 if verdict[0].startswith("PASS") else 1), out[-4000:]
    print(verdict[0])
