"""benchmarks/realhet.py's pure parts: scenario specs, CPU shares, candidate splits.
The harness end to end on real ranks is test_realhet_mpi.py."""
import json
import os
import random
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import realhet  # noqa: E402

pytestmark = pytest.mark.unit

def test_shares_and_candidate_splits():
    cpus = [0, 1]
    two_to_one = realhet.parse_spec("pin=0,1,1", cpus)
    assert realhet.shares(two_to_one[0], cpus) == [1.0, 0.5, 0.5]
    quota = realhet.parse_spec("quota=1,0.6,0.3", cpus)[0]
    assert realhet.shares(quota, cpus) == pytest.approx([1.0, 0.6, 0.3])
    crowded = realhet.parse_spec("quota=1,1,1", cpus)[0]   # 3 busy ranks on 2 CPUs
    assert realhet.shares(crowded, cpus) == pytest.approx([2 / 3] * 3)
    pinned = realhet.parse_spec("pin=0,1,1 quota=1,0.6,0.3", cpus)[0]  # 0.9 of CPU 1 used
    assert realhet.shares(pinned, cpus) == pytest.approx([1.0, 0.6, 0.3])
    packed = realhet.parse_spec("pin=0,0,0,1 quota=1,0.6,0.3,1", cpus)[0]  # CPU 0 is short
    assert realhet.shares(packed, cpus) == pytest.approx([0.35, 0.35, 0.3, 1.0])
    spread = realhet.parse_spec("pin=0-1,1 quota=1,1", cpus)[0]  # rank 0: half its cap a CPU
    assert realhet.shares(spread, cpus) == pytest.approx([1.0, 0.5])
    hl8 = realhet.parse_spec("quota=HL8", cpus)[0]
    assert hl8.quota == pytest.approx([6 / 32, 6 / 32, 4 / 32, 1.0])
    splits = realhet.candidate_splits(two_to_one, 192, [0.8, 1.0, 1.2], cpus)
    assert [96, 48, 48] in splits and all(sum(s) == 192 for s in splits) and len(splits) == 3
    dynamic = realhet.parse_spec("pin=0,1,1 | pin=1,0,1", cpus)
    assert realhet.candidate_splits(dynamic, 192, [1.0], cpus) == [[48, 96, 48], [96, 48, 48]]
    with pytest.raises(SystemExit, match="same number of ranks"):
        realhet.parse_spec("pin=0,1 | pin=0,1,1", cpus)
    with pytest.raises(SystemExit, match="cannot read"):
        realhet.parse_spec("pinned=0,1", cpus)


def test_disturbed_runs_are_run_again(monkeypatch):
    foreign = iter([3.0, 2.0, 0.5, 0.2])   # two disturbed runs, then quiet ones
    calls = []

    def fake_run(args, phases, mode, split, tag):
        calls.append(tag)
        return {"foreign_cpu_s": next(foreign), "steal_s": 0.0, "measured_s": 1.0,
                "final_sizes": [64, 64]}

    monkeypatch.setattr(realhet, "run_once", fake_run)
    monkeypatch.setattr(realhet, "summarize", lambda name, spec, phases, B, runs, args: runs)
    args = realhet.parse_args(["--modes", "plain", "--repeats", "2", "--max-foreign-cpu", "1"])
    args.available = [0, 1]
    runs = realhet.run_scenario(args, "eq", "pin=0,1")
    assert calls == ["0-0", "0-0-0", "0-0-1", "1-0"]
    assert [r["foreign_cpu_s"] for r in runs] == [0.5, 0.2]
    assert runs[0]["disturbed_before"] == 2 and "disturbed_before" not in runs[1]
    assert not realhet.disturbed({"foreign_cpu_s": 9.0}, None)


def test_each_mode_runs_once_in_each_position_over_as_many_repeats(monkeypatch):
    order = []

    def fake_run(args, phases, mode, split, tag):
        order.append((mode, tuple(split) if split else None))
        return {"mode": mode, "split": split, "foreign_cpu_s": 0.0, "steal_s": 0.0,
                "measured_s": 1.0, "final_sizes": [96, 48, 48]}

    monkeypatch.setattr(realhet, "run_once", fake_run)
    monkeypatch.setattr(realhet, "summarize", lambda name, spec, phases, B, runs, args: runs)
    args = realhet.parse_args(["--modes", "plain,omnihvd,fixed", "--repeats", "4",
                               "--lambdas", "1,2"])   # fixed splits 96,48,48 and 128,32,32
    args.available = [0, 1]
    runs = realhet.run_scenario(args, "2:1:1", "pin=0,1,1")
    modes = sorted(set(order), key=order.index)
    assert len(modes) == 4 and len(order) == 16
    positions = {m: sorted(r["position"] for r, o in zip(runs, order) if o == m)
                 for m in modes}
    assert all(p == [0, 1, 2, 3] for p in positions.values()), positions
    assert [r["repeat"] for r in runs] == [r for r in range(4) for _ in range(4)]
    assert realhet.position_effect(runs) == [1.0, 1.0, 1.0, 1.0]


def test_given_splits_are_timed_beside_the_lambdas_and_bad_ones_refused(monkeypatch):
    timed = []

    def fake_run(args, phases, mode, split, tag):
        timed.append(split)
        return {"mode": mode, "split": split, "foreign_cpu_s": 0.0, "steal_s": 0.0,
                "measured_s": 1.0, "final_sizes": split}

    monkeypatch.setattr(realhet, "run_once", fake_run)
    monkeypatch.setattr(realhet, "summarize", lambda name, spec, phases, B, runs, args: runs)
    args = realhet.parse_args(["--modes", "fixed", "--repeats", "1", "--lambdas", "1",
                               "--scenarios", "2:1:1",
                               "--splits", "100,46,46/96,48,48"])   # the second is lambda 1's
    args.available = [0, 1]
    realhet.run_scenario(args, "2:1:1", "pin=0,1,1")
    assert timed == [[96, 48, 48], [100, 46, 46]]
    args = realhet.parse_args(["--modes", "fixed", "--repeats", "1", "--lambdas", "",
                               "--scenarios", "2:1:1", "--splits", "100,46,46"])
    args.available = [0, 1]
    timed.clear()
    realhet.run_scenario(args, "2:1:1", "pin=0,1,1")
    assert timed == [[100, 46, 46]]
    for bad in ("100,92", "100,46,45", "192,0,0", "a,b,c"):
        args.splits = bad
        with pytest.raises(SystemExit, match="--splits: .* summing to the global batch 192"):
            realhet.run_scenario(args, "2:1:1", "pin=0,1,1")


@pytest.mark.parametrize("argv, said", [
    # found before the first launch, not when its scenario comes (hours in)
    (["--scenarios", "2:1:1", "3:1:1:1", "--splits", "96,48,48"], "scenario 3:1:1:1: --splits"),
    (["--scenarios", "2:1:1->1:2:1", "--epochs", "1"], "needs an epoch in each"),
    (["--scenarios", "x=quota=0.05,1,1"], "at least 1000 us per period"),
    (["--scenarios", "2:1:1", "--period-us", "100"], "--period-us must be in"),
    (["--scenarios", "x=pin=0,1,1 pin=1,0,1"], "once each"),
    (["--scenarios", "2:1:1", "--lambdas", "a"], "--lambdas takes numbers"),
    (["--scenarios", "2:1:1", "--repeats", "0"], "--repeats must be at least 1"),
    # two equal turns: their epochs would be pooled and compared as one (ratio 1.0)
    (["--scenarios", "2:1:1", "--modes", "alternate", "--turns", "omnihvd,omnihvd",
      "--epochs", "12", "--steps", "10"], "each turn once"),
])
def test_options_that_cannot_run_are_refused_before_any_launch(argv, said, capsys):
    with pytest.raises(SystemExit):
        realhet.parse_args(argv)
    assert said in capsys.readouterr().err


def test_the_equal_turn_among_the_splits_is_timed_once():
    args = realhet.parse_args(["--scenarios", "2:1:1", "--modes", "alternate", "--lambdas", "",
                               "--splits", "64,64,64/96,48,48", "--equal-turn", "--epochs",
                               "6", "--steps", "10"])
    (mode, turns), = realhet.plan_modes(args, realhet.parse_spec("pin=0,1,1", [0, 1]))
    assert mode == "alternate" and turns == ["omnihvd", [64, 64, 64], [96, 48, 48]]


def test_alternate_launches_take_turns_rotated_and_are_compared_within_each_launch(
        monkeypatch, tmp_path):
    # Launch speeds differ 4x; within every launch the split 128,32,32 is 20% slower than
    # omnihvd and 96,48,48 as fast: paired in a launch the comparison sees only that.
    launches = []

    def fake_run(args, phases, mode, split, tag):
        launches.append(split)
        speed = 1.0 + len(launches)   # each launch slower than the last
        cost = {"omnihvd": 1.0, (96, 48, 48): 1.0, (128, 32, 32): 1.2}
        seconds = [speed * cost[t if isinstance(t, str) else tuple(t)] for t in split * 2]
        seconds[:3] = [99.0] * 3   # the first round: omnihvd converging
        return {"mode": mode, "split": split, "foreign_cpu_s": 0.0, "steal_s": 0.0,
                "measured_s": 1.0, "final_sizes": [96, 48, 48],
                "epochs": [{"seconds": t} for t in seconds]}

    monkeypatch.setattr(realhet, "run_once", fake_run)
    args = realhet.parse_args(["--modes", "alternate", "--repeats", "3", "--lambdas", "1,2",
                               "--scenarios", "2:1:1",
                               "--epochs", "6", "--steps", "10", "--out", str(tmp_path / "r")])
    args.available = [0, 1]
    result = realhet.run_scenario(args, "2:1:1", "pin=0,1,1")
    turns = ["omnihvd", [96, 48, 48], [128, 32, 32]]
    assert launches == [turns, turns[1:] + turns[:1], turns[2:] + turns[:2]]
    alt = result["alternation"]
    assert alt["turns"] == turns and alt["launches"] == 3
    assert alt["first_over"] == [1.0, 1.0, 1.2] and alt["fastest"] == [3, 0, 0]
    assert alt["first_over_ci"][2] == [1.2, 1.2]
    # the launches' speeds (2, 3, 4) spread each turn's own time; pairing removes them
    assert alt["spread"] == [round(2 / 3, 3)] * 3 and alt["first_over_spread"] == [0.0] * 3
    doc = {"scenarios": [result], "command": "x", "code_tree": "t", "code_version": "v",
           "finished": "now", "machine": {"platform": "p", "cpus": 2}}
    assert "| 2:1:1 | 3 | omnihvd | 1.000 (1.000-1.000) | 3 | 66.7% | - |" in realhet.markdown(doc)
    assert "|  |  | 128,32,32 | 1.200 (1.200-1.200) | 0 | 66.7% | 0.0% |" in realhet.markdown(doc)
    with pytest.raises(SystemExit):   # argparse: --turns names balancing turns only
        realhet.parse_args(["--modes", "alternate", "--turns", "omnihvd,plain"])
    with pytest.raises(SystemExit):
        realhet.parse_args(["--modes", "alternate", "--turns", "plain:gain=0.5"])
    assert realhet.parse_args(["--turns", "omnihvd,omnihvd:adjust_every=50:gain=0.5"]).turns == [
        "omnihvd", "omnihvd:adjust_every=50:gain=0.5"]   # options after colons
    one_phase = r"--epochs 3 x \(1 \+ 1 x m\), m >= 1 \(6, 9, ...\), not 5"
    with pytest.raises(SystemExit, match=one_phase):
        args.epochs = 5
        realhet.run_scenario(args, "2:1:1", "pin=0,1,1")
    two_phases = r"as many rounds in each of 2 phase\(s\).*\(12, 20, ...\), not 6"
    with pytest.raises(SystemExit, match=two_phases):
        args.epochs = 6
        realhet.run_scenario(args, "2:1:1->1:2:1", "pin=0,1,1 | pin=1,0,1")


def test_alternate_with_a_mid_run_change_compares_whole_runs(monkeypatch, tmp_path):
    # 2:1:1 -> 1:2:1, turns omnihvd, the equal split and the candidates: the change comes
    # after the warm-up round and half the others; per launch a turn counts the mean of
    # its epochs, so omnihvd's slow epoch after the change (re-settling) is not dropped.
    seen = []

    def fake_run(args, phases, mode, split, tag):
        seen.append(split)
        k = len(split)
        starts = realhet.phase_starts(len(phases), args.epochs, k)
        seconds = [1.0] * args.epochs
        first_after = starts[0] + 1 + split.index("omnihvd")
        seconds[first_after] = 1.5   # omnihvd's first epoch in the new placement
        for e in range(k, args.epochs):   # the equal split: 10% slower throughout
            if split[e % k] == [64, 64, 64]:
                seconds[e] = 1.1
        return {"mode": mode, "split": split, "foreign_cpu_s": 0.0, "steal_s": 0.0,
                "measured_s": 1.0, "final_sizes": [64, 64, 64],
                "changes": [{"phase": 0}, {"phase": 1, "after_epoch": starts[0]}],
                "epochs": [{"seconds": t} for t in seconds]}

    monkeypatch.setattr(realhet, "run_once", fake_run)
    args = realhet.parse_args(["--modes", "alternate", "--repeats", "3", "--lambdas", "1",
                               "--equal-turn", "--epochs", "20", "--steps", "10",
                               "--scenarios", "2:1:1->1:2:1", "--out", str(tmp_path / "r")])
    args.available = [0, 1]
    result = realhet.run_scenario(args, "2:1:1->1:2:1", "pin=0,1,1 | pin=1,0,1")
    # omnihvd, equal, phase B's proportional split, phase A's proportional split
    assert seen[0] == ["omnihvd", [64, 64, 64], [48, 96, 48], [96, 48, 48]]
    assert realhet.phase_starts(2, 20, 4) == [11]   # warm-up 0-3, phase A 4-11, B 12-19
    alt = result["alternation"]
    # omnihvd: 1.0, 1.0 in phase A, then 1.5 (re-settling) and 1.0 in phase B: mean
    # 1.125, where the median (1.0) would drop the cost of the change
    assert alt["per_launch"][0][:2] == [1.125, 1.1]
    assert alt["first_over"][1] == pytest.approx(1.1 / 1.125, abs=1e-3)
    assert alt["fastest"][:2] == [0, 0]   # the proportional splits lose nothing here


def test_the_harness_docstring_examples():
    import doctest
    result = doctest.testmod(realhet)
    assert result.attempted >= 3 and result.failed == 0, result


def _resummarized(tmp_path, runs, **figures):
    """One scenario of an older harness's OUT.json (its ``runs`` and summary
    ``figures``), put through ``--resummarize``: the scenario and the table it rewrites."""
    scenario = {"scenario": "s", "spec": "pin=0,1", "period_us": 10000, "env": [],
                "best_fixed_split": [3, 1], "omnihvd_final_sizes": [], "fixed": [],
                "runs": runs, **figures}
    doc = {"scenarios": [scenario], "command": "x", "code_tree": "t", "code_version": "v",
           "finished": "now", "machine": {"platform": "p", "cpus": 2}}
    out = str(tmp_path / "r")
    with open(out + ".json", "w") as f:
        json.dump(doc, f)
    assert realhet.main(["--resummarize", "--out", out]) == 0
    with open(out + ".json") as f, open(out + ".md") as table:
        return json.load(f)["scenarios"][0], table.read()


def test_held_out_best_fixed_split_is_timed_on_repeats_it_was_not_chosen_on(tmp_path):
    # [2, 1] wins repeat 0 by luck; chosen on the other repeats, [3, 1] is what a user gets.
    runs = [{"mode": "fixed", "split": split, "repeat": r, "measured_s": t}
            for split, times in (([2, 1], [1.0, 3.0, 3.1, 3.2]), ([3, 1], [2.0, 2.1, 2.2, 2.3]))
            for r, t in enumerate(times)]
    runs.append({"mode": "fixed", "split": [4, 1], "repeat": 0, "error": "exit 1"})
    s, table = _resummarized(tmp_path, runs, plain_s=3.0, omnihvd_s=2.0, best_fixed_s=2.1,
                             omnihvd_vs_best_fixed=1.05, omnihvd_vs_plain=1.5,
                             fixed_vs_plain=1.43, omnihvd_spread=None)
    assert s["best_fixed_held_out_times"] == [2.0, 2.1, 2.2, 2.3]
    assert s["best_fixed_held_out_s"] == pytest.approx(2.15)
    assert s["omnihvd_vs_best_fixed_held_out"] == pytest.approx(1.075)
    assert "| 2.150 | 1.08 |" in table
    assert realhet.held_out_best({(2, 1): {0: 1.0}}) == []   # one repeat: nothing to hold out
    assert s["omnihvd_vs_best_fixed_held_out_ci"] is None    # no omnihvd times to resample


def test_ratio_interval_holds_the_ratio_and_narrows_with_more_launches():
    rng = random.Random(1)
    # Launch times that change by up to 30% at random, the fixed split 10% slower.
    def launches(n, scale):
        return [scale * rng.uniform(1.0, 1.3) for _ in range(n)]
    few = realhet.ratio_interval(launches(3, 1.1), launches(3, 1.0))
    many = realhet.ratio_interval(launches(40, 1.1), launches(40, 1.0))
    assert few[0] <= many[0] <= 1.1 <= many[1] <= few[1]
    assert many[1] - many[0] < 0.5 * (few[1] - few[0])
    # Seeded: the same times give the same interval; a single launch per side gives none.
    assert realhet.ratio_interval([3.0, 2.0, 4.0], [1.0, 2.0, 1.5]) == \
        realhet.ratio_interval([3.0, 2.0, 4.0], [1.0, 2.0, 1.5])
    assert realhet.ratio_interval([3.0], [1.0, 2.0, 1.5]) is None
    # Identical launches: no doubt left.
    assert realhet.ratio_interval([2.0] * 3, [1.0] * 4) == [2.0, 2.0]


def test_table_brackets_the_interval_of_each_ratio(tmp_path):
    runs = [{"mode": m, "split": split, "repeat": r, "measured_s": t}
            for r in range(3)
            for m, split, t in (("plain", None, 3.0 + 0.1 * r), ("omnihvd", None, 2.0 + 0.1 * r),
                                ("fixed", [3, 1], 2.2 + 0.1 * r))]
    s, table = _resummarized(tmp_path, runs, plain_s=3.1, omnihvd_s=2.1, best_fixed_s=2.3,
                             omnihvd_vs_best_fixed=2.3 / 2.1, omnihvd_vs_plain=3.1 / 2.1,
                             fixed_vs_plain=3.1 / 2.3, omnihvd_times=[2.0, 2.1, 2.2],
                             plain_times=[3.0, 3.1, 3.2], omnihvd_spread=0.1)
    low, high = s["omnihvd_vs_best_fixed_held_out_ci"]
    assert low <= s["omnihvd_vs_best_fixed_held_out"] <= high
    assert (low, high) == (round(2.2 / 2.2, 3), round(2.4 / 2.0, 3))
    assert "| 1.10 (%.2f-%.2f) | 1.48x (" % (low, high) in table


def _nice(pid, tid):
    with open("/proc/%d/task/%d/stat" % (pid, tid)) as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_renice_threads_lowers_every_thread_but_the_main_one():
    import subprocess
    import sys
    code = ("import threading, time, sys\n"
            "ts = [threading.Thread(target=time.sleep, args=(60,), daemon=True) for _ in range(2)]\n"
            "[t.start() for t in ts]\nprint('ready', flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        pid = proc.pid
        others = realhet.thread_ids(pid) - {pid}
        assert len(others) >= 2 and _nice(pid, pid) == os.getpriority(os.PRIO_PROCESS, 0)
        done = realhet.renice_threads(pid, 19, set())
        assert done == others
        assert [_nice(pid, t) for t in sorted(others)] == [19] * len(others)
        assert _nice(pid, pid) == os.getpriority(os.PRIO_PROCESS, 0)   # the main thread kept
        assert realhet.renice_threads(pid, 19, done) == set()          # nothing new
    finally:
        proc.kill()
        proc.wait()
    assert realhet.renice_threads(pid, 19, set()) == set()             # gone: nothing, no error
    assert realhet.thread_ids(pid) == set()


def test_thread_cpu_puts_the_main_thread_first_and_sees_a_busy_thread():
    import threading
    import time
    pause, stop, tid = threading.Event(), threading.Event(), []

    def spin():
        tid.append(threading.get_native_id())
        while not pause.is_set():
            pass
        stop.wait()            # idle and alive: its CPU time stays put

    worker = threading.Thread(target=spin, daemon=True)
    worker.start()
    time.sleep(0.5)            # the worker holds the GIL in turns: it gets CPU
    pause.set()
    time.sleep(0.05)
    try:
        cpu = realhet.thread_cpu(os.getpid())
        own = realhet.process_cpu(os.getpid(), tid[0])
        main = realhet.process_cpu(os.getpid(), os.getpid())
    finally:
        stop.set()
        worker.join()
    assert own > 0 and cpu[tid[0]] == own, (own, cpu)
    assert 0 < cpu[os.getpid()] <= main     # the main thread (still running)
    report = realhet.main_thread_first(cpu, os.getpid())
    assert report[0] == round(cpu[os.getpid()], 2) and round(own, 2) in report[1:]
    assert report[1:] == sorted(report[1:], reverse=True)
    assert realhet.thread_cpu(2 ** 22 + 12345) is None    # no such process


def test_randomisation_off_reads_the_personality_setarch_gives():
    import subprocess
    import platform

    code = "import sys; sys.path.insert(0, %r); import realhet, os; " \
           "print(realhet.randomisation_off(os.getpid()))" % os.path.join(ROOT, "benchmarks")
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
    off = subprocess.run(["setarch", platform.machine(), "-R", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60)
    assert (plain.stdout.strip(), off.stdout.strip()) == ("False", "True"), (plain, off)
    assert realhet.randomisation_off(2 ** 22 + 12345) is None    # no such process
    with pytest.raises(SystemExit):   # torchrun starts the ranks itself: no setarch
        realhet.parse_args(["--no-aslr", "--launcher", "torchrun"])
