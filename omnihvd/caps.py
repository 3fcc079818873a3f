"""Memory caps learned from out-of-memory errors.

A rank that runs out of memory at batch size ``b`` lowers its own cap to
``shrink * b`` (:func:`lowered_cap`) at once; the other ranks learn it from the next
gather (the cap travels in the payload), and then every rank lowers its copy of the
controller's upper bounds the same way (:func:`tighten_caps`) and re-splits within
them. A checkpoint's caps are applied the same way on resume. Pure Python and numpy.

>>> lowered_cap(size=40, floor=1, cap=64, shrink=0.8, rank=0)
32
>>> from omnihvd.controller import Controller
>>> c = Controller(2, 60)
>>> tighten_caps(c, [60, 40]), c.hi.tolist()
(True, [60, 40])
>>> tighten_caps(c, [60, 50]), c.hi.tolist()     # a cap is never raised again
(False, [60, 40])
"""
import numpy as np

from .errors import ConfigError, InfeasibleError

__all__ = ["lowered_cap", "tighten_caps"]


def lowered_cap(size: int, floor: int, cap: int, shrink: float, rank: int) -> int:
    """The cap of a rank that ran out of memory at batch size ``size``.

    Args:
        size: the rank's batch size in the step that failed.
        floor: its ``min_batch_size``.
        cap: its cap so far.
        shrink: the factor in (0, 1) the failed size is multiplied by.
        rank: the rank, for the messages.

    Returns:
        int: ``min(cap, max(floor, int(size * shrink)))``; the same ``cap`` when a
        lower one is already waiting for the next gather.

    Raises:
        ConfigError: ``shrink`` is not a number in (0, 1).
        InfeasibleError: ``size`` is already at ``floor``: nothing left to shed.
    """
    if isinstance(shrink, bool) or not isinstance(shrink, (int, float)) or not 0 < shrink < 1:
        raise ConfigError("shrink must be a number in (0, 1), got %r" % (shrink,))
    if size <= floor:
        raise InfeasibleError("rank %d ran out of memory at batch size %d, already its "
                              "min_batch_size; lower min_batch_size or the model's memory "
                              "use" % (rank, size))
    return min(cap, max(floor, int(size * shrink)))


def tighten_caps(controller, caps) -> bool:
    """Lower ``controller``'s upper bounds to ``caps`` where they are lower.

    Every rank calls it with the same gathered caps, so every rank's controller keeps
    the same bounds.

    Returns:
        bool: whether any bound was lowered.

    Raises:
        InfeasibleError: the lowered caps can no longer hold the global batch.
    """
    caps = np.asarray(caps, dtype=np.int64)
    if not (caps < controller.hi).any():
        return False
    controller.set_bounds(controller.lo, controller.hi.clip(max=caps))
    return True
