"""The training state as one canonical, ordered byte stream (docs/state.md).

The stream is the concatenation, in this order, of:

1. the model's parameters and buffers, in ``model.state_dict()`` order;
2. the optimizer's tensor state, in param-group order, then parameter order within a group, then
   the state keys sorted by name (``exp_avg``, ``exp_avg_sq``, ``step`` for Adam);
3. the tensors of the extra state objects (``extra``: LR schedulers, a ``GradScaler``, an EMA
   model, anything with ``state_dict()``/``load_state_dict()``), object by object, each
   ``state_dict()``'s tensors in the order it lists them;
4. one runtime record: a msgpack-encoded :class:`RuntimeInfo` (step, epoch, user
   hyperparameters, the torch CPU, Python ``random`` and numpy RNG states), no pickle.

Everything the stream does not carry travels in the :class:`Manifest` (the header): the layout of
every tensor (name, dtype, shape), the optimizer class, every param group's hyperparameters, the
optimizer's non-tensor per-parameter values (``None`` momentum buffers, int steps), every extra
object's ``state_dict()`` with its tensors replaced by their place in the stream, and the length
of the runtime record. A joiner gets the manifest first and allocates everything from it, so an
optimizer without state (Adam before its first step) can receive a donor's state.

A donor's :class:`TrainingState` reads zero-copy views of its live tensors; a joiner's writes
straight into its own model's tensors and into freshly allocated optimizer tensors, and
:meth:`TrainingState.apply` then installs the optimizer state, the hyperparameters and the RNG
states. The joiner's model is overwritten as shards arrive: it must not train until ``apply``
succeeded.

Only contiguous, strided CPU tensors are supported; anything else is refused with a clear error.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import numpy as np
import torch

from chaos.errors import StateLayoutError
from chaos.wire import STATE_FORMAT_VERSION

__all__ = [
    "STATE_FORMAT_VERSION",
    "ExtraEntry",
    "ExtraState",
    "Manifest",
    "RuntimeInfo",
    "TrainingState",
    "capture_runtime",
    "decode_manifest",
    "extra_digest",
    "extra_tensor_count",
    "restore_rng",
    "state_diff",
    "state_digest",
    "state_equal",
]

MAX_MANIFEST_BYTES = 64 << 20
"""Largest encoded manifest a joiner accepts (64 MiB: far above any real model's header)."""

MAX_RUNTIME_BYTES = 16 << 20
"""Largest runtime record a joiner accepts (16 MiB)."""

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}

Dim = Annotated[int, msgspec.Meta(ge=0)]
Index = Annotated[int, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(max_length=1024)]


# ----------------------------------------------------------------------------- wire structs


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of the stream: its name, dtype name (``"float32"``) and shape."""

    name: Name
    dtype: str
    shape: list[Dim]


class OptimTensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One optimizer state tensor, ``optimizer.state[p][key]`` where ``p`` is
    ``param_groups[group]["params"][index]``."""

    group: Index
    index: Index
    key: Name
    dtype: str
    shape: list[Dim]


class OptimValue(msgspec.Struct, array_like=True, frozen=True):
    """One non-tensor optimizer state value (plain msgpack types only)."""

    group: Index
    index: Index
    key: Name
    value: Any


class ExtraEntry(msgspec.Struct, array_like=True, frozen=True):
    """One extra state object: its name and its ``state_dict()`` in the tagged plain encoding
    of :func:`_encode_extra` (``["D", [[key, value], ...]]``, ``["L", [...]]``, ``["T", [...]]``,
    ``["X", i]`` for the ``i``-th tensor of ``Manifest.extra_tensors``; scalars as they are)."""

    name: Name
    state: Any


class Manifest(msgspec.Struct, kw_only=True, frozen=True):
    """The stream's header: everything a joiner needs to allocate before shards arrive.

    Attributes:
        version: :data:`STATE_FORMAT_VERSION`.
        fingerprint: :func:`layout_fingerprint` of the layout fields below.
        optimizer_class: ``module.QualName`` of the optimizer.
        params: Per param group, the dtype and shape of each parameter (name left empty).
        param_groups: Per param group, its hyperparameters (every key but ``"params"``).
        model: The model's tensors, in stream order.
        optim: The optimizer's tensors, in stream order.
        optim_values: The optimizer's non-tensor per-parameter values.
        extra: The extra state objects, in stream order: name and encoded ``state_dict()``.
        extra_tensors: Their tensors, in stream order (named ``OBJECT/PATH``).
        runtime_bytes: Length of the runtime record that ends the stream.
        runtime_digest: SHA-256 (hex) of the runtime record; :meth:`TrainingState.apply` checks
            the received record against it, and donors whose records differ have different
            manifests (so a joiner never assembles one record from two donors).
        total_bytes: Length of the whole stream.
    """

    version: int = STATE_FORMAT_VERSION
    fingerprint: str
    optimizer_class: str
    params: list[list[TensorSpec]]
    param_groups: list[dict[str, Any]]
    model: list[TensorSpec]
    optim: list[OptimTensorSpec]
    optim_values: list[OptimValue]
    extra: list[ExtraEntry] = []
    extra_tensors: list[TensorSpec] = []
    runtime_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_RUNTIME_BYTES)]
    runtime_digest: Annotated[str, msgspec.Meta(max_length=64)]
    total_bytes: Annotated[int, msgspec.Meta(ge=0)]


class PyRandomState(msgspec.Struct, array_like=True, frozen=True):
    """Python's ``random.getstate()``: ``(version, internal state, gauss_next)``."""

    version: int
    internal: list[int]
    gauss_next: float | None


class NumpyRandomState(msgspec.Struct, array_like=True, frozen=True):
    """numpy's legacy global ``np.random.get_state()``; ``keys`` is the raw uint32 array."""

    algorithm: str
    keys: bytes
    pos: int
    has_gauss: int
    cached_gaussian: float


class RuntimeInfo(msgspec.Struct, kw_only=True, frozen=True):
    """Runtime information carried at the end of the stream.

    Attributes:
        step: Global training step.
        epoch: Membership epoch the state belongs to.
        hyperparameters: User hyperparameters (plain msgpack types: str keys; ints, floats,
            strings, bools, None, lists and dicts of those).
        torch_rng: ``torch.get_rng_state()`` bytes (CPU generator).
        python_rng: ``random.getstate()``.
        numpy_rng: numpy's global RNG state.
    """

    step: Annotated[int, msgspec.Meta(ge=0)]
    epoch: Annotated[int, msgspec.Meta(ge=0)]
    hyperparameters: dict[str, Any] = {}
    torch_rng: bytes
    python_rng: PyRandomState
    numpy_rng: NumpyRandomState


_UNREADABLE = (msgspec.DecodeError, RecursionError, UnicodeDecodeError)
"""What msgspec raises on unreadable bytes (malformed, nested too deep, not UTF-8)."""
_MANIFEST_DECODER = msgspec.msgpack.Decoder(Manifest)
_RUNTIME_DECODER = msgspec.msgpack.Decoder(RuntimeInfo)
_ENCODER = msgspec.msgpack.Encoder()


# ----------------------------------------------------------------------------- runtime info


def capture_runtime(
    step: int, epoch: int, hyperparameters: dict[str, Any] | None = None
) -> RuntimeInfo:
    """Captures the current RNG states together with ``step``, ``epoch`` and hyperparameters.

    Args:
        step: Global training step (>= 0).
        epoch: Membership epoch (>= 0).
        hyperparameters: User hyperparameters, plain types only.

    Returns:
        The runtime record.

    Raises:
        ValueError: a negative step or epoch.
        TypeError: a hyperparameter is not a plain msgpack type.
    """
    for label, value in (("step", step), ("epoch", epoch)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{label} must be >= 0, got {value}")
    hyper = dict(hyperparameters or {})
    _check_plain(hyper, "hyperparameters")
    version, internal, gauss = random.getstate()
    algorithm, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return RuntimeInfo(
        step=step,
        epoch=epoch,
        hyperparameters=hyper,
        torch_rng=torch.get_rng_state().numpy().tobytes(),
        python_rng=PyRandomState(version=version, internal=list(internal), gauss_next=gauss),
        numpy_rng=NumpyRandomState(
            algorithm=str(algorithm),
            keys=np.ascontiguousarray(keys, dtype=np.uint32).tobytes(),
            pos=int(pos),
            has_gauss=int(has_gauss),
            cached_gaussian=float(cached),
        ),
    )


def restore_rng(info: RuntimeInfo) -> None:
    """Sets the torch CPU, Python and numpy RNG states from ``info``.

    Raises:
        StateLayoutError: a state is malformed (wrong length, wrong algorithm); the RNGs are
            left as they were.
    """
    try:
        torch_state = torch.frombuffer(bytearray(info.torch_rng), dtype=torch.uint8)
        py_state = (
            info.python_rng.version,
            tuple(info.python_rng.internal),
            info.python_rng.gauss_next,
        )
        if len(info.numpy_rng.keys) != 624 * 4:  # MT19937: 624 32-bit words
            raise ValueError(f"numpy RNG key is {len(info.numpy_rng.keys)} bytes, expected 2496")
        np_keys = np.frombuffer(info.numpy_rng.keys, dtype=np.uint32)
        np_state = (
            info.numpy_rng.algorithm,
            np_keys,
            info.numpy_rng.pos,
            info.numpy_rng.has_gauss,
            info.numpy_rng.cached_gaussian,
        )
        if torch_state.numel() != torch.get_rng_state().numel():
            raise ValueError(f"torch RNG state has {torch_state.numel()} bytes")
        saved = (torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=True))
        try:
            random.setstate(py_state)
            np.random.set_state(np_state)
            torch.set_rng_state(torch_state)
        except BaseException:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])
            raise
    except (ValueError, TypeError, RuntimeError, OverflowError, IndexError) as exc:
        raise StateLayoutError(f"malformed RNG state in the runtime record: {exc}") from exc


# ----------------------------------------------------------------------------- helpers


def _check_plain(value: Any, where: str) -> None:
    """Raises TypeError unless ``value`` is made only of plain msgpack types."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} has a non-str key {k!r}")
            _check_plain(item, f"{where}[{k!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}; only plain values (numbers, str, bytes, bool, None, "
        "lists and dicts of those) can travel in the state header"
    )


def _to_tuples(value: Any) -> Any:
    """Lists back to tuples (msgpack has one array type; torch hyperparameters use tuples)."""
    if isinstance(value, list):
        return tuple(_to_tuples(v) for v in value)
    return value


def _dtype_name(t: torch.Tensor, where: str) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"{where}: dtype {t.dtype} is not supported in the state stream")
    return name


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=_DTYPES[dtype]).element_size()


def _spec(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name=name, dtype=_dtype_name(t, name), shape=list(t.shape))


def _byte_view(t: torch.Tensor, where: str) -> memoryview:
    """A writable zero-copy byte view of a contiguous CPU tensor's memory."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided:
        raise ValueError(f"{where}: only dense (strided) tensors are supported, got {t.layout}")
    if t.device.type != "cpu":
        raise ValueError(f"{where}: only CPU tensors are supported, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{where}: tensor is not contiguous; call .contiguous() on it first")
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    arr: Any = flat.view(torch.uint8).numpy()
    return memoryview(arr)


ExtraState = dict[str, Any]
"""Extra state objects by name: each has ``state_dict()`` and ``load_state_dict(state)``."""

_EXTRA_TAGS = frozenset(("D", "L", "T", "X"))


def _encode_extra(
    extra: ExtraState | None,
) -> tuple[list[ExtraEntry], list[TensorSpec], list[torch.Tensor]]:
    """Every extra object's ``state_dict()`` as plain values, and its tensors, copied to CPU.

    The copies keep the bytes a donor serves fixed, whatever the object does meanwhile.

    Raises:
        TypeError: a value is neither a tensor of a supported dtype, a plain scalar, nor a
            dict, list or tuple of those (the message names the object and the path).
    """
    entries: list[ExtraEntry] = []
    specs: list[TensorSpec] = []
    tensors: list[torch.Tensor] = []

    def enc(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu", copy=True).contiguous()
            specs.append(_spec(path, t))
            tensors.append(t)
            return ["X", len(tensors) - 1]
        if v is None or isinstance(v, (bool, str, bytes)):
            return v
        if isinstance(v, int):
            if not -(1 << 63) <= v < 1 << 64:
                raise TypeError(f"{path}: the int {v} does not fit in 64 bits")
            return int(v)
        if isinstance(v, float):
            return float(v)
        if isinstance(v, dict):
            return ["D", [[enc(k, f"{path}/<key>"), enc(x, f"{path}/{k}")] for k, x in v.items()]]
        if isinstance(v, (list, tuple)):
            tag = "L" if isinstance(v, list) else "T"
            return [tag, [enc(x, f"{path}/{i}") for i, x in enumerate(v)]]
        raise TypeError(
            f"extra state {path} is a {type(v).__name__}; a state_dict() may hold tensors, "
            "numbers, str, bytes, bool, None, and dicts, lists and tuples of those"
        )

    for name, obj in (extra or {}).items():
        getter = getattr(obj, "state_dict", None)
        if not callable(getter):
            raise TypeError(f"extra state {name!r} has no state_dict() method")
        entries.append(ExtraEntry(name=name, state=enc(getter(), name)))
    return entries, specs, tensors


def _decode_extra(node: Any, tensors: Sequence[torch.Tensor], where: str) -> Any:
    """The value :func:`_encode_extra` encoded as ``node``, with its tensors.

    Raises:
        StateLayoutError: ``node`` is not such an encoding.
    """
    if not isinstance(node, (list, tuple)):
        return node
    if len(node) != 2 or node[0] not in _EXTRA_TAGS:
        raise StateLayoutError(f"malformed extra state at {where}")
    tag, body = node
    if tag == "X":
        if isinstance(body, bool) or not isinstance(body, int) or not 0 <= body < len(tensors):
            raise StateLayoutError(f"extra state at {where} names no tensor of the stream")
        return tensors[body]
    if not isinstance(body, (list, tuple)):
        raise StateLayoutError(f"malformed extra state at {where}")
    if tag == "D":
        out: dict[Any, Any] = {}
        for pair in body:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise StateLayoutError(f"malformed extra state dict at {where}")
            key = _decode_extra(pair[0], tensors, where)
            if isinstance(key, (list, dict, torch.Tensor)):
                raise StateLayoutError(f"extra state at {where} has an unhashable key")
            out[key] = _decode_extra(pair[1], tensors, f"{where}/{key}")
        return out
    items = [_decode_extra(x, tensors, f"{where}/{i}") for i, x in enumerate(body)]
    return items if tag == "L" else tuple(items)


def _tensor_refs(node: Any, refs: list[int]) -> None:
    """Appends to ``refs`` every tensor index an encoded value names (checked later)."""
    if isinstance(node, (list, tuple)) and len(node) == 2 and node[0] in _EXTRA_TAGS:
        tag, body = node
        if tag == "X":
            refs.append(body if isinstance(body, int) and not isinstance(body, bool) else -1)
        elif isinstance(body, (list, tuple)):
            for item in body:
                if tag == "D" and isinstance(item, (list, tuple)):  # a [key, value] pair
                    for part in item:
                        _tensor_refs(part, refs)
                else:
                    _tensor_refs(item, refs)


def extra_tensor_count(extra: ExtraState | None) -> int:
    """The tensors the extra objects' ``state_dict()`` hold now (to notice a new layout)."""
    count = 0

    def walk(v: Any) -> None:
        nonlocal count
        if isinstance(v, torch.Tensor):
            count += 1
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    for obj in (extra or {}).values():
        walk(obj.state_dict())
    return count


def extra_digest(extra: ExtraState | None) -> str:
    """SHA-256 (hex) of the extra objects' states: their encoded values and tensor bytes.

    Raises:
        TypeError: as :func:`_encode_extra`.
    """
    entries, specs, tensors = _encode_extra(extra)
    h = hashlib.sha256(_ENCODER.encode([entries, specs]))
    for t in tensors:
        h.update(_byte_view(t, "extra"))
    return h.hexdigest()


def layout_fingerprint(
    model: Sequence[TensorSpec],
    optimizer_class: str,
    params: Sequence[Sequence[TensorSpec]],
    optim: Sequence[OptimTensorSpec],
    extra: Sequence[ExtraEntry] = (),
    extra_tensors: Sequence[TensorSpec] = (),
) -> str:
    """SHA-256 (hex) of the layout: names, dtypes and shapes of every tensor, the optimizer,
    and the names of the extra state objects.

    Two states with equal fingerprints have identical streams up to the runtime record.
    """
    canon = [
        "chaos-state",
        STATE_FORMAT_VERSION,
        [[s.name, s.dtype, s.shape] for s in model],
        optimizer_class,
        [[[p.dtype, p.shape] for p in group] for group in params],
        [[s.group, s.index, s.key, s.dtype, s.shape] for s in optim],
        [e.name for e in extra],
        [[s.name, s.dtype, s.shape] for s in extra_tensors],
    ]
    return hashlib.sha256(_ENCODER.encode(canon)).hexdigest()


def decode_manifest(data: bytes | memoryview) -> Manifest:
    """Decodes and checks a manifest received from a donor.

    Raises:
        StateLayoutError: the bytes are oversized, malformed, of another format version, name an
            unsupported dtype, or are inconsistent (sizes, fingerprint, optimizer state or
            hyperparameters for params that the layout does not have).
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise StateLayoutError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        m = _MANIFEST_DECODER.decode(data)
    except _UNREADABLE as exc:
        raise StateLayoutError(f"malformed state manifest: {exc}") from exc
    if m.version != STATE_FORMAT_VERSION:
        raise StateLayoutError(
            f"state format version {m.version}, this node speaks {STATE_FORMAT_VERSION}"
        )
    specs: list[TensorSpec | OptimTensorSpec] = [*m.model, *m.optim, *m.extra_tensors]
    specs += [p for group in m.params for p in group]
    for s in specs:
        if s.dtype not in _DTYPES:
            raise StateLayoutError(f"manifest names an unsupported dtype {s.dtype!r}")
    total = m.runtime_bytes
    total += sum(_nbytes(s.dtype, s.shape) for s in m.model)
    total += sum(_nbytes(o.dtype, o.shape) for o in m.optim)
    total += sum(_nbytes(s.dtype, s.shape) for s in m.extra_tensors)
    if total != m.total_bytes:
        raise StateLayoutError(f"manifest total_bytes {m.total_bytes} != its tensors' {total}")
    if len(m.param_groups) != len(m.params):
        raise StateLayoutError("manifest has a different number of param groups and param lists")
    owners = [(o.group, o.index) for o in m.optim]
    owners += [(v.group, v.index) for v in m.optim_values]  # the values are not fingerprinted
    for group, index in owners:
        if group >= len(m.params) or index >= len(m.params[group]):
            raise StateLayoutError(
                f"manifest names optimizer state of param {index} of group {group},"
                " which its layout does not have"
            )
    if any("params" in hyper for hyper in m.param_groups):
        raise StateLayoutError("manifest hyperparameters name 'params'")
    refs: list[int] = []
    for entry in m.extra:
        _tensor_refs(entry.state, refs)
    if sorted(refs) != list(range(len(m.extra_tensors))):
        raise StateLayoutError("manifest extra state does not name each of its tensors once")
    if len({e.name for e in m.extra}) != len(m.extra):
        raise StateLayoutError("manifest names an extra state object twice")
    fingerprint = layout_fingerprint(
        m.model, m.optimizer_class, m.params, m.optim, m.extra, m.extra_tensors
    )
    if fingerprint != m.fingerprint:
        raise StateLayoutError("manifest fingerprint does not match its layout")
    return m


def _optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _param_specs(optimizer: torch.optim.Optimizer) -> list[list[TensorSpec]]:
    out: list[list[TensorSpec]] = []
    for g, group in enumerate(optimizer.param_groups):
        out.append([_spec("", p) for p in group["params"]])
        for i, p in enumerate(group["params"]):
            _dtype_name(p, f"param_groups[{g}]['params'][{i}]")
    return out


def _group_hypers(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    out = []
    for g, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        _check_plain(hyper, f"optimizer.param_groups[{g}]")
        out.append(hyper)
    return out


# ----------------------------------------------------------------------------- the state


class TrainingState:
    """The training state of one node as one canonical byte stream.

    Build a donor's state with :meth:`capture` (or the constructor with a :class:`RuntimeInfo`)
    and a joiner's receiving state with :meth:`for_joiner`. Both expose the same stream layout.

    Args:
        model: The model; its ``state_dict()`` tensors must be contiguous CPU tensors.
        optimizer: The model's optimizer.
        runtime: The runtime record to carry (see :func:`capture_runtime`).
        extra: Extra state objects by name (``state_dict()``/``load_state_dict()``): their
            states travel with the model's; their tensors are copied to CPU when captured.

    Raises:
        TypeError: a state value has an unsupported type (non-tensor model state, tensor
            hyperparameters, an unsupported dtype, an extra state value that is not plain).
        ValueError: a tensor is not a contiguous dense CPU tensor.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        runtime: RuntimeInfo,
        extra: ExtraState | None = None,
    ) -> None:
        model_specs, model_tensors = self._model_part(model)
        optim_specs: list[OptimTensorSpec] = []
        optim_tensors: list[torch.Tensor] = []
        values: list[OptimValue] = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                st = optimizer.state.get(p, {})
                for key in sorted(st):
                    v = st[key]
                    where = f"optimizer.state[group {g}, param {i}][{key!r}]"
                    if isinstance(v, torch.Tensor):
                        name = _dtype_name(v, where)
                        optim_specs.append(OptimTensorSpec(g, i, key, name, list(v.shape)))
                        optim_tensors.append(v)
                    else:
                        _check_plain(v, where)
                        values.append(OptimValue(g, i, key, v))
        entries, extra_specs, extra_tensors = _encode_extra(extra)
        blob = _ENCODER.encode(runtime)
        params = _param_specs(optimizer)
        cls_name = _optimizer_class(optimizer)
        fingerprint = layout_fingerprint(
            model_specs, cls_name, params, optim_specs, entries, extra_specs
        )
        manifest = Manifest(
            fingerprint=fingerprint,
            optimizer_class=cls_name,
            params=params,
            param_groups=_group_hypers(optimizer),
            model=model_specs,
            optim=optim_specs,
            optim_values=values,
            extra=entries,
            extra_tensors=extra_specs,
            runtime_bytes=len(blob),
            runtime_digest=hashlib.sha256(blob).hexdigest(),
            total_bytes=0,
        )
        self._extra = dict(extra or {})
        self._extra_tensors = extra_tensors
        self._setup(model, optimizer, manifest, model_tensors, optim_tensors, blob)
        self._runtime: RuntimeInfo | None = runtime
        self._written = [(0, self.total_bytes)]

    @classmethod
    def capture(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        step: int,
        epoch: int,
        hyperparameters: dict[str, Any] | None = None,
        extra: ExtraState | None = None,
    ) -> TrainingState:
        """A donor's state: live views of ``model`` and ``optimizer``, copies of the ``extra``
        objects' states, and the RNG states now.

        The views are live: the donor must not step the optimizer while the state is served.

        Raises:
            TypeError, ValueError: see the class.
        """
        return cls(model, optimizer, capture_runtime(step, epoch, hyperparameters), extra)

    @classmethod
    def for_joiner(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        manifest: Manifest | bytes | memoryview,
        extra: ExtraState | None = None,
    ) -> TrainingState:
        """A joiner's receiving state, laid out as the donor's ``manifest`` says.

        Model shards are written straight into ``model``'s tensors; optimizer and extra state
        tensors are allocated here (the optimizer may have no state yet) and installed by
        :meth:`apply`.

        Raises:
            StateLayoutError: the manifest is malformed, or its layout differs from this
                model and optimizer (names, shapes, dtypes, param groups, optimizer class), or
                it names other extra state objects than ``extra``.
        """
        m = decode_manifest(manifest) if not isinstance(manifest, Manifest) else manifest
        theirs, ours = [e.name for e in m.extra], list(extra or {})
        if sorted(theirs) != sorted(ours):
            raise StateLayoutError(
                f"the donor's extra state objects are {theirs}, this trainer's are {ours}"
            )
        model_specs, model_tensors = cls._model_part(model)
        params = _param_specs(optimizer)
        mine = layout_fingerprint(
            model_specs, _optimizer_class(optimizer), params, m.optim, m.extra, m.extra_tensors
        )
        if mine != m.fingerprint:
            raise StateLayoutError(
                "the donor's state has another layout than this model and optimizer: "
                + _layout_difference(m, model_specs, _optimizer_class(optimizer), params)
            )
        optim_tensors = [torch.empty(s.shape, dtype=_DTYPES[s.dtype]) for s in m.optim]
        self = cls.__new__(cls)
        self._extra = dict(extra or {})
        self._extra_tensors = [torch.empty(s.shape, dtype=_DTYPES[s.dtype])
                               for s in m.extra_tensors]  # fmt: skip
        self._setup(model, optimizer, m, model_tensors, optim_tensors, bytearray(m.runtime_bytes))
        self._runtime = None
        self._written = []
        return self

    # -- construction helpers

    @staticmethod
    def _model_part(model: torch.nn.Module) -> tuple[list[TensorSpec], list[torch.Tensor]]:
        specs: list[TensorSpec] = []
        tensors: list[torch.Tensor] = []
        for name, t in model.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"model state {name!r} is a {type(t).__name__}, not a tensor")
            specs.append(_spec(name, t))
            tensors.append(t)
        return specs, tensors

    def _setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        manifest: Manifest,
        model_tensors: list[torch.Tensor],
        optim_tensors: list[torch.Tensor],
        blob: bytes | bytearray,
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._optim_tensors = optim_tensors
        names = [f"model/{s.name}" for s in manifest.model]
        names += [f"optim/{s.group}/{s.index}/{s.key}" for s in manifest.optim]
        names += [f"extra/{s.name}" for s in manifest.extra_tensors]
        tensors = [*model_tensors, *optim_tensors, *self._extra_tensors]
        views = [_byte_view(t, n) for t, n in zip(tensors, names, strict=True)]
        views.append(memoryview(blob))
        self._views = views
        self._sizes = [v.nbytes for v in views]
        self._starts = [0]
        for size in self._sizes[:-1]:
            self._starts.append(self._starts[-1] + size)
        total = sum(self._sizes)
        if manifest.total_bytes not in (0, total):
            raise StateLayoutError(f"manifest says {manifest.total_bytes} bytes, layout {total}")
        if manifest.total_bytes == 0:
            manifest = msgspec.structs.replace(manifest, total_bytes=total)
        self._manifest = manifest
        self._manifest_bytes = _ENCODER.encode(manifest)
        self._total = total

    # -- layout

    @property
    def manifest(self) -> Manifest:
        """The stream's header (send it to a joiner before any shard)."""
        return self._manifest

    @property
    def manifest_bytes(self) -> bytes:
        """The encoded manifest, as it travels on the wire."""
        return self._manifest_bytes

    @property
    def total_bytes(self) -> int:
        """Length of the stream in bytes."""
        return self._total

    @property
    def runtime(self) -> RuntimeInfo | None:
        """The runtime record (``None`` on a joiner before :meth:`apply`)."""
        return self._runtime

    def tensor_sizes(self) -> list[int]:
        """Bytes per stream element in stream order (what ``plan_replication`` takes).

        The runtime record counts as the last element.
        """
        return list(self._sizes)

    def layout_fingerprint(self) -> str:
        """Hash of the names, shapes and dtypes of every tensor and of the optimizer layout."""
        return self._manifest.fingerprint

    # -- stream access

    def _check_range(self, offset: int, length: int) -> None:
        for label, value in (("offset", offset), ("length", length)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{label} must be an int, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"{label} must be >= 0, got {value}")
        if offset + length > self._total:
            raise ValueError(
                f"range [{offset}, {offset + length}) is outside the {self._total}-byte stream"
            )

    def _pieces(self, offset: int, length: int) -> list[tuple[memoryview, int, int]]:
        """``(view, start, stop)`` slices of the element views that make up a range."""
        out = []
        idx = bisect.bisect_right(self._starts, offset) - 1
        pos, end = offset, offset + length
        while pos < end:
            lo = pos - self._starts[idx]
            hi = min(self._sizes[idx], end - self._starts[idx])
            if hi > lo:
                out.append((self._views[idx], lo, hi))
                pos += hi - lo
            idx += 1
        return out

    def read(self, offset: int, length: int) -> memoryview:
        """The bytes ``[offset, offset + length)`` of the stream, read-only.

        Zero-copy (a view into the tensor's memory) when the range lies inside one element; a
        range that crosses elements is gathered into a new buffer.

        Raises:
            ValueError: the range is outside the stream.
            TypeError: a non-int offset or length.
        """
        self._check_range(offset, length)
        pieces = self._pieces(offset, length)
        if len(pieces) == 1:
            view, lo, hi = pieces[0]
            return view[lo:hi].toreadonly()
        buf = bytearray(length)
        pos = 0
        for view, lo, hi in pieces:
            buf[pos : pos + hi - lo] = view[lo:hi]
            pos += hi - lo
        return memoryview(buf).toreadonly()

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Writes ``data`` at ``offset`` of the stream (a joiner receiving a shard).

        Raises:
            ValueError: the range is outside the stream, or ``data`` is not a contiguous
                byte buffer.
        """
        src = memoryview(data)
        if not src.contiguous:
            raise ValueError("shard data must be a contiguous buffer")
        src = src.cast("B") if src.format != "B" or src.ndim != 1 else src
        self._check_range(offset, src.nbytes)
        pos = 0
        for view, lo, hi in self._pieces(offset, src.nbytes):
            view[lo:hi] = src[pos : pos + hi - lo]
            pos += hi - lo
        if src.nbytes:
            self._written.append((offset, src.nbytes))

    def missing(self) -> list[tuple[int, int]]:
        """``(offset, length)`` ranges not written yet, in stream order."""
        ranges = sorted(self._written)
        merged: list[tuple[int, int]] = []
        for off, length in ranges:
            if merged and off <= merged[-1][0] + merged[-1][1]:
                last_off, last_len = merged[-1]
                merged[-1] = (last_off, max(last_len, off + length - last_off))
            else:
                merged.append((off, length))
        self._written = merged
        out, pos = [], 0
        for off, length in merged:
            if off > pos:
                out.append((pos, off - pos))
            pos = max(pos, off + length)
        if pos < self._total:
            out.append((pos, self._total - pos))
        return out

    # -- applying a received state

    def apply(self) -> RuntimeInfo:
        """Installs the received stream: extra states, optimizer state and hyperparameters,
        RNG states.

        The model's tensors already hold the received bytes. Everything is decoded and checked
        before anything is changed, so a refused stream leaves the optimizer and RNGs untouched
        (an extra object whose ``load_state_dict`` refuses its state leaves the objects before
        it loaded).

        Returns:
            The runtime record (step, epoch, hyperparameters) for the caller's loop.

        Raises:
            StateLayoutError: bytes are missing, the runtime record or an extra state is
                malformed, or an extra object's ``load_state_dict`` refused its state.
        """
        missing = self.missing()
        if missing:
            n = sum(length for _, length in missing)
            raise StateLayoutError(f"{n} bytes of the state were never received: {missing[:4]}")
        if hashlib.sha256(self._views[-1]).hexdigest() != self._manifest.runtime_digest:
            raise StateLayoutError("the received runtime record does not match its digest")
        try:
            runtime = _RUNTIME_DECODER.decode(self._views[-1])
        except _UNREADABLE as exc:
            raise StateLayoutError(f"malformed runtime record: {exc}") from exc
        states = [(e.name, _decode_extra(e.state, self._extra_tensors, e.name))
                  for e in self._manifest.extra]  # fmt: skip
        for name, state in states:
            try:
                self._extra[name].load_state_dict(state)
            except Exception as exc:  # noqa: BLE001 - any refusal of the object's own check
                raise StateLayoutError(
                    f"extra state {name!r} refused the donor's state: {exc}"
                ) from exc
        restore_rng(runtime)
        opt = self._optimizer
        groups = opt.param_groups
        opt.state.clear()
        for spec, tensor in zip(self._manifest.optim, self._optim_tensors, strict=True):
            opt.state[groups[spec.group]["params"][spec.index]][spec.key] = tensor
        for val in self._manifest.optim_values:
            opt.state[groups[val.group]["params"][val.index]][val.key] = _to_tuples(val.value)
        for group, hyper in zip(groups, self._manifest.param_groups, strict=True):
            for key, value in hyper.items():
                group[key] = _to_tuples(value)
        self._runtime = runtime
        return runtime


def _layout_difference(
    m: Manifest, model: list[TensorSpec], opt_cls: str, params: list[list[TensorSpec]]
) -> str:
    """A short human-readable reason why two layouts differ."""
    if opt_cls != m.optimizer_class:
        return f"optimizer {m.optimizer_class} vs {opt_cls}"
    theirs = {s.name: s for s in m.model}
    mine = {s.name: s for s in model}
    if list(theirs) != list(mine):
        only_t = sorted(set(theirs) - set(mine))[:3]
        only_m = sorted(set(mine) - set(theirs))[:3]
        return f"model tensors differ (donor only: {only_t}, joiner only: {only_m}, or order)"
    for name, spec in theirs.items():
        if spec != mine[name]:
            return f"model tensor {name!r}: donor {spec.dtype}{spec.shape}, joiner " + (
                f"{mine[name].dtype}{mine[name].shape}"
            )
    if [len(g) for g in params] != [len(g) for g in m.params]:
        return "optimizer param groups differ in size"
    return "optimizer parameters differ in dtype or shape"


# ----------------------------------------------------------------------------- comparison

_COMPARE_CHUNK = 1 << 22


def state_digest(state: TrainingState) -> str:
    """SHA-256 (hex) of a state's manifest and whole stream: equal digests, equal states."""
    h = hashlib.sha256(state.manifest_bytes)
    for off in range(0, state.total_bytes, _COMPARE_CHUNK):
        h.update(state.read(off, min(_COMPARE_CHUNK, state.total_bytes - off)))
    return h.hexdigest()


def state_diff(a: TrainingState, b: TrainingState) -> list[str]:
    """Where two states differ, bitwise; empty when they are equal (for tests and debugging)."""
    out = []
    if a.layout_fingerprint() != b.layout_fingerprint():
        return ["layout fingerprints differ"]
    ma, mb = a.manifest, b.manifest
    if ma.param_groups != mb.param_groups:
        out.append("optimizer hyperparameters differ")
    if ma.optim_values != mb.optim_values:
        out.append("optimizer non-tensor values differ")
    if ma.extra != mb.extra:
        out.append("extra state values differ")
    names = [f"model/{s.name}" for s in ma.model]
    names += [f"optim/{s.group}/{s.index}/{s.key}" for s in ma.optim]
    names += [f"extra/{s.name}" for s in ma.extra_tensors] + ["runtime"]
    sa, sb = a.tensor_sizes(), b.tensor_sizes()
    if sa != sb:
        out.append(f"element sizes differ (runtime record {sa[-1]} vs {sb[-1]} bytes)")
        return out
    off = 0
    for name, size in zip(names, sa, strict=True):
        if a.read(off, size) != b.read(off, size):
            out.append(f"{name} differs")
        off += size
    return out


def state_equal(a: TrainingState, b: TrainingState) -> bool:
    """Whether two states are bitwise equal: layout, every tensor byte, optimizer values,
    hyperparameters, step, epoch and RNG states."""
    return not state_diff(a, b)
