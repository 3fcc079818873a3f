"""Which parts of a step are this rank's own work: the passes of its model.

A step's local time runs from the loader's batch to the wait boundary (the entry
of ``opt.step()``, or DDP's last gradient bucket). Between the model's forward
pass and its backward pass, and after the backward pass, a loop may run
collectives of its own -- a metric's ``hvd.allreduce`` or ``dist.all_reduce`` --
which wait for the slowest rank. That wait is no work of this rank, so the timer
pauses when a pass of the model ends and resumes when the next one begins
(:meth:`omnihvd.timing.StepTimer.pause`). What comes before the first pass of a
step (moving the batch to the device, ``zero_grad``) counts; so does a pass the
model runs outside a backward (an evaluation inside the step).

The boundaries come from public hooks: the model's forward pre-hook and forward
hook; a gradient hook on the model's output tensors and, through
:class:`omnihvd.weighting.GradientWeight`, on the weighted parameters and DDP's
buckets (a gradient arriving: a backward pass is under way); the end of a
backward pass from the autograd engine (:func:`omnihvd.internals.after_backward`).
A model whose forward is not called as ``model(x)`` (a loop calling
``model.features(x)``) shows only its backward passes: the time before its first
backward pass then counts, as it did before this module.
"""
from typing import List

from .internals import after_backward

__all__ = ["ComputeSegments"]

_MOST_OUTPUTS = 8   # output tensors hooked per forward pass (the loss uses one of them)


def _grad_tensors(output, found: List) -> List:
    """Up to ``_MOST_OUTPUTS`` tensors in ``output`` (nested tuples, lists, dicts)
    that will receive a gradient."""
    if len(found) >= _MOST_OUTPUTS:
        return found
    if getattr(output, "requires_grad", False) and hasattr(output, "register_hook"):
        found.append(output)
    elif isinstance(output, dict):
        for value in output.values():
            _grad_tensors(value, found)
    elif isinstance(output, (tuple, list)):
        for value in output:
            _grad_tensors(value, found)
    return found


class ComputeSegments:
    """Pauses ``timer`` between the model's passes (module docstring).

    Args:
        timer: the :class:`~omnihvd.timing.StepTimer` of the steps.

    >>> import torch
    >>> from omnihvd.timing import StepTimer
    >>> timer = StepTimer(); segments = ComputeSegments(timer)
    >>> model = torch.nn.Linear(2, 1)
    >>> handles = segments.install(model)
    >>> timer.start(); loss = model(torch.ones(3, 2)).sum(); timer.paused
    True
    >>> loss.backward(); timer.paused     # paused again once the backward pass ended
    True
    >>> for h in handles: h.remove()
    """

    def __init__(self, timer):
        self._timer = timer
        self._queued = False   # an end-of-backward callback waits in the running pass

    def install(self, model) -> list:
        """Hook ``model``'s forward passes; returns handles with ``remove()``."""
        return [model.register_forward_pre_hook(self._forward_begins),
                model.register_forward_hook(self._forward_ends)]

    def new_step(self):
        """Forget a callback that a failed backward pass never ran."""
        self._queued = False

    def backward_begins(self, *unused):
        """A gradient arrived: a backward pass is running (called from its hooks)."""
        self._timer.resume()
        if not self._queued:
            self._queued = True
            after_backward(self._backward_ends)

    def _backward_ends(self):
        self._queued = False
        self._timer.pause()

    def _forward_begins(self, module, args):
        self._timer.resume()

    def _forward_ends(self, module, args, output):
        for tensor in _grad_tensors(output, []):
            tensor.register_hook(self._output_gradient)
        self._timer.pause()

    def _output_gradient(self, grad):
        self.backward_begins()
        return None   # the gradient unchanged
