"""omnihvd.elastic: the global batch is re-split when a Horovod elastic job changes size.

These tests run several ElasticBatchSplit objects in threads, one per simulated
worker, with a real barrier-based allgather; the real elastic ``horovodrun`` runs are
in ``test_elastic_cluster.py``.
"""
import threading

import pytest

from omnihvd.elastic import ElasticBatchSplit, split_for_world
from omnihvd.errors import ConfigError, InfeasibleError, RankMismatchError

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------ split_for_world
def test_unknown_throughputs_split_equally():
    assert split_for_world(10, [None, None, None]) == [4, 3, 3]


def test_split_is_proportional_to_known_throughputs():
    assert split_for_world(64, [1.0, 1.0, 2.0, 4.0]) == [8, 8, 16, 32]


def test_newcomer_counts_as_median_known_worker():
    assert split_for_world(12, [30.0, 10.0, float("nan")]) == [6, 2, 4]
    assert split_for_world(12, [30.0, None, 10.0]) == [6, 4, 2]


def test_bounds_hold():
    sizes = split_for_world(20, [100.0, 1.0], min_batch_size=4, max_batch_size=15)
    assert sizes == [15, 5]


@pytest.mark.parametrize("throughputs", [[], [0.0, 1.0], [-1.0], [float("inf")], ["fast"], None])
def test_bad_throughputs_raise_config_error(throughputs):
    with pytest.raises(ConfigError, match="throughput"):
        split_for_world(8, throughputs)


def test_infeasible_bounds_raise():
    with pytest.raises(InfeasibleError):
        split_for_world(5, [1.0, 1.0, 1.0], min_batch_size=2)


# ------------------------------------------------------------- simulated workers
class World:
    """n simulated workers; ``allgather_object`` is a real collective between threads."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n)
        self.slots = [None] * n
        self.names = set()

    def gather_for(self, rank):
        def gather(obj, name):
            self.names.add(name)
            self.slots[rank] = obj
            self.barrier.wait(timeout=10)
            out = list(self.slots)
            self.barrier.wait(timeout=10)
            return out
        return gather


def begin_all(splits, world, step=None):
    """Run begin() on every worker at once; return {rank: sizes or exception}."""
    results = {}

    def run(rank, split):
        split._allgather_object = world.gather_for(rank)
        split._world = lambda: (rank, world.n)
        try:
            results[rank] = split.begin(step)
        except Exception as exc:  # checked by the caller
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r, s)) for r, s in enumerate(splits)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def measured(split, samples_per_second):
    for _ in range(5):
        split.observe(10, 10 / samples_per_second)
    return split


def test_shrink_resplits_by_measured_throughput_on_every_worker():
    splits = [ElasticBatchSplit(60) for _ in range(3)]
    assert begin_all(splits, World(3)) == {0: [20, 20, 20], 1: [20, 20, 20], 2: [20, 20, 20]}
    measured(splits[0], 300.0)
    measured(splits[1], 100.0)
    survivors = splits[:2]                  # worker 2 left
    for s in survivors:
        s.on_reset()
        assert s.stale
    result = begin_all(survivors, World(2))
    assert result == {0: [45, 15], 1: [45, 15]}
    assert [s.batch_size for s in survivors] == [45, 15]
    assert [s.offset for s in survivors] == [0, 45]
    assert survivors[1].history[-1]["throughputs"] == pytest.approx([300.0, 100.0])


def test_joining_worker_gets_the_median_share():
    old = [measured(ElasticBatchSplit(60), 300.0), measured(ElasticBatchSplit(60), 100.0)]
    for s in old:
        s.on_reset()
    result = begin_all(old + [ElasticBatchSplit(60)], World(3))
    assert set(map(tuple, result.values())) == {(30, 10, 20)}


def test_same_world_without_reset_keeps_split():
    splits = [ElasticBatchSplit(9) for _ in range(3)]
    begin_all(splits, World(3))
    measured(splits[0], 1000.0)                  # new measurements alone change nothing
    assert begin_all(splits, World(3)) == {0: [3, 3, 3], 1: [3, 3, 3], 2: [3, 3, 3]}


def test_disagreeing_global_batch_fails_on_every_worker():
    result = begin_all([ElasticBatchSplit(60), ElasticBatchSplit(64)], World(2))
    for r in (0, 1):
        assert isinstance(result[r], RankMismatchError)
        assert "rank 1 has (64, 1, None)" in str(result[r])


class Target:
    def __init__(self, throughput):
        self.throughput = throughput
        self.calls = []

    def local_throughput(self):
        return self.throughput

    def reset_world(self, rank, size, batch_sizes, step=None):
        self.calls.append((rank, size, batch_sizes, step))


def test_target_is_told_new_world_and_supplies_throughput():
    targets = [Target(200.0), Target(None), Target(float("nan"))]
    splits = [ElasticBatchSplit(12, target=t) for t in targets]
    begin_all(splits, World(3), step=7)
    assert [t.calls for t in targets] == [[(r, 3, [4, 4, 4], 7)] for r in range(3)]
    assert splits[0].local_throughput() == 200.0 and splits[2].local_throughput() is None


def test_observe_ignores_garbage_and_batch_size_needs_begin():
    s = ElasticBatchSplit(8)
    for b, t in [(4, float("nan")), (4, -1.0), (0, 1.0), ("x", 1.0), (4, float("inf"))]:
        s.observe(b, t)
    assert s.local_throughput() is None
    s.observe(4, 0.5)
    assert s.local_throughput() == 8.0
    with pytest.raises(RuntimeError, match="begin"):
        s.batch_size


@pytest.mark.parametrize("kwargs, word", [
    (dict(global_batch_size=0), "global_batch_size"),
    (dict(global_batch_size=8, min_batch_size=-1), "min_batch_size"),
    (dict(global_batch_size=8, max_batch_size=[4, 4]), "max_batch_size"),
    (dict(global_batch_size=8, window=0), "window"),
    (dict(global_batch_size=8, target=object()), "reset_world"),
])
def test_bad_arguments_raise_config_error(kwargs, word):
    with pytest.raises(ConfigError, match=word):
        ElasticBatchSplit(**kwargs)


def test_one_fixed_collective_name():
    splits = [ElasticBatchSplit(4) for _ in range(2)]
    world = World(2)
    begin_all(splits, world)
    assert world.names == {"omnihvd.elastic.split"}
