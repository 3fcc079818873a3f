"""The ideal step time and the balance of a split: the one definition of the figures
the benchmarks, the simulator and the run logs report.

Rank i's local compute time for a batch of b samples is modelled as
``t_i(b) = a_i + b / x_i`` (a fixed cost a_i, a throughput x_i samples/s). The ideal
step time T is the common time of the continuous split that equalises the ranks,
``b_i = (T - a_i) x_i`` summing to B, so ``T = (B + sum_i a_i x_i) / sum_i x_i``;
without fixed costs it is ``B / sum_i x_i``. The balance of a split is T over its
slowest rank's time: 1.0 when perfectly balanced. Efficiency is the ideal step time
over a measured one.

Pure numpy; every function broadcasts over leading axes (ranks on the last one).

>>> ideal_step_time(64, [100.0, 100.0, 200.0, 400.0])
0.08
>>> float(balance([16, 16, 16, 16], [100.0, 100.0, 200.0, 400.0]))
0.5
"""
import math

import numpy as np

__all__ = ["ideal_step_time", "split_time", "balance", "measured_ideal_step_time"]


def ideal_step_time(global_batch_size, throughputs, fixed_costs=0.0):
    """``(B + sum_i a_i x_i) / sum_i x_i``: the equal-time continuous split's step time.

    Args:
        global_batch_size: B (a number, or an array broadcasting against the
            leading axes).
        throughputs: x_i, samples per second, ranks on the last axis.
        fixed_costs: a_i, seconds per step independent of the batch (default 0).

    Returns:
        Seconds: a float for 1-d throughputs, else an array over the leading axes.
    """
    x = np.asarray(throughputs, dtype=np.float64)
    a = np.broadcast_to(np.asarray(fixed_costs, dtype=np.float64), x.shape)
    # sum_i a_i x_i per split: a BLAS dot product (numpy >= 2), as the simulator always
    # computed it, so its seeded results stay bit-identical.
    fixed = np.vecdot(a, x) if hasattr(np, "vecdot") else np.sum(a * x, axis=-1)
    value = (global_batch_size + fixed) / np.sum(x, axis=-1)
    return float(value) if np.ndim(value) == 0 else value


def split_time(sizes, throughputs, fixed_costs=0.0):
    """The step time of a split: its slowest rank's ``a_i + b_i / x_i``."""
    x = np.asarray(throughputs, dtype=np.float64)
    return np.max(np.asarray(fixed_costs, dtype=np.float64) + np.asarray(sizes) / x, axis=-1)


def balance(sizes, throughputs, fixed_costs=0.0, global_batch_size=None):
    """Ideal step time over the split's step time: 1.0 when perfectly balanced.

    Args:
        sizes: b_i, ranks on the last axis.
        throughputs, fixed_costs: as for :func:`ideal_step_time`.
        global_batch_size: B; default ``sum_i b_i``.
    """
    if global_batch_size is None:
        global_batch_size = np.sum(sizes, axis=-1)
    return (ideal_step_time(global_batch_size, throughputs, fixed_costs)
            / split_time(sizes, throughputs, fixed_costs))


def measured_ideal_step_time(sizes, times):
    """The ideal step time at measured throughputs ``x_i = b_i / t_i``: ``B / sum_i x_i``.

    Ranks whose time is missing, non-finite or not positive are left out of the
    throughput (their samples still count in B).

    Args:
        sizes: per-rank batch sizes b_i.
        times: per-rank local compute seconds t_i, one per size.

    Returns:
        Seconds; NaN when no rank has a positive, finite time.

    Raises:
        ConfigError: ``sizes`` and ``times`` differ in length.

    >>> round(measured_ideal_step_time([64, 64, 64, 64], [0.1, 0.1, 0.2, 0.05]), 4)
    0.0889
    """
    from ..errors import ConfigError

    sizes, times = list(sizes), list(times)
    if len(sizes) != len(times):
        raise ConfigError("sizes and times must have one entry per rank, got %d sizes and %d "
                          "times" % (len(sizes), len(times)))
    rates = [b / t for b, t in zip(sizes, times)
             if t is not None and math.isfinite(t) and t > 0]
    if not rates:
        return float("nan")
    return ideal_step_time(sum(sizes), rates)
