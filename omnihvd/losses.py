"""Loss normalisers that are not the number of samples: the global count.

Class-weighted cross-entropy divides by the sum of the targets' weights,
``ignore_index`` by the targets not ignored, a per-token mean by the tokens. The
gradient of such a loss over the global batch is ``sum_i grad(S_i) / W`` (``S_i``:
rank i's summed loss, ``W``: the count summed over ranks), so each rank computes
``S_i / W`` and the callback, with ``loss_reduction="sum"``, adds the ranks'
gradients unweighted. See docs/losses.rst. Pure Python: the gather itself is the
callback's (:meth:`omnihvd.OmniLearnCallback.global_count`).

Every weight also assumes that a rank's batch holds the size the sampler gave it:
:func:`check_batch_length` says so when it does not.
"""
import math
from typing import Optional

import numpy as np

from .errors import ConfigError

__all__ = ["batch_length", "check_batch_length", "checked_count", "total_count"]


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


def batch_length(batch) -> Optional[int]:
    """Samples in a batch as a DataLoader yields it: the first dimension of its first
    tensor (the batch itself, or the first item of a tuple, list or dict); None when
    there is no tensor in it.

    >>> batch_length((np.zeros((5, 3)), np.zeros(5))), batch_length({"x": np.zeros(2)})
    (5, 2)
    >>> batch_length(3) is None
    True
    """
    while isinstance(batch, (list, tuple, dict)) and len(batch):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    shape = getattr(batch, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else None


def check_batch_length(batch, batch_size: int, rank: int, step: int):
    """Check that ``batch`` (as :func:`batch_length` reads it) holds ``batch_size``.

    The gradient weights assume the sampler's sizes; a batch of another size (a
    DataLoader built with ``batch_size=`` instead of ``batch_sampler=``, a collate
    function that drops samples) would make the gradient silently wrong.

    Raises:
        ConfigError: another number of samples; the message names the rank, the
            step, both sizes and the fix.
    """
    got = batch_length(batch)
    if got is not None and got != batch_size:
        raise ConfigError(
            "rank %d got a batch of %d samples at step %d, but its batch size for that step is %d "
            "(cb.batch_size): build the loader as DataLoader(dataset, batch_sampler="
            "omnihvd.HeterogeneousBatchSampler(len(dataset), cb)), without batch_size=, keep "
            "every sample the sampler hands out, and call cb.on_batch_begin() and "
            "cb.on_batch_end() around every batch the loader yields (none skipped, every "
            "micro-batch); if the batch's first dimension is not its sample count (time-major "
            "sequences), wrap the loader with cb.wrap(loader, check=False)"
            % (rank, got, step, batch_size))
