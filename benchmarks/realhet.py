"""Real CPU heterogeneity, imposed from outside on an unmodified Horovod training script.

The ranks of examples/train_fashion_mnist.py (the README's drop-in lines, shaped like
Horovod's examples/pytorch/pytorch_mnist.py) are started under mpirun and made
unequal from the outside, as docker/Kubernetes would: each rank's process is found
(the children of mpirun whose /proc/PID/environ holds OMPI_COMM_WORLD_RANK), pinned
to a core set (every thread, like ``taskset -a -p -c``) and/or put in a cgroup with a
CFS quota (``cpu.cfs_quota_us``; v2 ``cpu.max``). Scenarios may change the placement
after an epoch (dynamic heterogeneity). See docs/real-heterogeneity.rst.

For each scenario, interleaved over ``--repeats`` repeats (the order rotated by one
place per repeat, see ``run_order``), it runs the script in
three modes: plain Horovod (equal split), omnihvd (default options) and fixed splits
(omnihvd's sampler and weighting, balancing off) derived from the known CPU shares
-- and, with ``--modes ...,tuned``, omnihvd with ``tune_split=True``; with
``seeded``, omnihvd started from each fixed split instead of the equal one; with
``alternate``, one more launch per repeat in which omnihvd and the fixed splits take
turns by epoch (benchmarks/train_turns.py; compared within the launch, see
``alternation``) --
and reports per mode the median time of the measured (last) epoch, the best fixed
split, the ratios and omnihvd's spread over repeats::

    flock -x /tmp/omnihvd-cpu.lock .venv/bin/python benchmarks/realhet.py \\
        --scenarios 2:1:1 --merge          # or bash benchmarks/run_realhet.sh

A scenario is a name from SCENARIOS or ``NAME=SPEC``. SPEC has one phase per epoch
boundary, separated by ``|`` (the last phase lasts to the end); a phase is
``pin=PLAN`` (per-rank CPU sets, e.g. ``0,1,1``: rank 0 alone on CPU 0, ranks 1-2
sharing CPU 1), ``quota=Q0,Q1,...`` (cores per rank, e.g. ``1,0.6,0.3``) or
``quota=HLk`` (the paper's level as CPU shares), or both separated by a space.

Results: <out>.json (every run) and <out>.md (the table).
"""
import argparse
import json
import os
import platform
import random
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)   # the harness's own omnihvd (cpulimits, emulate): not the code tested

from omnihvd.tools import cpulimits, emulate, levels  # noqa: E402
from omnihvd.controller import apportion  # noqa: E402
from omnihvd.cpuquota import CpuLimitError, find_cpu_controller  # noqa: E402

SCRIPT = os.path.join(ROOT, "examples", "train_fashion_mnist.py")
GROUP_PREFIX = "omnihvd-realhet-"
# The paper's levels as CPU shares: a worker's cores / 32, so HL8's fastest worker
# (32 cores) gets one whole core, and every level has the same total (1.5 cores).
HL_CORES_PER_CPU = float(max(max(c) for c in levels.LEVEL_CORES.values()))
SCENARIOS = {
    "2:1:1": "pin=0,1,1",
    "3:1:1:1": "pin=0,1,1,1",
    "quota-100/60/30": "quota=1,0.6,0.3",
    "HL1": "quota=HL1",
    "HL2": "quota=HL2",
    "HL4": "quota=HL4",
    "HL8": "quota=HL8",
    "2:1:1->1:2:1": "pin=0,1,1 | pin=1,0,1",
    # The same quotas, each rank also given a core of its own or shared (docker --cpus
    # with --cpuset-cpus): MPI's polling thread then competes with the training thread
    # on one CPU instead of using the quota on the other (docs/cpu-quotas.rst).
    "quota-100/60/30+cpuset": "pin=0,1,1 quota=1,0.6,0.3",
    "HL2+cpuset": "pin=0,0,1,1 quota=HL2",
    "HL4+cpuset": "pin=0,0,0,1 quota=HL4",
    "HL8+cpuset": "pin=0,0,0,1 quota=HL8",
}
DEFAULT_SCENARIOS = ("2:1:1", "3:1:1:1", "quota-100/60/30", "HL2", "HL4", "HL8", "2:1:1->1:2:1",
                     "quota-100/60/30+cpuset", "HL2+cpuset", "HL4+cpuset", "HL8+cpuset")
# What the example's rank 0 prints once every rank has started (data loaded, model
# built): with --place-when-ready the first phase is applied then, not at launch.
READY_LINE = "training starts"
EPOCH_LINE = re.compile(r"^epoch (\d+): ([\d.]+) s, test accuracy ([\d.]+), batch sizes "
                        r"\[([\d, ]+)\](?:, overhead ([\d.]+) ms/step)?")


class Phase(NamedTuple):
    """Placement of every rank during one phase: CPU sets and/or quotas (cores)."""
    cpus: Optional[List[Tuple[int, ...]]]
    quota: Optional[List[float]]

    @property
    def num_ranks(self) -> int:
        return len(self.cpus if self.cpus is not None else self.quota)


def parse_phase(text: str, available: Sequence[int]) -> Phase:
    """One phase of a scenario spec (see the module docstring)."""
    cpus = quota = None
    keys = [item.partition("=")[0] for item in text.split()]
    if len(set(keys)) < len(keys):
        raise SystemExit("phase %r: pin= and quota= once each" % text)
    for item in text.split():
        key, sep, value = item.partition("=")
        if key == "pin" and sep:
            cpus = emulate.parse_cpu_plan(value, available=available)
        elif key == "quota" and sep and value.upper() in levels.LEVEL_CORES:
            quota = [c / HL_CORES_PER_CPU for c in levels.LEVEL_CORES[value.upper()]]
        elif key == "quota" and sep:
            try:
                quota = [float(v) for v in value.split(",")]
            except ValueError:
                quota = None
            if not quota or not all(0 < q <= len(available) for q in quota):
                raise SystemExit("quota=%s: give cores per rank, each in (0, %d], e.g. "
                                 "quota=1,0.6,0.3, or a level such as quota=HL4"
                                 % (value, len(available)))
        else:
            raise SystemExit("cannot read %r in phase %r: write pin=PLAN and/or quota=LIST"
                             % (item, text))
    if cpus is None and quota is None:
        raise SystemExit("empty phase %r: write pin=PLAN and/or quota=LIST" % text)
    if cpus is not None and quota is not None and len(cpus) != len(quota):
        raise SystemExit("phase %r: pin names %d ranks, quota %d" % (text, len(cpus), len(quota)))
    return Phase(cpus, quota)


def parse_spec(spec: str, available: Sequence[int]) -> List[Phase]:
    phases = [parse_phase(p, available) for p in spec.split("|")]
    if len({p.num_ranks for p in phases}) != 1:
        raise SystemExit("scenario %r: every phase must place the same number of ranks" % spec)
    return phases


def _fill(caps: List[float], free: float) -> List[float]:
    """Share ``free`` cores between threads capped at ``caps`` (water-filling: what
    capped ones leave goes to the others)."""
    out, left = [0.0] * len(caps), list(range(len(caps)))
    while left:
        fair = free / len(left)
        capped = [r for r in left if caps[r] <= fair]
        if not capped:
            for r in left:
                out[r] = fair
            break
        for r in capped:
            out[r] = caps[r]
            free -= caps[r]
            left.remove(r)
    return out


def shares(phase: Phase, available: Sequence[int]) -> List[float]:
    """Each rank's expected CPU in cores: one busy thread per rank, capped by its quota;
    unpinned ranks share all CPUs, pinned ones each CPU of their set (a rank's cap
    split evenly over its CPUs), and what capped ranks leave goes to the others.

    >>> shares(parse_phase("pin=0,1,1 quota=1,0.6,0.3", [0, 1]), [0, 1])
    [1.0, 0.6, 0.3]
    >>> shares(parse_phase("pin=0,1,1", [0, 1]), [0, 1])
    [1.0, 0.5, 0.5]
    """
    n = phase.num_ranks
    cap = [1.0] * n if phase.quota is None else [min(1.0, q) for q in phase.quota]
    if phase.cpus is None:
        return _fill(cap, float(len(available)))
    out = [0.0] * n
    for cpu in sorted({c for cpus in phase.cpus for c in cpus}):
        users = [r for r, cpus in enumerate(phase.cpus) if cpu in cpus]
        for r, got in zip(users, _fill([cap[r] / len(phase.cpus[r]) for r in users], 1.0)):
            out[r] += got
    return out


def candidate_splits(phases: List[Phase], B: int, lambdas: Sequence[float],
                     available: Sequence[int]) -> List[List[int]]:
    """Fixed splits a user who knew the shares would try: equal + lambda*(proportional -
    equal) for each lambda for the last phase, and the proportional split of each
    earlier phase; duplicates and the equal split (= plain) dropped."""
    wanted = [(phases[-1], lam) for lam in lambdas] + [(p, 1.0) for p in phases[:-1]]
    return distinct_splits([scaled_split(shares(phase, available), B, lam)
                            for phase, lam in wanted])


def scaled_split(cores: Sequence[float], B: int, lam: float) -> List[int]:
    """The integer split of ``B`` at equal + lam * (proportional to ``cores`` - equal).

    >>> scaled_split([1.0, 0.5, 0.5], 192, 1.0), scaled_split([1.0, 0.5, 0.5], 192, 1.5)
    ([96, 48, 48], [112, 40, 40])
    """
    equal = apportion([1.0] * len(cores), B)
    prop = [B * v / sum(cores) for v in cores]
    return apportion([max(1e-9, e + lam * (p - e)) for e, p in zip(equal, prop)], B)


def distinct_splits(splits: Sequence[List[int]]) -> List[List[int]]:
    """The splits in order, each once, the equal split (= plain Horovod's) left out."""
    out = []
    for split in splits:
        if split not in out and split != apportion([1.0] * len(split), sum(split)):
            out.append(split)
    return out


def given_splits(text: str, num_ranks: int, B: int) -> List[List[int]]:
    """``--splits``: fixed splits joined by ``/``, each of ``num_ranks`` positive sizes
    summing to the global batch ``B``; SystemExit naming the one that is not.

    >>> given_splits("141,39,38,38/141,38,39,38", 4, 256)
    [[141, 39, 38, 38], [141, 38, 39, 38]]
    >>> given_splits("100,100", 4, 256)
    Traceback (most recent call last):
    ...
    SystemExit: --splits: 100,100 is not 4 positive sizes summing to the global batch 256
    """
    out = []
    for part in (p for p in text.split("/") if p):
        try:
            split = [int(v) for v in part.split(",")]
        except ValueError:
            split = []
        if len(split) != num_ranks or min(split) < 1 or sum(split) != B:
            raise SystemExit("--splits: %s is not %d positive sizes summing to the global "
                             "batch %d" % (part, num_ranks, B))
        out.append(split)
    return out


# ------------------------------------------------------------------ one run

# The variable that holds a rank's number in its environment, by launcher.
RANK_VARIABLE = {"mpirun": b"OMPI_COMM_WORLD_RANK=", "torchrun": b"RANK="}


def find_ranks(mpirun, n: int, timeout: float = 120.0, launcher: str = "mpirun") -> List[int]:
    """Pids of ranks 0..n-1: descendants of the launcher's Popen (``mpirun`` or
    ``torchrun``) whose environment names their rank."""
    variable = RANK_VARIABLE[launcher]
    deadline, found = time.time() + timeout, {}
    while time.time() < deadline and mpirun.poll() is None:
        found = {}
        for pid in cpulimits.descendants(mpirun.pid):
            try:
                with open("/proc/%d/environ" % pid, "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(variable):
                    found[int(item.split(b"=", 1)[1])] = pid
        if len(found) == n:
            return [found[r] for r in range(n)]
        time.sleep(0.02)
    raise RuntimeError("found only ranks %s of %d under mpirun %d (%s)"
                       % (sorted(found), n, mpirun.pid, "it exited" if mpirun.poll() is not None
                          else "not within %.0f s" % timeout))


class Placer:
    """Applies phases to the ranks of one run; owns the run's quota groups."""

    def __init__(self, pids: List[int], tag: str, period_us: int, available: Sequence[int]):
        self.pids, self.tag, self.period_us = pids, tag, period_us
        self.available = tuple(available)
        self.groups = {}
        self.created = []   # every group made, for the record

    def apply(self, phase: Phase) -> None:
        for rank, pid in enumerate(self.pids):
            cpus = phase.cpus[rank] if phase.cpus is not None else self.available
            cpulimits.pin(pid, cpus)
            quota = phase.quota[rank] if phase.quota is not None else None
            if quota is not None and rank not in self.groups:
                group = cpulimits.QuotaGroup("%s%d-%s-r%d" % (GROUP_PREFIX, os.getpid(), self.tag,
                                                             rank))
                self.groups[rank] = group
                self.created.append(group)
                group.set_quota(quota, self.period_us)
                group.add(pid)
            elif rank in self.groups:
                self.groups[rank].set_quota(quota, self.period_us)
                self.groups[rank].add(pid)   # threads started since

    def close(self):
        """Remove the groups; return their cpu.stat counters by rank (throttling)."""
        errors, stats = [], {rank: g.stats() for rank, g in self.groups.items()}
        for group in self.groups.values():
            try:
                group.close()
            except CpuLimitError as exc:
                errors.append(str(exc))
        self.groups = {}
        if errors:
            print("warning: " + "; ".join(errors), file=sys.stderr, flush=True)
        return stats


def process_cpu(pid: int, tid: Optional[int] = None) -> Optional[float]:
    """User + system CPU seconds of process ``pid`` (all its threads), or of its thread
    ``tid`` only; None once gone."""
    path = "/proc/%d/stat" % pid if tid is None else "/proc/%d/task/%d/stat" % (pid, tid)
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> Optional[Dict[int, float]]:
    """CPU seconds of each live thread of process ``pid``, by thread id; None once the
    process is gone. Under a quota, Horovod's background thread (which runs the
    collectives and waits in them) spends the same quota as the training thread.

    >>> cpu = thread_cpu(os.getpid())
    >>> os.getpid() in cpu and all(c >= 0 for c in cpu.values())
    True
    """
    tids = thread_ids(pid)
    if not tids:
        return None
    cpu = {t: process_cpu(pid, t) for t in tids}
    return {t: c for t, c in cpu.items() if c is not None}


def renice_threads(pid: int, nice: int, done: Set[int]) -> Set[int]:
    """Give every thread of process ``pid`` but its main one the nice value ``nice``
    (what ``renice -n NICE -p TID`` does), skipping the thread ids in ``done``; return
    the ids reniced now. In a rank these are Horovod's background thread (it polls in
    the collectives while waiting for its peers) and MPI's own threads; at a lower
    priority they take CPU only when the training thread does not want it, also under
    the rank's quota. Threads that exit meanwhile are skipped.

    >>> renice_threads(2 ** 22 + 12345, 19, set())   # no such process: nothing to do
    set()
    """
    reniced = set()
    for tid in thread_ids(pid) - done - {pid}:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:   # the thread (or the process) is gone
            continue
        reniced.add(tid)
    return reniced


ADDR_NO_RANDOMIZE = 0x0040000   # personality(2) flag that setarch -R sets


def randomisation_off(pid: int) -> Optional[bool]:
    """Whether process ``pid`` runs with address-space randomisation off (its
    personality has ADDR_NO_RANDOMIZE, as under ``setarch -R``); None once it is gone.

    >>> randomisation_off(os.getpid()) in (True, False)
    True
    """
    try:
        with open("/proc/%d/personality" % pid) as f:
            return bool(int(f.read(), 16) & ADDR_NO_RANDOMIZE)
    except (OSError, ValueError):
        return None


def thread_ids(pid: int) -> Set[int]:
    """The ids of the live threads of process ``pid`` (none once it is gone)."""
    try:
        return {int(t) for t in os.listdir("/proc/%d/task" % pid)}
    except OSError:
        return set()


def main_thread_first(cpu: Dict[int, float], pid: int) -> List[float]:
    """A rank's threads' CPU seconds as reported: the main thread first, then the
    others from the busiest down, those under 0.01 s left out.

    >>> main_thread_first({7: 1.5, 9: 0.004, 8: 3.25, 10: 0.5}, 7)
    [1.5, 3.25, 0.5]
    """
    others = sorted((c for t, c in cpu.items() if t != pid and c >= 0.01), reverse=True)
    return [round(c, 2) for c in [cpu.get(pid, 0.0)] + others]


def machine_cpu() -> Tuple[float, float]:
    """``(busy, steal)``: CPU seconds used on this machine so far by everyone, and of
    those the hypervisor's *steal* (/proc/stat): time a virtual CPU wanted to run and
    the host ran another guest instead. Steal slows every rank whatever its quota.

    >>> busy, steal = machine_cpu()
    >>> 0 <= steal <= busy
    True
    """
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]   # idle + iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - idle) / tick, fields[7] / tick


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(args, phases: List[Phase], mode: str, split: Optional[List[int]], tag: str) -> dict:
    """One mpirun of the training script under the scenario's placements."""
    n = phases[0].num_ranks
    epochs = args.epochs or len(phases) + 1
    if args.launcher == "torchrun":
        launch = [args.torchrun, "--standalone", "--nproc-per-node", str(n),
                  "--monitor-interval", "1"]
    else:
        launch = [args.mpirun, "-np", str(n), "--oversubscribe", "--bind-to", "none"]
        # setarch -R turns address-space randomisation off, then execs (same pid)
        launch += (["setarch", platform.machine(), "-R"] if args.no_aslr else []) + [args.python]
    # seeded: omnihvd (balancing on) started from a fixed split instead of the equal one
    script_mode, split_flag = (("omnihvd", "--start-split") if mode == "seeded"
                               else (mode, "--split"))
    if mode == "alternate":   # omnihvd and fixed splits taking turns by epoch
        cmd = launch + [os.path.join(args.code, "benchmarks", "train_turns.py"),
                        "--turns", turns_text(split)]
    else:
        cmd = launch + [args.script, "--mode", script_mode]
        if split is not None:
            cmd += [split_flag, turns_text(split)]
    cmd += ["--epochs", str(epochs), "--global-batch-size", str(args.batch_per_rank * n)]
    cmd += args.script_args
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (args.code, env.get("PYTHONPATH")) if p)
    env.update(dict(e.split("=", 1) for e in args.env))
    lines, epoch_seen = [], threading.Condition()
    started, cpu0, (busy0, steal0) = time.time(), children_cpu(), machine_cpu()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)

    steal_at_epoch_end: List[float] = []   # the machine's steal when each epoch line came

    def read():
        for line in proc.stdout:
            with epoch_seen:
                lines.append(line.rstrip("\n"))
                if EPOCH_LINE.match(lines[-1]):
                    steal_at_epoch_end.append(machine_cpu()[1])
                epoch_seen.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    placer, changes, error, pids, throttling, rank_cpu = None, [], None, [], {}, []
    aslr_off: List[Optional[bool]] = []
    reniced: List[Set[int]] = []   # per rank, the threads given --thread-nice
    rank_threads: List[Dict[int, float]] = []
    try:
        pids = find_ranks(proc, n, launcher=args.launcher)
        placer = Placer(pids, tag, args.period_us, args.available)
        placed = not args.place_when_ready
        if placed:
            placer.apply(phases[0])
            changes.append({"phase": 0, "t": time.time() - started})
        starts = phase_starts(len(phases), epochs,
                              len(split) if mode == "alternate" else None)
        next_phase, deadline = 1, started + args.run_timeout
        rank_cpu, rank_threads, threads_read = [0.0] * n, [{} for _ in pids], 0.0
        reniced = [set() for _ in pids]
        aslr_off: List[Optional[bool]] = [None] * n
        while proc.poll() is None and time.time() < deadline:
            # Each rank's CPU time, last seen alive: shows time spent polling in waits.
            rank_cpu = [c if c is not None else old
                        for c, old in zip(map(process_cpu, pids), rank_cpu)]
            if time.time() - threads_read >= 0.25:   # each thread as last seen alive
                threads_read = time.time()
                aslr_off = [a if a is not None else old
                            for a, old in zip(map(randomisation_off, pids), aslr_off)]
                for seen, now in zip(rank_threads, map(thread_cpu, pids)):
                    seen.update(now or {})
                if args.thread_nice is not None:   # threads started since, too
                    for tids, rank_pid in zip(reniced, pids):
                        tids |= renice_threads(rank_pid, args.thread_nice, tids)
            with epoch_seen:
                epoch_seen.wait(0.05)
                done = [int(m.group(1)) for m in map(EPOCH_LINE.match, lines) if m]
                ready = READY_LINE in lines
            if not placed and (ready or done):
                placer.apply(phases[0])
                changes.append({"phase": 0, "t": time.time() - started, "when_ready": ready})
                placed = True
                if not ready:
                    error = "no %r line before the first epoch's (--place-when-ready)" % READY_LINE
            if next_phase < len(phases) and done and max(done) >= starts[next_phase - 1]:
                placer.apply(phases[next_phase])
                changes.append({"phase": next_phase, "t": time.time() - started,
                                "after_epoch": starts[next_phase - 1]})
                next_phase += 1
        if proc.poll() is None:
            error = "timed out after %d s" % args.run_timeout
    except (RuntimeError, CpuLimitError) as exc:
        error = str(exc)
    finally:
        if proc.poll() is None:
            cpulimits.kill_session(proc.pid)
        proc.wait()
        reader.join(5)
        with epoch_seen:   # what the reader has seen, each epoch line with its steal
            output, steal_marks = list(lines), [steal0] + steal_at_epoch_end
        if placer is not None:
            throttling = placer.close()
    own_cpu = children_cpu() - cpu0
    busy, steal = machine_cpu()
    record = {"mode": mode, "split": split, "rc": proc.returncode, "error": error,
              "wall_s": time.time() - started, "cpu_s": own_cpu,
              # other processes' CPU *and* the hypervisor's steal; steal_s: steal alone
              "foreign_cpu_s": max(0.0, busy - busy0 - own_cpu),
              "steal_s": round(steal - steal0, 3),
              "changes": changes, "epochs": [], "mpirun_pid": proc.pid, "pids": pids,
              "groups": [g.path for g in placer.created] if placer is not None else [],
              "cgroup_stats": throttling, "rank_cpu_s": rank_cpu,
              "rank_thread_cpu_s": [main_thread_first(t, pid)
                                    for t, pid in zip(rank_threads, pids)],
              "reniced_threads": [len(r) for r in reniced],
              # per rank, whether it ran with address-space randomisation off (--no-aslr)
              "aslr_off": aslr_off}
    # omnihvd's own log of its size changes (rank 0, INFO): why a run settled where it did.
    record["decisions"] = [line for line in output if line.startswith("omnihvd: step ")]
    # steal from the previous epoch line (the start, for the first) to this one
    epoch_steal = [round(b - a, 3) for a, b in zip(steal_marks, steal_marks[1:])]
    for m in map(EPOCH_LINE.match, output):
        if m:
            record["epochs"].append({"epoch": int(m.group(1)), "seconds": float(m.group(2)),
                                     "steal_s": epoch_steal[len(record["epochs"])],
                                     "accuracy": float(m.group(3)),
                                     "sizes": [int(v) for v in m.group(4).split(",")],
                                     # the callback's own cost per step on rank 0
                                     "overhead_ms": float(m.group(5)) if m.group(5) else None})
    if proc.returncode != 0 or error or len(record["epochs"]) != epochs:
        record["error"] = error or "exit %s, %d of %d epoch lines" % (
            proc.returncode, len(record["epochs"]), epochs)
        record["output_tail"] = "\n".join(output[-40:])
    else:
        record["measured_s"] = record["epochs"][-1]["seconds"]
        record["final_sizes"] = record["epochs"][-1]["sizes"]
    return record


# ------------------------------------------------------------------ scenarios

def disturbed(record: dict, max_foreign_cpu: Optional[float]) -> bool:
    """Whether other processes used more than ``max_foreign_cpu`` CPU seconds during a
    run (a shared machine: such a run measures the neighbours, so it is run again).

    >>> disturbed({"foreign_cpu_s": 2.5}, 1.5), disturbed({"foreign_cpu_s": 2.5}, None)
    (True, False)
    """
    return max_foreign_cpu is not None and record["foreign_cpu_s"] > max_foreign_cpu


def turns_text(split) -> str:
    """A split as ``--split`` takes it, or turns as ``train_turns.py --turns`` does.

    >>> turns_text([24, 12, 12]), turns_text(["omnihvd", [24, 12, 12], [12, 18, 18]])
    ('24,12,12', 'omnihvd/24,12,12/12,18,18')
    """
    if split and isinstance(split[0], (str, list, tuple)):
        return "/".join(t if isinstance(t, str) else turns_text(t) for t in split)
    return ",".join(map(str, split))


def run_order(num_modes: int, repeat: int) -> List[int]:
    """The order in which one repeat runs the modes: rotated by one place per repeat, so
    that over ``num_modes`` repeats each mode runs once in each position (a run's time
    drifts with its place in the sequence on a shared machine; a fixed order would charge
    that drift to whichever mode always runs there).

    >>> [run_order(3, r) for r in range(4)]
    [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    """
    first = repeat % num_modes
    return list(range(first, num_modes)) + list(range(first))


def plan_modes(args, phases: List[Phase]) -> List[Tuple[str, Any]]:
    """The launches of one scenario: ``(mode, split)``, or ``("alternate", turns)``;
    SystemExit when the options cannot run it (``parse_args`` checks every scenario
    before the first launch)."""
    n = phases[0].num_ranks
    B = args.batch_per_rank * n
    if args.epochs is not None and args.epochs < len(phases):
        raise SystemExit("--epochs %d: a scenario of %d phases needs an epoch in each (the "
                         "default is one more, for a first unmeasured epoch)"
                         % (args.epochs, len(phases)))
    for phase in phases:
        if phase.quota is not None and min(phase.quota) * args.period_us < 1000:
            raise SystemExit("quota %s with --period-us %d: a CFS quota is at least 1000 us "
                             "per period" % (",".join("%g" % q for q in phase.quota),
                                             args.period_us))
    modes = [(m, None) for m in ("plain", "omnihvd", "tuned") if m in args.modes]
    candidates = candidate_splits(phases, B, args.lambdas, args.available)
    candidates += [s for s in given_splits(args.splits, n, B) if s not in candidates]
    modes += [(m, s) for m in ("fixed", "seeded") if m in args.modes for s in candidates]
    if "alternate" in args.modes:
        # --equal-turn: plain Horovod's split as a fixed turn, timed in the same launch
        equal = [apportion([1.0] * n, B)] if args.equal_turn else []
        turns = args.turns + [s for s in equal if s not in candidates] + candidates
        if len({str(t) for t in turns}) < len(turns):   # their epochs would be pooled
            raise SystemExit("--turns %s: each turn once" % ",".join(args.turns))
        check_alternation(len(phases), len(turns), args.epochs, args.steps, args.launcher)
        modes.append(("alternate", turns))
    return modes


def run_scenario(args, name: str, spec: str) -> dict:
    phases = parse_spec(spec, args.available)
    n = phases[0].num_ranks
    B = args.batch_per_rank * n
    modes = plan_modes(args, phases)
    runs = []
    for repeat in range(args.repeats):
        for position, k in enumerate(run_order(len(modes), repeat)):
            mode, split = modes[k]
            if mode == "alternate":   # each turn in each place, over repeats
                split = [split[i] for i in run_order(len(split), repeat)]
            tag = "%d-%d" % (repeat, k)
            rec = run_once(args, phases, mode, split, tag)
            for retry in range(args.retries):
                if not disturbed(rec, args.max_foreign_cpu):
                    break
                print("  %-16s repeat %d %-7s rerun: %.1f s of foreign CPU" % (
                    name, repeat, mode, rec["foreign_cpu_s"]), flush=True)
                rec = dict(run_once(args, phases, mode, split, "%s-%d" % (tag, retry)),
                           disturbed_before=retry + 1)
            rec["repeat"], rec["position"] = repeat, position
            runs.append(rec)
            print("  %-16s repeat %d %-7s %-16s %s" % (
                name, repeat, mode, turns_text(split) if split else "",
                "%.3f s, sizes %s, foreign cpu %.1f s (steal %.1f s)" % (
                    rec["measured_s"], rec["final_sizes"], rec["foreign_cpu_s"], rec["steal_s"])
                if "measured_s" in rec else "FAILED: " + failure(rec)), flush=True)
    return summarize(name, spec, phases, B, runs, args)


def check_alternation(num_phases: int, num_turns: int, epochs: Optional[int],
                      steps: Optional[int], launcher: str = "mpirun") -> None:
    """Mode ``alternate`` needs epochs of a fixed length, Horovod (mpirun), and as
    many epochs for every turn: a first round (a warm-up, left out), then as many
    rounds in each phase of the placement, at least one (``phase_starts``).

    >>> check_alternation(1, 3, 6, 100)
    >>> check_alternation(2, 3, 9, 100)     # warm-up, one round per phase
    >>> check_alternation(1, 3, 5, 100)
    Traceback (most recent call last):
    ...
    SystemExit: --modes alternate: each of the 3 turns needs as many epochs, a first round (left out) and as many rounds in each of 1 phase(s): --epochs 3 x (1 + 1 x m), m >= 1 (6, 9, ...), not 5
    """
    if launcher != "mpirun":
        raise SystemExit("--modes alternate runs benchmarks/train_turns.py, a Horovod script: "
                         "use --launcher mpirun")
    if not steps:
        raise SystemExit("--modes alternate needs epochs of a fixed length: --steps N")
    rounds = (epochs or 0) // num_turns - 1
    if (epochs is None or epochs % num_turns or rounds < num_phases
            or rounds % num_phases):
        raise SystemExit(
            "--modes alternate: each of the %d turns needs as many epochs, a first round "
            "(left out) and as many rounds in each of %d phase(s): --epochs %d x (1 + %d x m), "
            "m >= 1 (%d, %d, ...), not %s"
            % (num_turns, num_phases, num_turns, num_phases, num_turns * (1 + num_phases),
               num_turns * (1 + 2 * num_phases), epochs))


def phase_starts(num_phases: int, epochs: int, num_turns: Optional[int] = None) -> List[int]:
    """After which epoch each phase after the first begins.

    One phase per epoch boundary (phase i after epoch i-1, the last to the end); with
    ``num_turns`` (mode ``alternate``) the rounds of turns after the warm-up round are
    shared out equally: phase i begins after ``i`` such shares, so every turn runs as
    many epochs in each phase, and the balancing turns meet each change from where
    the other phase left them.

    >>> phase_starts(2, 3)
    [0]
    >>> phase_starts(2, 15, num_turns=3)   # warm-up round + 2 rounds per phase
    [8]
    >>> phase_starts(1, 6, num_turns=3)
    []
    """
    if num_turns is None:
        return list(range(num_phases - 1))
    per_phase = (epochs // num_turns - 1) // num_phases
    return [num_turns * (1 + i * per_phase) - 1 for i in range(1, num_phases)]


def alternation(runs: List[dict]) -> Optional[dict]:
    """Mode ``alternate``: omnihvd and fixed splits taking turns by epoch in each launch.

    Epoch e of a launch trains with turn ``e mod k`` of its turns (``split``: the
    balancing turns of ``--turns``, omnihvd by default, then the candidate splits, the
    order rotated over repeats); the first round
    of k epochs is a warm-up (omnihvd converges there) and left out. Per launch and
    turn: the median time of its epochs; when the placement changed during the launch
    (``changes``: more than its first phase), the mean, so that each turn's epochs
    after a change (omnihvd re-settling) count as they cost. Paired within one launch,
    the turns share whatever makes a launch fast or slow (docs/cpu-quotas.rst, "Runs in a fast or a
    slow mode"), which across launches moves a split's time by up to 2x here. Per
    turn: the median over launches of its time over the first turn's in the same
    launch (``first_over``: the first turn's throughput over it, omnihvd's over a fixed
    split; above 1 the first is faster), a 95% bootstrap interval of that median over
    launches (``median_interval``), in how many launches it was the fastest, and two
    spreads over launches (:func:`spread`): ``spread`` of the turn's own times (which
    the launch's speed moves too) and ``first_over_spread`` of its ratio to the first
    turn (what pairing leaves). None without such launches.

    >>> runs = [{"mode": "alternate", "repeat": r, "measured_s": 1.0,
    ...          "split": [["omnihvd", [1, 2]][(i + r) % 2] for i in range(2)],
    ...          "epochs": [{"seconds": t} for t in times]}
    ...         for r, times in enumerate([(9, 9, 1.0, 2.0, 1.0, 2.0), (9, 9, 2.2, 1.1, 2.2, 1.1),
    ...                                    (9, 9, 1.6, 3.0, 1.6, 3.0)])]
    >>> doc = alternation(runs)
    >>> doc["turns"], doc["first_over"], doc["fastest"]   # omnihvd twice as fast
    (['omnihvd', [1, 2]], [1.0, 2.0], [3, 0])
    >>> doc["per_launch"][1]
    [1.1, 2.2]
    >>> doc["spread"], doc["first_over_spread"]   # the launches' speeds apart, not the pair
    ([0.545, 0.455], [0.0, 0.062])
    """
    done = sorted((r for r in runs if r["mode"] == "alternate" and "measured_s" in r),
                  key=lambda r: r["repeat"])
    if not done:
        return None
    key = lambda t: t if isinstance(t, str) else tuple(t)  # noqa: E731
    first = done[0]["split"]
    turns = [first[i] for i in run_order(len(first), -done[0]["repeat"] % len(first))]
    per_launch = []
    for r in done:
        order = [key(t) for t in r["split"]]
        by_turn = {}
        for e, epoch in enumerate(r["epochs"]):
            if e >= len(order):   # the first round is a warm-up
                by_turn.setdefault(order[e % len(order)], []).append(epoch["seconds"])
        average = statistics.mean if len(r.get("changes", ())) > 1 else statistics.median
        per_launch.append([average(by_turn[key(t)]) for t in turns])
    ratios = [[t / times[0] for t in times] for times in per_launch]
    return {"turns": turns, "launches": len(done), "per_launch": per_launch,
            "first_over": [round(statistics.median(col), 3) for col in zip(*ratios)],
            "first_over_ci": [median_interval(list(col)) for col in zip(*ratios)],
            "spread": [_round3(spread(col)) for col in zip(*per_launch)],
            "first_over_spread": [_round3(spread(col)) for col in zip(*ratios)],
            "fastest": [sum(min(range(len(t)), key=t.__getitem__) == i for t in per_launch)
                        for i in range(len(turns))]}


def spread(values: Sequence[float]) -> Optional[float]:
    """How far repeats of one measurement lie apart: ``(max - min) / median``; None
    with fewer than two.

    >>> round(spread([4.0, 4.4, 4.2]), 3)
    0.095
    """
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else None


def _round3(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 3)


def median_interval(values: Sequence[float], level: float = 0.95, draws: int = 4000,
                    seed: int = 0) -> Optional[List[float]]:
    """A percentile bootstrap interval of the median of ``values`` (one per launch),
    seeded; None with fewer than 3 values.

    >>> median_interval([1.0, 1.1, 0.9, 1.0, 1.05])
    [0.9, 1.1]
    """
    if len(values) < 3:
        return None
    return percentile_bootstrap(
        lambda rng: statistics.median(rng.choices(values, k=len(values))), level, draws, seed)


def percentile_bootstrap(draw, level: float, draws: int, seed: int) -> List[float]:
    """The central ``level`` interval of ``draws`` values of ``draw(rng)`` (one
    resample each, from a ``random.Random(seed)``), rounded to 3 places."""
    rng = random.Random(seed)
    values = sorted(draw(rng) for _ in range(draws))
    tail = (1 - level) / 2
    return [round(values[int(tail * (draws - 1))], 3),
            round(values[int(round((1 - tail) * (draws - 1)))], 3)]


def failure(record: dict) -> str:
    """A failed run's error with the last line its processes printed (mpirun's reason).

    >>> failure({"error": "exit 1", "output_tail": "x\\nmpirun has detected root\\n"})
    'exit 1; last output: mpirun has detected root'
    """
    last = [line.strip() for line in record.get("output_tail", "").splitlines() if line.strip()]
    return record["error"] + ("; last output: " + last[-1] if last else "")


def _median(runs, mode, split=None):
    times = [r["measured_s"] for r in runs if r["mode"] == mode and r["split"] == split
             and "measured_s" in r]
    return (statistics.median(times), times) if times else (None, [])


def held_out_best(times: dict) -> List[float]:
    """The best fixed split as a user would get it, free of the winner's curse: for each
    repeat, the split with the lowest median over the *other* repeats, timed on this one.

    The lowest of several noisy medians is biased low by about their noise (the in-sample
    best fixed split); choosing on some repeats and reporting on another is not.
    ``times`` maps a split to ``{repeat: seconds}``; returns one time per repeat that
    could be held out (one per repeat from the second on; none with a single repeat).

    >>> held_out_best({(2, 1): {0: 1.0, 1: 3.0, 2: 1.1}, (3, 1): {0: 2.0, 1: 1.5, 2: 2.1}})
    [2.0, 3.0, 2.1]
    """
    out = []
    for repeat in sorted({r for by_repeat in times.values() for r in by_repeat}):
        others = {s: [t for r, t in by.items() if r != repeat] for s, by in times.items()
                  if repeat in by}
        others = {s: statistics.median(t) for s, t in others.items() if t}
        if others:
            out.append(times[min(others, key=others.get)][repeat])
    return out


def summarize(name, spec, phases, B, runs, args) -> dict:
    plain, plain_times = _median(runs, "plain")
    omni, omni_times = _median(runs, "omnihvd")
    fixed = {}
    for r in runs:
        if r["mode"] == "fixed":
            fixed.setdefault(tuple(r["split"]), None)
    fixed = {s: _median(runs, "fixed", list(s)) for s in fixed}
    best = min((s for s in fixed if fixed[s][0] is not None), key=lambda s: fixed[s][0],
               default=None)
    best_s = fixed[best][0] if best is not None else None

    def ratio(a, b):
        return a / b if a and b else None

    return with_held_out({
        "scenario": name, "spec": spec, "ranks": phases[0].num_ranks, "global_batch": B,
        "steps_per_epoch": args.steps or None, "epochs": args.epochs or len(phases) + 1,
        "code_tree": args.code, "code_version": code_version(args.code),
        "command": args.command,
        "shares": [[round(v, 4) for v in shares(p, args.available)] for p in phases],
        "period_us": args.period_us, "env": args.env, "thread_nice": args.thread_nice,
        "no_aslr": args.no_aslr,
        "repeats": args.repeats,
        "plain_s": plain, "omnihvd_s": omni, "best_fixed_s": best_s,
        "best_fixed_split": list(best) if best is not None else None,
        "fixed": [{"split": list(s), "median_s": m, "times": t} for s, (m, t) in fixed.items()],
        "omnihvd_vs_best_fixed": ratio(best_s, omni),   # throughput ratio, >= 0.97 wanted
        "omnihvd_vs_plain": ratio(plain, omni),          # speed-up over plain Horovod
        "fixed_vs_plain": ratio(plain, best_s),
        "omnihvd_times": omni_times, "plain_times": plain_times,
        "omnihvd_spread": spread(omni_times),
        "best_fixed_spread": spread(fixed[best][1]) if best is not None else None,
        "omnihvd_final_sizes": [r["final_sizes"] for r in runs
                                if r["mode"] == "omnihvd" and "final_sizes" in r],
        "failed_runs": sum("measured_s" not in r for r in runs),
        "foreign_cpu_s_max": max((r["foreign_cpu_s"] for r in runs), default=None),
        "position_effect": position_effect(runs),
        "seeded": seeded_summary(runs, fixed),
        "alternation": alternation(runs),
        "runs": runs,
    })


def seeded_summary(runs: List[dict], fixed: dict) -> List[dict]:
    """Mode ``seeded`` (omnihvd started from a fixed split) beside that fixed split: its
    median, times and throughput ratio to it with a 95% interval over launches.

    >>> runs = [{"mode": m, "split": [3, 1], "measured_s": t}
    ...         for m, times in (("seeded", [2.0, 2.2, 2.1]), ("fixed", [2.1, 2.1, 2.1]))
    ...         for t in times]
    >>> seeded_summary(runs, {(3, 1): (2.1, [2.1, 2.1, 2.1])})[0]["vs_fixed"]
    1.0
    """
    out = []
    for split in dict.fromkeys(tuple(r["split"]) for r in runs if r["mode"] == "seeded"):
        median, times = _median(runs, "seeded", list(split))
        fixed_s, fixed_times = fixed.get(split, (None, []))
        out.append({"split": list(split), "median_s": median, "times": times,
                    "vs_fixed": fixed_s / median if fixed_s and median else None,
                    "vs_fixed_ci": ratio_interval(fixed_times, times)})
    return out


def position_effect(runs: List[dict]) -> Optional[List[float]]:
    """How a run's time drifts with its place in the repeat: per position, the median
    over the runs there of each run's time over its mode's median (1.0: no effect).
    None for results of harnesses that did not record positions.

    >>> runs = [{"mode": m, "split": None, "repeat": r, "position": (i + r) % 2,
    ...          "measured_s": t * (1.1 if (i + r) % 2 else 1.0)}
    ...         for r in range(2) for i, (m, t) in enumerate([("plain", 3.0), ("omnihvd", 2.0)])]
    >>> position_effect(runs)
    [0.952, 1.048]
    """
    timed = [r for r in runs if "measured_s" in r and "position" in r]
    if not timed:
        return None
    by_position = {}
    for r in timed:
        mode_median = _median(runs, r["mode"], r["split"])[0]
        by_position.setdefault(r["position"], []).append(r["measured_s"] / mode_median)
    return [round(statistics.median(by_position[p]), 3) for p in sorted(by_position)]


def ratio_interval(slower: Sequence[float], faster: Sequence[float], level: float = 0.95,
                   draws: int = 4000, seed: int = 0) -> Optional[List[float]]:
    """How far the ratio of two modes' median times could move with other launches: a
    percentile bootstrap interval of ``median(slower) / median(faster)``, each mode's
    times resampled on their own (launches are independent; on this VM a launch's speed
    is set when it starts, see docs/cpu-quotas.rst). Seeded, so a file rewrites the same.

    With times that change by 30% from one launch to the next, three repeats a mode
    leave the ratio anywhere in a wide band; this says how wide. None with fewer than 3
    times on either side (too few to resample).

    >>> ratio_interval([2.0, 2.1, 2.2, 1.9, 2.0], [1.0, 1.05, 0.95, 1.0, 1.1])
    [1.818, 2.2]
    >>> ratio_interval([2.0, 2.1], [1.0, 1.0, 1.0]) is None
    True
    """
    if min(len(slower), len(faster)) < 3:
        return None
    return percentile_bootstrap(
        lambda rng: (statistics.median(rng.choices(slower, k=len(slower)))
                     / statistics.median(rng.choices(faster, k=len(faster)))),
        level, draws, seed)


def with_held_out(result: dict) -> dict:
    """``result`` (one scenario's summary) with the held-out best fixed split added."""
    times = {}
    for r in result["runs"]:
        if r["mode"] == "fixed" and "measured_s" in r:
            times.setdefault(tuple(r["split"]), {})[r["repeat"]] = r["measured_s"]
    held_out = held_out_best(times)
    held_s = statistics.median(held_out) if held_out else None
    omni = result["omnihvd_s"]
    omni_times, plain_times = result.get("omnihvd_times", []), result.get("plain_times", [])
    result.update({"best_fixed_held_out_s": held_s, "best_fixed_held_out_times": held_out,
                   "omnihvd_vs_best_fixed_held_out": held_s / omni if held_s and omni else None,
                   # 95% intervals of the two throughput ratios above over launches
                   "omnihvd_vs_best_fixed_held_out_ci": ratio_interval(held_out, omni_times),
                   "omnihvd_vs_plain_ci": ratio_interval(plain_times, omni_times)})
    return with_tuned(result)


def with_tuned(result: dict) -> dict:
    """``result`` with the ``tuned`` mode's figures (omnihvd with ``tune_split=True``)
    when it ran: its median time, its ratios to the others, and the time ratio of each
    repeat's tuned run to its omnihvd run (interleaved: they ran side by side).

    >>> runs = [{"mode": m, "split": None, "repeat": r, "measured_s": t, "final_sizes": [1]}
    ...         for r, (a, b) in enumerate([(2.0, 1.8), (2.2, 2.0), (2.1, 2.1)])
    ...         for m, t in (("omnihvd", a), ("tuned", b))]
    >>> doc = with_tuned({"runs": runs, "plain_s": 3.0, "omnihvd_s": 2.1,
    ...                   "best_fixed_held_out_s": 1.9})
    >>> doc["tuned_s"], round(doc["tuned_vs_omnihvd"], 3), doc["tuned_over_omnihvd_paired"]
    (2.0, 1.05, [0.9, 0.909, 1.0])
    """
    tuned, tuned_times = _median(result["runs"], "tuned")
    if tuned is None:
        return result
    by_repeat = {}
    for r in result["runs"]:
        if r["mode"] in ("omnihvd", "tuned") and "measured_s" in r:
            by_repeat.setdefault(r["repeat"], {})[r["mode"]] = r["measured_s"]
    paired = [round(v["tuned"] / v["omnihvd"], 3) for _, v in sorted(by_repeat.items())
              if len(v) == 2]
    held, plain, omni = (result.get(k) for k in ("best_fixed_held_out_s", "plain_s",
                                                  "omnihvd_s"))
    result.update({
        "tuned_s": tuned, "tuned_times": tuned_times,
        "tuned_vs_omnihvd": omni / tuned if omni else None,   # throughput ratio
        "tuned_vs_plain": plain / tuned if plain else None,
        "tuned_vs_best_fixed_held_out": held / tuned if held else None,
        "tuned_over_omnihvd_paired": paired,                  # time ratios, < 1 is faster
        "tuned_final_sizes": [r["final_sizes"] for r in result["runs"]
                              if r["mode"] == "tuned" and "final_sizes" in r]})
    return result


def _fmt(v, f="%.3f"):
    return "-" if v is None else f % v


def _interval(ci, f) -> str:
    return "" if ci is None else " (%s-%s)" % (f % ci[0], f % ci[1])


def markdown(doc) -> str:
    commands = []
    for s in doc["scenarios"]:
        line = "`%s` (code %s at %s)" % (s.get("command", doc["command"]),
                                        s.get("code_tree", doc["code_tree"]),
                                        s.get("code_version", doc["code_version"]) or "?")
        if line not in commands:
            commands.append(line)
    out = ["Commands: " + "; ".join(commands), "",
           "Machine: %s; %d CPUs; last scenario finished %s UTC." % (
               doc["machine"]["platform"], doc["machine"]["cpus"], doc["finished"]), "",
           "Times are the median over the repeats of the last epoch's training time "
           "(seconds); ratios are throughput ratios (higher is better for the first named). "
           "Best fixed: the split with the lowest median (biased low: the least of several "
           "noisy medians); held out: per repeat, the split best on the other repeats, timed "
           "on this one (what a user who picked it would get). In brackets: a 95% bootstrap "
           "interval of the ratio over launches (`ratio_interval`; 3 repeats or more).", "",
           "| scenario | spec | steps x epochs | plain s | omnihvd s | best fixed s (split) "
           "| omnihvd / best fixed | held-out best fixed s | omnihvd / held-out best fixed "
           "| omnihvd / plain | fixed / plain | omnihvd spread | omnihvd final sizes |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in doc["scenarios"]:
        extra = []
        if s["period_us"] != 10000:
            extra.append("period %g ms" % (s["period_us"] / 1000))
        extra += s["env"]
        if s.get("thread_nice") is not None:
            extra.append("threads but the main one at nice %d" % s["thread_nice"])
        if s.get("no_aslr"):
            extra.append("address-space randomisation off")
        out.append("| %s | `%s`%s | %s x %s | %s | %s | %s (%s) | %s | %s | %s | %s | %s | %s "
                   "| %s |" % (
            s["scenario"], s["spec"].replace("|", "\\|"), (" " + ", ".join(extra)) if extra else "",
            s.get("steps_per_epoch") or "full", s.get("epochs", "?"),
            _fmt(s["plain_s"]), _fmt(s["omnihvd_s"]), _fmt(s["best_fixed_s"]),
            ",".join(map(str, s["best_fixed_split"] or [])) or "-",
            _fmt(s["omnihvd_vs_best_fixed"], "%.2f"), _fmt(s.get("best_fixed_held_out_s")),
            _fmt(s.get("omnihvd_vs_best_fixed_held_out"), "%.2f")
            + _interval(s.get("omnihvd_vs_best_fixed_held_out_ci"), "%.2f"),
            _fmt(s["omnihvd_vs_plain"], "%.2fx") + _interval(s.get("omnihvd_vs_plain_ci"), "%.2fx"),
            _fmt(s["fixed_vs_plain"], "%.2fx"), _fmt(s["omnihvd_spread"] and
                                                     100 * s["omnihvd_spread"], "%.1f%%"),
            " ".join("/".join(map(str, v)) for v in s["omnihvd_final_sizes"])))
    tuned = [s for s in doc["scenarios"] if s.get("tuned_s") is not None]
    if tuned:
        out += ["", "With `tune_split=True` (mode `tuned`, the split also tuned by the step "
                "period), in the same runs:", "",
                "| scenario | tuned s | tuned / omnihvd | tuned time / omnihvd time, per repeat "
                "| tuned / held-out best fixed | tuned / plain | tuned final sizes |",
                "|---|---|---|---|---|---|---|"]
        for s in tuned:
            out.append("| %s | %s | %s | %s | %s | %s | %s |" % (
                s["scenario"], _fmt(s["tuned_s"]), _fmt(s["tuned_vs_omnihvd"], "%.2f"),
                " ".join("%.2f" % v for v in s["tuned_over_omnihvd_paired"]),
                _fmt(s["tuned_vs_best_fixed_held_out"], "%.2f"),
                _fmt(s["tuned_vs_plain"], "%.2fx"),
                " ".join("/".join(map(str, v)) for v in s["tuned_final_sizes"])))
    seeded = [(s["scenario"], v) for s in doc["scenarios"] for v in s.get("seeded", [])]
    if seeded:
        out += ["", "omnihvd started from a fixed split (mode `seeded`), median s and "
                "throughput over that fixed split's (95% interval): " + "; ".join(
                    "%s from %s: %s, %s%s" % (name, ",".join(map(str, v["split"])),
                                             _fmt(v["median_s"]), _fmt(v["vs_fixed"], "%.2f"),
                                             _interval(v["vs_fixed_ci"], "%.2f"))
                    for name, v in seeded)]
    alternated = [s for s in doc["scenarios"] if s.get("alternation")]
    if alternated:
        out += ["", "omnihvd and fixed splits taking turns by epoch in one launch (mode "
                "`alternate`, benchmarks/train_turns.py; the first round of epochs left out; "
                "with a mid-run change, each turn's mean epoch over both phases): "
                "per turn, the median over launches of the first turn's (omnihvd's) throughput "
                "over the turn's in the same launch (its time over the first's), a 95% interval "
                "over launches, the launches in which the turn was the fastest, and the "
                "spread over launches ((max - min) / median) of the turn's own time and of "
                "its paired ratio:", "",
                "| scenario | launches | turn | omnihvd / turn, same launch | fastest in "
                "| spread: time | spread: omnihvd / turn |",
                "|---|---|---|---|---|---|---|"]
        for s in alternated:
            a = s["alternation"]
            spreads = zip(a["spread"], a["first_over_spread"])
            for i, (turn, (own, paired)) in enumerate(zip(a["turns"], spreads)):
                out.append("| %s | %s | %s | %s%s | %d | %s | %s |" % (
                    s["scenario"] if i == 0 else "", a["launches"] if i == 0 else "",
                    turns_text([turn]), _fmt(a["first_over"][i], "%.3f"),
                    _interval(a["first_over_ci"][i], "%.3f"), a["fastest"][i],
                    _fmt(own and 100 * own, "%.1f%%"),
                    "-" if i == 0 else _fmt(paired and 100 * paired, "%.1f%%")))
    out.append("")
    out.append("Fixed splits tried (median s): " + "; ".join(
        "%s: %s" % (s["scenario"], ", ".join("%s %s" % (",".join(map(str, f["split"])),
                                                      _fmt(f["median_s"])) for f in s["fixed"]))
        for s in doc["scenarios"] if s["fixed"]))
    drift = ["%s: %s" % (s["scenario"], " ".join("%.3f" % v for v in s["position_effect"]))
             for s in doc["scenarios"] if s.get("position_effect")]
    if drift:
        out += ["", "Position effect (each run's time over its mode's median, median per "
                "position in the repeat, first to last): " + "; ".join(drift)]
    return "\n".join(out) + "\n"


def code_version(tree: str) -> Optional[str]:
    """The git commit of ``tree`` (``+dirty`` with uncommitted changes), if known;
    ``OMNIHVD_CODE_VERSION`` where set (a copy made with ``git archive`` has no .git)."""
    if os.environ.get("OMNIHVD_CODE_VERSION"):
        return os.environ["OMNIHVD_CODE_VERSION"]
    try:
        return subprocess.run(["git", "-C", tree, "describe", "--always", "--dirty=+dirty"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def scenario_arg(text: str) -> Tuple[str, Optional[str]]:
    """``(name, spec)`` from a name of SCENARIOS, ``NAME=SPEC``, or a bare SPEC."""
    name, sep, rest = text.partition("=")
    if name in ("pin", "quota"):
        return text, text
    return (name, rest) if sep else (text, SCENARIOS.get(text))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", nargs="+", default=list(DEFAULT_SCENARIOS),
                   help="names (%s) or NAME=SPEC, e.g. 'mine=pin=0,1,1'" % ", ".join(SCENARIOS))
    p.add_argument("--modes", default="plain,omnihvd,fixed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs per run (default: one per phase, plus one measured)")
    p.add_argument("--steps", type=int, default=100,
                   help="steps per epoch (0: full Fashion-MNIST epochs)")
    p.add_argument("--batch-per-rank", type=int, default=64, help="global batch = this * ranks")
    p.add_argument("--turns", default="omnihvd",
                   help="--modes alternate: the balancing turns before the fixed splits, "
                        "omnihvd, tuned, arrivals and/or means, each with options after "
                        "colons (omnihvd:adjust_every=50) (default omnihvd; the first is the "
                        "reference)")
    p.add_argument("--equal-turn", action="store_true",
                   help="--modes alternate: also the equal split (plain Horovod's) as a fixed "
                        "turn, after the balancing turns")
    p.add_argument("--lambdas", default="0.8,1,1.2,1.4",
                   help="fixed splits: equal + lambda * (proportional to shares - equal)")
    p.add_argument("--splits", default="",
                   help="more fixed splits to time, joined by / (141,39,38,38/154,34,34,34): "
                        "beside the lambdas' (--lambdas '' for these alone)")
    p.add_argument("--period-us", type=int, default=10000, help="CFS quota period")
    p.add_argument("--place-when-ready", action="store_true",
                   help="start the ranks on every CPU with no quota and apply the first "
                        "phase when rank 0 prints %r (examples/train_fashion_mnist.py "
                        "does): their start-up (imports, data) is then not slowed" % READY_LINE)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the ranks (repeatable)")
    p.add_argument("--thread-nice", type=int, choices=range(20), default=None, metavar="N",
                   help="give each rank's threads but the main one (Horovod's background "
                        "thread, MPI's) the nice value N (0-19) as they appear (default: "
                        "leave them as they start)")
    p.add_argument("--no-aslr", action="store_true",
                   help="start each rank with address-space randomisation off (setarch -R): "
                        "every launch then lays out its memory alike (mpirun only)")
    p.add_argument("--code", default=ROOT,
                   help="omnihvd tree to test (put first on the ranks' PYTHONPATH)")
    p.add_argument("--script", default=SCRIPT)
    p.add_argument("--script-args", default="", metavar="'OPTIONS'",
                   help="more options for every launch of the script, e.g. "
                        "--script-args='--seed 1 --lr 0.02'")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--launcher", choices=sorted(RANK_VARIABLE), default="mpirun",
                   help="torchrun: a torch.distributed script such as "
                        "examples/train_fashion_mnist_ddp.py (with --script)")
    p.add_argument("--torchrun", default=os.path.join(os.path.dirname(sys.executable), "torchrun"))
    p.add_argument("--run-timeout", type=int, default=300, help="seconds per run")
    p.add_argument("--max-foreign-cpu", type=float, default=None, metavar="S",
                   help="run again (up to --retries times) when other processes used more "
                        "than S CPU seconds during a run (default: never)")
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "results", "realhet"),
                   help="writes OUT.json and OUT.md")
    p.add_argument("--merge", action="store_true",
                   help="keep the other scenarios already in OUT.json")
    p.add_argument("--resummarize", action="store_true",
                   help="run nothing: add the held-out best fixed split and the position "
                        "effect to OUT.json's scenarios (results of older harnesses) and "
                        "rewrite OUT.md")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    bad = set(args.modes) - {"plain", "omnihvd", "tuned", "fixed", "seeded", "alternate"}
    if bad:
        p.error("unknown modes %s" % sorted(bad))
    try:
        args.lambdas = [float(v) for v in args.lambdas.split(",") if v]
    except ValueError:
        p.error("--lambdas takes numbers joined by commas, got %r" % args.lambdas)
    if args.repeats < 1:
        p.error("--repeats must be at least 1, got %d" % args.repeats)
    if not 1000 <= args.period_us <= 1000000:
        p.error("--period-us must be in [1000, 1000000] (the kernel's bounds), got %d"
                % args.period_us)
    args.turns = [t for t in args.turns.split(",") if t]
    if not args.turns or {t.split(":")[0] for t in args.turns} - {"omnihvd", "tuned",
                                                                     "arrivals", "means"}:
        p.error("--turns takes omnihvd, tuned, arrivals and/or means (options after colons: "
                "omnihvd:adjust_every=50), got %r" % ",".join(args.turns))
    args.command = " ".join(["python", os.path.relpath(os.path.abspath(__file__), ROOT)] +
                            [shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)])
    args.code = os.path.abspath(args.code)
    args.script_args = shlex.split(args.script_args)
    args.available = sorted(os.sched_getaffinity(0))
    args.scenarios = [scenario_arg(s) for s in args.scenarios]
    for name, spec in args.scenarios:
        if spec is None:
            p.error("unknown scenario %r; choose from %s or write NAME=SPEC"
                    % (name, ", ".join(SCENARIOS)))
        try:
            plan_modes(args, parse_spec(spec, args.available))
        except SystemExit as e:
            p.error("scenario %s: %s" % (name, e))
    for e in args.env:
        if "=" not in e:
            p.error("--env needs KEY=VALUE, got %r" % e)
    if args.no_aslr and args.launcher != "mpirun":
        p.error("--no-aslr starts the ranks through setarch under mpirun only")
    return args


# Signals that end the harness through its clean-up (every finally: groups, processes):
# a Ctrl-C, Slurm's or a supervisor's SIGTERM, a closed terminal or ssh session.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _terminate(signum, frame):
    # once: a second signal (an impatient Ctrl-C, a re-sent SIGTERM) raised inside the
    # finally blocks would cut the clean-up short and leave the cgroups behind
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt("signal %d" % signum)


def scenario_key(s: dict) -> tuple:
    """What makes a result replace an earlier one in OUT.json under ``--merge``: the
    scenario and every setting of the ranks (files of older harnesses lack
    ``thread_nice`` and ``no_aslr``)."""
    return (s["scenario"], s["period_us"], s["env"], s.get("thread_nice"),
            bool(s.get("no_aslr")))


def write(doc: dict, out: str, render=markdown) -> None:
    """OUT.json (atomically) and OUT.md (``render(doc)``)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json.tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(out + ".json.tmp", out + ".json")
    with open(out + ".md", "w") as f:
        f.write(render(doc))


def main(argv=None):
    args = parse_args(argv)
    if args.resummarize:
        with open(args.out + ".json") as f:
            doc = json.load(f)
        doc["scenarios"] = [dict(with_held_out(s), position_effect=position_effect(s["runs"]),
                                 alternation=alternation(s["runs"]))
                            for s in doc["scenarios"]]
        write(doc, args.out)
        print("results: %s.json, %s.md" % (args.out, args.out))
        return 0
    for sig in STOP_SIGNALS:
        signal.signal(sig, _terminate)
    try:
        stale = cpulimits.remove_stale_groups(GROUP_PREFIX, find_cpu_controller())
        if stale:
            print("removed stale cgroups of killed runs: %s" % ", ".join(stale))
    except CpuLimitError as exc:
        if any(p.quota is not None for _, spec in args.scenarios
               for p in parse_spec(spec, args.available)):
            raise SystemExit("CPU quotas are not available here: %s" % exc)
    started = time.time()
    doc, failed = {"scenarios": []}, []
    if args.merge and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            doc = json.load(f)
    for name, spec in args.scenarios:
        print("scenario %s (%s): %d repeats" % (name, spec, args.repeats), flush=True)
        result = run_scenario(args, name, spec)
        key = scenario_key(result)
        if not any("measured_s" in r for r in result["runs"]):
            failed.append(name)
            if any(scenario_key(s) == key for s in doc["scenarios"]):
                print("  -> every run failed: the earlier %s result in %s.json is kept"
                      % (name, args.out), flush=True)
                continue
        doc["scenarios"] = [s for s in doc["scenarios"]
                            if scenario_key(s) != key] + [result]
        doc.update({
            "command": args.command,
            "code_tree": args.code, "code_version": code_version(args.code),
            "script": os.path.relpath(args.script, ROOT),
            "finished": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "wall_s": time.time() - started,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "load_average": os.getloadavg()}})
        write(doc, args.out)
        print("  -> plain %s, omnihvd %s, best fixed %s %s; omnihvd/best fixed %s (held out "
              "%s%s), omnihvd/plain %s, spread %s" % (
                  _fmt(result["plain_s"]), _fmt(result["omnihvd_s"]),
                  _fmt(result["best_fixed_s"]), result["best_fixed_split"],
                  _fmt(result["omnihvd_vs_best_fixed"], "%.3f"),
                  _fmt(result["omnihvd_vs_best_fixed_held_out"], "%.3f"),
                  _interval(result["omnihvd_vs_best_fixed_held_out_ci"], "%.3f"),
                  _fmt(result["omnihvd_vs_plain"], "%.3f"),
                  _fmt(result["omnihvd_spread"], "%.3f")), flush=True)
    print("results: %s.json, %s.md" % (args.out, args.out))
    if failed:
        print("every run failed in: %s" % ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:   # the runs' processes and cgroups are gone already
        sys.exit("interrupted (%s); every run's processes and cgroups were removed" % (exc or "Ctrl-C"))
