"""The installation works: real multi-rank Horovod with mpi4py beside it, the console
script, and an idempotent tools/setup.sh."""
import os
import re
import subprocess
import sys

import pytest

from mpirun import mpirun

pytestmark = pytest.mark.mpi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "mpi_scripts", "install_check.py")
VENV_PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
RANKS = 4


@pytest.mark.parametrize("order", ["mpi4py-first", "horovod-first"])
def test_horovod_and_mpi4py_under_mpirun(order):
    proc = mpirun(RANKS, SCRIPT, order, timeout=300)
    ok = sorted(re.findall(r"INSTALL-CHECK OK rank=\d+ size=\d+ order=[a-z0-9-]+?(?=INSTALL|\s|$)",
                           proc.stdout))
    assert ok == ["INSTALL-CHECK OK rank=%d size=%d order=%s" % (r, RANKS, order)
                  for r in range(RANKS)], proc.stdout


def test_console_script_is_installed():
    omnihvd = os.path.join(os.path.dirname(sys.executable), "omnihvd")
    assert os.access(omnihvd, os.X_OK), "no %s: run `bash tools/setup.sh`" % omnihvd
    proc = subprocess.run([omnihvd, "--help"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    assert proc.returncode == 0 and "doctor" in proc.stdout, proc.stdout
    # the same command where the scripts folder is not on PATH
    proc = subprocess.run([sys.executable, "-m", "omnihvd", "--help"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    assert proc.returncode == 0 and "doctor" in proc.stdout, proc.stdout


def test_setup_is_idempotent():
    """A second `bash tools/setup.sh` installs and builds nothing and succeeds."""
    if os.path.realpath(sys.executable) != os.path.realpath(VENV_PYTHON):
        pytest.skip("the suite runs outside %s; setup.sh manages that one only" % VENV_PYTHON)
    env = dict(os.environ, OMNIHVD_NO_APT="1")
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "setup.sh")], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout
    for word in ("installing", "building", "creating", "using cached"):
        assert word not in proc.stdout, proc.stdout
    assert "ready:" in proc.stdout, proc.stdout
