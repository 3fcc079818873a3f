"""Index batches for one asynchronous worker, sized by the balancer as training runs.

In synchronous training every global step consumes exactly B samples of one shared
order (:class:`omnihvd.HeterogeneousBatchSampler`). Asynchronous workers have no
common step, so each worker walks its own shuffled order of the whole dataset
(seeded by ``seed``, ``epoch`` and the worker's index, so workers see different
orders and a run is reproducible), reading the batch size from the callback at every
batch: when server 0 moves a worker's batch size, the next batch has the new size.
An epoch is one pass of this worker over the dataset.

A DataLoader with ``num_workers > 0`` takes batches from the sampler ahead of the
training loop, so the batch being trained may have been cut at an older size than
the callback's current one. The sampler therefore tells the callback each batch's
size as it hands it out (``callback.sizes_handed_out``), and the callback weights
each push by the size of its own batch, oldest first.
"""
from typing import Iterator, List

import numpy as np

from ..checks import check_int
from ..errors import ConfigError

__all__ = ["AsyncBatchSampler"]


class AsyncBatchSampler:
    """Batches of indices of the current size, for ``DataLoader(batch_sampler=...)``.

    Args:
        dataset_len: number of samples.
        callback: anything with ``batch_size`` (current size, int >= 1) and
            ``worker_index`` (e.g. :class:`AsyncOmniLearnCallback` on a worker).
            Where it has a ``sizes_handed_out`` deque, each batch's size is appended
            to it as the batch is handed out (the deque is cleared as a pass begins).
        seed: base seed of the shuffle.
        drop_last: drop the last, short batch of an epoch (default True: a short
            batch would be weighted as if it were a full one of its size, which is
            correct, but it also distorts the worker's measured update interval).

    Raises:
        ConfigError: bad ``dataset_len`` or ``seed``; a batch size above
            ``dataset_len`` with ``drop_last`` (an epoch would hold no batch).

    >>> class Cb: batch_size, worker_index = 4, 0
    >>> s = AsyncBatchSampler(10, Cb(), seed=1)
    >>> [len(b) for b in s], sorted(i for b in s for i in b) == sorted(set(i for b in s for i in b))
    ([4, 4], True)
    """

    def __init__(self, dataset_len: int, callback, seed: int = 0, drop_last: bool = True):
        self.dataset_len = check_int("dataset_len", dataset_len, 1)
        self.callback = callback
        self.seed = check_int("seed", seed, 0)
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
        # None on a server rank: it has no batches to take
        size = check_int("batch_size", size, 1, where="the callback's ")
        if size > self.dataset_len and self.drop_last:
            raise ConfigError("the callback's batch_size %d is larger than the dataset (%d "
                              "samples): with drop_last=True an epoch would hold no batch; use "
                              "a smaller global_batch_size or max_batch_size, or drop_last=False"
                              % (size, self.dataset_len))
        return size

    def __iter__(self) -> Iterator[List[int]]:
        order = self.order()
        handed_out = getattr(self.callback, "sizes_handed_out", None)
        if handed_out is not None:   # batches of an earlier pass not trained: never will be
            handed_out.clear()
        pos = 0
        while pos < self.dataset_len:
            size = self._size()
            if pos + size > self.dataset_len and self.drop_last:
                return
            batch = order[pos:pos + size]
            pos += size
            if handed_out is not None:
                handed_out.append(len(batch))
            yield batch.tolist()

    def __len__(self) -> int:
        """Batches in an epoch at the current batch size (sizes may change on the way)."""
        size = self._size()
        return self.dataset_len // size if self.drop_last else -(-self.dataset_len // size)
