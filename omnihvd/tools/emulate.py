"""Heterogeneity on one machine: make ranks run at chosen relative speeds.

For benchmarks, tests, and rehearsing a heterogeneous cluster on a laptop. Two
mechanisms, which can be combined:

* **Emulated speeds** (:class:`Emulator`). After a rank's real forward and backward,
  and *before* ``optimizer.step()`` (where Horovod waits for the allreduce; inside
  ``cb.working()``, so omnihvd counts the sleep as this rank's own compute, not as a
  wait between the model's passes), the rank sleeps until its step has
  taken as long as a slower machine would have needed. The allreduce, which
  Horovod's hooks started during the backward pass, runs during the sleep:
  communication is hidden, and the peers wait for a slow rank at the next step's
  allreduce (docs/emulation.rst). Two modes:

  - ``"model"`` (default): the step takes exactly
    ``(step_cost + batch_size * sample_cost) / speed`` seconds; real compute is
    padded up to that. Ratios are exact whatever else runs on the machine, as long
    as the real compute fits (steps where it does not are counted as *overruns*).
  - ``"dilate"``: time dilation. The step is stretched to
    ``stretch * (real + step_cost)``, with ``stretch = max(speeds) / speed``: the
    fastest rank runs at its real speed. Ratios are as exact as the real compute
    times are equal per sample, which on an oversubscribed machine they are not.

* **Real CPU heterogeneity** (:func:`pin_cpus`): per-rank CPU affinity and thread
  count, e.g. one rank alone on core 0 and three ranks sharing core 1.

Speeds may change during the run (dynamic heterogeneity). A :class:`Schedule` is
written compactly as ``"STEP:SPEEDS;STEP:SPEEDS..."``, e.g. ``"0:1,1,2,4;300:4,2,1,1"``
(rank i's relative speed after the comma-separated position i; the first segment's
``0:`` may be left out). Instead of numbers a segment may name one of the paper's
heterogeneity levels for 4 workers, ``HL1`` ``HL2`` ``HL4`` ``HL8`` (CPU cores per
worker 12/12/12/12, 12/12/8/16, 9/9/6/24, 6/6/4/32; speed = cores / 12, so the total
capacity is the same at every level), and ``"dynamic:P"`` is the paper's
HL1 -> HL2 -> HL4 -> HL8 -> HL4 -> HL2 -> HL1 with a change every P steps.

Configuration comes from command-line options (:func:`add_arguments`) or, when an
option is not given, the environment: ``OMNIHVD_EMULATE`` (schedule),
``OMNIHVD_EMULATE_MODE``, ``OMNIHVD_EMULATE_SAMPLE_COST``, ``OMNIHVD_EMULATE_STEP_COST``
(seconds, or with a unit: ``2ms``, ``500us``), ``OMNIHVD_CPUS`` and ``OMNIHVD_THREADS``.

Example (each rank)::

    emu = omnihvd.tools.emulate.Emulator(parse_schedule("dynamic:100"), rank=hvd.rank())
    for step, (x, y) in enumerate(batches):
        cb.on_batch_begin(); emu.start(cb.step)
        opt.zero_grad(); loss_fn(model(x), y).backward()
        with cb.working():          # the sleep is the emulated device's work
            emu.finish(len(x))      # sleeps here, before the step's synchronisation
        opt.step(); cb.on_batch_end()
"""
import math
import os
import re
import time
from typing import Callable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from . import levels
from ..errors import ConfigError
from .levels import DYNAMIC_LEVELS, LEVEL_CORES, LEVELS

__all__ = [
    "LEVELS", "LEVEL_CORES", "DYNAMIC_LEVELS", "MODES", "ENV",
    "EmulationError", "Schedule", "Emulator",
    "parse_schedule", "dynamic_schedule", "level_speeds", "parse_seconds",
    "parse_cpu_plan", "pin_cpus", "add_arguments", "from_args", "cpu_plan_from_args",
]

# The paper's heterogeneity levels (cores per worker, relative speeds, the dynamic
# schedule) are defined once, in omnihvd.tools.levels.
MODES = ("model", "dilate")
ENV = {
    "schedule": "OMNIHVD_EMULATE",
    "mode": "OMNIHVD_EMULATE_MODE",
    "sample_cost": "OMNIHVD_EMULATE_SAMPLE_COST",
    "step_cost": "OMNIHVD_EMULATE_STEP_COST",
    "cpus": "OMNIHVD_CPUS",
    "threads": "OMNIHVD_THREADS",
}
_SYNTAX = ('write STEP:SPEEDS segments separated by ";", e.g. "0:1,1,2,4;300:4,2,1,1", '
           'a level name such as "0:HL4;200:HL8", or "dynamic:100"')


class EmulationError(ConfigError):
    """A malformed emulation option; the message quotes the value and the fix."""


def level_speeds(name: str) -> Tuple[float, ...]:
    """Relative speeds of a named heterogeneity level (cores / 12).

    >>> level_speeds("HL4")
    (0.75, 0.75, 0.5, 2.0)

    Raises:
        EmulationError: unknown level.
    """
    try:
        return levels.level_speeds(name)
    except ConfigError as exc:
        raise EmulationError(str(exc)) from None


class Segment(NamedTuple):
    """From ``step`` on, rank i runs at relative speed ``speeds[i]``."""

    step: int
    speeds: Tuple[float, ...]
    label: str  # the level name, or the speeds as written


class Schedule:
    """Piecewise-constant per-rank speeds over training steps.

    Args:
        segments: ``(step, speeds)`` or ``(step, speeds, label)`` tuples; the first
            step must be 0, steps strictly increasing, all segments the same length,
            every speed finite and > 0.

    Raises:
        EmulationError: any of the above violated.

    >>> s = parse_schedule("0:1,1,2,4;300:HL8")
    >>> s.speeds_at(299), s.speeds_at(300)[:2], s.changes, s.num_ranks
    ((1.0, 1.0, 2.0, 4.0), (0.5, 0.5), [300], 4)
    """

    def __init__(self, segments: Sequence[tuple]):
        if not segments:
            raise EmulationError("a schedule needs at least one segment; " + _SYNTAX)
        segs: List[Segment] = []
        for seg in segments:
            step, speeds = seg[0], tuple(float(v) for v in seg[1])
            label = seg[2] if len(seg) > 2 else ",".join("%g" % v for v in speeds)
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise EmulationError("segment step must be an int >= 0, got %r" % (step,))
            if segs and step <= segs[-1].step:
                raise EmulationError("segment steps must increase: %d comes after %d; %s"
                                     % (step, segs[-1].step, _SYNTAX))
            if segs and len(speeds) != len(segs[0].speeds):
                raise EmulationError("segment at step %d has %d speeds, the first has %d; "
                                     "give one speed per rank in every segment"
                                     % (step, len(speeds), len(segs[0].speeds)))
            for rank, v in enumerate(speeds):
                if not (math.isfinite(v) and v > 0):
                    raise EmulationError("speed of rank %d at step %d must be finite and > 0, "
                                         "got %r" % (rank, step, v))
            segs.append(Segment(step, speeds, label))
        if segs[0].step != 0:
            raise EmulationError("the first segment must start at step 0, got %d; prefix "
                                 "the schedule with 0:SPEEDS" % segs[0].step)
        self.segments: Tuple[Segment, ...] = tuple(segs)

    @property
    def num_ranks(self) -> int:
        return len(self.segments[0].speeds)

    @property
    def changes(self) -> List[int]:
        """Steps at which the speeds change (every segment start after the first)."""
        return [s.step for s in self.segments[1:]]

    def segment_index(self, step: int) -> int:
        """Index of the segment in force at ``step``."""
        index = 0
        for i, seg in enumerate(self.segments):
            if seg.step <= step:
                index = i
        return index

    def speeds_at(self, step: int) -> Tuple[float, ...]:
        """All ranks' relative speeds at ``step``."""
        return self.segments[self.segment_index(step)].speeds

    def check_ranks(self, num_ranks: int) -> "Schedule":
        """Return self; raise EmulationError unless it has one speed per rank."""
        if self.num_ranks != num_ranks:
            raise EmulationError("schedule %r gives %d speeds per segment but the job has %d "
                                 "ranks; give one speed per rank" % (str(self), self.num_ranks,
                                                                     num_ranks))
        return self

    def __str__(self):
        return ";".join("%d:%s" % (s.step, s.label) for s in self.segments)

    def __repr__(self):
        return "Schedule(%r)" % str(self)

    def __eq__(self, other):
        return isinstance(other, Schedule) and [s[:2] for s in self.segments] == \
            [s[:2] for s in other.segments]


def dynamic_schedule(period: int, levels: Sequence[str] = DYNAMIC_LEVELS) -> Schedule:
    """The paper's dynamic heterogeneity: ``levels`` in turn, each for ``period`` steps.

    >>> str(dynamic_schedule(100, ["HL1", "HL4"]))
    '0:HL1;100:HL4'
    """
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise EmulationError("dynamic schedule period must be an int >= 1 (steps per level), "
                             "got %r" % (period,))
    return Schedule([(i * period, level_speeds(name), name.upper()) for i, name in enumerate(levels)])


def parse_schedule(text: str, num_ranks: Optional[int] = None) -> Schedule:
    """Parse the compact schedule syntax (see the module docstring).

    Args:
        text: e.g. ``"0:1,1,2,4;300:4,2,1,1"``, ``"HL4"``, ``"0:HL2;500:HL8"``,
            ``"dynamic:150"``.
        num_ranks: when given, every segment must have exactly this many speeds.

    Returns:
        :class:`Schedule`.

    Raises:
        EmulationError: malformed text, with the offending segment quoted.

    >>> parse_schedule("1,1,2,4").speeds_at(10)
    (1.0, 1.0, 2.0, 4.0)
    >>> parse_schedule("dynamic:50").changes
    [50, 100, 150, 200, 250, 300]
    """
    if not isinstance(text, str) or not text.strip():
        raise EmulationError("empty heterogeneity schedule %r; %s" % (text, _SYNTAX))
    stripped = text.strip()
    match = re.fullmatch(r"(?i)dynamic(?::\s*(\S+))?", stripped)
    if match:
        period = match.group(1) or "100"
        if not period.isdigit() or int(period) < 1:
            raise EmulationError("in %r the period must be a positive number of steps, e.g. "
                                 "dynamic:100" % text)
        schedule = dynamic_schedule(int(period))
        return schedule if num_ranks is None else schedule.check_ranks(num_ranks)
    segments = []
    for part in stripped.split(";"):
        part = part.strip()
        if not part:
            raise EmulationError("empty segment in schedule %r; %s" % (text, _SYNTAX))
        if ":" in part:
            step_text, spec = (p.strip() for p in part.split(":", 1))
            if not step_text.isdigit():
                raise EmulationError("segment %r of schedule %r: the step before ':' must be a "
                                     "non-negative integer; %s" % (part, text, _SYNTAX))
            step = int(step_text)
        elif not segments:
            step, spec = 0, part
        else:
            raise EmulationError("segment %r of schedule %r has no STEP: prefix; only the "
                                 "first segment may omit it" % (part, text))
        if spec.upper() in LEVELS:
            segments.append((step, level_speeds(spec), spec.upper()))
            continue
        try:
            speeds = tuple(float(v) for v in spec.split(","))
        except ValueError:
            raise EmulationError("segment %r of schedule %r: speeds must be comma-separated "
                                 "numbers or a level (%s); %s"
                                 % (part, text, ", ".join(LEVELS), _SYNTAX)) from None
        segments.append((step, speeds, spec.replace(" ", "")))
    schedule = Schedule(segments)
    return schedule if num_ranks is None else schedule.check_ranks(num_ranks)


def parse_seconds(value, name: str = "duration") -> float:
    """A duration >= 0 given as seconds (``0.002``) or with a unit (``2ms``, ``500us``, ``1s``).

    >>> parse_seconds("2ms"), parse_seconds(0.5), parse_seconds("250us")
    (0.002, 0.5, 0.00025)
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us)?\s*", str(value))
        try:
            seconds = float(match.group(1)) * {None: 1, "s": 1, "ms": 1e-3, "us": 1e-6}[match.group(2)]
        except (AttributeError, ValueError):
            raise EmulationError("%s must be seconds >= 0, e.g. 0.002 or 2ms, got %r"
                                 % (name, value)) from None
    if not (math.isfinite(seconds) and seconds >= 0):
        raise EmulationError("%s must be finite seconds >= 0, got %r" % (name, value))
    return seconds


class Emulator:
    """Make this rank's local work per step as slow as its scheduled speed says.

    Call :meth:`start` when the step's own work begins and :meth:`finish` after
    backward, before ``optimizer.step()``.

    Args:
        schedule: :class:`Schedule` (or its text).
        rank: this rank's index into the speeds.
        mode: ``"model"`` or ``"dilate"`` (see the module docstring).
        sample_cost: model mode: seconds per sample at speed 1.
        step_cost: fixed seconds per step (at speed 1 in model mode; before
            dilation in dilate mode).
        clock, sleep: injectable for tests.

    Raises:
        EmulationError: bad mode, cost, or a rank outside the schedule.

    >>> t = [0.0]
    >>> emu = Emulator("0:1,2", rank=0, sample_cost=0.01, clock=lambda: t[0],
    ...                sleep=lambda s: t.__setitem__(0, t[0] + s))
    >>> emu.start(0); t[0] += 0.1; round(emu.finish(20), 6)   # pads 0.1 s up to 0.2 s
    0.1
    """

    def __init__(self, schedule, rank: int, *, mode: str = "model", sample_cost=1e-3,
                 step_cost=0.0, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        self.schedule = parse_schedule(schedule) if isinstance(schedule, str) else schedule
        if not isinstance(self.schedule, Schedule):
            raise EmulationError("schedule must be a Schedule or its text, got %r" % (schedule,))
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.schedule.num_ranks:
            raise EmulationError("rank %r is outside schedule %s, which has %d ranks; give one "
                                 "speed per rank" % (rank, self.schedule, self.schedule.num_ranks))
        if mode not in MODES:
            raise EmulationError("emulation mode must be one of %s, got %r" % (", ".join(MODES), mode))
        self.rank = rank
        self.mode = mode
        self.sample_cost = parse_seconds(sample_cost, "sample_cost")
        self.step_cost = parse_seconds(step_cost, "step_cost")
        if mode == "model" and self.sample_cost == 0 and self.step_cost == 0:
            raise EmulationError("model mode needs sample_cost or step_cost > 0 (e.g. 1ms); "
                                 "or use mode='dilate'")
        self._clock, self._sleep = clock, sleep
        self._begin: Optional[float] = None
        self._step = 0
        self.steps = 0          # finished steps
        self.overruns = 0       # model mode: steps whose real compute exceeded the target
        self.slept = 0.0        # seconds slept in total
        self.compute = 0.0      # seconds of real compute in total

    def speed(self, step: Optional[int] = None) -> float:
        """This rank's relative speed at ``step`` (default: the current step)."""
        return self.schedule.speeds_at(self._step if step is None else step)[self.rank]

    def target(self, batch_size: int, real: float, step: Optional[int] = None) -> float:
        """Seconds the step should take given ``real`` seconds of actual compute."""
        speeds = self.schedule.speeds_at(self._step if step is None else step)
        speed = speeds[self.rank]
        if self.mode == "model":
            return (self.step_cost + batch_size * self.sample_cost) / speed
        return max(speeds) / speed * (real + self.step_cost)

    def start(self, step: Optional[int] = None):
        """Mark the beginning of a step's work.

        Args:
            step: the global step, which selects the schedule segment (default: the
                number of steps finished so far).
        """
        self._step = self.steps if step is None else int(step)
        self._begin = self._clock()

    def finish(self, batch_size: int) -> float:
        """Sleep until the step has taken its emulated time; return the seconds slept.

        Raises:
            EmulationError: :meth:`start` was not called first.
        """
        if self._begin is None:
            raise EmulationError("Emulator.finish() called without start(); call start() when "
                                 "the step's work begins")
        real = self._clock() - self._begin
        self._begin = None
        pause = self.target(batch_size, real) - real
        if pause > 0:
            self._sleep(pause)
            self.slept += pause
        elif self.mode == "model":
            self.overruns += 1
        self.compute += real
        self.steps += 1
        return max(pause, 0.0)

    def stats(self) -> dict:
        """Totals so far: steps, overruns, seconds slept and of real compute."""
        return {"steps": self.steps, "overruns": self.overruns, "slept_s": self.slept,
                "compute_s": self.compute}


# ------------------------------------------------------------ real CPU heterogeneity


def _cpu_set(text: str, rank: int, whole: str) -> Tuple[int, ...]:
    cpus = set()
    for item in text.split("+"):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
        if not match or (match.group(2) and int(match.group(2)) < int(match.group(1))):
            raise EmulationError("CPU plan %r, rank %d: %r is not a CPU number or range; write "
                                 "ranks separated by ',' and each rank's CPUs as 0, 0-3 or 0+2, "
                                 "e.g. \"0,1,1,1\"" % (whole, rank, item))
        lo = int(match.group(1))
        cpus.update(range(lo, int(match.group(2) or lo) + 1))
    return tuple(sorted(cpus))


def parse_cpu_plan(text: str, num_ranks: Optional[int] = None,
                   available: Optional[Sequence[int]] = None) -> List[Tuple[int, ...]]:
    """Parse per-rank CPU sets: ``"0,1,1,1"`` puts rank 0 alone on CPU 0, ranks 1-3 on CPU 1.

    Args:
        text: ranks separated by ``,``; each rank's CPUs as ``N``, ``N-M`` or ``N+M``.
        num_ranks: when given, the plan must name exactly this many ranks.
        available: CPUs this process may use (default ``os.sched_getaffinity(0)``).

    Returns:
        One sorted tuple of CPU numbers per rank.

    Raises:
        EmulationError: malformed text, wrong rank count, or an unavailable CPU.

    >>> parse_cpu_plan("0,1,1-2,0+2", available=[0, 1, 2])
    [(0,), (1,), (1, 2), (0, 2)]
    """
    if not isinstance(text, str) or not text.strip():
        raise EmulationError("empty CPU plan %r; e.g. \"0,1,1,1\"" % (text,))
    plan = [_cpu_set(part, rank, text) for rank, part in enumerate(text.split(","))]
    if num_ranks is not None and len(plan) != num_ranks:
        raise EmulationError("CPU plan %r names %d ranks but the job has %d; give one CPU set "
                             "per rank" % (text, len(plan), num_ranks))
    if available is None:
        available = os.sched_getaffinity(0)
    for rank, cpus in enumerate(plan):
        missing = sorted(set(cpus) - set(available))
        if missing:
            raise EmulationError("CPU plan %r, rank %d: CPU %s not available to this process "
                                 "(available: %s)" % (text, rank, missing, sorted(available)))
    return plan


def pin_cpus(cpus: Sequence[int], threads: Optional[int] = None) -> Tuple[int, ...]:
    """Restrict this process to ``cpus`` and set torch's intra-op thread count.

    Args:
        cpus: CPU numbers (one entry of :func:`parse_cpu_plan`).
        threads: torch threads (default: one per CPU).

    Returns:
        The previous affinity, for restoring with ``os.sched_setaffinity(0, previous)``.

    Raises:
        EmulationError: empty ``cpus`` or ``threads`` < 1.
    """
    import torch

    if not cpus:
        raise EmulationError("pin_cpus needs at least one CPU")
    threads = len(cpus) if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise EmulationError("threads must be an int >= 1, got %r" % (threads,))
    previous = tuple(sorted(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, set(cpus))
    torch.set_num_threads(threads)
    return previous


# ------------------------------------------------------------ command line and environment


def add_arguments(parser):
    """Add the emulation options to an ``argparse`` parser (defaults come from ``ENV``)."""
    group = parser.add_argument_group("heterogeneity emulation")
    group.add_argument("--emulate", metavar="SCHEDULE",
                       help="per-rank relative speeds, e.g. '0:1,1,2,4;300:4,2,1,1', 'HL4' or "
                            "'dynamic:100' (env %s)" % ENV["schedule"])
    group.add_argument("--emulate-mode", choices=MODES,
                       help="model: exact step times; dilate: stretch real compute (env %s; "
                            "default model)" % ENV["mode"])
    group.add_argument("--emulate-sample-cost", metavar="SECONDS",
                       help="model mode: seconds per sample at speed 1, e.g. 2ms (env %s; "
                            "default 1ms)" % ENV["sample_cost"])
    group.add_argument("--emulate-step-cost", metavar="SECONDS",
                       help="fixed cost per step, e.g. 5ms (env %s; default 0)" % ENV["step_cost"])
    group.add_argument("--cpus", metavar="PLAN",
                       help="per-rank CPU sets, e.g. '0,1,1,1' (env %s)" % ENV["cpus"])
    group.add_argument("--threads", metavar="N,...",
                       help="per-rank torch threads, e.g. '1,1,1,1' (env %s; default: one per "
                            "CPU of the rank)" % ENV["threads"])
    return group


_ATTRS = {"schedule": "emulate", "mode": "emulate_mode", "sample_cost": "emulate_sample_cost",
          "step_cost": "emulate_step_cost", "cpus": "cpus", "threads": "threads"}


def _option(args, name: str, environ: Mapping[str, str]):
    """The command-line value of option ``name``, else its environment variable, else None."""
    value = getattr(args, _ATTRS[name], None)
    if value is None or value == "":
        value = environ.get(ENV[name]) or None
    return value


def from_args(args, rank: int, num_ranks: int,
              environ: Mapping[str, str] = os.environ) -> Optional[Emulator]:
    """Build this rank's :class:`Emulator` from parsed options, else the environment.

    Returns:
        The emulator, or None when no schedule is configured.

    Raises:
        EmulationError: any malformed option, naming the option or variable.

    >>> import argparse
    >>> p = argparse.ArgumentParser(); _ = add_arguments(p)
    >>> emu = from_args(p.parse_args(["--emulate", "HL4"]), rank=3, num_ranks=4, environ={})
    >>> emu.speed(0), emu.mode
    (2.0, 'model')
    """
    text = _option(args, "schedule", environ)
    if text is None:
        return None
    schedule = parse_schedule(text, num_ranks)
    mode = _option(args, "mode", environ) or "model"
    sample_cost = _option(args, "sample_cost", environ)
    step_cost = _option(args, "step_cost", environ)
    return Emulator(schedule, rank, mode=mode,
                    sample_cost=1e-3 if sample_cost is None else sample_cost,
                    step_cost=0.0 if step_cost is None else step_cost)


def cpu_plan_from_args(args, rank: int, num_ranks: int,
                       environ: Mapping[str, str] = os.environ) -> Optional[Tuple[Tuple[int, ...], int]]:
    """This rank's ``(cpus, threads)`` from ``--cpus``/``--threads`` or the environment.

    Returns:
        None when no CPU plan is configured; pass the result to :func:`pin_cpus`.

    Raises:
        EmulationError: malformed plan or thread list.
    """
    text = _option(args, "cpus", environ)
    if text is None:
        return None
    plan = parse_cpu_plan(text, num_ranks)
    threads_text = _option(args, "threads", environ)
    if threads_text is None:
        return plan[rank], len(plan[rank])
    parts = str(threads_text).split(",")
    if len(parts) == 1:
        parts = parts * num_ranks
    if len(parts) != num_ranks or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise EmulationError("threads %r must be one positive int, or one per rank (%d), e.g. "
                             "'1,1,1,1'" % (threads_text, num_ranks))
    return plan[rank], int(parts[rank])
