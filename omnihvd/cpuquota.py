"""The CPU quota this process runs under: where the cgroup cpu controller is, and the
CFS bandwidth limits (cgroup v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``, v2
``cpu.max``) along a process's cgroup path.

This is the runtime half of omnihvd's cgroup code: the step timer uses
:func:`cpu_quota_cores` for its CPU-quota floor (:mod:`omnihvd.timing`) and
``omnihvd doctor`` shows :func:`cpu_quotas`. Imposing core sets and quotas on other
processes (benchmarks) is :mod:`omnihvd.tools.cpulimits`.

Every function takes ``root`` (default ``"/"``), the folder that ``/proc`` and the
cgroup mounts are read under, so tests can run on a fake tree. This module imports
only the standard library.

    >>> cpu_quotas(root="/nonexistent")
    []
"""
import math
import os
import re
from typing import List, NamedTuple, Optional, Tuple

from .errors import OmniHvdError

__all__ = ["CpuLimitError", "CpuController", "Quota", "find_cpu_controller", "cpu_quotas",
           "cpu_quota_cores", "cpu_groups", "group_cpus", "quota_spread", "usable_cpus",
           "SPREAD_FIX", "parse_mountinfo", "rooted", "read_text"]

# The cure for quota_spread's finding (docs/cpu-quotas.rst).
SPREAD_FIX = ("give each rank as many CPUs of its own as its quota allows, rounded up: "
              "docker run --cpuset-cpus with --cpus, mpirun --bind-to core (one core per "
              "rank), or taskset; see docs/cpu-quotas.rst")


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


def rooted(root: str, absolute: str) -> str:
    return os.path.join(root, absolute.lstrip("/"))


def read_text(path: str) -> str:
    # surrogateescape, as os.fsdecode: a mount or group name need not be UTF-8
    with open(path, errors="surrogateescape") as f:
        return f.read()


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
        mounts = parse_mountinfo(read_text(rooted(root, "/proc/%s/mountinfo" % pid)))
    except (OSError, ValueError):
        return []
    found = []
    for m in mounts:
        if m["fstype"] == "cgroup" and "cpu" in m["options"]:
            found.append(CpuController("v1", rooted(root, m["mount"]), m["root"]))
    for m in mounts:
        if m["fstype"] == "cgroup2":
            mount = rooted(root, m["mount"])
            try:
                available = read_text(os.path.join(mount, "cgroup.controllers")).split()
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
            "sets (pin) work without cgroups" % rooted(root, "/proc/self/mountinfo"))
    return found[0]


def _group_dir(controller: CpuController, cgroup_path: str) -> Optional[str]:
    """Folder of ``cgroup_path`` in the mount, or None when the mount does not show it
    (also when either path leaves its namespace's root: ``/..`` in a cgroup namespace
    whose mount was made outside it)."""
    if ".." in cgroup_path.split("/") or ".." in controller.mount_root.split("/"):
        return None
    base = controller.mount_root.rstrip("/")
    if cgroup_path != base and not cgroup_path.startswith(base + "/"):
        return None
    rest = cgroup_path[len(base):].strip("/")
    return os.path.join(controller.mount, rest) if rest else controller.mount


# A mount that does not show where a process's group is: found as the group that lists
# the process's main thread (v1 "tasks": a process whose threads sit in several groups
# is listed in each one's cgroup.procs; v2 "cgroup.procs"), at most this many groups
# looked at. Remembered -- found or not -- until /proc/PID/cgroup shows a move.
SEARCH_LIMIT = 4000
_searched = {}


def _lists(folder: str, pid: str, version: str) -> bool:
    try:
        listed = read_text(os.path.join(folder, "tasks" if version == "v1" else "cgroup.procs"))
    except OSError:
        return False
    return pid in listed.split()


def _search_group(controller: CpuController, pid, shown: str) -> Optional[str]:
    """The group folder of ``pid`` under ``controller``'s mount, or None; ``shown``:
    its path in ``/proc/PID/cgroup``."""
    pid = str(os.getpid() if pid == "self" else pid)
    key = (controller.mount, pid, shown)
    if key in _searched:
        known = _searched[key]
        if known is None or _lists(known, pid, controller.version):
            return known
    found = None
    for looked, (folder, subfolders, _) in enumerate(os.walk(controller.mount), 1):
        if _lists(folder, pid, controller.version):
            found = folder
            break
        if looked >= SEARCH_LIMIT:
            break
        subfolders.sort()
    _searched[key] = found
    return found


def _own_groups(root: str, pid) -> dict:
    """``{"v1": path, "v2": path}`` of the cpu cgroup of ``pid`` from /proc/PID/cgroup."""
    groups = {}
    for line in read_text(rooted(root, "/proc/%s/cgroup" % pid)).splitlines():
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
            quota = int(read_text(os.path.join(folder, "cpu.cfs_quota_us")))
            period = int(read_text(os.path.join(folder, "cpu.cfs_period_us")))
        else:
            text = read_text(os.path.join(folder, "cpu.max")).split()
            if text[0] == "max":
                return None
            quota, period = int(text[0]), int(text[1])
    except (OSError, ValueError, IndexError):
        return None
    return Quota(folder, quota, period) if quota > 0 else None


def cpu_groups(pid="self", root: str = "/") -> List[Tuple[CpuController, Optional[str]]]:
    """The cpu controllers that ``pid`` can see, each with the folder of ``pid``'s
    group in its mount (None where it cannot be found there).

    Where the mount does not show the path in ``/proc/PID/cgroup`` (a cgroup namespace
    whose mount was made outside it), the group is the one that lists ``pid``'s main
    thread (:data:`SEARCH_LIMIT` groups at most, searched once per place the process
    is shown in).

    >>> cpu_groups(root="/nonexistent")
    []
    """
    try:
        groups = _own_groups(root, pid)
    except (OSError, ValueError):
        return []
    found = []
    for controller in _controllers(root, pid):
        if controller.version in groups:
            shown = groups[controller.version]
            folder = _group_dir(controller, shown)
            found.append((controller, folder if folder is not None
                          else _search_group(controller, pid, shown)))
    return found


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
    found = []
    for controller, folder in cpu_groups(pid, root):
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


def group_cpus(folder: str) -> int:
    """How many CPUs the processes of the cgroup ``folder`` and the groups below it
    may run on together (the union of their affinities; 0 when none can be read):
    what a quota on that group can fill (:data:`SEARCH_LIMIT` groups at most)."""
    cpus = set()
    for looked, (group, _, _) in enumerate(os.walk(folder), 1):
        try:
            pids = read_text(os.path.join(group, "cgroup.procs")).split()
        except OSError:
            pids = []
        for pid in pids:
            try:
                cpus |= os.sched_getaffinity(int(pid))
            except (OSError, ValueError, AttributeError):
                pass
        if looked >= SEARCH_LIMIT:
            break
    return len(cpus)


def usable_cpus() -> int:
    """How many CPUs this process may run on (its affinity where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


def quota_spread(cores: Optional[float], cpus: int) -> Optional[str]:
    """What goes wrong when a quota of ``cores`` may run on ``cpus`` CPUs, more than
    it can fill (``cpus > ceil(cores)``); None when it cannot (or without a quota).

    Horovod's background thread coordinates with its peers over MPI every cycle, and
    Open MPI polls while it waits. On a CPU of its own that polling spends the rank's
    quota while the training thread computes on another, so a rank's speed depends on
    how long its peers keep it polling: on this project's machine, ranks with equal
    quotas measured up to 1.6x apart from one window of steps to the next. On the
    training thread's CPU the two threads share the CPU instead (docs/cpu-quotas.rst).

    >>> quota_spread(0.3, 2).split(":")[0]
    'a CPU quota of 0.30 cores over 2 CPUs'
    >>> quota_spread(0.3, 1) is None and quota_spread(None, 8) is None
    True
    """
    if cores is None or cpus <= math.ceil(cores):
        return None
    return ("a CPU quota of %.2f cores over %d CPUs: Horovod's MPI thread polls on one CPU "
            "while the training thread computes on another, both from the one quota, so "
            "equal ranks run at unequal speeds that change from step to step" % (cores, cpus))
