"""The adjustment gather's payload (omnihvd.payload): one row per rank, read back the
same on every rank. Pure, single process."""
import math

import numpy as np
import pytest

from omnihvd import payload
from omnihvd.arrivals import ARRIVAL_STEPS
from omnihvd.cadence import Measurement
from omnihvd.errors import RankMismatchError
from omnihvd.payload import PAYLOAD_FIELDS, digest, payload_row, read_gathered

pytestmark = pytest.mark.unit


def matrix(sizes, times, lookaheads=None, caps=None, counts=None, errors=None):
    n = len(sizes)
    rows = [payload_row(Measurement(time=times[r], error=(errors or [0.0] * n)[r],
                                    count=(counts or [5] * n)[r]),
                        sizes, r, (lookaheads or [0] * n)[r], (caps or [sum(sizes)] * n)[r])
            for r in range(n)]
    return np.array(rows, dtype=np.float64)


def test_a_row_has_the_columns_in_order():
    row = payload_row(Measurement(time=0.25, error=0.01, count=9, period=0.5, period_error=0.02),
                      [10, 30], 1, 2, 28)
    assert len(row) == PAYLOAD_FIELDS == 13 and row[payload.BLOCKS] == 0
    assert row[payload.HOST] == row[payload.CPUS] == 0 and np.isnan(row[payload.KIND])
    assert row[payload.TIME] == 0.25 and row[payload.COUNT] == 9 and row[payload.ERROR] == 0.01
    assert row[payload.SIZE] == 30 and row[payload.AHEAD] == 2 and row[payload.CAP] == 28
    assert row[payload.DIGEST] == digest([10, 30])
    assert row[payload.PERIOD] == 0.5 and row[payload.PERIOD_ERR] == 0.02
    got = read_gathered(np.array([row, row]), step=3)
    assert got.periods.tolist() == [0.5, 0.5] and got.period_errors.tolist() == [0.02, 0.02]
    assert got.arrivals is None and got.releases is None and got.kinds is None


def test_the_ranks_kinds_come_back_only_when_every_rank_sent_one():
    m = Measurement(time=0.25, error=0.01, count=9)
    rows = [payload_row(m, [10, 30], r, 0, 40, kind=k) for r, k in enumerate((7.0, 9.0))]
    assert read_gathered(np.array(rows), step=3).kinds.tolist() == [7.0, 9.0]
    rows[1] = payload_row(m, [10, 30], 1, 0, 40)
    assert read_gathered(np.array(rows), step=3).kinds is None


def test_the_steps_local_times_come_back_as_a_steps_by_ranks_table():
    steps = [np.array([0.1, 0.2, np.nan]), np.array([0.3, 0.4, 0.5])]
    rows = [payload_row(Measurement(time=0.2, error=0.0, count=3, arrivals=steps[r]),
                        [10, 30], r, 0, 40) for r in (0, 1)]
    got = read_gathered(np.array(rows), step=3)
    assert all(len(r) == PAYLOAD_FIELDS + ARRIVAL_STEPS for r in rows)
    assert got.arrivals.shape == (3, 2)
    assert got.arrivals[:2].tolist() == [[0.1, 0.3], [0.2, 0.4]]
    assert math.isnan(got.arrivals[2, 0]) and got.arrivals[2, 1] == 0.5
    # a window longer than ARRIVAL_STEPS sends its last steps
    long = np.arange(1, ARRIVAL_STEPS + 11, dtype=np.float64)
    row = payload_row(Measurement(time=1.0, error=0.0, count=3, arrivals=long), [40], 0, 0, 40)
    assert row[PAYLOAD_FIELDS:] == long[-ARRIVAL_STEPS:].tolist()


def test_release_times_and_local_times_per_step_come_back_as_separate_tables():
    local = [np.array([0.1, 0.2]), np.array([0.3, 0.4])]
    releases = [np.array([1000.01, np.nan]), np.array([1000.02, 1000.07])]
    rows = [payload_row(Measurement(time=0.2, error=0.0, count=2, arrivals=local[r],
                                    releases=releases[r]), [10, 30], r, 0, 40, host=5.0 + r,
                        cpus=7.0)
            for r in (0, 1)]
    assert all(len(r) == PAYLOAD_FIELDS + 2 * ARRIVAL_STEPS for r in rows)
    got = read_gathered(np.array(rows), step=3)
    assert got.arrivals.tolist() == [[0.1, 0.3], [0.2, 0.4]]
    assert got.releases[0].tolist() == [1000.01, 1000.02] and got.releases[1, 1] == 1000.07
    assert got.hosts.tolist() == [5.0, 6.0] and got.cpusets.tolist() == [7.0, 7.0]
    # release times alone (the default: release_lag without balance_arrivals)
    rows = [payload_row(Measurement(time=0.2, error=0.0, count=2, releases=releases[r]),
                        [10, 30], r, 0, 40) for r in (0, 1)]
    got = read_gathered(np.array(rows), step=3)
    assert got.arrivals is None and got.releases[0].tolist() == [1000.01, 1000.02]


def test_reading_the_gathered_matrix_gives_every_column_back():
    got = read_gathered(matrix([10, 20, 30], [0.1, 0.2, math.nan], lookaheads=[0, 3, 1],
                               caps=[60, 17, 60], counts=[4, 5, 0], errors=[0.01, 0.02, 0.0]),
                        step=9)
    assert got.sizes == [10, 20, 30] and all(type(b) is int for b in got.sizes)
    assert got.times[:2].tolist() == [0.1, 0.2] and math.isnan(got.times[2])
    assert got.counts.tolist() == [4, 5, 0] and got.errors.tolist() == [0.01, 0.02, 0.0]
    assert got.caps.tolist() == [60, 17, 60] and got.caps.dtype == np.int64
    assert got.lookahead == 3  # the deepest prefetch of any rank


def test_ranks_that_disagree_on_the_sizes_stop_every_rank():
    m = matrix([10, 20, 30], [0.1, 0.2, 0.3])
    m[2, payload.DIGEST] = digest([10, 20, 31])
    with pytest.raises(RankMismatchError, match="disagree on the current batch sizes at step 7"):
        read_gathered(m, step=7)


def test_the_digest_is_exact_in_float64_and_tells_splits_apart():
    splits = [[16, 16], [15, 17], [17, 15], [1, 31], [160, 16], [16, 160]]
    values = [digest(s) for s in splits]
    assert len(set(values)) == len(splits)
    assert all(v == int(v) and 0 <= v < 2 ** 32 for v in values)  # crc32: exact as a float
    assert digest(np.array([16, 16])) == digest([16, 16])


def test_the_per_step_blocks_hold_a_windows_steps():
    # rows of 20 steps a block read as rows of ARRIVAL_STEPS do: the same tables
    rng = np.random.default_rng(0)
    releases = 100.0 + rng.random((20, 3))
    releases[:, 1] = np.nan
    rows = {steps: np.array([payload_row(
        Measurement(time=0.2, error=0.01, count=4, releases=releases[:, r],
                    arrived_at=releases[:, r] - 0.01), [30, 30, 30], r, lookahead=0, cap=90,
        steps=steps) for r in range(3)]) for steps in (20, ARRIVAL_STEPS)}
    assert rows[20].shape == (3, PAYLOAD_FIELDS + 2 * 20)
    short, full = (read_gathered(rows[s], step=20) for s in (20, ARRIVAL_STEPS))
    for name in ("releases", "arrived_at"):
        np.testing.assert_array_equal(getattr(short, name), getattr(full, name))
    assert short.releases.shape == (20, 3)
    # a longer series sends its last steps
    row = payload_row(Measurement(time=0.2, error=0.0, count=4, releases=np.arange(30.0) + 1),
                      [30], 0, lookahead=0, cap=30, steps=20)
    assert row[PAYLOAD_FIELDS:] == list(np.arange(10.0, 30.0) + 1)
