"""Run a Python script under a real ``mpirun`` from pytest.

OpenMPI needs OMPI_ALLOW_RUN_AS_ROOT* when run as root and --oversubscribe for more
ranks than cores; those settings live here, in the harness, not in the library.
"""
import os
import shutil
import subprocess
import sys

from omnihvd.tools.cpulimits import kill_session  # noqa: F401 - the tests import it from here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpi_env(extra=None):
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        # Keep each rank to one thread: 2 cores shared by up to 4 ranks.
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    )
    # No PYTHONUNBUFFERED: unbuffered, print() writes the text and its newline in two
    # calls, and mpirun can splice another rank's line between them. Buffered, each
    # print(..., flush=True) reaches mpirun as whole lines.
    env.pop("PYTHONUNBUFFERED", None)
    env.update(extra or {})
    return env


def run_bounded(cmd, timeout, env):
    """Run ``cmd`` in a new session; on timeout kill the whole session, then raise."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError("%s did not finish within %d s (a hang?); its output:\n%s"
                             % (" ".join(map(str, cmd[:6])), timeout, (out or "")[-6000:]))
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def mpirun(np, script, *args, timeout=240, env=None, check=True):
    """Run ``script`` on ``np`` ranks; return the CompletedProcess (text output).

    Fails (never skips) when mpirun is missing: the suite must prove multi-rank
    behaviour. ``check=False`` returns non-zero exits for the caller to inspect.
    """
    launcher = shutil.which("mpirun")
    if launcher is None:
        raise RuntimeError("mpirun not found: run `bash tools/setup.sh` (installs OpenMPI)")
    cmd = [launcher, "-np", str(np), "--oversubscribe", "--bind-to", "none",
           sys.executable, script, *map(str, args)]
    proc = run_bounded(cmd, timeout, mpi_env(env))
    if check and proc.returncode != 0:
        raise AssertionError("mpirun -np %d %s failed (exit %d):\n%s"
                             % (np, os.path.basename(script), proc.returncode, proc.stdout[-6000:]))
    return proc
