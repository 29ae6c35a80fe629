"""Layer tables of CNNs for the training performance model.

A :class:`Network` is the ordered list (forward order) of its fully
connected (``fc``), convolution (``conv``) and pooling (``pool``) layers with
the shapes the GEMM model needs. Normalisation, activation and element-wise
layers are left out, as in Castello et al. (CCGRID 2019, HPML workshop).

Built-in tables, with the paper's counts of FC / CONV / POOL layers:

- ``alexnet``      3 / 5 / 3     single-tower AlexNet, 227x227 input
- ``vgg16``        3 / 13 / 5    224x224 input
- ``resnet50``     1 / 53 / 1    ResNet-50 v2 (pre-activation, TF-slim layout:
  the stride sits in the last unit of blocks 1-3), 224x224 input; the
  stride-2 1x1 subsampling of identity shortcuts and the global average
  before the logits carry no weights and are not counted, as in the paper
- ``inception3``   1 / 94 / 14   Inception v3 without the auxiliary head,
  299x299 input

:func:`from_torch` derives a table from a live ``torch.nn.Module`` by
running an example input through it and recording its Linear, Conv2d and
pooling layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

__all__ = [
    "Layer",
    "Network",
    "NETWORKS",
    "get_network",
    "alexnet",
    "vgg16",
    "resnet50",
    "inception3",
    "fc_network",
    "from_torch",
]

KINDS = ("fc", "conv", "pool")


@dataclass(frozen=True)
class Layer:
    """One layer of a network, per sample (the batch is not part of it).

    A fully connected layer is a 1x1 "convolution" over ``positions`` input
    vectors (1 for an image classifier's head, the sequence length for a
    token-wise Linear layer).

    Attributes:
        kind: ``"fc"``, ``"conv"`` or ``"pool"``.
        name: label for tables.
        in_channels: input features (fc) or channels (conv, pool).
        out_channels: output features or channels.
        kernel: (height, width) of the filter or pooling window.
        in_size: (height, width) of the input feature map; (positions, 1) for fc.
        out_size: (height, width) of the output feature map.
        groups: grouped convolution (1 = ordinary).
        bias: whether the layer has a bias vector.
    """

    kind: str
    name: str
    in_channels: int
    out_channels: int
    kernel: tuple[int, int] = (1, 1)
    in_size: tuple[int, int] = (1, 1)
    out_size: tuple[int, int] = (1, 1)
    groups: int = 1
    bias: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layer kind must be one of {KINDS}, got {self.kind!r}")
        if self.in_channels % self.groups or self.out_channels % self.groups:
            raise ValueError(f"layer {self.name}: channels not divisible by groups={self.groups}")

    @property
    def params(self) -> int:
        """Number of trainable parameters (weights and bias); 0 for pooling."""
        if self.kind == "pool":
            return 0
        kh, kw = self.kernel
        weights = self.out_channels * (self.in_channels // self.groups) * kh * kw
        return weights + (self.out_channels if self.bias else 0)

    @property
    def in_elements(self) -> int:
        """Input activations per sample."""
        return self.in_channels * self.in_size[0] * self.in_size[1]

    @property
    def out_elements(self) -> int:
        """Output activations per sample."""
        return self.out_channels * self.out_size[0] * self.out_size[1]


@dataclass(frozen=True)
class Network:
    """An ordered (forward order) tuple of layers.

    Attributes:
        name: network name.
        layers: the layers, input side first.
        input_shape: (channels, height, width) of one sample.
    """

    name: str
    layers: tuple[Layer, ...]
    input_shape: tuple[int, ...] = ()

    def counts(self) -> dict[str, int]:
        """Number of layers of each kind: ``{"fc": .., "conv": .., "pool": ..}``."""
        return {kind: sum(1 for layer in self.layers if layer.kind == kind) for kind in KINDS}

    @property
    def params(self) -> int:
        """Total trainable parameters of the modelled layers."""
        return sum(layer.params for layer in self.layers)


# --------------------------------------------------------------------------- builders


def _out_len(size: int, kernel: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - kernel) // stride + 1


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


@dataclass
class _Builder:
    """Tracks the current (C, H, W) while appending layers to a shared list."""

    shape: tuple[int, int, int]
    layers: list[Layer] = field(default_factory=list)
    prefix: str = ""
    bias: bool = True

    def _name(self, kind: str) -> str:
        return f"{self.prefix}{kind}{sum(1 for layer in self.layers if layer.kind == kind) + 1}"

    def conv(self, out: int, kernel: Any, stride: Any = 1, pad: Any = 0, name: str = "") -> "_Builder":
        c, h, w = self.shape
        (kh, kw), (sh, sw), (ph, pw) = _pair(kernel), _pair(stride), _pair(pad)
        ho, wo = _out_len(h, kh, sh, ph), _out_len(w, kw, sw, pw)
        self.layers.append(Layer("conv", name or self._name("conv"), c, out, (kh, kw), (h, w), (ho, wo), bias=self.bias))
        self.shape = (out, ho, wo)
        return self

    def pool(self, kernel: Any, stride: Any = None, pad: Any = 0, name: str = "") -> "_Builder":
        c, h, w = self.shape
        kh, kw = _pair(kernel)
        sh, sw = _pair(kernel if stride is None else stride)
        ph, pw = _pair(pad)
        ho, wo = _out_len(h, kh, sh, ph), _out_len(w, kw, sw, pw)
        self.layers.append(Layer("pool", name or self._name("pool"), c, c, (kh, kw), (h, w), (ho, wo), bias=False))
        self.shape = (c, ho, wo)
        return self

    def fc(self, out: int, name: str = "") -> "_Builder":
        c, h, w = self.shape
        self.layers.append(Layer("fc", name or self._name("fc"), c * h * w, out))
        self.shape = (out, 1, 1)
        return self

    def flatten_to(self, shape: tuple[int, int, int]) -> "_Builder":
        """Set the shape without a layer (global average, identity subsampling)."""
        self.shape = shape
        return self

    def branch(self) -> "_Builder":
        """A builder sharing the layer list, starting from the current shape."""
        return _Builder(self.shape, self.layers, self.prefix, self.bias)

    def concat(self, branches: Iterable["_Builder"]) -> "_Builder":
        """Concatenate the channels of branches that end at the same size."""
        shapes = [b.shape for b in branches]
        sizes = {s[1:] for s in shapes}
        if len(sizes) != 1:
            raise ValueError(f"branches end at different sizes: {shapes}")
        self.shape = (sum(s[0] for s in shapes), *sizes.pop())
        return self


def alexnet() -> Network:
    """AlexNet (single tower, no grouping), 227x227x3 input: 3 FC, 5 CONV, 3 POOL."""
    b = _Builder((3, 227, 227))
    b.conv(96, 11, 4).pool(3, 2).conv(256, 5, pad=2).pool(3, 2)
    b.conv(384, 3, pad=1).conv(384, 3, pad=1).conv(256, 3, pad=1).pool(3, 2)
    b.fc(4096).fc(4096).fc(1000)
    return Network("alexnet", tuple(b.layers), (3, 227, 227))


def vgg16() -> Network:
    """VGG16 (configuration D), 224x224x3 input: 3 FC, 13 CONV, 5 POOL."""
    b = _Builder((3, 224, 224))
    for width, repeat in ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3)):
        for _ in range(repeat):
            b.conv(width, 3, pad=1)
        b.pool(2, 2)
    b.fc(4096).fc(4096).fc(1000)
    return Network("vgg16", tuple(b.layers), (3, 224, 224))


def _bottleneck_v2(b: _Builder, depth: int, stride: int, name: str) -> None:
    """Pre-activation bottleneck unit (TF-slim ``resnet_v2.bottleneck``)."""
    if b.shape[0] != depth:
        b.branch().conv(depth, 1, stride, name=f"{name}_shortcut")
    b.conv(depth // 4, 1, name=f"{name}_conv1")
    b.conv(depth // 4, 3, stride, 1, name=f"{name}_conv2")  # slim conv2d_same
    b.conv(depth, 1, name=f"{name}_conv3")


def resnet50() -> Network:
    """ResNet-50 v2, 224x224x3 input: 1 FC, 53 CONV, 1 POOL."""
    b = _Builder((3, 224, 224), bias=False)
    b.conv(64, 7, 2, 3, name="conv1").pool(3, 2, 1, name="pool1")
    for block, (units, depth, stride) in enumerate(((3, 256, 2), (4, 512, 2), (6, 1024, 2), (3, 2048, 1)), 1):
        for unit in range(1, units + 1):
            _bottleneck_v2(b, depth, stride if unit == units else 1, f"block{block}_unit{unit}")
    b.flatten_to((b.shape[0], 1, 1))
    b.bias = True
    b.fc(1000, name="logits")
    return Network("resnet50", tuple(b.layers), (3, 224, 224))


def _inception_a(b: _Builder, pool_features: int, name: str) -> None:
    b.prefix = f"{name}_"
    b1 = b.branch().conv(64, 1)
    b5 = b.branch().conv(48, 1).conv(64, 5, pad=2)
    b3 = b.branch().conv(64, 1).conv(96, 3, pad=1).conv(96, 3, pad=1)
    bp = b.branch().pool(3, 1, 1).conv(pool_features, 1)
    b.concat([b1, b5, b3, bp])


def _inception_b(b: _Builder, name: str) -> None:
    b.prefix = f"{name}_"
    b3 = b.branch().conv(384, 3, 2)
    bd = b.branch().conv(64, 1).conv(96, 3, pad=1).conv(96, 3, 2)
    bp = b.branch().pool(3, 2)
    b.concat([b3, bd, bp])


def _inception_c(b: _Builder, c7: int, name: str) -> None:
    b.prefix = f"{name}_"
    b1 = b.branch().conv(192, 1)
    b7 = b.branch().conv(c7, 1).conv(c7, (1, 7), pad=(0, 3)).conv(192, (7, 1), pad=(3, 0))
    bd = b.branch().conv(c7, 1).conv(c7, (7, 1), pad=(3, 0)).conv(c7, (1, 7), pad=(0, 3))
    bd.conv(c7, (7, 1), pad=(3, 0)).conv(192, (1, 7), pad=(0, 3))
    bp = b.branch().pool(3, 1, 1).conv(192, 1)
    b.concat([b1, b7, bd, bp])


def _inception_d(b: _Builder, name: str) -> None:
    b.prefix = f"{name}_"
    b3 = b.branch().conv(192, 1).conv(320, 3, 2)
    b7 = b.branch().conv(192, 1).conv(192, (1, 7), pad=(0, 3)).conv(192, (7, 1), pad=(3, 0)).conv(192, 3, 2)
    bp = b.branch().pool(3, 2)
    b.concat([b3, b7, bp])


def _inception_e(b: _Builder, name: str) -> None:
    b.prefix = f"{name}_"
    b1 = b.branch().conv(320, 1)
    b3 = b.branch().conv(384, 1)
    b3a, b3b = b3.branch().conv(384, (1, 3), pad=(0, 1)), b3.branch().conv(384, (3, 1), pad=(1, 0))
    bd = b.branch().conv(448, 1).conv(384, 3, pad=1)
    bda, bdb = bd.branch().conv(384, (1, 3), pad=(0, 1)), bd.branch().conv(384, (3, 1), pad=(1, 0))
    bp = b.branch().pool(3, 1, 1).conv(192, 1)
    b.concat([b1, b3a, b3b, bda, bdb, bp])


def inception3() -> Network:
    """Inception v3 (no auxiliary head), 299x299x3 input: 1 FC, 94 CONV, 14 POOL."""
    b = _Builder((3, 299, 299), bias=False)
    b.prefix = "stem_"
    b.conv(32, 3, 2).conv(32, 3).conv(64, 3, pad=1).pool(3, 2).conv(80, 1).conv(192, 3).pool(3, 2)
    for name, pool_features in (("mixed5b", 32), ("mixed5c", 64), ("mixed5d", 64)):
        _inception_a(b, pool_features, name)
    _inception_b(b, "mixed6a")
    for name, c7 in (("mixed6b", 128), ("mixed6c", 160), ("mixed6d", 160), ("mixed6e", 192)):
        _inception_c(b, c7, name)
    _inception_d(b, "mixed7a")
    _inception_e(b, "mixed7b")
    _inception_e(b, "mixed7c")
    b.prefix = ""
    b.pool(b.shape[1], 1, name="avgpool")
    b.bias = True
    b.fc(1000, name="logits")
    return Network("inception3", tuple(b.layers), (3, 299, 299))


def fc_network(widths: Iterable[int], name: str = "mlp", bias: bool = True) -> Network:
    """A chain of fully connected layers.

    Args:
        widths: ``[n_0, n_1, ..., n_L]``; layer l maps n_{l-1} to n_l features.
        name: network name.
        bias: whether the layers have biases.

    Returns:
        The network of ``len(widths) - 1`` fc layers.
    """
    widths = [int(w) for w in widths]
    if len(widths) < 2:
        raise ValueError("fc_network needs at least an input and an output width")
    layers = tuple(Layer("fc", f"fc{i}", n_in, n_out, bias=bias) for i, (n_in, n_out) in enumerate(zip(widths, widths[1:]), 1))
    return Network(name, layers, (widths[0],))


NETWORKS: dict[str, Callable[[], Network]] = {
    "alexnet": alexnet,
    "vgg16": vgg16,
    "resnet50": resnet50,
    "inception3": inception3,
}


def get_network(name: str) -> Network:
    """Built-in network by name (``alexnet``, ``vgg16``, ``resnet50``, ``inception3``).

    Raises:
        ValueError: unknown name.
    """
    key = name.lower().replace("-", "").replace("_", "")
    aliases = {"resnet50v2": "resnet50", "inceptionv3": "inception3", "vgg": "vgg16"}
    key = aliases.get(key, key)
    if key not in NETWORKS:
        raise ValueError(f"unknown network {name!r}; built-in: {', '.join(NETWORKS)}")
    return NETWORKS[key]()


# --------------------------------------------------------------------------- torch


def _spatial(shape: Any) -> tuple[int, int]:
    dims = tuple(int(d) for d in shape[2:])
    return (dims + (1, 1))[:2] if len(dims) <= 2 else (dims[0], _prod(dims[1:]))


def _prod(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def _torch_layer(module: Any, name: str, inp: Any, out: Any) -> Layer | None:
    import torch.nn as nn

    if isinstance(module, nn.Linear):
        positions = _prod(inp.shape[1:-1])
        return Layer("fc", name, module.in_features, module.out_features, (1, 1), (positions, 1), (positions, 1),
                     bias=module.bias is not None)
    if isinstance(module, nn.Conv2d):
        return Layer("conv", name, module.in_channels, module.out_channels, tuple(module.kernel_size),
                     _spatial(inp.shape), _spatial(out.shape), module.groups, module.bias is not None)
    pools = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
    if isinstance(module, pools):
        hi, wi = _spatial(inp.shape)
        ho, wo = _spatial(out.shape)
        kernel = getattr(module, "kernel_size", None)
        kernel = _pair(kernel) if kernel is not None else (max(hi // ho, 1), max(wi // wo, 1))
        return Layer("pool", name, int(inp.shape[1]), int(out.shape[1]), kernel, (hi, wi), (ho, wo), bias=False)
    return None


def from_torch(module: Any, example_input: Any, name: str | None = None) -> Network:
    """Derive the layer table of a ``torch.nn.Module``.

    Runs ``example_input`` (batch first; any batch size) through the module
    under ``torch.no_grad()`` and records, in execution order, every Linear,
    Conv2d and 2-D pooling layer with its input and output sizes. Each call
    of a module counts as a layer (a module used twice appears twice).

    Args:
        module: the model.
        example_input: a tensor, or a tuple of tensors passed as arguments.
        name: network name (default: the module's class name).

    Returns:
        The network.

    Raises:
        ImportError: torch is not installed.
    """
    import torch

    layers: list[Layer] = []
    names = {mod: qual or type(mod).__name__ for qual, mod in module.named_modules()}

    def hook(mod: Any, args: tuple, out: Any) -> None:
        if args and hasattr(args[0], "shape") and hasattr(out, "shape"):
            layer = _torch_layer(mod, names.get(mod, type(mod).__name__), args[0], out)
            if layer is not None:
                layers.append(layer)

    handles = [m.register_forward_hook(hook) for m in module.modules()]
    try:
        args = example_input if isinstance(example_input, tuple) else (example_input,)
        with torch.no_grad():
            module(*args)
    finally:
        for handle in handles:
            handle.remove()
    first = args[0] if args and hasattr(args[0], "shape") else None
    shape = tuple(int(d) for d in first.shape[1:]) if first is not None else ()
    return Network(name or type(module).__name__, tuple(layers), shape)
