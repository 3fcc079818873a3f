"""The OmniLearn batch-size controller. Pure numpy: no torch, horovod or mpi4py.

Every function here is deterministic: the same inputs give bit-identical outputs on
every rank, also on different processors, because it uses only element-wise IEEE
arithmetic, sorting and numpy's fixed-order sums -- no threads, no BLAS.
That is what lets every rank compute the same decision from the same gathered data
without a second collective.

Two policies turn measured step times into new per-rank batch sizes:

``"proportional"`` -- the paper's controller (Tyagi & Sharma, eq. 4-5)::

    x_i = b_i / t_i                       # throughput of rank i, samples/s
    delta_i = -gain * x_i * (t_i - mean(t))
    b_i' = b_i + delta_i                  # then scaled to sum to B

  With ``gain=1`` this is ``b_i' = B x_i / sum(x)``: exact in one step when step time
  is proportional to batch size.

``"affine"`` -- a time model ``t_i(b) = a_i + c_i * b`` per rank, fitted from the
  measured history, solved in closed form for the common step time ``T`` at which
  ``sum_i (T - a_i) / c_i = B``. A fixed per-step cost ``a_i`` (kernel launches,
  Python overhead, the optimizer) makes the proportional controller overshoot and
  need several rounds; the affine solve lands in one once two sizes were seen.

Both end in :func:`apportion`, which turns continuous targets into integers that sum
exactly to the global batch and respect per-rank bounds -- and, with
``size_multiple=k``, are multiples of k (the *multiple rule*: when k does not divide
the total, rank 0 alone also takes the remainder ``total mod k``; see
:func:`unit_bounds`). :func:`partial_split` sizes an epoch's last, smaller step
under the same bounds, or says that no split fits.
"""
import math
import warnings
from collections.abc import Mapping, Set as AbstractSet
from typing import List, NamedTuple, Optional, Sequence, Union

import numpy as np

from .alike import AlikeGroups
from .arrivals import ArrivalPool, last_arrival_split
from .errors import ConfigError, InfeasibleError
from .lags import LagPool
from .lead import ArrivalLead
from .timing import MAD_TO_SD
from .tuning import tilt_weights

__all__ = [
    "POLICIES",
    "DEFAULT_DEADBAND",
    "TimeModel",
    "Controller",
    "rebalance",
    "apportion",
    "partial_split",
    "is_valid_split",
    "unit_bounds",
    "fit_time_model",
    "solve_time_model",
    "predict_step_times",
    "relative_change",
    "resolve_bounds",
    "initial_split",
]

POLICIES = ("affine", "proportional")

# A rank's new time must stray from the prediction by more than this many times the
# measured noise of one round (and by ``change_tolerance``) to count as a change of
# speed: a round of Gaussian noise strays 4 standard deviations about once in 16,000.
CHANGE_NOISE_FACTOR = 4.0

# The callbacks' and balancer's dead band: new sizes are applied only when some rank's
# size changes by at least 1%. Telling noise from a real imbalance is the noise gate's
# work (Controller.decide); the dead band only skips moves too small to matter (and
# the cost of a change: settle steps, a new pool, on GPUs new kernel shapes). A split
# one sample off on a rank of b samples costs about 1/b of every step, so the dead band
# must let such a move through where 1/b matters: at 5% (the paper's value) 32 of 256
# where 31 was balanced stayed for good (3% of every step), at 2% 63/65 of 256 where
# 64/64 was balanced (1.6%, after the emulation's dynamic schedule came back to HL1).
DEFAULT_DEADBAND = 0.01

IntOrList = Union[int, Sequence[int], None]


class TimeModel(NamedTuple):
    """Affine model of one step's local compute time on each rank."""

    intercept: np.ndarray  # a_i: fixed cost of a step on rank i, seconds
    slope: np.ndarray      # c_i: cost of one more sample on rank i, seconds


# ---------------------------------------------------------------- validation


def _fsum(values) -> float:
    # numpy's float64 sum is a fixed-order pairwise summation (no reassociation, no
    # fused multiply-add), so it gives the same bits on every rank.
    return float(np.sum(np.asarray(values, dtype=np.float64)))


def int_list(values) -> list:
    """``[int(v) for v in values]`` (a float truncated), through one int64 array: at
    thousands of ranks the loop costs a millisecond, this a fraction of it.

    >>> int_list([3, 2.7, np.int64(5)])
    [3, 2, 5]
    """
    return np.asarray(values, dtype=np.int64).tolist()


# The largest size or count accepted: every float64 up to it is an exact integer (the
# gathered rows carry sizes as float64), and sums of a few of them fit an int64.
MAX_COUNT = 2 ** 53


def _as_int_vector(name, values, n=None):
    try:
        arr = np.asarray(values)
    except Exception as exc:  # ragged lists and the like
        raise ConfigError("%s must be a sequence of integers, got %r (%s)" % (name, values, exc))
    if arr.ndim != 1 or arr.size == 0:
        raise ConfigError("%s must be a non-empty 1-d sequence of integers, got %r" % (name, values))
    if n is not None and arr.size != n:
        raise ConfigError("%s has %d entries but there are %d ranks; give one per rank"
                          % (name, arr.size, n))
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise ConfigError("%s must hold whole numbers, got %r" % (name, list(values)))
    elif arr.dtype.kind not in "iu" or (isinstance(values, (list, tuple)) and not {
            bool, np.bool_}.isdisjoint(map(type, values))):  # [16, True] is int64 to numpy
        raise ConfigError("%s must hold integers, got %r" % (name, values))
    if np.any(np.abs(arr) > MAX_COUNT):
        raise ConfigError("%s must hold integers up to 2**53, got %r" % (name, list(values)))
    return arr.astype(np.int64)


def _as_time_vector(name, values, n):
    kind = values.dtype.kind if isinstance(values, np.ndarray) else "O"
    raw = np.asarray(values, dtype=object) if kind == "O" else None
    if kind in "bSU" or (raw is not None and raw.ndim == 1 and any(
            isinstance(v, (bool, np.bool_, str, bytes)) for v in raw)):
        raise ConfigError("%s must be a sequence of seconds (numbers, not bools or strings), "
                          "got %r" % (name, values))
    try:
        arr = np.asarray(values, dtype=np.float64)
    except Exception as exc:
        raise ConfigError("%s must be a sequence of seconds, got %r (%s)" % (name, values, exc))
    if arr.ndim != 1 or arr.size != n:
        raise ConfigError("%s must have one entry per rank (%d), got %r" % (name, n, values))
    bad = np.flatnonzero(~np.isfinite(arr) | (arr <= 0))
    if bad.size:
        raise ConfigError("%s must be finite and positive; rank %d has %r. Drop the "
                          "measurement instead of passing it." % (name, bad[0], float(arr[bad[0]])))
    return arr


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError("%s must be an integer, got %r" % (name, value))
    if value < minimum:
        raise ConfigError("%s must be >= %d, got %d" % (name, minimum, value))
    if value > MAX_COUNT:
        raise ConfigError("%s must be <= 2**53, got %d" % (name, value))
    return int(value)


def _check_float(name, value, minimum, *, strict=False):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ConfigError("%s must be a number, got %r" % (name, value))
    value = float(value)
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ConfigError("%s must be a finite number %s %g, got %r"
                          % (name, ">" if strict else ">=", minimum, value))
    return value


# A proportional step of gain K leaves (1 - K) of the error: at 2 each step overshoots
# by as much as it corrects (the split swings for ever), above 2 it diverges.
MAX_GAIN = 2.0


def _check_gain(gain) -> float:
    gain = _check_float("gain", gain, 0.0, strict=True)
    if gain >= MAX_GAIN:
        raise ConfigError("gain must be in (0, %g): a step of gain K leaves 1 - K of the "
                          "imbalance, so from %g on the split overshoots by as much as it "
                          "corrects or more and never settles; got %r"
                          % (MAX_GAIN, MAX_GAIN, gain))
    return gain


def resolve_bounds(n: int, global_batch_size: int, min_batch_size: IntOrList = 1,
                   max_batch_size: IntOrList = None):
    """Per-rank integer bounds ``(lo, hi)`` as int64 arrays, checked for feasibility.

    Args:
        n: number of ranks.
        global_batch_size: B, the sum every split must reach.
        min_batch_size: int or per-rank list, each >= 1.
        max_batch_size: None (no cap), int, or per-rank list.

    Raises:
        ConfigError: malformed bounds (wrong length, non-integer, min > max).
        InfeasibleError: no split exists (``sum(min) > B`` or ``sum(max) < B``).

    >>> resolve_bounds(2, 10, 1, [4, 8])
    (array([1, 1]), array([4, 8]))
    """
    B = _check_int("global_batch_size", global_batch_size, 1)
    if isinstance(min_batch_size, (int, np.integer)) and not isinstance(min_batch_size, bool):
        lo = np.full(n, _check_int("min_batch_size", min_batch_size, 1), dtype=np.int64)
    else:
        lo = _as_int_vector("min_batch_size", min_batch_size, n)
    if max_batch_size is None:
        hi = np.full(n, B, dtype=np.int64)
    elif isinstance(max_batch_size, (int, np.integer)) and not isinstance(max_batch_size, bool):
        hi = np.full(n, _check_int("max_batch_size", max_batch_size, 1), dtype=np.int64)
    else:
        hi = _as_int_vector("max_batch_size", max_batch_size, n)
    if np.any(lo < 1):
        r = int(np.flatnonzero(lo < 1)[0])
        raise ConfigError("min_batch_size must be >= 1 on every rank; rank %d has %d" % (r, lo[r]))
    if int(lo.sum()) > B:
        raise InfeasibleError(
            "infeasible: %d ranks x min_batch_size (sum %d) exceed global_batch_size %d; lower "
            "min_batch_size or raise global_batch_size" % (n, int(lo.sum()), B))
    if np.any(lo > hi):
        r = int(np.flatnonzero(lo > hi)[0])
        raise ConfigError("min_batch_size %d > max_batch_size %d on rank %d; lower the minimum "
                          "or raise the maximum" % (lo[r], hi[r], r))
    hi = np.minimum(hi, B)
    if int(hi.sum()) < B:
        raise InfeasibleError(
            "infeasible: the per-rank max_batch_size caps sum to %d < global_batch_size %d; raise "
            "the caps, add ranks, or lower global_batch_size" % (int(hi.sum()), B))
    return lo, hi


# ---------------------------------------------------------- size multiples


def unit_bounds(lo, hi, total: int, size_multiple: int):
    """Per-rank bounds in units of ``size_multiple`` for a split of ``total``.

    The multiple rule: every rank's size is ``k * units``, except rank 0, whose size
    is ``k * units + (total mod k)``; so the sizes sum to ``total`` for any total, and
    when k divides it every size is a multiple of k. Rank 0 is fixed (not, say, the
    fastest rank) so that a valid split stays valid while speeds change, which keeps
    the controller's one-decision trust region feasible.

    Args:
        lo, hi: per-rank int64 size bounds (from :func:`resolve_bounds`).
        total: the samples to split.
        size_multiple: k >= 1.

    Returns:
        ``(ulo, uhi, units, remainder)``: int64 unit bounds, the units to share
        (``total // k``) and rank 0's extra samples (``total % k``).

    Raises:
        InfeasibleError: a rank's bounds hold no allowed size, or the unit bounds
            cannot share ``total // k`` units.

    >>> ulo, uhi, units, rest = unit_bounds(np.array([1, 1]), np.array([40, 40]), 36, 8)
    >>> ulo.tolist(), uhi.tolist(), units, rest
    ([0, 1], [4, 5], 4, 4)
    """
    k = _check_int("size_multiple", size_multiple, 1)
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    units, rest = divmod(int(total), k)
    ulo, uhi = -(-lo // k), hi // k
    ulo[0] = max(0 if rest else 1, -(-(int(lo[0]) - rest) // k))
    uhi[0] = (int(hi[0]) - rest) // k
    if np.any(ulo > uhi):
        r = int(np.flatnonzero(ulo > uhi)[0])
        allowed = "a multiple of %d" % k if r or not rest else "%d more than a multiple of %d" % (
            rest, k)
        raise InfeasibleError("infeasible: size_multiple %d needs rank %d's size to be %s, and "
                              "none lies in its bounds [%d, %d]; widen min/max_batch_size or "
                              "change size_multiple" % (k, r, allowed, lo[r], hi[r]))
    if int(ulo.sum()) > units or int(uhi.sum()) < units:
        raise InfeasibleError("infeasible: with size_multiple %d, %d samples (%d units of %d, "
                              "rank 0 taking %d more) do not fit the per-rank bounds %s..%s; "
                              "lower size_multiple or widen the bounds"
                              % (k, total, units, k, rest, lo.tolist(), hi.tolist()))
    return ulo, uhi, units, rest


def is_valid_split(sizes, total: int, lo, hi, size_multiple: int = 1) -> bool:
    """Whether ``sizes`` sums to ``total``, lies within ``[lo, hi]`` and follows the
    multiple rule of :func:`unit_bounds`.

    >>> is_valid_split([12, 8, 16], 36, [1, 1, 1], [36, 36, 36], 8)
    True
    >>> is_valid_split([8, 12, 16], 36, [1, 1, 1], [36, 36, 36], 8)
    False
    """
    b = np.asarray(sizes, dtype=np.int64)
    if b.ndim != 1 or b.size != np.size(lo) or int(b.sum()) != int(total):
        return False
    if np.any(b < lo) or np.any(b > hi):
        return False
    k = int(size_multiple)
    return bool(np.all(b[1:] % k == 0) and b[0] % k == int(total) % k)
def initial_split(num_ranks: int, global_batch_size: int, lo, hi, initial_batch_sizes=None,
                  *, member: str = "rank", size_multiple: int = 1) -> list:
    """The starting sizes: ``initial_batch_sizes`` checked, or an equal split.

    The one check of ``initial_batch_sizes`` for the callback, the asynchronous
    balancer and the simulator.

    Args:
        num_ranks: n.
        global_batch_size: B.
        lo, hi: per-rank bounds from :func:`resolve_bounds`.
        initial_batch_sizes: None (equal split within the bounds) or one int per rank.
        member: what one entry is for, in messages (``"rank"`` or ``"worker"``).
        size_multiple: k; the sizes must follow the multiple rule of :func:`unit_bounds`.

    Raises:
        ConfigError: not one int per rank, a sum other than B, or a size outside
            its bounds (the message names the entry and the bounds).

    >>> initial_split(3, 10, [1, 1, 1], [10, 10, 10])
    [4, 3, 3]
    >>> initial_split(2, 10, [1, 1], [10, 10], [3, 7])
    [3, 7]
    """
    if initial_batch_sizes is None:
        return apportion([1.0] * num_ranks, global_batch_size, lo, hi, size_multiple)
    try:   # a mapping or a set would give its keys, in no agreed order
        sizes = (None if isinstance(initial_batch_sizes, (Mapping, AbstractSet, str))
                 else [int(b) for b in initial_batch_sizes])
    except (TypeError, ValueError):
        sizes = None
    if sizes is None or len(sizes) != num_ranks or any(
            isinstance(v, bool) or b != v for b, v in zip(sizes, initial_batch_sizes)):
        raise ConfigError("initial_batch_sizes must be a list of %d ints (one per %s), got %r"
                          % (num_ranks, member, initial_batch_sizes))
    if sum(sizes) != global_batch_size:
        raise ConfigError("initial_batch_sizes %r sum to %d, not global_batch_size %d"
                          % (sizes, sum(sizes), global_batch_size))
    for r, b in enumerate(sizes):
        if not lo[r] <= b <= hi[r]:
            raise ConfigError("initial_batch_sizes[%d]=%d is outside [%d, %d] (min/max_batch_size)"
                              % (r, b, lo[r], hi[r]))
    if not is_valid_split(sizes, global_batch_size, lo, hi, size_multiple):
        raise ConfigError("initial_batch_sizes %r do not follow size_multiple %d: every size must "
                          "be a multiple of it, rank 0's plus %d (B mod %d)"
                          % (sizes, size_multiple, global_batch_size % size_multiple, size_multiple))
    return sizes


# ------------------------------------------------------------- apportioning


def _water_fill(offset, scale, total, lo, hi):
    """Continuous ``v_i = clip(offset_i + scale_i * s, lo_i, hi_i)`` with ``sum v = total``.

    ``scale`` must be positive. ``sum v`` is piecewise linear and non-decreasing in s,
    so the s that hits ``total`` lies between two sorted breakpoints, found by binary
    search, and is solved exactly there.
    """
    lo_f, hi_f = lo.astype(np.float64), hi.astype(np.float64)
    breaks = np.unique(np.concatenate([(lo_f - offset) / scale, (hi_f - offset) / scale]))

    def filled(s):
        return np.clip(offset + scale * s, lo_f, hi_f)

    if _fsum(hi_f) <= total:  # every rank at its cap (resolve_bounds excludes "<")
        return hi_f
    lo_i, hi_i = 0, breaks.size - 1
    while hi_i - lo_i > 1:  # invariant: sum(filled(breaks[lo_i])) <= total <= sum(...hi_i)
        mid = (lo_i + hi_i) // 2
        if _fsum(filled(breaks[mid])) <= total:
            lo_i = mid
        else:
            hi_i = mid
    s0 = breaks[lo_i]
    base = filled(s0)
    if _fsum(base) >= total:
        return base
    s1 = breaks[hi_i]
    mid_s = (s0 + s1) / 2.0
    free = (offset + scale * mid_s > lo_f) & (offset + scale * mid_s < hi_f)
    slope = _fsum(scale[free])
    s = s0 + (total - _fsum(base)) / slope if slope > 0 else s1
    return filled(min(max(s, s0), s1))


def apportion(targets, global_batch_size: int, min_batch_size: IntOrList = 1,
              max_batch_size: IntOrList = None, size_multiple: int = 1) -> list:
    """Integer batch sizes proportional to ``targets``, summing exactly to B, within bounds.

    Targets are scaled by one common factor (ranks at a bound are held there, the
    rest share what is left), then rounded by largest remainder; ties go to the lower
    rank, so the result is deterministic.

    Args:
        targets: one non-negative weight per rank (e.g. throughputs).
        global_batch_size: B.
        min_batch_size, max_batch_size: see :func:`resolve_bounds`.
        size_multiple: k; sizes follow the multiple rule of :func:`unit_bounds`
            (multiples of k, rank 0 also taking ``B mod k``). The sharing and the
            rounding then work in units of k.

    Returns:
        list of int, one per rank, ``sum == global_batch_size``.

    Raises:
        ConfigError, InfeasibleError: see :func:`resolve_bounds` and
        :func:`unit_bounds`; also for negative or non-finite targets.

    >>> apportion([1, 1, 2, 4], 64)
    [8, 8, 16, 32]
    >>> apportion([1, 1, 1], 10)
    [4, 3, 3]
    >>> apportion([1, 1, 2, 4], 64, size_multiple=8)
    [8, 8, 16, 32]
    >>> apportion([1, 1, 1], 10, size_multiple=4)   # rank 0 takes 10 mod 4 = 2
    [2, 4, 4]
    """
    w = np.asarray(targets, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ConfigError("targets must be a non-empty 1-d sequence, got %r" % (targets,))
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ConfigError("targets must be finite and >= 0, got %r" % (list(w),))
    lo, hi = resolve_bounds(w.size, global_batch_size, min_batch_size, max_batch_size)
    top = float(w.max())
    # Weights relative to the largest (only their ratios matter; a tiny or subnormal
    # scale would overflow the solve's breakpoints). A zero weight would pin a rank to
    # its minimum forever; a tiny floor keeps the solve well-posed and changes nothing
    # measurable.
    w = np.maximum(w / top, 1e-9) if top > 0 else np.ones_like(w)
    if _check_int("size_multiple", size_multiple, 1) == 1:
        return _round_to_total(_water_fill(np.zeros_like(w), w, global_batch_size, lo, hi),
                               int(global_batch_size), lo, hi)
    ulo, uhi, units, rest = unit_bounds(lo, hi, int(global_batch_size), size_multiple)
    sizes = np.asarray(_round_to_total(_water_fill(np.zeros_like(w), w, units, ulo, uhi),
                                       units, ulo, uhi), dtype=np.int64) * int(size_multiple)
    sizes[0] += rest
    return sizes.tolist()


def partial_split(batch_sizes, total: int, min_batch_size: IntOrList = 1,
                  max_batch_size: IntOrList = None, size_multiple: int = 1) -> Optional[list]:
    """Sizes of an epoch's last, partial step of ``total`` samples, or None.

    The ``total`` samples are split in proportion to the current ``batch_sizes``
    within the same per-rank bounds and multiple rule as a full step. When no split
    fits (fewer samples than the ranks' minimums add up to, or the multiples cannot
    reach ``total``), the answer is None: the step is dropped, since a rank below its
    minimum (e.g. one sample into ``BatchNorm``) or outside its memory cap cannot
    take it.

    Args:
        batch_sizes: every rank's current size (the proportions).
        total: samples left for the partial step, ``0 < total``.
        min_batch_size, max_batch_size, size_multiple: as in :func:`apportion`.

    Returns:
        list of int summing to ``total``, or None.

    Raises:
        ConfigError: malformed arguments.

    >>> partial_split([8, 8, 16, 32], 5, min_batch_size=2) is None   # 4 ranks x 2 > 5
    True
    >>> partial_split([8, 8, 16, 32], 9, min_batch_size=2)
    [2, 2, 2, 3]
    """
    try:
        return apportion(batch_sizes, total, min_batch_size, max_batch_size, size_multiple)
    except InfeasibleError:
        return None


def _round_to_total(values, total, lo, hi):
    """Largest-remainder rounding of ``values`` to integers summing to ``total``.

    Ranks are served by decreasing fractional part, lower rank first on ties (the
    fraction is rounded to 12 digits so float noise cannot reorder true ties).
    """
    sizes = np.clip(np.floor(values + 1e-9).astype(np.int64), lo, hi)
    frac = np.round(values - sizes, 12)
    order = np.lexsort((np.arange(sizes.size), -frac))
    short = total - int(sizes.sum())
    while short != 0:
        if short > 0:
            room = order[sizes[order] < hi[order]][:short]
            sizes[room] += 1
        else:
            room = order[::-1][sizes[order[::-1]] > lo[order[::-1]]][:-short]
            sizes[room] -= 1
        if room.size == 0:  # excluded by resolve_bounds
            raise InfeasibleError("no integer split of %d within the bounds" % total)
        short = total - int(sizes.sum())
    return sizes.tolist()


def relative_change(old, new) -> float:
    """``max_i |new_i - old_i| / old_i``: the quantity the dead band is compared with."""
    old = np.asarray(old, dtype=np.float64)
    new = np.asarray(new, dtype=np.float64)
    return float(np.max(np.abs(new - old) / np.maximum(old, 1.0)))


def _deadband(old, new, global_batch_size, lo, hi, deadband, size_multiple=1):
    """Keep ``old`` when it is a valid split and the change is below the dead band."""
    old = np.asarray(old)
    valid = is_valid_split(old, global_batch_size, lo, hi, size_multiple)
    if valid and relative_change(old, new) < deadband:
        return int_list(old)
    return new


# ------------------------------------------------------- proportional policy


def rebalance(batch_sizes, times, global_batch_size, *, min_batch_size=1, max_batch_size=None,
              gain=1.0, deadband=0.0, size_multiple=1) -> list:
    """The paper's proportional controller: new per-rank batch sizes from step times.

    Args:
        batch_sizes: current size of each rank, the sizes ``times`` were measured at.
        times: each rank's local compute time per step at that size (seconds, > 0),
            excluding time spent waiting for other ranks.
        global_batch_size: B; the result always sums to it exactly.
        min_batch_size: int or per-rank list (default 1).
        max_batch_size: None, int, or per-rank list (memory caps).
        gain: K in ``delta_i = -K x_i (t_i - mean t)``, in (0, 2); 1.0 jumps straight
            to the proportional split, smaller values move part of the way.
        deadband: return ``batch_sizes`` unchanged when the largest relative change
            ``max |b_i' - b_i| / b_i`` is below it (only when ``batch_sizes`` is itself
            a valid split; otherwise the sizes must change anyway).
        size_multiple: k; sizes are multiples of k, rank 0 also taking
            ``global_batch_size mod k`` (see :func:`unit_bounds`).

    Returns:
        list of int: new sizes, ``sum == global_batch_size``, each within bounds.

    Raises:
        ConfigError: malformed input (lengths, non-integer sizes, non-positive or
            non-finite times, a gain outside (0, 2) or a negative dead band).
        InfeasibleError: bounds that admit no split.

    Example: speeds 1:1:2:4 at equal sizes, then the proportional split:

    >>> rebalance([16, 16, 16, 16], [4.0, 4.0, 2.0, 1.0], 64)
    [8, 8, 16, 32]
    >>> rebalance([8, 8, 16, 32], [2.0, 2.0, 2.0, 2.0], 64)   # balanced: a fixed point
    [8, 8, 16, 32]
    """
    b = _as_int_vector("batch_sizes", batch_sizes)
    if np.any(b < 1):
        raise ConfigError("batch_sizes must be >= 1, got %r" % (list(batch_sizes),))
    t = _as_time_vector("times", times, b.size)
    gain = _check_gain(gain)
    deadband = _check_float("deadband", deadband, 0.0)
    lo, hi = resolve_bounds(b.size, global_batch_size, min_batch_size, max_batch_size)
    # The update is scale-free (only the times' ratios matter), so they are taken
    # relative to the slowest: no overflow at any float scale. A rank more than 1e12
    # times faster than the slowest counts as 1e12 times.
    t = np.maximum(t / t.max(), 1e-12)
    x = b / t
    tbar = _fsum(t) / t.size
    target = np.maximum(b - gain * x * (t - tbar), 0.0)
    new = apportion(target, global_batch_size, lo, hi, size_multiple)
    return _deadband(b, new, int(global_batch_size), lo, hi, deadband, size_multiple)


# ------------------------------------------------------------- affine policy


def fit_time_model(history_sizes, history_times, *, mask=None, max_intercept_fraction=0.5,
                   min_spread=0.1) -> TimeModel:
    """Fit ``t_i(b) = a_i + c_i b`` per rank from its measured (size, time) history.

    Least squares per rank. The line is then re-anchored through the rank's latest
    measurement (the current state, which matters when speeds change) keeping the
    fitted intercept, clamped to ``[0, max_intercept_fraction * t_latest]`` so that a
    noisy fit can neither go negative nor claim a step is mostly fixed cost (which
    would make the rank look far faster per sample than it is). A rank whose sizes
    spread less than ``min_spread`` (relative to their mean) has no usable slope and,
    like a non-increasing fit, gets ``a_i = 0``: the proportional model.

    Args:
        history_sizes: array-like ``(k, n)``: sizes at k past measurements, oldest first.
        history_times: array-like ``(k, n)``: local step times at those sizes.
        mask: optional boolean ``(k, n)``: which measurements still describe the rank
            (False for those before a detected change of speed). The last row must
            be valid.

    Returns:
        TimeModel(intercept, slope), each shape (n,).

    >>> m = fit_time_model([[10, 30], [20, 20]], [[2.0, 3.5], [3.0, 2.5]])
    >>> [round(float(v), 6) for v in m.intercept], [round(float(v), 6) for v in m.slope]
    ([1.0, 0.5], [0.1, 0.1])
    """
    sizes = np.atleast_2d(np.asarray(history_sizes, dtype=np.float64))
    times = np.atleast_2d(np.asarray(history_times, dtype=np.float64))
    if sizes.shape != times.shape or sizes.size == 0:
        raise ConfigError("history_sizes %s and history_times %s must have the same (k, n) shape"
                          % (sizes.shape, times.shape))
    if not (np.all(np.isfinite(times)) and np.all(times > 0) and np.all(sizes >= 1)):
        raise ConfigError("history must hold sizes >= 1 and finite positive times")
    w = np.ones(sizes.shape) if mask is None else np.asarray(mask, dtype=bool).astype(np.float64)
    if w.shape != sizes.shape or not np.all(w[-1] == 1):
        raise ConfigError("mask must have the history's shape with its last row all True")
    b_last, t_last = sizes[-1], times[-1]
    intercept = np.zeros(sizes.shape[1])
    count = w.sum(axis=0)
    if sizes.shape[0] >= 2 and np.any(count >= 2):
        # Column-wise weighted least squares over each rank's valid rows. Sums over
        # k <= history rows run in a fixed order, so they are deterministic.
        bm, tm = (w * sizes).sum(axis=0) / count, (w * times).sum(axis=0) / count
        var = (w * (sizes - bm) ** 2).sum(axis=0)
        spread = np.where(w > 0, sizes, -np.inf).max(axis=0) - np.where(w > 0, sizes, np.inf).min(axis=0)
        usable = (count >= 2) & (spread >= min_spread * bm) & (var > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            cov = (w * (sizes - bm) * (times - tm)).sum(axis=0)
            c = np.where(usable, cov / np.where(usable, var, 1.0), 0.0)
        a = np.clip(tm - c * bm, 0.0, max_intercept_fraction * t_last)
        intercept = np.where(usable & (c > 0), a, 0.0)
    slope = (t_last - intercept) / b_last
    return TimeModel(intercept, slope)


def predict_step_times(model: TimeModel, batch_sizes) -> np.ndarray:
    """Each rank's predicted local step time at ``batch_sizes`` under ``model``."""
    return model.intercept + model.slope * np.asarray(batch_sizes, dtype=np.float64)


def solve_time_model(model: TimeModel, global_batch_size, *, min_batch_size=1,
                     max_batch_size=None, size_multiple=1) -> list:
    """Integer sizes that equalise predicted step times, in closed form.

    Finds the common step time T with ``sum_i clip((T - a_i) / c_i, lo_i, hi_i) = B``
    (piecewise linear in T, solved exactly between breakpoints), then rounds with
    :func:`apportion`'s largest-remainder rule (in units of ``size_multiple``, whose
    rule :func:`unit_bounds` states, when it is above 1).

    >>> solve_time_model(TimeModel(np.array([1.0, 1.0]), np.array([0.1, 0.05])), 60)
    [20, 40]
    """
    a = np.asarray(model.intercept, dtype=np.float64)
    c = np.asarray(model.slope, dtype=np.float64)
    if a.shape != c.shape or a.ndim != 1 or a.size == 0:
        raise ConfigError("model intercept and slope must be 1-d arrays of equal length")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(c)) and np.all(c > 0)):
        raise ConfigError("model slopes must be finite and > 0, intercepts finite; got %r, %r"
                          % (list(a), list(c)))
    lo, hi = resolve_bounds(a.size, global_batch_size, min_batch_size, max_batch_size)
    # b_i(T) = (T - a_i)/c_i = -a_i/c_i + (1/c_i) T
    values = _water_fill(-a / c, 1.0 / c, int(global_batch_size), lo, hi)
    if _check_int("size_multiple", size_multiple, 1) > 1:
        # the continuous solution already sums to B within bounds: apportion keeps
        # it and only rounds it to the multiple rule
        return apportion(values, global_batch_size, lo, hi, size_multiple)
    return _round_to_total(values, int(global_batch_size), lo, hi)


def _column_medians(values) -> np.ndarray:
    """Each column's median of its finite values (every column holds one), as
    ``np.nanmedian(values, axis=0)`` gives it, at a fraction of its cost on
    thousands of columns.

    >>> _column_medians(np.array([[3.0, 1.0], [1.0, np.nan], [2.0, 4.0]])).tolist()
    [2.0, 2.5]
    """
    ordered = np.sort(values, axis=0)   # NaN last
    count = np.isfinite(values).sum(axis=0)
    column = np.arange(values.shape[1])
    return (ordered[(count - 1) // 2, column] + ordered[count // 2, column]) / 2.0


# ------------------------------------------------------------ the controller


class Controller:
    """Stateful wrapper the callback drives: history, policy, bounds, dead band.

    Pure numpy and deterministic, so every rank holds an identical copy when fed the
    same gathered measurements.

    Args:
        num_ranks: n.
        global_batch_size: B.
        policy: ``"affine"`` (default) or ``"proportional"``.
        gain, deadband, min_batch_size, max_batch_size: as in :func:`rebalance`.
        history: how many past (sizes, times) rounds the affine fit uses.
        max_step_ratio: no rank's size grows or shrinks by more than this factor in
            one decision (default 4).
        significance: with ``errors`` given to :meth:`decide`, how many standard
            errors apart the slowest and fastest rank must be to act (default 3).
            Those errors then also count the noise from one round to the next
            (:meth:`pooled`), which the spread inside one window does not show.
        change_tolerance: a rank whose new time differs from the model's prediction
            by more than this fraction (of the smaller of the two), and by more than
            ``CHANGE_NOISE_FACTOR`` times the measured noise of one round
            (:meth:`pooled`), has changed speed (noisy neighbour, throttling, new
            hardware): its older measurements are dropped from the fit. Under
            bursty CPU (CFS quotas) single rounds stray far, and taking each for a
            change would restart the rank's pool and act on one round. A window
            that spans such a change reports only its part after the change
            (:func:`omnihvd.timing.speed_change_start`, same default fraction).
        size_multiple: every size is a multiple of this k (rank 0 also taking
            ``B mod k``; see :func:`unit_bounds`), so few distinct shapes occur.

    Given each window's per-step local times (``arrivals`` of :meth:`decide`), the
    split is then moved for the slowest arrival of each step rather than the mean
    (:mod:`omnihvd.arrivals`): ranks whose time varies from step to step get a little
    less, steady ones a little more.

    >>> ctl = Controller(2, 60, policy="affine")
    >>> ctl.decide([30, 30], [4.0, 2.5])     # one size seen: proportional guess
    [23, 37]
    >>> ctl.decide([23, 37], [3.3, 2.85])    # two sizes: solves a + c*b exactly
    [20, 40]
    """

    def __init__(self, num_ranks, global_batch_size, *, policy="affine", gain=1.0, deadband=0.0,
                 min_batch_size=1, max_batch_size=None, history=8, change_tolerance=0.25,
                 max_step_ratio=4, significance=3.0, size_multiple=1):
        self.num_ranks = _check_int("num_ranks", num_ranks, 1)
        self.global_batch_size = _check_int("global_batch_size", global_batch_size, 1)
        if policy not in POLICIES:
            raise ConfigError("policy must be one of %s, got %r" % (", ".join(POLICIES), policy))
        self.policy = policy
        self.gain = _check_gain(gain)
        self.deadband = _check_float("deadband", deadband, 0.0)
        self.history = _check_int("history", history, 2)
        self.change_tolerance = _check_float("change_tolerance", change_tolerance, 0.0, strict=True)
        self.max_step_ratio = _check_int("max_step_ratio", max_step_ratio, 2)
        self.significance = _check_float("significance", significance, 0.0)
        self.size_multiple = _check_int("size_multiple", size_multiple, 1)
        self.set_bounds(min_batch_size, max_batch_size)
        self.forget()

    def set_bounds(self, min_batch_size=1, max_batch_size=None):
        """Change per-rank bounds (e.g. a lowered memory cap); checks feasibility."""
        lo, hi = resolve_bounds(self.num_ranks, self.global_batch_size, min_batch_size,
                                max_batch_size)
        unit_bounds(lo, hi, self.global_batch_size, self.size_multiple)  # raises if infeasible
        self.lo, self.hi = lo, hi

    def resized(self, num_ranks, min_batch_size=1, max_batch_size=None) -> "Controller":
        """A controller with the same options for another world (membership changed),
        with new bounds and no measured history.

        >>> Controller(3, 60, policy="proportional").resized(2, 1, [40, 20]).split([1, 1])
        [40, 20]
        """
        return Controller(num_ranks, self.global_batch_size, policy=self.policy, gain=self.gain,
                          deadband=self.deadband, min_batch_size=min_batch_size,
                          max_batch_size=max_batch_size, history=self.history,
                          change_tolerance=self.change_tolerance,
                          max_step_ratio=self.max_step_ratio, significance=self.significance,
                          size_multiple=self.size_multiple)

    def split(self, targets, total=None) -> list:
        """:func:`apportion` of ``targets`` to ``total`` (default B) within this
        controller's bounds and size multiple."""
        return apportion(targets, self.global_batch_size if total is None else total,
                         self.lo, self.hi, self.size_multiple)

    def valid(self, sizes) -> bool:
        """Whether ``sizes`` is a split of B this controller could have chosen."""
        return is_valid_split(sizes, self.global_batch_size, self.lo, self.hi,
                              self.size_multiple)

    def forget(self):
        """Drop the measured history (after a change of hardware or membership)."""
        self._sizes, self._times, self._valid, self._ratios = [], [], [], []
        self._pool_sizes, self._pool_sum, self._pool_count = None, None, None
        self._arrivals = ArrivalPool()
        self._lags = LagPool(self.num_ranks)
        self._lead = ArrivalLead()
        self._alike = AlikeGroups()

    def observe(self, batch_sizes, times, arrivals=None, lags=None, offsets=None, kinds=None):
        """Record one round of measurements without deciding (``arrivals``, ``lags``,
        ``offsets`` and ``kinds``: see :meth:`decide`)."""
        b = _as_int_vector("batch_sizes", batch_sizes, self.num_ranks)
        if np.any(b < 1):
            raise ConfigError("batch_sizes must be >= 1, got %r" % (b.tolist(),))
        t = _as_time_vector("times", times, self.num_ranks)
        changed = np.zeros(self.num_ranks, dtype=bool)
        ratio = np.full(self.num_ranks, np.nan)   # t / predicted, where the prediction is sound
        if self._sizes:
            # Only a model fitted from two or more valid rounds predicts well enough
            # to tell a change of speed from the fixed cost a one-point model ignores;
            # at an unchanged size any model predicts the rank's last time.
            fitted = np.stack(self._valid).sum(axis=0) >= 2
            predicted = predict_step_times(self.model(), b)
            # Relative to the smaller of the two, so that a speed-up counts as much as
            # the slow-down that undoes it (0.16 s -> 0.12 s is 1.33x, like 0.12 -> 0.16).
            noise = self._round_noise()
            tolerance = np.maximum(self.change_tolerance,
                                   np.where(np.isfinite(noise), CHANGE_NOISE_FACTOR * noise, 0.0))
            changed = fitted & (np.abs(t - predicted) > tolerance * np.minimum(t, predicted))
            for row in self._valid:
                row[changed] = False
            sound = (fitted | (b == self._sizes[-1])) & ~changed
            ratio = np.where(sound, t / predicted, np.nan)
        self._sizes = (self._sizes + [b])[-self.history:]
        self._times = (self._times + [t])[-self.history:]
        self._valid = (self._valid + [np.ones(self.num_ranks, dtype=bool)])[-self.history:]
        self._ratios = (self._ratios + [ratio])[-self.history:]
        self._add_to_pool(b, t, changed)
        if changed.any():   # a rank's old noise, and the lead found with it, no longer apply
            self._arrivals.forget()
            self._lead.forget()
        if lags is not None:
            lag = np.asarray(lags, dtype=np.float64)
            if lag.ndim != 2 or lag.shape[1] != self.num_ranks:
                raise ConfigError("lags must be a (steps, %d) table of seconds, got shape %s"
                                  % (self.num_ranks, lag.shape))
            self._lags.add(lag)
        if arrivals is not None:
            arr = np.asarray(arrivals, dtype=np.float64)
            if arr.ndim != 2 or arr.shape[1] != self.num_ranks:
                raise ConfigError("arrivals must be a (steps, %d) table of local times, got "
                                  "shape %s" % (self.num_ranks, arr.shape))
            self._arrivals.add(arr)
        # a window that saw a rank change speed spans the change: no lead from it
        self._lead.observe(None if changed.any() else offsets, b, t)
        if kinds is not None and np.shape(kinds) != (self.num_ranks,):
            raise ConfigError("kinds must be one number per rank (%d), got %r"
                              % (self.num_ranks, kinds))
        self._alike.update(kinds)

    def _add_to_pool(self, b, t, changed):
        """Add a round to the pool of rounds at the current sizes (see :meth:`pooled`)."""
        if self._pool_sizes is None or not np.array_equal(b, self._pool_sizes):
            self._pool_sizes, self._pool_sum, self._pool_count = b, t.copy(), np.ones_like(t)
            return
        # Once it holds ``history`` rounds, the pool forgets geometrically (weight
        # 1 - 1/history per round), so a slow drift is followed, not averaged away.
        count, full = self._pool_count, float(self.history)
        keep = np.where(count >= full, (full - 1.0) / count, 1.0)
        self._pool_sum = np.where(changed, t, self._pool_sum * keep + t)
        self._pool_count = np.where(changed, 1.0, np.minimum(count + 1.0, full))

    def model(self, pooled: bool = False) -> Optional[TimeModel]:
        """The affine time model fitted from the history, or None before any data.

        With ``pooled``, each rank's line runs through its :meth:`pooled` time at the
        current sizes instead of its latest round alone.
        """
        if not self._sizes:
            return None
        times = np.stack(self._times)
        if pooled:   # the pool always holds the latest round's sizes
            times[-1] = self._pool_sum / self._pool_count
        return fit_time_model(np.stack(self._sizes), times, mask=np.stack(self._valid))

    def pooled(self):
        """Each rank's time at the current sizes, over the rounds measured at them.

        A window's own spread understates how far one window's time may fall from the
        next at the same sizes: on shared cores and under CPU quotas a rank's speed
        drifts over seconds, so the samples of one window move together. So while the
        sizes stay, the rounds measured at them are pooled (their mean; once there are
        ``history`` of them, an exponentially weighted mean of that weight, so that a
        slow drift is followed). A rank's pool starts again with a new split or a
        change of speed (``change_tolerance``).

        The noise of one round is read off how far each round of the history fell
        from what the time model predicted for it (at an unchanged size: the rank's
        previous time), so it is known while the split still moves. It is taken
        relative to the round's mean over all ranks: when the whole machine slows
        down for a while, every rank slows alike and the split stays right, so only
        what moves one rank against the others counts.

        Returns:
            ``(times, rounds, noise)``, one entry per rank: the pool's mean time, how
            many rounds it holds (at most ``history``), and the relative noise of one
            round's time (from every rank's rounds, or the rank's own once it has
            three and they show more; NaN until there are three).

        >>> ctl = Controller(2, 60)
        >>> for t in ([1.0, 2.0], [1.1, 2.0], [0.9, 2.0], [1.0, 2.0]):
        ...     ctl.observe([30, 30], t)
        >>> times, rounds, noise = ctl.pooled()
        >>> times.round(3).tolist(), rounds.tolist(), noise.round(3).tolist()
        ([1.0, 2.0], [4.0, 4.0], [0.078, 0.078])
        """
        if self._pool_sizes is None:
            empty = np.full(self.num_ranks, np.nan)
            return empty, np.zeros(self.num_ranks), empty.copy()
        return self._pool_sum / self._pool_count, self._pool_count.copy(), self._round_noise()

    def lag_charges(self) -> np.ndarray:
        """Seconds each rank is charged per step beyond its local time: its mean
        release lag (:meth:`omnihvd.lags.LagPool.charges`; zeros until a rank has
        :data:`~omnihvd.lags.MIN_LAGS` lags, and without ``lags`` in :meth:`decide`).

        >>> ctl = Controller(2, 60)
        >>> _ = ctl.decide([30, 30], [1.0, 1.0], lags=[[0.0, 0.004]] * 8)
        >>> ctl.lag_charges().round(3).tolist()
        [0.0, 0.004]
        """
        return self._lags.charges()

    def arrival_lead(self) -> float:
        """Seconds by which the rank with the most samples is let arrive after the
        others, on average (:class:`omnihvd.lead.ArrivalLead`; 0 without
        ``offsets`` in :meth:`decide`)."""
        return self._lead.lead

    def alike_groups(self) -> List[List[int]]:
        """The groups of alike ranks held at equal sizes (:mod:`omnihvd.alike`; none
        without ``kinds`` in :meth:`decide`).

        >>> ctl = Controller(3, 90)
        >>> ctl.decide([30, 30, 30], [0.3, 0.2, 0.2], kinds=[1.0, 2.0, 2.0])
        [22, 34, 34]
        >>> ctl.alike_groups()
        [[1, 2]]
        """
        return self._alike.groups()

    def _charges(self) -> np.ndarray:
        """Seconds added to each rank's time: its release lag, minus the arrival lead."""
        return self._lags.charges() + self._lead.charges(self.num_ranks)

    def _round_noise(self) -> np.ndarray:
        """Relative noise of one round per rank, from the history (see :meth:`pooled`)."""
        ratios = np.stack(self._ratios)   # each round's time over the model's prediction
        noise = np.full(self.num_ranks, np.nan)
        if self.num_ranks > 1:
            # Relative to the round's mean over ranks (common slow-downs out); a rank's
            # own share in that mean hides 1/m of its variance, m ranks seen.
            m = np.isfinite(ratios).sum(axis=1, keepdims=True)
            ratios = np.where(m >= 2, ratios, np.nan)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)   # rows without a ratio
                centre = np.nanmean(ratios, axis=1, keepdims=True)
            deviation = np.abs(ratios / centre - 1.0) * np.sqrt(m / np.maximum(m - 1.0, 1.0))
        else:
            deviation = np.abs(ratios - 1.0)
        seen = np.isfinite(deviation)
        if seen.sum() >= 3:
            # MAD_TO_SD median|ratio - 1| estimates the standard deviation of the ratio,
            # which holds the noise of this round and of the one the line runs through:
            # sqrt(2) times one round's.
            scale = MAD_TO_SD / math.sqrt(2.0)
            noise[:] = scale * float(np.median(deviation[seen]))
            # A rank's own estimate (from few rounds) may fall far below the truth;
            # every rank's together is the floor, so one lucky run of rounds does not
            # make a rank look quiet enough to act on a single round of it.
            own = seen.sum(axis=0) >= 3
            noise[own] = np.maximum(noise[own], scale * _column_medians(deviation[:, own]))
        return noise

    def decide(self, batch_sizes, times, errors=None, *, tilt: float = 0.0,
               arrivals=None, lags=None, offsets=None, kinds=None) -> list:
        """Record ``times`` measured at ``batch_sizes`` and return the next sizes.

        Args:
            batch_sizes, times: this round's sizes and measured local step times.
            errors: optional standard error of each time (from the window's spread).
                With them the controller judges noise: each rank's time is its
                :meth:`pooled` time over the rounds at the current sizes, its error
                the larger of ``errors`` and the round-to-round noise, over the
                square root of those rounds; when the slowest and the fastest rank
                differ by less than ``significance`` such errors, the sizes are kept:
                the difference is noise, and chasing it would only shuffle samples
                around. Without them every round is taken at face value.
            tilt: balance ``t_i * w_i`` instead of ``t_i`` (:func:`omnihvd.tuning.tilt_weights`;
                0, the default, balances local times; ``tune_split`` searches it).
            arrivals: optional ``(steps, ranks)`` local times of single steps of the
                window, aligned by step (NaN: none). Pooled over the last windows,
                they move the split for each step's slowest arrival
                (:func:`omnihvd.arrivals.last_arrival_split`); balanced means are then
                left alone only when that would gain less than
                :data:`omnihvd.arrivals.MIN_GAIN` of the step.
            lags: optional ``(steps, ranks)`` release lags of single steps, seconds
                (:func:`omnihvd.lags.release_lags`; NaN: none). Pooled over the last
                windows, each rank's mean lag is added to its time
                (:mod:`omnihvd.lags`): the controller balances local time plus
                release lag, i.e. the ranks' arrivals.
            offsets: optional ``(steps, ranks)`` arrival moments of single steps
                relative to each step's last (:func:`omnihvd.lead.arrival_offsets`):
                the rank with the most samples is charged minus its lead
                (:class:`omnihvd.lead.ArrivalLead`), searched until it arrives last
                in its share of the steps.
            kinds: optional :func:`omnihvd.alike.kind_key` of each rank: ranks of one
                kind are held at equal sizes while their times agree
                (:class:`omnihvd.alike.AlikeGroups`).

        No size changes by more than ``max_step_ratio`` (x or /) in one decision: a
        noisy round cannot throw a rank to an extreme.
        """
        self.observe(batch_sizes, times, arrivals, lags, offsets, kinds)
        b, t = self._sizes[-1], self._times[-1]
        self._alike.confirm(b, t, self.significance)
        valid = self.valid(b)
        pooled = errors is not None
        if pooled:
            t, errors = self._pooled_errors(errors)
        t = t + self._charges()   # a rank resumes that much after the first (lead: sooner)
        if pooled:
            w = tilt_weights(b, t, tilt)
            # the gate sees the charges the sizes were measured at (before a move of the lead)
            held = t * w - self._lead.charges(self.num_ranks, self._lead.change) * w
            if valid and not self._significant(held, errors * w):
                if self._lead.moved:
                    # only the lead moved (significant already): the led rank's share
                    # changes, the others keep theirs among themselves
                    new = self._lead_transfer(b, self._solve(b, t, pooled, tilt, self.gain))
                else:
                    # the means are balanced within their noise: only the slowest
                    # arrival may still move the split, from where it is
                    new = self._for_last_arrival(b, b, t, pooled, w,
                                                 self._arrivals.residuals())
                return _deadband(b, self._equalize(new), self.global_batch_size, self.lo,
                                 self.hi, self.deadband, self.size_multiple)
        new = self._equalize(self._solve(b, t, pooled, tilt, self.gain))
        return _deadband(b, new, self.global_batch_size, self.lo, self.hi, self.deadband,
                         self.size_multiple)

    def split_at(self, tilt: float) -> list:
        """The split the last decision would have chosen at ``tilt``, in full (no dead
        band, no noise gate, no partial ``gain`` step): the probes of
        :class:`omnihvd.tuning.TiltSearch`. Needs one observed round.

        >>> ctl = Controller(2, 60, policy="proportional")
        >>> ctl.decide([30, 30], [1.0, 0.5])
        [20, 40]
        >>> ctl.split_at(0.0), ctl.split_at(0.25), ctl.split_at(-0.25)
        ([20, 40], [14, 46], [27, 33])
        """
        if not self._sizes:
            raise RuntimeError("split_at needs an observed round")
        # the pool always holds the latest round's sizes (observe starts it afresh)
        return self._equalize(self._solve(self._sizes[-1], self.pooled()[0] + self._charges(),
                                          True, tilt, 1.0))

    def _equalize(self, sizes) -> list:
        """``sizes`` with alike ranks at equal shares (:meth:`alike_groups`)."""
        if not self._alike.groups():
            return int_list(sizes)
        return self.split(self._alike.equal_shares(sizes))

    def _lead_transfer(self, b, new) -> list:
        """``b`` with the led rank's size as in ``new``, the difference taken from (or
        given to) the other ranks in proportion to their sizes."""
        led = self._lead.rank
        b = np.asarray(b, dtype=np.float64)
        others = np.arange(self.num_ranks) != led
        delta = float(new[led]) - b[led]
        targets = b.copy()
        targets[led] += delta
        targets[others] -= delta * b[others] / b[others].sum()
        return self.split(np.maximum(targets, 0.0))

    def _trust_region(self, b):
        """Bounds no farther than ``max_step_ratio`` from ``b`` (when ``b`` is valid)."""
        if not self.valid(b):
            return self.lo, self.hi
        return (np.maximum(self.lo, -(-b // self.max_step_ratio)),
                np.minimum(self.hi, b * self.max_step_ratio))

    def _weighted_model(self, b, t, pooled: bool, w) -> TimeModel:
        """The policy's time model with each rank's release lag (:mod:`omnihvd.lags`),
        times ``w`` (the proportional policy: a_i = 0, ``t`` holding the lags)."""
        if self.policy == "proportional":
            # relative to the slowest, as rebalance() takes them (scale-free)
            t = np.maximum(t / t.max(), 1e-12)
            return TimeModel(np.zeros(self.num_ranks), t * w / b)
        model = self.model(pooled)
        return TimeModel((model.intercept + self._charges()) * w, model.slope * w)

    def _for_last_arrival(self, start, b, t, pooled: bool, w, residuals) -> list:
        """``start`` moved for the slowest arrival of the pooled steps ``residuals``
        (:func:`omnihvd.arrivals.last_arrival_split`; unchanged when None), within the
        trust region around the measured sizes ``b``."""
        if residuals is None:
            return int_list(start)
        lo, hi = self._trust_region(b)
        return last_arrival_split(start, self._weighted_model(b, t, pooled, w), residuals,
                                  lo=lo, hi=hi, size_multiple=self.size_multiple)

    def _solve(self, b, t, pooled: bool, tilt: float, gain: float) -> list:
        """The policy's split from sizes ``b`` and times ``t`` (the latest or pooled) at
        ``tilt`` (equal ``t_i * w_i``, :func:`omnihvd.tuning.tilt_weights`), moved for
        the slowest arrival when steps were pooled, a ``gain`` step of the way from
        ``b``."""
        lo, hi = self._trust_region(b)  # feasible because b itself lies inside it
        w = tilt_weights(b, t, tilt)
        B, k = self.global_batch_size, self.size_multiple
        residuals = self._arrivals.residuals()
        if self.policy == "proportional":
            if residuals is None:   # the paper's controller, as it was
                return rebalance(b, t * w, B, min_batch_size=lo, max_batch_size=hi,
                                 gain=gain, deadband=0.0, size_multiple=k)
            new = rebalance(b, t * w, B, min_batch_size=lo, max_batch_size=hi, gain=1.0,
                            deadband=0.0, size_multiple=k)
        else:
            new = solve_time_model(self._weighted_model(b, t, pooled, w), B,
                                   min_batch_size=lo, max_batch_size=hi, size_multiple=k)
        new = self._for_last_arrival(new, b, t, pooled, w, residuals)
        if gain != 1.0:  # partial step towards the solved split
            new = apportion(np.maximum(b + gain * (np.asarray(new) - b), 0.0), B, lo, hi, k)
        return new

    def _pooled_errors(self, errors):
        """The pooled times and their standard errors: this window's error or the
        round-to-round noise, whichever is larger, over the square root of the rounds."""
        e = np.asarray(errors, dtype=np.float64)
        if e.shape != (self.num_ranks,) or not np.all(np.isfinite(e) & (e >= 0)):
            raise ConfigError("errors must be one finite value >= 0 per rank, got %r" % (errors,))
        t, rounds, noise = self.pooled()
        between = np.where(np.isfinite(noise), noise * t, 0.0)
        return t, np.maximum(e, between) / np.sqrt(rounds)

    def _significant(self, t, e) -> bool:
        slow, fast = int(np.argmax(t)), int(np.argmin(t))
        return t[slow] - t[fast] > self.significance * math.sqrt(e[slow] ** 2 + e[fast] ** 2)

    def state_dict(self):
        """The measured history, the pool of rounds at the current sizes and the alike
        groups (:meth:`alike_groups`, with who was let go). Not kept: the per-step
        pools (arrivals, release lags) and the arrival lead, searched afresh after a
        restore (it rests on one machine's clock and on every window's arrivals: a
        kept lead would outlive ``arrival_lead=False`` or a move to several machines,
        where no window brings arrivals to correct it)."""
        state = {"policy": self.policy, "sizes": [s.tolist() for s in self._sizes],
                 "times": [t.tolist() for t in self._times],
                 "valid": [v.tolist() for v in self._valid],
                 "ratios": [[None if math.isnan(v) else v for v in r.tolist()]
                            for r in self._ratios],
                 "alike": self._alike.state_dict()}
        if self._pool_sizes is not None:
            state["pool"] = {"sizes": self._pool_sizes.tolist(), "sum": self._pool_sum.tolist(),
                             "count": self._pool_count.tolist()}
        return state

    def load_state_dict(self, state):
        """Restore the measured history saved by :meth:`state_dict`.

        Raises:
            ConfigError: malformed state (not a dict, ragged or non-numeric history, or
                a history of another number of ranks: call :meth:`forget` instead).
        """
        if not isinstance(state, dict):
            raise ConfigError("Controller state must be a dict, got %s" % type(state).__name__)
        try:
            sizes = np.asarray(state.get("sizes", []), dtype=np.int64)
            times = np.asarray(state.get("times", []), dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ConfigError("Controller state has a malformed history (%s)" % exc) from exc
        if sizes.size == 0:
            self.forget()
            return
        if sizes.ndim != 2 or sizes.shape != times.shape:
            raise ConfigError("Controller state history must be two (rounds, ranks) tables of "
                              "equal shape, got %s and %s" % (sizes.shape, times.shape))
        if sizes.shape[1] != self.num_ranks:
            raise ConfigError("Controller state has a history of %d ranks, this controller has "
                              "%d" % (sizes.shape[1], self.num_ranks))
        if np.any(sizes < 1) or not np.all(np.isfinite(times)) or np.any(times <= 0):
            raise ConfigError("Controller state history must hold sizes >= 1 and finite positive "
                              "times (a hand-edited or corrupted checkpoint?)")
        # The alike groups (absent in older checkpoints: compared afresh).
        alike = AlikeGroups()
        try:
            if state.get("alike"):
                alike.load_state_dict(state["alike"], self.num_ranks)
        except ValueError as exc:
            raise ConfigError("Controller state: %s" % exc) from exc
        sizes = list(sizes)
        self._sizes = sizes[-self.history:]
        self._times = list(times)[-self.history:]
        valid = state.get("valid") or [[True] * self.num_ranks for _ in self._sizes]
        self._valid = [np.asarray(v, dtype=bool) for v in valid][-self.history:]
        try:   # absent in older checkpoints: no round has a ratio yet
            ratios = [np.asarray([np.nan if v is None else v for v in r], dtype=np.float64)
                      for r in state.get("ratios") or []][-self.history:]
        except (TypeError, ValueError) as exc:
            raise ConfigError("Controller state has malformed ratios (%s)" % exc) from exc
        if len(ratios) != len(self._sizes) or any(r.shape != (self.num_ranks,) for r in ratios):
            ratios = [np.full(self.num_ranks, np.nan) for _ in self._sizes]
        self._ratios = ratios
        # The pool of rounds at the current sizes (absent in older checkpoints: it
        # starts again from the latest round).
        pool = state.get("pool")
        try:
            pool = None if not pool else tuple(
                np.asarray(pool[key], dtype=dtype) for key, dtype in
                (("sizes", np.int64), ("sum", np.float64), ("count", np.float64)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError("Controller state has a malformed pool (%s)" % exc) from exc
        if (pool is None or any(v.shape != (self.num_ranks,) for v in pool) or np.any(pool[2] < 1)
                or not np.array_equal(pool[0], self._sizes[-1])):   # the pool is of the latest
            pool = (self._sizes[-1], self._times[-1].copy(), np.ones(self.num_ranks))
        self._pool_sizes, self._pool_sum, self._pool_count = pool
        self._lead, self._alike = ArrivalLead(), alike
