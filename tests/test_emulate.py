"""omnihvd.tools.emulate: schedules, the emulator's arithmetic (with a fake clock), CPU plans,
options from the command line and the environment. Single process, no timing
(pinning CPUs in a child process: test_emulate_single.py)."""
import argparse

import pytest
from hypothesis import given, settings, strategies as st

from omnihvd.tools import emulate
from omnihvd.tools.emulate import EmulationError, Emulator, parse_cpu_plan, parse_schedule
from omnihvd.errors import ConfigError

pytestmark = pytest.mark.unit


class FakeClock:
    """A clock that only moves when told to (or when the emulator sleeps)."""

    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def make(schedule, rank, **kw):
    clock = FakeClock()
    return Emulator(schedule, rank, clock=clock, sleep=clock.sleep, **kw), clock


# ------------------------------------------------------------------ schedules

def test_levels_are_the_papers_core_counts_over_12():
    assert emulate.LEVEL_CORES["HL4"] == (9, 9, 6, 24)
    for name, speeds in emulate.LEVELS.items():
        assert sum(speeds) == pytest.approx(4.0)          # same total capacity
        assert max(speeds) / min(speeds) == pytest.approx(int(name[2:]))


@pytest.mark.parametrize("text, step, expected", [
    ("1,1,2,4", 10 ** 6, (1, 1, 2, 4)),
    ("0:1,1,2,4;300:4,2,1,1", 299, (1, 1, 2, 4)),
    ("0:1,1,2,4;300:4,2,1,1", 300, (4, 2, 1, 1)),
    (" 0 : 1, 1, 2, 4 ; 300 : hl8 ", 301, emulate.LEVELS["HL8"]),
    ("HL2", 0, emulate.LEVELS["HL2"]),
    ("dynamic:10", 35, emulate.LEVELS["HL8"]),
    ("dynamic:10", 65, emulate.LEVELS["HL1"]),
    ("DYNAMIC", 150, emulate.LEVELS["HL2"]),      # default period 100
])
def test_parse_schedule(text, step, expected):
    assert parse_schedule(text).speeds_at(step) == pytest.approx(expected)


def test_dynamic_schedule_is_the_papers_sequence():
    s = parse_schedule("dynamic:50", num_ranks=4)
    assert [seg.label for seg in s.segments] == list(emulate.DYNAMIC_LEVELS)
    assert s.changes == [50, 100, 150, 200, 250, 300]
    assert s.segment_index(149) == 2 and s.segment_index(10 ** 9) == 6


def test_str_round_trips():
    for text in ["0:1,1,2,4;300:4,2,1,1", "0:HL1;20:HL8", "dynamic:7", "0.5,2"]:
        s = parse_schedule(text)
        assert parse_schedule(str(s)) == s


@given(st.lists(st.lists(st.floats(0.01, 100), min_size=3, max_size=3), min_size=1, max_size=6),
       st.lists(st.integers(1, 50), min_size=6, max_size=6))
@settings(max_examples=60, deadline=None)
def test_parse_matches_segments(speed_lists, gaps):
    steps = [0]
    for g in gaps[:len(speed_lists) - 1]:
        steps.append(steps[-1] + g)
    text = ";".join("%d:%s" % (k, ",".join(repr(v) for v in sp)) for k, sp in zip(steps, speed_lists))
    s = parse_schedule(text, num_ranks=3)
    assert s.changes == steps[1:]
    for j, (k, sp) in enumerate(zip(steps, speed_lists)):
        assert s.speeds_at(k) == tuple(sp)
        if j:
            assert s.speeds_at(k - 1) == tuple(speed_lists[j - 1])


@pytest.mark.parametrize("text, fragment", [
    ("", "empty"),
    ("   ", "empty"),
    ("0:1,1;;5:2,2", "empty segment"),
    ("x:1,1", "step before ':'"),
    ("-3:1,1", "step before ':'"),
    ("0:1,1;2,2", "no STEP: prefix"),
    ("5:1,1", "must start at step 0"),
    ("0:1,1;10:2,2;10:3,3", "must increase"),
    ("0:1,1;10:2,2,2", "has 3 speeds"),
    ("0:1,0", "rank 1"),
    ("0:1,-2", "finite and > 0"),
    ("0:1,nan", "finite"),
    ("0:1,inf", "finite"),
    ("0:fast,slow", "comma-separated numbers"),
    ("0:HL3", "comma-separated numbers"),
    ("dynamic:0", "positive number of steps"),
    ("dynamic:x", "positive number of steps"),
])
def test_bad_schedules_say_what_and_how(text, fragment):
    with pytest.raises(EmulationError) as info:
        parse_schedule(text)
    assert fragment in str(info.value)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_rank_count_must_match():
    with pytest.raises(EmulationError, match="gives 4 speeds per segment but the job has 2 ranks"):
        parse_schedule("HL4", num_ranks=2)
    with pytest.raises(EmulationError, match="unknown heterogeneity level"):
        emulate.level_speeds("HL16")


def test_schedule_constructor_validates():
    with pytest.raises(EmulationError):
        emulate.Schedule([])
    with pytest.raises(EmulationError, match="int >= 0"):
        emulate.Schedule([(1.5, (1, 1))])
    with pytest.raises(EmulationError, match="period"):
        emulate.dynamic_schedule(0)


# ------------------------------------------------------------------ the emulator

def test_model_mode_pads_to_exact_target():
    emu, clock = make("0:1,1,2,4", rank=2, sample_cost=0.01, step_cost=0.02)
    emu.start(0)
    clock.now += 0.05                      # real compute
    slept = emu.finish(30)                 # target (0.02 + 30 * 0.01) / 2 = 0.16
    assert slept == pytest.approx(0.11)
    assert clock.now == pytest.approx(0.16)
    assert emu.stats()["overruns"] == 0


def test_model_mode_counts_overruns_and_never_sleeps_negative():
    emu, clock = make("0:1,4", rank=1, sample_cost=0.001)
    emu.start(0)
    clock.now += 1.0
    assert emu.finish(10) == 0.0 and clock.sleeps == []
    assert emu.stats() == {"steps": 1, "overruns": 1, "slept_s": 0.0, "compute_s": 1.0}


def test_dilate_mode_stretches_relative_to_fastest():
    schedule = "0:1,1,2,4"
    for rank, stretch in enumerate([4, 4, 2, 1]):
        emu, clock = make(schedule, rank, mode="dilate", step_cost=0.01)
        emu.start(0)
        clock.now += 0.1
        emu.finish(64)
        assert clock.now == pytest.approx(stretch * (0.1 + 0.01))


def test_schedule_switches_by_step_argument_or_count():
    emu, clock = make("0:1,1;2:1,0.5", rank=1, sample_cost=0.01)
    times = []
    for _ in range(4):                      # default step = steps finished so far
        begin = clock.now
        emu.start()
        emu.finish(10)
        times.append(clock.now - begin)
    assert times == pytest.approx([0.1, 0.1, 0.2, 0.2])
    emu.start(0)
    assert emu.speed() == 1.0 and emu.speed(5) == 0.5


@given(st.lists(st.floats(0.1, 10), min_size=2, max_size=6), st.integers(1, 512),
       st.floats(0, 0.001))
@settings(max_examples=100, deadline=None)
def test_model_mode_time_is_inverse_to_speed(speeds, batch, real):
    """Equal batches: time * speed is the same on every rank (exact ratios)."""
    products = []
    for rank, speed in enumerate(speeds):
        emu, clock = make(emulate.Schedule([(0, speeds)]), rank, sample_cost=0.01)
        emu.start(0)
        clock.now += real
        emu.finish(batch)
        products.append(clock.now * speed)
    assert max(products) == pytest.approx(min(products), rel=1e-9)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(mode="warp"), "mode must be one of"),
    (dict(sample_cost=0, step_cost=0), "needs sample_cost or step_cost"),
    (dict(sample_cost="fast"), "sample_cost must be seconds"),
    (dict(step_cost=-1.0), "step_cost must be finite seconds >= 0"),
])
def test_emulator_rejects_bad_options(kwargs, fragment):
    with pytest.raises(EmulationError, match=fragment):
        Emulator("1,2", 0, **kwargs)


def test_emulator_rank_and_order_errors():
    with pytest.raises(EmulationError, match="rank 2 is outside"):
        Emulator("1,2", 2)
    with pytest.raises(EmulationError, match="schedule must be"):
        Emulator(42, 0)
    emu = Emulator("1,2", 0)
    with pytest.raises(EmulationError, match="without start"):
        emu.finish(3)


@pytest.mark.parametrize("text, seconds", [
    ("2ms", 0.002), ("500us", 0.0005), ("1.5s", 1.5), ("0.25", 0.25), (3, 3.0), ("1e-3", 0.001)])
def test_parse_seconds(text, seconds):
    assert emulate.parse_seconds(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "ms", "2 minutes", "-1ms", "nan", True])
def test_parse_seconds_rejects(bad):
    with pytest.raises(EmulationError):
        emulate.parse_seconds(bad)


# ------------------------------------------------------------------ CPU plans

def test_cpu_plan_parsing():
    assert parse_cpu_plan("0,1,1,1", available=[0, 1]) == [(0,), (1,), (1,), (1,)]
    assert parse_cpu_plan("0-2,3+1", num_ranks=2, available=range(4)) == [(0, 1, 2), (1, 3)]


@pytest.mark.parametrize("text, kwargs, fragment", [
    ("", {}, "empty CPU plan"),
    ("0,x", {}, "rank 1: 'x' is not a CPU number"),
    ("3-1", {}, "not a CPU number or range"),
    ("0,1", dict(num_ranks=4), "names 2 ranks but the job has 4"),
    ("0,7", dict(available=[0, 1]), "rank 1: CPU [7] not available"),
])
def test_cpu_plan_errors(text, kwargs, fragment):
    with pytest.raises(EmulationError) as info:
        parse_cpu_plan(text, **kwargs)
    assert fragment in str(info.value)


# ------------------------------------------------------------------ options

def parser():
    p = argparse.ArgumentParser()
    emulate.add_arguments(p)
    return p


def test_from_args_command_line_beats_environment():
    env = {"OMNIHVD_EMULATE": "1,1", "OMNIHVD_EMULATE_MODE": "dilate",
           "OMNIHVD_EMULATE_SAMPLE_COST": "5ms", "OMNIHVD_EMULATE_STEP_COST": "1ms"}
    args = parser().parse_args(["--emulate", "0:HL1;10:HL8", "--emulate-sample-cost", "2ms"])
    emu = emulate.from_args(args, rank=2, num_ranks=4, environ=env)
    assert emu.mode == "dilate"                    # from the environment
    assert emu.sample_cost == pytest.approx(0.002)  # the option wins
    assert emu.step_cost == pytest.approx(0.001)
    assert emu.speed(10) == pytest.approx(4 / 12)


def test_from_args_environment_only_and_nothing():
    args = parser().parse_args([])
    assert emulate.from_args(args, 0, 4, environ={}) is None
    emu = emulate.from_args(args, 3, 4, environ={"OMNIHVD_EMULATE": "dynamic:5"})
    assert emu.mode == "model" and emu.sample_cost == pytest.approx(0.001)
    assert emu.speed(15) == pytest.approx(emulate.LEVELS["HL8"][3])
    with pytest.raises(EmulationError, match="job has 2 ranks"):
        emulate.from_args(args, 0, 2, environ={"OMNIHVD_EMULATE": "HL4"})


def test_cpu_plan_from_args():
    args = parser().parse_args(["--cpus", "0,0"])
    assert emulate.cpu_plan_from_args(args, 1, 2, environ={}) == ((0,), 1)
    env = {"OMNIHVD_CPUS": "0,0", "OMNIHVD_THREADS": "2"}
    assert emulate.cpu_plan_from_args(parser().parse_args([]), 0, 2, environ=env) == ((0,), 2)
    assert emulate.cpu_plan_from_args(parser().parse_args([]), 0, 2, environ={}) is None
    with pytest.raises(EmulationError, match="one per rank"):
        emulate.cpu_plan_from_args(parser().parse_args(["--cpus", "0,0", "--threads", "1,2,3"]),
                                   0, 2, environ={})
