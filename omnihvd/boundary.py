"""Where a step's local time ends: the *wait boundary*, and the optimizer's step hooks
that find it (a part of :class:`~omnihvd.OmniLearnCallback`, a mixin).

A rank's local time runs from the step's start (``on_batch_begin``) to the moment
it starts waiting for its peers: the entry of ``opt.step()`` (Horovod's optimizer
synchronises there), DDP's last gradient bucket, or :meth:`StepBoundary.mark_compute_end`.
Between the model's passes the timer is paused (:mod:`omnihvd.segments`), so a
collective the loop runs there is no rank's work; ``with cb.working():`` counts
what it wraps. At the boundary the step's time goes to the cadence's window
(:meth:`StepBoundary._record`); the optimizer's update after the gradients'
synchronisation is timed too and charged to the next step, as data loading is.

The mixin reads the engine's ``_timer``, ``_backend``, ``cadence``, ``_options``,
``_model``, ``_step_sizes``, ``_meter``, ``_begun_step`` and ``ends_at_step``, and
keeps the step's ``_drop_sample``, ``_recorded``, ``_update_began``,
``_step_depth`` and ``last_step_time``.
"""
import logging
import math
import time

from .cpuquota import SPREAD_FIX, cpu_quota_cores, quota_spread, usable_cpus

__all__ = ["StepBoundary"]

log = logging.getLogger("omnihvd")


class StepBoundary:
    """The step's wait boundary and the optimizer's step hooks (module docstring)."""

    def _step_hooks(self, optimizer) -> list:
        """The optimizer's step hooks: the wait boundary, and the step's end."""
        return [optimizer.register_step_pre_hook(self._on_step_entry),
                optimizer.register_step_post_hook(self._on_step_exit)]

    def _timing_open(self) -> bool:
        """Whether the current step's local time is still running (no wait boundary yet)."""
        return self._timer.running

    def _discard_step_time(self):
        """Do not use the current step's local time (it holds no clean boundary)."""
        self._drop_sample = True

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
        if self._timer.marked or self._timer.paused:
            return   # paused: the synchronize() came after the model's last pass, unseen
        if self._backend.synchronized_early():
            self._drop_sample = True

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
        self._backend.check_weighted(self.step)   # after the mark: no step's work
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
