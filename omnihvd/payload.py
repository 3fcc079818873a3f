"""What each rank contributes to the adjustment allgather, and how the gathered matrix reads.

Once per ``adjust_every`` window every rank sends one row of :data:`PAYLOAD_FIELDS`
float64 (72 bytes), and every rank receives the same ``(ranks, PAYLOAD_FIELDS)``
matrix; with ``balance_arrivals=True`` (the same on every rank) each row also carries
:data:`~omnihvd.arrivals.ARRIVAL_STEPS` more (328 bytes in all):

====  =========  ==========================================================
col   name       meaning
====  =========  ==========================================================
0     TIME       the window's summary step time, seconds (NaN: no sample)
1     COUNT      valid samples in the window
2     SIZE       this rank's batch size in the window
3     AHEAD      steps beyond the current one this rank's sampler handed out
4     DIGEST     checksum of the whole size vector this rank believes in
5     CAP        this rank's memory cap (lowered by out-of-memory errors)
6     ERROR      the standard error of TIME (the noise gate's input)
7     PERIOD     the window's median step period, waiting included (NaN: none)
8     PERIOD_ERR the standard error of PERIOD
9-40  ARRIVALS   only with balance_arrivals: the local time of each of the
                 window's last steps (NaN: none), aligned by step: column
                 9 + j is the same step on every rank
====  =========  ==========================================================

Every float is exact for the integers it carries (a crc32 and batch sizes are far
below 2**53), so every rank reads the same ints back. Pure Python and numpy.

>>> from omnihvd.cadence import Measurement
>>> m = Measurement(time=0.2, error=0.01, count=4)
>>> rows = [payload_row(m, [30, 30], r, lookahead=0, cap=60) for r in (0, 1)]
>>> got = read_gathered(np.array(rows), step=3)
>>> got.sizes, got.times.tolist(), got.caps.tolist(), got.lookahead
([30, 30], [0.2, 0.2], [60, 60], 0)
"""
import zlib
from typing import List, NamedTuple, Optional, Sequence

import numpy as np

from .arrivals import ARRIVAL_STEPS
from .errors import RankMismatchError

__all__ = ["PAYLOAD_FIELDS", "Gathered", "digest", "payload_row", "read_gathered"]

TIME, COUNT, SIZE, AHEAD, DIGEST, CAP, ERROR, PERIOD, PERIOD_ERR = range(9)
PAYLOAD_FIELDS = 9  # float64 per rank per adjustment
ARRIVALS = PAYLOAD_FIELDS  # with balance_arrivals: the first of ARRIVAL_STEPS more columns


def digest(sizes: Sequence[int]) -> float:
    """A float-exact checksum of a size vector (crc32 fits a float64 exactly).

    >>> digest([30, 30]) == digest([30, 30]) != digest([20, 40])
    True
    """
    return float(zlib.crc32(",".join(str(int(b)) for b in sizes).encode()))


def payload_row(measured, sizes: Sequence[int], rank: int, lookahead: int,
                cap: int) -> List[float]:
    """This rank's row of the gather.

    Args:
        measured: the closed window (:class:`omnihvd.cadence.Measurement`).
        sizes: every rank's sizes the window was measured at.
        rank: this rank.
        lookahead: steps beyond the current one this rank has handed out.
        cap: this rank's memory cap.

    Returns:
        list of :data:`PAYLOAD_FIELDS` floats in column order, and ARRIVAL_STEPS more
        when ``measured`` holds per-step times (``arrivals`` not None).
    """
    row = [0.0] * PAYLOAD_FIELDS
    row[TIME], row[COUNT], row[ERROR] = measured.time, measured.count, measured.error
    row[PERIOD], row[PERIOD_ERR] = measured.period, measured.period_error
    row[SIZE], row[AHEAD], row[DIGEST], row[CAP] = sizes[rank], lookahead, digest(sizes), cap
    if measured.arrivals is not None:
        steps = np.ravel(measured.arrivals)[-ARRIVAL_STEPS:]
        row += [float(v) for v in steps] + [float("nan")] * (ARRIVAL_STEPS - len(steps))
    return row


class Gathered(NamedTuple):
    """The gathered matrix, read column by column (the same on every rank)."""

    sizes: List[int]       # every rank's size in the window
    times: np.ndarray      # summary step times, seconds
    errors: np.ndarray     # their standard errors
    counts: np.ndarray     # valid samples per rank
    caps: np.ndarray       # memory caps (int64)
    lookahead: int         # the most steps any rank has handed out beyond the current one
    periods: np.ndarray    # median step periods, waiting included (NaN: none)
    period_errors: np.ndarray  # their standard errors
    arrivals: Optional[np.ndarray] = None  # (steps, ranks) single steps' local times


def read_gathered(matrix: np.ndarray, step: int) -> Gathered:
    """Read the gathered ``(ranks, PAYLOAD_FIELDS)`` matrix of the window ending at ``step``.

    Raises:
        RankMismatchError: the ranks' digests differ, i.e. they disagree on the
            current batch sizes (diverged state, e.g. different checkpoints loaded).
    """
    if len(set(matrix[:, DIGEST].tolist())) != 1:
        raise RankMismatchError("ranks disagree on the current batch sizes at step %d: "
                                "omnihvd state diverged (were different checkpoints loaded?)"
                                % step)
    steps = matrix[:, ARRIVALS:].T   # none without balance_arrivals
    steps = steps[np.isfinite(steps).any(axis=1)]
    return Gathered(sizes=[int(b) for b in matrix[:, SIZE]], times=matrix[:, TIME],
                    errors=matrix[:, ERROR], counts=matrix[:, COUNT],
                    caps=matrix[:, CAP].astype(np.int64), lookahead=int(matrix[:, AHEAD].max()),
                    periods=matrix[:, PERIOD], period_errors=matrix[:, PERIOD_ERR],
                    arrivals=steps if steps.size else None)
