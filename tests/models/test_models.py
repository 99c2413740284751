"""Tests for chaos.models: architecture shapes and training-state size lists."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from chaos.models import (
    ADAM_STEP_BYTES,
    MODEL_NAMES,
    model_summary,
    state_tensor_sizes,
)
from chaos.models.gpt2 import GPT2, GPT2Config, LoRALinear, apply_lora, gpt2
from chaos.models.vision import alexnet, resnet101, vgg11

MiB = 2**20


def _meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build()


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: resnet101(num_classes=1000), 44_549_160),
        (lambda: alexnet(num_classes=1000), 61_100_840),
        (lambda: vgg11(num_classes=1000), 132_863_336),
    ],
    ids=["resnet101", "alexnet", "vgg11"],
)
def test_vision_imagenet_param_counts(build: Callable[[], nn.Module], expected: int) -> None:
    assert _n_params(_meta(build)) == expected


@pytest.mark.parametrize(
    ("name", "imagenet", "last_in"),
    [("resnet101", 44_549_160, 2048), ("alexnet", 61_100_840, 4096), ("vgg11", 132_863_336, 4096)],
)
def test_vision_api_uses_ten_class_head(name: str, imagenet: int, last_in: int) -> None:
    # Only the head differs from the 1000-class model: 990 fewer rows of (weight + bias).
    assert model_summary(name)["params"] == imagenet - 990 * (last_in + 1)


@pytest.mark.parametrize(
    ("size", "expected"),
    [("small", 124_439_808), ("medium", 354_823_168), ("large", 774_030_080)],
)
def test_gpt2_param_counts_tied_head(size: str, expected: int) -> None:
    model = _meta(lambda: gpt2(size))
    assert isinstance(model, GPT2)
    assert model.lm_head.weight is model.wte.weight
    assert _n_params(model) == expected
    assert model_summary(f"gpt2-{size}")["params"] == expected


def test_resnet_buffers_in_state() -> None:
    model = _meta(lambda: resnet101(10))
    sizes = state_tensor_sizes("resnet101")
    params = [p.numel() * 4 for p in model.parameters()]
    buffers = [b.numel() * b.element_size() for b in model.buffers()]
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert len(buffers) == 3 * n_bn
    assert buffers.count(8) == n_bn  # num_batches_tracked is int64
    assert sizes == params + buffers + params  # momentum buffer per parameter, in order


def test_sgd_models_without_buffers() -> None:
    for name in ("alexnet", "vgg11"):
        sizes = state_tensor_sizes(name)
        half = len(sizes) // 2
        assert len(sizes) % 2 == 0
        assert sizes[:half] == sizes[half:]
        summary = model_summary(name)
        assert summary["optimizer"] == "sgd-momentum"
        assert summary["state_bytes"] == 2 * summary["param_bytes"]


def test_adam_state_order() -> None:
    model = _meta(lambda: gpt2("small"))
    params = [p.numel() * 4 for p in model.parameters()]
    expected = list(params)
    for size in params:
        expected += [size, size, ADAM_STEP_BYTES]
    sizes = state_tensor_sizes("gpt2-small")
    assert sizes == expected
    assert sizes[0] == 50257 * 768 * 4  # wte first, in module order
    assert len(sizes) == 4 * len(params)


def test_gpt2_lora_state() -> None:
    summary = model_summary("gpt2-lora")
    per_block = 8 * 768 + 2304 * 8
    assert summary["params"] == 12 * per_block
    assert summary["param_bytes"] == 12 * per_block * 4
    assert summary["tensors"] == 12 * 2 * 4
    assert summary["state_bytes"] == 3 * 12 * per_block * 4 + 24 * ADAM_STEP_BYTES
    sizes = state_tensor_sizes("gpt2-lora")
    assert sizes[:2] == [8 * 768 * 4, 2304 * 8 * 4]  # lora_A then lora_B of block 0


def test_apply_lora_freezes_base_and_starts_at_identity() -> None:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_ctx=16)
    model = GPT2(cfg).eval()
    idx = torch.randint(0, 50, (2, 10))
    with torch.no_grad():
        before = model(idx)
        apply_lora(model, rank=4)
        after = model(idx)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [f"h.{i}.attn.c_attn.lora_{ab}" for i in range(2) for ab in "AB"]
    assert all(isinstance(model.get_submodule(f"h.{i}.attn.c_attn"), LoRALinear) for i in (0, 1))
    assert torch.allclose(before, after)
    assert after.shape == (2, 10, 50)
    with pytest.raises(TypeError):
        apply_lora(model)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_sizes_sum_to_state_bytes(name: str) -> None:
    sizes = state_tensor_sizes(name)
    summary = model_summary(name)
    assert set(summary) == {"name", "params", "param_bytes", "state_bytes", "tensors", "optimizer"}
    assert summary["name"] == name
    assert sum(sizes) == summary["state_bytes"]
    assert len(sizes) == summary["tensors"]
    assert all(isinstance(s, int) and s > 0 for s in sizes)
    assert summary["state_bytes"] > summary["param_bytes"] > 0


def test_result_is_cached_but_a_copy() -> None:
    first = state_tensor_sizes("alexnet")
    first.append(123)
    assert state_tensor_sizes("alexnet") == first[:-1]


@pytest.mark.parametrize("mib", [64, 1, 0.5, 4.00390625, 200, 3])
def test_synthetic_sums_exactly(mib: float) -> None:
    sizes = state_tensor_sizes(f"synthetic:{mib}")
    assert sum(sizes) == int(mib * MiB)
    assert all(s > 0 and s % 4 == 0 for s in sizes)
    assert max(sizes) <= 4 * MiB
    summary = model_summary(f"synthetic:{mib}")
    assert summary["state_bytes"] == int(mib * MiB)
    assert summary["optimizer"] == "none"


def test_synthetic_mix_is_deterministic() -> None:
    sizes = state_tensor_sizes("synthetic:64")
    assert sizes[:4] == [4 * MiB, 4096, 4 * MiB, 4096]
    assert len(sizes) == 31
    assert sizes[-1] == 64 * MiB - 15 * (4 * MiB + 4096)
    assert state_tensor_sizes("synthetic:8") == [4 * MiB, 4096, 4 * MiB - 4096]


def test_synthetic_fraction_rounds_to_fp32_elements() -> None:
    assert state_tensor_sizes("synthetic:0.000003") == [4]  # 3.15 bytes -> one element
    assert state_tensor_sizes("synthetic:0.1") == [104_856]  # 104857.6 bytes -> 26214 elements
    with pytest.raises(ValueError, match="less than one fp32 element"):
        state_tensor_sizes("synthetic:0.000001")  # 1.05 bytes -> zero elements


@pytest.mark.parametrize(
    "name",
    [
        "resnet",
        "GPT2-small",
        "",
        "synthetic:",
        "synthetic:abc",
        "synthetic:0",
        "synthetic:-1",
        "synthetic:nan",
        "synthetic:inf",
        "synthetic:1e-9",
        "synthetic:1e9",
    ],
)
def test_bad_names_raise(name: str) -> None:
    with pytest.raises(ValueError):
        state_tensor_sizes(name)
    with pytest.raises(ValueError):
        model_summary(name)


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(ValueError) as info:
        state_tensor_sizes("bert")
    for valid in MODEL_NAMES:
        assert valid in str(info.value)
    assert "synthetic:N" in str(info.value)


def test_non_string_name_raises_type_error() -> None:
    with pytest.raises(TypeError):
        state_tensor_sizes(101)  # type: ignore[arg-type]


def test_bad_builder_args_raise() -> None:
    with pytest.raises(ValueError):
        resnet101(0)
    with pytest.raises(TypeError):
        vgg11(10.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        gpt2("xl")
    with pytest.raises(ValueError):
        GPT2Config(n_layer=2, n_embd=30, n_head=4)


@pytest.mark.parametrize(
    ("build", "hw"),
    [(lambda: resnet101(10), 32), (lambda: alexnet(10), 64), (lambda: vgg11(10), 32)],
    ids=["resnet101", "alexnet", "vgg11"],
)
def test_vision_forward_shapes(build: Callable[[], nn.Module], hw: int) -> None:
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, hw, hw))
    assert out.shape == (2, 10)


def _real_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> list[int]:
    """Run one real step and list the optimizer's state tensors in the canonical order."""
    loss = sum((p.float() ** 2).sum() for p in model.parameters() if p.requires_grad)
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    opt.step()
    sizes: list[int] = []
    for p in (p for p in model.parameters() if p.requires_grad):
        st = opt.state[p]
        keys = ("exp_avg", "exp_avg_sq", "step") if "exp_avg" in st else ("momentum_buffer",)
        assert set(st) == set(keys)
        sizes += [st[k].numel() * st[k].element_size() for k in keys]
    return sizes


def test_counting_matches_real_torch_optimizers() -> None:
    # The counted optimizer state (after params and buffers) equals what torch really allocates,
    # including AdamW's 4-byte float32 ``step``.
    from chaos.models import _model_state, _Spec

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=40, n_ctx=8)
    builders: list[Callable[[], nn.Module]] = [
        lambda: GPT2(cfg),
        lambda: apply_lora(GPT2(cfg), rank=2),
    ]
    for build in builders:
        model = build()
        trained = [p for p in model.parameters() if p.requires_grad]
        real = _real_optimizer_state(model, torch.optim.AdamW(trained))
        counted = _model_state(_Spec(build, "adamw")).sizes
        assert list(counted[len(trained) :]) == real  # GPT-2 has no buffers
    small = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    real = _real_optimizer_state(small, torch.optim.SGD(small.parameters(), lr=0.1, momentum=0.9))
    counted = _model_state(_Spec(lambda: small, "sgd-momentum")).sizes
    assert list(counted[6 + 3 :]) == real  # 6 parameters, 3 batch-norm buffers, then momentum
    assert counted[6:9] == (16, 16, 8)
