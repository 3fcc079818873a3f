"""PNG plots: run logs (``omnihvd plot``, telemetry.plot_logs) and the simulator's
``simulate.png``. They need matplotlib, so they run with the installed stack."""
import json

import pytest

from omnihvd.tools import cli, telemetry
from test_telemetry import PNG_MAGIC, synthetic_run

pytestmark = pytest.mark.single


def test_plots_and_cli(tmp_path, capsys):
    synthetic_run(tmp_path / "run-omnihvd.log")
    synthetic_run(tmp_path / "run-plain.log", "plain", balance=False)
    paths = telemetry.plot_logs([str(tmp_path / "run-plain.log"), str(tmp_path / "run-omnihvd.log")],
                                prefix="cmp")
    assert [p.rsplit("/", 1)[1] for p in paths] == ["cmp-batch-sizes.png", "cmp-step-time.png",
                                                    "cmp-accuracy.png"]   # logs hold evals
    for p in paths:
        assert open(p, "rb").read(8) == PNG_MAGIC
    out = tmp_path / "out"
    assert cli.main(["plot", str(tmp_path / "run-omnihvd.log"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / ("run-omnihvd-%s.png" % kind))
                       for kind in ("batch-sizes", "step-time", "accuracy")]
    assert cli.main(["plot", str(tmp_path / "nope.log")]) == 2
    assert "cannot read run log" in capsys.readouterr().err
    # plain's and omnihvd's logs together: named after both, not the first one
    both = telemetry.plot_logs([str(tmp_path / "run-plain.log"), str(tmp_path / "run-omnihvd.log")],
                               out_dir=str(out))
    assert both[0] == str(out / "run-batch-sizes.png"), both


def test_no_accuracy_plot_without_evaluations(tmp_path):
    path = tmp_path / "x.log"
    with telemetry.RunLog(str(path), run="x") as log:
        log.step(0, t=1, step_s=1, sizes=[1, 2], times=[0.5, 1])
    assert [p.rsplit("-", 1)[1] for p in telemetry.plot_logs([str(path)])] == ["sizes.png", "time.png"]


def test_cli_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = cli.main(["simulate", "--ranks", "8", "--steps", "140", "--profile", "dynamic",
                   "--compare", "--out", str(out), "--every", "2"])
    assert rc == 0
    doc = json.loads((out / "simulate.json").read_text())
    assert set(doc) == {"omnihvd", "reference"}
    assert doc["omnihvd"]["summary"]["ranks"] == 8
    assert len(doc["omnihvd"]["series"]["efficiency"]) == 70
    png = (out / "simulate.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "steady efficiency" in capsys.readouterr().out
