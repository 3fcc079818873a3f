"""Unequal CPU for other processes, from the outside: core sets and CFS quotas.

Real CPU heterogeneity on one machine, imposed on running processes without their
cooperation -- what ``docker run --cpuset-cpus`` / ``--cpus`` and Kubernetes CPU
limits do to a container:

* :func:`pin` sets the CPU affinity of every thread of a process and of its
  descendants, like ``taskset -a -p -c CPUS PID``. Threads created later inherit it.
* :class:`QuotaGroup` is a cgroup with a CFS bandwidth limit (``quota`` microseconds
  of CPU per ``period``): cgroup v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` or
  cgroup v2's ``cpu.max``. Processes moved into it (every thread) are throttled for
  the rest of a period once they have used the quota.
* reading the quotas that limit a process is :mod:`omnihvd.cpuquota` (the runtime
  half, used by the step timer and ``omnihvd doctor``).

Writing to cgroups and pinning other users' processes need root. Every function
takes ``root`` (default ``"/"``), the folder that ``/proc`` and the cgroup mounts
are read under, so tests can run on a fake tree.

This module imports only the standard library.

Example (as root)::

    with QuotaGroup("demo") as group:
        group.set_quota(0.3, period_us=10000)   # 30% of one core, 10 ms period
        group.add(pid)                          # the process and all its threads
        pin(pid, [1])                           # and only on CPU 1
    # leaving the block moves the process back and removes the group
"""
import os
import re
import time
from typing import Iterable, List, Optional

from ..cpuquota import CpuController, CpuLimitError, Quota, find_cpu_controller, read_text, rooted

__all__ = ["CpuLimitError", "QuotaGroup", "pin", "threads", "descendants", "process_tree",
           "remove_stale_groups", "kill_session"]


def write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# ------------------------------------------------------------------ processes

def threads(pid: int, root: str = "/") -> List[int]:
    """Thread ids of process ``pid`` (empty when it has exited)."""
    try:
        return sorted(int(t) for t in os.listdir(rooted(root, "/proc/%d/task" % pid)))
    except OSError:
        return []


def descendants(pid: int, root: str = "/") -> List[int]:
    """Every live process below ``pid`` (children, their children...), from /proc."""
    children = {}
    for entry in os.listdir(rooted(root, "/proc")):
        if not entry.isdigit():
            continue
        try:
            stat = read_text(rooted(root, "/proc/%s/stat" % entry))
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])   # field 4 of stat
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return sorted(out)


def kill_session(sid: int, root: str = "/") -> List[int]:
    """SIGKILL every process of session ``sid``; return their pids.

    A job started with ``start_new_session=True`` is one session: this reaches
    mpirun's ranks too, which OpenMPI puts in process groups of their own (so
    killing mpirun's group is not enough), and ranks orphaned by a dead mpirun.
    """
    import signal

    killed = []
    for entry in os.listdir(rooted(root, "/proc")):
        if not entry.isdigit():
            continue
        try:
            fields = read_text(rooted(root, "/proc/%s/stat" % entry)).rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:   # field 6 of stat: the session id
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except ProcessLookupError:
                pass
    return killed


def process_tree(pid: int, root: str = "/") -> List[int]:
    """``pid`` and its descendants."""
    return [pid] + descendants(pid, root)


def _until_stable(pid: int, apply, root: str) -> int:
    """Apply ``apply(pid, tid)`` to every thread of ``pid``'s process tree, again until
    a pass meets no new thread (threads started meanwhile may have escaped)."""
    done = set()
    while True:
        fresh = [(p, t) for p in process_tree(pid, root) for t in threads(p, root)
                 if (p, t) not in done]
        if not fresh:
            return len(done)
        for p, t in fresh:
            try:
                apply(p, t)
            except ProcessLookupError:
                pass   # the thread ended in between
            done.add((p, t))


def pin(pid: int, cpus: Iterable[int], root: str = "/") -> int:
    """Restrict every thread of ``pid`` and of its descendants to ``cpus``.

    The same as ``taskset -a -p -c CPUS PID`` for each process of the tree. Threads
    created afterwards inherit the affinity of the thread that creates them.

    Args:
        pid: the process.
        cpus: CPU numbers, e.g. ``[0]`` or ``range(2)``.
        root: see the module docstring (affinity itself is always set on this
            machine's threads).

    Returns:
        The number of threads pinned.

    Raises:
        CpuLimitError: empty or unavailable ``cpus``, or not allowed (not root).
    """
    cpus = set(cpus)
    if not cpus:
        raise CpuLimitError("pin(%d): no CPUs given; e.g. pin(pid, [0])" % pid)

    def apply(_, tid):
        try:
            os.sched_setaffinity(tid, cpus)
        except PermissionError:
            raise CpuLimitError("pin(%d, %s): not allowed to set the affinity of thread %d; "
                                "run as root or as the process's owner" % (pid, sorted(cpus), tid))
        except OSError as exc:
            if isinstance(exc, ProcessLookupError):
                raise
            raise CpuLimitError("pin(%d, %s): %s; available CPUs: %s"
                                % (pid, sorted(cpus), exc, sorted(os.sched_getaffinity(0))))

    return _until_stable(pid, apply, root)


# ------------------------------------------------------------------ quota groups

class QuotaGroup:
    """A cgroup with a CFS quota; move processes in, change the quota, remove it.

    Args:
        name: folder name of the group (created at the top of the cpu hierarchy).
        controller: where to create it (default :func:`find_cpu_controller`).
        root: see the module docstring.

    Raises:
        CpuLimitError: no cpu controller, or the group cannot be created (not root,
            or a cgroup v2 hierarchy that cannot delegate the cpu controller).

    Use it as a context manager, or call :meth:`close`: the group is removed after
    moving whatever is still in it back to the top group.
    """

    CLOSE_WAIT_S = 3.0   # how long close() waits for killed members to finish exiting

    def __init__(self, name: str, controller: Optional[CpuController] = None, root: str = "/"):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name or ""):
            raise CpuLimitError("cgroup name must be letters, digits, '_', '.', '-'; got %r"
                                % (name,))
        self.controller = controller or find_cpu_controller(root)
        self.root = root
        self.path = os.path.join(self.controller.mount, name)
        self.version = self.controller.version
        try:
            if self.version == "v2":
                # cpu.max exists in a child only when the parent delegates the controller.
                write_text(os.path.join(self.controller.mount, "cgroup.subtree_control"), "+cpu")
            os.mkdir(self.path)
        except FileExistsError:
            pass
        except OSError as exc:
            raise CpuLimitError("cannot create cgroup %s: %s. Fix: run as root; on cgroup v2 the "
                                "parent must be able to enable the cpu controller "
                                "(cgroup.subtree_control)" % (self.path, exc))
        self.closed = False

    def set_quota(self, cores: Optional[float], period_us: int = 10000) -> Quota:
        """Limit the group to ``cores`` (0.3 = 30% of one core) per ``period_us``; None lifts it.

        Returns:
            The :class:`Quota` now in force (``quota_us`` -1 when lifted).

        Raises:
            CpuLimitError: a period outside 1 ms..1 s, a quota under 1 ms per period,
                or a write the kernel refused.
        """
        if isinstance(period_us, bool) or not isinstance(period_us, int) or \
                not 1000 <= period_us <= 1000000:
            raise CpuLimitError("period_us must be an int in [1000, 1000000] (1 ms..1 s), got %r"
                                % (period_us,))
        quota = -1
        if cores is not None:
            quota = int(round(float(cores) * period_us))
            if not quota >= 1000:
                raise CpuLimitError("quota of %r cores per %d us period is %d us; the kernel "
                                    "needs >= 1000 us: raise cores or the period"
                                    % (cores, period_us, quota))
        try:
            if self.version == "v1":
                write_text(os.path.join(self.path, "cpu.cfs_period_us"), str(period_us))
                write_text(os.path.join(self.path, "cpu.cfs_quota_us"), str(quota))
            else:
                write_text(os.path.join(self.path, "cpu.max"),
                       "%s %d" % ("max" if quota < 0 else quota, period_us))
        except OSError as exc:
            raise CpuLimitError("cannot set the quota of %s to %r cores per %d us: %s"
                                % (self.path, cores, period_us, exc))
        return Quota(self.path, quota, period_us)

    def _move(self, folder: str, pid: int, tid: int) -> None:
        if self.version == "v1":
            write_text(os.path.join(folder, "tasks"), str(tid))   # one thread at a time
        elif tid == pid:
            write_text(os.path.join(folder, "cgroup.procs"), str(pid))   # v2: the whole process

    def add(self, pid: int) -> int:
        """Move ``pid``, its descendants and all their threads into the group.

        Returns:
            The number of threads moved.

        Raises:
            CpuLimitError: the kernel refused (not root, or the process is gone).
        """
        def apply(p, tid):
            try:
                self._move(self.path, p, tid)
            except OSError as exc:
                if not os.path.exists(rooted(self.root, "/proc/%d/task/%d" % (p, tid))):
                    raise ProcessLookupError(tid)
                raise CpuLimitError("cannot move thread %d of process %d into %s: %s"
                                    % (tid, p, self.path, exc))

        return _until_stable(pid, apply, self.root)

    def stats(self) -> dict:
        """The group's ``cpu.stat`` counters, e.g. ``nr_periods``, ``nr_throttled`` and
        ``throttled_time`` (v1, ns) or ``throttled_usec`` (v2); empty when unreadable."""
        try:
            pairs = (line.split() for line in read_text(os.path.join(self.path, "cpu.stat")).splitlines())
            return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}
        except OSError:
            return {}

    def members(self) -> List[int]:
        """Thread ids (v1) or process ids (v2) now in the group."""
        name = "tasks" if self.version == "v1" else "cgroup.procs"
        try:
            return [int(v) for v in read_text(os.path.join(self.path, name)).split()]
        except OSError:
            return []

    def close(self) -> None:
        """Move what is left to the top group and remove this one (safe to call twice)."""
        if self.closed:
            return
        top = self.controller.mount
        # Members may still be starting threads, or still exiting after a kill (a task
        # that is exiting can be neither moved nor waited for): retry for a while.
        deadline = time.monotonic() + self.CLOSE_WAIT_S
        while True:
            left = self.members()
            if not left:
                break
            for task in left:
                try:
                    write_text(os.path.join(top, "tasks" if self.version == "v1" else "cgroup.procs"),
                           str(task))
                except OSError:
                    pass   # gone already, or exiting
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise CpuLimitError("cannot remove cgroup %s: %s (still used by %s); remove it by "
                                "hand: rmdir %s" % (self.path, exc, self.members(), self.path))
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def remove_stale_groups(prefix: str, controller: CpuController,
                        alive=lambda pid: os.path.exists("/proc/%d" % pid)) -> List[str]:
    """Remove empty groups named ``PREFIX<pid>-...`` left by a killed owner ``pid``."""
    removed = []
    for name in sorted(os.listdir(controller.mount)):
        match = re.match(re.escape(prefix) + r"(\d+)-", name)
        if match and not alive(int(match.group(1))):
            try:
                os.rmdir(os.path.join(controller.mount, name))
                removed.append(name)
            except OSError:
                pass
    return removed
