"""benchmarks/step_anatomy.py: the summary of the example's per-rank step anatomy.
The example writing it under real mpirun is test_example_mpi.py."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import step_anatomy  # noqa: E402

pytestmark = pytest.mark.unit


def _step(samples, local, before, in_step, period):
    return {"samples": samples, "local_s": local, "before_step_s": before,
            "in_step_s": in_step, "period_s": period}


def _write(folder, name, steps):
    with open(os.path.join(folder, name), "w") as f:
        json.dump(steps, f)


def test_summary_per_rank_and_tail(tmp_path):
    # rank 0 (fast, many samples) arrives last: its time in step() is the tail
    fast = [_step(30, 0.2, 0.19, 0.05, 0.26)] * 4 + [_step(30, 0.2, 0.19, 0.05, None)]
    slow = [_step(10, 0.1, 0.09, 0.16, 0.26)] * 4 + [_step(10, 0.1, 0.09, 0.16, None)]
    warm = [_step(20, 9.0, 9.0, 9.0, 9.0)] * 2     # an earlier epoch: not the last
    _write(tmp_path, "anatomy-fixed-30_10-77-e1-r0.json", fast)
    _write(tmp_path, "anatomy-fixed-30_10-77-e1-r1.json", slow)
    _write(tmp_path, "anatomy-fixed-30_10-77-e0-r0.json", warm)
    _write(tmp_path, "anatomy-fixed-30_10-77-e0-r1.json", warm)
    _write(tmp_path, "unrelated.json", [])
    runs = step_anatomy.summarize(str(tmp_path), skip=1)
    run = runs["fixed-30_10-77"]
    assert run["epoch"] == 1 and run["tail_s"] == pytest.approx(0.05)
    r0, r1 = run["ranks"]
    assert (r0["samples"], r1["samples"], r0["steps"]) == (30, 10, 4)
    assert r0["period_s"] == pytest.approx(0.26)        # the last step has no period
    assert r1["outside_local_s"] == pytest.approx(0.16)
    assert step_anatomy.summarize(str(tmp_path), epoch=0, skip=0)["fixed-30_10-77"]["ranks"][0][
        "local_s"] == 9.0
    assert (r0["last_share"], r1["last_share"]) == (1.0, 0.0)   # rank 0 always last
    assert run["mean_slowest_s"] == pytest.approx(0.2) == run["slowest_mean_s"]
    table = step_anatomy.markdown(runs)
    assert "| fixed-30_10-77 | 0 | 30 | 200.0 | 190.0 | 50.0 | 260.0 | 60.0 | 100% |" in table
    assert "| | tail | | | | 50.0 | | | |" in table
    assert "mean over steps 200.0 ms, largest rank mean 200.0 ms" in table


def test_plain_mode_has_no_local_time(tmp_path):
    steps = [_step(16, None, 0.1, 0.1, 0.21)] * 3
    _write(tmp_path, "anatomy-plain-5-e0-r0.json", steps)
    run = step_anatomy.summarize(str(tmp_path), skip=0)["plain-5"]
    r0 = run["ranks"][0]
    assert r0["local_s"] is None and r0["outside_local_s"] is None
    assert r0["last_share"] == 1.0 and run["mean_slowest_s"] == pytest.approx(0.1)
    assert "| - |" in step_anatomy.markdown({"plain-5": {"ranks": [r0], "tail_s": 0.1}})


def test_missing_rank_or_steps_is_an_error(tmp_path):
    steps = [_step(16, 0.1, 0.1, 0.1, 0.21)] * 3
    _write(tmp_path, "anatomy-omnihvd-5-e0-r1.json", steps)
    with pytest.raises(ValueError, match="not 0..n-1"):
        step_anatomy.summarize(str(tmp_path))
    _write(tmp_path, "anatomy-omnihvd-5-e0-r0.json", steps)
    with pytest.raises(ValueError, match="no steps left"):
        step_anatomy.summarize(str(tmp_path), skip=3)
    with pytest.raises(SystemExit, match="no anatomy"):
        step_anatomy.main([str(tmp_path / "empty")])


def test_docstring_examples():
    import doctest
    result = doctest.testmod(step_anatomy)
    assert result.attempted > 0 and result.failed == 0
