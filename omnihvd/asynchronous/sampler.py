"""Index batches for one asynchronous worker, sized by the balancer as training runs.

In synchronous training every global step consumes exactly B samples of one shared
order (:class:`omnihvd.HeterogeneousBatchSampler`). Asynchronous workers have no
common step, so each worker walks its own shuffled order of the whole dataset
(seeded by ``seed``, ``epoch`` and the worker's index, so workers see different
orders and a run is reproducible), reading the batch size from the callback at every
batch: when server 0 moves a worker's batch size, the next batch has the new size.
An epoch is one pass of this worker over the dataset.
"""
from typing import Iterator, List

import numpy as np

from ..errors import ConfigError

__all__ = ["AsyncBatchSampler"]


class AsyncBatchSampler:
    """Batches of indices of the current size, for ``DataLoader(batch_sampler=...)``.

    Args:
        dataset_len: number of samples.
        callback: anything with ``batch_size`` (current size, int >= 1) and
            ``worker_index`` (e.g. :class:`AsyncOmniLearnCallback` on a worker).
        seed: base seed of the shuffle.
        drop_last: drop the last, short batch of an epoch (default True: a short
            batch would be weighted as if it were a full one of its size, which is
            correct, but it also distorts the worker's measured update interval).

    Raises:
        ConfigError: bad ``dataset_len`` or ``seed``.

    >>> class Cb: batch_size, worker_index = 4, 0
    >>> s = AsyncBatchSampler(10, Cb(), seed=1)
    >>> [len(b) for b in s], sorted(i for b in s for i in b) == sorted(set(i for b in s for i in b))
    ([4, 4], True)
    """

    def __init__(self, dataset_len: int, callback, seed: int = 0, drop_last: bool = True):
        if isinstance(dataset_len, bool) or not isinstance(dataset_len, int) or dataset_len < 1:
            raise ConfigError("dataset_len must be an int >= 1, got %r" % (dataset_len,))
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError("seed must be an int >= 0, got %r" % (seed,))
        self.dataset_len = dataset_len
        self.callback = callback
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = 0

    def set_epoch(self, epoch: int):
        """Select the shuffle of this epoch (call before iterating, as with DistributedSampler)."""
        self.epoch = int(epoch)

    def order(self) -> np.ndarray:
        """This worker's permutation of the dataset for the current epoch."""
        worker = int(self.callback.worker_index or 0)
        rng = np.random.default_rng([self.seed, self.epoch, worker])
        return rng.permutation(self.dataset_len)

    def _size(self) -> int:
        size = self.callback.batch_size
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ConfigError("the callback's batch_size must be an int >= 1, got %r (is this a "
                              "server rank?)" % (size,))
        return int(size)

    def __iter__(self) -> Iterator[List[int]]:
        order = self.order()
        pos = 0
        while pos < self.dataset_len:
            size = self._size()
            if pos + size > self.dataset_len and self.drop_last:
                return
            batch = order[pos:pos + size]
            pos += size
            yield batch.tolist()

    def __len__(self) -> int:
        """Batches in an epoch at the current batch size (sizes may change on the way)."""
        size = self._size()
        return self.dataset_len // size if self.drop_last else -(-self.dataset_len // size)
