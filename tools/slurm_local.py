#!/usr/bin/env python3
"""Start and stop a real, throw-away Slurm cluster on this machine, for tests.

One ``slurmctld`` and three ``slurmd`` daemons run on this host; everything (config,
state, spool, logs, pid files) lives in one folder. Nodes and partitions:

* ``n1`` and ``n2``: two virtual nodes (NodeHostname=localhost, own ports), for
  multi-node and heterogeneous jobs. Partitions ``all`` (both, the default),
  ``fast`` (n1) and ``slow`` (n2) -- two "node types" for a heterogeneous job.
* the host itself, under its real host name, partition ``host``: for launchers that
  need node names they can resolve (``horovodrun -H``). Jobs never mix it with n1
  or n2: OpenMPI would see two nodes with the same host name and crash.

Needs root (the daemons run as root) and the Debian/Ubuntu packages slurmctld,
slurmd and slurm-client (``install`` adds them with apt).

Usage::

    python3 tools/slurm_local.py install            # apt-get install, when missing
    python3 tools/slurm_local.py start DIR          # prints the environment to use
    eval "$(python3 tools/slurm_local.py env DIR)"  # SLURM_CONF etc. for sbatch/srun
    python3 tools/slurm_local.py stop DIR           # cancels jobs, stops the daemons

Daemons are stopped only through the pid files in ``DIR/run``, never by name, so
other Slurm or MPI processes on the machine are left alone.
"""
import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

__all__ = ["install", "start", "stop", "environment", "node_names", "node_states",
           "missing_commands", "ClusterError", "PACKAGES"]

PACKAGES = ("slurmctld", "slurmd", "slurm-client")
COMMANDS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")
CPUS_PER_NODE = 4  # declared, not real: SlurmdParameters=config_overrides allows it

CONF = """\
# Throw-away local cluster written by tools/slurm_local.py; not for production.
ClusterName=omnihvd-local
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/run/slurmctld.pid
SlurmdPidFile={dir}/run/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
TmpFS={dir}/tmp/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=pmix
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
JobRequeue=1
InactiveLimit=0
KillWait=5
# Generous: the test machine may be heavily loaded, and a lost message can leave
# srun waiting for tasks that have already exited.
MessageTimeout=60
MinJobAge=600
{nodes}
PartitionName=all Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
PartitionName=fast Nodes=n1 MaxTime=INFINITE State=UP
PartitionName=slow Nodes=n2 MaxTime=INFINITE State=UP
PartitionName=host Nodes={host} MaxTime=INFINITE State=UP
"""

NODE_LINE = ("NodeName={name} NodeHostname={hostname} NodeAddr=localhost Port={port} "
             "CPUs={cpus} State=UNKNOWN")


def node_names():
    """The cluster's nodes: the virtual n1 and n2, then this host's own name."""
    return ("n1", "n2", socket.gethostname())


class ClusterError(RuntimeError):
    """The local cluster could not be installed, started or stopped."""


def _say(msg):
    print("[slurm_local] " + msg, file=sys.stderr, flush=True)


def missing_commands():
    """Slurm commands not found on PATH (an empty list when all are there)."""
    return [c for c in COMMANDS if shutil.which(c) is None]


def install():
    """Install the Slurm packages with apt-get when any command is missing.

    Raises:
        ClusterError: commands are missing and apt-get is not usable (not root, no
            apt-get, or OMNIHVD_NO_APT set), or the installation failed.
    """
    missing = missing_commands()
    if not missing:
        return
    how = "apt-get install %s (Debian/Ubuntu; other systems: your Slurm packages)" % " ".join(PACKAGES)
    if os.environ.get("OMNIHVD_NO_APT") or shutil.which("apt-get") is None or os.geteuid() != 0:
        raise ClusterError("Slurm commands missing: %s; install them: %s" % (" ".join(missing), how))
    _say("installing with apt: " + " ".join(PACKAGES))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        if proc.returncode != 0:
            raise ClusterError("%s failed (exit %d):\n%s\nfix: %s"
                               % (" ".join(cmd), proc.returncode, proc.stdout[-3000:], how))
    if missing_commands():
        raise ClusterError("after apt-get, still missing: %s" % " ".join(missing_commands()))


def _free_ports(count):
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def environment(folder):
    """Environment variables for clients and jobs of the cluster in ``folder``.

    Besides SLURM_CONF: OpenMPI must use TCP between the two virtual nodes (its
    shared-memory transport crashes when two "nodes" share one host), must yield
    idle cores (the nodes declare more CPUs than there are), and needs the
    run-as-root permission since the daemons run as root. These are quirks of this
    test cluster, so they live here and not in the templates.
    """
    folder = os.path.abspath(folder)
    env = {"SLURM_CONF": os.path.join(folder, "slurm.conf"),
           "OMPI_MCA_btl": "self,tcp",
           # Nodes declare more CPUs than the host has: waiting ranks must yield the
           # core instead of spinning (mpirun --oversubscribe does the same).
           "OMPI_MCA_mpi_yield_when_idle": "1"}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _run(cmd, env, timeout=30, check=True):
    proc = subprocess.run(cmd, env=dict(os.environ, **env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError("%s failed (exit %d): %s" % (" ".join(cmd), proc.returncode,
                                                        proc.stdout.strip()))
    return proc.stdout


def _pid_files(folder):
    run = os.path.join(folder, "run")
    names = ["slurmd-%s.pid" % n for n in node_names()] + ["slurmctld.pid"]
    return [os.path.join(run, n) for n in names]


def _read_pid(path):
    try:
        with open(path) as f:
            return int(f.read().strip() or 0) or None
    except (OSError, ValueError):
        return None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie or a reused pid of another program is not our daemon.
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _daemon_name(pid):
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().strip()
    except OSError:
        return ""


def node_states(folder):
    """``{node: state}`` as sinfo reports it (e.g. ``{"n1": "idle"}``)."""
    out = _run(["sinfo", "-h", "-N", "-o", "%N %t"], environment(folder), check=False)
    states = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in node_names():
            states[parts[0]] = parts[1]
    return states


def start(folder, timeout=60.0):
    """Write ``folder/slurm.conf``, start slurmctld and one slurmd per node, wait for idle.

    Args:
        folder: where the cluster lives (created if needed; one cluster per folder).
        timeout: seconds to wait for every node to be idle.

    Returns:
        The environment (dict) for clients, as :func:`environment`.

    Raises:
        ClusterError: Slurm is not installed, not root, or the nodes did not come up
            (the message quotes the daemon logs); daemons already started are stopped.
    """
    if missing_commands():
        raise ClusterError("Slurm is not installed (missing %s): run "
                           "`python3 tools/slurm_local.py install`" % " ".join(missing_commands()))
    if os.geteuid() != 0:
        raise ClusterError("the local cluster runs its daemons as root; run as root")
    folder = os.path.abspath(folder)
    for pid_file in _pid_files(folder):
        pid = _read_pid(pid_file)
        if pid and _alive(pid):
            raise ClusterError("a cluster is already running in %s (pid %d); stop it first"
                               % (folder, pid))
    names = node_names()
    for sub in ["state", "run", "log"] + ["spool/" + n for n in names] + ["tmp/" + n for n in names]:
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    ports = _free_ports(1 + len(names))
    hostnames = ("localhost", "localhost", names[2])
    nodes = "\n".join(NODE_LINE.format(name=n, hostname=h, port=p, cpus=CPUS_PER_NODE)
                      for n, h, p in zip(names, hostnames, ports[1:]))
    conf = CONF.format(dir=folder, ctld_port=ports[0], nodes=nodes, host=names[2])
    conf_path = os.path.join(folder, "slurm.conf")
    with open(conf_path, "w") as f:
        f.write(conf)
    env = environment(folder)
    try:
        # -i: ignore state left by an earlier cluster in the same folder.
        _run(["slurmctld", "-f", conf_path, "-i"], env)
        for n in names:
            _run(["slurmd", "-f", conf_path, "-N", n], env)
        deadline = time.monotonic() + timeout
        while True:
            states = node_states(folder)
            if len(states) == len(names) and all(s == "idle" for s in states.values()):
                break
            if time.monotonic() > deadline:
                raise ClusterError("nodes not idle after %.0f s: %s\n%s"
                                   % (timeout, states, _log_tails(folder)))
            time.sleep(0.3)
    except BaseException:
        stop(folder)
        raise
    return env


def _log_tails(folder, lines=15):
    out = []
    log_dir = os.path.join(folder, "log")
    for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
        with open(os.path.join(log_dir, name), errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
        out.append("--- %s ---\n%s" % (name, "\n".join(tail)))
    return "\n".join(out)


def stop(folder, timeout=20.0):
    """Cancel every job of the cluster, then stop its daemons through their pid files.

    Jobs are cancelled first so that no job step (slurmstepd and its tasks) outlives
    the daemons. Safe to call on a folder whose cluster is already stopped.

    Raises:
        ClusterError: a daemon did not exit even after SIGKILL.
    """
    folder = os.path.abspath(folder)
    env = environment(folder)
    ctld = _read_pid(os.path.join(folder, "run", "slurmctld.pid"))
    if ctld and _alive(ctld) and shutil.which("scancel"):
        try:
            _run(["scancel", "--full", "--user", str(os.geteuid())], env, check=False)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                out = _run(["squeue", "-h", "-t", "running,completing,configuring", "-o", "%i"],
                           env, check=False)
                if not out.strip():
                    break
                time.sleep(0.5)
        except subprocess.TimeoutExpired:
            pass  # an unresponsive controller: stop the daemons all the same
    pids = [_read_pid(f) for f in _pid_files(folder)]
    pids = [p for p in pids if p and _alive(p) and _daemon_name(p).startswith("slurm")]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    stuck = []
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
            if _alive(pid):
                stuck.append(pid)
    if stuck:
        raise ClusterError("daemons did not exit: pids %s" % stuck)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["install", "start", "stop", "env", "status"])
    parser.add_argument("folder", nargs="?", help="the cluster's folder (not for install)")
    args = parser.parse_args(argv)
    try:
        if args.action == "install":
            install()
            return 0
        if args.folder is None:
            parser.error("%s needs the cluster's folder" % args.action)
        if args.action == "start":
            env = start(args.folder)
        elif args.action == "stop":
            stop(args.folder)
            return 0
        elif args.action == "status":
            states = node_states(args.folder)
            print(" ".join("%s=%s" % kv for kv in sorted(states.items())) or "down")
            return 0 if states else 1
        else:
            env = environment(args.folder)
        for key, value in env.items():
            print("export %s=%s" % (key, value))
        return 0
    except (ClusterError, subprocess.TimeoutExpired) as exc:
        print("slurm_local: %s" % exc, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
