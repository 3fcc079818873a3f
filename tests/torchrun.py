"""Run a Python script under a real ``torchrun`` from pytest (the DDP backend's tests).

``--standalone`` gives every run its own rendezvous on a free port, so runs do not
collide; ``--monitor-interval 0.1`` lets torchrun notice a failed worker at once. The
run is bounded like mpirun's (tests/mpirun.py): on timeout the whole session is killed.
"""
import os
import sys

from mpirun import ROOT, kill_session, run_bounded  # noqa: F401  (kill_session: re-export)


def torchrun_env(extra=None):
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",  # 2 cores shared by 3 ranks
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra or {})
    return env


def torchrun(nproc, script, *args, timeout=240, env=None, check=True):
    """Run ``script`` on ``nproc`` local workers; return the CompletedProcess (text output).

    ``check=False`` returns non-zero exits for the caller to inspect.
    """
    launcher = os.path.join(os.path.dirname(sys.executable), "torchrun")
    prefix = [launcher] if os.path.exists(launcher) else [sys.executable, "-m",
                                                          "torch.distributed.run"]
    cmd = prefix + ["--standalone", "--nproc-per-node", str(nproc), "--monitor-interval", "0.1",
                    script, *map(str, args)]
    proc = run_bounded(cmd, timeout, torchrun_env(env))
    if check and proc.returncode != 0:
        raise AssertionError("torchrun --nproc-per-node %d %s failed (exit %d):\n%s"
                             % (nproc, os.path.basename(script), proc.returncode,
                                proc.stdout[-6000:]))
    return proc
