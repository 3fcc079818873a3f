"""Fast single-process tests of omnihvd.weighting: the weights, the hooks, the optimizer check.

The optimizer check needs a real Horovod optimizer; a world of one rank (``hvd.init()``
in plain pytest, no mpirun) is enough for that.
"""
import pytest
import torch

import horovod.torch as hvd
from omnihvd.errors import ConfigError
from omnihvd.weighting import (
    GradientWeight,
    _optimizer_op,
    allreduce_weight,
    register_gradient_weight,
    weighted_parameters,
)

pytestmark = pytest.mark.single


# ------------------------------------------------------------- allreduce_weight


@pytest.mark.parametrize("sizes", [[8, 8, 16, 32], [1, 2, 3], [5], [7, 1], [100, 1, 1, 1]])
def test_weights_recover_the_global_batch_mean(sizes):
    # sum_i w_i / n (Average) and sum_i w_i (Sum) both give sum_i b_i / B = 1, and
    # each rank's share is b_i / B: exactly the mean over the global batch.
    n, B = len(sizes), sum(sizes)
    avg = [allreduce_weight(b, sizes, average=True) for b in sizes]
    tot = [allreduce_weight(b, sizes, average=False) for b in sizes]
    assert avg == pytest.approx([n * b / B for b in sizes])
    assert tot == pytest.approx([b / B for b in sizes])
    assert sum(avg) / n == pytest.approx(1.0)
    assert sum(tot) == pytest.approx(1.0)


def test_documented_weight_values():
    assert allreduce_weight(8, [8, 8, 16, 32], average=True) == 0.5
    assert allreduce_weight(32, [8, 8, 16, 32], average=True) == 2.0
    assert allreduce_weight(8, [8, 8, 16, 32], average=False) == 0.125
    assert allreduce_weight(16, [16], average=True) == 1.0
    assert allreduce_weight(16, [16], average=False) == 1.0
    assert type(allreduce_weight(3, [3, 5], average=False)) is float


def test_equal_sizes_give_weight_one_under_average():
    assert all(allreduce_weight(4, [4] * 5, average=True) == 1.0 for _ in range(5))


@pytest.mark.parametrize("b,sizes", [
    (1, []),            # no ranks
    (0, [0, 0]),        # empty global batch
    (-1, [4, 4]),       # negative size
    (9, [4, 4]),        # larger than the global batch
])
def test_bad_sizes_are_config_errors_naming_the_values(b, sizes):
    with pytest.raises(ConfigError, match="batch_size") as err:
        allreduce_weight(b, sizes, average=True)
    assert repr(list(sizes)) in str(err.value)


# ------------------------------------------------------ register_gradient_weight


def linear_grads(weight_value, x, hooked=True):
    """Gradients of a fixed linear model's mean loss with an optional weight hook."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    handle = register_gradient_weight(model.parameters(), GradientWeight(weight_value)) \
        if hooked else None
    model(x).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()], handle, model


def test_hook_scales_every_gradient():
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    plain, _, _ = linear_grads(1.0, x, hooked=False)
    for value in (0.25, 3.0, 0.0):
        scaled, handle, _ = linear_grads(value, x)
        assert len(handle) == 2
        for g, ref in zip(scaled, plain):
            torch.testing.assert_close(g, ref * value)


def test_weight_one_leaves_gradients_bit_identical():
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    plain, _, _ = linear_grads(1.0, x, hooked=False)
    same, _, _ = linear_grads(1.0, x)
    assert all(torch.equal(a, b) for a, b in zip(same, plain))
    assert GradientWeight(1.0)(torch.ones(2)) is None  # "leave it as it is" to autograd


def test_weight_is_read_at_backward_time():
    p = torch.ones(3, requires_grad=True)
    w = GradientWeight(1.0)
    register_gradient_weight([p], w)
    w.value = 0.5  # changed after registration: the hook uses the current value
    (2 * p).sum().backward()
    assert p.grad.tolist() == [1.0, 1.0, 1.0]


def test_remove_restores_plain_gradients():
    p = torch.ones(2, requires_grad=True)
    handle = register_gradient_weight([p], GradientWeight(0.5))
    (p * 4).sum().backward()
    assert p.grad.tolist() == [2.0, 2.0]
    handle.remove()
    assert len(handle) == 0
    handle.remove()  # idempotent
    p.grad = None
    (p * 4).sum().backward()
    assert p.grad.tolist() == [4.0, 4.0]


def test_an_exclusive_weight_refuses_another_until_it_is_removed():
    # Two callbacks' hooks on one parameter would multiply its gradient twice.
    p = torch.ones(2, requires_grad=True)
    first = register_gradient_weight([p], GradientWeight(0.5), exclusive=True)
    with pytest.raises(ConfigError, match="on_train_end"):
        register_gradient_weight([p], GradientWeight(2.0), exclusive=True)
    first.remove()
    second = register_gradient_weight([p], GradientWeight(2.0), exclusive=True)
    (p * 1).sum().backward()
    assert p.grad.tolist() == [2.0, 2.0]
    second.remove()
    register_gradient_weight([p], GradientWeight(3.0), exclusive=True).remove()


def test_the_optimizers_parameters_outside_the_model_are_weighted_once():
    model = torch.nn.Linear(2, 1)
    temperature = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([{"params": [temperature, model.weight]},
                           {"params": [model.bias]}], lr=0.1)
    found = weighted_parameters(model, opt)
    assert [id(p) for p in found] == [id(temperature), id(model.weight), id(model.bias)]
    handle = register_gradient_weight(found, GradientWeight(0.5))
    (model(torch.ones(1, 2)) * temperature).sum().backward()
    assert temperature.grad.tolist() == [0.5 * float(model(torch.ones(1, 2)).detach())]
    assert model.bias.grad.tolist() == [0.5]
    handle.remove()


def test_parameters_without_gradient_keep_grad_none():
    used = torch.nn.Parameter(torch.ones(2))
    unused = torch.nn.Parameter(torch.ones(2))
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    handle = register_gradient_weight([used, unused, frozen], GradientWeight(0.5))
    assert len(handle) == 2  # frozen parameters get no hook
    (used * 3).sum().backward()
    assert used.grad.tolist() == [1.5, 1.5]
    assert unused.grad is None and frozen.grad is None


def test_accumulated_backwards_give_the_weighted_sum():
    # backward_passes_per_step > 1: each micro-step's gradient is weighted with the
    # weight of its own step before it is accumulated into .grad.
    p = torch.tensor([1.0, 2.0], requires_grad=True)
    w = GradientWeight(0.5)
    register_gradient_weight([p], w)
    (p * torch.tensor([3.0, 5.0])).sum().backward()      # g1 = [3, 5]
    w.value = 2.0
    (p ** 2).sum().backward()                            # g2 = 2p = [2, 4]
    torch.testing.assert_close(p.grad, 0.5 * torch.tensor([3.0, 5.0]) + 2.0 * torch.tensor([2.0, 4.0]))


def test_hook_applies_to_a_parameter_used_twice_in_the_graph():
    # Autograd sums both uses before the leaf hook runs: the weight applies once.
    p = torch.ones(2, requires_grad=True)
    register_gradient_weight([p], GradientWeight(0.5))
    (p * 2 + p * 3).sum().backward()
    assert p.grad.tolist() == [2.5, 2.5]


def test_register_accepts_a_generator_and_skips_non_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    assert len(register_gradient_weight(model.parameters(), GradientWeight(1.0))) == 4
    assert len(register_gradient_weight([], GradientWeight(1.0))) == 0


# ---------------------------------------------------------------- _optimizer_op


def hvd_optimizer(**kwargs):
    model = torch.nn.Linear(2, 1)
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), **kwargs)


def test_average_and_sum_optimizers_are_recognised(horovod):
    assert _optimizer_op(hvd_optimizer()) is True
    assert _optimizer_op(hvd_optimizer(op=hvd.Average)) is True
    assert _optimizer_op(hvd_optimizer(op=hvd.Sum)) is False


def test_plain_torch_optimizer_is_rejected_with_the_fix(horovod):
    plain = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="Horovod optimizer") as err:
        _optimizer_op(plain)
    assert "SGD" in str(err.value) and "hvd.DistributedOptimizer" in str(err.value)
    with pytest.raises(ConfigError, match="Horovod optimizer"):
        _optimizer_op(object())


def test_adasum_on_several_ranks_is_rejected_with_the_reason(horovod):
    # With 2+ ranks Horovod returns its Adasum optimizer class, named after the base
    # optimizer and without an op attribute: still the Adasum message, not "wrap it".
    from horovod.torch.optimizer import _DistributedAdasumOptimizer

    cls = type("SGD", (torch.optim.SGD,), dict(_DistributedAdasumOptimizer.__dict__))
    with pytest.raises(ConfigError, match="Adasum") as err:
        _optimizer_op(object.__new__(cls))
    assert "wrap it" not in str(err.value)


def test_adasum_is_rejected_with_the_reason(horovod):
    with pytest.raises(ConfigError, match="Adasum") as err:
        _optimizer_op(hvd_optimizer(op=hvd.Adasum))
    assert "hvd.Average" in str(err.value) and "hvd.Sum" in str(err.value)
