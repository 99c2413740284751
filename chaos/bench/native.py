"""``chaos-bench native``: each native op against its pure-torch fallback, side by side.

For each op and size the native and the fallback implementation run alternately (one call of
each per repeat, after a warm-up call of each), so that both see the same machine state. The
figure is the median per side and ``ratio = fallback_s / native_s``: above 1 the native op wins.
:data:`chaos.ops.NATIVE_OPS` keeps an op native only where this ratio is above 1 (the rule
and the figures behind each decision are in ``docs/native.md``); the table's last column shows it.

Sizes are bytes of data the op reads: the float32 accumulator for ``reduce_into_*`` (its src is
that many elements in the wire dtype), the packed buffer for ``pack``/``unpack``, the input for
``checksum``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch

from chaos import ops

DEFAULT_SIZES = "1MB,16MB,64MB"
#: Tensors a packed buffer is cut into: a model-like mix of large and small parameters.
PACK_TENSORS = 48
OPS = (
    "reduce_into_fp32",
    "reduce_into_fp16",
    "reduce_into_bf16",
    "pack",
    "unpack",
    "checksum",
)
#: The scale reduce_into is measured with: averaging over 4 members (the trainer's use).
REDUCE_SCALE = 0.25
_UNITS = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "B": 1}


def parse_size(text: str) -> int:
    """Parse ``"16MB"`` (binary units: KB, MB, GB, or B) into bytes.

    Raises:
        ValueError: If the text is not a positive size with a known unit.
    """
    t = text.strip().upper()
    for unit, mult in _UNITS.items():
        if t.endswith(unit):
            number = t[: -len(unit)]
            try:
                value = float(number)
            except ValueError:
                break
            if value <= 0:
                break
            return int(value * mult)
    raise ValueError(f"bad size {text!r}: expected e.g. 1MB, 512KB, 1GB")


def _split(total: int, parts: int, gen: torch.Generator) -> list[int]:
    """Cut ``total`` elements into ``parts`` model-like pieces (a few large, many small)."""
    weights = torch.rand(parts, generator=gen) ** 4 + 1e-3
    sizes = (weights / weights.sum() * total).floor().to(torch.int64)
    sizes[0] += total - int(sizes.sum())
    return [int(x) for x in sizes]


def _workload(op: str, nbytes: int) -> Callable[[], object]:
    """A zero-argument callable that runs ``op`` once on inputs of ``nbytes``."""
    gen = torch.Generator().manual_seed(nbytes)
    n = max(1, nbytes // 4)
    if op.startswith("reduce_into_"):
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[op[-4:]]
        acc = torch.randn(n, generator=gen)
        src = torch.randn(n, generator=gen).to(dtype)
        return lambda: ops.reduce_into(acc, src, REDUCE_SCALE)
    if op in ("pack", "unpack"):
        tensors = [torch.randn(k, generator=gen) for k in _split(n, PACK_TENSORS, gen)]
        flat = torch.empty(n)
        if op == "pack":
            return lambda: ops.pack(tensors, out=flat)
        ops.pack(tensors, out=flat)
        return lambda: ops.unpack(flat, tensors)
    if op == "checksum":
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        return lambda: ops.checksum(data)
    raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")


def _time_once(fn: Callable[[], object], native: bool) -> float:
    with ops.use_native(native, all_ops=native):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def measure(op: str, nbytes: int, repeats: int) -> dict[str, float]:
    """Median native and fallback times of one op at one size, measured alternately.

    Returns:
        ``{"native_s": ..., "fallback_s": ..., "ratio": fallback_s / native_s}``.
    """
    fn = _workload(op, nbytes)
    _time_once(fn, True)
    _time_once(fn, False)
    native_t: list[float] = []
    fallback_t: list[float] = []
    for i in range(repeats):
        order = (True, False) if i % 2 == 0 else (False, True)
        for side in order:
            (native_t if side else fallback_t).append(_time_once(fn, side))
    native_s, fallback_s = statistics.median(native_t), statistics.median(fallback_t)
    return {"native_s": native_s, "fallback_s": fallback_s, "ratio": fallback_s / native_s}


def run(sizes: list[str], op_names: list[str], repeats: int) -> dict[str, Any]:
    """Measure every op at every size.

    Raises:
        RuntimeError: If the native extension cannot be built here.
        ValueError: On an unknown op or a bad size.
    """
    if not ops.native_available():
        raise RuntimeError("the native extension is unavailable (see the warning above)")
    parsed = {s: parse_size(s) for s in sizes}
    for op in op_names:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")
    result: dict[str, Any] = {
        "ops": {op: {label: measure(op, nb, repeats) for label, nb in parsed.items()}
                for op in op_names},
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "reduce_scale": REDUCE_SCALE,
        "torch": torch.__version__,
        "kept_native": {op: ops.NATIVE_OPS.get(op, False) for op in op_names},
    }
    return result


@click.command("native")
@click.option("--sizes", default=DEFAULT_SIZES, show_default=True,
              help="Comma-separated data sizes (binary units).")
@click.option("--ops", "op_list", default=",".join(OPS), show_default=True,
              help="Comma-separated ops to measure.")
@click.option("--repeats", type=click.IntRange(min=1), default=11, show_default=True,
              help="Timed calls per side; raise it on a noisy machine.")
@click.option("--threads", type=click.IntRange(min=0), default=0, show_default=True,
              help="Intra-op threads for both sides (0: torch's default). 1 gives steadier "
                   "figures on a loaded machine.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def native_command(sizes: str, op_list: str, repeats: int, threads: int,
                   json_path: Path | None) -> None:
    """Time each native op against its torch fallback (ratio = fallback_s / native_s)."""
    if threads:
        torch.set_num_threads(threads)
    size_list = [s for s in sizes.split(",") if s.strip()]
    op_names = [o.strip() for o in op_list.split(",") if o.strip()]
    try:
        res = run(size_list, op_names, repeats)
    except (ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from exc
    print(f"{'op':<18}{'size':>7}{'native':>12}{'fallback':>12}{'ratio':>8}  kept native")
    for op, by_size in res["ops"].items():
        kept = "yes" if res["kept_native"][op] else "no"
        for label, m in by_size.items():
            print(f"{op:<18}{label:>7}{m['native_s'] * 1e3:>10.3f}ms"
                  f"{m['fallback_s'] * 1e3:>10.3f}ms{m['ratio']:>8.2f}  {kept}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(res, indent=1))
        print(f"wrote {json_path}")
