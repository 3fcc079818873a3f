"""What each rank contributes to the adjustment allgather, and how the gathered matrix reads.

Once per ``adjust_every`` window every rank sends one row of :data:`PAYLOAD_FIELDS`
float64 (104 bytes), and every rank receives the same ``(ranks, PAYLOAD_FIELDS)``
matrix. Per-step blocks follow, one value per step of the window (``steps`` of
:func:`payload_row`: ``min(ARRIVAL_STEPS, adjust_every)`` holds a whole window), in
the order of :data:`STEP_BLOCKS`, each when it is kept (the same on every rank): the
steps' local times with ``balance_arrivals=True``, their release times with
``release_lag=True`` and their arrival moments with ``arrival_lead=True`` or
``release_lag=True`` (the defaults: 424 bytes in all with ``adjust_every=20``, 616
at :data:`~omnihvd.arrivals.ARRIVAL_STEPS` steps):

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
9     BLOCKS     which per-step blocks follow: the sum of 2**k over the k-th
                 block of STEP_BLOCKS present
10    HOST       this rank's machine (:func:`omnihvd.lags.host_key`)
11    CPUS       the CPUs this rank may run on (:func:`omnihvd.lags.cpuset_key`)
12    KIND       this rank's resources (:func:`omnihvd.alike.kind_key`; NaN: none)
13-   per step   each block present: the value of each of the window's last
                 steps (NaN: none), aligned by step: its column j is the same
                 step on every rank
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

(TIME, COUNT, SIZE, AHEAD, DIGEST, CAP, ERROR, PERIOD, PERIOD_ERR, BLOCKS, HOST, CPUS,
 KIND) = range(13)
PAYLOAD_FIELDS = 13  # float64 per rank per adjustment, before the per-step blocks
# the per-step blocks (Measurement fields), in column order: "arrivals" the steps'
# local times (balance_arrivals), "releases" their release times (release_lag),
# "arrived_at" their arrival moments (arrival_lead or release_lag)
STEP_BLOCKS = ("arrivals", "releases", "arrived_at")


def digest(sizes: Sequence[int], agreed: Sequence = ()) -> float:
    """A float-exact checksum of a size vector and of ``agreed``, anything else the
    ranks must hold alike (crc32 fits a float64 exactly).

    >>> digest([30, 30]) == digest([30, 30]) != digest([20, 40])
    True
    >>> digest([30, 30], [(600, 0)]) != digest([30, 30], [(600, 1)])
    True
    """
    text = ",".join(str(int(b)) for b in sizes) + ("|%r" % (tuple(agreed),) if agreed else "")
    return float(zlib.crc32(text.encode()))


def payload_row(measured, sizes: Sequence[int], rank: int, lookahead: int,
                cap: int, host: float = 0.0, cpus: float = 0.0,
                kind: float = float("nan"), agreed: Sequence = (),
                steps: int = ARRIVAL_STEPS) -> List[float]:
    """This rank's row of the gather.

    Args:
        measured: the closed window (:class:`omnihvd.cadence.Measurement`).
        sizes: every rank's sizes the window was measured at.
        rank: this rank.
        lookahead: steps beyond the current one this rank has handed out.
        cap: this rank's memory cap.
        host: this rank's machine (:func:`omnihvd.lags.host_key`).
        cpus: the CPUs it may run on (:func:`omnihvd.lags.cpuset_key`).
        kind: its resources (:func:`omnihvd.alike.kind_key`; NaN: not compared).
        agreed: what else every rank must hold alike (its training sampler's settings
            and place), folded into the sizes' digest.
        steps: the values of each per-step block, the window's last ones (NaN-padded;
            the same on every rank): ``min(ARRIVAL_STEPS, adjust_every)`` holds a
            whole window.

    Returns:
        list of :data:`PAYLOAD_FIELDS` floats in column order, then ``steps`` more
        for each of :data:`STEP_BLOCKS` that ``measured`` holds (not None).
    """
    row = [0.0] * PAYLOAD_FIELDS
    row[TIME], row[COUNT], row[ERROR] = measured.time, measured.count, measured.error
    row[PERIOD], row[PERIOD_ERR] = measured.period, measured.period_error
    row[SIZE], row[AHEAD], row[CAP] = sizes[rank], lookahead, cap
    row[DIGEST] = digest(sizes, agreed)
    row[HOST], row[CPUS], row[KIND] = host, cpus, kind
    for k, name in enumerate(STEP_BLOCKS):
        values = getattr(measured, name)
        if values is not None:
            row[BLOCKS] += 2 ** k
            last = np.ravel(values)[-steps:]
            row += [float(v) for v in last] + [float("nan")] * (steps - len(last))
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
    hosts: Optional[np.ndarray] = None     # each rank's machine
    cpusets: Optional[np.ndarray] = None   # the CPUs each rank may run on
    releases: Optional[np.ndarray] = None  # (steps, ranks) single steps' release times
    arrived_at: Optional[np.ndarray] = None  # (steps, ranks) single steps' arrival moments
    kinds: Optional[np.ndarray] = None     # each rank's resources (None: not compared)


def read_gathered(matrix: np.ndarray, step: int) -> Gathered:
    """Read the gathered ``(ranks, PAYLOAD_FIELDS)`` matrix decided on at ``step``.

    Raises:
        RankMismatchError: the ranks' digests differ, i.e. they disagree on the
            current batch sizes or their training samplers (diverged state, e.g.
            different checkpoints loaded).
    """
    if np.any(matrix[:, DIGEST] != matrix[0, DIGEST]):
        raise RankMismatchError(
            "ranks disagree on the current batch sizes at step %d, or on their training "
            "sampler (dataset length, seed, shuffle, drop_last, epoch, position in it): "
            "omnihvd state diverged -- were different checkpoints loaded, or a sampler "
            "created, loaded or given set_epoch() differently on some rank after "
            "on_train_begin()? Iterating the training loader again mid-epoch on some rank "
            "(next(iter(loader)) to look at a batch) starts a new pass of it there: look "
            "at batches through another loader" % step)
    blocks = int(matrix[0, BLOCKS])
    names = [name for k, name in enumerate(STEP_BLOCKS) if blocks & 2 ** k]
    steps = (matrix.shape[1] - PAYLOAD_FIELDS) // max(len(names), 1)
    per_step = {name: matrix[:, PAYLOAD_FIELDS + k * steps:PAYLOAD_FIELDS + (k + 1) * steps].T
                for k, name in enumerate(names)}
    # the steps no rank has a value of, in any block, left out (of every block alike:
    # row j stays the same step in each); a block without any value is None
    seen = np.zeros(steps, dtype=bool)
    for steps in per_step.values():
        seen |= np.isfinite(steps).any(axis=1)
    if not seen.all():
        per_step = {name: steps[seen] for name, steps in per_step.items()}
    per_step = {name: steps if np.isfinite(steps).any() else None
                for name, steps in per_step.items()}
    return Gathered(sizes=matrix[:, SIZE].astype(np.int64).tolist(), times=matrix[:, TIME],
                    errors=matrix[:, ERROR], counts=matrix[:, COUNT],
                    caps=matrix[:, CAP].astype(np.int64), lookahead=int(matrix[:, AHEAD].max()),
                    periods=matrix[:, PERIOD], period_errors=matrix[:, PERIOD_ERR],
                    hosts=matrix[:, HOST], cpusets=matrix[:, CPUS],
                    kinds=matrix[:, KIND] if np.isfinite(matrix[:, KIND]).all() else None,
                    **per_step)
