"""The callback under Horovod elastic: tracked by :class:`omnihvd.elastic.TorchState`,
it leaves a world without a collective and agrees on the split of B over the
workers present when it joins the next (one gather, :data:`JOIN_NAME`).

:class:`ElasticWorlds` is a part of :class:`~omnihvd.OmniLearnCallback` (a mixin): it
reads the engine's ``controller``, ``schedule``, ``cadence``, ``_options``,
``_cap`` and ``_comm`` and gives it a new rank, size, gather and controller on
entry. Pure of Horovod until a world is joined.
"""
import logging
from typing import Dict, List, Optional

from .comm import HorovodComm, LocalComm, make_comm
from .errors import ConfigError
from .membership import JOIN_NAME, ThroughputMeter, agree_on_world, world_report, worker_label

__all__ = ["ElasticWorlds"]

log = logging.getLogger("omnihvd")


class ElasticWorlds:
    """Horovod elastic's side of the callback (module docstring)."""

    _elastic = False         # HOROVOD_ELASTIC=1: no collective may run before entry
    _tracker = None          # the omnihvd.elastic.TorchState committing this callback
    _meter: Optional[ThroughputMeter] = None   # this worker's samples/s, for a re-split
    _initial_given = False   # the user chose initial_batch_sizes (they fit one world only)

    def _track(self, tracker):
        """Called by :class:`omnihvd.elastic.TorchState`: from now on every entry into
        the ``@hvd.elastic.run`` function re-splits B over the workers present."""
        if self._tracker is not None and self._tracker is not tracker:
            raise ConfigError("this OmniLearnCallback is already tracked by another "
                              "omnihvd.elastic.TorchState; create one state per callback")
        if not isinstance(self._comm, (HorovodComm, LocalComm)):
            raise ConfigError("under Horovod elastic omnihvd gathers through Horovod, whose "
                              "workers change: create the callback without comm=")
        if self._initial_given:
            raise ConfigError("initial_batch_sizes fit one fixed world; under Horovod elastic "
                              "omnihvd splits B from each worker's measured throughput (equally "
                              "at the start): drop initial_batch_sizes")
        for name, values in (("min_batch_size", self._options.min_batch_size),
                             ("max_batch_size", self._options.max_batch_size)):
            if len(set(values)) > 1:
                raise ConfigError("%s %r is a per-rank list, but Horovod elastic changes the "
                                  "ranks: pass one int for every worker" % (name, values))
        self._tracker = tracker
        if self._meter is None:
            self._meter = ThroughputMeter()
            self.worlds: List[Dict] = []   # one record per (re)entry, see omnihvd.elastic

    def _elastic_snapshot(self) -> Dict:
        """What Horovod's state commits: the step, the epoch, the training samplers'
        positions (world-independent: the split is agreed again on entry)."""
        return {"step": self.step, "epoch": self.epoch,
                "samplers": [s.state_dict() for s in self.schedule.samplers if s.train]}

    def _elastic_load(self, snapshot: Dict):
        """Go back to a committed (or rank 0's synced) snapshot; no collective."""
        samplers = [s for s in self.schedule.samplers if s.train]
        if len(samplers) != len(snapshot["samplers"]):
            raise ConfigError("rank %d has %d training samplers, the synced state %d: every "
                              "worker must create the same samplers"
                              % (self.rank, len(samplers), len(snapshot["samplers"])))
        step = snapshot["step"]
        self.schedule.restore(step, [(step, self.schedule.batch_sizes_at(self.step))])
        self.cadence.forget_pending()
        self.epoch = snapshot["epoch"]
        for sampler, state in zip(samplers, snapshot["samplers"]):
            sampler.load_state_dict(state)

    def _leave_world(self):
        """Horovod reset callback (the world changed): local clean-up, no collective,
        since a joining worker would not take part in it."""
        self._pending = None    # a gather of the old world: its handle died with it
        self._step_sizes = None
        self._timer.stop()
        self._timer.discard_extra()
        self._detach()

    def _join_world(self):
        """Agree on the split of B over the workers present: one gather, fixed name."""
        if self._tracker is None:
            raise ConfigError("under Horovod elastic the callback must be tracked by the elastic "
                              "state: state = omnihvd.elastic.TorchState(model, optimizer, "
                              "callback=cb, ...)")
        if self.schedule.handed_out:
            raise ConfigError("the sampler handed out step %d before the world was agreed: call "
                              "cb.on_train_begin() first thing inside the @hvd.elastic.run "
                              "function, before iterating the loader" % self.step)
        import horovod.torch as hvd

        rank, size = hvd.rank(), hvd.size()
        comm = make_comm(None, rank=rank, size=size)
        c = self.controller
        config = (self.global_batch_size, int(c.lo[0]), int(self._options.max_batch_size[0]),
                  c.size_multiple)
        report = world_report(config, self.step, self._meter.value(), self._cap, worker_label())
        world = agree_on_world(comm.allgather_object(report, name=JOIN_NAME))
        self.rank, self.num_ranks, self._comm = rank, size, comm
        self.controller = c.resized(size, config[1], world.caps)
        self.cadence = self._new_cadence()
        self.schedule.rank, self.schedule.num_ranks = rank, size
        self.schedule.restore(world.step, [(world.step, world.batch_sizes)])
        self._decisions.caps_before = []   # the new world's caps hold from here
        self._decisions.rank = rank
        self._options = self._options._replace(
            initial_batch_sizes=list(world.batch_sizes),
            min_batch_size=self.controller.lo.tolist(), max_batch_size=[config[2]] * size)
        self.worlds.append(dict(world._asdict(), size=size, rank=rank))
        if rank == 0:
            log.info("omnihvd: %d workers from step %d (%s): batch sizes %s", size, world.step,
                     ", ".join(world.workers), world.batch_sizes)
