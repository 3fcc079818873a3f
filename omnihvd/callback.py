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

This module keeps the hooks, in the order they run, and the seams another backend
plugs into (:mod:`omnihvd.ddp`).

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
import math
import os
import sys
import time
import zlib
from typing import Dict, List, Optional

from .alike import size_classes, this_kind
from .arrivals import ARRIVAL_STEPS
from .cadence import Cadence
from .caps import lowered_cap, tighten_caps
from .checkpoint import checked_state, restore
from .checks import check_flag
from .comm import HorovodComm, LocalComm, PendingGather, agree_on_comm, make_comm
from .controller import DEFAULT_DEADBAND, partial_split
from .cpuquota import SPREAD_FIX, cpu_quota_cores, quota_spread, usable_cpus
from .errors import ConfigError
from .internals import clear_synchronized_flag, horovod_reduced, synchronized_flag
from .lags import cpuset_key, host_key
from .losses import check_batch_length, checked_count, total_count
from .membership import JOIN_NAME, ThroughputMeter, agree_on_world, world_report, worker_label
from .normalization import batchnorm_layers, check_no_sync_batchnorm
from .options import (check_agreement, configure_everywhere, model_fingerprint, option_values,
                      resolve_options)
from .payload import payload_row, read_gathered
from .schedule import ScheduledSizes, SizeSchedule
from .segments import ComputeSegments
from .timing import DEFAULT_SUMMARY, StepTimer, TimedIterable
from .weighting import (GradientWeight, _optimizer_op, allreduce_weight, register_gradient_weight,
                        weighted_parameters)

__all__ = ["OmniLearnCallback"]

log = logging.getLogger("omnihvd")

# Horovod's backward passes per step while omnihvd balances a loop that accumulates
# (backward_passes_per_step > 1): each rank runs as many passes as its share needs,
# so none reaches the count and every gradient is allreduced once, in synchronize().
ALL_AT_SYNCHRONIZE = 2 ** 31 - 1


def _sampler_place(sampler) -> tuple:
    """What every rank's sampler must share: its settings, epoch and position."""
    return (sampler.num_samples, sampler.seed, sampler.shuffle, sampler.drop_last,
            sampler.epoch, sampler.position())


class OmniLearnCallback(ScheduledSizes):
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
            (default 0.01; the noise gate, not the dead band, keeps noise from moving
            the split: see :data:`omnihvd.controller.DEFAULT_DEADBAND`).
        gain: controller gain K, in (0, 2) (default 1.0).
        adjust_every: steps between adjustments (default 20). A window holds the
            ``adjust_every`` steps before the step that gathers, so the first one
            ``adjust_every - 1``; a change is decided on again at the first gather
            whose window holds a step at the new sizes past ``settle_steps`` (at least
            ``settle_steps + 2`` plus the loader's look-ahead to decide at every
            gather after a change).
        policy: ``"affine"`` (default; time model a + c*b) or ``"proportional"``
            (the paper's controller).
        settle_steps: steps not timed after each size change (default 1).
        timing: window summary: ``"sustained"`` (default; the mean with rare pauses
            clipped, robust to bursty CPU), ``"median"`` or ``"mean"``
            (docs/timing.rst).
        nonblocking: post the allgather at the start of the step that gathers, so
            that it runs beside the step's work and gradient synchronisation and
            waits for no slower rank's work (default True; the window is then the
            ``adjust_every`` steps before it); False posts it in ``on_batch_end``,
            after the step's work, and waits there.
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
            A rank whose quota may run on more CPUs than it can fill logs a warning
            once (:func:`omnihvd.cpuquota.quota_spread`).
        tune_split: also tune the split by the measured step period, the wall time
            every rank sees (default False). The controller equalises local times;
            where ranks share cores, the work around the allreduce on those cores
            is in no rank's local time and a split that favours the other ranks is
            faster. With this on, once the controller holds its split, omnihvd
            times windows at splits tilted either way and keeps the faster side
            (:mod:`omnihvd.tuning`); each probe costs a window at a slightly
            different split. ``cb.history`` records the tilt.
        balance_arrivals: also split for the slowest arrival of each step, not
            only for equal mean local times (default False; experimental). A step
            waits for its last rank, and a rank whose time varies from step to step
            (a shared core, a CPU quota) arrives last more often than its mean says:
            with this on, every window's per-step local times are gathered too (32
            more floats per rank) and such ranks get a little less, steady ones a
            little more (:mod:`omnihvd.arrivals`). Steady ranks, or ranks all alike
            noisy, keep the split of equal means (measured:
            docs/real-heterogeneity.rst).
        release_lag: also charge each rank its *release lag* (default True): how
            much later than the ranks on other CPUs of its machine its gradients'
            synchronize returns. Ranks that share a core resume one after another,
            a delay in no local time; each window's release times
            (``time.perf_counter``, one clock per machine) are gathered too (32
            more floats per rank) and the controller balances local time plus lag:
            the ranks' arrivals (:mod:`omnihvd.lags`). Ranks on the same CPUs are
            charged their group's mean; ranks that all share their CPUs, or each
            have their own, about nothing; ranks under CPU quotas alike
            (measured: docs/real-heterogeneity.rst, "Release lag").
        arrival_lead: also search how long after the others the rank with the
            most samples should arrive (default True). Balanced means leave it
            arriving last less often than its share of the batch where the others'
            times vary (shared cores, CPU quotas), and the step is shortest where
            it arrives last in that share of the steps. Each window's arrival
            moments are gathered too (32 more floats per rank) and that rank's
            *lead* moves by up to a twentieth of its local time per window until it
            does (:mod:`omnihvd.lead`); ``cb.history`` records the lead. Only a rank
            holding 1.5 times the samples of every other is led; ranks on several
            machines keep a lead of 0. False: balanced means.
        alike_ranks: hold ranks on alike resources at equal sizes (default True):
            ranks on one machine with the same CPUs, CPU quota and kind of
            accelerator get the same batch size while their measured times agree
            (a rank more than 20% apart in two windows in a row, or 5% on average
            over its last windows, is balanced on its own from then on). Ranks sharing
            a core take about the same time however they divide it, so the time
            model cannot tell their sizes apart and would leave them anywhere
            (:mod:`omnihvd.alike`); ``cb.history`` records the groups. Ranks that
            ``initial_batch_sizes`` sets apart (by
            more than one ``size_multiple``) are never alike. False: every rank is
            balanced on its own from the first decision.

    Raises:
        ConfigError: on every rank, when any rank's options are invalid (the message
            names the rank and the fix), or the model uses synchronised batch
            normalisation (see :mod:`omnihvd.normalization`).
        InfeasibleError: valid options whose bounds cannot hold the global batch,
            alike on every rank (when they differ, the ConfigError above names the
            rank). ``on_train_begin()`` raises RankMismatchError on every rank when
            the ranks' options, models or resume points differ.

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

    Subclass interface (how :class:`omnihvd.ddp.DDPOmniLearnCallback` plugs in
    another backend; the configuration, schedule, decisions and checkpoints stay
    here): the constructor calls :meth:`_start` with its communicator; a subclass
    overrides :meth:`_check_backend` (what it accepts as model and optimizer) and
    :meth:`_install_hooks` (how gradients get their weight and where the local time
    ends), and may read ``_model``, ``_optimizer``, :attr:`_gradient_weight` and
    :meth:`_timing_open`, and call :meth:`mark_compute_end` and
    :meth:`_discard_step_time`. Everything else underscored is private.
    """

    # Horovod elastic (omnihvd.elastic): off unless horovodrun runs an elastic job and
    # an omnihvd.elastic.TorchState tracks the callback.
    _elastic = False         # HOROVOD_ELASTIC=1: no collective may run before entry
    _tracker = None          # the omnihvd.elastic.TorchState committing this callback
    _meter: Optional[ThroughputMeter] = None   # this worker's samples/s, for a re-split
    _initial_given = False   # the user chose initial_batch_sizes (they fit one world only)

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
        self._start(make_comm(comm, rank=hvd.rank(), size=hvd.size()), model, optimizer,
                    option_values(locals()), abort_on_exception)

    # ------------------------------------------------------- subclass seams
    def _start(self, comm, model, optimizer, options: Dict, abort_on_exception: bool):
        """Configure on every rank over ``comm`` (raising on all ranks if any failed),
        then arm the abort path. ``options``: the keyword options by name."""
        self._comm = comm
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
        weights = register_gradient_weight(
            weighted_parameters(self._model, self._optimizer), self._weight, exclusive=True)
        hooks = [weights, *self._step_hooks(), *self._accumulate_per_rank()]
        self._weights = weights
        self._refuse_unreduced([p for g in self._optimizer.param_groups for p in g["params"]])
        if weights.frozen:   # gradual unfreezing: weighted before their first backward pass
            hooks.append(self._model.register_forward_pre_hook(
                lambda module, args: self._weigh_unfrozen()))
        return hooks

    def _step_hooks(self) -> list:
        """The optimizer's step hooks: the wait boundary, and the step's end."""
        return [self._optimizer.register_step_pre_hook(self._on_step_entry),
                self._optimizer.register_step_post_hook(self._on_step_exit)]

    def _accumulate_per_rank(self) -> list:
        """Let each rank run its own number of backward passes per step.

        Horovod allreduces a gradient after exactly ``backward_passes_per_step``
        passes; a loop that cuts its share into sub-batches of a fixed size runs
        more passes on a rank with a larger share. While omnihvd is attached every
        gradient is therefore allreduced in ``synchronize()`` (public
        ``set_backward_passes_per_step``), once per step, whatever the passes.
        Returns a handle that gives the optimizer its own count back."""
        passes = self._backward_passes
        if passes <= 1 or not hasattr(self._optimizer, "set_backward_passes_per_step"):
            return []
        self._optimizer.set_backward_passes_per_step(ALL_AT_SYNCHRONIZE)
        restore = self._optimizer.set_backward_passes_per_step

        class _Restore:
            def remove(self):
                restore(passes)
        return [_Restore()]

    def _weigh_unfrozen(self):
        """Weight the parameters unfrozen since the last look (at ``on_batch_begin`` and
        before each forward pass of the model: a loop may call a method of the model
        rather than the model itself)."""
        if self._weights is not None and self._weights.frozen:
            self._refuse_unreduced(self._weights.hook_unfrozen())

    def _refuse_unreduced(self, parameters):
        """Refuse trainable parameters of the optimizer that Horovod does not allreduce
        (frozen when the DistributedOptimizer was created): the optimizer would update
        them with this rank's gradient alone and the replicas would drift apart."""
        hooked = horovod_reduced(self._optimizer)
        if not parameters or not hooked:
            return   # not Horovod's optimizer, or one rank: Horovod hooks nothing then
        updated = {id(q) for g in self._optimizer.param_groups for q in g["params"]}
        missing = [p for p in parameters
                   if p.requires_grad and id(p) in updated and p not in hooked]
        if missing:
            raise ConfigError(
                "rank %d: parameter(s) %s were frozen (requires_grad=False) when "
                "hvd.DistributedOptimizer was created, so Horovod never allreduces their "
                "gradients: trained now, each rank would update them with its own gradient "
                "and the replicas would drift apart. Create the DistributedOptimizer with "
                "every parameter you will train trainable (freeze them after creating it), "
                "or create a new one after unfreezing" % (self.rank, self._names(missing)))

    def _names(self, parameters) -> str:
        """The model's names for ``parameters`` (their shapes where they have none)."""
        names = {id(p): n for n, p in self._model.named_parameters()}
        return ", ".join(names.get(id(p), "of shape %s" % (tuple(p.shape),))
                         for p in parameters)

    def _check_weighted(self):
        """At the wait boundary: a parameter unfrozen within the step (after
        ``on_batch_begin``) and trained with no forward pass of the model to weight it
        has had its gradient allreduced unweighted -- a wrong gradient, refused."""
        if self._weights is None or not self._weights.frozen:
            return
        unweighted = self._weights.unweighted_gradients()
        if unweighted:
            raise ConfigError(
                "rank %d: parameter(s) %s became trainable after cb.on_batch_begin() of step "
                "%d and got gradients with no forward pass of the model (model(x)) between: "
                "their gradients carry no batch-size weight. Unfreeze parameters between "
                "steps (before on_batch_begin)" % (self.rank, self._names(unweighted),
                                                   self.step))

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

    def _timing_open(self) -> bool:
        """Whether the current step's local time is still running (no wait boundary yet)."""
        return self._timer.running

    def _discard_step_time(self):
        """Do not use the current step's local time (it holds no clean boundary)."""
        self._drop_sample = True

    # ------------------------------------------------------------ set-up
    def _configure(self, model, optimizer, options: Dict):
        """Check the model and backend, resolve the options, build the pieces."""
        if not hasattr(model, "named_modules"):
            raise ConfigError("model must be a torch.nn.Module, got %s" % type(model).__name__)
        check_no_sync_batchnorm(model)
        self._average = self._check_backend(model, optimizer)
        self._options, self.controller = resolve_options(
            self.num_ranks, batchnorm_layers=batchnorm_layers(model), log_floor=self.rank == 0,
            **options)
        o = self._options
        self.global_batch_size, self.adjust_every = o.global_batch_size, o.adjust_every
        self.nonblocking, self.loss_reduction = o.nonblocking, o.loss_reduction
        self.history_size = o.history_size
        self.cadence = self._new_cadence()
        self.schedule = SizeSchedule(self.rank, self.num_ranks, o.global_batch_size,
                                     o.initial_batch_sizes, partial=self._partial_split)
        self._model, self._optimizer = model, optimizer
        # ranks the user's initial split sets apart are never alike (omnihvd.alike)
        self._size_class = (size_classes(o.initial_batch_sizes, o.size_multiple)[self.rank]
                            if options.get("initial_batch_sizes") is not None else None)
        self._backward_passes = getattr(optimizer, "backward_passes_per_step", 1)
        # None: this optimizer does not expose Horovod's private flag, so an explicit
        # synchronize() before step() cannot be detected (warned at on_train_begin).
        self._sync_detectable = (not hasattr(optimizer, "synchronize")
                                 or synchronized_flag(optimizer) is not None)
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
        self._weights = None          # the gradient weights' handle (its frozen parameters)
        self._unchecked = None        # the batch cb.wrap last yielded, not yet checked
        self._batch_checked = False   # this step's batch was checked (begin or end)
        self._ahead = False           # _unchecked was fetched for the next step
        self._warned_unchecked = False
        self._started = False
        self._drop_sample = False
        self._recorded = False        # this step's sample was taken at the wait boundary
        self._update_began = None     # perf_counter at the optimizer update's start
        self._step_depth = 0          # nesting of step() calls (see _on_step_entry)
        self._began = None            # (step, perf_counter) of the last on_batch_begin
        self._begun_step = None       # the step of the last on_batch_begin
        self._updated = False         # opt.step() ran and on_batch_end has not yet
        self._warned_sync = False
        self._cap = int(self.controller.hi[self.rank])
        self._caps_before = []       # (from step, the memory caps until then)
        self._host = host_key()       # whose ranks share this one's clock (omnihvd.lags)
        self._devices: List[str] = []  # the model's accelerators (omnihvd.alike)
        # this rank's local time of the last timed step (None: none yet, or dropped)
        self.last_step_time: Optional[float] = None
        self.oom_events = 0
        self.epoch = 0
        self.history: List[Dict] = []   # the last history_size decisions
        self._adjustments = 0
        self.overhead_seconds = 0.0

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
        fp.update(average=self._average, backward_passes_per_step=self._backward_passes,
                  model=model_fingerprint(self._model))
        # the whole resume point: ranks restored from different checkpoints would
        # otherwise train on different sizes or samples until the next decision
        fp["resume"] = (self.step, self.batch_sizes, self.schedule.upcoming(),
                        zlib.crc32(json.dumps(self.controller.state_dict(),
                                              sort_keys=True).encode()))
        fp["samplers"] = [_sampler_place(s) for s in self.schedule.samplers]
        return fp

    def _training_sampler_place(self) -> tuple:
        """The training sampler's settings and place, which every rank's must match at
        each gather (one created, loaded or set to an epoch differently on some rank
        after on_train_begin would repeat samples, or end the epochs apart)."""
        return tuple(_sampler_place(s) for s in self.schedule.samplers
                     if getattr(s, "train", False))

    def _configure_timer(self):
        """Device sync and CPU quota for the timer (the model may have moved to its
        device after the callback was built, so this runs at on_train_begin)."""
        option = self._options.device_sync
        if option == "auto":
            from .device import device_synchronizer

            option = device_synchronizer(self._model)
        self._timer.device_sync = option
        if self._options.alike_ranks:
            from .device import device_names

            self._devices = device_names(self._model)
        self._refresh_quota()

    def _refresh_quota(self):
        option = self._options.cpu_quota
        self._timer.cpu_cores = cpu_quota_cores() if option == "auto" else option
        spread = quota_spread(self._timer.cpu_cores, usable_cpus())
        if option == "auto" and spread and not self._warned_spread:
            self._warned_spread = True
            log.warning("omnihvd: rank %d: %s; %s", self.rank, spread, SPREAD_FIX)

    def _partial_split(self, sizes, total, step):
        # the bounds in force at ``step``: memory caps lowered at a decision hold from
        # its effective step, as its sizes do, so that a rank whose loader cut this
        # step before the decision and one that cuts it after agree
        c = self.controller
        hi = next((before for first, before in self._caps_before if step < first), c.hi)
        return partial_split(sizes, total, c.lo, hi, c.size_multiple)

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
        check_flag("check", check)
        if getattr(loader, "num_workers", 0) and getattr(loader, "in_order", True) is False:
            raise ConfigError("DataLoader(in_order=False) yields batches as its workers finish "
                              "them, not in the sampler's order: a step could train another "
                              "step's batch, weighted with that step's sizes; omnihvd's sampler "
                              "needs in_order=True (the default)")
        sampler = getattr(loader, "batch_sampler", None)
        if sampler in self.schedule.samplers and not sampler.train:
            return loader
        return TimedIterable(loader, self._timer.add, restart=self._wrapped_restart,
                             seen=self._fetched if check else None,
                             ended=self._wrapped_ended if check else None)

    def _fetched(self, batch):
        """``cb.wrap`` yielded ``batch``: check it at the next hook."""
        self._no_lost_batch("fetched another one")
        self._unchecked = batch

    def _wrapped_restart(self):
        """A new pass over the wrapped loader: a batch fetched ahead by a pass left
        early (``break``) is void, as are its charges."""
        self._unchecked, self._ahead = None, False
        self._timer.discard_extra()

    def _wrapped_ended(self):
        self._no_lost_batch("reached the loader's end")

    def _no_lost_batch(self, then):
        # A batch fetched after this step's (checked) batch must be the next step's,
        # fetched ahead; another fetch, or the loader's end, before that step began
        # means the loop trained it in place of its own batch, or skipped it.
        if self._unchecked is not None and self._ahead:
            raise ConfigError(
                "rank %d fetched a batch from cb.wrap(loader) after on_batch_begin() of step "
                "%d and then %s before the next on_batch_begin(): that batch was trained in "
                "place of the step's own (with its weights) or skipped; fetch each batch "
                "once, for the step that trains it" % (self.rank, self.step - 1, then))

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
        self._hooks = self._install_hooks() + self._segments.install(self._model)
        self._weight.on_gradient = self._segments.backward_begins
        self._weight.refuse = self._outside_pair   # until the first on_batch_begin
        self._started = True
        if not self._sync_detectable and not self._warned_sync:
            self._warned_sync = True
            log.warning("omnihvd: rank %d: the optimizer has no Horovod _synchronized flag, so "
                        "omnihvd cannot detect an explicit opt.synchronize() before opt.step(); "
                        "if the loop calls it, call cb.mark_compute_end() just before, or step "
                        "times include waiting for other ranks", self.rank)
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
        self._check_training_sampler()
        self._weigh_unfrozen()
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
        if batch is None or isinstance(batch, int):   # cb.wrap's batch for this step, if any
            batch = self._unchecked
        self._unchecked = None
        self._ahead = False
        self._batch_checked = batch is not None and not isinstance(batch, int)
        if self._batch_checked:
            self.check_batch(batch)
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

    def _warn_unchecked(self):
        self._warned_unchecked = True
        log.warning("omnihvd: rank %d: no HeterogeneousBatchSampler feeds this callback and the "
                    "batches are not checked: the loop must cut each batch at cb.batch_size "
                    "(cb.batch_sizes_at(cb.step) in an epoch's partial step), or the gradient "
                    "is weighted wrongly -- a DataLoader with batch_size= and a "
                    "DistributedSampler keeps equal sizes. Use the sampler, or pass "
                    "on_batch_begin(batch=...) or iterate cb.wrap(loader) to have each batch "
                    "checked", self.rank)

    def _check_training_sampler(self):
        """The training sampler must hand out the steps the loop runs: by this step's
        start it has handed out the previous one at least (the current one too unless
        the loop fetches after ``on_batch_begin``).

        Raises:
            ConfigError: the loop runs on another loader's batches (a validation
                sampler created first drives the schedule, and the training one, read
                only, hands out sizes that prefetching makes stale: wrong weights).
        """
        if self.schedule.driven and self.schedule.issued_upto < self.step - 1:
            raise ConfigError(
                "step %d runs on batches the training sampler did not hand out (it handed out "
                "steps up to %d): the training sampler is the HeterogeneousBatchSampler created "
                "with train=True, by default the first one created on this callback; create "
                "validation samplers after it, or with train=False; create the training sampler "
                "once (sampler.set_epoch(epoch) each epoch), not once per epoch"
                % (self.step, self.schedule.issued_upto))

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

    def mark_compute_end(self):
        """Mark where this rank starts waiting for the others, when that is not ``step()``.

        Call it just before an explicit ``opt.synchronize()`` (e.g. for gradient
        clipping with ``opt.skip_synchronize()``); otherwise omnihvd times up to the
        entry of ``opt.step()`` by itself. Called after ``opt.synchronize()``, the
        step's time includes the wait and is dropped, with one warning (so is an
        unmarked step whose ``step()`` ``GradScaler`` skipped).
        """
        self._wait_boundary()

    def working(self):
        """``with cb.working():`` counts what runs inside as this rank's work, also
        between the model's passes, where omnihvd leaves time out (it is where a
        loop waits in collectives of its own): work no hook of the model sees, such
        as an emulated slower device's sleep (:mod:`omnihvd.tools.emulate`)."""
        return self._timer.working()

    def _on_step_entry(self, optimizer, args, kwargs):
        # Horovod's step() enters this hook before synchronize(): the first level is
        # the wait boundary. It then calls the base optimizer's step(), which enters it
        # again one level deeper (and deeper still for each subclass that calls
        # super().step()): the second level starts the update, this rank's own work
        # (dearer on a slow or shared CPU), timed to its exit and charged to the next
        # step like data loading.
        self._step_depth += 1
        if self._step_depth == 2 and self._recorded and not self._timer.running:
            self._update_began = time.perf_counter()
            self._released(self._update_began)
            return
        self._wait_boundary()

    def _drop_if_synchronized(self):
        """Drop the running step's time if ``synchronize()`` already ran before its
        wait boundary: the time then includes waiting for the other ranks."""
        if self._timer.marked or self._timer.paused or not synchronized_flag(self._optimizer):
            return   # paused: the synchronize() came after the model's last pass, unseen
        self._drop_sample = True
        if not self._warned_sync:
            self._warned_sync = True
            log.warning("omnihvd: rank %d: opt.synchronize() ran before omnihvd's wait boundary "
                        "(opt.step() or cb.mark_compute_end()), so step times include waiting "
                        "and are dropped; call cb.mark_compute_end() just before "
                        "opt.synchronize() to let omnihvd balance", self.rank)

    def _on_step_exit(self, optimizer, args, kwargs):
        if self._step_depth == 2 and self._update_began is not None:
            self._timer.add(time.perf_counter() - self._update_began)
            self._update_began = None
        self._step_depth = max(0, self._step_depth - 1)
        if self._step_depth == 0 and self._begun_step == self.step:
            self._updated = True   # the model moved; on_batch_end has not counted the step
            if self.ends_at_step:
                self.on_batch_end()

    def _wait_boundary(self):
        """The step's own work is done; next this rank waits for its peers: stop the
        timer and offer the step's time to the window (dropped if it holds a
        synchronize()). Later calls in the same step (Horovod's step() re-enters the
        hook; on_batch_end) do nothing."""
        if not self._timer.running:
            return
        self._drop_if_synchronized()
        self._timer.mark_wait()
        self._check_weighted()   # after the mark: omnihvd's own check is no step's work
        self._record()
        self._timer.stop()

    def _released(self, now: float):
        """The gradients' synchronize returned at ``now`` (``time.perf_counter()``):
        offer it as this step's release time (:mod:`omnihvd.lags`), once, if the step
        had a clean wait boundary (its local time was recorded there)."""
        if self._recorded and not self._drop_sample:
            self.cadence.record_release(now)

    def _record(self):
        if not self._recorded:
            self._recorded = True
            local = self._timer.local()
            if local is None or not math.isfinite(local):   # work of unknown cost in it
                self._drop_sample = True
            self.last_step_time = None if self._drop_sample else local
            if self.last_step_time is not None:
                self.cadence.record(local)
                self.cadence.record_arrived(self._timer.wait_began)
                if self._meter is not None:
                    self._meter.observe(self._step_sizes[self.rank], local)

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
                          agreed=self._training_sampler_place(),
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
        if self._unchecked is not None and not self._batch_checked:
            # cb.wrap yielded this step's batch after on_batch_begin
            batch, self._unchecked = self._unchecked, None
            self._batch_checked = True
            self.check_batch(batch)
        elif self._unchecked is not None:
            # with this step's batch checked, it is the next step's, fetched ahead
            # (checked then; _no_lost_batch if it never gets there)
            self._ahead = True
        if not self._batch_checked and not self.schedule.driven and not self._warned_unchecked:
            self._warn_unchecked()
        # no wait boundary this step: no opt.step() call (a loop without one, or a step
        # GradScaler skipped)
        self._wait_boundary()
        # a step GradScaler skipped left Horovod's flag set; step() would have cleared
        # it, and the next step must not read it as its own synchronize()
        clear_synchronized_flag(self._optimizer)
        if not self.nonblocking and self.cadence.gathers_at(self.step):
            self._post(window_end=self.step)  # blocking: after this step's work
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._decide(self._waiting_for_peers(pending.wait))
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
        self._hooks, self._weights = [], None
        if self._abort_handle is not None and not keep_abort:
            self._abort_handle.remove()
            self._abort_handle = None
        self._weight.value, self._weight.refuse, self._weight.on_gradient = 1.0, None, None
        self._started = False

    # ------------------------------------------------------------ deciding
    def _decide(self, matrix):
        """Decide from the gathered matrix (every rank alike) and schedule the result."""
        t0 = time.perf_counter()
        got = read_gathered(matrix, self.step)
        record = {"step": self.step + 1, "epoch": self.epoch, "sizes": got.sizes,
                  "times": [float(t) for t in got.times],
                  "samples": [int(c) for c in got.counts]}
        caps_before = self.controller.hi.copy()
        capped = tighten_caps(self.controller, got.caps)  # a rank ran out of memory
        if capped:
            record["caps"] = self.controller.hi.tolist()
            # where the decision's sizes would start: beyond every rank's look-ahead
            self._caps_before.append((self.step + 1 + max(got.lookahead, 0), caps_before))
        decision = self._decision(got, capped)
        if self._options.release_lag:
            record["lag_charges"] = [float(v) for v in self.controller.lag_charges()]
        if self._options.arrival_lead:
            record["arrival_lead"] = self.controller.arrival_lead()
        if self._options.alike_ranks:
            record["alike"] = self.controller.alike_groups()
        # skipped or held: the split held from now on (not a partial step's sizes)
        record.update(new_sizes=decision.new_sizes or self.schedule.latest,
                      changed=decision.changed,
                      effective_step=decision.effective_step)
        if decision.skipped is not None:
            record["skipped"] = decision.skipped
        elif decision.changed:
            self.schedule.change(decision.effective_step, decision.new_sizes)
            self._log_change(got, decision, capped)
        tuner = self.cadence.tuner
        if tuner is not None:
            before = self.history[-1].get("tilt", 0.0) if self.history else 0.0
            if self.rank == 0 and tuner.tilt != before:
                log.info("omnihvd: step %d: split tilt %+.2f -> %+.2f (step periods %s s)",
                         self.step + 1, before, tuner.tilt,
                         ", ".join("%.4g" % p for p in got.periods))
            record.update(tilt=tuner.tilt, periods=[float(p) for p in got.periods])
        record["decision_s"] = time.perf_counter() - t0
        self._adjustments += decision.changed
        self.history.append(record)
        if len(self.history) > self.history_size:
            del self.history[0]  # history_size pointers moved: cheap, and memory stays flat

    def _decision(self, got, capped):
        """The cadence's verdict; with new caps a re-split even when timing is unusable."""
        decision = self.cadence.decide_gathered(self.step, got, measured_upto=self._window_end)
        if decision.skipped is not None and capped:
            # no usable timing, but the split must respect the new caps now
            forced = self.controller.split(self.schedule.latest)
            decision = self.cadence.propose(self.step, got.sizes, forced,
                                            lookahead=got.lookahead)
        return decision

    def _log_change(self, got, decision, capped):
        if self.rank == 0:
            charges, lead = self.controller.lag_charges(), self.controller.arrival_lead()
            alike = self.controller.alike_groups()
            log.info("omnihvd: step %d: batch sizes %s -> %s from step %d (times %s%s%s%s%s)",
                     self.step + 1, got.sizes, decision.new_sizes, decision.effective_step,
                     ", ".join("%.4g" % t for t in got.times),
                     "; release lags +%s" % ", ".join("%.4g" % c for c in charges) if charges.any()
                     else "", "; arrival lead %.4g" % lead if lead else "",
                     "; alike ranks %s" % " ".join(",".join(map(str, g)) for g in alike)
                     if alike else "",
                     "; memory caps %s" % self.controller.hi.tolist() if capped else "")

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
        return self._adjustments

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

    # --------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict:
        """Batch sizes, time-model history and step, for the user's checkpoint: take it
        after ``on_batch_end()`` (or between epochs).

        Raises:
            ConfigError: called between ``opt.step()`` and ``on_batch_end()``: the
                model holds the step's update but the step is not counted yet, so a
                resume would run it again.
        """
        if self._updated:
            raise ConfigError("state_dict() between opt.step() and cb.on_batch_end() (step %d): "
                              "the model has this step's update but the step is not counted, "
                              "so a resume would repeat it; checkpoint after cb.on_batch_end()"
                              % self.step)
        return {"version": 1, "global_batch_size": self.global_batch_size,
                "num_ranks": self.num_ranks, "step": self.step, "epoch": self.epoch,
                "batch_sizes": self.batch_sizes, "changes": self.schedule.upcoming(),
                "max_batch_size": self.controller.hi.tolist(),
                "controller": self.controller.state_dict(),
                **({} if self.cadence.tuner is None else
                   {"tuning": self.cadence.tuner.state_dict()})}

    def load_state_dict(self, state: Dict):
        """Restore from :meth:`state_dict`; call on every rank before training resumes.

        On a different number of ranks the global batch is re-split (equally, or by
        ``initial_batch_sizes`` when given) and the measured history is dropped.

        Raises:
            ConfigError: the checkpoint has another global batch size, or is malformed.
        """
        saved = checked_state(state)
        if saved.global_batch_size != self.global_batch_size:
            raise ConfigError("checkpoint has global_batch_size %d but this run has %d; resume "
                              "with the same global batch"
                              % (saved.global_batch_size, self.global_batch_size))
        if self._started:
            raise ConfigError("load_state_dict must be called before on_train_begin")
        self.epoch = saved.epoch
        self.cadence.forget_pending()
        same = restore(saved, self.controller, self.schedule, self._options.initial_batch_sizes)
        if same and self.cadence.tuner is not None and state.get("tuning") is not None:
            self.cadence.tuner.load_state_dict(state["tuning"])
        self._cap = min(self._cap, int(self.controller.hi[self.rank]))
        self._caps_before = []
        if not same and self.rank == 0:
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
        for name, values in (("min_batch_size", self._options.min_batch_size),
                             ("max_batch_size", self._options.max_batch_size)):
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
        config = (self.global_batch_size, int(c.lo[0]), int(self._options.max_batch_size[0]),
                  c.size_multiple)
        report = world_report(config, self.step, self._meter.value(), self._cap, worker_label())
        world = agree_on_world(comm.allgather_object(report, name=JOIN_NAME))
        self.rank, self.num_ranks, self._comm = rank, size, comm
        self.controller = c.resized(size, config[1], world.caps)
        self.cadence = self._new_cadence()
        self.schedule.rank, self.schedule.num_ranks = rank, size
        self.schedule.restore(world.step, [(world.step, world.batch_sizes)])
        self._caps_before = []   # the new world's caps hold from here
        self._options = self._options._replace(
            initial_batch_sizes=list(world.batch_sizes),
            min_batch_size=self.controller.lo.tolist(), max_batch_size=[config[2]] * size)
        self.worlds.append(dict(world._asdict(), size=size, rank=rank))
        if rank == 0:
            log.info("omnihvd: %d workers from step %d (%s): batch sizes %s", size, world.step,
                     ", ".join(world.workers), world.batch_sizes)
