"""OmniLearn balancing for ``torch.distributed`` / DistributedDataParallel (torchrun).

The same balancing as :class:`~omnihvd.OmniLearnCallback` -- the same options,
controller, size schedule, sampler, checkpoints and errors on every rank -- for a
model wrapped in ``DistributedDataParallel`` and launched with ``torchrun`` (or
``srun``): no Horovod and no MPI are imported. gloo on CPUs, NCCL on GPUs::

    import torch, torch.distributed as dist, omnihvd
    dist.init_process_group("gloo")        # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=512)
    sampler = omnihvd.HeterogeneousBatchSampler(len(dataset), cb, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    cb.on_train_begin()
    for epoch in range(epochs):
        sampler.set_epoch(epoch); cb.on_epoch_begin(epoch)
        for x, y in loader:
            cb.on_batch_begin()
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
            cb.on_batch_end()
        cb.on_epoch_end(epoch)
    cb.on_train_end()

Gradient weighting
    :func:`weighted_allreduce_hook`, a DDP communication hook (a plain function
    and the small :class:`WeightedAllreduceState`), multiplies each bucket by
    ``b_i / B`` and allreduces with SUM, so after ``backward()`` every gradient is
    ``sum_i (b_i / B) g_i``: the gradient of the mean loss over all B samples of the
    step, when each rank's loss is the mean over its own samples. DDP does not
    divide a hooked bucket by the world size (its own default hook does that), so
    the hook's factor is the whole weighting. With weight 1 (before
    ``on_train_begin``, after ``on_train_end``) it is DDP's plain mean.

Timing boundary
    DDP hands each gradient bucket to the hook as soon as backward has produced it,
    in bucket order, and the hook only *launches* the allreduce; the rank waits for
    its peers once, after backward has produced every bucket (DDP's finalisation
    at the end of ``backward()``). So the local time ends when the hook receives
    the last bucket (``bucket.is_last()``): data work since ``on_batch_begin``,
    forward and the whole backward are in, waiting for other ranks is not. (The
    first bucket would be too early: it holds the last layers' gradients, before
    most of backward has run.) On CUDA the host reaches the last bucket before the
    device has computed it, so there the timer first synchronises the stream the
    gradients were produced on (``device_sync="auto"``, :mod:`omnihvd.device`:
    ``torch.cuda.current_stream(device)``, never ``torch.cuda.synchronize()``,
    which would also wait for NCCL's stream, i.e. for the peers). The last bucket's
    allreduce waits for those kernels anyway, so the cost is one host-side stream
    wait per step; ``device_sync=None`` leaves it out (host time only).

Gathers
    The timings travel over the DDP model's own process group
    (:class:`~omnihvd.comm.TorchDistComm`: ``all_gather_into_tensor`` of a few
    float64 per rank). As for Horovod, the gather of an ``adjust_every`` window is
    posted in ``on_batch_begin`` of the step that gathers -- before the forward
    pass, so before that step's first collective on every rank -- runs beside the
    step's work and its gradient allreduces, and is completed in ``on_batch_end`` of
    the same step. No collective is in flight between steps or
    after the last one, so a rank that leaves the loop first leaves nothing behind
    for a slower one.

Not covered: gradient accumulation across loader steps with ``model.no_sync()``
(the hook sees only the accumulated bucket and weights it with the synced step's
sizes, so the gradient is exact only while the split does not change between the
steps it sums -- 2.06 off at one that did; such steps are not timed either), and
:meth:`report_oom` (a rank whose backward fails leaves its peers in DDP's allreduce;
the job is then ended by ``abort_on_exception``). ``no_sync()`` within one step (one
``on_batch_begin``/``on_batch_end`` pair around the micro-batches) is exact.
"""
import logging
import time
from typing import List, Optional

from .callback import OmniLearnCallback
from .comm import TorchDistComm, hold_past_exit
from .controller import DEFAULT_DEADBAND
from .errors import ConfigError
from .internals import comm_hook_name, ddp_buckets_rebuilt, tensor_version
from .options import option_values
from .timing import DEFAULT_SUMMARY
from .weighting import GradientWeight

__all__ = ["DDPOmniLearnCallback", "DDPBackend", "WeightedAllreduceState", "weighted_allreduce_hook"]

log = logging.getLogger("omnihvd")


class WeightedAllreduceState:
    """State of :func:`weighted_allreduce_hook`.

    Args:
        process_group: the group to allreduce over (None: the default group).
        weight: the rank's current weight ``n * b_i / B`` (a
            :class:`~omnihvd.weighting.GradientWeight`; 1.0 gives DDP's plain mean).
        on_last_bucket: None, or a callable taking the bucket's device, called when
            the hook receives the last bucket of a backward pass, before its
            allreduce is launched (the timing boundary).
        on_released: None, or a callable taking nothing, called once the last
            bucket's CPU (gloo) allreduces are complete (the rank's release,
            :mod:`omnihvd.lags`); NCCL buckets complete on the GPU, unseen here.
    """

    __slots__ = ("process_group", "weight", "on_last_bucket", "on_released", "_in_flight")

    def __init__(self, process_group=None, weight: Optional[GradientWeight] = None,
                 on_last_bucket=None, on_released=None):
        self.process_group = process_group
        self.weight = weight if weight is not None else GradientWeight(1.0)
        self.on_last_bucket = on_last_bucket
        self.on_released = on_released  # called once the last CPU bucket is reduced
        self._in_flight: list = []  # CPU buckets' (work, buffer, future), in launch order

    def complete_in_flight(self):
        """Wait for the CPU buckets' allreduces in launch order and fulfil their futures."""
        in_flight, self._in_flight = self._in_flight, []
        for work, buffer, future in in_flight:
            work.wait()
            future.set_result(buffer)


def weighted_allreduce_hook(state: WeightedAllreduceState, bucket):
    """DDP communication hook: the batch-size-weighted sum of the ranks' gradients.

    Multiplies the bucket by ``state.weight.value / n`` (``b_i / B`` for the weight
    ``n * b_i / B``) and allreduces it with SUM over ``state.process_group``.

    Every bucket's allreduce is launched at once. On CUDA (NCCL) the returned future
    follows the work's own. On CPU (gloo) the futures are fulfilled on this thread,
    all together when the last bucket arrives (DDP waits for them all right after
    it): a callback chained to a gloo work runs and is freed on gloo's worker thread,
    which aborts the process if the interpreter is exiting by then
    (:func:`omnihvd.comm.hold_past_exit`).

    Args:
        state: a :class:`WeightedAllreduceState`.
        bucket: the ``torch.distributed.GradBucket`` DDP passes in.

    Returns:
        a ``torch.futures.Future`` holding the reduced bucket.

    Example::

        state = WeightedAllreduceState(model.process_group, GradientWeight(1.0))
        model.register_comm_hook(state, weighted_allreduce_hook)
        state.weight.value = n * b_i / B      # before each backward
    """
    import torch
    import torch.distributed as dist

    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    if state.weight.on_gradient is not None:
        state.weight.on_gradient()
    if bucket.index() == 0:
        state.complete_in_flight()  # a backward that failed before its last bucket
    if state.on_last_bucket is not None and bucket.is_last():
        state.on_last_bucket(buffer.device)
    buffer.mul_(state.weight.value / group.size())
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if buffer.device.type != "cpu":
        # NCCL completes its future on this thread, with CUDA events: chain as usual.
        return work.get_future().then(lambda fut: fut.value()[0])
    hold_past_exit(work)  # it holds backward's thread-local state
    future = torch.futures.Future()
    state._in_flight.append((work, buffer, future))
    if bucket.is_last():
        state.complete_in_flight()
        if state.on_released is not None:
            state.on_released()
    return future


class _HookHandle:
    """DDP cannot unregister a comm hook; removing ours stops its timing mark (and the
    callback resets the weight to 1, i.e. DDP's plain mean)."""

    def __init__(self, state: WeightedAllreduceState):
        self._state = state

    def remove(self):
        self._state.on_last_bucket = self._state.on_released = None


class DDPBackend:
    """DistributedDataParallel's side of the engine (the peer of
    :class:`omnihvd.backend.HorovodBackend`, whose docstring lists the calls):
    the weights go in through :func:`weighted_allreduce_hook`, and the wait
    boundary is the last gradient bucket (module docstring)."""

    def __init__(self, model):
        self._hook_state: Optional[WeightedAllreduceState] = None
        self._warned_no_bucket = False
        self._bucket_seen = False   # a last gradient bucket in the running step
        self._buckets_rebuilt = ddp_buckets_rebuilt(model)
        self._watched = None   # (parameter, its version at the step's last bucket)
        self._model, self._optimizer, self._cb, self.rank = model, None, None, 0

    def check(self, model, optimizer, rank: int) -> bool:
        from torch.nn.parallel import DistributedDataParallel

        self._optimizer, self.rank = optimizer, rank
        if not isinstance(model, DistributedDataParallel):
            raise ConfigError("model must be a torch.nn.parallel.DistributedDataParallel, got %s; "
                              "wrap it: model = DistributedDataParallel(net) (with "
                              "device_ids=[local_rank] on GPUs)" % type(model).__name__)
        self._refuse_other_comm_hook(model)
        if getattr(model, "broadcast_buffers", False) and any(True for _ in model.buffers()):
            log.warning("omnihvd: rank %d: DDP broadcasts the model's buffers at every forward "
                        "(broadcast_buffers=True), a collective inside the timed window; pass "
                        "broadcast_buffers=False to DistributedDataParallel", rank)
        return True  # the hook's weight is n * b_i / B, as for an averaging allreduce

    @staticmethod
    def _refuse_other_comm_hook(model):
        """ConfigError when ``model`` has a communication hook: DDP takes one, for good."""
        if comm_hook_name(model) == weighted_allreduce_hook.__name__:
            raise ConfigError("this DDP model already carries the hook of an earlier "
                              "DDPOmniLearnCallback, and DDP keeps one communication hook per "
                              "model for good: keep using that callback (on_train_end() then "
                              "on_train_begin() starts it again), or wrap the network in a new "
                              "DistributedDataParallel")
        name = comm_hook_name(model)
        if name:
            raise ConfigError("the DDP model already has a communication hook (%s); DDP allows one "
                              "and omnihvd's applies the batch-size weights: register none of "
                              "your own" % name)

    def agreed(self) -> dict:
        # a hook registered since the constructor (by the user, or by another callback
        # on this model that started first), compared so that every rank refuses it
        return {"comm_hook": None if self._hook_state is not None
                else comm_hook_name(self._model)}

    def install(self, cb) -> list:
        # DDP takes one comm hook per model, for good: register it on the first
        # on_train_begin and only switch its timing mark on and off afterwards.
        self._cb = cb
        if self._hook_state is None:
            self._refuse_other_comm_hook(self._model)   # the same on every rank (agreed)
            state = WeightedAllreduceState(self._model.process_group, cb._weight)
            self._model.register_comm_hook(state, weighted_allreduce_hook)
            self._hook_state = state
        self._hook_state.on_last_bucket = self._on_last_bucket
        self._hook_state.on_released = lambda: cb._released(time.perf_counter())
        return [_HookHandle(self._hook_state)] + ([] if self._optimizer is None else
                                                  cb._step_hooks(self._optimizer))

    def _on_last_bucket(self, device):
        # The wait boundary: the timer's device_sync ("auto": the model's compute
        # streams, never NCCL's) runs here.
        self._bucket_seen = True
        rebuilt = ddp_buckets_rebuilt(self._model)
        if rebuilt != self._buckets_rebuilt:
            # DDP rebuilt its buckets in this step's forward (once, in the second
            # iteration), broadcasting their layout: a wait for the peers in the window
            self._buckets_rebuilt = rebuilt
            self._cb._discard_step_time()
        # a parameter with a gradient, to tell whether opt.step() has run since
        # (checkpoints), as Horovod's optimizer hooks tell the engine
        self._watched = next(((p, tensor_version(p)) for p in self._model.parameters()
                              if p.grad is not None), None)
        self._cb.mark_compute_end()

    def begin_step(self):
        """Nothing: DDP weights every bucket in its hook."""

    def synchronized_early(self) -> bool:
        return False

    def check_weighted(self, step: int):
        """Nothing: the hook weights every bucket, frozen parameters or not."""

    def end_step(self, cb):
        """A step with no last bucket (``model.no_sync()``, or no backward) has no wait
        boundary: its time is not used (warned once)."""
        if not self._bucket_seen:
            if cb._timing_open():
                cb._discard_step_time()
            if not self._warned_no_bucket:
                self._warned_no_bucket = True
                log.warning("omnihvd: rank %d: step %d ran no DDP gradient allreduce; its time "
                            "is not used, and if the loop accumulates gradients over steps with "
                            "model.no_sync(), the sum is weighted with the synced step's sizes: "
                            "wrong whenever the split changes between them (put one "
                            "on_batch_begin/on_batch_end pair around all the micro-batches of "
                            "an optimizer step instead)", self.rank, cb.step)
        self._bucket_seen = False
        self._watched = None

    def updated(self) -> bool:
        """Whether ``opt.step()`` has run since this step's backward, read from a
        parameter's version counter (the engine may not see a DDP loop's optimizer)."""
        return self._watched is not None and tensor_version(self._watched[0]) != self._watched[1]

    def detach(self):
        """Nothing: DDP keeps its hook; :class:`_HookHandle` switched its marks off."""


class DDPOmniLearnCallback(OmniLearnCallback):
    """OmniLearn dynamic batch sizing for a DistributedDataParallel training loop.

    The hooks, options, properties (``batch_size``, ``batch_sizes``, ``history``),
    checkpoints and sampler protocol are those of
    :class:`~omnihvd.OmniLearnCallback`; what differs is how gradients are reduced
    (a DDP communication hook) and where the local time ends (module docstring).

    Args:
        model: the ``torch.nn.parallel.DistributedDataParallel`` being trained, with
            no communication hook of its own; the timings are gathered over its
            ``process_group``.
        global_batch_size: B, the samples per step over all ranks; held exactly.
        initial_batch_sizes, min_batch_size, max_batch_size, deadband, gain,
        adjust_every, policy, settle_steps, timing, nonblocking, size_multiple,
        loss_reduction, history_size, device_sync, cpu_quota, tune_split,
        balance_arrivals, release_lag, arrival_lead, alike_ranks: as for
            :class:`~omnihvd.OmniLearnCallback`. A rank is released when its CPU
            (gloo) buckets are reduced; NCCL's buckets end on the GPU unseen by the
            host, so on GPUs no release lag is charged.
        abort_on_exception: an uncaught exception on a rank prints it with the rank
            and ends that process at once (``os._exit``), so ``torchrun`` ends the
            others; default True with several ranks.
        optimizer: None, or the model's optimizer: its ``step()`` then marks the
            step's end (what :class:`omnihvd.Balancer` passes).

    Raises:
        ConfigError: ``torch.distributed`` is not initialised; or, on every rank,
            when any rank's options or model are invalid (the message names the
            rank and the fix).

    Example: see the module docstring (:mod:`omnihvd.ddp`).
    """

    def __init__(self, model, global_batch_size: int, *,
                 initial_batch_sizes: Optional[List[int]] = None, min_batch_size=1,
                 max_batch_size=None, deadband: float = DEFAULT_DEADBAND, gain: float = 1.0,
                 adjust_every: int = 20, policy: str = "affine", settle_steps: int = 1,
                 timing: str = DEFAULT_SUMMARY, nonblocking: bool = True, size_multiple: int = 1,
                 loss_reduction: str = "mean", history_size: int = 1000,
                 abort_on_exception: Optional[bool] = None, device_sync="auto",
                 cpu_quota="auto", tune_split: bool = False, balance_arrivals: bool = False,
                 release_lag: bool = True, arrival_lead: bool = True,
                 alike_ranks: bool = True, optimizer=None):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("torch.distributed is not initialised: call "
                              "dist.init_process_group('gloo' or 'nccl') before creating "
                              "DDPOmniLearnCallback (torchrun sets its environment)")
        # A DDP model's group; the default group otherwise, so that the check of the
        # model fails on every rank together.
        comm = TorchDistComm(getattr(model, "process_group", None))
        self._start(comm, DDPBackend(model), model, optimizer, option_values(locals()),
                    comm.size > 1 if abort_on_exception is None else abort_on_exception)
