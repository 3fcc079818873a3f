"""OmniLearnCallback: the drop-in object that wires timing, gathering, the cadence,
gradient weighting and the size schedule together. It owns no math of its own.

Per step ``s`` (global steps, counted across epochs)::

    on_batch_begin   sizes of step s (schedule) -> gradient weight; start the timer
    opt.step()       pre-hook = the wait boundary: the local time ends (the compute
                     stream synchronised on GPUs); if s closes a window, post the
                     non-blocking allgather of [time, samples, size, look-ahead,
                     digest, memory cap, standard error] now, so it overlaps the
                     gradient synchronize() that follows
    on_batch_end     complete that gather, decide (every rank the same, from the
                     same data: omnihvd.cadence), schedule the new sizes for the
                     first step no rank's sampler has handed out yet

Where each idea lives: timing in :mod:`omnihvd.timing` (device, data loading,
CPU quota, estimator), the rhythm in :mod:`omnihvd.cadence`, the decision in
:mod:`omnihvd.controller`, the schedule in :mod:`omnihvd.schedule`, checkpoint
validation in :mod:`omnihvd.checkpoint`, gathering in :mod:`omnihvd.comm`.

Why the gather starts and ends inside one step: ranks leave the last step at
different moments, and the first to exit shuts Horovod down on every rank (when
``hvd.init()`` initialised MPI, Horovod's background thread also finalises it). A
gather still open when a rank exits, or an MPI call made by a rank that is still
in its last ``on_batch_end``, would then use a finalised MPI. The gather is
therefore posted before the step's gradient synchronisation, on every rank, and
goes through Horovod's own allgather, which its background thread completes
before it handles any shutdown; nothing is in flight when the loop ends, whether
or not it calls :meth:`OmniLearnCallback.on_train_end`.
"""
import logging
import os
import time
import zlib
from typing import Dict, List, Optional

import numpy as np

from .cadence import Cadence, close_window
from .cpuquota import cpu_quota_cores
from .checkpoint import checked_state
from .comm import HorovodComm, LocalComm, PendingGather, make_comm
from .controller import POLICIES, Controller, initial_split, partial_split
from .errors import ConfigError, InfeasibleError, RankMismatchError
from .losses import check_batch_length, checked_count, total_count
from .membership import JOIN_NAME, ThroughputMeter, agree_on_world, world_report, worker_label
from .normalization import batchnorm_layers, check_no_sync_batchnorm, raise_min_batch_size
from .schedule import SizeSchedule
from .timing import DEFAULT_SUMMARY, SUMMARIES, StepTimer, TimedIterable
from .weighting import (LOSS_REDUCTIONS, GradientWeight, _optimizer_op, allreduce_weight,
                        register_gradient_weight, synchronized_flag)

__all__ = ["OmniLearnCallback"]

log = logging.getLogger("omnihvd")

# Columns of the per-adjustment allgather payload.
_TIME, _COUNT, _SIZE, _AHEAD, _DIGEST, _CAP, _ERROR = range(7)
PAYLOAD_FIELDS = 7  # float64 per rank per adjustment: time, samples, size, look-ahead,
#                     digest of the sizes, memory cap, standard error of the time


def _digest(sizes) -> float:
    """A float-exact checksum of a size vector (crc32 fits a float64 exactly)."""
    return float(zlib.crc32(",".join(str(int(b)) for b in sizes).encode()))


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError("%s must be an int >= %d, got %r" % (name, minimum, value))
    return value


class OmniLearnCallback:
    """OmniLearn dynamic batch sizing for a Horovod PyTorch training loop.

    Args:
        model: the ``torch.nn.Module`` being trained.
        optimizer: the ``hvd.DistributedOptimizer`` wrapping the model's optimizer
            (``op=hvd.Average`` or ``op=hvd.Sum``).
        global_batch_size: B, the samples per step over all ranks; held exactly.
        initial_batch_sizes: one int per rank summing to B (static
            heterogeneity-aware sizing); default: an equal split.
        min_batch_size: int or per-rank list (default 1). A model with BatchNorm
            layers gets at least 2 (logged): one sample has no batch statistics.
        max_batch_size: None, int or per-rank list (memory caps).
        deadband: apply new sizes only when the largest relative change reaches it
            (default 0.05, the paper's 5%).
        gain: controller gain K (default 1.0).
        adjust_every: steps between adjustments (default 20).
        policy: ``"affine"`` (default; time model a + c*b) or ``"proportional"``
            (the paper's controller).
        settle_steps: steps not timed after each size change (default 1).
        timing: window summary: ``"sustained"`` (default; the mean with rare pauses
            clipped, robust to bursty CPU), ``"median"`` or ``"mean"``
            (docs/timing.rst).
        nonblocking: post the allgather at the wait boundary so that it runs beside
            the step's gradient synchronisation (default True); False posts it in
            ``on_batch_end`` and waits there.
        comm: None (Horovod's own allgather: safe at any shutdown order), or the
            mpi4py communicator given to ``hvd.init(comm=...)`` (then mpi4py owns
            MPI and finalises it only at its own exit).
        size_multiple: every batch size is a multiple of this k (default 1), so GPUs
            see few distinct shapes; when k does not divide B, rank 0 also takes the
            remainder ``B mod k`` (see :func:`omnihvd.controller.unit_bounds`).
        loss_reduction: ``"mean"`` (default: each rank's loss is the mean over its
            samples) or ``"sum"`` (the sum over them, or a sum divided by
            :meth:`global_count`). The result is the gradient of the same loss over
            the global batch, under ``op=hvd.Average`` and ``op=hvd.Sum`` alike (see
            docs/losses.rst).
        history_size: how many decisions ``cb.history`` keeps (default 1000; older
            ones are dropped, so a long run's memory stays flat).
        abort_on_exception: when a rank raises an uncaught exception, print it with
            the rank and abort the whole MPI job instead of leaving the other ranks
            waiting in a collective forever (see :mod:`omnihvd.faults`). Default:
            True with several ranks, except under Horovod elastic, where a failed
            worker must leave alone.
        device_sync: ``"auto"`` (default: wait for the model's compute stream at
            the wait boundary when it is on an accelerator, see
            :mod:`omnihvd.device`), None (host time only) or a callable.
        cpu_quota: ``"auto"`` (default: this process's CFS quota in cores, read from
            its cgroup at the start and at every adjustment), None (ignore quotas)
            or a number of cores; a step then lasts at least its CPU time over it.

    Raises:
        ConfigError: on every rank, when any rank's options are invalid (the message
            names the rank and the fix), or the model uses synchronised batch
            normalisation (see :mod:`omnihvd.normalization`).

    Under Horovod elastic (``horovodrun --min-np/--max-np``) track it with
    :class:`omnihvd.elastic.TorchState`: B is then re-split over the workers present
    at every entry into the ``@hvd.elastic.run`` function (docs/elastic.rst).

    Example::

        import horovod.torch as hvd, omnihvd
        hvd.init()
        opt = hvd.DistributedOptimizer(base_opt, named_parameters=model.named_parameters())
        cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=512)
        sampler = omnihvd.HeterogeneousBatchSampler(len(dataset), cb, seed=0)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
        cb.on_train_begin()
        for epoch in range(epochs):
            sampler.set_epoch(epoch); cb.on_epoch_begin(epoch)
            for x, y in cb.wrap(loader):       # or `in loader`: data time not counted
                cb.on_batch_begin()
                opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
                cb.on_batch_end()
            cb.on_epoch_end(epoch)
        cb.on_train_end()
    """

    # Horovod elastic (omnihvd.elastic): off unless horovodrun runs an elastic job and
    # an omnihvd.elastic.TorchState tracks the callback.
    _elastic = False         # HOROVOD_ELASTIC=1: no collective may run before entry
    _tracker = None          # the omnihvd.elastic.TorchState committing this callback
    _meter: Optional[ThroughputMeter] = None   # this worker's samples/s, for a re-split
    _initial_given = False   # the user chose initial_batch_sizes (they fit one world only)

    def __init__(self, model, optimizer, global_batch_size: int, *,
                 initial_batch_sizes: Optional[List[int]] = None, min_batch_size=1,
                 max_batch_size=None, deadband: float = 0.05, gain: float = 1.0,
                 adjust_every: int = 20, policy: str = "affine", settle_steps: int = 1,
                 timing: str = DEFAULT_SUMMARY, nonblocking: bool = True, comm=None,
                 size_multiple: int = 1, loss_reduction: str = "mean",
                 history_size: int = 1000, abort_on_exception: Optional[bool] = None,
                 device_sync="auto", cpu_quota="auto"):
        import horovod.torch as hvd

        if not hvd.is_initialized():
            raise ConfigError("Horovod is not initialised: call hvd.init() before creating "
                              "OmniLearnCallback")
        self.rank, self.num_ranks = hvd.rank(), hvd.size()
        self._comm = make_comm(comm, rank=self.rank, size=self.num_ranks)
        self._elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        self._initial_given = initial_batch_sizes is not None
        self._configure_everywhere(model, optimizer, global_batch_size, initial_batch_sizes,
                                   min_batch_size, max_batch_size, deadband, gain, adjust_every,
                                   policy, settle_steps, timing, nonblocking, size_multiple,
                                   loss_reduction, history_size, device_sync, cpu_quota)
        if abort_on_exception is None:
            abort_on_exception = self.num_ranks > 1 and not self._elastic
        self._enable_abort(abort_on_exception)

    # Seams for other backends (omnihvd.ddp): how a rank joins and reduces gradients
    # differs; the configuration, schedule, decisions and checkpoints do not.
    def _configure_everywhere(self, *configure_args):
        """Validate the options on every rank; raise on all ranks if any rank failed."""
        if self._elastic:
            # Horovod elastic: no collective before the @hvd.elastic.run function (a new
            # worker would run it alone); the options are compared on entry instead.
            self._configure(*configure_args)
            return
        error = None
        try:
            self._configure(*configure_args)
        except Exception as exc:  # reported on every rank below, never on one alone
            error = exc
        self._agree_on_errors(error)

    def _enable_abort(self, abort_on_exception):
        self._abort_enabled = bool(abort_on_exception)
        self._abort_handle = None
        self._install_abort()

    def _check_backend(self, model, optimizer) -> bool:
        """Check the Horovod optimizer; returns True for op=Average, False for op=Sum."""
        average = _optimizer_op(optimizer)
        process_set = getattr(optimizer, "process_set", None)
        if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
            raise ConfigError("optimizer uses a non-global Horovod process set; omnihvd balances "
                              "the global set only: create it without process_set=")
        return average

    def _install_hooks(self) -> list:
        """Gradient weights and the timing boundary; returns handles with ``remove()``."""
        return [register_gradient_weight(self._model.parameters(), self._weight),
                self._optimizer.register_step_pre_hook(self._on_step_entry)]

    def _install_abort(self):
        if self._abort_enabled and self._abort_handle is None:
            from .faults import install_abort_on_exception

            self._abort_handle = install_abort_on_exception(self.rank)

    # ------------------------------------------------------------ set-up
    def _configure(self, model, optimizer, global_batch_size, initial_batch_sizes,
                   min_batch_size, max_batch_size, deadband, gain, adjust_every, policy,
                   settle_steps, timing, nonblocking, size_multiple=1, loss_reduction="mean",
                   history_size=1000, device_sync="auto", cpu_quota="auto"):
        if not hasattr(model, "named_modules"):
            raise ConfigError("model must be a torch.nn.Module, got %s" % type(model).__name__)
        check_no_sync_batchnorm(model)
        self._average = self._check_backend(model, optimizer)
        B = _check_int("global_batch_size", global_batch_size, 1)
        adjust_every = _check_int("adjust_every", adjust_every, 1)
        if policy not in POLICIES:
            raise ConfigError("policy must be one of %s, got %r" % (", ".join(POLICIES), policy))
        if timing not in SUMMARIES:
            raise ConfigError("timing must be one of %s, got %r" % (", ".join(SUMMARIES), timing))
        if not isinstance(nonblocking, bool):
            raise ConfigError("nonblocking must be True or False, got %r" % (nonblocking,))
        if not (device_sync is None or device_sync == "auto" or callable(device_sync)):
            raise ConfigError("device_sync must be 'auto', None or a callable, got %r"
                              % (device_sync,))
        if not (cpu_quota is None or cpu_quota == "auto" or (
                isinstance(cpu_quota, (int, float)) and not isinstance(cpu_quota, bool)
                and 0 < cpu_quota < float("inf"))):
            raise ConfigError("cpu_quota must be 'auto', None or a number of cores > 0, got %r"
                              % (cpu_quota,))
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ConfigError("loss_reduction must be one of %s, got %r"
                              % (", ".join(LOSS_REDUCTIONS), loss_reduction))
        self.global_batch_size = B
        self.adjust_every = adjust_every
        self.nonblocking = nonblocking
        self.loss_reduction = loss_reduction
        self.history_size = _check_int("history_size", history_size, 1)
        norms = batchnorm_layers(model)
        raised = False
        if norms:  # BatchNorm cannot normalise a batch of one sample
            min_batch_size, raised = raise_min_batch_size(min_batch_size)
            if raised and self.rank == 0:
                log.info("omnihvd: the model has BatchNorm layers (%s): min_batch_size raised to "
                         "%r (a batch of one sample has no batch statistics)",
                         ", ".join(norms[:3]) + (", ..." if len(norms) > 3 else ""),
                         min_batch_size)
        try:
            self.controller = Controller(self.num_ranks, B, policy=policy, gain=gain,
                                         deadband=deadband, min_batch_size=min_batch_size,
                                         max_batch_size=max_batch_size,
                                         size_multiple=size_multiple)
        except InfeasibleError as exc:
            if not raised:
                raise
            raise InfeasibleError("%s (min_batch_size was raised to 2 because the model has "
                                  "BatchNorm layers; use a larger global_batch_size, or "
                                  "GroupNorm/LayerNorm)" % exc) from exc
        lo, hi = self.controller.lo, self.controller.hi
        sizes = initial_split(self.num_ranks, B, lo, hi, initial_batch_sizes,
                              size_multiple=self.controller.size_multiple)
        self.cadence = Cadence(self.controller, adjust_every=adjust_every,
                               settle_steps=settle_steps, timing=timing)
        self.schedule = SizeSchedule(self.rank, self.num_ranks, B, sizes,
                                     partial=self._partial_split)
        self._model = model
        self._optimizer = optimizer
        self._options = dict(
            global_batch_size=B, initial_batch_sizes=list(sizes), min_batch_size=lo.tolist(),
            max_batch_size=hi.tolist(), deadband=self.controller.deadband,
            gain=self.controller.gain, adjust_every=self.adjust_every, policy=policy,
            settle_steps=settle_steps, timing=timing, nonblocking=self.nonblocking,
            average=self._average, size_multiple=self.controller.size_multiple,
            loss_reduction=loss_reduction, history_size=self.history_size,
            backward_passes_per_step=getattr(optimizer, "backward_passes_per_step", 1))
        self._device_sync_option = device_sync
        self._cpu_quota_option = cpu_quota
        self._timer = StepTimer()
        self._weight = GradientWeight(1.0)
        self._pending = None          # the posted gather of this step
        self._step_sizes: Optional[List[int]] = None
        self._hooks = []
        self._started = False
        self._drop_sample = False
        self._recorded = False        # this step's sample was taken at the wait boundary
        self._warned_sync = False
        # None: this optimizer does not expose Horovod's private flag, so an explicit
        # synchronize() before step() cannot be detected (warned at on_train_begin).
        self._sync_detectable = optimizer is None or synchronized_flag(optimizer) is not None
        self._cap = int(self.controller.hi[self.rank])
        self.oom_events = 0
        self.epoch = 0
        self.history: List[Dict] = []   # the last history_size decisions
        self._adjustments = 0
        self.overhead_seconds = 0.0

    def _agree_on_errors(self, error):
        reports = self._comm.allgather_object(None if error is None else
                                              "%s: %s" % (type(error).__name__, error))
        failed = [(r, msg) for r, msg in enumerate(reports) if msg is not None]
        if not failed:
            return
        detail = "; ".join("rank %d: %s" % (r, msg) for r, msg in failed)
        if len(failed) == len(reports) and len({m for _, m in failed}) == 1 and isinstance(
                error, ValueError):
            raise error  # the same problem everywhere: keep its own type and message
        raise ConfigError("%s rejected its configuration on %d of %d ranks (%s)"
                          % (type(self).__name__, len(failed), len(reports), detail)) from error

    def _fingerprint(self):
        shapes = [(name, tuple(p.shape)) for name, p in self._model.named_parameters()]
        fp = dict(self._options)
        fp["model"] = "%d tensors, %d values, crc %08x" % (
            len(shapes), sum(int(p.numel()) for p in self._model.parameters()),
            zlib.crc32(repr(shapes).encode()))
        fp["resume"] = (self.step, self.batch_sizes)
        fp["samplers"] = [(s.num_samples, s.seed, s.shuffle, s.drop_last)
                          for s in self.schedule.samplers]
        return fp

    def _configure_timer(self):
        """Device sync and CPU quota for the timer (the model may have moved to its
        device after the callback was built, so this runs at on_train_begin)."""
        option = self._device_sync_option
        if option == "auto":
            from .device import device_synchronizer

            option = device_synchronizer(self._model)
        self._timer.device_sync = option
        self._refresh_quota()

    def _refresh_quota(self):
        option = self._cpu_quota_option
        self._timer.cpu_cores = cpu_quota_cores() if option == "auto" else option

    # ----------------------------------------------- schedule (BatchSchedule protocol)
    @property
    def step(self) -> int:
        """Steps completed so far (global, across epochs)."""
        return self.schedule.step

    @property
    def current_step(self) -> int:
        """Steps completed so far (the index of the step about to run)."""
        return self.schedule.step

    def batch_sizes_at(self, step: int) -> List[int]:
        """All ranks' sizes for global step ``step`` as scheduled now."""
        return self.schedule.batch_sizes_at(step)

    def issue(self, step: int, total: int, record: bool = True) -> Optional[List[int]]:
        """Sizes of global step ``step`` holding ``total`` samples (called by the sampler).

        A partial step (``total < B``) is split within the bounds, or None when no
        split fits (the sampler then drops it). ``record=False`` (evaluation
        samplers) leaves the schedule untouched.
        """
        return self.schedule.issue(step, total, record)

    def _partial_split(self, sizes, total):
        c = self.controller
        return partial_split(sizes, total, c.lo, c.hi, c.size_multiple)

    def can_split(self, total: int) -> bool:
        """Whether a partial step of ``total`` samples fits the per-rank bounds now."""
        return self._partial_split(self.batch_sizes, total) is not None

    def register_sampler(self, sampler, train: Optional[bool] = None) -> bool:
        """Called by :class:`~omnihvd.HeterogeneousBatchSampler`: its dataset length,
        seed, shuffle and drop_last join the cross-rank check at ``on_train_begin``
        (ranks with different seeds would silently repeat and skip samples).

        Returns whether the sampler drives the schedule (its steps are the training
        steps): ``train``, or by default True for the first sampler only. Others (a
        validation loader) read the current sizes and record nothing.

        Raises:
            ConfigError: a second sampler asks for ``train=True``.
        """
        return self.schedule.register_sampler(sampler, train)

    @property
    def batch_sizes(self) -> List[int]:
        """Every rank's current batch size (the same list on every rank); sums to B."""
        return self.schedule.batch_sizes_at(self.step)

    @property
    def batch_size(self) -> int:
        """This rank's current batch size, b_i."""
        return self.batch_sizes[self.rank]

    def wrap(self, loader):
        """``loader`` with each ``next()`` counted as this rank's work.

        Iterate the result instead of the loader (``for x, y in cb.wrap(loader)``):
        the time of each ``next()`` is added to the local time of the step it feeds,
        so a rank with slow storage or few loader workers gets fewer samples. The
        first ``next()`` of each epoch (worker start-up) is not counted, nor is
        anything between steps that is not a ``next()``.
        """
        return TimedIterable(loader, self._timer.add, restart=self._timer.discard_extra)

    # --------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None):
        """Register the gradient-weight and timing hooks; check that ranks agree."""
        if self._started:
            return
        t0 = time.perf_counter()
        if self._elastic or self._tracker is not None:
            self._join_world()
        self._install_abort()
        views = self._comm.allgather_object(self._fingerprint())
        diffs = []
        for key in views[0]:
            values = [v.get(key) for v in views]
            if any(v != values[0] for v in values):
                diffs.append("%s: %s" % (key, ", ".join("rank %d has %r" % (r, v)
                                                        for r, v in enumerate(values))))
        if diffs:
            raise RankMismatchError("ranks disagree on the omnihvd configuration or model; every "
                                    "rank must pass the same values (%s)" % "; ".join(diffs))
        self._configure_timer()
        self._hooks = self._install_hooks()
        self._started = True
        if not self._sync_detectable and not self._warned_sync:
            self._warned_sync = True
            log.warning("omnihvd: rank %d: the optimizer has no Horovod _synchronized flag, so "
                        "omnihvd cannot detect an explicit opt.synchronize() before opt.step(); "
                        "if the loop calls it, call cb.mark_compute_end() just before, or step "
                        "times include waiting for other ranks", self.rank)
        if self.rank == 0:
            log.info("omnihvd: %d ranks, global batch %d, initial sizes %s, policy %s, adjust "
                     "every %d steps", self.num_ranks, self.global_batch_size, self.batch_sizes,
                     self.controller.policy, self.adjust_every)
        self.overhead_seconds += time.perf_counter() - t0

    def on_epoch_begin(self, epoch, logs=None):
        """Record the epoch (the sampler's ``set_epoch`` chooses the permutation)."""
        self.epoch = epoch

    def on_batch_begin(self, batch=None, logs=None):
        """Set this step's gradient weight and start the local timer.

        Args:
            batch: optional; the batch the loop got (a tensor, or a tuple/list/dict
                of them, as the DataLoader yields it). Its length is checked
                against this step's size (see :meth:`check_batch`). An int (a
                Keras-style batch index) is ignored.
        """
        if not self._started:
            self.on_train_begin()
        t0 = time.perf_counter()
        sizes = self.schedule.batch_sizes_at(self.step)
        self._step_sizes = sizes
        if batch is not None and not isinstance(batch, int):
            self.check_batch(batch)
        self._weight.value = allreduce_weight(sizes[self.rank], sizes, self._average,
                                              self.loss_reduction)
        self.cadence.begin_step(sizes)
        self._drop_sample = self._recorded = False
        self.overhead_seconds += time.perf_counter() - t0
        self._timer.start()

    def check_batch(self, batch):
        """Check that ``batch`` holds this rank's size for the current step.

        The gradient weights assume the sampler's sizes; a batch of another size (a
        DataLoader built with ``batch_size=`` instead of ``batch_sampler=``, a
        collate function that drops samples) would make the gradient silently wrong.

        Raises:
            ConfigError: the batch has another number of samples (on this rank).
        """
        check_batch_length(batch, (self._step_sizes or self.batch_sizes_at(self.step))[self.rank],
                           self.rank, self.step)

    def global_count(self, count) -> float:
        """The sum of ``count`` over every rank, for normalising a summed loss.

        For losses whose normaliser is not the number of samples -- class-weighted
        cross-entropy (sum of the targets' weights), ``ignore_index`` (targets not
        ignored), per-token means (tokens) -- compute each rank's loss with
        ``reduction="sum"`` and divide it by the step's global count; with
        ``loss_reduction="sum"`` the gradient is then exactly that of the loss over
        the global batch. Every rank must call it once per (micro-)step, at the same
        point. It is a small blocking allgather; the time spent waiting in it is
        left out of the step's timing. Every rank sums the same gathered values in
        the same order, so all get the same bits.

        Args:
            count: this rank's count (int, float or a one-element tensor), >= 0.

        Returns:
            float: the global count.

        Raises:
            ConfigError: the callback's ``loss_reduction`` is not ``"sum"``; a count
                that is negative or not finite (on this rank); a global count of 0
                (on every rank).

        Example::

            cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=512,
                                           loss_reduction="sum")
            ...
            loss_sum = F.cross_entropy(out, y, ignore_index=-100, reduction="sum")
            loss = loss_sum / cb.global_count((y != -100).sum())
        """
        if self.loss_reduction != "sum":
            raise ConfigError("global_count normalises a sum-reduced loss: create the callback "
                              "with loss_reduction='sum' (it has %r)" % self.loss_reduction)
        value = checked_count(count, self.rank)
        t0 = time.perf_counter()
        gathered = self._comm.allgather([value])
        self._timer.exclude(time.perf_counter() - t0)  # waiting for the others
        return total_count(gathered, self.step)

    def mark_compute_end(self):
        """Mark where this rank starts waiting for the others, when that is not ``step()``.

        Call it just before an explicit ``opt.synchronize()`` (e.g. for gradient
        clipping with ``opt.skip_synchronize()``); otherwise omnihvd times up to the
        entry of ``opt.step()`` by itself.
        """
        self._wait_boundary()

    def _on_step_entry(self, optimizer, args, kwargs):
        # Horovod's step() enters this hook before synchronize() (and once more from
        # the wrapped optimizer's step after it); only the first entry is the boundary.
        if (self._timer.running and not self._timer.marked
                and synchronized_flag(optimizer)):
            # synchronize() already ran and nobody marked the compute end: the time
            # includes waiting for other ranks, so it must not be used.
            self._drop_sample = True
            if not self._warned_sync:
                self._warned_sync = True
                log.warning("omnihvd: rank %d: opt.synchronize() ran before opt.step(), so step "
                            "times include waiting and are dropped; call cb.mark_compute_end() "
                            "just before opt.synchronize() to let omnihvd balance", self.rank)
        self._wait_boundary()

    def _wait_boundary(self):
        # The step's own work is done; next this rank waits for its peers. Later calls
        # in the same step (Horovod's step() re-enters the hook) do nothing.
        if not self._timer.running:
            return
        self._timer.mark_wait()
        self._record()
        self._timer.stop()
        t0 = time.perf_counter()
        if self.nonblocking and self.cadence.gathers_at(self.step):
            self._post()  # overlaps the gradient synchronize() that follows
        self.overhead_seconds += time.perf_counter() - t0

    def _record(self):
        if not self._recorded:
            self._recorded = True
            local = self._timer.local()
            if local is not None and not self._drop_sample:
                self.cadence.record(local)
                if self._meter is not None:
                    self._meter.observe(self._step_sizes[self.rank], local)

    def _post(self):
        self._record()
        measured = close_window(self.cadence.window)
        sizes = self.cadence.window_sizes or self.batch_sizes
        payload = [measured.time, measured.count, sizes[self.rank], self.schedule.lookahead,
                   _digest(sizes), self._cap, measured.error]
        if self.nonblocking:
            self._pending = self._comm.iallgather(payload)
        else:
            done = self._comm.allgather(payload)
            self._pending = PendingGather(lambda: done)

    def on_batch_end(self, batch=None, logs=None):
        """Record the step's local time; complete the gather, decide and schedule when due."""
        t0 = time.perf_counter()
        if self._timer.running:  # no wait boundary this step (no opt.step() call)
            self._timer.mark_wait()
            self._record()
            self._timer.stop()
        if self.cadence.gathers_at(self.step) and self._pending is None:
            self._post()  # no wait boundary this step (a loop without step()), or blocking
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._decide(pending.wait())
            self._refresh_quota()  # a re-quota mid-run counts from the next window on
        self.schedule.advance()
        self.overhead_seconds += time.perf_counter() - t0

    def on_epoch_end(self, epoch, logs=None):
        """Nothing to do: adjustments run by step, independent of epochs."""

    def on_train_end(self, logs=None):
        """Finish any in-flight gather and remove the hooks."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        self._detach()

    close = on_train_end

    def _detach(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._abort_handle is not None:
            self._abort_handle.remove()
            self._abort_handle = None
        self._weight.value = 1.0
        self._started = False

    # ------------------------------------------------------------ deciding
    def _decide(self, gathered):
        t0 = time.perf_counter()
        step = self.step
        digests = set(gathered[:, _DIGEST].tolist())
        if len(digests) != 1:
            raise RankMismatchError("ranks disagree on the current batch sizes at step %d: "
                                    "omnihvd state diverged (were different checkpoints loaded?)"
                                    % step)
        times = gathered[:, _TIME]
        sizes = [int(b) for b in gathered[:, _SIZE]]
        record = {"step": step + 1, "epoch": self.epoch, "sizes": sizes,
                  "times": [float(t) for t in times],
                  "samples": [int(c) for c in gathered[:, _COUNT]]}
        caps = gathered[:, _CAP].astype(int)
        capped = bool((caps < self.controller.hi).any())
        if capped:  # a rank ran out of memory: every rank lowers its cap the same way
            self.controller.set_bounds(self.controller.lo, self.controller.hi.clip(max=caps))
            record["caps"] = self.controller.hi.tolist()
        lookahead = int(gathered[:, _AHEAD].max())
        decision = self.cadence.decide(step, sizes, times, gathered[:, _ERROR],
                                       gathered[:, _COUNT], lookahead=lookahead)
        if decision.skipped is not None and capped:
            # no usable timing, but the split must respect the new caps now
            forced = self.controller.split(self.schedule.latest)
            decision = self.cadence.propose(step, sizes, forced, lookahead=lookahead)
        if decision.skipped is not None:
            record.update(new_sizes=sizes, changed=False, effective_step=None,
                          skipped=decision.skipped)
        else:
            if decision.changed:
                self.schedule.change(decision.effective_step, decision.new_sizes)
            record.update(new_sizes=decision.new_sizes, changed=decision.changed,
                          effective_step=decision.effective_step)
            if decision.changed and self.rank == 0:
                log.info("omnihvd: step %d: batch sizes %s -> %s from step %d (times %s%s)",
                         step + 1, sizes, decision.new_sizes, decision.effective_step,
                         ", ".join("%.4g" % t for t in times),
                         "; memory caps %s" % self.controller.hi.tolist() if capped else "")
        record["decision_s"] = time.perf_counter() - t0
        self._adjustments += bool(record.get("changed"))
        self.history.append(record)
        if len(self.history) > self.history_size:
            del self.history[0]  # history_size pointers moved: cheap, and memory stays flat

    def report_oom(self, shrink: float = 0.8):
        """Tell omnihvd this rank ran out of memory in the current step.

        Call it from the rank that caught the error (e.g. ``torch.cuda.OutOfMemoryError``
        in forward or backward), then still call ``opt.step()`` and
        ``cb.on_batch_end()`` so that the other ranks' allreduce completes: Horovod
        contributes zeros for the gradients this rank did not finish, so that one step
        uses fewer samples. This rank's cap becomes ``shrink`` times its current size;
        at the next adjustment every rank lowers its copy of the cap and re-splits the
        global batch within the new caps (the dead band does not apply).

        Raises:
            InfeasibleError: the rank is already at ``min_batch_size`` (nothing left
                to shed), on this rank; at the next adjustment on every rank if the
                caps can no longer hold the global batch.
        """
        from .errors import InfeasibleError

        if isinstance(shrink, bool) or not isinstance(shrink, (int, float)) or not 0 < shrink < 1:
            raise ConfigError("shrink must be a number in (0, 1), got %r" % (shrink,))
        size = (self._step_sizes or self.batch_sizes)[self.rank]
        floor = int(self.controller.lo[self.rank])
        if size <= floor:
            raise InfeasibleError("rank %d ran out of memory at batch size %d, already its "
                                  "min_batch_size; lower min_batch_size or the model's memory "
                                  "use" % (self.rank, size))
        cap = min(self._cap, max(floor, int(size * shrink)))
        self._drop_sample = True
        self.oom_events += 1
        if cap == self._cap:
            return  # the lowered cap is not in effect yet; said already
        self._cap = cap
        log.warning("omnihvd: rank %d out of memory at batch size %d; cap lowered to %d, "
                    "applied at the next adjustment", self.rank, size, self._cap)

    @property
    def adjustments(self) -> int:
        """How many decisions changed the sizes so far (also those no longer in history)."""
        return self._adjustments

    @property
    def overhead_per_step(self) -> float:
        """Mean seconds per step spent in the callback's own code."""
        return self.overhead_seconds / max(self.step, 1)

    # --------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict:
        """Batch sizes, time-model history and step, for the user's checkpoint."""
        return {"version": 1, "global_batch_size": self.global_batch_size,
                "num_ranks": self.num_ranks, "step": self.step, "epoch": self.epoch,
                "batch_sizes": self.batch_sizes, "changes": self.schedule.upcoming(),
                "max_batch_size": self.controller.hi.tolist(),
                "controller": self.controller.state_dict()}

    def load_state_dict(self, state: Dict):
        """Restore from :meth:`state_dict`; call on every rank before training resumes.

        On a different number of ranks the global batch is re-split (equally, or by
        ``initial_batch_sizes`` when given) and the measured history is dropped.

        Raises:
            ConfigError: the checkpoint has another global batch size, or is malformed.
        """
        saved = checked_state(state)
        B, step, sizes = saved.global_batch_size, saved.step, saved.batch_sizes
        if B != self.global_batch_size:
            raise ConfigError("checkpoint has global_batch_size %d but this run has %d; resume "
                              "with the same global batch" % (B, self.global_batch_size))
        if self._started:
            raise ConfigError("load_state_dict must be called before on_train_begin")
        self.epoch = saved.epoch
        self.cadence.forget_pending()
        if saved.num_ranks == self.num_ranks:
            if saved.max_batch_size is not None:  # memory caps learned from out-of-memory errors
                self.controller.set_bounds(self.controller.lo,
                                           self.controller.hi.clip(max=saved.max_batch_size))
                self._cap = int(self.controller.hi[self.rank])

            def fit(v):  # the bounds of this run may be narrower than the checkpoint's
                return v if self.controller.valid(v) else self.controller.split(v)
            self.schedule.restore(step, [(step, fit(sizes))] + [
                (s, fit(v)) for s, v in saved.changes if s > step])
            self.controller.load_state_dict(saved.controller)
        else:
            self.schedule.restore(step, [(step, list(self._options["initial_batch_sizes"]))])
            self.controller.forget()
            if self.rank == 0:
                log.info("omnihvd: checkpoint from %d ranks resumed on %d: sizes re-split to %s",
                         saved.num_ranks, self.num_ranks, self.batch_sizes)

    # ---------------------------------------------- Horovod elastic (omnihvd.elastic)
    def _track(self, tracker):
        """Called by :class:`omnihvd.elastic.TorchState`: from now on every entry into
        the ``@hvd.elastic.run`` function re-splits B over the workers present."""
        if self._tracker is not None and self._tracker is not tracker:
            raise ConfigError("this OmniLearnCallback is already tracked by another "
                              "omnihvd.elastic.TorchState; create one state per callback")
        if not isinstance(self._comm, (HorovodComm, LocalComm)):
            raise ConfigError("under Horovod elastic omnihvd gathers through Horovod, whose "
                              "workers change: create the callback without comm=")
        if self._initial_given:
            raise ConfigError("initial_batch_sizes fit one fixed world; under Horovod elastic "
                              "omnihvd splits B from each worker's measured throughput (equally "
                              "at the start): drop initial_batch_sizes")
        for name, values in (("min_batch_size", self._options["min_batch_size"]),
                             ("max_batch_size", self._options["max_batch_size"])):
            if len(set(values)) > 1:
                raise ConfigError("%s %r is a per-rank list, but Horovod elastic changes the "
                                  "ranks: pass one int for every worker" % (name, values))
        self._tracker = tracker
        if self._meter is None:
            self._meter = ThroughputMeter()
            self.worlds: List[Dict] = []   # one record per (re)entry, see omnihvd.elastic

    def _elastic_snapshot(self) -> Dict:
        """What Horovod's state commits: the step, the epoch, the training samplers'
        positions (world-independent: the split is agreed again on entry)."""
        return {"step": self.step, "epoch": self.epoch,
                "samplers": [s.state_dict() for s in self.schedule.samplers if s.train]}

    def _elastic_load(self, snapshot: Dict):
        """Go back to a committed (or rank 0's synced) snapshot; no collective."""
        samplers = [s for s in self.schedule.samplers if s.train]
        if len(samplers) != len(snapshot["samplers"]):
            raise ConfigError("rank %d has %d training samplers, the synced state %d: every "
                              "worker must create the same samplers"
                              % (self.rank, len(samplers), len(snapshot["samplers"])))
        step = snapshot["step"]
        self.schedule.restore(step, [(step, self.schedule.batch_sizes_at(self.step))])
        self.cadence.forget_pending()
        self.epoch = snapshot["epoch"]
        for sampler, state in zip(samplers, snapshot["samplers"]):
            sampler.load_state_dict(state)

    def _leave_world(self):
        """Horovod reset callback (the world changed): local clean-up, no collective,
        since a joining worker would not take part in it."""
        self._pending = None    # a gather of the old world: its handle died with it
        self._step_sizes = None
        self._timer.stop()
        self._timer.discard_extra()
        self._detach()

    def _join_world(self):
        """Agree on the split of B over the workers present: one gather, fixed name."""
        if self._tracker is None:
            raise ConfigError("under Horovod elastic the callback must be tracked by the elastic "
                              "state: state = omnihvd.elastic.TorchState(model, optimizer, "
                              "callback=cb, ...)")
        if self.schedule.handed_out:
            raise ConfigError("the sampler handed out step %d before the world was agreed: call "
                              "cb.on_train_begin() first thing inside the @hvd.elastic.run "
                              "function, before iterating the loader" % self.step)
        import horovod.torch as hvd

        rank, size = hvd.rank(), hvd.size()
        comm = make_comm(None, rank=rank, size=size)
        c = self.controller
        config = (self.global_batch_size, int(c.lo[0]), int(self._options["max_batch_size"][0]),
                  c.size_multiple)
        report = world_report(config, self.step, self._meter.value(), self._cap, worker_label())
        world = agree_on_world(comm.allgather_object(report, name=JOIN_NAME))
        self.rank, self.num_ranks, self._comm = rank, size, comm
        self.controller = c.resized(size, config[1], world.caps)
        self.cadence = Cadence(self.controller, adjust_every=self.cadence.adjust_every,
                               settle_steps=self.cadence.settle_steps, timing=self.cadence.timing)
        self.schedule.rank, self.schedule.num_ranks = rank, size
        self.schedule.restore(world.step, [(world.step, world.batch_sizes)])
        self._options.update(initial_batch_sizes=list(world.batch_sizes),
                             min_batch_size=self.controller.lo.tolist(),
                             max_batch_size=[config[2]] * size)
        self.worlds.append(dict(world._asdict(), size=size, rank=rank))
        if rank == 0:
            log.info("omnihvd: %d workers from step %d (%s): batch sizes %s", size, world.step,
                     ", ".join(world.workers), world.batch_sizes)
