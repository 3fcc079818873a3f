"""The synchronous callbacks' options: checked, resolved, and agreed across ranks.

:func:`resolve_options` turns the keyword options of
:class:`~omnihvd.OmniLearnCallback` (and of its DDP subclass) into an
:class:`Options` tuple and the :class:`~omnihvd.controller.Controller` that holds the
bounds, or raises :class:`~omnihvd.errors.ConfigError` /
:class:`~omnihvd.errors.InfeasibleError` naming the option and the fix. The callback
runs it on every rank and then makes every rank raise if any rank failed
(:func:`configure_everywhere`); at ``on_train_begin`` the ranks compare their options
(:meth:`Options.agreed`) and model (:func:`model_fingerprint`) with
:func:`check_agreement`. What is checked about
the model and the optimizer belongs to each backend and stays in the callbacks.

Pure Python and numpy: no torch, horovod or mpi4py.

>>> options, controller = resolve_options(2, global_batch_size=64, adjust_every=10)
>>> options.initial_batch_sizes, options.adjust_every, controller.hi.tolist()
([32, 32], 10, [64, 64])
>>> resolve_options(2, global_batch_size=64, timing="p90")
Traceback (most recent call last):
...
omnihvd.errors.ConfigError: timing must be one of sustained, median, mean, got 'p90'
"""
import logging
import zlib
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .checks import check_choice, check_flag, check_int
from .controller import DEFAULT_DEADBAND, POLICIES, Controller, initial_split
from .errors import ConfigError, InfeasibleError, RankMismatchError
from .normalization import raise_min_batch_size
from .timing import DEFAULT_SUMMARY, SUMMARIES
from .weighting import LOSS_REDUCTIONS

__all__ = ["Options", "resolve_options", "option_values", "configure_everywhere", "agreed_error",
           "model_fingerprint", "check_agreement"]

log = logging.getLogger("omnihvd")


class Options(NamedTuple):
    """The callback's options after checking (see OmniLearnCallback for each one)."""

    global_batch_size: int          # B, held exactly
    initial_batch_sizes: List[int]  # the first split: the user's, or an equal one
    min_batch_size: List[int]       # per-rank bounds, as resolved (BatchNorm floor in)
    max_batch_size: List[int]
    deadband: float
    gain: float
    adjust_every: int               # steps per window
    policy: str
    settle_steps: int               # samples dropped after each change
    timing: str                     # the window summary
    nonblocking: bool
    size_multiple: int
    loss_reduction: str
    history_size: int               # decisions kept in cb.history
    device_sync: Any                # "auto", None or a callable (resolved at on_train_begin)
    cpu_quota: Any                  # "auto", None or cores
    tune_split: bool                # also tune the split by the measured step period
    balance_arrivals: bool          # split for each step's slowest arrival, not the mean
    release_lag: bool               # charge each rank how late it resumes after the allreduce
    arrival_lead: bool              # search the lead of the rank with the most samples
    alike_ranks: bool               # hold ranks on alike resources at equal sizes

    def agreed(self) -> Dict[str, Any]:
        """The options every rank must share (device_sync and cpu_quota are per rank)."""
        values = self._asdict()
        del values["device_sync"], values["cpu_quota"]
        return values


def option_values(arguments: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword options of :func:`resolve_options` out of a constructor's arguments.

    The callbacks list every option in their signatures (for users and their
    editors) and pass them on as one dict: ``option_values(locals())``.

    >>> sorted(option_values(dict(Options(*range(21))._asdict(), self=None, comm=None)))[:3]
    ['adjust_every', 'alike_ranks', 'arrival_lead']
    """
    return {name: arguments[name] for name in Options._fields}


def _check_device_sync(device_sync):
    if not (device_sync is None or device_sync == "auto" or callable(device_sync)):
        raise ConfigError("device_sync must be 'auto', None or a callable, got %r"
                          % (device_sync,))


def _check_cpu_quota(cpu_quota):
    if not (cpu_quota is None or cpu_quota == "auto" or (
            isinstance(cpu_quota, (int, float)) and not isinstance(cpu_quota, bool)
            and 0 < cpu_quota < float("inf"))):
        raise ConfigError("cpu_quota must be 'auto', None or a number of cores > 0, got %r"
                          % (cpu_quota,))


def _controller(num_ranks, B, policy, gain, deadband, min_batch_size, max_batch_size,
                size_multiple, batchnorm_layers, log_floor):
    """The controller, with ``min_batch_size`` raised to 2 for a model with BatchNorm."""
    raised = False
    if batchnorm_layers:  # BatchNorm cannot normalise a batch of one sample
        min_batch_size, raised = raise_min_batch_size(min_batch_size)
        if raised and log_floor:
            log.info("omnihvd: the model has BatchNorm layers (%s): min_batch_size raised to "
                     "%r (a batch of one sample has no batch statistics)",
                     ", ".join(batchnorm_layers[:3]) + (", ..." if len(batchnorm_layers) > 3
                                                        else ""), min_batch_size)
    try:
        return Controller(num_ranks, B, policy=policy, gain=gain, deadband=deadband,
                          min_batch_size=min_batch_size, max_batch_size=max_batch_size,
                          size_multiple=size_multiple)
    except InfeasibleError as exc:
        if not raised:
            raise
        raise InfeasibleError("%s (min_batch_size was raised to 2 because the model has "
                              "BatchNorm layers; use a larger global_batch_size, or "
                              "GroupNorm/LayerNorm)" % exc) from exc


def resolve_options(num_ranks: int, *, global_batch_size, initial_batch_sizes=None,
                    min_batch_size=1, max_batch_size=None, deadband=DEFAULT_DEADBAND, gain=1.0,
                    adjust_every=20, policy="affine", settle_steps=1, timing=DEFAULT_SUMMARY,
                    nonblocking=True, size_multiple=1, loss_reduction="mean",
                    history_size=1000, device_sync="auto", cpu_quota="auto", tune_split=False,
                    balance_arrivals=False, release_lag=True, arrival_lead=True,
                    alike_ranks=True, batchnorm_layers: Sequence[str] = (),
                    log_floor: bool = False) -> Tuple[Options, Controller]:
    """Check the callback's options and build its controller.

    Args:
        num_ranks: the number of ranks.
        global_batch_size ... cpu_quota: as for :class:`~omnihvd.OmniLearnCallback`.
        batchnorm_layers: names of the model's BatchNorm layers; when any, every
            ``min_batch_size`` below 2 is raised to 2.
        log_floor: log that raise (rank 0 passes True, so it is said once).

    Returns:
        ``(Options, Controller)``; the same on every rank given the same arguments.

    Raises:
        ConfigError: a malformed option (the message names it and quotes the value).
        InfeasibleError: bounds, multiple or initial sizes that admit no split of B.
    """
    B = check_int("global_batch_size", global_batch_size, 1)
    adjust_every = check_int("adjust_every", adjust_every, 1)
    check_choice("policy", policy, POLICIES)
    check_choice("timing", timing, SUMMARIES)
    check_flag("nonblocking", nonblocking)
    check_flag("tune_split", tune_split)
    check_flag("balance_arrivals", balance_arrivals)
    check_flag("release_lag", release_lag)
    check_flag("arrival_lead", arrival_lead)
    check_flag("alike_ranks", alike_ranks)
    _check_device_sync(device_sync)
    _check_cpu_quota(cpu_quota)
    check_choice("loss_reduction", loss_reduction, LOSS_REDUCTIONS)
    history_size = check_int("history_size", history_size, 1)
    controller = _controller(num_ranks, B, policy, gain, deadband, min_batch_size,
                             max_batch_size, size_multiple, list(batchnorm_layers), log_floor)
    sizes = initial_split(num_ranks, B, controller.lo, controller.hi, initial_batch_sizes,
                          size_multiple=controller.size_multiple)
    settle_steps = check_int("settle_steps", settle_steps, 0)
    options = Options(
        global_batch_size=B, initial_batch_sizes=list(sizes),
        min_batch_size=controller.lo.tolist(), max_batch_size=controller.hi.tolist(),
        deadband=controller.deadband, gain=controller.gain, adjust_every=adjust_every,
        policy=policy, settle_steps=settle_steps, timing=timing, nonblocking=nonblocking,
        size_multiple=controller.size_multiple, loss_reduction=loss_reduction,
        history_size=history_size, device_sync=device_sync, cpu_quota=cpu_quota,
        tune_split=tune_split, balance_arrivals=balance_arrivals, release_lag=release_lag,
        arrival_lead=arrival_lead, alike_ranks=alike_ranks)
    return options, controller


def configure_everywhere(comm, configure: Callable[[], Any], owner: str):
    """Run ``configure()`` here, then raise on every rank if it failed on any rank.

    Collective: every rank makes one ``comm.allgather_object`` of its outcome, failed
    or not, so a rank with bad options never leaves the others waiting in a later
    collective, and every rank raises the same error (:func:`agreed_error`).

    Raises:
        the error of :func:`agreed_error`, on every rank.
    """
    error = None
    try:
        configure()
    except Exception as exc:  # reported on every rank below, never on one alone
        error = exc
    reports = comm.allgather_object(None if error is None else
                                    "%s: %s" % (type(error).__name__, error))
    agreed = agreed_error(reports, error, owner)
    if agreed is not None and agreed is error:
        raise error  # the same problem everywhere: keep its own type and message
    if agreed is not None:
        raise agreed from error


def agreed_error(reports: List[Optional[str]], error: Optional[BaseException],
                 owner: str) -> Optional[BaseException]:
    """What every rank raises once the ranks have exchanged their configuration errors.

    Args:
        reports: one per rank, None or ``"<ErrorType>: <message>"`` (all ranks' list).
        error: this rank's own exception, or None.
        owner: the class being configured, for the message.

    Returns:
        None when no rank failed; ``error`` itself when every rank failed with the same
        ValueError (its own type and message are clearest); otherwise a ConfigError
        naming each failing rank and its message.

    >>> print(agreed_error([None, "ConfigError: bad gain"], None, "OmniLearnCallback"))
    OmniLearnCallback rejected its configuration on 1 of 2 ranks (rank 1: ConfigError: bad gain)
    """
    failed = [(r, msg) for r, msg in enumerate(reports) if msg is not None]
    if not failed:
        return None
    if len(failed) == len(reports) and len({m for _, m in failed}) == 1 and isinstance(
            error, ValueError):
        return error
    detail = "; ".join("rank %d: %s" % (r, msg) for r, msg in failed)
    return ConfigError("%s rejected its configuration on %d of %d ranks (%s)"
                       % (owner, len(failed), len(reports), detail))


def model_fingerprint(model) -> str:
    """A short summary of a model's parameters: count, size and a crc of names and shapes.

    Ranks that built different models (another width, a layer missing) differ here.
    """
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    return "%d tensors, %d values, crc %08x" % (
        len(shapes), sum(int(p.numel()) for p in model.parameters()),
        zlib.crc32(repr(shapes).encode()))


def check_agreement(views: List[Dict[str, Any]]):
    """Raise when the ranks' fingerprints (one dict per rank) differ in any key.

    Raises:
        RankMismatchError: every differing key with every rank's value.

    >>> check_agreement([{"gain": 1.0}, {"gain": 1.0}])
    >>> check_agreement([{"gain": 1.0}, {"gain": 0.5}])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    omnihvd.errors.RankMismatchError: ranks disagree ... (gain: rank 0 has 1.0, rank 1 has 0.5)
    """
    diffs = []
    for key in views[0]:
        values = [v.get(key) for v in views]
        if any(v != values[0] for v in values):
            diffs.append("%s: %s" % (key, ", ".join("rank %d has %r" % (r, v)
                                                    for r, v in enumerate(values))))
    if diffs:
        raise RankMismatchError("ranks disagree on the omnihvd configuration or model; every "
                                "rank must pass the same values (%s)" % "; ".join(diffs))
