"""Which batch feeds which step: the checks that keep a loop from training a batch
with another step's weights.

The gradient weights assume that the step trains a batch of this rank's scheduled
size, cut for that step. :class:`BatchChecks` holds what the callback knows of the
batches a loop fetched through ``cb.wrap(loader)`` (or passed to
``on_batch_begin(batch=...)``) and refuses, with a ConfigError naming the rank and
the step, a batch of another size, a batch skipped or trained in place of another,
and a loop that runs on batches the training sampler did not hand out. The
training samplers' settings and places, which every rank's must share, are
compared at each gather (:func:`training_sampler_place`).
"""
import logging

from .checks import check_flag
from .errors import ConfigError
from .losses import check_batch_length
from .timing import TimedIterable

__all__ = ["BatchChecks", "sampler_place", "training_sampler_place"]

log = logging.getLogger("omnihvd")


def sampler_place(sampler) -> tuple:
    """What every rank's sampler must share: its settings, epoch and position."""
    return (sampler.num_samples, sampler.seed, sampler.shuffle, sampler.drop_last,
            sampler.epoch, sampler.position())


def training_sampler_place(schedule) -> tuple:
    """The training sampler's settings and place, which every rank's must match at
    each gather (one created, loaded or set to an epoch differently on some rank
    after on_train_begin would repeat samples, or end the epochs apart)."""
    return tuple(sampler_place(s) for s in schedule.samplers if getattr(s, "train", False))


class BatchChecks:
    """The batches of the running step, checked against its sizes.

    Args:
        schedule: the callback's :class:`~omnihvd.schedule.SizeSchedule` (its
            ``rank``, ``step``, samplers).
        timer: the callback's :class:`~omnihvd.timing.StepTimer` (fetches are work).

    The callback calls :meth:`begin` at ``on_batch_begin`` and :meth:`end` at
    ``on_batch_end``, each with the step's sizes.
    """

    def __init__(self, schedule, timer):
        self.schedule, self.timer = schedule, timer
        self.unchecked = None   # the batch cb.wrap last yielded, not yet checked
        self.checked = False    # this step's batch was checked (begin or end)
        self._ahead = False     # unchecked was fetched for the next step
        self._warned = False

    def wrap(self, loader, check: bool = True):
        """``loader`` with each ``next()`` timed as work (:meth:`OmniLearnCallback.wrap`)."""
        check_flag("check", check)
        if getattr(loader, "num_workers", 0) and getattr(loader, "in_order", True) is False:
            raise ConfigError("DataLoader(in_order=False) yields batches as its workers finish "
                              "them, not in the sampler's order: a step could train another "
                              "step's batch, weighted with that step's sizes; omnihvd's sampler "
                              "needs in_order=True (the default)")
        sampler = getattr(loader, "batch_sampler", None)
        if sampler in self.schedule.samplers and not sampler.train:
            return loader
        return TimedIterable(loader, self.timer.add, restart=self._restart,
                             seen=self._fetched if check else None,
                             ended=self._ended if check else None)

    def _fetched(self, batch):
        """``cb.wrap`` yielded ``batch``: check it at the next hook."""
        self._no_lost_batch("fetched another one")
        self.unchecked = batch

    def _restart(self):
        """A new pass over the wrapped loader: a batch fetched ahead by a pass left
        early (``break``) is void, as are its charges."""
        self.unchecked, self._ahead = None, False
        self.timer.discard_extra()

    def _ended(self):
        self._no_lost_batch("reached the loader's end")

    def _no_lost_batch(self, then):
        # A batch fetched after this step's (checked) batch must be the next step's,
        # fetched ahead; another fetch, or the loader's end, before that step began
        # means the loop trained it in place of its own batch, or skipped it.
        if self.unchecked is not None and self._ahead:
            raise ConfigError(
                "rank %d fetched a batch from cb.wrap(loader) after on_batch_begin() of step "
                "%d and then %s before the next on_batch_begin(): that batch was trained in "
                "place of the step's own (with its weights) or skipped; fetch each batch "
                "once, for the step that trains it"
                % (self.schedule.rank, self.schedule.step - 1, then))

    def begin(self, batch, sizes):
        """At ``on_batch_begin``: ``batch`` (else the one ``cb.wrap`` yielded, if
        any) holds this rank's size of ``sizes``."""
        if batch is None or isinstance(batch, int):   # cb.wrap's batch for this step, if any
            batch = self.unchecked
        self.unchecked, self._ahead = None, False
        self.checked = batch is not None and not isinstance(batch, int)
        if self.checked:
            self.check(batch, sizes)

    def end(self, sizes):
        """At ``on_batch_end``: check a batch ``cb.wrap`` yielded after ``begin``."""
        if self.unchecked is not None and not self.checked:
            # cb.wrap yielded this step's batch after on_batch_begin
            batch, self.unchecked = self.unchecked, None
            self.checked = True
            self.check(batch, sizes)
        elif self.unchecked is not None:
            # with this step's batch checked, it is the next step's, fetched ahead
            # (checked then; _no_lost_batch if it never gets there)
            self._ahead = True
        if not self.checked and not self.schedule.driven and not self._warned:
            self._warned = True
            log.warning("omnihvd: rank %d: no HeterogeneousBatchSampler feeds this callback and "
                        "the batches are not checked: the loop must cut each batch at "
                        "cb.batch_size (cb.batch_sizes_at(cb.step) in an epoch's partial step), "
                        "or the gradient is weighted wrongly -- a DataLoader with batch_size= "
                        "and a DistributedSampler keeps equal sizes. Use the sampler, or pass "
                        "on_batch_begin(batch=...) or iterate cb.wrap(loader) to have each "
                        "batch checked", self.schedule.rank)

    def check(self, batch, sizes):
        """ConfigError when ``batch`` does not hold this rank's size of ``sizes``."""
        check_batch_length(batch, sizes[self.schedule.rank], self.schedule.rank,
                           self.schedule.step)

    def check_sampler(self):
        """The training sampler must hand out the steps the loop runs: by this step's
        start it has handed out the previous one at least (the current one too unless
        the loop fetches after ``on_batch_begin``).

        Raises:
            ConfigError: the loop runs on another loader's batches (a validation
                sampler created first drives the schedule, and the training one, read
                only, hands out sizes that prefetching makes stale: wrong weights).
        """
        step = self.schedule.step
        if self.schedule.driven and self.schedule.issued_upto < step - 1:
            raise ConfigError(
                "step %d runs on batches the training sampler did not hand out (it handed out "
                "steps up to %d): the training sampler is the HeterogeneousBatchSampler created "
                "with train=True, by default the first one created on this callback; create "
                "validation samplers after it, or with train=False; create the training sampler "
                "once (sampler.set_epoch(epoch) each epoch), not once per epoch"
                % (step, self.schedule.issued_upto))
