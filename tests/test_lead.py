"""Arrival lead: how long after the others the rank with the most samples should arrive
(omnihvd.lead), and how the controller, the cadence and the gathered payload carry
it. Pure, single process."""
import math

import numpy as np
import pytest

from omnihvd.arrivals import ARRIVAL_STEPS
from omnihvd.cadence import Cadence, Measurement
from omnihvd.controller import Controller
from omnihvd.lead import (DOMINANCE, LEAD_STEP, MAX_LEAD, MIN_LEAD_STEP, ArrivalLead,
                          arrival_offsets, lead_of)
from omnihvd.payload import PAYLOAD_FIELDS, payload_row, read_gathered

pytestmark = pytest.mark.unit

NAN = float("nan")
LOCAL = 0.05   # the led rank's local time in these windows, seconds


def window(lead=0.0, *, steps=20, seed=0, led=1, ranks=2, noise=0.006):
    """One window's arrival moments on one machine: rank ``led`` arrives ``lead`` after
    the last of the others on average (step-to-step noise ``noise``)."""
    rng = np.random.default_rng(seed)
    arrived = 1000.0 + 10.0 * seed + 0.1 * np.arange(steps)[:, None] + rng.normal(
        0.0, 0.002, (steps, ranks))
    others = np.delete(arrived, led, axis=1).max(axis=1)
    arrived[:, led] = others + rng.normal(lead, noise, steps)
    return arrived


def observed(search, sizes, seeds, **kw):
    """The lead after each window of ``seeds``."""
    leads = []
    for seed in seeds:
        ranks = kw.get("ranks", 2)
        search.observe(arrival_offsets(window(seed=seed, **kw), hosts=[1.0] * ranks),
                       sizes=sizes, times=[LOCAL] * len(sizes))
        leads.append(search.lead)
    return leads


def test_each_rank_arrives_relative_to_the_steps_last_arrival():
    arrived = [[10.000, 10.012, 10.004], [10.100, 10.101, NAN], [10.200, 10.203, 10.220]]
    offsets = arrival_offsets(arrived, hosts=[4.0] * 3)
    # the step with a missing arrival is left out
    assert offsets.round(4).tolist() == [[-0.012, 0.0, -0.008], [-0.02, -0.017, 0.0]]
    assert lead_of(offsets, 1).round(4).tolist() == [0.008, -0.017]
    assert lead_of(offsets, 2).round(4).tolist() == [-0.008, 0.017]


def test_ranks_on_several_machines_or_clocks_not_shared_give_no_offsets():
    assert arrival_offsets([[1.0, 2.0]], hosts=[1.0, 2.0]) is None
    assert arrival_offsets([[1.0, 2.0]], hosts=[1.0, 1.0, 1.0]) is None
    assert arrival_offsets([[1.0, 1.5]], hosts=[1.0, 1.0]).shape == (1, 2)
    assert arrival_offsets([[1.0, 900.0]], hosts=[1.0, 1.0]).shape == (0, 2)


def test_steps_that_did_not_hold_the_ranks_together_do_not_move_the_lead():
    # Sleep emulation sleeps after the backward pass: the allreduce completes during the
    # sleep, each rank is released as it arrives, and the arrival order (here the led
    # rank 1 always well before rank 0) sets nothing. Released together after the last
    # arrival, the same arrivals lead rank 1 on.
    arrived = window(lead=-0.02, seed=3, noise=0.001)
    alone, held = arrived + 0.0005, np.repeat(arrived.max(axis=1, keepdims=True) + 0.001, 2, 1)
    for released, moves in ((alone, False), (held, True)):
        search = ArrivalLead()
        search.observe(arrival_offsets(arrived, [1.0, 1.0], released), sizes=[20, 80],
                       times=[LOCAL] * 2)
        assert search.moved == moves and (search.lead > 0) == moves
    # a missing release says nothing against its step
    released = held.copy()
    released[:5, 0] = NAN
    assert arrival_offsets(arrived, [1.0, 1.0], released).shape == arrived.shape


def test_a_rank_that_arrives_last_less_often_than_its_share_is_led_step_by_step_to_the_bound():
    # 80% of the samples, arriving ~5 ms before the other: last in ~20% of the steps
    search = ArrivalLead()
    leads = observed(search, [20, 80], range(30), lead=-0.005)
    assert search.rank == 1
    assert leads[0] == pytest.approx(LEAD_STEP * LOCAL)   # one step per window
    assert np.all(np.diff(leads) >= 0) and leads[-1] == pytest.approx(MAX_LEAD * LOCAL)
    assert search.charges(2).tolist() == [0.0, -leads[-1]]
    derivative, error = search.derivative
    assert derivative < -3 * error


def test_in_closed_loop_the_rank_ends_up_last_in_about_its_share_of_the_steps():
    # the lead moves the rank's arrivals: ~5 ms early at lead 0, noise 6 ms; with 80%
    # of the samples it should arrive last in ~80% of the steps, ~5 ms late on average
    search, leads = ArrivalLead(), []
    for seed in range(40):
        arrived = window(-0.005 + search.lead, seed=seed)
        search.observe(arrival_offsets(arrived, hosts=[1.0, 1.0]), sizes=[20, 80],
                       times=[LOCAL, LOCAL])
        leads.append(search.lead)
    settled = np.array(leads[20:])
    assert 0.005 <= settled.min() and settled.max() <= 0.0175, leads
    assert np.ptp(settled) <= 2 * LEAD_STEP * LOCAL, leads


def test_with_steady_arrivals_the_lead_settles_by_bisection_instead_of_swinging():
    # noise 0.3 ms: the rank is last in ~80% of the steps only within ~0.3 ms of a
    # 5.25 ms lead; full steps of 2.5 ms would swing across it for good
    search, leads = ArrivalLead(), []
    for seed in range(30):
        arrived = window(-0.005 + search.lead, seed=seed, noise=0.0003)
        search.observe(arrival_offsets(arrived, hosts=[1.0, 1.0]), sizes=[20, 80],
                       times=[LOCAL, LOCAL])
        leads.append(search.lead)
    assert np.ptp(leads[15:]) <= 2 * MIN_LEAD_STEP * LOCAL, leads
    assert abs(leads[-1] - 0.00525) <= 0.0005, leads


def test_a_rank_last_as_often_as_its_share_keeps_its_lead_and_one_last_more_often_is_led_back():
    # 80% of the samples, last in ~80% of the steps
    assert observed(ArrivalLead(), [20, 80], range(12), lead=0.005) == [0.0] * 12
    # last in every step: led back to no lead, never before the others' mean
    search = ArrivalLead()
    ahead = observed(search, [20, 80], range(4), lead=-0.02)
    assert ahead[-1] == pytest.approx(4 * LEAD_STEP * LOCAL)
    back = observed(search, [20, 80], range(4, 30), lead=0.02)
    assert min(back) == back[-1] == 0.0 and max(back) < MAX_LEAD * LOCAL
    assert observed(ArrivalLead(), [20, 80], range(12), lead=0.02) == [0.0] * 12


def test_ranks_of_about_equal_shares_are_not_led():
    # the larger rank would be last in only ~20% of the steps, but it holds less than
    # DOMINANCE times the other's samples: which rank is "the" rank is chance there
    search = ArrivalLead()
    assert observed(search, [49, 51], range(6), lead=-0.005) == [0.0] * 6
    assert search.rank is None and not search.moved
    share = 100 / (1 + DOMINANCE)
    assert observed(ArrivalLead(), [share, 100 - share], range(3), lead=-0.005)[-1] > 0


def test_the_lead_restarts_with_a_new_rank_and_holds_without_data():
    search = ArrivalLead()
    observed(search, [20, 80], range(3), lead=-0.005)
    assert search.lead > 0
    # rank 0 now has the most samples: its lead starts from 0 (one move at most)
    observed(search, [80, 20], [7], lead=-0.005, led=0)
    assert search.rank == 0 and search.lead == pytest.approx(LEAD_STEP * LOCAL)
    search.observe(None, sizes=[80, 20], times=[LOCAL, LOCAL])   # nothing gathered
    assert search.lead == pytest.approx(LEAD_STEP * LOCAL) and not search.moved
    search.forget()
    assert search.lead == 0.0 and search.rank is None


def test_the_controller_gives_the_led_rank_more_samples_and_forgets_the_lead():
    led, plain = Controller(2, 100), Controller(2, 100)
    offsets = arrival_offsets(window(-0.005), hosts=[1.0, 1.0])
    new = led.decide([30, 70], [LOCAL, LOCAL], offsets=offsets)
    assert plain.decide([30, 70], [LOCAL, LOCAL]) == [30, 70]
    assert led.arrival_lead() == pytest.approx(LEAD_STEP * LOCAL)
    assert new[1] > 70 and sum(new) == 100
    led.forget()
    assert led.arrival_lead() == 0.0


def test_a_move_of_the_lead_passes_the_noise_gate_and_a_held_lead_does_not_reopen_it():
    noisy = [0.01, 0.01]   # equal times, 20% noise: the gate holds the split by itself
    ctl = Controller(2, 100)
    early = arrival_offsets(window(-0.005), hosts=[1.0, 1.0])
    assert ctl.decide([30, 70], [LOCAL, LOCAL], noisy, offsets=early)[1] > 70
    ctl = Controller(2, 100)
    held = arrival_offsets(window(0.005, seed=3), hosts=[1.0, 1.0])   # last in ~80%
    assert ctl.decide([20, 80], [LOCAL, LOCAL], noisy, offsets=held) == [20, 80]
    assert not ctl._lead.moved and ctl.arrival_lead() == 0.0


def test_the_cadence_keeps_arrival_moments_and_decides_with_their_offsets():
    cad = Cadence(Controller(2, 60), adjust_every=4, settle_steps=0, arrived_at=True)
    for step in range(4):
        cad.begin_step([30, 30])
        cad.record(0.1), cad.record_arrived(100.0 + step)
    measured = cad.close()
    assert measured.arrived_at.tolist() == [100.0, 101.0, 102.0, 103.0]
    assert measured.releases is None
    cad.decide(3, [20, 40], [LOCAL, LOCAL], [0.0, 0.0], [4, 4], hosts=[1.0, 1.0],
               cpusets=[1.0, 2.0], arrived_at=window(-0.005))
    assert cad.controller.arrival_lead() > 0
    assert cad.controller.lag_charges().tolist() == [0.0, 0.0]   # no releases: no lag
    quiet = Cadence(Controller(2, 60), adjust_every=4, settle_steps=0)
    quiet.begin_step([30, 30])
    quiet.record(0.1), quiet.record_arrived(5.0)
    assert quiet.close().arrived_at is None


def test_arrival_moments_travel_in_the_payload_aligned_with_the_releases():
    arrived = [np.array([5.0, NAN, 7.0]), np.array([5.1, NAN, 7.1])]
    releases = [np.array([5.2, NAN, NAN]), np.array([5.3, NAN, 7.3])]
    rows = [payload_row(Measurement(time=0.2, error=0.0, count=3, releases=releases[r],
                                    arrived_at=arrived[r]), [10, 30], r, 0, 40)
            for r in (0, 1)]
    assert all(len(r) == PAYLOAD_FIELDS + 2 * ARRIVAL_STEPS for r in rows)
    got = read_gathered(np.array(rows), step=3)
    # the step neither block has is left out of both: row j is one step in each
    assert got.arrived_at.tolist() == [[5.0, 5.1], [7.0, 7.1]]
    assert got.releases[0].tolist() == [5.2, 5.3] and math.isnan(got.releases[1, 0])
    assert got.releases[1, 1] == 7.3 and got.arrivals is None


def test_a_move_of_the_lead_alone_leaves_the_other_ranks_shares_among_themselves():
    # 3:1:1:1 at balanced means: the lead gives the lone rank more, and the three
    # ranks of equal speed give it up in proportion, staying equal
    arrived = window(-0.005, ranks=4, led=0)
    for sizes in ([141, 39, 38, 38], [150, 36, 35, 35]):
        ctl = Controller(4, 256)
        new = ctl.decide(sizes, [0.03] * 4, [0.003] * 4,
                         offsets=arrival_offsets(arrived, hosts=[1.0] * 4))
        assert ctl._lead.moved and new[0] > sizes[0] and sum(new) == 256
        assert max(new[1:]) - min(new[1:]) <= max(sizes[1:]) - min(sizes[1:]) + 1, new


def test_a_rank_that_changes_speed_restarts_the_search_without_the_window_of_the_change():
    ctl = Controller(2, 100)
    early = arrival_offsets(window(-0.005), hosts=[1.0, 1.0])
    sizes = [30, 70]
    for _ in range(3):
        sizes = ctl.decide(sizes, [LOCAL, LOCAL], offsets=early)
    assert ctl.arrival_lead() > 0
    # rank 1 slows down fourfold: its old model no longer predicts it
    ctl.decide(sizes, [LOCAL, 4 * LOCAL], offsets=early)
    assert ctl.arrival_lead() == 0.0 and ctl._lead.rank is None
