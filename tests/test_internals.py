"""Every private attribute of Horovod or PyTorch that omnihvd reads (omnihvd.internals)
is still where omnihvd reads it: each test fails loudly when a framework release
renames or drops one, instead of omnihvd silently falling back."""
import pytest
import torch
import torch.distributed as dist

import horovod.torch as hvd
from omnihvd import internals

pytestmark = [pytest.mark.single, pytest.mark.usefixtures("horovod")]


def _horovod_optimizer(**kwargs):
    model = torch.nn.Linear(2, 1)
    return model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), **kwargs)


def test_torch_runs_a_callback_at_the_end_of_a_backward_pass():
    order, x = [], torch.ones(3, requires_grad=True)

    def hook(grad):
        assert internals.after_backward(lambda: order.append("end"))
        order.append("hook")

    x.register_hook(hook)
    (x * 2).sum().backward()
    assert order == ["hook", "end"]


def test_horovod_keeps_its_synchronized_flag_and_reduced_set():
    model, opt = _horovod_optimizer()
    assert internals.synchronized_flag(opt) is False
    model(torch.ones(1, 2)).sum().backward()
    opt.synchronize()
    assert internals.synchronized_flag(opt) is True
    internals.clear_synchronized_flag(opt)
    assert internals.synchronized_flag(opt) is False
    with opt.skip_synchronize():
        opt.step()
    assert isinstance(internals.horovod_reduced(opt), set)   # empty on one rank
    assert internals.horovod_reduced(torch.optim.SGD(model.parameters(), lr=0.1)) is None


def test_horovod_can_defer_every_allreduce_to_synchronize():
    # the public method omnihvd uses for per-rank accumulation (omnihvd.backend.HorovodBackend._accumulate_per_rank)
    _, opt = _horovod_optimizer(backward_passes_per_step=2)
    opt.set_backward_passes_per_step(7)
    assert opt.backward_passes_per_step == 7


def test_horovod_names_its_adasum_optimizer_class():
    from horovod.torch.optimizer import _DistributedAdasumOptimizer

    fake = type("Adasum", (_DistributedAdasumOptimizer,), {})   # a subclass keeps its step
    assert internals.adasum_optimizer(object.__new__(fake))
    assert not internals.adasum_optimizer(_horovod_optimizer()[1])


def test_ddp_keeps_its_comm_hooks_bucket_flag_and_tensor_versions(tmp_path):
    dist.init_process_group("gloo", init_method="file://%s" % (tmp_path / "store"), rank=0,
                            world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        assert internals.comm_hook_name(model) is None
        assert internals.ddp_buckets_rebuilt(model) is False

        def my_hook(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        model.register_comm_hook(None, my_hook)
        assert internals.comm_hook_name(model) == "my_hook"
        p = next(model.parameters())
        before = internals.tensor_version(p)
        with torch.no_grad():
            p.add_(1.0)
        assert internals.tensor_version(p) == before + 1
    finally:
        dist.destroy_process_group()
