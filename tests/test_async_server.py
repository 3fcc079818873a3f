"""Asynchronous mode in one process: server rules, weighting, staleness, balancing, sampler."""
import collections
import heapq

import numpy as np
import pytest

from omnihvd.asynchronous import (AsyncBatchSampler, IntervalBalancer, ProtocolError, ServerCore,
                                  staleness_scale, summarize_staleness)
from omnihvd.asynchronous.protocol import DONE, FINAL, HELLO, PARAMS, PUSH, decode, encode
from omnihvd.errors import ConfigError

pytestmark = pytest.mark.unit

WORKERS = [1, 2, 3]


def make_core(**kw):
    opts = dict(rank=0, worker_ranks=WORKERS, global_batch_size=8, lr=1.0, layout=77)
    opts.update(kw)
    return ServerCore(np.zeros(4, np.float32), **opts)


def send(core, kind, source, payload=None, sender=None, **header):
    msg = decode(encode(kind, source if sender is None else sender, payload, **header), source)
    return [(dest, decode(buf)) for dest, buf in core.handle(msg, source)]


def hello_all(core):
    for w in WORKERS:
        [(dest, reply)] = send(core, HELLO, w, layout=77)
        assert dest == w and reply.kind == PARAMS and reply.version == 0


def grad(value=1.0, n=4, dtype=np.float32):
    return np.full(n, value, dtype)


def test_push_is_weighted_by_batch_size_and_staleness_recorded():
    core = make_core()
    hello_all(core)
    [(dest, reply)] = send(core, PUSH, 1, grad(), seq=0, version=0, batch_size=2)
    assert dest == 1 and reply.version == 1
    np.testing.assert_array_equal(reply.payload, grad(-0.25))  # lr * 2/8 * 1
    send(core, PUSH, 2, grad(2.0), seq=0, version=0, batch_size=4)  # computed on v0, now v1
    np.testing.assert_array_equal(core.params, grad(-0.25 - 1.0))
    send(core, PUSH, 1, grad(), seq=1, version=1, batch_size=2)     # v1, now v2
    assert core.log["staleness"] == [0, 1, 1]
    assert core.log["worker"] == [1, 2, 1] and core.log["batch_size"] == [2, 4, 2]
    assert core.version == 3 and core.applied == {1: 2, 2: 1, 3: 0}


def test_one_round_of_weighted_pushes_equals_one_synchronous_step():
    core = make_core(lr=0.5)
    hello_all(core)
    sizes, grads = [1, 3, 4], [grad(1.0), grad(-2.0), grad(4.0)]
    for w, b, g in zip(WORKERS, sizes, grads):
        send(core, PUSH, w, g, seq=0, version=0, batch_size=b)
    expected = -0.5 * sum(b / 8 * g for b, g in zip(sizes, grads))
    np.testing.assert_allclose(core.params, expected, rtol=1e-6)


def test_done_waits_for_every_worker_then_sends_final_to_all():
    core = make_core()
    hello_all(core)
    send(core, PUSH, 2, grad(), seq=0, version=0, batch_size=1)
    assert send(core, DONE, 1, seq=0) == []
    assert send(core, DONE, 2, seq=1) == []
    assert core.pending() == [3] and not core.finished
    replies = send(core, DONE, 3, seq=0)
    assert core.finished and sorted(d for d, _ in replies) == WORKERS
    assert all(m.kind == FINAL and m.version == 1 for _, m in replies)
    rep = core.report()
    assert rep["updates"] == 1 and rep["applied"] == {"1": 0, "2": 1, "3": 0}


@pytest.mark.parametrize("seq,match", [(1, "sequence number 1, expected 0: an update was lost"),
                                       (3, "an update was lost")])
def test_sequence_gap_is_a_lost_update(seq, match):
    core = make_core()
    hello_all(core)
    with pytest.raises(ProtocolError, match=match):
        send(core, PUSH, 1, grad(), seq=seq, version=0, batch_size=1)


def test_repeated_sequence_number_is_rejected_not_applied_twice():
    core = make_core()
    hello_all(core)
    send(core, PUSH, 1, grad(), seq=0, version=0, batch_size=1)
    before = core.params.copy()
    with pytest.raises(ProtocolError, match="expected 1: an update was a repeat"):
        send(core, PUSH, 1, grad(), seq=0, version=1, batch_size=1)
    np.testing.assert_array_equal(core.params, before)
    assert core.applied[1] == 1


def test_done_with_wrong_count_names_lost_or_duplicated_updates():
    core = make_core()
    hello_all(core)
    send(core, PUSH, 1, grad(), seq=0, version=0, batch_size=1)
    with pytest.raises(ProtocolError, match="worker rank 1: the worker sent 2 pushes but this "
                                            "server applied 1: updates were lost or duplicated"):
        send(core, DONE, 1, seq=2)


@pytest.mark.parametrize("payload,header,match", [
    (grad(n=3), {}, "gradient shard has 3 elements, expected 4"),
    (grad(dtype=np.float64), {}, "gradient dtype float64, expected float32"),
    (grad(np.nan), {}, "the gradient holds NaN or infinity"),
    (grad(), {"version": 5}, "version 5 is newer than the server's 0"),
    (grad(), {"batch_size": 0}, "batch_size 0, expected >= 1"),
])
def test_malformed_push_is_rejected_naming_the_worker(payload, header, match):
    core = make_core()
    hello_all(core)
    fields = dict(seq=0, version=0, batch_size=1)
    fields.update(header)
    with pytest.raises(ProtocolError, match="server rank 0 rejected PUSH from worker rank 2: " + match):
        send(core, PUSH, 2, payload, **fields)
    assert core.version == 0 and not core.params.any()


def test_unknown_worker_impostor_and_wrong_order():
    core = make_core()
    with pytest.raises(ProtocolError, match="got HELLO from rank 9, which is not a worker"):
        send(core, HELLO, 9, layout=77)
    with pytest.raises(ProtocolError, match="from worker rank 1: it claims to come from rank 2"):
        send(core, HELLO, 1, sender=2, layout=77)
    with pytest.raises(ProtocolError, match="the worker is new \\(HELLO must come first"):
        send(core, PUSH, 1, grad(), batch_size=1)
    with pytest.raises(ProtocolError, match="parameter layout \\(fingerprint 78\\) differs"):
        send(core, HELLO, 1, layout=78)
    send(core, HELLO, 1, layout=77)
    with pytest.raises(ProtocolError, match="already said HELLO"):
        send(core, HELLO, 1, layout=77)
    with pytest.raises(ProtocolError, match="servers accept only HELLO, PUSH and DONE"):
        send(core, PARAMS, 1, grad())
    send(core, DONE, 1, seq=0)
    with pytest.raises(ProtocolError, match="the worker is done"):
        send(core, PUSH, 1, grad(), batch_size=1)


def test_momentum_and_weight_decay():
    core = make_core(lr=0.1, momentum=0.9, weight_decay=0.5)
    core.params[:] = 2.0
    hello_all(core)
    send(core, PUSH, 1, grad(1.0), seq=0, version=0, batch_size=4)  # weight 1/2
    v1 = 0.5 * (1.0 + 0.5 * 2.0)
    p1 = 2.0 - 0.1 * v1
    send(core, PUSH, 1, grad(1.0), seq=1, version=1, batch_size=4)
    v2 = 0.9 * v1 + 0.5 * (1.0 + 0.5 * p1)
    np.testing.assert_allclose(core.params, 2.0 - 0.1 * v1 - 0.1 * v2, rtol=1e-6)


def test_staleness_aware_learning_rate():
    assert [staleness_scale(t, 3, None) for t in (0, 9)] == [1.0, 1.0]
    assert [staleness_scale(t, 3, "inverse") for t in (0, 1, 2, 4, 8)] == [1, 1, 1, 0.5, 0.25]
    assert staleness_scale(5, 1, "inverse") == 0.2  # one worker: tau0 = 1
    with pytest.raises(ConfigError, match="staleness_lr must be one of"):
        staleness_scale(1, 3, "sqrt")
    with pytest.raises(ConfigError, match="staleness_lr must be one of"):
        make_core(staleness_lr="sqrt")
    core = make_core(staleness_lr="inverse")
    hello_all(core)
    for seq in range(5):  # worker 1 pushes 5 times, then worker 2 on version 0: staleness 5
        send(core, PUSH, 1, grad(0.0), seq=seq, version=seq, batch_size=8)
    send(core, PUSH, 2, grad(1.0), seq=0, version=0, batch_size=8)
    assert core.log["staleness"][-1] == 5 and core.log["scale"][-1] == 2 / 5
    np.testing.assert_allclose(core.params, -0.4)


def test_bad_server_options():
    with pytest.raises(ConfigError, match="lr must be a number >= 0"):
        make_core(lr=-1)
    with pytest.raises(ConfigError, match="at least one worker"):
        make_core(worker_ranks=[])


def test_summarize_staleness():
    assert summarize_staleness([]) == {"count": 0, "median": None, "p95": None, "max": None,
                                       "mean": None}
    s = summarize_staleness(range(101))
    assert (s["median"], s["p95"], s["max"]) == (50.0, 95.0, 100)


# ------------------------------------------------------------------ balancing


def simulate(speeds, balance, pushes=600, overhead=0.002, **kw):
    """Event-driven run of a ServerCore: worker i needs overhead + b_i / speeds[i] seconds."""
    n = len(speeds)
    workers = list(range(1, n + 1))
    bal = IntervalBalancer(n, 64 * n, balance=balance, adjust_every=2, **kw)
    core = ServerCore(np.zeros(2, np.float32), rank=0, worker_ranks=workers,
                      global_batch_size=64 * n, lr=0.0, balancer=bal)
    state = {}
    events = []
    for i, w in enumerate(workers):
        [(_, buf)] = core.handle(decode(encode(HELLO, w)), w)
        r = decode(buf)
        state[w] = {"version": r.version, "size": r.batch_size, "seq": 0}
        heapq.heappush(events, (overhead + r.batch_size / speeds[i], w, 0.0))
    for _ in range(pushes):
        t, w, last = heapq.heappop(events)
        s = state[w]
        msg = encode(PUSH, w, np.zeros(2, np.float32), seq=s["seq"], version=s["version"],
                     batch_size=s["size"], interval_us=int((t - last) * 1e6))
        [(_, buf)] = core.handle(decode(msg), w)
        r = decode(buf)
        s.update(version=r.version, size=r.batch_size, seq=s["seq"] + 1)
        heapq.heappush(events, (t + overhead + s["size"] / speeds[w - 1], w, t))
    return core


@pytest.mark.parametrize("policy", ["affine", "proportional"])
def test_balancing_equalises_update_rates_and_staleness(policy):
    speeds = [6.0, 6.0, 4.0, 32.0]  # HL8, samples per ms
    speeds = [s * 1000 for s in speeds]
    equal = simulate(speeds, balance=False)
    balanced = simulate(speeds, balance=True, policy=policy)
    assert equal.report()["batch_sizes"] == [64, 64, 64, 64]
    sizes = balanced.report()["batch_sizes"]
    assert sum(sizes) == 256
    ideal = np.array(speeds) / sum(speeds) * 256
    assert np.all(np.abs(np.array(sizes) - ideal) <= 0.1 * ideal + 2), (sizes, ideal)
    tail = slice(300, None)  # after convergence
    counts = np.bincount(np.array(balanced.log["worker"][tail]), minlength=5)[1:]
    assert counts.max() <= 1.3 * counts.min(), counts  # everyone updates at the same rate
    eq_stale = summarize_staleness(equal.log["staleness"][tail])
    bal_stale = summarize_staleness(balanced.log["staleness"][tail])
    assert bal_stale["max"] < eq_stale["max"] and bal_stale["p95"] < eq_stale["p95"]
    assert bal_stale["median"] == 3.0  # workers - 1: they take turns


def test_balancer_options_and_frozen_state():
    with pytest.raises(ConfigError, match="adjust_every must be an int >= 1"):
        IntervalBalancer(2, 10, adjust_every=0)
    with pytest.raises(ConfigError, match="initial_batch_sizes \\[3, 3\\] sum to 6, not "
                                          "global_batch_size 10"):
        IntervalBalancer(2, 10, initial_batch_sizes=[3, 3])
    with pytest.raises(ConfigError, match="policy must be one of"):
        IntervalBalancer(2, 10, policy="magic")
    bal = IntervalBalancer(2, 10, initial_batch_sizes=[3, 7], adjust_every=1, settle_steps=0,
                           policy="proportional")
    bal.record(0, 3, 1.0)
    bal.record(1, 5, 1.0)  # a stale size: ignored
    assert not bal.after_update() and not bal.after_update()  # worker 1 has no sample yet
    bal.record(1, 7, 1.0)
    bal.freeze()
    assert not bal.after_update() and bal.sizes == [3, 7]


# -------------------------------------------------------------------- sampler


class FakeCallback:
    def __init__(self, batch_size, worker_index=0):
        self.batch_size, self.worker_index = batch_size, worker_index


def test_sampler_follows_batch_size_changes_and_covers_each_index_once():
    cb = FakeCallback(10)
    sampler = AsyncBatchSampler(100, cb, seed=3)
    seen, sizes = [], []
    for i, batch in enumerate(sampler):
        seen += batch
        sizes.append(len(batch))
        cb.batch_size = 10 if i < 1 else 25
    assert sizes == [10, 10, 25, 25, 25] and len(seen) == len(set(seen)) == 95
    cb.batch_size = 30
    assert len(sampler) == 3 and [len(b) for b in sampler] == [30, 30, 30]
    assert [len(b) for b in AsyncBatchSampler(100, cb, drop_last=False)] == [30, 30, 30, 10]


def test_sampler_orders_differ_by_worker_and_epoch_and_repeat_by_seed():
    a = AsyncBatchSampler(50, FakeCallback(5, 0), seed=1)
    b = AsyncBatchSampler(50, FakeCallback(5, 1), seed=1)
    assert not np.array_equal(a.order(), b.order())
    first = a.order()
    a.set_epoch(1)
    assert not np.array_equal(first, a.order())
    a.set_epoch(0)
    assert np.array_equal(first, a.order())


def test_sampler_bad_input():
    with pytest.raises(ConfigError, match="dataset_len must be an int >= 1"):
        AsyncBatchSampler(0, FakeCallback(1))
    with pytest.raises(ConfigError, match="batch_size must be an int >= 1, got None"):
        list(AsyncBatchSampler(10, FakeCallback(None)))
    with pytest.raises(ConfigError, match="batch_size 11 is larger than the dataset"):
        list(AsyncBatchSampler(10, FakeCallback(11)))   # it yielded empty epochs
    assert [len(b) for b in AsyncBatchSampler(10, FakeCallback(11), drop_last=False)] == [10]


def test_sampler_tells_the_callback_each_batch_size_as_it_hands_it_out():
    cb = FakeCallback(4)
    cb.sizes_handed_out = collections.deque([7, 7])   # a pass left early: never trained
    sampler = AsyncBatchSampler(10, cb, drop_last=False)
    batches = iter(sampler)
    next(batches)
    cb.batch_size = 5
    next(batches)
    assert list(cb.sizes_handed_out) == [4, 5]
    next(batches)   # the short last one
    assert list(cb.sizes_handed_out) == [4, 5, 1]
