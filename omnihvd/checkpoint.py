"""The callback's checkpoint state (``OmniLearnCallback.state_dict``): validation
(:func:`checked_state`) and how a checked state is put back (:func:`restore`).

A checkpoint may come from another run, another version or a hand-edited file; a
wrong field must stop the resume with a message naming it, never start training
at a split that does not sum to the global batch. Pure Python and numpy.
"""
import logging
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from .caps import tighten_caps
from .checks import check_int
from .errors import ConfigError

log = logging.getLogger("omnihvd")

__all__ = ["CallbackState", "Checkpointed", "checked_state", "restore"]


class CallbackState(NamedTuple):
    """The validated fields of a callback state_dict."""

    global_batch_size: int
    num_ranks: int
    step: int                                  # steps completed
    epoch: int
    batch_sizes: List[int]                     # in effect at ``step``
    changes: List[Tuple[int, List[int]]]       # (first step, sizes) scheduled after ``step``
    max_batch_size: Optional[List[int]]        # memory caps learned from OOM errors
    controller: dict                           # the controller's measured history


def _bad(what):
    return ConfigError("not a valid OmniLearnCallback state_dict: %s" % what)


def _whole(key, value, minimum):
    return check_int(key, value, minimum, where="not a valid OmniLearnCallback state_dict: ")


def _split(key, value, width):
    if not isinstance(value, (list, tuple)) or len(value) != width:
        raise _bad("%s must be a list of %d ints, got %r" % (key, width, value))
    return [_whole(key, b, 1) for b in value]


def checked_state(state) -> CallbackState:
    """The fields of a callback state_dict, validated.

    Raises:
        ConfigError: not a dict, a missing or malformed field, or splits that do not
            sum to the checkpoint's global batch (the message names the field).

    >>> checked_state({"global_batch_size": 4, "num_ranks": 2, "step": 3,
    ...                "batch_sizes": [1, 3]}).batch_sizes
    [1, 3]
    """
    if not isinstance(state, dict):
        raise _bad("expected a dict, got %s" % type(state).__name__)
    for key in ("global_batch_size", "num_ranks", "step", "batch_sizes"):
        if key not in state:
            raise _bad("missing %r" % key)
    B = _whole("global_batch_size", state["global_batch_size"], 1)
    n = _whole("num_ranks", state["num_ranks"], 1)
    step = _whole("step", state["step"], 0)
    epoch = _whole("epoch", state.get("epoch", 0), 0)
    sizes = _split("batch_sizes", state["batch_sizes"], n)
    if sum(sizes) != B:
        raise _bad("batch_sizes %r do not sum to its global_batch_size %d" % (sizes, B))
    changes = state.get("changes", [])
    if not isinstance(changes, (list, tuple)) or not all(
            isinstance(c, (list, tuple)) and len(c) == 2 for c in changes):
        raise _bad("changes must be a list of (step, sizes) pairs, got %r" % (changes,))
    changes = [(_whole("changes step", s, 0), _split("changes sizes", v, n)) for s, v in changes]
    if any(sum(v) != B for _, v in changes):
        raise _bad("a scheduled split in changes does not sum to global_batch_size %d: %r"
                   % (B, changes))
    firsts = [s for s, _ in changes]
    if firsts != sorted(set(firsts)):   # applied in order (those up to step: ignored)
        raise _bad("changes must be in increasing order of their steps, got steps %r" % firsts)
    caps = state.get("max_batch_size")
    if caps is not None:
        caps = _split("max_batch_size", caps, n)
    return CallbackState(B, n, step, epoch, sizes, changes, caps, state.get("controller", {}))


def restore(saved: CallbackState, controller, schedule,
            initial_batch_sizes: Sequence[int]) -> bool:
    """Put a checked state into the callback's ``controller`` and ``schedule``.

    Every rank calls it with the same state, so every rank resumes alike. From as
    many ranks, the memory caps are applied, the sizes in effect and the changes
    scheduled after the checkpoint's step are kept (re-split where this run's bounds
    exclude them) and the time-model history is loaded. From another number of
    ranks, ``initial_batch_sizes`` hold from that step on and the history is dropped.

    Returns:
        bool: whether the checkpoint came from the same number of ranks.

    Raises:
        InfeasibleError: the checkpoint's caps cannot hold the global batch.
        ConfigError: a malformed controller history.
    """
    step = saved.step
    if saved.num_ranks != controller.num_ranks:
        schedule.restore(step, [(step, list(initial_batch_sizes))])
        controller.forget()
        return False
    if saved.max_batch_size is not None:  # memory caps learned from out-of-memory errors
        tighten_caps(controller, saved.max_batch_size)

    def fit(sizes):  # the bounds of this run may be narrower than the checkpoint's
        return sizes if controller.valid(sizes) else controller.split(sizes)
    schedule.restore(step, [(step, fit(saved.batch_sizes))] + [
        (s, fit(v)) for s, v in saved.changes if s > step])
    controller.load_state_dict(saved.controller)
    return True


class Checkpointed:
    """The callback's ``state_dict`` / ``load_state_dict`` (a part of
    :class:`~omnihvd.OmniLearnCallback`, a mixin): it reads the engine's
    ``schedule``, ``controller``, ``cadence`` and options, through
    :func:`checked_state` and :func:`restore` above."""

    def state_dict(self) -> Dict:
        """Batch sizes, time-model history and step, for the user's checkpoint: take it
        after ``on_batch_end()`` (or between epochs).

        Raises:
            ConfigError: called between ``opt.step()`` and ``on_batch_end()``: the
                model holds the step's update but the step is not counted yet, so a
                resume would run it again.
        """
        if self._updated or self._backend.updated():
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
        self._decisions.caps_before = []
        if not same and self.rank == 0:
            log.info("omnihvd: checkpoint from %d ranks resumed on %d: sizes re-split to %s",
                     saved.num_ranks, self.num_ranks, self.batch_sizes)
