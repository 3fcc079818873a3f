"""Where the model computes, and how to wait for that device's compute stream.

On CUDA the host returns from ``backward()`` once the kernels are queued; Horovod's
hooks only enqueue allreduces. A timer that stops at ``opt.step()``'s entry then
measures launch time, about the same on a fast and a slow GPU. The callable built
here synchronises the *current (compute) stream* of each device the model lives
on -- the stream the forward and backward kernels were queued on -- and nothing
else: ``torch.cuda.synchronize()`` would also wait for Horovod's NCCL stream, that
is, for the other ranks. :class:`omnihvd.timing.StepTimer` calls it at the wait
boundary.

The synchronisation costs nothing a step would not pay anyway: ``opt.step()``'s
``synchronize()`` waits for the allreduces, which wait for the gradients, which are
the last compute-stream work of the step.
"""
from typing import Callable, List, Optional

__all__ = ["model_devices", "device_names", "device_synchronizer"]


def model_devices(model) -> List:
    """The distinct devices of the model's parameters and buffers, in first-use order."""
    seen = []
    tensors = list(model.parameters()) + list(getattr(model, "buffers", lambda: [])())
    for tensor in tensors:
        if tensor.device not in seen:
            seen.append(tensor.device)
    return seen


def device_names(model, torch_module=None) -> List[str]:
    """The kinds of accelerator the model computes on, e.g. ``["NVIDIA H100 80GB HBM3"]``
    (``torch.cuda.get_device_name``; the device type where there is no name; [] on
    the CPU): ranks on the same kinds are alike (:mod:`omnihvd.alike`)."""
    if torch_module is None:
        import torch as torch_module
    names = []
    for device in model_devices(model):
        if device.type in ("cpu", "meta"):
            continue
        backend = getattr(torch_module, device.type, None)
        name = getattr(backend, "get_device_name", None)
        names.append(str(name(device)) if name is not None else device.type)
    return names


def device_synchronizer(model, torch_module=None) -> Optional[Callable[[], None]]:
    """A callable that waits for the model's compute stream(s), or None on CPU.

    Args:
        model: the ``torch.nn.Module`` being trained.
        torch_module: the ``torch`` module (tests pass a stand-in).

    Returns:
        None when every parameter is on the CPU (host time is device time there);
        otherwise a function that synchronises, for each accelerator device of the
        model, the stream current at call time (``torch.<type>.current_stream``),
        or the device itself where streams do not exist (``torch.mps``).

    Example::

        timer = omnihvd.timing.StepTimer(device_sync=device_synchronizer(model))
    """
    if torch_module is None:
        import torch as torch_module
    streams, whole = [], []
    for device in model_devices(model):
        if device.type in ("cpu", "meta"):
            continue
        backend = getattr(torch_module, device.type, None)
        if backend is not None and hasattr(backend, "current_stream"):
            streams.append((backend.current_stream, device))
        elif backend is not None and hasattr(backend, "synchronize"):
            whole.append(backend.synchronize)
    if not streams and not whole:
        return None

    def synchronize():
        for current_stream, device in streams:
            current_stream(device).synchronize()  # the stream the step's kernels went to
        for sync in whole:
            sync()
    return synchronize
