"""The cluster simulator: fast, single-process (its plot is in test_plots.py)."""
import numpy as np
import pytest

from omnihvd.controller import TimeModel, solve_time_model
from omnihvd.errors import ConfigError
from omnihvd.tools.simulate import (DYNAMIC_SCHEDULE, Cluster, Control, hl_speeds,
                                    make_profile, reference_control, ring_allreduce_seconds,
                                    simulate)

pytestmark = pytest.mark.unit


def test_hl_levels_tile_over_ranks():
    assert hl_speeds("hl4", 6).tolist() == [0.75, 0.75, 0.5, 2.0, 0.75, 0.75]
    with pytest.raises(ConfigError, match="hl3"):
        hl_speeds("hl3", 4)


def test_ring_allreduce_cost():
    assert ring_allreduce_seconds(2, 100.0, 10.0, 0.5) == pytest.approx(10.0 + 1.0)
    assert ring_allreduce_seconds(1, 100.0, 10.0, 0.5) == 0.0


@pytest.mark.parametrize("policy", ["affine", "proportional"])
def test_converges_to_the_equal_time_split(policy):
    """Noise-free HL8: the final split is the controller's own optimum for the true model."""
    cluster = Cluster(ranks=8, overhead=0.0, noise=0.0)
    res = simulate(cluster, "hl8", global_batch_size=512, steps=200, control=Control(policy=policy))
    speed = hl_speeds("hl8", 8)
    best = solve_time_model(TimeModel(np.zeros(8), 1.0 / (cluster.throughput * speed)), 512)
    assert res.final_sizes == best
    # with no fixed cost the equal-time split is the proportional split B x / sum(x)
    assert np.allclose(res.final_sizes, 512 * speed / speed.sum(), atol=1.0)
    assert res.summary()["steady"]["efficiency"] > 0.99


def test_sizes_always_sum_to_the_global_batch_and_respect_bounds():
    control = Control(policy="proportional", min_batch_size=4, max_batch_size=60)
    res = simulate(Cluster(ranks=12, noise=0.2), "drift", global_batch_size=300, steps=300,
                   control=control, seed=3)
    assert np.all(res.tracked_sizes.sum(axis=1) <= 300)
    assert sum(res.final_sizes) == 300
    assert min(res.final_sizes) >= 4 and max(res.final_sizes) <= 60
    assert res.tracked_sizes.min() >= 4 and res.tracked_sizes.max() <= 60
    assert len(res.tracked_ranks) == 8


def test_deterministic_with_a_seed():
    def go(seed):
        return simulate(Cluster(ranks=16, noise=0.1), "noisy", global_batch_size=512, steps=240,
                        seed=seed)
    a, b, c = go(1), go(1), go(2)
    assert np.array_equal(a.step_time, b.step_time)
    assert a.final_sizes == b.final_sizes
    assert not np.array_equal(a.step_time, c.step_time)


def test_better_than_equal_split_and_noise_free_efficiency_bounded_by_one():
    res = simulate(Cluster(ranks=4), "hl4", global_batch_size=128, steps=200)
    s = res.summary()
    assert s["steady"]["speedup_vs_equal"] > 1.5
    assert np.all(res.ideal_time <= res.step_time + 1e-12)


def test_decision_cadence_matches_the_callback():
    """The window closes at every adjust_every-th step, whose gather completes in the
    same step: the new sizes start at the next step (later by a loader's look-ahead)."""
    res = simulate(Cluster(ranks=4), "hl8", global_batch_size=64, steps=100,
                   control=Control(adjust_every=10))
    assert [d["step"] for d in res.decisions] == list(range(9, 100, 10))
    first = res.decisions[0]
    assert first["changed"] and first["effective_step"] == 10
    assert res.tracked_sizes[9].tolist() == [16, 16, 16, 16]
    assert res.tracked_sizes[10].tolist() != [16, 16, 16, 16]
    ahead = simulate(Cluster(ranks=4), "hl8", global_batch_size=64, steps=100,
                     control=Control(adjust_every=10, latency_steps=3))
    assert ahead.decisions[0]["effective_step"] == 13
    assert ahead.tracked_sizes[12].tolist() == [16, 16, 16, 16] != ahead.tracked_sizes[13].tolist()


def test_reference_policy_adjusts_once_per_epoch():
    res = simulate(Cluster(ranks=4), "hl8", global_batch_size=64, steps=300,
                   control=reference_control(steps_per_epoch=100))
    assert [d["step"] for d in res.decisions] == [99, 199, 299]
    assert res.control["deadband"] == 0.2 and res.control["timing"] == "mean"


def test_dynamic_profile_phases_and_convergence():
    prof = make_profile("dynamic", 4, 700, phase_steps=100)
    assert prof.change_steps == [0, 100, 200, 300, 400, 500, 600]
    res = simulate(Cluster(ranks=4), prof, global_batch_size=128, steps=700,
                   control=Control(policy="proportional"))
    conv = res.convergence()
    assert len(conv) == len(DYNAMIC_SCHEDULE)
    assert all(c["steps"] is not None for c in conv)


def test_the_dynamic_schedule_comes_back_to_the_equal_split():
    """The emulated benchmark's dynamic schedule, noise-free (2 ms a sample, 5 ms a step,
    60-step phases): the last phase (HL1, equal speeds) ends at 64 samples each, not at
    the 63/65 the old 2% dead band held."""
    cluster = Cluster(ranks=4, throughput=500.0, overhead=0.005, gradient_bytes=1e6)
    res = simulate(cluster, make_profile("dynamic", 4, 480, phase_steps=60),
                   global_batch_size=256, steps=480, control=Control(latency_steps=1))
    assert res.final_sizes == [64, 64, 64, 64]


def test_noisy_neighbours_slow_a_fraction_of_ranks():
    prof = make_profile("noisy", 20, 10, slow_fraction=0.25, slowdown=4.0, slow_period=5, seed=0)
    speeds = list(prof.stream(10))
    assert np.sum(speeds[0] < 1.0) == 5 and speeds[0].min() == pytest.approx(0.25)
    assert prof.change_steps == [0, 5]


def test_bad_input_is_rejected_with_a_clear_message():
    with pytest.raises(ConfigError, match="ranks"):
        simulate(Cluster(ranks=0), "hl1", global_batch_size=8, steps=10)
    with pytest.raises(ConfigError, match="adjust_every"):
        simulate(Cluster(ranks=2), "hl1", global_batch_size=8, steps=10,
                 control=Control(adjust_every=1))
    with pytest.raises(ConfigError, match="profile"):
        simulate(Cluster(ranks=2), "fast", global_batch_size=8, steps=10)
    with pytest.raises(ValueError, match="min_batch_size"):
        simulate(Cluster(ranks=4), "hl1", global_batch_size=8, steps=10,
                 control=Control(min_batch_size=4))


def test_a_speed_change_mid_window_resettles_in_one_decision():
    """The dynamic schedule with every change mid-window (150 steps per level, windows
    of 20): the window that straddles a change reports the new speed only, so each
    change costs one adjustment. Before the window cut the change point out, the
    blended point misled the affine fit: 11-26 adjustments over the 7 levels and up
    to 110 steps to re-settle (the emulated benchmark's HL4 -> HL2)."""
    prof = make_profile("dynamic", 4, 1050, phase_steps=150)
    # The paper's 5% dead band, and the split for the last arrival off: the count is
    # then the window cut's doing alone (at the default 1% and 2% noise the controller
    # also refines a split by a sample or two).
    for seed in range(4):
        for arrivals in (False, True):
            res = simulate(Cluster(ranks=4, noise=0.02), prof, global_batch_size=256,
                           steps=1050, seed=seed,
                           control=Control(deadband=0.05, balance_arrivals=arrivals))
            conv = res.convergence()
            assert all(c["steps"] is not None and c["steps"] <= 20 for c in conv), (seed, conv)
            # the split for the last arrival may refine a phase's split once more
            most = len(DYNAMIC_SCHEDULE) * (2 if arrivals else 1)
            assert sum(d["changed"] for d in res.decisions) <= most, (seed, arrivals)
