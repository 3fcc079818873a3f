"""omnihvd.tools.telemetry: run logs, per-segment summaries, the progress bar and tables.
The plots (matplotlib) are in test_plots.py."""
import io
import json

import pytest

from omnihvd.tools import telemetry
from omnihvd.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.unit


def synthetic_run(path, variant="omnihvd", balance=True):
    """Two segments (change at step 30); sizes settle 10 steps after each change."""
    speeds = [[1, 1, 2, 4], [4, 2, 1, 1]]
    t = 0.0
    with telemetry.RunLog(str(path), run="test " + variant, variant=variant, level="dyn",
                          changes=[30], labels=["A", "B"], speeds=speeds) as log:
        for k in range(60):
            seg = 0 if k < 30 else 1
            s = speeds[seg]
            settled = balance and (k % 30) >= 10
            sizes = [int(128 * v / 8) for v in s] if settled else [32, 32, 32, 32]
            times = [b * 0.001 / v for b, v in zip(sizes, s)]
            step_s = max(times) + 0.002
            t += step_s
            log.step(k, t=t, step_s=step_s, sizes=sizes, times=times, hooks_s=1e-4)
        log.event("eval", 59, t=t, accuracy=0.5)
    return telemetry.read_log(str(path))


def test_log_round_trip(tmp_path):
    log = synthetic_run(tmp_path / "a.log")
    assert log["meta"]["labels"] == ["A", "B"] and log["meta"]["changes"] == [30]
    assert len(log["steps"]) == 60 and log["events"] == [
        {"kind": "eval", "step": 59, "t": pytest.approx(log["steps"][-1]["t"]), "accuracy": 0.5}]
    first = log["steps"][0]
    assert first["ideal_s"] == pytest.approx(telemetry.ideal_step_time(first["sizes"], first["times"]))
    assert all(json.loads(line)["kind"] for line in open(tmp_path / "a.log"))


def test_ideal_step_time():
    # speeds 1,1,2,4 samples/ms: B=128 / 8 per ms = 16 ms
    assert telemetry.ideal_step_time([32] * 4, [0.032, 0.032, 0.016, 0.008]) == pytest.approx(0.016)
    assert telemetry.ideal_step_time([1, 1], [0.0, float("nan")]) != telemetry.ideal_step_time([1], [1])


def test_summarize_segments(tmp_path):
    log = synthetic_run(tmp_path / "a.log")
    segs = telemetry.summarize(log["steps"], log["meta"]["changes"])
    assert [(s["start"], s["end"]) for s in segs] == [(0, 30), (30, 60)]
    for seg, sizes in zip(segs, [[16, 16, 32, 64], [64, 32, 16, 16]]):
        assert seg["sizes"] == sizes
        assert seg["steps_to_converge"] == 10 and seg["adjustments_to_converge"] == 1
        assert seg["step_s"] == pytest.approx(0.016 + 0.002)
        assert seg["ideal_s"] == pytest.approx(0.016)
        assert seg["efficiency"] == pytest.approx(0.016 / 0.018)
        assert seg["hooks_s"] == pytest.approx(1e-4)
        assert seg["window"] == 30 - 10 - 2
    assert segs[0]["seconds_to_converge"] == pytest.approx(10 * (0.032 + 0.002))


def test_summarize_without_changes_and_empty(tmp_path):
    log = synthetic_run(tmp_path / "p.log", "plain", balance=False)
    (seg,) = telemetry.summarize(log["steps"])
    assert seg["adjustments"] == 0 and seg["steps_to_converge"] == 0
    assert seg["seconds_to_converge"] == 0.0 and seg["window"] == 57   # warm-up of 3
    assert telemetry.summarize([]) == []


def test_read_log_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read run log"):
        telemetry.read_log(str(tmp_path / "missing.log"))
    bad = tmp_path / "bad.log"
    bad.write_text('{"kind": "meta"}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        telemetry.read_log(str(bad))
    empty = tmp_path / "empty.log"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="holds no records"):
        telemetry.read_log(str(empty))
    # JSON, but not a run log's records: a message, not a traceback in omnihvd plot
    for text, needle in [("[1, 2]", "line 1: not a JSON object"),
                         ('{"kind": "step", "step": 0}', "needs step, t, step_s and sizes"),
                         ('{"kind": "step", "step": 0, "t": 1, "step_s": "abc", "sizes": [2]}',
                          "step_s must be a number"),
                         ('{"kind": "step", "step": 0, "t": 1, "step_s": 1, "sizes": 2}',
                          "sizes must be a list of ints")]:
        bad.write_text(text + "\n")
        with pytest.raises(ConfigError, match=needle):
            telemetry.read_log(str(bad))


def test_plot_rejects_nothing_to_plot(tmp_path):
    with pytest.raises(ConfigError, match="at least one"):
        telemetry.plot_logs([])
    path = tmp_path / "meta-only.log"
    telemetry.RunLog(str(path), run="x").close()
    with pytest.raises(ConfigError, match="no step records"):
        telemetry.plot_logs([str(path)])


def test_run_log_to_nowhere():
    with telemetry.RunLog("-", run="x") as log:
        log.step(0, t=1, step_s=1, sizes=[1])


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_modes():
    pipe = io.StringIO()
    bar = telemetry.ProgressBar(100, "run", stream=pipe)
    for _ in range(100):
        bar.update(step_s=0.5)
    bar.close()
    lines = pipe.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("run |" + "#" * 24 + "| 100/100")
    tty = Tty()
    bar = telemetry.ProgressBar(3, "t", stream=tty)
    for _ in range(3):
        bar.update()
    bar.close()
    assert tty.getvalue().count("\r") == 3 and tty.getvalue().endswith("\n")
    quiet = io.StringIO()
    bar = telemetry.ProgressBar(3, stream=quiet, enabled=False)
    bar.update()
    bar.close()
    assert quiet.getvalue() == ""


def test_format_table():
    text = telemetry.format_table(
        [{"level": "HL1", "x": 1.23456, "n": 3}, {"level": "HL8", "x": None, "n": float("nan")}],
        [("level", "level", "%s"), ("x", "step s", "%.3f"), ("n", "adj", "%d")])
    assert text.splitlines() == ["level  step s  adj", "-----  ------  ---",
                                 "HL1     1.235    3", "HL8         -    -"]
