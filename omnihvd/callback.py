"""OmniLearnCallback: the drop-in object that wires timing, gathering, the cadence,
gradient weighting and the size schedule together. It owns no math of its own.

Per step ``s`` (global steps, counted across epochs)::

    on_batch_begin   if s gathers, close the window of the steps before it and post
                     the non-blocking allgather of this rank's payload row, so that
                     it runs beside the step's work; sizes of step s (schedule) ->
                     gradient weight; start the timer
    opt.step()       pre-hook = the wait boundary: the local time ends (the compute
                     stream synchronised on GPUs)
    on_batch_end     complete that gather, decide (every rank the same, from the
                     same data: omnihvd.cadence), schedule the new sizes for the
                     first step no rank's sampler has handed out yet

Where each idea lives:

* the options, their checks and the cross-rank agreement: :mod:`omnihvd.options`
  (the scalar checks every module shares: :mod:`omnihvd.checks`);
* timing (device, data loading, CPU quota, estimator): :mod:`omnihvd.timing`;
* the rhythm (window, settle, when to gather, when a change takes effect):
  :mod:`omnihvd.cadence`; the decision: :mod:`omnihvd.controller`;
* what each rank sends in the gather and how it reads back: :mod:`omnihvd.payload`;
  the gathering itself: :mod:`omnihvd.comm`;
* memory caps after out-of-memory errors: :mod:`omnihvd.caps`;
* the size schedule and what samplers see of it (``batch_size``, ``issue``, ...):
  :mod:`omnihvd.schedule`;
* checkpoint validation and restore: :mod:`omnihvd.checkpoint`;
* gradient weights: :mod:`omnihvd.weighting`; loss normalisers: :mod:`omnihvd.losses`.

The callback's own parts: the framework's side, a backend
(:mod:`omnihvd.backend` for Horovod, :class:`omnihvd.ddp.DDPBackend` its peer);
the batch checks (:mod:`omnihvd.batches`); the wait boundary and the optimizer's
step hooks (:mod:`omnihvd.boundary`); what a gather becomes
(:mod:`omnihvd.decisions`); ``state_dict`` (:mod:`omnihvd.checkpoint`); Horovod
elastic (:mod:`omnihvd.worlds`). This module keeps the hooks, in the order they run.

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
import json
import logging
import os
import sys
import time
import zlib
from typing import Dict, List, Optional

from .alike import size_classes, this_kind
from .arrivals import ARRIVAL_STEPS
from .backend import HorovodBackend
from .batches import BatchChecks, sampler_place, training_sampler_place
from .boundary import StepBoundary
from .cadence import Cadence
from .caps import lowered_cap
from .checkpoint import Checkpointed
from .comm import HorovodComm, PendingGather, agree_on_comm, make_comm
from .controller import DEFAULT_DEADBAND
from .decisions import Decisions
from .errors import ConfigError
from .lags import cpuset_key, host_key
from .losses import checked_count, total_count
from .normalization import batchnorm_layers, check_no_sync_batchnorm
from .options import (check_agreement, configure_everywhere, model_fingerprint, option_values,
                      resolve_options)
from .payload import payload_row
from .schedule import ScheduledSizes, SizeSchedule
from .segments import ComputeSegments
from .timing import DEFAULT_SUMMARY, StepTimer
from .weighting import GradientWeight, allreduce_weight
from .worlds import ElasticWorlds

__all__ = ["OmniLearnCallback"]

log = logging.getLogger("omnihvd")

class OmniLearnCallback(ScheduledSizes, StepBoundary, Checkpointed, ElasticWorlds):
    """OmniLearn dynamic batch sizing for a Horovod PyTorch training loop: the engine
    under :class:`omnihvd.Balancer`, for loops that own their pipeline.

    Args:
        model: the ``torch.nn.Module`` being trained.
        optimizer: the ``hvd.DistributedOptimizer`` wrapping the model's optimizer
            (``op=hvd.Average`` or ``op=hvd.Sum``).
        global_batch_size: B, the samples per step over all ranks; held exactly.
        **options: ``initial_batch_sizes``, ``min_batch_size``, ``max_batch_size``,
            ``deadband``, ``gain``, ``adjust_every`` (default 20), ``policy``,
            ``settle_steps``, ``timing``, ``nonblocking``, ``comm``,
            ``size_multiple``, ``loss_reduction``, ``history_size``,
            ``abort_on_exception``, ``device_sync``, ``cpu_quota``, ``tune_split``,
            ``balance_arrivals``, ``release_lag``, ``arrival_lead``, ``alike_ranks``:
            one line each, with their defaults, in docs/callback.rst ("Options").

    Raises:
        ConfigError: on every rank, when any rank's options are invalid (the message
            names the rank and the fix), or the model uses synchronised batch
            normalisation (see :mod:`omnihvd.normalization`).
        InfeasibleError: valid options whose bounds cannot hold the global batch,
            alike on every rank. ``on_train_begin()`` raises RankMismatchError on
            every rank when the ranks' options, models or resume points differ.

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

    The framework's side -- which optimizer or model it accepts, how gradients get
    their weight, where a rank starts waiting -- is a *backend* given to
    :meth:`_start`: :class:`omnihvd.backend.HorovodBackend` here,
    :class:`omnihvd.ddp.DDPBackend` for :class:`~omnihvd.DDPOmniLearnCallback`.
    """

    def __init__(self, model, optimizer, global_batch_size: int, *,
                 initial_batch_sizes: Optional[List[int]] = None, min_batch_size=1,
                 max_batch_size=None, deadband: float = DEFAULT_DEADBAND, gain: float = 1.0,
                 adjust_every: int = 20, policy: str = "affine", settle_steps: int = 1,
                 timing: str = DEFAULT_SUMMARY, nonblocking: bool = True, comm=None,
                 size_multiple: int = 1, loss_reduction: str = "mean",
                 history_size: int = 1000, abort_on_exception: Optional[bool] = None,
                 device_sync="auto", cpu_quota="auto", tune_split: bool = False,
                 balance_arrivals: bool = False, release_lag: bool = True,
                 arrival_lead: bool = True, alike_ranks: bool = True):
        import horovod.torch as hvd

        if not hvd.is_initialized():
            raise ConfigError("Horovod is not initialised: call hvd.init() before creating "
                              "OmniLearnCallback")
        self._elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        self._initial_given = initial_batch_sizes is not None
        if abort_on_exception is None:
            abort_on_exception = hvd.size() > 1 and not self._elastic
        if hvd.size() > 1 and not self._elastic:   # before make_comm's collective Dup()
            agree_on_comm(comm, hvd.rank(), hvd.size(),
                          lambda obj: HorovodComm().allgather_object(obj, "omnihvd.comm_check"))
        self._start(make_comm(comm, rank=hvd.rank(), size=hvd.size()), HorovodBackend(), model,
                    optimizer, option_values(locals()), abort_on_exception)

    # ------------------------------------------------------------ set-up
    def _start(self, comm, backend, model, optimizer, options: Dict, abort_on_exception: bool):
        """Configure on every rank over ``comm`` (raising on all ranks if any failed),
        then arm the abort path. ``backend``: :class:`omnihvd.backend.HorovodBackend`
        or a peer; ``options``: the keyword options by name."""
        self._comm, self._backend = comm, backend
        self.rank, self.num_ranks = comm.rank, comm.size
        if self._elastic:
            # Horovod elastic: no collective before the @hvd.elastic.run function (a new
            # worker would run it alone); the options are compared on entry instead.
            self._configure(model, optimizer, options)
        else:
            configure_everywhere(comm, lambda: self._configure(model, optimizer, options),
                                 type(self).__name__)
        self._abort_enabled = bool(abort_on_exception)
        self._abort_handle = None
        self._install_abort()

    def _outside_pair(self) -> str:
        """The error of a backward pass outside an on_batch_begin/on_batch_end pair."""
        return ("rank %d: a backward pass ran outside a cb.on_batch_begin() / cb.on_batch_end() "
                "pair (before step %d): its gradients would carry no step's batch-size weight; "
                "call the pair around every batch the loop trains on (around every micro-batch "
                "with backward_passes_per_step)" % (self.rank, self.step))

    @property
    def _gradient_weight(self) -> GradientWeight:
        """The weight this rank's gradients get in the current step (set at on_batch_begin)."""
        return self._weight

    def _configure(self, model, optimizer, options: Dict):
        """Check the model and backend, resolve the options, build the pieces."""
        if not hasattr(model, "named_modules"):
            raise ConfigError("model must be a torch.nn.Module, got %s" % type(model).__name__)
        check_no_sync_batchnorm(model)
        self._average = self._backend.check(model, optimizer, self.rank)
        self._options, self.controller = resolve_options(
            self.num_ranks, batchnorm_layers=batchnorm_layers(model), log_floor=self.rank == 0,
            **options)
        o = self._options
        self.global_batch_size, self.adjust_every = o.global_batch_size, o.adjust_every
        self.nonblocking, self.loss_reduction = o.nonblocking, o.loss_reduction
        self.cadence = self._new_cadence()
        self.schedule = SizeSchedule(self.rank, self.num_ranks, o.global_batch_size,
                                     o.initial_batch_sizes, partial=self._partial_split)
        self._decisions = Decisions(self.rank, o, o.history_size)
        self.history = self._decisions.history   # the last history_size decisions
        self._model, self._optimizer = model, optimizer
        # ranks the user's initial split sets apart are never alike (omnihvd.alike)
        self._size_class = (size_classes(o.initial_batch_sizes, o.size_multiple)[self.rank]
                            if options.get("initial_batch_sizes") is not None else None)
        self._init_state()

    def _init_state(self):
        """The state of a run that has not started: no step, no gather, no hooks."""
        self._timer = StepTimer()
        self._segments = ComputeSegments(self._timer)   # pauses it between the model's passes
        self.ends_at_step = False     # on_batch_end when opt.step() returns (omnihvd.Balancer)
        self._warned_spread = False  # quota_spread is logged once per rank
        self._weight = GradientWeight(1.0)
        self._pending = None          # the posted gather of this step
        self._window_end = None       # the last step whose time that gather carries
        self._step_sizes: Optional[List[int]] = None
        self._hooks = []
        self._batches = BatchChecks(self.schedule, self._timer)
        self._started = False
        self._drop_sample = False
        self._recorded = False        # this step's sample was taken at the wait boundary
        self._update_began = None     # perf_counter at the optimizer update's start
        self._step_depth = 0          # nesting of step() calls (see _on_step_entry)
        self._began = None            # (step, perf_counter) of the last on_batch_begin
        self._begun_step = None       # the step of the last on_batch_begin
        self._updated = False         # opt.step() ran and on_batch_end has not yet
        self._cap = int(self.controller.hi[self.rank])
        self._host = host_key()       # whose ranks share this one's clock (omnihvd.lags)
        self._devices: List[str] = []  # the model's accelerators (omnihvd.alike)
        # this rank's local time of the last timed step (None: none yet, or dropped)
        self.last_step_time: Optional[float] = None
        self.oom_events = 0
        self.epoch = 0
        self.overhead_seconds = 0.0

    def _partial_split(self, sizes, total, step):
        return self._decisions.partial_split(self.controller, sizes, total, step)

    def _new_cadence(self) -> Cadence:
        """The adjustment rhythm around the current controller, from the options."""
        o = self._options
        return Cadence(self.controller, adjust_every=o.adjust_every, settle_steps=o.settle_steps,
                       timing=o.timing, tune_split=o.tune_split, arrivals=o.balance_arrivals,
                       releases=o.release_lag, arrived_at=o.arrival_lead)

    def _install_abort(self):
        if self._abort_enabled and self._abort_handle is None:
            from .faults import install_abort_on_exception

            self._abort_handle = install_abort_on_exception(self.rank)

    def _fingerprint(self) -> Dict:
        """What every rank must agree on: options, backend, model shape, resume point."""
        fp = self._options.agreed()
        fp.update(average=self._average, model=model_fingerprint(self._model),
                  **self._backend.agreed())
        # the whole resume point: ranks restored from different checkpoints would
        # otherwise train on different sizes or samples until the next decision
        fp["resume"] = (self.step, self.batch_sizes, self.schedule.upcoming(),
                        zlib.crc32(json.dumps(self.controller.state_dict(),
                                              sort_keys=True).encode()))
        fp["samplers"] = [sampler_place(s) for s in self.schedule.samplers]
        return fp

    def wrap(self, loader, check: bool = True):
        """``loader`` with each ``next()`` counted as this rank's work.

        Iterate the result instead of the loader (``for x, y in cb.wrap(loader)``):
        the time of each ``next()`` is added to the local time of the step it feeds,
        so a rank with slow storage or few loader workers gets fewer samples. A
        step whose batch was the first of an epoch from a loader with worker
        processes (their start-up) is not timed; nothing between steps that is not
        a ``next()`` is counted; a batch fetched after ``on_batch_begin()`` counts
        once, in the step's own time. Wrap the training loader
        only: a loader on one of this callback's evaluation samplers (``train=False``)
        comes back as it is, since its batches are no training step's work.

        With ``check`` (the default) each batch it yields is checked against the
        step it feeds (:meth:`check_batch`, at that step's ``on_batch_begin``, or
        ``on_batch_end`` if fetched after it; a loop that fetches the next step's
        batch before ``on_batch_end``, once this step's was checked, has it checked
        at the next ``on_batch_begin``): a batch the loop skipped, or a loader
        that does not cut the sampler's sizes, is a ConfigError instead of a silently
        wrong gradient. Pass ``check=False`` for batches whose first tensor's first
        dimension is not the sample count (time-major sequences).

        Raises:
            ConfigError: a DataLoader with ``in_order=False`` (its batches would not
                come in the order of the steps they were cut for).
        """
        return self._batches.wrap(loader, check)

    # --------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None):
        """Register the gradient-weight and timing hooks; check that ranks agree."""
        if self._started:
            return
        t0 = time.perf_counter()
        if self._elastic or self._tracker is not None:
            self._waiting_for_peers(self._join_world)
        self._install_abort()
        check_agreement(self._waiting_for_peers(
            lambda: self._comm.allgather_object(self._fingerprint())))
        self._configure_timer()
        self._hooks = self._backend.install(self) + self._segments.install(self._model)
        self._weight.on_gradient = self._segments.backward_begins
        self._weight.refuse = self._outside_pair   # until the first on_batch_begin
        self._started = True
        if self.rank == 0:
            every = ("every %d steps" % self.adjust_every if self.adjust_every < 2 ** 31
                     else "never (adjust_every=%d)" % self.adjust_every)
            log.info("omnihvd: %d ranks, global batch %d, initial sizes %s, policy %s, adjust %s",
                     self.num_ranks, self.global_batch_size, self.batch_sizes,
                     self.controller.policy, every)
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
        again = self._begun_step == self.step   # begun before, its on_batch_end not come
        # A step begun again (its on_batch_end never came: a break, a NaN guard's
        # continue) keeps the gather its first on_batch_begin posted, with that window;
        # a gather of another step (the step was rewound since) is settled unused.
        if self._pending is not None and self._window_end != self.step - 1:
            self._waiting_for_peers(self._drop_pending)
        self._batches.check_sampler()
        self._backend.begin_step()
        sizes = self.schedule.batch_sizes_at(self.step)
        self._begun_step, self._updated = self.step, False
        if self.cadence.tuner is not None:   # the step period, for tune_split only
            if self._began is not None and self._began[0] == self.step - 1:
                self.cadence.record_period(t0 - self._began[1])  # before a new window opens
            self._began = (self.step, t0)
        if self.nonblocking and self.cadence.gathers_at(self.step) and self._pending is None:
            # The window holds the steps before this one. Posted now, the gather runs
            # beside this step's work and waits only for peers that began this step,
            # as the gradients' allreduce already does; posted after this step's work
            # it would also wait for the slowest rank's work within the step.
            self._post(window_end=self.step - 1)
        self._step_sizes = sizes
        self._batches.begin(batch, sizes)
        self._weight.value = allreduce_weight(sizes[self.rank], sizes, self._average,
                                              self.loss_reduction)
        self._weight.refuse = None
        if not again:   # one slot per step in the window's per-step series
            self.cadence.begin_step(sizes)
        self._drop_sample = self._recorded = False
        self._update_began, self._step_depth = None, 0
        self._segments.new_step()
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
        self._batches.check(batch, self._step_sizes or self.batch_sizes_at(self.step))

    def global_count(self, count) -> float:
        """The sum of ``count`` over every rank, for normalising a summed loss.

        For losses whose normaliser is not the number of samples -- class-weighted
        cross-entropy (sum of the targets' weights), ``ignore_index`` (targets not
        ignored), per-token means (tokens) -- compute each rank's loss with
        ``reduction="sum"`` and divide it by the step's global count; with
        ``loss_reduction="sum"`` the gradient is then exactly that of the loss over
        the global batch. Every rank sums the same gathered values in the same
        order, so all get the same bits.

        It blocks: each call is one allgather of one float per rank, which returns
        only when every rank has made the same call -- a synchronisation point
        inside the step (a fast rank waits for the slowest one's forward pass) and
        one round trip of latency. So every rank must call it the same number of
        times per (micro-)step, at the same point, or the ranks hang. The whole
        call is left out of the step's local time when it runs between
        :meth:`on_batch_begin` and the wait boundary (e.g. before ``backward()``),
        so the balancing still sees each rank's own work.

        Args:
            count: this rank's count (int, float or a one-element tensor), >= 0.

        Returns:
            float: the global count.

        Raises:
            ConfigError: the callback's ``loss_reduction`` is not ``"sum"``; a count
                that is negative or not finite (on this rank, before the gather:
                the other ranks are then stopped by ``abort_on_exception``); a
                global count of 0 (on every rank).

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
        with self._timer.excluding():   # waiting for the others
            gathered = self._comm.allgather([value])
        return total_count(gathered, self.step)

    def _kind(self, cpuset: float) -> float:
        """This rank's resources for ``alike_ranks`` (NaN with it off), on the CPUs
        ``cpuset`` read at this gather: a re-pin or a re-quota shows at once."""
        if not self._options.alike_ranks:
            return float("nan")
        return this_kind(self._timer.cpu_cores, self._devices, self._host, cpuset,
                         self._size_class)

    def _post(self, window_end: int):
        """Close the timing window, whose last step is ``window_end``, and post its
        gather (completed and decided on in this step's ``on_batch_end``)."""
        self._window_end = window_end
        sizes = self.cadence.window_sizes or self.batch_sizes
        cpuset = cpuset_key()   # a re-pin shows at once
        row = payload_row(self.cadence.close(), sizes, self.rank, self.schedule.decision_lookahead,
                          self._cap, self._host, cpuset, self._kind(cpuset),
                          agreed=training_sampler_place(self.schedule),
                          steps=min(ARRIVAL_STEPS, self.adjust_every))   # a window's steps
        if self.nonblocking:
            self._pending = self._comm.iallgather(row)
        else:
            done = self._waiting_for_peers(lambda: self._comm.allgather(row))
            self._pending = PendingGather(lambda: done)

    def on_batch_end(self, batch=None, logs=None):
        """Record the step's local time; complete the gather, decide and schedule when due.

        Raises:
            ConfigError: no ``on_batch_begin()`` for this batch (its gradients did not
                get their batch-size weights).
        """
        if self._begun_step != self.step:
            raise ConfigError(
                "cb.on_batch_end() without cb.on_batch_begin() for this batch (rank %d, step "
                "%d): its gradients did not get their batch-size weights; call "
                "cb.on_batch_begin() before each batch's forward pass" % (self.rank, self.step))
        t0 = time.perf_counter()
        self._batches.end(self._step_sizes)
        self._backend.end_step(self)
        # no wait boundary this step: no opt.step() call (a loop without one, or a step
        # GradScaler skipped)
        self._wait_boundary()
        if not self.nonblocking and self.cadence.gathers_at(self.step):
            self._post(window_end=self.step)  # blocking: after this step's work
        if self._pending is not None:
            pending, self._pending = self._pending, None
            matrix = self._waiting_for_peers(pending.wait)
            self._decisions.decide(matrix, step=self.step, epoch=self.epoch,
                                   window_end=self._window_end, controller=self.controller,
                                   cadence=self.cadence, schedule=self.schedule)
            # a re-quota mid-run counts from the next step on (this step's sample,
            # in the next window, was timed under the quota read before)
            self._refresh_quota()
        self.schedule.advance()
        self._updated = False
        self._weight.refuse = self._outside_pair   # until the next on_batch_begin
        self.overhead_seconds += time.perf_counter() - t0

    def end_step(self):
        """:meth:`on_batch_end` for a step begun and not yet ended, else nothing
        (:class:`omnihvd.Balancer` calls it before each fetch: a loop may run no
        ``opt.step()`` for a batch)."""
        if self._started and self._begun_step == self.step:
            self.on_batch_end()

    def on_epoch_end(self, epoch, logs=None):
        """Nothing to do: adjustments run by step, independent of epochs."""

    def on_train_end(self, logs=None):
        """Finish any in-flight gather and remove the hooks.

        Called while an exception propagates (from a ``finally:`` block or
        ``contextlib.closing(cb)``), it waits for no other rank -- the gather in
        flight may be one the failing rank never posted -- and keeps the
        ``abort_on_exception`` hook, so the exception still ends the whole job with
        this rank named.
        """
        failing = sys.exc_info()[1] is not None
        if failing:
            self._pending = None
        else:
            self._drop_pending()
        self._detach(keep_abort=failing)

    close = on_train_end

    def __enter__(self):
        """``with cb:`` around the training: :meth:`on_train_end` on the way out, as
        from a ``finally:`` block (an exception still ends the whole job).

        >>> # with cb:
        >>> #     for epoch in range(epochs): ...
        """
        return self

    def __exit__(self, exc_type, exc, tb):
        self.on_train_end()   # sys.exc_info() holds the exception leaving the block
        return False

    def _drop_pending(self):
        """Complete an in-flight gather without deciding on it."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def _detach(self, keep_abort: bool = False):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._backend.detach()
        if self._abort_handle is not None and not keep_abort:
            self._abort_handle.remove()
            self._abort_handle = None
        self._weight.value, self._weight.refuse, self._weight.on_gradient = 1.0, None, None
        self._started = False

    def report_oom(self, shrink: float = 0.8):
        """Tell omnihvd this rank ran out of memory in the current step.

        Call it from the rank that caught the error (e.g. ``torch.cuda.OutOfMemoryError``
        in forward or backward), then still call ``opt.step()`` and
        ``cb.on_batch_end()`` so that the other ranks' allreduce completes: Horovod
        contributes zeros for the gradients this rank did not finish, so that one step
        uses fewer samples. This rank's cap becomes ``shrink`` times its current size;
        at the next adjustment posted after this call (its gather is posted in
        ``on_batch_begin``) every rank lowers its copy of the cap and re-splits the
        global batch within the new caps (the dead band does not apply; see
        :mod:`omnihvd.caps`).

        Raises:
            ConfigError: ``shrink`` is not a number in (0, 1).
            InfeasibleError: the rank is already at ``min_batch_size`` (nothing left
                to shed), on this rank; at the next adjustment on every rank if the
                caps can no longer hold the global batch.
        """
        size = (self._step_sizes or self.batch_sizes)[self.rank]
        cap = lowered_cap(size, int(self.controller.lo[self.rank]), self._cap, shrink, self.rank)
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
        return self._decisions.adjustments

    def _waiting_for_peers(self, wait):
        """``wait()``'s result; the time it takes is left out of ``overhead_seconds``
        (the hook that calls it adds its whole span)."""
        t0 = time.perf_counter()
        try:
            return wait()
        finally:
            self.overhead_seconds -= time.perf_counter() - t0

    @property
    def overhead_per_step(self) -> float:
        """Mean seconds per step spent in the callback's own code since training began
        (its gathers' waits for the other ranks left out)."""
        return self.overhead_seconds / max(self.step, 1)
