"""Horovod's side of the engine: what :class:`~omnihvd.OmniLearnCallback` needs to
know about a ``hvd.DistributedOptimizer``, and nothing else.

The engine (:mod:`omnihvd.callback`) times steps, gathers, decides and schedules
sizes; a *backend* tells it how this framework's gradients get their batch-size
weight and where a rank starts waiting for the others. Two backends are peers over
the one engine: :class:`HorovodBackend` here and :class:`omnihvd.ddp.DDPBackend`.
The engine calls, in this order::

    check(model, optimizer, rank) -> bool   configuration, on every rank together:
                                            True for an averaging allreduce
    agreed() -> dict                        compared across ranks at on_train_begin
    install(cb) -> [handles with remove()]  at on_train_begin
    begin_step()                            at on_batch_begin
    synchronized_early() -> bool            at the wait boundary: the step's time
                                            holds a wait for the peers, drop it
    check_weighted(step)                    just after the wait boundary
    end_step(cb)                            at on_batch_end, before its wait boundary
    updated() -> bool                       at state_dict: opt.step() ran unseen
    detach()                                at on_train_end

Horovod allreduces a gradient in a hook on its accumulator; omnihvd multiplies it
by the rank's weight in a tensor hook that runs first (:mod:`omnihvd.weighting`).
The private attributes of Horovod it reads live in :mod:`omnihvd.internals`.
"""
import logging

from .errors import ConfigError
from .internals import clear_synchronized_flag, horovod_reduced, synchronized_flag
from .weighting import _optimizer_op, register_gradient_weight, weighted_parameters

__all__ = ["HorovodBackend", "ALL_AT_SYNCHRONIZE"]

log = logging.getLogger("omnihvd")

# Horovod's backward passes per step while omnihvd balances a loop that accumulates
# (backward_passes_per_step > 1): each rank runs as many passes as its share needs,
# so none reaches the count and every gradient is allreduced once, in synchronize().
ALL_AT_SYNCHRONIZE = 2 ** 31 - 1


class _Call:
    """A handle whose ``remove()`` calls ``undo()``."""

    def __init__(self, undo):
        self.remove = undo


class HorovodBackend:
    """A ``hvd.DistributedOptimizer`` (``op=hvd.Average`` or ``hvd.Sum``) on the
    global process set.

    >>> backend = HorovodBackend()
    >>> backend.updated()      # Horovod's step hooks tell the engine by themselves
    False
    """

    def __init__(self):
        self._model = self._optimizer = None
        self._weights = None       # the gradient weights' handle (its frozen parameters)
        self._warned_sync = False
        self.rank = 0

    # ------------------------------------------------------------ set-up
    def check(self, model, optimizer, rank: int) -> bool:
        """True for ``op=hvd.Average``, False for ``op=hvd.Sum``; ConfigError otherwise."""
        self._model, self._optimizer, self.rank = model, optimizer, rank
        average = _optimizer_op(optimizer)
        process_set = getattr(optimizer, "process_set", None)
        if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
            raise ConfigError("optimizer uses a non-global Horovod process set; omnihvd balances "
                              "the global set only: create it without process_set=")
        return average

    def agreed(self) -> dict:
        return {"backward_passes_per_step": getattr(self._optimizer, "backward_passes_per_step", 1)}

    def install(self, cb) -> list:
        """Gradient weights, the optimizer's step hooks and per-rank accumulation."""
        weights = register_gradient_weight(
            weighted_parameters(self._model, self._optimizer), cb._weight, exclusive=True)
        hooks = [weights, *cb._step_hooks(self._optimizer), *self._accumulate_per_rank()]
        self._weights = weights
        self._refuse_unreduced([p for g in self._optimizer.param_groups for p in g["params"]])
        if weights.frozen:   # gradual unfreezing: weighted before their first backward pass
            hooks.append(self._model.register_forward_pre_hook(
                lambda module, args: self._weigh_unfrozen()))
        if synchronized_flag(self._optimizer) is None and not self._warned_sync:
            self._warned_sync = True
            log.warning("omnihvd: rank %d: the optimizer has no Horovod _synchronized flag, so "
                        "omnihvd cannot detect an explicit opt.synchronize() before opt.step(); "
                        "if the loop calls it, call cb.mark_compute_end() just before, or step "
                        "times include waiting for other ranks", self.rank)
        return hooks

    def _accumulate_per_rank(self) -> list:
        """Let each rank run its own number of backward passes per step.

        Horovod allreduces a gradient after exactly ``backward_passes_per_step``
        passes; a loop that cuts its share into sub-batches of a fixed size runs
        more passes on a rank with a larger share. While omnihvd is attached every
        gradient is therefore allreduced in ``synchronize()`` (public
        ``set_backward_passes_per_step``), once per step, whatever the passes.
        Returns a handle that gives the optimizer its own count back."""
        passes = getattr(self._optimizer, "backward_passes_per_step", 1)
        if passes <= 1 or not hasattr(self._optimizer, "set_backward_passes_per_step"):
            return []
        self._optimizer.set_backward_passes_per_step(ALL_AT_SYNCHRONIZE)
        restore = self._optimizer.set_backward_passes_per_step
        return [_Call(lambda: restore(passes))]

    # --------------------------------------------------------- each step
    def begin_step(self):
        """A step GradScaler skipped left Horovod's flag set (``step()`` clears it):
        cleared, so that this step does not read it as its own ``synchronize()``;
        parameters unfrozen between steps get their weight."""
        clear_synchronized_flag(self._optimizer)
        self._weigh_unfrozen()

    def synchronized_early(self) -> bool:
        """Whether ``synchronize()`` already ran before the wait boundary: the step's
        time then includes waiting for the other ranks (warned once)."""
        if not synchronized_flag(self._optimizer):
            return False
        if not self._warned_sync:
            self._warned_sync = True
            log.warning("omnihvd: rank %d: opt.synchronize() ran before omnihvd's wait boundary "
                        "(opt.step() or cb.mark_compute_end()), so step times include waiting "
                        "and are dropped; call cb.mark_compute_end() just before "
                        "opt.synchronize() to let omnihvd balance", self.rank)
        return True

    def check_weighted(self, step: int):
        """A parameter unfrozen within the step (after ``on_batch_begin``) and trained
        with no forward pass of the model to weight it has had its gradient
        allreduced unweighted -- a wrong gradient, refused."""
        if self._weights is None or not self._weights.frozen:
            return
        unweighted = self._weights.unweighted_gradients()
        if unweighted:
            raise ConfigError(
                "rank %d: parameter(s) %s became trainable after cb.on_batch_begin() of step "
                "%d and got gradients with no forward pass of the model (model(x)) between: "
                "their gradients carry no batch-size weight. Unfreeze parameters between "
                "steps (before on_batch_begin)" % (self.rank, self._names(unweighted), step))

    def end_step(self, cb):
        """Nothing: Horovod's optimizer hooks saw the step."""

    def updated(self) -> bool:
        return False

    def detach(self):
        self._weights = None

    # ------------------------------------------------------------ helpers
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
