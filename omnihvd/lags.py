"""Release lag: how much later than its host's first rank a rank resumes after the allreduce.

A synchronous step ends for every rank when the gradients' allreduce completes, but
not every rank resumes at that moment: each must notice the completion, and ranks
that share a core do so one after another. On this project's 2-core machine (one
rank alone on a core, three sharing the other; per-step timestamps of every rank,
docs/real-heterogeneity.rst "Release lag") the three returned from the gradients'
synchronize 2.3-5.4 ms after the lone rank, on average and at every split tried,
in steps of 42-50 ms. That delay is in no rank's local time (which starts at
``on_batch_begin`` and takes the update after the synchronize as the next step's
work), yet it delays the rank's next arrival one for one: balancing local times
left the three co-located ranks arriving 4-5 ms after the lone one, and the split
whose *arrivals* were equal (the lone rank's local time 2-4 ms longer) was 5% faster.

So with ``release_lag=True`` (experimental, off by default) the controller balances
each rank's local time plus its mean release lag. Ranks that do not share cores
resume together and are charged about nothing. Paired in one launch with the
default in 3:1:1:1 it ran at 1.04x (1.02-1.14) and reached 0.99 of the best fixed
split (0.95 without). It is off by default because where several ranks share each
core the lag is not a fixed cost of a rank: with sleep-emulated speeds on 4 ranks
over 2 cores it gave ranks of equal speed 53 and 75 samples and ran 17% slower than
plain Horovod (docs/real-heterogeneity.rst, "Release lag"). A rank under a CPU
quota sends no release times: it also resumes late when its quota for the period is
spent, a stall its quota floor (:mod:`omnihvd.timing`) charges in its own way;
measured with lags under quotas (HL8 quotas with core sets, quotas 100/60/30%), the
split ran at 0.985 and 0.987 of the one without, and ranks of equal quotas ended up
to 17 and 24 samples apart.

How it is measured: each rank notes the moment its synchronize returns (where its
update begins), on the clock ``time.perf_counter`` reads, which is the system's
monotonic clock and the same for every process of one machine (one boot). Every
window, these release times of its steps are gathered aligned by step (like
:mod:`omnihvd.arrivals`), with each rank's machine (:func:`host_key`); a rank's lag
in a step is its release time minus the earliest of its machine's ranks. Ranks on
different machines are not compared (their clocks are not the same), so a rank
alone on its machine has lag 0. :class:`LagPool` keeps each rank's last
:data:`LAG_SAMPLES` lags; its charge is their mean with the rarest slowest winsorised
(a one-off pause is not a lag). A lag above :data:`MAX_LAG` seconds is taken as a
clock that is not shared after all (a container with its own time namespace) and
left out.

Pure numpy, deterministic: the same table gives the same charges on every rank.

>>> import numpy as np
>>> releases = np.array([[100.000, 100.004, 100.003],
...                      [100.050, 100.053, 100.052]])
>>> release_lags(releases, hosts=[7.0, 7.0, 7.0]).round(4).tolist()
[[0.0, 0.004, 0.003], [0.0, 0.003, 0.002]]
>>> release_lags(releases, hosts=[7.0, 7.0, 9.0]).round(4).tolist()   # rank 2 alone
[[0.0, 0.004, 0.0], [0.0, 0.003, 0.0]]
"""
import os
import socket
import zlib

import numpy as np

from .timing import _clip_rare

__all__ = ["LAG_SAMPLES", "MIN_LAGS", "MAX_LAG", "host_key", "release_lags", "LagPool"]

# Lags kept per rank: the steps of a few windows (one window sends up to 32).
LAG_SAMPLES = 64
# Fewer lags than this: the rank's lag is unknown (charged nothing).
MIN_LAGS = 8
# A larger lag means the clocks compared are not one clock: that step is left out.
MAX_LAG = 1.0


def host_key() -> float:
    """This machine's identity as a float-exact number: the crc32 of its boot id
    (the same in every container on one kernel, whose monotonic clock they share),
    or of its host name where there is no boot id.

    >>> host_key() == host_key() and 0 <= host_key() < 2 ** 32
    True
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            name = f.read().strip()
    except OSError:
        name = socket.gethostname() or str(os.getpid())
    return float(zlib.crc32(name.encode()))


def release_lags(releases, hosts) -> np.ndarray:
    """Each rank's lag in each step: its release time minus the earliest release of
    its machine's ranks in that step (NaN where its release is missing, or the lag
    exceeds :data:`MAX_LAG`).

    Args:
        releases: ``(steps, ranks)`` release times, seconds on each machine's
            monotonic clock (NaN: none), aligned by step.
        hosts: one :func:`host_key` per rank.
    """
    r = np.asarray(releases, dtype=np.float64)
    h = np.asarray(hosts, dtype=np.float64)
    lags = np.full(r.shape, np.nan)
    if r.ndim != 2 or r.shape[1] != h.size:
        return lags
    with np.errstate(invalid="ignore"):
        for host in np.unique(h):
            mine = h == host
            first = np.nanmin(np.where(np.isfinite(r[:, mine]), r[:, mine], np.inf), axis=1)
            lags[:, mine] = r[:, mine] - first[:, None]
        lags[~(np.isfinite(lags) & (lags >= 0) & (lags <= MAX_LAG))] = np.nan
    return lags


class LagPool:
    """Each rank's last :data:`LAG_SAMPLES` release lags, and the charge they make.

    Same tables in, same pool out, on every rank. :meth:`forget` it when the ranks
    or their placement change.

    >>> pool = LagPool(2)
    >>> pool.add(release_lags([[100.0, 100.004]] * 8, hosts=[1.0, 1.0]))
    >>> pool.charges().round(4).tolist()
    [0.0, 0.004]
    """

    def __init__(self, num_ranks: int, samples: int = LAG_SAMPLES):
        self.num_ranks = int(num_ranks)
        self.samples = int(samples)
        self.forget()

    def forget(self):
        self._lags = np.empty((0, self.num_ranks))

    def add(self, lags):
        """Add one window's ``(steps, ranks)`` lags (:func:`release_lags`; NaN: none)."""
        lags = np.asarray(lags, dtype=np.float64)
        if lags.ndim == 2 and lags.shape[1] == self.num_ranks:
            self._lags = np.concatenate([self._lags, lags])[-self.samples:]

    def counts(self) -> np.ndarray:
        """How many lags each rank holds."""
        return np.isfinite(self._lags).sum(axis=0)

    def charges(self) -> np.ndarray:
        """Seconds to add to each rank's local time: the mean of its pooled lags, the
        slowest tenth winsorised (:func:`omnihvd.timing.sustained_step_time`'s
        rule); 0 below :data:`MIN_LAGS` lags."""
        counts = self.counts()
        if not self._lags.size:
            return np.zeros(self.num_ranks)
        clipped, _ = _clip_rare(self._lags, axis=0)
        with np.errstate(invalid="ignore"):
            total = np.nansum(clipped, axis=0)
        return np.where(counts >= MIN_LAGS, total / np.maximum(counts, 1), 0.0)
