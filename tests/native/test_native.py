"""Native ops (chaos._native) against the pure-torch fallback in chaos.ops, and their contracts.

The native side runs with ``use_native(True, all_ops=True)``, so every native op is checked
whether or not :data:`chaos.ops.NATIVE_OPS` keeps it. The first test that needs the extension
JIT-builds it (about 30 s on a cold cache).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from chaos._native import _BuildLock, _missing_toolchain
from hypothesis import given
from hypothesis import strategies as st

from chaos import ops
from chaos.errors import ChaosTimeout

NATIVE_DIR = Path(__file__).resolve().parents[2] / "native"
P = (1 << 32) - 5
ROW_BYTES = 8 * (1 << 15)  # one checksum row; sizes around it cross the parallel split


@pytest.fixture(scope="module")
def native() -> Iterator[Any]:
    """The built extension; skips only where the toolchain is really missing."""
    reason = _missing_toolchain()
    if reason is not None:
        pytest.skip(f"native ops cannot be built here: {reason}")
    assert ops.native_available(), "toolchain present but the native build failed"
    yield ops._load_native()


def both(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """Run ``fn`` natively (every op) and with the fallback; return (native, fallback)."""
    with ops.use_native(True, all_ops=True):
        nat = fn()
    with ops.use_native(False):
        ref = fn()
    return nat, ref


def checksum_reference(data: bytes) -> int:
    """The checksum's definition (chaos/ops.py docstring), one block at a time."""
    a, b = len(data), 0
    padded = data + b"\0" * (-len(data) % 8)
    for j in range(len(padded) // 8):
        v = int.from_bytes(padded[8 * j : 8 * j + 8], "little")
        w = j % (1 << 31) + 1
        a += w * (v & 0xFFFFFFFF)
        b += w * (v >> 32)
    return 0 if not data else (a % P) << 32 | (b % P)


def bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(
            x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)
        )
    )


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g, dtype=torch.int64
    ).to(dtype)


DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]
shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
sizes = st.one_of(st.integers(0, 70), st.integers(0, 5000), st.sampled_from([ROW_BYTES - 1, 70001]))


# ---------------------------------------------------------------------------------------------
# checksum


@given(st.binary(min_size=0, max_size=3000))
def test_checksum_matches_definition(native: Any, data: bytes) -> None:
    nat, ref = both(lambda: ops.checksum(data))
    assert nat == ref == checksum_reference(data)
    assert 0 <= nat < 2**64


@pytest.mark.parametrize(
    "n", [0, 1, 7, ROW_BYTES - 3, ROW_BYTES, ROW_BYTES + 8, 3 * ROW_BYTES + 13, 70 * ROW_BYTES + 5]
)
def test_checksum_across_rows(native: Any, n: int) -> None:
    data = random.Random(n).randbytes(n)
    nat, ref = both(lambda: ops.checksum(data))
    assert nat == ref
    if n <= 3 * ROW_BYTES + 13:
        assert nat == checksum_reference(data)


@given(st.sampled_from(DTYPES), shapes, st.integers(0, 2**16))
def test_checksum_of_tensor_is_checksum_of_its_bytes(
    native: Any, dtype: torch.dtype, shape: tuple[int, ...], seed: int
) -> None:
    t = random_tensor(shape, dtype, seed)
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    nat, ref = both(lambda: ops.checksum(t))
    assert nat == ref == ops.checksum(raw) == checksum_reference(raw)


def test_checksum_accepts_bytes_like_and_views(native: Any) -> None:
    data = random.Random(1).randbytes(1001)
    expected = checksum_reference(data)
    forms: list[bytes | bytearray | memoryview] = [data, bytearray(data), memoryview(data)]
    for form in forms:
        assert both(partial(ops.checksum, form)) == (expected, expected)
    # a non-contiguous memoryview and an unaligned byte slice
    strided = memoryview(data)[::3]
    assert ops.checksum(strided) == checksum_reference(data[::3])
    u8 = torch.frombuffer(bytearray(data), dtype=torch.uint8)[3:]
    assert both(lambda: ops.checksum(u8)) == (checksum_reference(data[3:]),) * 2
    # a non-contiguous tensor is checksummed in row-major order
    m = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    assert both(lambda: ops.checksum(m.t())) == (ops.checksum(m.t().contiguous()),) * 2
    assert ops.checksum(b"") == ops.checksum(torch.empty(0)) == 0


def test_checksum_detects_every_single_bit_flip(native: Any) -> None:
    data = bytearray(random.Random(2).randbytes(61))
    base = checksum_reference(bytes(data))
    for i in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[i // 8] ^= 1 << (i % 8)
        nat, ref = both(partial(ops.checksum, flipped))
        assert nat == ref != base, f"bit {i}"


@given(st.binary(min_size=16, max_size=4096), st.data())
def test_checksum_detects_flips_and_block_swaps(
    native: Any, data: bytes, draw: st.DataObject
) -> None:
    base = ops.checksum(data)
    bit = draw.draw(st.integers(0, len(data) * 8 - 1))
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert both(lambda: ops.checksum(flipped)) != (base, base)
    blocks = len(data) // 8
    a = draw.draw(st.integers(0, blocks - 1))
    b = draw.draw(st.integers(0, blocks - 1).filter(lambda x: x != a))
    swapped = bytearray(data)
    swapped[8 * a : 8 * a + 8] = data[8 * b : 8 * b + 8]
    swapped[8 * b : 8 * b + 8] = data[8 * a : 8 * a + 8]
    if bytes(swapped) != data:
        nat, ref = both(lambda: ops.checksum(swapped))
        assert nat == ref != base
    # swapped words whose halves have equal sums (a plain Fletcher sum misses these)
    word1, word2 = (
        (1).to_bytes(4, "little") + (2).to_bytes(4, "little"),
        (2).to_bytes(4, "little") + (1).to_bytes(4, "little"),
    )
    assert ops.checksum(word1 + word2) != ops.checksum(word2 + word1)


def test_checksum_rejects_other_types() -> None:
    for bad in ("text", 12, None, [1, 2]):
        with pytest.raises(TypeError):
            ops.checksum(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# reduce_into

SCALES = [1.0, 0.25, 1 / 3, -2.5, 0.0]


@given(
    sizes,
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    st.sampled_from([torch.float32, torch.float64]),
    st.sampled_from(SCALES),
    st.integers(0, 2**16),
)
def test_reduce_into_native_equals_fallback(
    native: Any, n: int, src_dtype: torch.dtype, acc_dtype: torch.dtype, scale: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    acc0 = torch.randn(n, generator=g, dtype=torch.float64).to(acc_dtype)
    src = torch.randn(n, generator=g).to(src_dtype)
    results = []
    for enabled in (True, False):
        acc = acc0.clone()
        with ops.use_native(enabled, all_ops=enabled):
            ops.reduce_into(acc, src, scale)
        results.append(acc)
    # the definition, with torch's own conversion of the wire format
    expected = acc0 + src.to(acc_dtype) * scale
    assert bits_equal(results[0], results[1])
    assert bits_equal(results[0], expected)


def test_reduce_into_large_and_special_values(native: Any) -> None:
    n = 300_007  # several parallel tasks and a ragged tail
    src = torch.randn(n)
    src[:6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 3e38])
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        acc0 = torch.randn(n, dtype=acc_dtype)

        def run(acc0: torch.Tensor = acc0, dtype: torch.dtype = dtype) -> torch.Tensor:
            acc = acc0.clone()
            ops.reduce_into(acc, src.to(dtype), 0.5)
            return acc

        nat, ref = both(run)
        assert bits_equal(nat, ref), dtype


def test_reduce_into_shapes_and_noncontiguous_src(native: Any) -> None:
    acc0 = torch.randn(4, 6)
    src = torch.randn(6, 4).t()  # non-contiguous, same numel and shape

    def run() -> torch.Tensor:
        acc = acc0.clone()
        ops.reduce_into(acc, src, 2.0)
        return acc

    nat, ref = both(run)
    assert bits_equal(nat, ref)
    assert torch.equal(nat, acc0 + src * 2.0)
    flat = torch.randn(24)
    acc = acc0.clone()
    ops.reduce_into(acc, flat)  # same numel, different shape: elementwise in row-major order
    assert torch.equal(acc, acc0 + flat.view(4, 6))


def test_reduce_into_bad_input() -> None:
    acc = torch.zeros(8)
    with pytest.raises(ValueError, match="size mismatch"):
        ops.reduce_into(acc, torch.zeros(7))
    with pytest.raises(ValueError, match="contiguous"):
        ops.reduce_into(torch.zeros(4, 2).t(), torch.zeros(8))
    with pytest.raises(TypeError, match="acc must be"):
        ops.reduce_into(torch.zeros(8, dtype=torch.float16), torch.zeros(8))
    with pytest.raises(TypeError, match="src must be"):
        ops.reduce_into(acc, torch.zeros(8, dtype=torch.int32))
    with pytest.raises(TypeError, match="float64 src"):
        ops.reduce_into(acc, torch.zeros(8, dtype=torch.float64))
    with pytest.raises(TypeError):
        ops.reduce_into(acc, [0.0] * 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scale"):
        ops.reduce_into(acc, torch.zeros(8), "2")  # type: ignore[arg-type]
    assert torch.equal(acc, torch.zeros(8)), "a refused call must not touch acc"


def test_raw_native_module_checks_its_arguments(native: Any) -> None:
    with pytest.raises(ValueError, match="size mismatch"):
        native.reduce_into(torch.zeros(4), torch.zeros(3), 1.0)
    with pytest.raises(TypeError, match="unsupported"):
        native.reduce_into(torch.zeros(4, dtype=torch.int32), torch.zeros(4), 1.0)
    with pytest.raises(ValueError, match="dtype mismatch"):
        native.pack([torch.zeros(2, dtype=torch.float64)], torch.zeros(2))
    with pytest.raises(ValueError, match="needed"):
        native.unpack(torch.zeros(3), [torch.zeros(2)])
    with pytest.raises(ValueError, match="uint8"):
        native.checksum(torch.zeros(3))


# ---------------------------------------------------------------------------------------------
# pack / unpack


@given(
    st.sampled_from(DTYPES),
    st.lists(shapes, min_size=0, max_size=6),
    st.integers(0, 2**16),
    st.booleans(),
)
def test_pack_unpack_native_equals_fallback(
    native: Any, dtype: torch.dtype, shape_list: list[tuple[int, ...]], seed: int, with_out: bool
) -> None:
    tensors = [random_tensor(s, dtype, seed + i) for i, s in enumerate(shape_list)]
    total = sum(t.numel() for t in tensors)
    expected = (
        torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0, dtype=dtype)
    )

    def do_pack() -> torch.Tensor:
        if with_out:
            out = torch.full((total + 3,), 7, dtype=dtype)
            return ops.pack(tensors, out=out)
        return ops.pack(tensors)

    nat, ref = both(do_pack)
    if tensors:
        assert bits_equal(nat, expected) and bits_equal(ref, expected)
    else:
        assert nat.numel() == ref.numel() == 0

    def do_unpack() -> list[torch.Tensor]:
        dests = [torch.zeros_like(t) for t in tensors]
        ops.unpack(expected, dests)
        return dests

    nat_d, ref_d = both(do_unpack)
    for a, b, t in zip(nat_d, ref_d, tensors, strict=True):
        assert bits_equal(a, t) and bits_equal(b, t)


def test_pack_unpack_large_and_noncontiguous(native: Any) -> None:
    tensors = [
        torch.randn(1000, 700),
        torch.randn(3),
        torch.randn(50, 20).t(),
        torch.randn(0, 4),
        torch.randn(2_500_001),
    ]
    nat, ref = both(lambda: ops.pack(tensors))
    assert bits_equal(nat, ref)
    assert torch.equal(nat, torch.cat([t.reshape(-1) for t in tensors]))
    dests_c = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    dests_nc = [
        torch.empty(t.shape[::-1]).t() if t.dim() == 2 else torch.empty_like(t) for t in tensors
    ]
    for dests in (dests_c, dests_nc):
        for enabled in (True, False):
            for d in dests:
                d.zero_()
            with ops.use_native(enabled, all_ops=enabled):
                ops.unpack(nat, dests)
            for d, t in zip(dests, tensors, strict=True):
                assert torch.equal(d, t)


def test_pack_into_tensors_requiring_grad(native: Any) -> None:
    params = [torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(5))]
    flat = ops.pack(params)
    assert not flat.requires_grad
    ops.unpack(flat * 2, params)  # in place into leaves that require grad
    assert params[0].requires_grad


def test_pack_unpack_bad_input() -> None:
    a, b = torch.zeros(3), torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="item 1"):
        ops.pack([a, b])
    with pytest.raises(ValueError, match="needed"):
        ops.pack([a, a], out=torch.zeros(5))
    with pytest.raises(ValueError, match="out is"):
        ops.pack([a], out=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="1-D"):
        ops.pack([a], out=torch.zeros(3, 1))
    with pytest.raises(ValueError, match="1-D contiguous"):
        ops.pack([a], out=torch.zeros(2, 4).t()[0])
    with pytest.raises(TypeError):
        ops.pack(a)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="item 1"):
        ops.pack([a, [1.0, 2.0]])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        ops.pack([a], out=[0.0] * 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="elements"):
        ops.unpack(torch.zeros(4), [a])
    with pytest.raises(ValueError, match="1-D"):
        ops.unpack(torch.zeros(3, 1), [a])
    with pytest.raises(ValueError, match="flat is"):
        ops.unpack(torch.zeros(3, dtype=torch.float64), [a])
    with pytest.raises(ValueError, match="item 1"):
        ops.unpack(torch.zeros(5), [a, b])
    with pytest.raises(TypeError):
        ops.unpack([0.0], [a])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# dispatch, loader and build


def test_dispatch_follows_the_table(native: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(native, name)

    monkeypatch.setattr(ops, "_native_module", Spy())
    monkeypatch.setitem(ops.NATIVE_OPS, "checksum", False)
    monkeypatch.setitem(ops.NATIVE_OPS, "pack", True)
    ops.checksum(b"abc")
    ops.pack([torch.zeros(2)])
    assert calls == ["pack"]
    with ops.use_native(False):
        ops.pack([torch.zeros(2)])
    with ops.use_native(True, all_ops=True):
        ops.checksum(b"abc")
    assert calls == ["pack", "checksum"]
    with pytest.raises(TypeError):
        with ops.use_native(1):  # type: ignore[arg-type]
            pass


def test_missing_toolchain_falls_back_with_a_warning(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import warnings, torch
        from pathlib import Path
        from chaos import ops
        from chaos._native import load
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert load(Path({str(tmp_path)!r})) is None
            assert not ops.native_available()
        assert any("fallback" in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert ops.checksum(b"abc") > 0
        acc = torch.zeros(3); ops.reduce_into(acc, torch.ones(3)); assert acc.tolist() == [1.0] * 3
        print("fallback ok")
    """)
    env = {"PATH": "/usr/bin:/bin", "CXX": "/nonexistent/c++", "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert "fallback ok" in proc.stdout
    assert not list(tmp_path.glob("*.so")), "nothing may be built without a compiler"


def test_build_lock_excludes_other_processes(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        from pathlib import Path
        from chaos._native import _BuildLock
        from chaos.errors import ChaosTimeout
        try:
            with _BuildLock(Path({str(tmp_path)!r}), 0.3):
                print("acquired")
        except ChaosTimeout:
            print("timed out")
    """)
    with _BuildLock(tmp_path, 1.0):
        held = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
    assert held.stdout.strip() == "timed out", held.stderr
    free = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert free.stdout.strip() == "acquired", free.stderr
    assert issubclass(ChaosTimeout, TimeoutError)


def test_ahead_of_time_build_command(native: Any) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "chaos._native", "build"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "chaos native ops built in" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "chaos._native", "frobnicate"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "No such command" in bad.stderr


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").exists():
        found = "/usr/local/cuda/bin/nvcc"
    return found


@pytest.mark.parametrize("source", sorted(p.name for p in (NATIVE_DIR / "cuda").glob("*.cu")))
def test_cuda_sources_compile_with_nvcc(source: str, tmp_path: Path) -> None:
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found on PATH or at /usr/local/cuda/bin/nvcc")
    obj = tmp_path / (source + ".o")
    proc = subprocess.run(
        [
            nvcc,
            "-c",
            str(NATIVE_DIR / "cuda" / source),
            "-o",
            str(obj),
            "-O3",
            "--fmad=false",
            "-Werror",
            "all-warnings",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert obj.stat().st_size > 0


def test_cuda_sources_exist() -> None:
    assert {p.name for p in (NATIVE_DIR / "cuda").glob("*.cu")} == {"reduce_into.cu", "checksum.cu"}


def test_bench_native_writes_json(native: Any, tmp_path: Path) -> None:
    out = tmp_path / "native.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "chaos.bench.cli",
            "native",
            "--sizes",
            "64KB,1MB",
            "--repeats",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert set(data["ops"]) == set(ops.NATIVE_OPS)
    for by_size in data["ops"].values():
        assert set(by_size) == {"64KB", "1MB"}
        for m in by_size.values():
            assert m["native_s"] > 0 and m["fallback_s"] > 0
            assert m["ratio"] == pytest.approx(m["fallback_s"] / m["native_s"])
    assert "ratio" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "chaos.bench.cli", "native", "--sizes", "12XB"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "bad size" in bad.stderr
