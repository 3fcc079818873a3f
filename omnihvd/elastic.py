"""Horovod elastic: the OmniLearnCallback keeps B exact while workers come and go.

With ``horovodrun --min-np/--max-np --host-discovery-script`` (Gloo), workers join
and leave during training. :class:`TorchState` is ``hvd.elastic.TorchState`` that
also commits, restores and syncs an :class:`~omnihvd.OmniLearnCallback` (Horovod's
documented way to sync a custom type: a state subclass). The callback and the
:class:`~omnihvd.HeterogeneousBatchSampler` of the normal drop-in are used unchanged.

How it follows Horovod's protocol (``horovod/common/elastic.py`` ``run_fn``):

* ``state.commit()`` saves the callback's step, epoch and the training sampler's
  position in its epoch, with the model and the optimizer.
* On a failure (``HorovodInternalError``) Horovod restores the last commit; on a
  membership change (``HostsUpdatedInterrupt``) the state is already committed.
  Either way Horovod re-initialises and runs the reset callbacks: the callback's
  removes its hooks and puts the sampler back at the committed position. A reset
  callback runs no collective, since a joining worker would not take part in it.
* ``state.sync()`` (new workers, and survivors when workers joined) broadcasts
  rank 0's committed snapshot, under a fixed name.
* In the ``@hvd.elastic.run`` function every worker calls ``cb.on_train_begin()``
  first: one gather with a fixed name (``omnihvd.elastic.join``) where each worker
  reports the samples/s it measured itself and its memory cap; every worker splits
  the same B from the same reports (:func:`omnihvd.membership.split_for_world`: a
  newcomer counts as the median known worker, equal with nothing known), and the
  callback re-derives its rank, size, gather, controller, gradient weights and size
  schedule for the new world. The sampler then continues the epoch at the committed
  global step: no sample is lost or repeated within an epoch across the change.

Under ``HOROVOD_ELASTIC=1`` the callback runs no collective when it is created (the
options are compared on entry instead) and does not abort the job when a worker
raises (a failed worker must leave alone).

Running on one host needs ``--network-interface lo`` (or the host's interface):
without it horovodrun waits for two distinct hosts to detect common interfaces and,
with one host, sits silent until ``--elastic-timeout`` (600 s by default) ends it.
"""
import horovod.torch as hvd

from .membership import split_for_world

__all__ = ["TorchState", "split_for_world"]

# The broadcast of rank 0's committed callback snapshot in state.sync(); fixed.
SYNC_NAME = "omnihvd.elastic.state"


class TorchState(hvd.elastic.TorchState):
    """``hvd.elastic.TorchState`` that also commits, restores and syncs an OmniLearnCallback.

    Args:
        model, optimizer: as for ``hvd.elastic.TorchState``.
        callback: the :class:`~omnihvd.OmniLearnCallback`; its training sampler is
            tracked with it.
        **kwargs: further state attributes (``epoch=0``, ...), as for Horovod's.

    Raises:
        ConfigError: options that do not fit a changing world (``initial_batch_sizes``,
            per-rank ``min_batch_size``/``max_batch_size`` lists, ``comm=``), or a
            callback already tracked by another state.

    ``cb.worlds`` then records every (re)entry: its step, batch sizes, caps, the
    throughputs the workers reported (None: unknown), the workers, size and rank.

    It is Horovod's state, so everything Horovod does with one still holds:

    >>> issubclass(TorchState, hvd.elastic.TorchState)
    True

    Example::

        hvd.init()
        opt = hvd.DistributedOptimizer(base_opt, named_parameters=model.named_parameters())
        cb = omnihvd.OmniLearnCallback(model, opt, global_batch_size=96)
        sampler = omnihvd.HeterogeneousBatchSampler(len(dataset), cb, seed=0)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
        state = omnihvd.elastic.TorchState(model, opt, callback=cb, epoch=0)

        @hvd.elastic.run
        def train(state):
            cb.on_train_begin()               # every worker, every (re)entry: re-split B
            for state.epoch in range(state.epoch, epochs):
                sampler.set_epoch(state.epoch); cb.on_epoch_begin(state.epoch)
                for x, y in loader:
                    cb.on_batch_begin()
                    opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
                    cb.on_batch_end()
                    state.commit()
            cb.on_train_end()

        train(state)
    """

    def __init__(self, model=None, optimizer=None, *, callback, **kwargs):
        track = getattr(callback, "_track", None)
        if not callable(track):
            from .errors import ConfigError

            raise ConfigError("callback must be an omnihvd.OmniLearnCallback, got %s"
                              % type(callback).__name__)
        track(self)
        self._omnihvd_callback = callback
        self._omnihvd_saved = callback._elastic_snapshot()
        super().__init__(model, optimizer, **kwargs)
        self.register_reset_callbacks([self._omnihvd_reset])

    def save(self):
        self._omnihvd_saved = self._omnihvd_callback._elastic_snapshot()
        super().save()

    def restore(self):
        self._omnihvd_callback._elastic_load(self._omnihvd_saved)
        super().restore()

    def sync(self):
        super().sync()
        self._omnihvd_saved = hvd.broadcast_object(self._omnihvd_saved, root_rank=0,
                                                   name=SYNC_NAME)
        self._omnihvd_callback._elastic_load(self._omnihvd_saved)

    def _omnihvd_reset(self):
        self._omnihvd_callback._leave_world()
        self._omnihvd_callback._elastic_load(self._omnihvd_saved)
