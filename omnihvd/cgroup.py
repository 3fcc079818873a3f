"""This process's CPU quota, read from its cgroup (no writes, no torch).

A CFS quota (``docker run --cpus``, Kubernetes CPU limits, ``cpu.cfs_quota_us``)
lets a process run ``quota / period`` CPU-seconds per second: at full speed until
the period's budget is spent, then not at all. A rank that waits for its peers
between steps refills its budget while it waits, so at a small batch it measures
its full, unthrottled speed -- and is throttled once it is given the batch that
speed suggests. :class:`omnihvd.timing.StepTimer` therefore charges each step at
least its CPU time divided by this quota (the wall time it would take if the rank
worked without pause, as it does at balance).

cgroup v1 (``<root>/cpu/.../cpu.cfs_quota_us`` and ``cpu.cfs_period_us``) and v2
(``<root>/.../cpu.max``) are read; the limit is the smallest along the path from
the process's cgroup up to the root (a parent's quota binds its children too).
"""
import os
from typing import List, Optional

__all__ = ["cpu_quota_cores"]

_V1_MOUNTS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def _read(path) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _chain(base: str, path: str) -> List[str]:
    """Directories from ``base/path`` up to ``base`` that exist (the cgroup's own
    first); just ``base`` when the path is not visible (inside a container, its
    own cgroup is mounted as the root)."""
    parts = [p for p in path.strip("/").split("/") if p]
    dirs = [os.path.join(base, *parts[:k]) for k in range(len(parts), -1, -1)]
    found = [d for d in dirs if os.path.isdir(d)]
    return found or [base]


def _v1_limit(directory) -> Optional[float]:
    quota, period = _read(os.path.join(directory, "cpu.cfs_quota_us")), _read(
        os.path.join(directory, "cpu.cfs_period_us"))
    try:
        quota, period = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v2_limit(directory) -> Optional[float]:
    text = _read(os.path.join(directory, "cpu.max"))
    if not text:
        return None
    fields = text.split()
    try:
        if fields[0] == "max":
            return None
        quota, period = int(fields[0]), int(fields[1]) if len(fields) > 1 else 100000
    except (ValueError, IndexError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cpu_quota_cores(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") \
        -> Optional[float]:
    """CPU cores this process may use under its cgroup's CFS quota, or None (no quota,
    or no cgroup file readable).

    Args:
        root: where the cgroup file systems are mounted.
        self_cgroup: the file naming the process's cgroups (``/proc/self/cgroup``).

    Returns:
        float cores (e.g. 0.3 for ``--cpus=0.3``), or None.

    >>> cpu_quota_cores(root="/nonexistent", self_cgroup="/nonexistent") is None
    True
    """
    text = _read(self_cgroup)
    if text is None:
        return None
    limits = []
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # cgroup v2 (unified)
            if os.path.isfile(os.path.join(root, "cgroup.controllers")):
                limits += [_v2_limit(d) for d in _chain(root, path)]
            elif os.path.isdir(os.path.join(root, "unified")):  # hybrid: v2 beside v1
                limits += [_v2_limit(d) for d in _chain(os.path.join(root, "unified"), path)]
        elif "cpu" in controllers.split(","):
            for mount in _V1_MOUNTS:
                base = os.path.join(root, mount)
                if os.path.isdir(base):
                    limits += [_v1_limit(d) for d in _chain(base, path)]
                    break
    limits = [v for v in limits if v is not None]
    return min(limits) if limits else None
