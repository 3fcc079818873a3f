"""benchmarks/scaling.py's decision with every gathered input: it runs the callback's
own path (payload rows, read_gathered, Cadence.decide) and balances the two
generations. Its timings are the benchmark's, never asserted here."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import scaling  # noqa: E402

from omnihvd.arrivals import ARRIVAL_STEPS  # noqa: E402
from omnihvd.payload import PAYLOAD_FIELDS  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("placement", scaling.PLACEMENTS)
def test_the_gathered_decision_balances_two_generations(placement):
    got = scaling.gathered_decisions(32, placement, rounds=4)
    # (5 ms + 1 ms a sample) / speed, speeds 1 and 0.5, 64 samples a rank on average:
    # 87 and 41 samples take the same time
    fast, slow = got["final_sizes_first_two_machines"]
    assert 86 <= fast <= 88 and 40 <= slow <= 42
    # every rank receives 32 rows: the fields and two per-step blocks (release lag,
    # arrival lead) of the window's 20 steps, not ARRIVAL_STEPS
    assert got["gathered_bytes"] == 32 * (PAYLOAD_FIELDS + 2 * 20) * 8 < 32 * (
        PAYLOAD_FIELDS + 2 * ARRIVAL_STEPS) * 8
