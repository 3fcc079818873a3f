"""The scaled-gradient hook: Horovod's allreduce yields the global-batch gradient.

Rank i computes ``g_i``, the gradient of the mean loss over its ``b_i`` samples.
The gradient of the mean loss over all ``B = sum(b)`` samples of the step is
``sum_i (b_i / B) g_i``. Horovod allows no per-rank prescale factor, so each rank
multiplies its own gradient before the allreduce:

* ``op=hvd.Average`` (divides by n): weight ``n * b_i / B``
* ``op=hvd.Sum``: weight ``b_i / B``

So with omnihvd both ops return the same thing: the gradient of the mean loss over
the global batch (op only changes the factor omnihvd applies).

With ``loss_reduction="sum"`` each rank's loss is the *sum* over its samples (or a
sum already divided by a global count, see ``OmniLearnCallback.global_count``); the
global-batch loss is then the plain sum of the ranks' losses, so the weight does not
depend on the sizes: ``n`` under Average, 1 under Sum.

The multiplication is a tensor hook on every parameter Horovod allreduces -- the
optimizer's, including any outside the model (a loss's learnable temperature) --
and on the model's. On a leaf tensor such a
hook runs before the gradient is accumulated into ``.grad``, hence before Horovod's
own hook (registered on the gradient accumulator) launches the allreduce. It
therefore composes with ``backward_passes_per_step > 1`` (each micro-step is
weighted before accumulation) and with parameters that get no gradient (no hook
fires; Horovod allreduces zeros for them). A parameter frozen at registration
gets its hook once it is unfrozen (:meth:`_Handles.hook_unfrozen`, which the
callback runs in ``on_batch_begin`` and in a forward pre-hook of the model; a
gradient that came before it is refused, :meth:`_Handles.unweighted_gradients`). A
parameter carries at most one
callback's weight at a time (:func:`register_gradient_weight` with
``exclusive=True``): two would multiply it twice.
"""
import weakref
from typing import Dict, List, Tuple

from .errors import ConfigError
from .internals import adasum_optimizer

__all__ = ["GradientWeight", "LOSS_REDUCTIONS", "allreduce_weight", "register_gradient_weight",
           "weighted_parameters"]

LOSS_REDUCTIONS = ("mean", "sum")


def allreduce_weight(batch_size: int, batch_sizes, average: bool,
                     reduction: str = "mean") -> float:
    """The factor rank ``i`` applies to its gradient before the allreduce.

    Args:
        batch_size: this rank's samples in the step, ``b_i``.
        batch_sizes: every rank's samples in the step (their sum is the step's B).
        average: True for ``op=hvd.Average``, False for ``op=hvd.Sum``.
        reduction: ``"mean"`` when each rank's loss is the mean over its samples,
            ``"sum"`` when it is their sum (module docstring).

    Raises:
        ConfigError: inconsistent sizes or an unknown reduction.

    >>> allreduce_weight(8, [8, 8, 16, 32], average=True)
    0.5
    >>> allreduce_weight(8, [8, 8, 16, 32], average=False)
    0.125
    >>> allreduce_weight(8, [8, 8, 16, 32], average=True, reduction="sum")
    4.0
    """
    total = sum(int(b) for b in batch_sizes)
    if total <= 0 or not 0 <= batch_size <= total:
        raise ConfigError("need 0 <= batch_size <= sum(batch_sizes) > 0; got batch_size %r of %r"
                          % (batch_size, list(batch_sizes)))
    if reduction not in LOSS_REDUCTIONS:
        raise ConfigError("loss_reduction must be one of %s, got %r"
                          % (", ".join(LOSS_REDUCTIONS), reduction))
    scale = len(batch_sizes) if average else 1
    return float(scale) if reduction == "sum" else scale * batch_size / total


class GradientWeight:
    """The current weight, read by the hooks; a small explicit state object.

    ``value`` is set by the callback at the start of each step. ``refuse``: None, or
    a function returning the message of the ConfigError a hook raises instead of
    weighting (the callback sets it between its steps: a backward pass there gets
    no step's weight). ``on_gradient``: None, or called with no argument by every
    hook that reads the weight (a backward pass is running: the step timer's
    cue, :mod:`omnihvd.segments`).

    >>> w = GradientWeight(0.5); w(4.0)   # a hook's gradient: a tensor, here a float
    2.0
    >>> w.refuse = lambda: "a backward pass between the steps"; w(4.0)
    Traceback (most recent call last):
    omnihvd.errors.ConfigError: a backward pass between the steps
    """

    def __init__(self, value: float = 1.0):
        self.value = float(value)
        self.refuse = None
        self.on_gradient = None

    def __call__(self, grad):
        if self.refuse is not None:
            raise ConfigError(self.refuse())
        if self.on_gradient is not None:
            self.on_gradient()
        if self.value == 1.0:
            return None  # leave the gradient untouched
        return grad * self.value


# id(parameter) -> (a weak reference to it, the GradientWeight it carries), for the
# registrations made with exclusive=True that are still in place.
_EXCLUSIVE: Dict[int, Tuple[weakref.ref, "GradientWeight"]] = {}


def _exclusive_weight(p):
    """The GradientWeight an exclusive registration put on ``p``, or None."""
    held = _EXCLUSIVE.get(id(p))
    return held[1] if held is not None and held[0]() is p else None


class _Handles:
    """The hooks of one registration; parameters frozen at registration (no grad
    required) get theirs when they become trainable (:meth:`hook_unfrozen`)."""

    def __init__(self, weight: GradientWeight, exclusive: bool):
        self._weight, self._claim = weight, exclusive
        self._handles: List = []
        self._exclusive: List[int] = []
        self._frozen: List = []

    def add(self, parameters):
        trainable = [p for p in parameters if p.requires_grad]
        if self._claim and any(_exclusive_weight(p) not in (None, self._weight)
                               for p in trainable):
            raise ConfigError("the model's parameters already carry the gradient weights of "
                              "another OmniLearnCallback that is still attached (two would "
                              "weight every gradient twice): call on_train_end() on the old "
                              "callback first")
        self._handles += [p.register_hook(self._weight) for p in trainable]
        if self._claim:
            for p in trainable:
                _EXCLUSIVE[id(p)] = (weakref.ref(p), self._weight)
                self._exclusive.append(id(p))
        self._frozen += [p for p in parameters if not p.requires_grad]

    @property
    def frozen(self) -> bool:
        """Whether some parameter is still frozen (no hook yet)."""
        return bool(self._frozen)

    def hook_unfrozen(self) -> List:
        """Weight the parameters unfrozen since (``requires_grad_(True)`` mid-training:
        Horovod allreduces them as before, so unweighted they would be silently
        wrong); returns them. Costs one check per still-frozen parameter."""
        if not any(p.requires_grad for p in self._frozen):
            return []
        frozen, self._frozen = self._frozen, []
        self.add(frozen)
        return [p for p in frozen if p.requires_grad]

    def unweighted_gradients(self) -> List:
        """The still-frozen parameters that require grad and hold a gradient: unfrozen
        and trained before :meth:`hook_unfrozen` ran (their gradient has no weight)."""
        return [p for p in self._frozen if p.requires_grad and p.grad is not None]

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles, self._frozen = [], []
        for key in self._exclusive:
            _EXCLUSIVE.pop(key, None)
        self._exclusive = []

    def __len__(self):
        return len(self._handles)


def _optimizer_op(optimizer):
    """True for Average, False for Sum; ConfigError for anything else."""
    import horovod.torch as hvd

    op = getattr(optimizer, "op", None)
    if op is None and adasum_optimizer(optimizer):
        op = hvd.Adasum   # Horovod's Adasum optimizer (2+ ranks) keeps no op attribute
    if op is None or not hasattr(optimizer, "synchronize"):
        raise ConfigError(
            "optimizer must be a Horovod optimizer, got %s; wrap it: "
            "opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())"
            % type(optimizer).__name__)
    if op == hvd.Average:
        return True
    if op == hvd.Sum:
        return False
    names = {getattr(hvd, n, None): "hvd." + n for n in ("Adasum", "Min", "Max", "Product")}
    raise ConfigError("omnihvd supports op=hvd.Average and op=hvd.Sum, got op=%s (Adasum "
                      "combines gradients non-linearly, so batch-size weights cannot apply)"
                      % names.get(op, repr(op)))


def weighted_parameters(model, optimizer) -> List:
    """The parameters whose gradients get the weight, each once: the optimizer's
    (what Horovod allreduces, the model's or not) and the model's.

    >>> import torch
    >>> model, temperature = torch.nn.Linear(2, 1), torch.nn.Parameter(torch.ones(1))
    >>> opt = torch.optim.SGD([*model.parameters(), temperature], lr=0.1)
    >>> len(weighted_parameters(model, opt)), len(weighted_parameters(model, None))
    (3, 2)
    """
    found, seen = [], set()
    groups = getattr(optimizer, "param_groups", None) or []
    for p in [q for g in groups for q in g.get("params", [])] + list(model.parameters()):
        if id(p) not in seen:
            seen.add(id(p))
            found.append(p)
    return found


def register_gradient_weight(parameters, weight: GradientWeight, exclusive: bool = False):
    """Register ``weight`` on every parameter that requires grad; returns a handle.

    A parameter frozen now gets the weight once it requires grad and the handle's
    ``hook_unfrozen()`` runs (the callback runs it in ``on_batch_begin`` and before
    each forward pass of the model).

    Args:
        parameters: iterable of tensors (e.g. ``model.parameters()``).
        weight: the shared :class:`GradientWeight` state.
        exclusive: refuse parameters that already carry another exclusive weight
            (another callback still attached to them), and claim these until
            ``remove()``.

    Returns:
        an object whose ``remove()`` takes all the hooks off again and whose
        ``hook_unfrozen()`` weights the parameters unfrozen since.

    Raises:
        ConfigError: with ``exclusive``, a parameter already carries another weight.

    >>> import torch
    >>> p = torch.ones(2, requires_grad=True)
    >>> w = GradientWeight(0.5)
    >>> h = register_gradient_weight([p], w)
    >>> (p * 4).sum().backward(); p.grad.tolist()
    [2.0, 2.0]
    >>> h.remove(); p.grad = None; (p * 4).sum().backward(); p.grad.tolist()
    [4.0, 4.0]
    """
    handles = _Handles(weight, exclusive)
    handles.add([p for p in parameters if hasattr(p, "requires_grad")])
    return handles
