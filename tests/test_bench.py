"""benchmarks/bench.py end to end on 4 real ranks, tiny: every variant, a static and a
dynamic level, time to accuracy, the JSON fields, run logs and plots. No timing
assertions (the machine is shared): the figures are only checked to exist."""
import json
import os

import pytest
from mpirun import ROOT, mpirun

pytestmark = pytest.mark.mpi

BENCH = os.path.join(ROOT, "benchmarks", "bench.py")
FIELDS = ["level", "speeds", "plain_step_s", "omnihvd_step_s", "reference_step_s", "ideal_step_s",
          "efficiency", "speedup", "adjustments_to_converge", "overhead_per_step_s"]


def test_bench_smoke(tmp_path):
    out = tmp_path / "results"
    proc = mpirun(4, BENCH, "--name", "smoke", "--out", out, "--levels", "HL4",
                  "--dynamic", "0:HL1;8:HL8", "--steps", "10", "--reference-steps", "12",
                  "--batch-size", "32", "--train-limit", "320", "--tta", "--tta-epochs", "1",
                  "--eval-every", "5", "--emulate-sample-cost", "0.25ms", "--progress", "off",
                  timeout=300)
    assert "results:" in proc.stdout
    doc = json.load(open(out / "smoke.json"))
    assert doc["complete"] is True
    levels = [row["level"] for row in doc["runs"]]
    assert levels == ["HL4", "dynamic[0]:HL1", "dynamic[1]:HL8"]
    for row in doc["runs"]:
        for field in FIELDS:
            assert row[field] is not None, (row["level"], field)
        assert row["plain_step_s"] > 0 and row["ideal_step_s"] > 0
        for rel in row["logs"] + row["plots"]:
            assert os.path.getsize(os.path.join(ROOT, "benchmarks", rel)) > 0
    assert doc["runs"][0]["speeds"] == [0.75, 0.75, 0.5, 2.0]
    tta = {(r["variant"], r["seed"]): r for r in doc["time_to_accuracy"]}
    assert set(tta) == {("plain", 0), ("omnihvd", 0)}
    for r in tta.values():
        assert 0 < r["final_accuracy"] <= 1 and len(r["accuracy_curve"]) == 2


def test_bench_rejects_bad_schedule(tmp_path):
    proc = mpirun(2, BENCH, "--out", tmp_path, "--levels", "HL4", "--dynamic", "",
                  "--train-limit", "64", "--progress", "off", timeout=120, check=False)
    assert proc.returncode != 0
    assert "gives 4 speeds per segment but the job has 2 ranks" in proc.stdout
