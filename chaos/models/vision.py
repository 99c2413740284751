"""Image classifiers of the Chaos paper: ResNet-101, AlexNet and VGG-11.

The layer shapes follow the standard ImageNet-style architectures (the same shapes as the
well-known torchvision definitions, written here from scratch), so that parameter counts match
the published figures: ResNet-101 has 44,549,160 parameters, AlexNet 61,100,840 and VGG-11
(without batch norm) 132,863,336, all with a 1000-class head. The Chaos benchmarks train on
CIFAR-10 and therefore build them with ``num_classes=10``.

The modules are meant to be instantiated on torch's ``meta`` device to read tensor shapes, but
they are complete: ``forward`` runs on real tensors too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["AlexNet", "Bottleneck", "ResNet", "VGG", "alexnet", "resnet101", "vgg11"]

# VGG configuration "A" (VGG-11): channel counts, "M" = 2x2 max-pool.
_VGG11_CFG: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


def _check_classes(num_classes: int) -> None:
    """Reject a class count that cannot size a classifier head.

    Args:
        num_classes: Number of output classes.

    Raises:
        TypeError: If ``num_classes`` is not an ``int``.
        ValueError: If ``num_classes`` is smaller than 1.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int):
        raise TypeError(f"num_classes must be an int, got {type(num_classes).__name__}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck block (1x1 -> 3x3 (strided) -> 1x1, expansion 4).

    Args:
        in_ch: Channels entering the block.
        width: Channels of the inner 3x3 convolution; the block outputs ``4 * width``.
        stride: Stride of the 3x3 convolution (2 at the first block of a stage).
    """

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block with its residual connection."""
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Bottleneck ResNet with an ImageNet stem (7x7 conv, stride 2, 3x3 max-pool).

    Args:
        layers: Number of bottleneck blocks in each of the four stages.
        num_classes: Size of the classifier head.

    Raises:
        TypeError: If ``num_classes`` is not an ``int``.
        ValueError: If ``layers`` does not have four positive entries or ``num_classes < 1``.
    """

    def __init__(self, layers: Sequence[int], num_classes: int = 1000) -> None:
        super().__init__()
        _check_classes(num_classes)
        if len(layers) != 4 or any(n < 1 for n in layers):
            raise ValueError(f"layers must be four positive block counts, got {list(layers)}")
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_ch = 64
        stages: list[nn.Sequential] = []
        for i, blocks in enumerate(layers):
            width = 64 * 2**i
            stride = 1 if i == 0 else 2
            stage = [Bottleneck(in_ch, width, stride)]
            in_ch = width * Bottleneck.expansion
            stage += [Bottleneck(in_ch, width) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map a ``(N, 3, H, W)`` image batch to ``(N, num_classes)`` logits."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class AlexNet(nn.Module):
    """AlexNet in its single-GPU form (64-192-384-256-256 conv channels).

    Args:
        num_classes: Size of the classifier head.
        dropout: Dropout probability in the classifier.

    Raises:
        TypeError: If ``num_classes`` is not an ``int``.
        ValueError: If ``num_classes < 1``.
    """

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        _check_classes(num_classes)
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 11, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2),
            nn.Conv2d(64, 192, 5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2),
            nn.Conv2d(192, 384, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map a ``(N, 3, H, W)`` image batch to ``(N, num_classes)`` logits."""
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class VGG(nn.Module):
    """VGG without batch norm: 3x3 conv stacks, 7x7 adaptive pool, 4096-4096 classifier.

    Args:
        cfg: Channel counts of the 3x3 convolutions, with ``"M"`` marking a 2x2 max-pool.
        num_classes: Size of the classifier head.
        dropout: Dropout probability in the classifier.

    Raises:
        TypeError: If ``num_classes`` is not an ``int``.
        ValueError: If ``num_classes < 1`` or ``cfg`` holds an entry other than ``"M"`` or a
            positive ``int``.
    """

    def __init__(
        self, cfg: Sequence[int | str], num_classes: int = 1000, dropout: float = 0.5
    ) -> None:
        super().__init__()
        _check_classes(num_classes)
        layers: list[nn.Module] = []
        in_ch = 3
        for entry in cfg:
            if entry == "M":
                layers.append(nn.MaxPool2d(2, stride=2))
            elif isinstance(entry, int) and not isinstance(entry, bool) and entry > 0:
                layers += [nn.Conv2d(in_ch, entry, 3, padding=1), nn.ReLU(inplace=True)]
                in_ch = entry
            else:
                raise ValueError(f"bad VGG cfg entry {entry!r}: expected 'M' or a positive int")
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(in_ch * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map a ``(N, 3, H, W)`` image batch to ``(N, num_classes)`` logits."""
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def resnet101(num_classes: int = 10) -> ResNet:
    """Build ResNet-101 (bottleneck blocks 3-4-23-3).

    Args:
        num_classes: Size of the head; 10 for CIFAR-10 (the Chaos setting), 1000 for ImageNet.

    Returns:
        The model, on the current default device.

    Raises:
        TypeError: If ``num_classes`` is not an ``int``.
        ValueError: If ``num_classes < 1``.
    """
    return ResNet((3, 4, 23, 3), num_classes)


def alexnet(num_classes: int = 10) -> AlexNet:
    """Build AlexNet.

    Args:
        num_classes: Size of the head; 10 for CIFAR-10 (the Chaos setting), 1000 for ImageNet.

    Returns:
        The model, on the current default device.

    Raises:
        TypeError: If ``num_classes`` is not an ``int``.
        ValueError: If ``num_classes < 1``.
    """
    return AlexNet(num_classes)


def vgg11(num_classes: int = 10) -> VGG:
    """Build VGG-11 (configuration "A", no batch norm).

    Args:
        num_classes: Size of the head; 10 for CIFAR-10 (the Chaos setting), 1000 for ImageNet.

    Returns:
        The model, on the current default device.

    Raises:
        TypeError: If ``num_classes`` is not an ``int``.
        ValueError: If ``num_classes < 1``.
    """
    return VGG(_VGG11_CFG, num_classes)
