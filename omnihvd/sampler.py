"""Per-rank batches of varying size cut from one global shuffled order per epoch.

Each epoch has one permutation of the dataset (from ``seed + epoch``, identical on
every rank). Global step ``j`` of the epoch owns positions ``[j*B, (j+1)*B)`` of that
order; rank ``i`` takes the slice of length ``b_i`` that starts after the slices of
ranks ``0..i-1``. So every step consumes exactly B distinct samples, every rank runs
the same number of steps, and a change of sizes -- which the schedule makes
effective at the same step on every rank -- never repeats or skips a sample.

Last partial global batch (``N mod B`` samples left over):

* ``drop_last=True`` (default): not used this epoch. The permutation changes every
  epoch, so a different handful is left out each time; every step keeps the full
  global batch B and so the same learning-rate semantics.
* ``drop_last=False``: one more, smaller step uses them, split in proportion to the
  current sizes within the same per-rank bounds as every step (``min_batch_size``,
  ``max_batch_size``, ``size_multiple``; see
  :func:`omnihvd.controller.partial_split`). When no split fits -- fewer samples
  left than the ranks' minimums add up to, e.g. 5 samples for 4 ranks of minimum 2
  -- the samples are dropped for this epoch, as with ``drop_last=True``: a rank
  below its minimum (one sample into BatchNorm) cannot take a step. When the step
  is kept, every sample is still handed out exactly once.

The sizes come from a *schedule*, any object of the protocol
:class:`omnihvd.schedule.BatchSchedule` (``rank``, ``num_ranks``,
``global_batch_size``, ``current_step`` and ``issue(step, total)``; optionally
``can_split(total) -> bool``, whether a partial step of ``total`` fits the bounds,
``register_sampler(sampler, train) -> bool`` and ``restart_pass(partial)``, called at
the start of each training pass with ``(step, total)`` of the pass's last, partial
step or None): the :class:`~omnihvd.OmniLearnCallback`,
or :class:`StaticSchedule`, a fixed one for tests and evaluation: it cuts the sizes
but weights no gradient, so training on it averages unequal batches as if equal.
For a fixed heterogeneous split in training, give the callback
``initial_batch_sizes=[...]`` and an ``adjust_every`` beyond the run's steps.

Training and evaluation samplers: only one sampler per schedule *drives* it (its
steps are the training steps the callback counts; ``train=True``, by default the
first sampler created). Any other sampler on the same callback (a validation
loader) is read-only: each of its batches has the current split's sizes, and it
records nothing, so it cannot disturb the training schedule.
"""
from typing import Dict, Iterator, List, Optional

import torch
from torch.utils.data import Sampler

from .checks import check_flag, check_int
from .errors import ConfigError
from .schedule import BatchSchedule, StaticSchedule

__all__ = ["HeterogeneousBatchSampler", "StaticSchedule"]


class HeterogeneousBatchSampler(Sampler):
    """Batch sampler: this rank's indices for each global step.

    Args:
        num_samples: the dataset's length, N.
        schedule: a :class:`~omnihvd.schedule.BatchSchedule`: the
            :class:`~omnihvd.OmniLearnCallback` (or a :class:`StaticSchedule`).
        seed: shuffling seed; must be the same on every rank.
        shuffle: permute each epoch (``seed + epoch``); False keeps dataset order.
        drop_last: policy for the last partial global batch (module docstring).
        train: whether this sampler's steps are the training steps (module
            docstring); default: True for the first sampler on the schedule, False
            for later ones (validation).

    Raises:
        ConfigError: N < B, malformed arguments, or a second ``train=True`` sampler.

    Example (two simulated ranks of sizes 2 and 3 over 10 samples)::

        >>> s0 = HeterogeneousBatchSampler(10, StaticSchedule([2, 3], 0), shuffle=False)
        >>> s1 = HeterogeneousBatchSampler(10, StaticSchedule([2, 3], 1), shuffle=False)
        >>> list(s0), list(s1)
        ([[0, 1], [5, 6]], [[2, 3, 4], [7, 8, 9]])

    Use it as ``DataLoader(dataset, batch_sampler=sampler)``; call
    ``sampler.set_epoch(epoch)`` before each epoch.
    """

    def __init__(self, num_samples: int, schedule, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, train: Optional[bool] = None):
        if not isinstance(schedule, BatchSchedule):
            missing = [name for name in ("rank", "num_ranks", "global_batch_size", "current_step",
                                         "issue") if not hasattr(schedule, name)]
            raise ConfigError("schedule must be an OmniLearnCallback (or provide %s); got %s"
                              % (", ".join(missing), type(schedule).__name__))
        # as ints: a numpy seed or length would reach torch.Generator.manual_seed
        num_samples = check_int("num_samples", num_samples, 1, "len(dataset)")
        seed = check_int("seed", seed, 0, "the same on every rank", maximum=2 ** 62 - 1)
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last),
                           ("train", True if train is None else train)):
            check_flag(name, flag)
        if num_samples < schedule.global_batch_size:
            raise ConfigError("the dataset has %d samples, fewer than global_batch_size %d: not "
                              "even one step fits; lower global_batch_size"
                              % (num_samples, schedule.global_batch_size))
        self.num_samples = num_samples
        self.schedule = schedule
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.train = True if train is None else train
        if hasattr(schedule, "register_sampler"):  # lets the callback check ranks agree
            self.train = schedule.register_sampler(self, train)
        self._resume_step = 0      # step of the epoch to start from (after a resume)
        self._epoch_base: Optional[int] = None  # global step of the epoch's step 0
        self._pass_start: Optional[int] = None  # where the epoch's latest pass started

    # -------------------------------------------------------------- geometry
    @property
    def global_batch_size(self) -> int:
        return self.schedule.global_batch_size

    def _partial(self) -> int:
        """Size of the last partial step, 0 when there is none (or it is dropped)."""
        rest = self.num_samples % self.global_batch_size
        if self.drop_last or rest < self.schedule.num_ranks:
            return 0
        fits = getattr(self.schedule, "can_split", None)
        if fits is not None and not fits(rest):
            return 0
        return rest

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size + (1 if self._partial() else 0)

    def __len__(self) -> int:
        """Steps of the epoch's current pass (from a resume position: the rest). The
        same all through the pass, also once a prefetching DataLoader has drawn its
        last batch ahead of the loop."""
        start = self._resume_step if self._pass_start is None else self._pass_start
        return self.steps_per_epoch - start

    # --------------------------------------------------------------- epochs
    def set_epoch(self, epoch: int):
        """Choose the epoch's permutation. Keeps a resume position only for its own
        epoch, and the position of a pass in progress when called again with its
        epoch."""
        epoch = check_int("epoch", epoch, 0)   # np.int64 from np.arange works too
        if epoch != self.epoch:
            self._resume_step = 0
            self._epoch_base = self._pass_start = None
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        """The epoch's global order of sample indices (identical on every rank)."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[List[int]]:
        order = self.order()
        B = self.global_batch_size
        rank = self.schedule.rank
        full_steps = self.num_samples // B
        start = self._pass_start = self._resume_step
        base = self.schedule.current_step - start
        # decided once for the pass (asked again at hand-out, with the bounds of a later
        # step, the answer could differ between ranks that hand out at different steps)
        partial = self._partial()
        if self.train:
            self._epoch_base = base
            restart = getattr(self.schedule, "restart_pass", None)
            if restart is not None:   # a pass left early handed out steps never run
                restart((base + full_steps, partial) if partial else None)
        for j in range(start, full_steps + (1 if partial else 0)):
            total = B if j < full_steps else partial
            if self.train:
                sizes = self.schedule.issue(base + j, total)
            else:  # the current split, recorded nowhere: the training schedule is untouched
                sizes = self.schedule.issue(self.schedule.current_step, total, record=False)
            if sizes is None:  # the bounds changed since __len__: no split holds this step
                break
            offset = j * B + sum(sizes[:rank])
            yield order[offset:offset + sizes[rank]].tolist()
        self._resume_step = 0

    # ---------------------------------------------------------- checkpoints
    def position(self) -> int:
        """Steps of the current epoch already consumed by the training loop."""
        if self._epoch_base is None:
            return self._resume_step
        return min(self.schedule.current_step - self._epoch_base, self.steps_per_epoch)

    def state_dict(self) -> Dict:
        """Epoch and position, to resume mid-epoch (also on a different rank count)."""
        return {"epoch": self.epoch, "step_in_epoch": self.position(), "seed": self.seed,
                "num_samples": self.num_samples, "global_batch_size": self.global_batch_size,
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: Dict):
        """Resume: the next iteration of ``state['epoch']`` continues where it stopped.

        Raises:
            ConfigError: the checkpoint was made with another dataset length, seed,
                global batch size, ``shuffle`` or ``drop_last``, so positions would not
                mean the same samples.
        """
        if not isinstance(state, dict):
            raise ConfigError("not a HeterogeneousBatchSampler state_dict: expected a dict, got %s"
                              % type(state).__name__)
        # shuffle and drop_last: absent in older checkpoints, then not compared
        for key in ("num_samples", "seed", "global_batch_size", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError("sampler checkpoint has %s=%r but this run has %r; resume with "
                                  "the same dataset, seed, global batch size, shuffle and "
                                  "drop_last" % (key, state[key], getattr(self, key)))
        step, epoch = (check_int(key, state.get(key), 0,
                                 where="not a HeterogeneousBatchSampler state_dict: ")
                       for key in ("step_in_epoch", "epoch"))
        # an epoch's partial step may be kept on one rank count and dropped on another:
        # a checkpoint past the steps this run has means the epoch was done
        most = -(-self.num_samples // self.global_batch_size)
        if not 0 <= step <= most:
            raise ConfigError("sampler checkpoint position %d is outside the epoch (0..%d)"
                              % (step, most))
        self.epoch = epoch
        self._resume_step = min(step, self.steps_per_epoch)
        self._epoch_base = self._pass_start = None

