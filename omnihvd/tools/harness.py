"""One training loop for the benchmarks: epochs, steps and the callback's hooks, in order.

Every benchmark trains with the same shape of loop (DESIGN.md's drop-in lines plus
an emulator and per-step timing). :func:`steps` owns that shape once; the body of
the loop is only what differs: the model's forward and backward, ``opt.step()``,
and what the benchmark records.

Example (each rank; ``cb`` may be None for plain Horovod, ``emu`` None for no
emulation)::

    with harness.steps(cb, sampler, max_steps=200, emulator=emu) as run:
        for step in run:
            idx = torch.as_tensor(step.batch)
            opt.zero_grad(); loss_fn(model(x[idx]), y[idx]).backward()
            step.compute_done()      # emulator finish: the rank's own work ends here
            opt.step()
    # or step.end() in the body, to run cb.on_batch_end() and read step.step_s there

The hooks run in this order, on every rank::

    cb.on_train_begin()                                  # entering the with block
    per epoch: sampler.set_epoch(e); cb.on_epoch_begin(e)
        per step: cb.on_batch_begin(); emulator.start(i)
                  (body: forward, backward, step.compute_done() -> emulator.finish(b),
                   opt.step())
                  cb.on_batch_end()    # step.end(), or when the body asks for the next step
        cb.on_epoch_end(e)           # also after a partial epoch
    cb.on_train_end()                                    # leaving the with block

The loop ends after ``max_steps`` steps or when ``stop`` says so, always between two
complete steps and after the epoch's end, so every rank runs the same steps (and
collectives) when ``stop`` returns the same on every rank. A ``break`` in the body
abandons the current step (no ``on_batch_end``) and still ends the epoch and the run.
An exception calls no further hook (as in Keras): it leaves the with block with the
callback as it was, so the callback's abort-on-exception handler, which
``on_train_end`` would remove, still ends the whole job with this rank named.
"""
import contextlib
import time
from typing import Any, Callable, Iterable, Iterator, Optional

from ..errors import ConfigError

__all__ = ["Step", "Run", "steps"]


class Step:
    """One training step: its batch, and the moments at which its phases ended.

    Attributes:
        index: the global step (0-based, counted across epochs and resumes).
        epoch: the epoch it belongs to.
        batch: what the batches iterable yielded (an index list, a DataLoader's batch).
        size: its number of samples (the ``size`` function of :func:`steps`).
        t_prev: ``time.perf_counter()`` at the previous step's end (or the loop's start,
            or the last :meth:`Run.restart_clock`).
        t_begin, t_work, t_wait, t_synced, t_end: before ``cb.on_batch_begin()``,
            after it (the rank's own work begins), at :meth:`compute_done` (the wait
            for other ranks begins), when :meth:`end` is called (``opt.step()`` has
            returned), and after ``cb.on_batch_end()``. Those not reached yet are None.
    """

    def __init__(self, run: "Run", index: int, epoch: int, batch: Any, size: int, t_prev: float):
        self._run = run
        self.index, self.epoch, self.batch, self.size = index, epoch, batch, size
        self.t_prev = t_prev
        self.t_begin = self.t_work = self.t_wait = self.t_synced = self.t_end = None

    @property
    def ended(self) -> bool:
        """True once :meth:`end` has run."""
        return self.t_end is not None

    def compute_done(self) -> None:
        """The rank's own work for this step ends here: call it right before ``opt.step()``.

        Finishes the emulator (it sleeps until the step has taken its emulated time)
        and marks ``t_wait``.

        Raises:
            ConfigError: called twice, or after :meth:`end`.
        """
        if self.t_wait is not None or self.ended:
            raise ConfigError("step %d: compute_done() called twice or after end(); call it "
                              "once, right before opt.step()" % self.index)
        if self._run.emulator is not None:
            cb = self._run.callback
            # the emulated device's time: work, though it comes after the backward pass
            with contextlib.nullcontext() if cb is None else cb.working():
                self._run.emulator.finish(self.size)
        self.t_wait = time.perf_counter()

    def end(self) -> None:
        """Finish the step now: ``cb.on_batch_end()``. Called by the loop if the body does not.

        Call it in the body to run code after the callback's end of step (a
        checkpoint at ``cb.step``, reading ``cb.history`` or :attr:`step_s`).

        Raises:
            ConfigError: with an emulator, :meth:`compute_done` was not called.
        """
        if self.ended:
            return
        if self.t_wait is None and self._run.emulator is not None:
            raise ConfigError("step %d ended without step.compute_done(); with an emulator the "
                              "body must call it right before opt.step()" % self.index)
        self.t_synced = time.perf_counter()
        if self._run.callback is not None:
            self._run.callback.on_batch_end()
        self.t_end = self._run._clock = time.perf_counter()
        self._run.step += 1

    @property
    def hook_s(self) -> float:
        """Seconds spent in ``on_batch_begin`` and ``on_batch_end``."""
        return (self.t_work - self.t_begin) + (self.t_end - self.t_synced)

    @property
    def local_s(self) -> Optional[float]:
        """This rank's own work: after ``on_batch_begin`` until :meth:`compute_done`
        (None when it was not called)."""
        return None if self.t_wait is None else self.t_wait - self.t_work

    @property
    def step_s(self) -> float:
        """Wall time since the previous step ended: the step as the job sees it,
        including fetching its batch and every hook."""
        return self.t_end - self.t_prev


class Run:
    """The loop of :func:`steps`: a context manager to iterate over once.

    Attributes:
        step: steps complete, counted from 0 (``first_step`` plus the steps ended in this
            run): after :meth:`Step.end`, the index of the next step.
        epoch: the current (or, after the loop, the last) epoch.
        finished: the loop reached ``max_steps`` or ``stop`` (not a break).
    """

    def __init__(self, callback, sampler, batches, *, max_steps, stop, emulator, first_step,
                 first_epoch, size):
        if batches is None and sampler is None:
            raise ConfigError("steps() needs batches or a sampler to iterate over")
        if max_steps is not None and (isinstance(max_steps, bool) or
                                      not isinstance(max_steps, int) or max_steps < 0):
            raise ConfigError("max_steps must be an int >= 0 or None, got %r" % (max_steps,))
        if max_steps is None and stop is None:
            raise ConfigError("steps() needs max_steps or stop, or the loop never ends")
        self.callback, self.sampler, self.emulator = callback, sampler, emulator
        self.batches = sampler if batches is None else batches
        self.max_steps, self.stop_when, self.size_of = max_steps, stop, size
        self.step, self.epoch = first_step, first_epoch
        self.finished = False
        self._entered = self._iterated = self._epoch_open = False
        self._clock = None

    def __enter__(self) -> "Run":
        if self._entered:
            raise ConfigError("a harness run can be entered once; call steps() again")
        self._entered = True
        if self.callback is not None:
            self.callback.on_train_begin()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            return False  # no hook: the callback's abort-on-exception must see it intact
        self._end_epoch()
        if self.callback is not None:
            self.callback.on_train_end()
        return False

    def restart_clock(self) -> None:
        """The time until now is not training time: the next step's ``step_s`` starts here.

        Call it between two steps, after :meth:`Step.end` (e.g. after an evaluation).
        """
        self._clock = time.perf_counter()

    def _end_epoch(self):
        if self._epoch_open:
            self._epoch_open = False
            if self.callback is not None:
                self.callback.on_epoch_end(self.epoch)

    def _reached(self) -> bool:
        return self.max_steps is not None and self.step >= self.max_steps

    def __iter__(self) -> Iterator[Step]:
        if not self._entered:
            raise ConfigError("iterate a harness run inside its with block: "
                              "`with harness.steps(...) as run: for step in run: ...`")
        if self._iterated:
            raise ConfigError("a harness run can be iterated once; call steps() again")
        self._iterated = True
        return self._steps()

    def _steps(self) -> Iterator[Step]:
        cb = self.callback
        self._clock = time.perf_counter()
        first = True
        while not (self.finished or self._reached()):
            if self.sampler is not None:
                self.sampler.set_epoch(self.epoch)
            if cb is not None:
                cb.on_epoch_begin(self.epoch)
            self._epoch_open = True
            ran = 0
            for batch in self.batches:
                step = Step(self, self.step, self.epoch, batch, self.size_of(batch), self._clock)
                step.t_begin = time.perf_counter()
                if cb is not None:
                    cb.on_batch_begin()
                step.t_work = time.perf_counter()
                if self.emulator is not None:
                    self.emulator.start(step.index)
                yield step
                step.end()
                ran += 1
                # stop is asked once per step: it may run a collective (agreeing on it)
                if self._reached() or (self.stop_when is not None and self.stop_when(step)):
                    self.finished = True
                    break
            # a resumed run may start at an epoch's very end; an empty epoch after that
            # would repeat forever
            if not ran and not first:
                raise ConfigError("epoch %d yielded no batch at step %d; the loop would never "
                                  "reach its end (is the dataset smaller than one global "
                                  "batch?)" % (self.epoch, self.step))
            first = False
            self._end_epoch()
            if not self.finished:
                self.epoch += 1
        self.finished = True


def steps(callback=None, sampler=None, batches: Optional[Iterable] = None, *,
          max_steps: Optional[int] = None, stop: Optional[Callable[[Step], bool]] = None,
          emulator=None, first_step: int = 0, first_epoch: int = 0,
          size: Callable[[Any], int] = len) -> Run:
    """The training loop's shape, once: use as ``with steps(...) as run: for step in run:``.

    Args:
        callback: an OmniLearnCallback (or anything with its hook names), or None for
            plain Horovod.
        sampler: its ``set_epoch(epoch)`` runs before each epoch (None: no sampler).
        batches: iterated once per epoch (a DataLoader, a batch sampler); default: the
            sampler itself.
        max_steps: end once step ``max_steps`` is reached, counting from 0 (a resumed
            run with ``first_step=k`` runs ``max_steps - k`` more).
        stop: ``stop(step) -> bool``, asked after each complete step; True ends the
            loop. It must answer the same on every rank (agree, e.g. by an allreduce).
        emulator: an :class:`omnihvd.tools.emulate.Emulator` (``start(step)`` after
            ``on_batch_begin``, ``finish(size)`` in :meth:`Step.compute_done`), or None.
        first_step, first_epoch: where a resumed run starts (e.g. ``cb.step`` and
            ``sampler.epoch`` after loading a checkpoint).
        size: ``size(batch)`` -> its number of samples (for ``(x, y)`` batches from a
            DataLoader: ``lambda b: len(b[0])``).

    Returns:
        :class:`Run`.

    Raises:
        ConfigError: no batches, no end (neither ``max_steps`` nor ``stop``), a bad
            ``max_steps``; while iterating: an epoch without batches, misuse of a
            :class:`Step` (see its methods).

    >>> class Hooks:
    ...     def __getattr__(self, name):
    ...         return lambda *args: print(name, *args)
    >>> with steps(Hooks(), batches=[[0, 1], [2, 3]], max_steps=3) as run:
    ...     for step in run:
    ...         print("step", step.index, step.batch)
    on_train_begin
    on_epoch_begin 0
    on_batch_begin
    step 0 [0, 1]
    on_batch_end
    on_batch_begin
    step 1 [2, 3]
    on_batch_end
    on_epoch_end 0
    on_epoch_begin 1
    on_batch_begin
    step 2 [0, 1]
    on_batch_end
    on_epoch_end 1
    on_train_end
    """
    return Run(callback, sampler, batches, max_steps=max_steps, stop=stop, emulator=emulator,
               first_step=first_step, first_epoch=first_epoch, size=size)
