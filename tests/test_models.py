"""omnihvd.tools.models: shapes, seeded construction, a learning step, and errors."""
import pytest
import torch

from omnihvd.errors import ConfigError
from omnihvd.tools.models import MODELS, SmallResNet, build_model

pytestmark = pytest.mark.single


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shapes_and_one_step_learns(name):
    model = build_model(name, seed=1)
    x, y = torch.randn(6, 1, 28, 28), torch.arange(6) % 10
    assert model(x).shape == (6, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(5):          # the same batch: the loss must go down
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_seeded_builds_are_identical_and_leave_global_rng_alone(name):
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = build_model(name, seed=7), build_model(name, seed=7)
    assert torch.rand(1) == before          # building did not consume the global stream
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    c = build_model(name, seed=8)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_per_sample_independence():
    """No batch normalisation: a sample's output does not depend on its batch-mates,
    so unequal per-rank batches give the same gradients as one big batch."""
    for name in MODELS:
        model = build_model(name, seed=0)
        x = torch.randn(5, 1, 28, 28)
        assert torch.allclose(model(x)[:2], model(x[:2]), atol=1e-5)


def test_errors():
    with pytest.raises(ConfigError, match="unknown model 'vgg'"):
        build_model("vgg")
    with pytest.raises(ConfigError, match="groups"):
        SmallResNet(width=10, groups=4)
