"""omnihvd: OmniLearn dynamic batch sizing for Horovod (PyTorch, MPI) and DDP.

On heterogeneous ranks each rank gets a batch size proportional to its speed, the
global batch stays fixed, and gradients are weighted so that the allreduce returns
exactly the gradient of the whole global batch. The training loop stays as it is::

    bal = omnihvd.Balancer(model, opt, global_batch_size=512)
    loader = bal.loader(train_dataset, num_workers=2)   # in place of the DataLoader

The pure controller:

    >>> import omnihvd
    >>> omnihvd.controller.rebalance([16, 16, 16, 16], [4.0, 4.0, 2.0, 1.0], 64)
    [8, 8, 16, 32]

Importing omnihvd has no side effects: it initialises neither MPI nor Horovod.
"""
from . import controller, errors, timing
from .errors import ConfigError, InfeasibleError, OmniHvdError, RankMismatchError

__version__ = "0.1.0"

__all__ = [
    "Balancer",
    "BalancedLoader",
    "OmniLearnCallback",
    "HeterogeneousBatchSampler",
    "StaticSchedule",
    "AsyncOmniLearnCallback",
    "DDPOmniLearnCallback",
    "controller",
    "timing",
    "errors",
    "OmniHvdError",
    "ConfigError",
    "InfeasibleError",
    "RankMismatchError",
]


def __getattr__(name):
    # torch and horovod load only when these are first used, so `omnihvd doctor`
    # and the pure-numpy controller work even where torch is broken.
    if name in ("Balancer", "BalancedLoader"):
        from . import balancer

        return getattr(balancer, name)
    if name == "OmniLearnCallback":
        from .callback import OmniLearnCallback

        return OmniLearnCallback
    if name == "AsyncOmniLearnCallback":
        from .asynchronous import AsyncOmniLearnCallback

        return AsyncOmniLearnCallback
    if name == "DDPOmniLearnCallback":  # torch.distributed only: no Horovod import
        from .ddp import DDPOmniLearnCallback

        return DDPOmniLearnCallback
    if name in ("HeterogeneousBatchSampler", "StaticSchedule"):
        from . import sampler

        return getattr(sampler, name)
    raise AttributeError("module 'omnihvd' has no attribute %r" % name)
