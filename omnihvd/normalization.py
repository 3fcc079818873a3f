"""Batch normalisation under unequal per-rank batches: what omnihvd accepts and why.

* ``hvd.SyncBatchNorm`` (and ``torch.nn.SyncBatchNorm``) is refused. Its forward
  and backward run collectives inside the step, so every rank waits for the slowest
  one *inside* the timed window (all ranks measure the same time: nothing can be
  balanced), and its backward sums the batch-statistics gradients across ranks, so
  the cross-rank part of each gradient would be scaled by the wrong rank's weight.
* Plain ``torch.nn.BatchNorm1d/2d/3d`` normalise each rank's batch with its own
  statistics. The weighted gradient is then exactly the gradient a single process
  computes on the global batch cut into "ghost batches" of the per-rank sizes (see
  docs/batchnorm.rst). A batch of one sample has no batch statistics (BatchNorm1d
  raises on it in training), so a model with BatchNorm layers gets a
  ``min_batch_size`` of at least :data:`BATCHNORM_MIN_BATCH`.
"""
from typing import List

from .errors import ConfigError

__all__ = ["BATCHNORM_MIN_BATCH", "batchnorm_layers", "check_no_sync_batchnorm",
           "raise_min_batch_size"]

BATCHNORM_MIN_BATCH = 2


def _sync_types():
    import torch

    types = [torch.nn.SyncBatchNorm]
    try:
        import horovod.torch as hvd

        types.append(hvd.SyncBatchNorm)
    except (ImportError, AttributeError):  # a Horovod without it cannot be used anyway
        pass
    return tuple(types)


def batchnorm_layers(model) -> List[str]:
    """Names of the model's batch-normalisation layers (any ``_BatchNorm``).

    >>> import torch
    >>> batchnorm_layers(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)))
    ['1']
    """
    from torch.nn.modules.batchnorm import _BatchNorm

    return [name for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def check_no_sync_batchnorm(model):
    """Refuse synchronised batch normalisation (module docstring).

    Raises:
        ConfigError: the model has a ``hvd.SyncBatchNorm`` or ``torch.nn.SyncBatchNorm``
            layer; the message names the layers and the fix.
    """
    sync = _sync_types()
    names = ["%s: %s" % (name or "the model itself", type(m).__name__)
             for name, m in model.named_modules() if isinstance(m, sync)]
    if names:
        raise ConfigError(
            "the model has synchronised batch normalisation (%s): its collectives make every "
            "rank wait inside the timed step, so omnihvd cannot balance, and its gradients are "
            "no longer exact under batch-size weights. Use torch.nn.BatchNorm1d/2d/3d (per-rank "
            "statistics, exact as ghost batch norm; see docs/batchnorm.rst), or GroupNorm / "
            "LayerNorm, which normalise each sample on its own" % ", ".join(names))


def raise_min_batch_size(min_batch_size, floor: int = BATCHNORM_MIN_BATCH):
    """``min_batch_size`` with every entry below ``floor`` raised to it.

    Malformed values are returned unchanged, for the controller's validation to
    report.

    Returns:
        ``(value, raised)``: the new int or list, and whether anything changed.

    >>> raise_min_batch_size(1), raise_min_batch_size([1, 4]), raise_min_batch_size(3)
    ((2, True), ([2, 4], True), (3, False))
    """
    def whole(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if whole(min_batch_size):
        return max(min_batch_size, floor), min_batch_size < floor
    if isinstance(min_batch_size, (list, tuple)) and all(whole(v) for v in min_batch_size):
        return [max(v, floor) for v in min_batch_size], any(v < floor for v in min_batch_size)
    return min_batch_size, False
