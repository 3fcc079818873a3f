"""Asynchronous mode: a parameter server over MPI, with OmniLearn batch balancing.

Horovod has only synchronous collectives, so this mode does not use them: ranks
``0 .. num_servers-1`` hold the parameters (one contiguous shard each) and the other
ranks are workers that pull parameters, compute a gradient on their own batch size
and push it. Each server applies every push once, weighted by its batch size, counts
versions and records each update's staleness. With ``balance=True`` server 0 moves
the workers' batch sizes so that every worker updates at the same rate (the
OmniLearn controller applied to update intervals).

Synchronous mode: ``omnihvd.OmniLearnCallback`` with ``hvd.DistributedOptimizer``.
Asynchronous mode: :class:`AsyncOmniLearnCallback` and :class:`AsyncBatchSampler`
here; launched the same way (``mpirun``, ``horovodrun``, ``srun``).

Modules: ``protocol`` (wire format), ``server`` (server state machine),
``worker`` (client), ``balance`` (batch-size control, staleness-aware lr),
``transport`` (the MPI calls), ``sampler``, ``callback``. Importing this package
does not initialise MPI.
"""
from .balance import IntervalBalancer, staleness_scale
from .callback import AsyncOmniLearnCallback
from .protocol import ProtocolError
from .sampler import AsyncBatchSampler
from .server import ServerCore, summarize_staleness

__all__ = ["AsyncOmniLearnCallback", "AsyncBatchSampler", "IntervalBalancer", "ServerCore",
           "ProtocolError", "staleness_scale", "summarize_staleness"]
