"""Small models for 28x28 single-channel images (Fashion-MNIST), for benchmarks and examples.

Both are cheap enough to train on a laptop CPU and reach about 88-91% test accuracy
on Fashion-MNIST in a few epochs. Neither uses batch normalisation: its statistics
depend on the per-rank batch, so with unequal batches the result would no longer be
the gradient of the global batch. The ResNet uses group normalisation instead, which
normalises each sample on its own.
"""
import inspect

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["MODELS", "SmallCNN", "SmallResNet", "BasicBlock", "build_model"]


def _check_sizes(**sizes):
    # A zero width or class count builds a model that only fails at its first forward.
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError("%s must be an int >= 1, got %r" % (name, value))


def SmallCNN(num_classes: int = 10, width: int = 16) -> nn.Module:
    """Two 5x5 conv layers with max pooling and one hidden linear layer.

    Args:
        num_classes: output logits.
        width: channels of the first conv layer (the second has twice as many).

    Returns:
        ``torch.nn.Sequential`` mapping ``(N, 1, 28, 28)`` to ``(N, num_classes)``.

    Raises:
        ConfigError: ``num_classes`` or ``width`` is not a positive int.

    >>> SmallCNN()(torch.zeros(2, 1, 28, 28)).shape
    torch.Size([2, 10])
    """
    _check_sizes(num_classes=num_classes, width=width)
    return nn.Sequential(
        nn.Conv2d(1, width, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),          # 14x14
        nn.Conv2d(width, 2 * width, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # 7x7
        nn.Flatten(),
        nn.Linear(2 * width * 7 * 7, 128), nn.ReLU(),
        nn.Linear(128, num_classes),
    )


class BasicBlock(nn.Module):
    """Residual block: two 3x3 convs with group norm, projection shortcut when shapes change."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.relu = nn.ReLU()
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.GroupNorm(groups, cout))

    def forward(self, x):
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def SmallResNet(num_classes: int = 10, width: int = 16, groups: int = 4) -> nn.Module:
    """A ResNet of three stages (one basic block each) at 28, 14 and 7 pixels.

    Args:
        num_classes: output logits.
        width: channels of the first stage (doubled at each later stage).
        groups: group-normalisation groups (must divide ``width``).

    Returns:
        ``torch.nn.Sequential`` mapping ``(N, 1, 28, 28)`` to ``(N, num_classes)``.

    Raises:
        ConfigError: a size is not a positive int, or ``groups`` does not divide ``width``.

    >>> SmallResNet()(torch.zeros(2, 1, 28, 28)).shape
    torch.Size([2, 10])
    """
    _check_sizes(num_classes=num_classes, width=width, groups=groups)
    if width < 1 or groups < 1 or width % groups:
        raise ConfigError("SmallResNet needs groups (%r) to divide width (%r)" % (groups, width))
    return nn.Sequential(
        nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.GroupNorm(groups, width), nn.ReLU(),
        BasicBlock(width, width, 1, groups),
        BasicBlock(width, 2 * width, 2, groups),
        BasicBlock(2 * width, 4 * width, 2, groups),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(4 * width, num_classes),
    )


MODELS = {"cnn": SmallCNN, "resnet": SmallResNet}


def build_model(name: str, seed=None, **kwargs):
    """Build a model by name, optionally with a seeded initialisation.

    Args:
        name: ``"cnn"`` or ``"resnet"``.
        seed: when given, parameters are initialised from ``torch.manual_seed(seed)``,
            so every run and every rank starts from the same weights.
        **kwargs: passed to the model function (``num_classes``, ``width``...).

    Returns:
        the ``torch.nn.Module``.

    Raises:
        ConfigError: unknown name, an option the model does not take, or a bad value.

    >>> m1, m2 = build_model("cnn", seed=0), build_model("cnn", seed=0)
    >>> all((a == b).all() for a, b in zip(m1.parameters(), m2.parameters()))
    True
    """
    if name not in MODELS:
        raise ConfigError("unknown model %r; choose one of: %s" % (name, ", ".join(MODELS)))
    accepted = inspect.signature(MODELS[name]).parameters
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigError("model %r has no option %s; it takes: %s"
                          % (name, ", ".join(map(repr, unknown)), ", ".join(accepted)))
    if seed is None:
        return MODELS[name](**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name](**kwargs)
