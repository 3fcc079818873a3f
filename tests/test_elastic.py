"""omnihvd.membership: the split of B over a changed world (Horovod elastic), pure.

The callback under Horovod's elastic state in one process is in
``test_elastic_single.py``; the real elastic ``horovodrun`` runs are in
``test_elastic_cluster.py``.
"""
import pytest

from omnihvd.errors import ConfigError, InfeasibleError, RankMismatchError
from omnihvd.membership import ThroughputMeter, agree_on_world, split_for_world, world_report

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


def test_per_worker_caps_and_size_multiple_hold():
    assert split_for_world(64, [1.0, 1.0, 6.0], max_batch_size=[64, 64, 32]) == [16, 16, 32]
    sizes = split_for_world(36, [1.0, 2.0, 3.0], size_multiple=8)
    assert sum(sizes) == 36 and all(b % 8 == 0 for b in sizes[1:]) and sizes[0] % 8 == 4


@pytest.mark.parametrize("throughputs", [[], [0.0, 1.0], [-1.0], [float("inf")], ["fast"], None])
def test_bad_throughputs_raise_config_error(throughputs):
    with pytest.raises(ConfigError, match="throughput"):
        split_for_world(8, throughputs)


def test_infeasible_bounds_raise():
    with pytest.raises(InfeasibleError):
        split_for_world(5, [1.0, 1.0, 1.0], min_batch_size=2)


# ------------------------------------------------------------------ ThroughputMeter
def test_meter_ignores_garbage_and_is_none_before_any_step():
    m = ThroughputMeter()
    for b, t in [(4, float("nan")), (4, -1.0), (0, 1.0), ("x", 1.0), (4, float("inf")),
                 (None, 1.0)]:
        m.observe(b, t)
    assert m.value() is None
    m.observe(4, 0.5)
    assert m.value() == 8.0


def test_meter_forgets_old_steps_and_clips_a_rare_pause():
    m = ThroughputMeter(window=10)
    for _ in range(10):
        m.observe(10, 1.0)                 # 10 samples/s ...
    for _ in range(10):
        m.observe(10, 0.5)                 # ... then 20: the old steps aged out
    assert m.value() == pytest.approx(20.0)
    m.observe(10, 50.0)                    # one garbage-collector pause
    assert m.value() > 15.0


def test_meter_window_must_be_positive():
    with pytest.raises(ConfigError, match="window"):
        ThroughputMeter(window=0)


# ------------------------------------------------------------------ agree_on_world
CONFIG = (60, 1, 60, 1)


def reports(*throughputs, step=7, caps=None, configs=None):
    caps = caps or [60] * len(throughputs)
    configs = configs or [CONFIG] * len(throughputs)
    return [world_report(c, step, x, cap, "host[%d]" % i)
            for i, (x, cap, c) in enumerate(zip(throughputs, caps, configs))]


def test_survivors_keep_their_speed_newcomer_gets_the_median():
    world = agree_on_world(reports(300.0, 100.0, None))
    assert world.batch_sizes == [30, 10, 20]
    assert world.step == 7 and world.throughputs == [300.0, 100.0, None]
    assert world.workers == ["host[0]", "host[1]", "host[2]"]


def test_nothing_measured_splits_equally():
    assert agree_on_world(reports(None, None, None)).batch_sizes == [20, 20, 20]


def test_a_workers_own_memory_cap_holds_in_the_new_world():
    world = agree_on_world(reports(100.0, 100.0, caps=[60, 12]))
    assert world.caps == [60, 12] and world.batch_sizes == [48, 12]


def test_every_worker_computes_the_same_split_from_the_same_reports():
    gathered = reports(310.0, 97.5, None, 12.0)
    assert len({tuple(agree_on_world(list(gathered)).batch_sizes) for _ in range(4)}) == 1


def test_disagreeing_options_fail_naming_each_worker():
    with pytest.raises(RankMismatchError, match=r"rank 1 \(host\[1\]\) has \(64, 1, 60, 1\)"):
        agree_on_world(reports(1.0, 1.0, configs=[CONFIG, (64, 1, 60, 1)]))


def test_different_steps_mean_the_state_was_not_synced():
    gathered = reports(1.0, 1.0)
    gathered[1]["step"] = 9
    with pytest.raises(RankMismatchError, match="rank 0 has 7, rank 1 has 9.*TorchState"):
        agree_on_world(gathered)


def test_caps_that_cannot_hold_b_raise_on_every_worker():
    with pytest.raises(InfeasibleError):
        agree_on_world(reports(1.0, 1.0, caps=[20, 20]))
