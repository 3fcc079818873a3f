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
* :func:`cpu_quotas` reads the quotas that limit a process (its own group and the
  groups above it), for ``omnihvd doctor``.

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
from typing import Iterable, List, NamedTuple, Optional, Sequence

from .errors import OmniHvdError

__all__ = ["CpuLimitError", "CpuController", "Quota", "QuotaGroup", "find_cpu_controller",
           "cpu_quotas", "pin", "threads", "descendants", "process_tree", "parse_mountinfo",
           "remove_stale_groups", "kill_session"]


class CpuLimitError(OmniHvdError):
    """A core set or quota cannot be applied; the message says why and how to fix it."""


class CpuController(NamedTuple):
    """Where the cgroup cpu controller is mounted.

    Attributes:
        version: ``"v1"`` (``cpu.cfs_quota_us``) or ``"v2"`` (``cpu.max``).
        mount: the mount point (under ``root``), e.g. ``/sys/fs/cgroup/cpu``.
        mount_root: the cgroup path that the mount point shows (``/`` unless the
            mount shows only a sub-tree, as in some containers).
    """
    version: str
    mount: str
    mount_root: str


class Quota(NamedTuple):
    """A CFS bandwidth limit on one cgroup: ``quota_us`` of CPU time per ``period_us``."""
    path: str
    quota_us: int
    period_us: int

    @property
    def cores(self) -> float:
        """The limit in cores (0.3 = 30% of one core)."""
        return self.quota_us / self.period_us


def _path(root: str, absolute: str) -> str:
    return os.path.join(root, absolute.lstrip("/"))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes (\040).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> List[dict]:
    """The cgroup mounts in a ``/proc/<pid>/mountinfo`` text.

    Returns:
        One dict per cgroup mount: ``fstype`` (``"cgroup"`` or ``"cgroup2"``),
        ``root`` (the cgroup path it shows), ``mount`` (mount point), ``options``
        (set of super options, e.g. ``{"rw", "cpu", "cpuacct"}``).

    >>> m, = parse_mountinfo("32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\\n")
    >>> m["fstype"], m["root"], m["mount"], sorted(m["options"])
    ('cgroup', '/', '/sys/fs/cgroup/cpu', ['cpu', 'rw'])
    """
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        options = set(tail[2].split(",")) if len(tail) > 2 else set()
        mounts.append({"fstype": tail[0], "root": _unescape(fields[3]),
                       "mount": _unescape(fields[4]), "options": options})
    return mounts


def _controllers(root: str, pid="self") -> List[CpuController]:
    try:
        mounts = parse_mountinfo(_read(_path(root, "/proc/%s/mountinfo" % pid)))
    except OSError:
        return []
    found = []
    for m in mounts:
        if m["fstype"] == "cgroup" and "cpu" in m["options"]:
            found.append(CpuController("v1", _path(root, m["mount"]), m["root"]))
    for m in mounts:
        if m["fstype"] == "cgroup2":
            mount = _path(root, m["mount"])
            try:
                available = _read(os.path.join(mount, "cgroup.controllers")).split()
            except OSError:
                continue
            if "cpu" in available:
                found.append(CpuController("v2", mount, m["root"]))
    return found


def find_cpu_controller(root: str = "/") -> CpuController:
    """The cgroup cpu controller this machine offers (v1 preferred, as on hybrid hosts).

    Raises:
        CpuLimitError: neither v1 nor v2 has a cpu controller here; the message says
            what was looked for.

    >>> find_cpu_controller().version in ("v1", "v2")   # doctest: +SKIP
    True
    """
    found = _controllers(root)
    if not found:
        raise CpuLimitError(
            "no cgroup cpu controller found in %s: neither a cgroup v1 hierarchy with the "
            "'cpu' controller (cpu.cfs_quota_us) nor a cgroup v2 hierarchy listing 'cpu' in "
            "cgroup.controllers (cpu.max). CPU quotas need one: mount it (e.g. mount -t cgroup "
            "-o cpu cgroup /sys/fs/cgroup/cpu), or run a container with --privileged; core "
            "sets (pin) work without cgroups" % _path(root, "/proc/self/mountinfo"))
    return found[0]


def _group_dir(controller: CpuController, cgroup_path: str) -> Optional[str]:
    """Folder of ``cgroup_path`` in the mount, or None when the mount does not show it."""
    base = controller.mount_root.rstrip("/")
    if cgroup_path != base and not cgroup_path.startswith(base + "/"):
        return None
    rest = cgroup_path[len(base):].strip("/")
    return os.path.join(controller.mount, rest) if rest else controller.mount


def _own_groups(root: str, pid) -> dict:
    """``{"v1": path, "v2": path}`` of the cpu cgroup of ``pid`` from /proc/PID/cgroup."""
    groups = {}
    for line in _read(_path(root, "/proc/%s/cgroup" % pid)).splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            groups["v2"] = parts[2]
        elif "cpu" in parts[1].split(","):
            groups["v1"] = parts[2]
    return groups


def _quota_of(folder: str, version: str) -> Optional[Quota]:
    try:
        if version == "v1":
            quota = int(_read(os.path.join(folder, "cpu.cfs_quota_us")))
            period = int(_read(os.path.join(folder, "cpu.cfs_period_us")))
        else:
            text = _read(os.path.join(folder, "cpu.max")).split()
            if text[0] == "max":
                return None
            quota, period = int(text[0]), int(text[1])
    except (OSError, ValueError, IndexError):
        return None
    return Quota(folder, quota, period) if quota > 0 else None


def cpu_quotas(pid="self", root: str = "/") -> List[Quota]:
    """Every CFS quota that limits ``pid``: its cpu cgroup and each group above it.

    Args:
        pid: a process id, or ``"self"``.
        root: folder that ``/proc`` and the cgroup mounts are read under.

    Returns:
        list of :class:`Quota`, innermost group first; empty when none is set or no
        cpu controller is visible (a quota that cannot be seen cannot be reported).

    >>> [q.cores for q in cpu_quotas()]   # doctest: +SKIP
    [0.3]
    """
    try:
        groups = _own_groups(root, pid)
    except OSError:
        return []
    found = []
    for controller in _controllers(root, pid):
        if controller.version not in groups:
            continue
        folder = _group_dir(controller, groups[controller.version])
        while folder is not None:
            quota = _quota_of(folder, controller.version)
            if quota is not None:
                found.append(quota)
            if os.path.normpath(folder) == os.path.normpath(controller.mount):
                break
            folder = os.path.dirname(folder.rstrip("/"))
    return found


def cpu_quota_cores(pid="self", root: str = "/") -> Optional[float]:
    """The CPU cores ``pid`` may use under its CFS quotas (the smallest along its
    cgroup path), or None when no quota is set or none can be seen.

    >>> cpu_quota_cores(root="/nonexistent") is None
    True
    """
    quotas = cpu_quotas(pid, root)
    return min(q.cores for q in quotas) if quotas else None


# ------------------------------------------------------------------ processes

def threads(pid: int, root: str = "/") -> List[int]:
    """Thread ids of process ``pid`` (empty when it has exited)."""
    try:
        return sorted(int(t) for t in os.listdir(_path(root, "/proc/%d/task" % pid)))
    except OSError:
        return []


def descendants(pid: int, root: str = "/") -> List[int]:
    """Every live process below ``pid`` (children, their children...), from /proc."""
    children = {}
    for entry in os.listdir(_path(root, "/proc")):
        if not entry.isdigit():
            continue
        try:
            stat = _read(_path(root, "/proc/%s/stat" % entry))
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
    for entry in os.listdir(_path(root, "/proc")):
        if not entry.isdigit():
            continue
        try:
            fields = _read(_path(root, "/proc/%s/stat" % entry)).rsplit(")", 1)[1].split()
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
                _write(os.path.join(self.controller.mount, "cgroup.subtree_control"), "+cpu")
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
                _write(os.path.join(self.path, "cpu.cfs_period_us"), str(period_us))
                _write(os.path.join(self.path, "cpu.cfs_quota_us"), str(quota))
            else:
                _write(os.path.join(self.path, "cpu.max"),
                       "%s %d" % ("max" if quota < 0 else quota, period_us))
        except OSError as exc:
            raise CpuLimitError("cannot set the quota of %s to %r cores per %d us: %s"
                                % (self.path, cores, period_us, exc))
        return Quota(self.path, quota, period_us)

    def _move(self, folder: str, pid: int, tid: int) -> None:
        if self.version == "v1":
            _write(os.path.join(folder, "tasks"), str(tid))   # one thread at a time
        elif tid == pid:
            _write(os.path.join(folder, "cgroup.procs"), str(pid))   # v2: the whole process

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
                if not os.path.exists(_path(self.root, "/proc/%d/task/%d" % (p, tid))):
                    raise ProcessLookupError(tid)
                raise CpuLimitError("cannot move thread %d of process %d into %s: %s"
                                    % (tid, p, self.path, exc))

        return _until_stable(pid, apply, self.root)

    def stats(self) -> dict:
        """The group's ``cpu.stat`` counters, e.g. ``nr_periods``, ``nr_throttled`` and
        ``throttled_time`` (v1, ns) or ``throttled_usec`` (v2); empty when unreadable."""
        try:
            pairs = (line.split() for line in _read(os.path.join(self.path, "cpu.stat")).splitlines())
            return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}
        except OSError:
            return {}

    def members(self) -> List[int]:
        """Thread ids (v1) or process ids (v2) now in the group."""
        name = "tasks" if self.version == "v1" else "cgroup.procs"
        try:
            return [int(v) for v in _read(os.path.join(self.path, name)).split()]
        except OSError:
            return []

    def close(self) -> None:
        """Move what is left to the top group and remove this one (safe to call twice)."""
        if self.closed:
            return
        top = self.controller.mount
        for _ in range(10):   # members may still be starting threads
            left = self.members()
            if not left:
                break
            for task in left:
                try:
                    _write(os.path.join(top, "tasks" if self.version == "v1" else "cgroup.procs"),
                           str(task))
                except OSError:
                    pass   # gone already
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
