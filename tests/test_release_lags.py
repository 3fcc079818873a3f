"""benchmarks/release_lags.py: per-step moments of each rank (the recorder train_turns.py
uses) and their summary: release lags, arrivals, the period."""
import doctest
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import release_lags  # noqa: E402

pytestmark = pytest.mark.unit


class FakeOptimizer:
    """What StepTimestamps touches: ``synchronize``, called by ``step``."""

    def __init__(self):
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1

    def step(self):
        self.synchronize()


class FakeCallback:
    last_step_time = 0.01


def record(folder, rank, monkeypatch, epochs=1, steps=3, turn="omnihvd"):
    monkeypatch.setenv(release_lags.ENV, str(folder))
    monkeypatch.setenv("PMIX_NAMESPACE", "job-7")
    opt = FakeOptimizer()
    stamps = release_lags.StepTimestamps(opt, rank)
    for epoch in range(epochs):
        for _ in range(steps):
            stamps.begin(8 + rank)
            stamps.before_step()
            opt.step()
            stamps.after_step(FakeCallback())
        stamps.end_epoch(epoch, turn)
    return opt


def test_each_step_is_recorded_with_its_release(tmp_path, monkeypatch):
    opt = record(tmp_path, 0, monkeypatch)
    record(tmp_path, 1, monkeypatch)
    assert opt.synchronized == 3
    assert sorted(os.listdir(tmp_path)) == ["steps-job7-e0-r0.json", "steps-job7-e0-r1.json"]
    rows = release_lags.summarize(str(tmp_path), skip=0)
    assert len(rows) == 1 and rows[0]["turn"] == "omnihvd" and rows[0]["samples"] == [8, 9]
    assert rows[0]["steps"] == 2 and rows[0]["period_s"] > 0
    assert rows[0]["local_s"] == [0.01, 0.01]
    assert all(lag >= 0 for lag in rows[0]["lag_s"])
    # rank 1 recorded after rank 0 (one process): it arrived last in every step
    assert rows[0]["last"] == [0, 3] and math.isnan(rows[0]["handoff_when_last_s"][0])
    assert "| job7 | 0 | omnihvd | 8/9 |" in release_lags.markdown(rows)
    assert "| 0/3 | - / " in release_lags.markdown(rows)


def test_off_without_the_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(release_lags.ENV, raising=False)
    opt = FakeOptimizer()
    synchronize = opt.synchronize
    stamps = release_lags.StepTimestamps(opt, 0)
    stamps.begin(8), stamps.before_step(), stamps.after_step(FakeCallback())
    stamps.end_epoch(0, "omnihvd")
    assert opt.synchronize == synchronize and os.listdir(tmp_path) == []


def test_an_epoch_missing_a_rank_is_left_out(tmp_path, monkeypatch):
    record(tmp_path, 1, monkeypatch)      # rank 0's file never written
    assert release_lags.summarize(str(tmp_path)) == []
    with pytest.raises(SystemExit, match="no steps"):
        release_lags.main([str(tmp_path / "empty")])


def test_the_docstring_examples():
    failures, _ = doctest.testmod(release_lags)
    assert failures == 0
