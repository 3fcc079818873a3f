"""The user-facing object of asynchronous mode: :class:`AsyncOmniLearnCallback`.

It has the synchronous callback's hook names and signatures (``on_batch_end(batch=None,
logs=None)`` and so on), its options and its abort path
(:func:`omnihvd.faults.fail_job`), so switching a training loop between the modes
changes the constructor and one ``if``::

    from mpi4py import MPI                       # no hvd.init(): no Horovod here
    from omnihvd.asynchronous import AsyncOmniLearnCallback, AsyncBatchSampler

    cb = AsyncOmniLearnCallback(model, global_batch_size=512, lr=0.05, num_servers=1)
    with cb:                                      # any exception: abort naming the rank
        if cb.is_server:
            report = cb.serve()                   # until every worker is done
        else:
            sampler = AsyncBatchSampler(len(dataset), cb, seed=0)
            loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
            cb.on_train_begin()                   # pull the parameters
            for epoch in range(epochs):
                sampler.set_epoch(epoch); cb.on_epoch_begin(epoch)
                for x, y in loader:
                    cb.on_batch_begin()
                    model.zero_grad(); loss_fn(model(x), y).backward()
                    cb.on_batch_end()             # push the gradient, pull fresh parameters
                cb.on_epoch_end(epoch)
            cb.on_train_end()                     # final parameters into the model

Differences from the synchronous path, all inherent to a parameter server: there is
no optimizer on the workers (the server applies SGD, so ``lr``, ``momentum`` and
``weight_decay`` are given here), ranks ``0 .. num_servers-1`` are servers, and the
global batch is the sum of the workers' batches, each of which is pushed on its own.
"""
import time
from collections import deque
from typing import Deque, List, Optional

import numpy as np

from ..checks import check_int, check_number
from ..controller import DEFAULT_DEADBAND
from ..errors import ConfigError, RankMismatchError
from ..faults import fail_job
from ..timing import DEFAULT_SUMMARY
from .balance import IntervalBalancer, staleness_scale
from .protocol import layout_fingerprint, shard_bounds
from .server import ServerCore, serve
from .transport import Link
from .worker import WorkerClient

__all__ = ["AsyncOmniLearnCallback"]


def _nan_as_text(value):
    """``value`` with every float NaN in it, also in lists, replaced by ``"nan"``.

    >>> _nan_as_text([float("nan"), 12.0]), _nan_as_text(0.5)
    (['nan', 12.0], 0.5)
    """
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, (list, tuple)):
        return [_nan_as_text(v) for v in value]
    return value


class AsyncOmniLearnCallback:
    """Asynchronous parameter-server training with OmniLearn batch balancing.

    Construct on every rank (it is collective: it checks that all ranks agree on the
    options and the model, and broadcasts rank 0's initial parameters).

    Args:
        model: ``torch.nn.Module`` with float32 parameters, the same on every rank.
        global_batch_size: B, the sum of all workers' batch sizes; a push of b samples
            is weighted b / B.
        lr: learning rate of the servers' SGD.
        num_servers: ranks ``0 .. num_servers-1`` serve a contiguous shard each; the
            other ranks are workers (at least one).
        balance: True: equalise the workers' update intervals by moving batch size
            (OmniLearn); False: keep ``initial_batch_sizes`` (default equal) throughout.
        initial_batch_sizes, min_batch_size, max_batch_size, deadband, gain, policy,
            settle_steps, timing: as for :class:`omnihvd.OmniLearnCallback`,
            per worker.
        history: past decisions' measurements the controller fits its time model
            to (:class:`omnihvd.controller.Controller`'s ``history``; not the
            synchronous callback's ``history_size``).
        adjust_every: rounds between decisions; a round is one update per worker on
            average.
        momentum, weight_decay: of the servers' SGD.
        staleness_lr: None, or ``"inverse"`` to damp stale updates (see
            :func:`omnihvd.asynchronous.balance.staleness_scale`).
        comm: mpi4py communicator (default ``MPI.COMM_WORLD``); it is duplicated, so
            the protocol's messages never mix with the caller's.
        idle_timeout: seconds a server waits without any message, or a worker for a
            reply, before declaring the job broken (None: forever).
        abort_on_exception: as for :class:`omnihvd.OmniLearnCallback`: an exception
            (``KeyboardInterrupt`` and ``SystemExit`` included) inside a hook,
            :meth:`serve` or the ``with cb:`` block prints its
            traceback and ``omnihvd: rank R (worker k) raised ...; aborting the job``
            and aborts the whole job (other ranks would otherwise wait forever);
            False re-raises instead (for debugging). Default (None): True, since
            asynchronous mode always runs on several ranks.

    Raises:
        RankMismatchError: ranks disagree on an option or on the model (raised on
            every rank, naming the first rank that differs).
        ConfigError, InfeasibleError: bad options (raised on every rank).
    """

    def __init__(self, model, *, global_batch_size: int, lr: float, num_servers: int = 1,
                 balance: bool = True, initial_batch_sizes=None, min_batch_size=1,
                 max_batch_size=None, deadband: float = DEFAULT_DEADBAND, gain: float = 1.0,
                 adjust_every: int = 20, policy: str = "affine", settle_steps: int = 1,
                 timing: str = DEFAULT_SUMMARY, history: int = 8, momentum: float = 0.0,
                 weight_decay: float = 0.0, staleness_lr: Optional[str] = None, comm=None,
                 idle_timeout: Optional[float] = 600.0,
                 abort_on_exception: Optional[bool] = None):
        from mpi4py import MPI

        self.comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.model = model
        self._params = list(model.parameters())
        dtypes = sorted({str(p.dtype) for p in self._params})
        self.layout = layout_fingerprint([tuple(p.shape) for p in self._params], "float32")
        self.numel = int(sum(p.numel() for p in self._params))
        if hasattr(initial_batch_sizes, "tolist"):   # a numpy array or a tensor
            initial_batch_sizes = initial_batch_sizes.tolist()
        options = dict(global_batch_size=global_batch_size, lr=lr, num_servers=num_servers,
                       balance=balance, initial_batch_sizes=initial_batch_sizes,
                       min_batch_size=min_batch_size, max_batch_size=max_batch_size,
                       deadband=deadband, gain=gain, adjust_every=adjust_every, policy=policy,
                       settle_steps=settle_steps, timing=timing, history=history,
                       momentum=momentum, weight_decay=weight_decay, staleness_lr=staleness_lr,
                       idle_timeout=idle_timeout, model_layout=self.layout,
                       model_numel=self.numel, model_dtypes=dtypes)
        self._check_agreement(options)
        # From here on every rank holds the same options, so it reaches the same verdict.
        check_int("num_servers", num_servers, 1, "at least one of the %d ranks must be a "
                  "worker" % self.size, maximum=self.size - 1)
        if dtypes != ["torch.float32"]:
            raise ConfigError("asynchronous mode supports float32 parameters only; the model "
                              "has %s (call model.float())" % dtypes)
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            check_number(name, value, 0)
        if idle_timeout is not None and check_number("idle_timeout", idle_timeout, 0) == 0:
            raise ConfigError("idle_timeout must be None or a number of seconds > 0, got %r"
                              % (idle_timeout,))
        self.num_servers = num_servers
        self.servers = list(range(num_servers))
        self.workers = list(range(num_servers, self.size))
        self.num_workers = len(self.workers)
        staleness_scale(0, self.num_workers, staleness_lr)  # validates the mode
        self.bounds = shard_bounds(self.numel, num_servers)
        balancer = IntervalBalancer(
            self.num_workers, global_batch_size, balance=balance,
            initial_batch_sizes=initial_batch_sizes, adjust_every=adjust_every,
            settle_steps=settle_steps, timing=timing, policy=policy, gain=gain,
            deadband=deadband, min_batch_size=min_batch_size, max_batch_size=max_batch_size,
            history=history)
        self.global_batch_size = global_batch_size
        self.idle_timeout = idle_timeout
        self.abort_on_exception = True if abort_on_exception is None else bool(abort_on_exception)

        flat = self._flat_params() if self.rank == 0 else np.empty(self.numel, np.float32)
        self.comm.Bcast([flat, MPI.FLOAT], root=0)
        self.is_server = self.rank < num_servers
        self.is_worker = not self.is_server
        self.role = ("server %d" % self.rank if self.is_server
                     else "worker %d" % (self.rank - num_servers))
        self._link = Link(self.comm, server=self.is_server)
        if self.is_server:
            lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
            self._core = ServerCore(flat[lo:hi], rank=self.rank, worker_ranks=self.workers,
                                    global_batch_size=global_batch_size, lr=lr,
                                    momentum=momentum, weight_decay=weight_decay,
                                    staleness_lr=staleness_lr, layout=self.layout,
                                    balancer=balancer if self.rank == 0 else None)
            self._client = None
        else:
            self._core = None
            self._client = WorkerClient(self._link, self.servers, self.bounds, self.layout,
                                        timeout=idle_timeout)
            self._load(flat)
        self.worker_index = None if self.is_server else self.rank - num_servers
        self.batch_size = None if self.is_server else balancer.sizes[self.rank - num_servers]
        # sizes of the batches AsyncBatchSampler handed out and no push has used yet,
        # oldest first (a prefetching DataLoader runs ahead of the loop)
        self.sizes_handed_out: Deque[int] = deque()
        self.step = 0
        self.epoch = 0
        self.history: List[dict] = []
        self.report_: Optional[dict] = None
        self._begun = self._ended = False
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------ helpers

    def _check_agreement(self, options):
        # NaN is not equal to itself: compared as text (also inside a list), so that a
        # NaN on every rank is reported as the bad value it is (checked after the
        # agreement)
        options = {k: _nan_as_text(v) for k, v in options.items()}
        everyone = self.comm.allgather(options)
        for rank, theirs in enumerate(everyone):
            for key in options:
                if theirs[key] != everyone[0][key]:
                    raise RankMismatchError(
                        "asynchronous mode: rank %d has %s=%r but rank 0 has %r; pass the same "
                        "options and build the same model on every rank"
                        % (rank, key, theirs[key], everyone[0][key]))

    def _flat_params(self) -> np.ndarray:
        import torch

        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).cpu() for p in self._params]).numpy().astype(
                np.float32, copy=True)

    def _flat_grads(self) -> np.ndarray:
        import torch

        parts = [p.grad.detach().reshape(-1).cpu() if p.grad is not None
                 else torch.zeros(p.numel(), dtype=torch.float32) for p in self._params]
        return torch.cat(parts).numpy().astype(np.float32, copy=False)

    def _load(self, flat: np.ndarray):
        import torch

        offset = 0
        with torch.no_grad():
            for p in self._params:
                n = p.numel()
                p.copy_(torch.from_numpy(flat[offset:offset + n]).view_as(p))
                offset += n

    def _guard(self, fn, *args):
        try:
            return fn(*args)
        except BaseException as exc:   # Ctrl-C and sys.exit() too: the others would wait
            if self.abort_on_exception:
                fail_job(self.rank, exc, role=self.role, comm=self.comm)
            raise

    def _need(self, worker: bool, hook: str):
        if worker != self.is_worker:
            raise ConfigError("%s() is for %s ranks; rank %d is %s (branch on cb.is_server)"
                              % (hook, "worker" if worker else "server", self.rank, self.role))

    # ------------------------------------------------------------ server

    def serve(self) -> dict:
        """Run this server until every worker has called :meth:`on_train_end`.

        Returns:
            this server's report: updates applied per worker, staleness summary
            (median, p95, max), the per-update log, the balancer's decisions (server 0).
        """
        def run():
            self._need(False, "serve")
            self.report_ = serve(self._core, self._link, self.idle_timeout)
            return self.report_
        return self._guard(run)

    # ------------------------------------------------------------ worker hooks

    def on_train_begin(self, logs=None):
        """Pull the parameters and this worker's first batch size."""
        def run():
            self._need(True, "on_train_begin")
            if self._begun:
                return
            flat, size = self._client.hello()
            self._load(flat)
            self.batch_size = size or self.batch_size
            self._begun = True
        self._guard(run)

    def on_epoch_begin(self, epoch, logs=None):
        """Record the epoch (each worker runs its own epochs)."""
        self.epoch = epoch

    def on_batch_begin(self, batch=None, logs=None):
        """Nothing to do: the update interval runs from push to push."""

    def on_batch_end(self, batch=None, logs=None):
        """Push this batch's gradient, load the fresh parameters, take the next batch size.

        Args:
            batch: the batch index (unused, as in the synchronous callback).
            logs: optional dict; ``logs["size"]`` (the Keras key) is the number of
                samples the gradient averages over. Default: the size of the oldest
                batch :class:`AsyncBatchSampler` handed out that no push has used yet
                (right with a prefetching DataLoader, whose batches were cut at
                earlier sizes, and for ``drop_last=False``'s short last batch);
                :attr:`batch_size` for batches from another sampler.
        """
        def run():
            self._need(True, "on_batch_end")
            if not self._begun:
                raise ConfigError("on_batch_end() before on_train_begin() on rank %d" % self.rank)
            handed = (self.sizes_handed_out.popleft() if self.sizes_handed_out
                      else self.batch_size)
            used = check_int("logs['size']", (logs or {}).get("size", handed), 1,
                             "the samples of this batch", where="rank %d: " % self.rank,
                             maximum=self.global_batch_size)
            flat, size = self._client.push(self._flat_grads(), used)
            self._load(flat)
            self.history.append({"step": self.step, "batch_size": used, "next_batch_size": size,
                                 "versions": list(self._client.versions),
                                 "time": round(time.perf_counter() - self._t0, 6)})
            self.batch_size = size
            self.step += 1
        self._guard(run)

    def on_epoch_end(self, epoch, logs=None):
        """Nothing to do: there is no cross-worker epoch boundary."""

    def on_train_end(self, logs=None):
        """Stop protocol: tell the servers, wait for the last worker, load the final model."""
        def run():
            self._need(True, "on_train_end")
            if self._ended:
                return
            if not self._begun:
                self.on_train_begin()
            self._load(self._client.done())
            self._ended = True
        self._guard(run)

    # ------------------------------------------------------------ context

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # any exception, Ctrl-C (KeyboardInterrupt) and sys.exit() included: a rank
        # that leaves the protocol early leaves the others waiting for it
        if exc is not None and self.abort_on_exception:
            fail_job(self.rank, exc, role=self.role, comm=self.comm)
        # a worker that never trained still says it is done, or the servers wait for it
        if exc is None and self.is_worker and not self._ended:
            self.on_train_end()
        return False
