"""Loss normalisers that are not the number of samples: the global count.

Class-weighted cross-entropy divides by the sum of the targets' weights,
``ignore_index`` by the targets not ignored, a per-token mean by the tokens. The
gradient of such a loss over the global batch is ``sum_i grad(S_i) / W`` (``S_i``:
rank i's summed loss, ``W``: the count summed over ranks), so each rank computes
``S_i / W`` and the callback, with ``loss_reduction="sum"``, adds the ranks'
gradients unweighted. See docs/losses.rst. Pure Python: the gather itself is the
callback's (:meth:`omnihvd.OmniLearnCallback.global_count`).
"""
import math

import numpy as np

from .errors import ConfigError

__all__ = ["checked_count", "total_count"]


def checked_count(count, rank: int) -> float:
    """``count`` (int, float or a one-element tensor) as a float >= 0.

    Raises:
        ConfigError: not a finite number >= 0; the message names the rank.

    >>> checked_count(3, 0)
    3.0
    """
    try:
        value = float(count)
    except (TypeError, ValueError, RuntimeError):  # a tensor of several elements too
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError("global_count: rank %d passed count %r; it must be a finite number >= 0"
                          % (rank, count))
    return value


def total_count(gathered, step: int) -> float:
    """The sum of the gathered counts (column 0), the same bits on every rank.

    numpy's float64 sum runs in a fixed order, so every rank, summing the same
    gathered array, divides its loss by the same number.

    Raises:
        ConfigError: the sum is 0 (every rank's count is 0), on every rank alike.

    >>> total_count(np.array([[2.0], [0.0], [3.5]]), 7)
    5.5
    """
    total = float(np.sum(np.asarray(gathered, dtype=np.float64)[:, 0]))
    if total <= 0:
        raise ConfigError("global_count: the count is 0 on every rank at step %d (e.g. every "
                          "target is ignore_index); there is nothing to normalise by" % step)
    return total
