"""Every private attribute of Horovod or PyTorch that omnihvd reads, in one place.

Each is used only where no public API tells the same thing, and each has a test
(tests/test_internals.py) that fails loudly when the framework changes it. Where
one is missing, the function says so (None) and the caller falls back.

==============================  =================================  ====================================
private attribute               what omnihvd learns from it        without it
==============================  =================================  ====================================
torch autograd engine's         when a backward pass ends          the time after the last backward
``queue_callback``                                                 pass counts as work
Horovod ``_synchronized``       ``opt.synchronize()`` ran before   such a step's time is dropped
                                ``step()``                         (warned once)
Horovod ``_requires_update``    which parameters Horovod reduces   a parameter frozen when the
                                                                   optimizer was made goes unchecked
Horovod ``_DistributedAdasum``  Adasum (it keeps no ``op``)        Adasum is refused as "not Horovod"
DDP ``_comm_hooks``,            a communication hook already       torch's own error when a second
``_get_ddp_logging_data``       registered                         hook is registered
DDP ``_has_rebuilt_buckets``    the step in which DDP rebuilds     that step (a broadcast: a wait)
                                its buckets                        is timed
tensor ``_version``             ``opt.step()`` updated a DDP       a checkpoint inside the step is
                                model (checkpoint check)           not refused
==============================  =================================  ====================================
"""
from typing import Callable, Optional

__all__ = ["after_backward", "adasum_optimizer", "clear_synchronized_flag", "comm_hook_name",
           "ddp_buckets_rebuilt", "horovod_reduced", "synchronized_flag", "tensor_version"]


def after_backward(callback: Callable[[], None]) -> bool:
    """Run ``callback`` once the running backward pass has ended; call it from a
    hook inside that pass. Returns False when this torch has no callback queue.

    >>> import torch
    >>> ended, x = [], torch.ones(2, requires_grad=True)
    >>> _ = x.register_hook(lambda g: after_backward(lambda: ended.append(True)) and None)
    >>> (x * 2).sum().backward(); ended
    [True]
    """
    from torch.autograd import Variable

    queue = getattr(getattr(Variable, "_execution_engine", None), "queue_callback", None)
    if queue is None:
        return False
    queue(callback)
    return True


def synchronized_flag(optimizer) -> Optional[bool]:
    """Whether Horovod's optimizer has run ``synchronize()`` in this step (its
    ``_synchronized``, set there and cleared in ``step()``); None when it has no
    such flag.

    >>> class Opt: _synchronized = True
    >>> synchronized_flag(Opt()), synchronized_flag(object())
    (True, None)
    """
    flag = getattr(optimizer, "_synchronized", None)
    return None if flag is None else bool(flag)


def clear_synchronized_flag(optimizer):
    """Clear Horovod's ``_synchronized`` flag at a step's end, as ``step()`` does: a
    step whose ``step()`` never ran (``GradScaler`` skipped it) leaves it set, and
    the next step would read it as its own.

    >>> class Opt: _synchronized = True
    >>> opt = Opt(); clear_synchronized_flag(opt); synchronized_flag(opt)
    False
    """
    if synchronized_flag(optimizer):
        optimizer._synchronized = False


def horovod_reduced(optimizer) -> Optional[set]:
    """The parameters Horovod's optimizer allreduces (its ``_requires_update``);
    None for another optimizer, an empty set on one rank (Horovod hooks nothing)."""
    hooked = getattr(optimizer, "_requires_update", None)
    return hooked if isinstance(hooked, set) else None


def adasum_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` is Horovod's Adasum optimizer (2+ ranks), which keeps no
    ``op`` attribute: known by its class."""
    step = getattr(type(optimizer), "step", None)
    return getattr(step, "__qualname__", "").startswith("_DistributedAdasumOptimizer.")


def comm_hook_name(model) -> Optional[str]:
    """The name of the communication hook registered on a DDP ``model``, or None."""
    hooks = getattr(model, "_comm_hooks", None)
    if hooks:
        return ", ".join(getattr(h, "__name__", repr(h)) for h, _ in hooks)
    try:
        return model._get_ddp_logging_data().get("comm_hook") or None
    except (AttributeError, RuntimeError):
        return None


def ddp_buckets_rebuilt(model):
    """DDP's flag for its bucket layout rebuilt (once, in the second iteration);
    None where it has none."""
    return getattr(model, "_has_rebuilt_buckets", None)


def tensor_version(tensor) -> int:
    """The in-place update counter of ``tensor`` (an optimizer step bumps it)."""
    return tensor._version
