"""Synchronous and asynchronous mode share hook names, hook signatures, the abort
option and the abort path, so a training loop switches mode by its constructor."""
import inspect

import pytest

from omnihvd.asynchronous import AsyncOmniLearnCallback
from omnihvd.callback import OmniLearnCallback

pytestmark = pytest.mark.unit

HOOKS = ("on_train_begin", "on_epoch_begin", "on_batch_begin", "on_batch_end",
         "on_epoch_end", "on_train_end")


@pytest.mark.parametrize("hook", HOOKS)
def test_hooks_have_the_same_signature(hook):
    sync = inspect.signature(getattr(OmniLearnCallback, hook))
    asynchronous = inspect.signature(getattr(AsyncOmniLearnCallback, hook))
    assert sync == asynchronous, (hook, str(sync), str(asynchronous))


def test_keras_style_hook_signatures():
    sig = inspect.signature(OmniLearnCallback.on_batch_end)
    assert list(sig.parameters) == ["self", "batch", "logs"]
    assert inspect.signature(OmniLearnCallback.on_epoch_begin).parameters["logs"].default is None


def test_shared_options_have_the_same_names_and_defaults():
    sync = inspect.signature(OmniLearnCallback.__init__).parameters
    asynchronous = inspect.signature(AsyncOmniLearnCallback.__init__).parameters
    shared = ("global_batch_size", "initial_batch_sizes", "min_batch_size", "max_batch_size",
              "deadband", "gain", "adjust_every", "policy", "settle_steps", "timing", "comm",
              "abort_on_exception")
    for name in shared:
        assert name in sync and name in asynchronous, name
        assert sync[name].default == asynchronous[name].default, name
    assert "abort_on_error" not in asynchronous


def test_one_abort_path():
    # Both modes end a job through omnihvd.faults.fail_job; the asynchronous
    # transport has no abort of its own any more.
    import omnihvd.asynchronous.callback as async_callback
    import omnihvd.asynchronous.transport as transport
    from omnihvd import faults

    assert async_callback.fail_job is faults.fail_job
    assert not hasattr(transport, "abort")
    assert "fail_job(" in inspect.getsource(faults._AbortHook.__call__)
