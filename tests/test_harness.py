"""omnihvd.tools.harness: the benchmarks' one training loop, driven with fakes that
record every call in one shared list, so the order of hooks is checked exactly."""
import contextlib

import pytest

from omnihvd.errors import ConfigError
from omnihvd.tools import harness

pytestmark = pytest.mark.unit


class Fake:
    """Callback, sampler and emulator in one: every method call is appended to ``calls``."""

    HOOKS = ("on_train_begin", "on_epoch_begin", "on_batch_begin", "on_batch_end",
             "on_epoch_end", "on_train_end")

    def __init__(self, calls, prefix):
        self.calls, self.prefix = calls, prefix

    def __getattr__(self, name):
        if name not in self.HOOKS + ("set_epoch", "start", "finish", "working"):
            raise AttributeError(name)
        if name == "working":   # the callback's context: the emulator's sleep is work
            return lambda: contextlib.nullcontext(self.calls.append((self.prefix + name,)))
        return lambda *args: self.calls.append((self.prefix + name,) + args)


def fakes():
    calls = []
    return calls, Fake(calls, "cb."), Fake(calls, "sampler."), Fake(calls, "emu.")


def expected_step(index, size=2):
    return [("cb.on_batch_begin",), ("emu.start", index), ("body", index), ("cb.working",),
            ("emu.finish", size), ("opt.step",), ("cb.on_batch_end",)]


def body(calls, step):
    calls.append(("body", step.index))
    step.compute_done()
    calls.append(("opt.step",))


BATCHES = [[0, 1], [2, 3], [4, 5]]   # three steps per epoch


def test_order_of_hooks_across_epochs_and_a_partial_last_epoch():
    calls, cb, sampler, emu = fakes()
    with harness.steps(cb, sampler, BATCHES, max_steps=7, emulator=emu) as run:
        for step in run:
            body(calls, step)
    want = [("cb.on_train_begin",)]
    for epoch, indices in ((0, [0, 1, 2]), (1, [3, 4, 5]), (2, [6])):
        want += [("sampler.set_epoch", epoch), ("cb.on_epoch_begin", epoch)]
        for i in indices:
            want += expected_step(i)
        want += [("cb.on_epoch_end", epoch)]
    want += [("cb.on_train_end",)]
    assert calls == want
    assert run.finished and run.step == 7 and run.epoch == 2


def test_the_last_step_at_an_epoch_end_begins_no_further_epoch():
    calls, cb, sampler, emu = fakes()
    with harness.steps(cb, sampler, BATCHES, max_steps=3, emulator=emu) as run:
        for step in run:
            body(calls, step)
    assert [c for c in calls if c[0] == "cb.on_epoch_begin"] == [("cb.on_epoch_begin", 0)]
    assert calls[-2:] == [("cb.on_epoch_end", 0), ("cb.on_train_end",)]


def test_the_batches_default_to_the_sampler_and_the_batch_is_handed_over():
    class Sampler(list):
        def set_epoch(self, epoch):
            self.epoch = epoch

    sampler = Sampler([[7], [8, 9]])
    seen = []
    with harness.steps(None, sampler, max_steps=3) as run:
        for step in run:
            seen.append((step.index, step.epoch, step.batch, step.size))
    assert seen == [(0, 0, [7], 1), (1, 0, [8, 9], 2), (2, 1, [7], 1)]
    assert sampler.epoch == 1


def test_plain_horovod_without_callback_still_drives_sampler_and_emulator():
    calls, _, sampler, emu = fakes()
    with harness.steps(None, sampler, BATCHES, max_steps=4, emulator=emu) as run:
        for step in run:
            body(calls, step)
    want = [("sampler.set_epoch", 0)]
    for i in range(3):
        want += [s for s in expected_step(i) if not s[0].startswith("cb.")]
    want += [("sampler.set_epoch", 1)] + [s for s in expected_step(3) if not s[0].startswith("cb.")]
    assert calls == want


def test_break_abandons_the_step_and_still_ends_epoch_and_run():
    calls, cb, sampler, emu = fakes()
    with harness.steps(cb, sampler, BATCHES, max_steps=100, emulator=emu) as run:
        for step in run:
            body(calls, step)
            if step.index == 4:
                break
    assert calls[-8:] == expected_step(4)[:-1] + [("cb.on_epoch_end", 1), ("cb.on_train_end",)]
    assert not run.finished and run.step == 4


def test_an_exception_calls_no_further_hook():
    # the callback's abort-on-exception must see the exception with its hooks in place
    calls, cb, sampler, emu = fakes()
    with pytest.raises(RuntimeError, match="injected"):
        with harness.steps(cb, sampler, BATCHES, max_steps=100, emulator=emu) as run:
            for step in run:
                if step.index == 4:
                    raise RuntimeError("injected")
                body(calls, step)
    assert calls[-2:] == [("cb.on_batch_begin",), ("emu.start", 4)]
    assert ("cb.on_train_end",) not in calls and calls.count(("cb.on_epoch_end", 1)) == 0


def test_an_exception_in_a_hook_calls_no_further_hook():
    calls, cb, sampler, emu = fakes()

    class Failing(Fake):
        def on_batch_end(self):
            raise ValueError("hook failed")

    cb = Failing(calls, "cb.")
    with pytest.raises(ValueError, match="hook failed"):
        with harness.steps(cb, sampler, BATCHES, max_steps=10, emulator=emu) as run:
            for step in run:
                body(calls, step)
    assert calls[-1] == ("opt.step",) and ("cb.on_train_end",) not in calls


def test_stop_is_asked_once_after_every_complete_step():
    calls, cb, sampler, emu = fakes()
    asked = []

    def stop(step):
        asked.append(step.index)
        calls.append(("stop", step.index))
        return step.index == 4

    with harness.steps(cb, sampler, BATCHES, stop=stop, emulator=emu) as run:
        for step in run:
            body(calls, step)
    assert asked == [0, 1, 2, 3, 4]   # once each, also for an epoch's last step
    assert calls[-4:] == [("cb.on_batch_end",), ("stop", 4), ("cb.on_epoch_end", 1),
                          ("cb.on_train_end",)]
    assert run.finished


def test_max_steps_ends_before_stop_is_asked_for_the_last_step():
    asked = []
    with harness.steps(None, batches=BATCHES, max_steps=2,
                       stop=lambda s: asked.append(s.index)) as run:
        for _ in run:
            pass
    assert asked == [0] and run.step == 2


def test_an_explicit_end_runs_on_batch_end_once_and_code_after_it_sees_it():
    calls, cb, sampler, emu = fakes()
    with harness.steps(cb, sampler, BATCHES, max_steps=2, emulator=emu) as run:
        for step in run:
            body(calls, step)
            step.end()
            step.end()   # idempotent
            calls.append(("after", step.index, step.ended, run.step))
    assert calls.count(("cb.on_batch_end",)) == 2
    assert calls[calls.index(("cb.on_batch_end",)) + 1] == ("after", 0, True, 1)


def test_a_resumed_run_starts_at_its_step_and_epoch_and_skips_an_empty_resumed_epoch():
    calls, cb, _, emu = fakes()

    class Resumed:
        """A sampler resumed at the very end of epoch 4: nothing left in it."""

        def __init__(self):
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

        def __iter__(self):
            return iter([] if self.epochs == [4] else BATCHES)

    sampler = Resumed()
    with harness.steps(cb, sampler, max_steps=14, emulator=emu, first_step=12,
                       first_epoch=4) as run:
        for step in run:
            body(calls, step)
    assert sampler.epochs == [4, 5]
    assert [c for c in calls if c[0] == "emu.start"] == [("emu.start", 12), ("emu.start", 13)]
    assert calls[1:3] == [("cb.on_epoch_begin", 4), ("cb.on_epoch_end", 4)]


def test_a_run_already_at_max_steps_runs_no_epoch():
    calls, cb, sampler, _ = fakes()
    with harness.steps(cb, sampler, BATCHES, max_steps=5, first_step=5) as run:
        for _ in run:
            raise AssertionError("no step expected")
    assert calls == [("cb.on_train_begin",), ("cb.on_train_end",)]


def test_an_epoch_without_batches_is_an_error_not_an_endless_loop():
    with pytest.raises(ConfigError, match="epoch 1 yielded no batch"):
        with harness.steps(None, batches=[], max_steps=3) as run:
            for _ in run:
                pass


def test_timings_follow_the_phases_of_a_step():
    with harness.steps(None, batches=BATCHES, max_steps=4) as run:
        steps = []
        for step in run:
            step.compute_done()
            step.end()
            steps.append(step)
            if step.index == 1:
                run.restart_clock()
                restarted = run._clock
    for s in steps:
        marks = [s.t_prev, s.t_begin, s.t_work, s.t_wait, s.t_synced, s.t_end]
        assert marks == sorted(marks)
        assert s.hook_s == (s.t_work - s.t_begin) + (s.t_end - s.t_synced)
        assert s.local_s == s.t_wait - s.t_work and s.step_s == s.t_end - s.t_prev
    assert steps[1].t_prev == steps[0].t_end
    assert steps[2].t_prev == restarted > steps[1].t_end   # the evaluation time is left out


def test_local_time_is_none_without_compute_done():
    with harness.steps(None, batches=BATCHES, max_steps=1) as run:
        for step in run:
            pass
    assert step.local_s is None and step.step_s >= 0


def test_size_counts_the_samples_of_a_loader_batch():
    with harness.steps(None, batches=[("xx", "yy")], max_steps=1,
                       size=lambda b: len(b[0])) as run:
        sizes = [step.size for step in run]
    assert sizes == [2]


@pytest.mark.parametrize("kwargs, message", [
    (dict(batches=BATCHES), "max_steps or stop"),
    (dict(max_steps=3), "batches or a sampler"),
    (dict(batches=BATCHES, max_steps=-1), "max_steps must be an int >= 0"),
    (dict(batches=BATCHES, max_steps=2.0), "max_steps must be an int >= 0"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        harness.steps(None, **kwargs)


def test_misuse_is_an_error():
    run = harness.steps(None, batches=BATCHES, max_steps=1)
    with pytest.raises(ConfigError, match="inside its with block"):
        iter(run)
    calls, _, _, emu = fakes()
    with pytest.raises(ConfigError, match="without step.compute_done"):
        with harness.steps(None, batches=BATCHES, max_steps=1, emulator=emu) as run:
            for step in run:
                pass
    with pytest.raises(ConfigError, match="called twice"):
        with harness.steps(None, batches=BATCHES, max_steps=1) as run:
            for step in run:
                step.compute_done()
                step.compute_done()
    with harness.steps(None, batches=BATCHES, max_steps=1) as run:
        list(run)
        with pytest.raises(ConfigError, match="iterated once"):
            iter(run)
    with pytest.raises(ConfigError, match="entered once"):
        with run:
            pass
