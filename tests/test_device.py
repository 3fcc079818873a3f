"""omnihvd.device: which stream the timer waits for (single process; fakes, no GPU)."""
import types

import pytest
import torch

from omnihvd.device import device_names, device_synchronizer, model_devices

pytestmark = pytest.mark.single


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def synchronize(self):
        self.log.append(self.name)


def fake_torch(log):
    """A stand-in for ``torch`` with a CUDA backend whose current stream is recorded,
    and a synchronize() that must never be called (it would wait for NCCL too)."""
    def current_stream(device):
        return FakeStream(log, "stream of %s" % device)

    def device_wide():
        raise AssertionError("torch.cuda.synchronize() also waits on the NCCL stream")
    return types.SimpleNamespace(cuda=types.SimpleNamespace(current_stream=current_stream,
                                                            synchronize=device_wide),
                                 mps=types.SimpleNamespace(synchronize=lambda: log.append("mps")))


class OnDevices:
    """A model-like object whose parameters claim to live on the given devices."""

    def __init__(self, *names):
        self._params = [types.SimpleNamespace(device=torch.device(n)) for n in names]

    def parameters(self):
        return iter(self._params)

    def buffers(self):
        return iter(())


def test_cpu_model_needs_no_device_sync():
    assert device_synchronizer(torch.nn.Linear(3, 2)) is None
    assert model_devices(torch.nn.Linear(3, 2)) == [torch.device("cpu")]


def test_cuda_model_syncs_its_current_stream_only():
    log = []
    sync = device_synchronizer(OnDevices("cuda:1", "cuda:1"), torch_module=fake_torch(log))
    sync()
    assert log == ["stream of cuda:1"]


def test_a_model_split_over_devices_syncs_each_once():
    log = []
    sync = device_synchronizer(OnDevices("cuda:0", "cpu", "cuda:1", "cuda:0"),
                               torch_module=fake_torch(log))
    sync()
    assert log == ["stream of cuda:0", "stream of cuda:1"]


def test_streamless_backend_syncs_the_device():
    log = []
    device_synchronizer(OnDevices("mps"), torch_module=fake_torch(log))()
    assert log == ["mps"]


def test_device_names_say_the_kind_of_accelerator_not_its_index():
    names = {"cuda:0": "NVIDIA H100", "cuda:1": "NVIDIA H100", "cuda:2": "Tesla V100"}
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_device_name=lambda device: names[str(device)]), mps=types.SimpleNamespace())
    assert device_names(torch.nn.Linear(3, 2)) == []
    assert device_names(OnDevices("cuda:0"), fake) == device_names(OnDevices("cuda:1"), fake)
    assert device_names(OnDevices("cuda:2", "cpu"), fake) == ["Tesla V100"]
    assert device_names(OnDevices("mps"), fake) == ["mps"]   # no name: the type
