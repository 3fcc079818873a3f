"""The size schedule: which batch size every rank uses at every global step.

Decisions are made at one step and take effect at a later one (the first step no
rank's sampler has handed out yet: a ``DataLoader`` with workers prefetches). So the
schedule is a list of ``(first step, sizes)`` changes plus a record of what the
sampler already handed out for steps not yet run, and the step counter the sampler
reads. Pure Python: no torch, horovod or mpi4py.

:class:`BatchSchedule` is the protocol a sampler depends on;
:class:`~omnihvd.OmniLearnCallback` (through its :class:`SizeSchedule`, which
:class:`ScheduledSizes` exposes) and :class:`StaticSchedule` implement it.
"""
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from .checks import check_int
from .controller import apportion
from .errors import ConfigError

__all__ = ["BatchSchedule", "SizeSchedule", "ScheduledSizes", "StaticSchedule"]


@runtime_checkable
class BatchSchedule(Protocol):
    """What a sampler needs from whoever decides the batch sizes.

    ``issue(step, total)`` returns every rank's size for global step ``step`` holding
    ``total`` samples (``global_batch_size``, or fewer for an epoch's last partial
    step); the same step gives the same sizes on every rank. ``current_step`` is the
    number of steps completed. A schedule may also have ``can_split(total)`` (whether a
    partial step of ``total`` fits the bounds) and ``register_sampler(sampler, train)
    -> bool``, which samplers call once so that their settings join the cross-rank
    check; it says whether the sampler drives the schedule (training) or only reads
    it (evaluation: ``issue(step, total, record=False)``); and ``restart_pass()``,
    which a training sampler calls as each pass over its data begins (steps an
    earlier pass handed out but the loop never ran are void).
    """

    rank: int
    num_ranks: int
    global_batch_size: int

    @property
    def current_step(self) -> int: ...

    def issue(self, step: int, total: int) -> List[int]: ...


class SizeSchedule:
    """The sizes of every global step: decided changes and what was handed out.

    Args:
        rank, num_ranks: this rank and the world size.
        global_batch_size: B.
        sizes: the sizes from ``step`` on.
        step: steps completed (after a resume: the checkpoint's step).
        partial: ``(sizes, total, step) -> sizes or None``: the split of an epoch's
            last, partial step ``step`` (default :func:`omnihvd.controller.apportion`;
            None when no split fits the bounds in force at ``step``).

    >>> s = SizeSchedule(0, 2, 10, [5, 5])
    >>> s.issue(0, 10), s.issue(1, 10)          # a prefetching loader hands out two steps
    ([5, 5], [5, 5])
    >>> s.lookahead                              # step 1 is handed out, step 0 runs
    1
    >>> s.change(2, [3, 7]); s.advance()
    >>> s.batch_sizes_at(1), s.batch_sizes_at(2), s.issue(4, 6)
    ([5, 5], [3, 7], [2, 4])
    """

    def __init__(self, rank: int, num_ranks: int, global_batch_size: int, sizes: Sequence[int],
                 step: int = 0, partial: Optional[Callable] = None):
        self.rank, self.num_ranks, self.global_batch_size = rank, num_ranks, global_batch_size
        self._partial = partial or (lambda sizes, total, step: apportion(sizes, total))
        self.samplers: List = []
        self.driven = False   # a training sampler (train=True) hands out the steps
        self.restore(step, [(step, list(sizes))])

    def restore(self, step: int, changes: List[Tuple[int, List[int]]]):
        """Start over at ``step`` with ``changes`` (the first holds from ``step`` on)."""
        self.step = step
        self._changes = [(s, list(v)) for s, v in changes]
        self._issued: Dict[int, List[int]] = {}  # step -> sizes the sampler handed out
        self._issued_upto = step - 1
        self._max_lookahead = 0
        self._completed_one = False   # a step completed since this start
        self._partial_step: Optional[Tuple[int, int]] = None   # (step, total) of this pass

    @property
    def current_step(self) -> int:
        """Steps completed so far (the index of the step about to run)."""
        return self.step

    def batch_sizes_at(self, step: int) -> List[int]:
        """All ranks' sizes for global step ``step`` (the running one or a later one)
        as scheduled now; an epoch's last, partial step: as handed out, or as it will
        be (a loop that fetches its batch after ``on_batch_begin``)."""
        if step in self._issued:
            return list(self._issued[step])
        sizes = self.split_at(step)
        if self._partial_step is not None and self._partial_step[0] == step:
            sizes = self._partial(sizes, self._partial_step[1], step) or sizes
        return sizes

    def split_at(self, step: int) -> List[int]:
        """The split of B in force at global step ``step`` (a partial step is cut from it)."""
        sizes = self._changes[0][1]
        for first, s in self._changes:
            if first > step:
                break
            sizes = s
        return list(sizes)

    def issue(self, step: int, total: int, record: bool = True) -> Optional[List[int]]:
        """Sizes of global step ``step`` holding ``total`` samples (the sampler's call);
        None for a partial step no split fits. ``record=False`` (an evaluation
        sampler) leaves the schedule untouched."""
        sizes = self.split_at(step)
        if total != self.global_batch_size:  # the last, partial step of an epoch
            sizes = self._partial(sizes, total, step)
            if sizes is None:
                return None
        if record:
            self._issued[step] = sizes
            self._issued_upto = max(self._issued_upto, step)
            self._max_lookahead = max(self._max_lookahead, step - self.step)
        return list(sizes)

    def restart(self, partial: Optional[Tuple[int, int]] = None):
        """A training sampler starts a new pass: steps handed out by an earlier pass
        but never run (a loop that broke out of its epoch) are void. ``partial``:
        ``(step, total)`` of the pass's last, partial step, or None."""
        self._issued = {s: v for s, v in self._issued.items() if s < self.step}
        self._issued_upto = self.step - 1
        self._partial_step = partial

    def register_sampler(self, sampler, train: Optional[bool] = None) -> bool:
        """Samplers register once; their settings join the cross-rank check.

        Returns whether the sampler drives the schedule: ``train``, or by default
        True for the first sampler only (later ones, e.g. validation, only read).

        Raises:
            ConfigError: a second sampler asks for ``train=True``.
        """
        if train is None:
            train = not self.driven
        elif train and self.driven:
            raise ConfigError("a training sampler (train=True) is already registered with this "
                              "callback; create evaluation samplers with train=False")
        self.samplers.append(sampler)
        self.driven = self.driven or bool(train)
        return bool(train)

    def can_split(self, total: int) -> bool:
        """Whether a partial step of ``total`` samples fits the bounds: those in force
        at the running pass's partial step when it has one of ``total`` samples (the
        same answer all through the pass, on every rank), else those now."""
        step = self.step
        if self._partial_step is not None and self._partial_step[1] == total:
            step = max(self._partial_step[0], self.step)
        return self._partial(self.batch_sizes_at(step), total, step) is not None

    @property
    def issued_upto(self) -> int:
        """The last step a training sampler handed out (``current_step - 1``: none yet)."""
        return self._issued_upto

    @property
    def handed_out(self) -> bool:
        """Whether a sampler already handed out the step about to run."""
        return self._issued_upto >= self.step

    @property
    def lookahead(self) -> int:
        """How many steps beyond the running one (``current_step``) the sampler has
        handed out: the most seen so far, since a loader's prefetch depth varies (it
        is deepest at an epoch's start) and a change must start after all of it."""
        return max(self._max_lookahead, self._issued_upto - self.step, 0)

    @property
    def decision_lookahead(self) -> int:
        """The look-ahead a decision gathered now must clear: :attr:`lookahead`, and one
        more before the first step completes -- a loop that fetches its next batch
        after ``opt.step()`` (after the gather was posted in ``on_batch_begin``) hands
        out one more step before the decision, and has no history yet that shows it."""
        return self.lookahead + (not self._completed_one)

    @property
    def latest(self) -> List[int]:
        """The sizes of the last scheduled change (in effect now or later)."""
        return list(self._changes[-1][1])

    def upcoming(self) -> List[Tuple[int, List[int]]]:
        """Scheduled changes that have not started yet."""
        return [(s, list(v)) for s, v in self._changes if s > self.step]

    def change(self, first_step: int, sizes: Sequence[int]):
        """Use ``sizes`` from ``first_step`` on.

        Raises:
            RuntimeError: a sampler already handed out ``first_step``: the loop trained
                fewer batches than its loader yielded (a skipped batch), or omnihvd's
                own bug (the cadence chooses a step after every rank's look-ahead).
        """
        if first_step <= self._issued_upto:
            raise RuntimeError(
                "omnihvd: rank %d already handed out step %d, so new sizes cannot start at "
                "step %d. A loop that skips a batch its loader yielded (a `continue` after "
                "cb.on_batch_begin(), a NaN guard that fetches a replacement) does this: call "
                "on_batch_end() for every batch the loader yields (cb.wrap(loader) checks "
                "it); otherwise it is omnihvd's bug: please report it with your DataLoader "
                "settings" % (self.rank, self._issued_upto, first_step))
        self._changes = [c for c in self._changes if c[0] < first_step] + [(first_step, list(sizes))]

    def advance(self):
        """One step completed."""
        self.step += 1
        self._completed_one = True
        self._issued = {s: v for s, v in self._issued.items() if s >= self.step}
        while len(self._changes) > 1 and self._changes[1][0] <= self.step:
            # the next change is in effect: earlier ones are never read again (no step
            # before the current one is asked for), so a long run's schedule stays short
            del self._changes[0]


class ScheduledSizes:
    """The :class:`BatchSchedule` protocol and the size properties of an object that
    keeps its sizes in a :class:`SizeSchedule` (``self.schedule``) and has ``rank``:
    what :class:`~omnihvd.OmniLearnCallback` shows its samplers and its users."""

    schedule: SizeSchedule
    rank: int

    @property
    def step(self) -> int:
        """Steps completed so far (global, across epochs)."""
        return self.schedule.step

    @property
    def current_step(self) -> int:
        """Steps completed so far (the index of the step about to run)."""
        return self.schedule.step

    @property
    def batch_sizes(self) -> List[int]:
        """Every rank's current batch size (the same list on every rank); sums to B.
        An epoch's last, partial step (``drop_last=False``) is cut from it:
        :meth:`batch_sizes_at` of the step gives what that step's batches hold."""
        return self.schedule.split_at(self.schedule.step)

    @property
    def batch_size(self) -> int:
        """This rank's current batch size, b_i (of :attr:`batch_sizes`)."""
        return self.batch_sizes[self.rank]

    def batch_sizes_at(self, step: int) -> List[int]:
        """All ranks' sizes for global step ``step``, the running one (``cb.step``)
        or a later one, as scheduled now (a partial step's own sizes); a finished
        step's sizes are not kept (``cb.history`` records the decisions)."""
        return self.schedule.batch_sizes_at(step)

    def issue(self, step: int, total: int, record: bool = True) -> Optional[List[int]]:
        """Sizes of global step ``step`` holding ``total`` samples (called by the sampler).

        A partial step (``total < B``) is split within the bounds, or None when no
        split fits (the sampler then drops it). ``record=False`` (evaluation
        samplers) leaves the schedule untouched.
        """
        return self.schedule.issue(step, total, record)

    def can_split(self, total: int) -> bool:
        """Whether a partial step of ``total`` samples fits the per-rank bounds now."""
        return self.schedule.can_split(total)

    def restart_pass(self, partial: Optional[Tuple[int, int]] = None):
        """Called by the training sampler at the start of each pass over its data, with
        ``(step, total)`` of the pass's last, partial step (None: it has none)."""
        self.schedule.restart(partial)

    def register_sampler(self, sampler, train: Optional[bool] = None) -> bool:
        """Called by :class:`~omnihvd.HeterogeneousBatchSampler`: its dataset length,
        seed, shuffle and drop_last join the cross-rank check at ``on_train_begin``
        (ranks with different seeds would silently repeat and skip samples), and the
        training sampler's, with its epoch and place in it, that of every gather.

        Returns whether the sampler drives the schedule (its steps are the training
        steps): ``train``, or by default True for the first sampler only. Others (a
        validation loader) read the current sizes and record nothing.

        Raises:
            ConfigError: a second sampler asks for ``train=True``.
        """
        return self.schedule.register_sampler(sampler, train)


class StaticSchedule:
    """A schedule with fixed sizes, for one rank of a simulated or static world (tests,
    evaluation): it weights no gradient, so do not train on it (see
    :mod:`omnihvd.sampler`).

    >>> s = StaticSchedule([2, 3], rank=1)
    >>> s.issue(0, 5), s.global_batch_size
    ([2, 3], 5)
    """

    def __init__(self, batch_sizes, rank: int = 0):
        if not isinstance(batch_sizes, (list, tuple)) or not batch_sizes or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in batch_sizes):
            raise ConfigError("batch_sizes must be a non-empty list of ints >= 1, got %r"
                              % (batch_sizes,))
        self.rank = check_int("rank", rank, 0, maximum=len(batch_sizes) - 1)
        self.batch_sizes = list(batch_sizes)
        self.num_ranks = len(self.batch_sizes)
        self.global_batch_size = sum(self.batch_sizes)
        self.current_step = 0

    def issue(self, step: int, total: int, record: bool = True) -> List[int]:
        if total == self.global_batch_size:
            return list(self.batch_sizes)
        return apportion(self.batch_sizes, total)
