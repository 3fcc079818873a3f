"""omnihvd.Balancer: dynamic batch sizing with the training loop left as it is.

The balancer is made from the model and the optimizer, and the training loader is
taken from it. The step boundaries come from where the framework already tells
them: a step begins when the loader hands out its batch (the time of ``next()``,
data loading, is this rank's work) and ends when ``opt.step()`` returns (the
wait for the other ranks begins at its entry: Horovod's ``synchronize()``, or
DDP's last gradient bucket). Nothing inside the loop calls omnihvd (the example is
:class:`Balancer`'s).

The engine underneath is the callback (:class:`omnihvd.OmniLearnCallback`, or
:class:`omnihvd.DDPOmniLearnCallback` for a DDP model), driven by the loader and
the optimizer's step hooks instead of the loop.
"""
import logging
from typing import Dict, List, Optional

from .errors import ConfigError

__all__ = ["Balancer", "BalancedLoader"]

log = logging.getLogger("omnihvd")

# DataLoader arguments the balancer sets itself: each rank's batches are cut from
# one global order by omnihvd's sampler.
_OWN = ("batch_size", "sampler", "batch_sampler")


def _is_ddp(model) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


class Balancer:
    """Balance an existing Horovod or DDP training loop: per-rank batch sizes
    proportional to each rank's measured speed, the global batch held, the
    gradient exactly that of the whole global batch.

    Args:
        model: the model being trained: a ``torch.nn.Module`` under Horovod, or the
            ``DistributedDataParallel`` model under torch.distributed.
        optimizer: ``hvd.DistributedOptimizer`` (``op=hvd.Average`` or ``hvd.Sum``;
            any ``backward_passes_per_step``), or the DDP model's optimizer.
        global_batch_size: B, the samples per step over all ranks; held exactly.
        initial_batch_sizes: one int per rank summing to B (default: equal).
        min_batch_size: int or per-rank list (default 1).
        max_batch_size: int or per-rank list: the most samples a rank's loader
            batch may hold (default: no cap). A loop that cuts its batch into
            sub-batches bounds its memory by the sub-batch instead: no cap needed.
        size_multiple: every rank's batch is a multiple of it (default 1). A loop
            that cuts its batch into sub-batches of ``s`` and divides each loss by
            their number passes ``size_multiple=s``: each rank's loss is then the
            mean over its batch, and the gradient exact.
        adjust_every: steps between adjustments (default 20).
        loss_reduction: ``"mean"`` (default: each rank's loss is the mean over its
            samples) or ``"sum"``.
        advanced: a dict of the callback's other options (``deadband``, ``gain``,
            ``policy``, ``timing``, ``comm``, ``device_sync``, ``cpu_quota``, ...;
            see :class:`omnihvd.OmniLearnCallback`).

    Raises:
        ConfigError: on every rank, when any rank's options are invalid (the
            message names the rank and the fix); an unknown ``advanced`` option.
        InfeasibleError: bounds that cannot hold the global batch.

    Example (Horovod; DDP alike, with the DDP model)::

        hvd.init()
        opt = hvd.DistributedOptimizer(base_opt, named_parameters=model.named_parameters())
        bal = omnihvd.Balancer(model, opt, global_batch_size=512)
        loader = bal.loader(train_dataset, num_workers=2)
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    def __init__(self, model, optimizer, global_batch_size: int, *,
                 initial_batch_sizes: Optional[List[int]] = None, min_batch_size=1,
                 max_batch_size=None, size_multiple: int = 1, adjust_every: int = 20,
                 loss_reduction: str = "mean", advanced: Optional[Dict] = None):
        if advanced is not None and not isinstance(advanced, dict):
            raise ConfigError("advanced must be a dict of OmniLearnCallback options, got %s"
                              % type(advanced).__name__)
        options = dict(advanced or {})
        for name in ("model", "optimizer", "global_batch_size"):
            if name in options:
                raise ConfigError("advanced may not hold %r: pass it to Balancer itself" % name)
        options.update(initial_batch_sizes=initial_batch_sizes, min_batch_size=min_batch_size,
                       max_batch_size=max_batch_size, size_multiple=size_multiple,
                       adjust_every=adjust_every, loss_reduction=loss_reduction)
        if optimizer is None or not hasattr(optimizer, "register_step_post_hook"):
            raise ConfigError("optimizer must be the torch optimizer that trains the model "
                              "(hvd.DistributedOptimizer under Horovod), got %r" % (optimizer,))
        try:
            if _is_ddp(model):
                from .ddp import DDPOmniLearnCallback

                self.callback = DDPOmniLearnCallback(model, global_batch_size,
                                                     optimizer=optimizer, **options)
            else:
                from .callback import OmniLearnCallback

                self.callback = OmniLearnCallback(model, optimizer, global_batch_size, **options)
        except TypeError as e:   # an unknown name in advanced
            raise ConfigError("Balancer: %s (advanced takes the keyword options of "
                              "omnihvd.OmniLearnCallback)" % e) from None
        self.callback.ends_at_step = True
        self._loader: Optional["BalancedLoader"] = None

    # ------------------------------------------------------------ the loader
    def loader(self, dataset, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
               **kwargs) -> "BalancedLoader":
        """The training loader: each step, this rank's share of one global order.

        Use it where the loop had ``DataLoader(dataset, batch_size=...,
        sampler=DistributedSampler(...))``; the keyword arguments are
        DataLoader's (``num_workers``, ``pin_memory``, ``collate_fn``, ...), except
        the batch size and sampler, which omnihvd sets. Every sample is used once
        per epoch (``drop_last=False``: the epoch's last, smaller step is split
        too). ``loader.sampler.set_epoch(epoch)`` (or :meth:`set_epoch`) chooses
        each epoch's order, as with ``DistributedSampler``.

        Args:
            dataset: a map-style dataset (``len()`` and indexing), the same on
                every rank.
            shuffle: a new permutation each epoch, from ``seed + epoch``.
            seed: the same on every rank.
            drop_last: leave out the epoch's last partial step.

        Raises:
            ConfigError: ``batch_size``, ``sampler`` or ``batch_sampler`` given; a
                second training loader on this balancer.
        """
        import torch.utils.data

        given = [name for name in _OWN if kwargs.get(name) is not None]
        if given:
            raise ConfigError("Balancer.loader sets %s itself (each rank's share of the global "
                              "batch, changing as ranks are balanced): drop it"
                              % " and ".join(given))
        if self._loader is not None:
            raise ConfigError("this balancer already has its training loader; evaluate on an "
                              "ordinary DataLoader")
        from .sampler import HeterogeneousBatchSampler

        sampler = HeterogeneousBatchSampler(len(dataset), self.callback, seed=seed,
                                            shuffle=shuffle, drop_last=drop_last)
        self._loader = BalancedLoader(
            self, torch.utils.data.DataLoader(dataset, batch_sampler=sampler, **kwargs))
        return self._loader

    def _batches(self, loader):
        """Iterate ``loader`` as the training loop's steps (BalancedLoader.__iter__)."""
        cb = self.callback
        cb.on_train_begin()
        cb.epoch = loader.batch_sampler.epoch
        batches = iter(cb.wrap(loader, check=False))   # next() is this rank's work
        while True:
            cb.end_step()   # a step whose loop ran no opt.step(): before the next fetch
            try:
                batch = next(batches)
            except StopIteration:
                return
            cb.on_batch_begin()
            yield batch

    # -------------------------------------------------------------- the run
    def set_epoch(self, epoch: int):
        """Choose the training loader's order for ``epoch`` (its sampler's
        ``set_epoch``)."""
        if self._loader is None:
            raise ConfigError("set_epoch before Balancer.loader(): there is no training loader")
        self._loader.sampler.set_epoch(epoch)
        self.callback.epoch = self._loader.sampler.epoch

    def close(self):
        """End the training: close a step left open, complete a gather in flight and
        remove every hook (the optimizer and the model are as before). Optional
        (nothing is in flight when a loop ends at a step's end); ``with bal:`` calls
        it on the way out."""
        import sys

        if sys.exc_info()[1] is None:
            self.callback.end_step()
        self.callback.on_train_end()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    @property
    def batch_size(self) -> int:
        """This rank's batch size in the current step."""
        return self.callback.batch_size

    @property
    def batch_sizes(self) -> List[int]:
        """Every rank's batch size in the current step (the same list on every rank,
        summing to the global batch)."""
        return self.callback.batch_sizes

    @property
    def step(self) -> int:
        """Global steps completed (counted across epochs)."""
        return self.callback.step

    @property
    def history(self) -> List[Dict]:
        """The decisions so far (see :attr:`omnihvd.OmniLearnCallback.history`)."""
        return self.callback.history

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> Dict:
        """The sizes, the time model and the loader's place, for a checkpoint taken
        at any point of the loop: before ``opt.step()`` it records the step as not
        yet run, after it as run."""
        state = {"callback": self.callback.state_dict()}
        if self._loader is not None:
            state["sampler"] = self._loader.sampler.state_dict()
        return state

    def load_state_dict(self, state: Dict):
        """Resume from :meth:`state_dict` on every rank, before the first batch (also
        on another number of ranks: the global batch is split again).

        Raises:
            ConfigError: a malformed state, or one from another global batch,
                dataset or seed.
        """
        if not isinstance(state, dict) or "callback" not in state:
            raise ConfigError("not a Balancer state_dict: expected a dict with 'callback'")
        self.callback.load_state_dict(state["callback"])
        if "sampler" in state:
            if self._loader is None:
                raise ConfigError("the state holds the loader's place: create bal.loader(...) "
                                  "before load_state_dict")
            self._loader.sampler.load_state_dict(state["sampler"])


class BalancedLoader:
    """The training loader of a :class:`Balancer` (from :meth:`Balancer.loader`).

    Iterating it yields the DataLoader's batches -- this rank's share of each
    step -- and tells the balancer where steps begin. ``sampler`` (also
    ``batch_sampler``) is omnihvd's :class:`~omnihvd.HeterogeneousBatchSampler`,
    with ``set_epoch`` as ``DistributedSampler``'s; ``len()`` counts steps; any
    other attribute is the DataLoader's.
    """

    def __init__(self, balancer: Balancer, loader):
        self._balancer = balancer
        self.loader = loader

    @property
    def sampler(self):
        return self.loader.batch_sampler

    batch_sampler = sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        return self._balancer._batches(self.loader)

    def __getattr__(self, name):   # dataset, num_workers, ... of the DataLoader
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
