"""benchmarks/time_to_accuracy.py's pure parts: time to a target accuracy, the seed
spread, the phase schedule and the fixed splits searched. The launches themselves are
realhet's (test_realhet_mpi.py)."""
import doctest
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import time_to_accuracy as tta  # noqa: E402

pytestmark = pytest.mark.unit


def test_time_to_target_interpolates_within_the_first_epoch_that_reaches_it():
    # from chance (0.1) at 0 s to 0.7 after 10 s: 0.4 is half way
    assert tta.time_to_target([10.0], [0.7], 0.4) == pytest.approx(5.0)
    # reached exactly at an epoch's end: that end
    assert tta.time_to_target([4.0, 6.0], [0.6, 0.85], 0.85) == pytest.approx(10.0)
    # a dip below the target after reaching it does not move the first time
    assert tta.time_to_target([5, 5, 5], [0.86, 0.80, 0.90], 0.85) == pytest.approx(
        5 * 0.75 / 0.76)
    # a dip before it: the climb is interpolated from the last epoch below
    assert tta.time_to_target([5, 5, 5, 5], [0.84, 0.80, 0.84, 0.88], 0.85) == pytest.approx(
        15 + 5 * 0.25)
    assert tta.time_to_target([5, 5], [0.84, 0.849], 0.85) is None
    assert tta.time_to_target([], [], 0.85) is None
    assert tta.time_to_target([3.0], [0.2], 0.05) == 0.0   # below chance: at once


def test_time_to_target_refuses_malformed_input():
    with pytest.raises(ValueError, match="2 epoch times but 1 accuracies"):
        tta.time_to_target([1.0, 2.0], [0.5], 0.4)
    with pytest.raises(ValueError, match="negative"):
        tta.time_to_target([1.0, -2.0], [0.5, 0.6], 0.9)


def test_curve_and_time_to_target_agree():
    seconds, accs = [3.0, 4.0, 2.5], [0.6, 0.83, 0.87]
    t, a = tta.curve(seconds, accs)
    assert t == [0.0, 3.0, 7.0, 9.5] and a[0] == tta.CHANCE and a[1:] == accs
    found = tta.time_to_target(seconds, accs, 0.85)
    assert 7.0 < found < 9.5 and found == pytest.approx(7.0 + 2.5 * 0.5)


def test_spread_counts_a_seed_that_never_reached_the_target_as_latest():
    assert tta.spread([2.0, 1.0, 3.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                           "reached": 3, "n": 3}
    assert tta.spread([None, 1.0, None])["median"] is None   # most never reached it
    assert tta.spread([None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": None,
                                            "reached": 2, "n": 3}
    assert tta.spread([])["n"] == 0


def test_phase_schedule_and_weights():
    assert tta.phase_schedule(["A", "B"], 2) == ["A", "A", "B"]
    assert tta.phase_schedule(["A", "B", "C"], 2) == ["A", "A", "B", "B", "C"]
    assert tta.phase_weights(2, 4, 2) == [0.5, 0.5]
    assert tta.phase_weights(3, 6, 1) == pytest.approx([1 / 6, 1 / 6, 4 / 6])
    with pytest.raises(ValueError, match="leave none"):
        tta.phase_weights(2, 2, 2)
    with pytest.raises(ValueError, match="epochs_per_phase"):
        tta.phase_schedule(["A"], 0)
    # a search launch: warm-up, then one epoch per phase, weighted as in the real run
    assert tta.search_score([9.0, 2.0, 4.0], [0.25, 0.75]) == pytest.approx(3.5)
    with pytest.raises(ValueError, match="warm-up"):
        tta.search_score([2.0, 4.0], [0.5, 0.5])


def test_fixed_candidates_of_the_default_levels():
    cpus = [0, 1]
    (_, static), (_, change) = [tta.realhet.scenario_arg(v) for v in tta.LEVELS]
    static, change = (tta.realhet.parse_spec(s, cpus) for s in (static, change))
    shares = [tta.realhet.shares(p, cpus) for p in static]
    assert shares == [pytest.approx([9 / 32, 9 / 32, 6 / 32, 24 / 32])]
    found = tta.fixed_candidates(shares, [1.0], 256, [1.0, 1.5])
    assert found == [[48, 48, 32, 128], [40, 40, 16, 160]]
    # HL2 then HL8 for as long: their mean (HL4's shares), and each phase's own split
    shares = [tta.realhet.shares(p, cpus) for p in change]
    found = tta.fixed_candidates(shares, [0.5, 0.5], 256, [1.0])
    assert found == [[48, 48, 32, 128], [64, 64, 43, 85], [32, 32, 21, 171]]
    assert all(sum(s) == 256 and min(s) >= 1 for s in found)
    # equal shares: nothing but the equal split, which is plain Horovod's
    assert tta.fixed_candidates([[0.5, 0.5]], [1.0], 64, [1.0, 1.5]) == []


def test_docstring_examples():
    assert doctest.testmod(tta).failed == 0


def test_the_launches_carry_the_seed_and_the_script_options():
    args, hargs = tta.parse_args(["--seeds", "3,4", "--script-args=--lr 0.02", "--epochs", "5",
                                  "--fixed-split", "40,40,16,160"])
    assert args.seeds == [3, 4] and args.fixed_split == [40, 40, 16, 160]
    assert hargs.base_script_args == ["--lr", "0.02"] and hargs.epochs == 5
    assert tta.realhet.parse_args(["--script-args=--seed 1"]).script_args == ["--seed", "1"]
    with pytest.raises(SystemExit):   # the change needs an epoch after its epoch of HL2
        tta.parse_args(["--epochs", "1"])


def test_main_goes_round_the_levels_seed_by_seed(tmp_path, monkeypatch):
    # every launch faked: the searches first, then each seed at each level, modes rotated
    launched = []

    def fake_run(hargs, phases, mode, split, tag):
        launched.append((len(phases), mode, split, list(hargs.script_args)))
        fast = {"plain": 2.0, "omnihvd": 1.0, "fixed": 1.5}[mode]
        epochs = [{"epoch": e, "seconds": fast, "accuracy": 0.8 + 0.05 * e, "sizes": [1]}
                  for e in range(hargs.epochs)]
        return {"mode": mode, "split": split, "error": None, "epochs": epochs,
                "final_sizes": [1], "changes": [], "wall_s": 1.0}

    monkeypatch.setattr(tta.realhet, "run_once", fake_run)
    monkeypatch.setattr(tta.realhet.cpulimits, "remove_stale_groups", lambda *a: [])
    monkeypatch.setattr(tta.realhet, "find_cpu_controller", lambda: None)
    out = str(tmp_path / "r")
    assert tta.main(["--seeds", "5,6", "--out", out, "--plot", "", "--lambdas", "1,1.5"]) == 0
    # the searches: 2 splits at HL4 (warm-up + HL4), 4 at the change (warm-up, HL2, HL8)
    assert [l[:2] for l in launched[:6]] == [(2, "fixed")] * 2 + [(3, "fixed")] * 4
    seeds = [l[3][1] for l in launched[6:]]
    assert seeds == ["5"] * 6 + ["6"] * 6, launched   # seed 5 at both levels, then seed 6
    assert [l[1] for l in launched[6:9]] == ["plain", "omnihvd", "fixed"]
    assert [l[1] for l in launched[12:15]] == ["omnihvd", "fixed", "plain"]   # rotated
    doc = json.load(open(out + ".json"))
    for level in doc["levels"]:
        assert len(level["runs"]) == 6 and level["summary"]["omnihvd_below_plain"]
        ttt = level["summary"]["omnihvd"]["time_to_target_s"]
        assert ttt["median"] == pytest.approx(2.0) and ttt["reached"] == 2   # 2 epochs of 1 s
    table = open(out + ".md").read()
    assert "| HL4+cpuset | `pin=0,0,0,1 quota=HL4` | plain | equal | 4.0 (4.0-4.0) | 2/2 |" in table
