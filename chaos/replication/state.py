"""The training state as one canonical, ordered byte stream (docs/state.md).

The stream is the concatenation, in this order, of:

1. the model's parameters and buffers, in ``model.state_dict()`` order;
2. the optimizer's tensor state, in param-group order, then parameter order within a group, then
   the state keys sorted by name (``exp_avg``, ``exp_avg_sq``, ``step`` for Adam);
3. the tensors of the extra state objects (``extra``: LR schedulers, a ``GradScaler``, an EMA
   model, anything with ``state_dict()``/``load_state_dict()``), object by object, each
   ``state_dict()``'s tensors in the order it lists them (:mod:`chaos.replication.extra`);
4. one runtime record: a msgpack-encoded :class:`RuntimeInfo` (step, epoch, user
   hyperparameters, the torch CPU, Python ``random`` and numpy RNG states), no pickle
   (:mod:`chaos.replication.runtime`).

Everything the stream does not carry travels in the :class:`Manifest` (the header,
:mod:`chaos.replication.manifest`): the layout of every tensor (name, dtype, shape), the
optimizer class, every param group's hyperparameters, the optimizer's non-tensor per-parameter
values (``None`` momentum buffers, int steps), every extra object's ``state_dict()`` with its
tensors replaced by their place in the stream, and the length of the runtime record. A joiner
gets the manifest first and allocates everything from it, so an optimizer without state (Adam
before its first step) can receive a donor's state.

A donor's :class:`TrainingState` reads zero-copy views of its live CPU tensors; a joiner's
writes straight into its own model's CPU tensors and into freshly allocated optimizer tensors,
and :meth:`TrainingState.apply` then installs the optimizer state, the hyperparameters and the
RNG states. The joiner's CPU model is overwritten as shards arrive: it must not train until
``apply`` succeeded.

Tensors on an accelerator (a CUDA model and its optimizer) go through host buffers
(:mod:`chaos.replication.staging`): a donor copies them to host memory when the state is first
read, a joiner receives into host buffers and ``apply`` copies them to the device. The bytes on
the wire are the same either way, so CPU and GPU members can serve each other.

Only dense (strided) tensors are supported, and CPU tensors must be contiguous; anything else
is refused with a clear error.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch

from chaos.errors import StateLayoutError
from chaos.replication.extra import (
    ExtraState,
    decode_extra,
    encode_extra,
    extra_digest,
    extra_tensor_count,
)
from chaos.replication.manifest import (
    DTYPES,
    ENCODER,
    UNREADABLE,
    ExtraEntry,
    Manifest,
    OptimTensorSpec,
    OptimValue,
    TensorSpec,
    chunk_address,
    chunk_ranges,
    decode_manifest,
    dtype_name,
    layout_fingerprint,
    tensor_spec,
)
from chaos.replication.runtime import (
    RUNTIME_DECODER,
    RuntimeInfo,
    capture_runtime,
    check_plain,
    restore_rng,
    to_tuples,
)
from chaos.replication.staging import HostStaging
from chaos.wire import STATE_FORMAT_VERSION

PARALLEL_HASH_BYTES = 16 << 20
"""A state at least this large is hashed (its chunk addresses) on several threads."""
HASH_THREADS = 4

__all__ = [
    "STATE_FORMAT_VERSION",
    "ExtraEntry",
    "ExtraState",
    "Manifest",
    "OptimTensorSpec",
    "OptimValue",
    "RuntimeInfo",
    "TensorSpec",
    "TrainingState",
    "capture_runtime",
    "decode_manifest",
    "extra_digest",
    "extra_tensor_count",
    "layout_fingerprint",
    "restore_rng",
    "state_diff",
    "state_digest",
    "state_equal",
]


def _optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _param_specs(optimizer: torch.optim.Optimizer) -> list[list[TensorSpec]]:
    out: list[list[TensorSpec]] = []
    for g, group in enumerate(optimizer.param_groups):
        out.append([tensor_spec("", p) for p in group["params"]])
        for i, p in enumerate(group["params"]):
            dtype_name(p, f"param_groups[{g}]['params'][{i}]")
    return out


def _group_hypers(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    out = []
    for g, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        check_plain(hyper, f"optimizer.param_groups[{g}]")
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
                        name = dtype_name(v, where)
                        optim_specs.append(OptimTensorSpec(g, i, key, name, list(v.shape)))
                        optim_tensors.append(v)
                    else:
                        check_plain(v, where)
                        values.append(OptimValue(g, i, key, v))
        entries, extra_specs, extra_tensors = encode_extra(extra)
        blob = ENCODER.encode(runtime)
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
        self._donor = True
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
        *,
        reuse: bool = True,
    ) -> TrainingState:
        """A joiner's receiving state, laid out as the donor's ``manifest`` says.

        Model shards are written straight into ``model``'s CPU tensors; optimizer and extra
        state tensors are allocated here (the optimizer may have no state yet) and installed by
        :meth:`apply`.

        With ``reuse``, every chunk whose bytes the joiner already holds (its model as it is,
        a base model loaded from disk, a returning device's optimizer and extra state) counts as
        received: :meth:`missing` lists only the chunks whose content addresses differ, and
        :attr:`reused_bytes` says how much was kept.

        Args:
            model: The joiner's model.
            optimizer: Its optimizer.
            manifest: The donor's manifest (bytes as received, or decoded).
            extra: The joiner's extra state objects (the same names as the donor's).
            reuse: Keep the chunks the joiner already holds (hashing its own state once).

        Raises:
            StateLayoutError: the manifest is malformed, or its layout differs from this
                model and optimizer (names, shapes, dtypes, param groups, optimizer class), or
                it names other extra state objects than ``extra``.
        """
        # a decoded Manifest is checked as the bytes would be: a joiner trusts no manifest
        m = decode_manifest(
            ENCODER.encode(manifest) if isinstance(manifest, Manifest) else manifest
        )
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
        optim_tensors = [torch.zeros(s.shape, dtype=DTYPES[s.dtype]) for s in m.optim]
        self = cls.__new__(cls)
        self._extra = dict(extra or {})
        self._extra_tensors = [torch.zeros(s.shape, dtype=DTYPES[s.dtype])
                               for s in m.extra_tensors]  # fmt: skip
        self._setup(model, optimizer, m, model_tensors, optim_tensors, bytearray(m.runtime_bytes))
        self._donor = False
        self._runtime = None
        self._written = []
        if reuse:
            self._reuse_held(optimizer)
        return self

    def _reuse_held(self, optimizer: torch.optim.Optimizer) -> None:
        """Marks as received every chunk whose bytes this joiner already holds."""
        m = self._manifest
        groups = optimizer.param_groups
        with torch.no_grad():
            for spec, t in zip(m.optim, self._optim_tensors, strict=True):
                own = optimizer.state.get(groups[spec.group]["params"][spec.index], {})
                _copy_if_alike(t, own.get(spec.key))
            try:
                _, specs, tensors = encode_extra(self._extra)
            except TypeError:  # its own state cannot travel: nothing of it to reuse
                specs, tensors = [], []
            own_extra = {s.name: t for s, t in zip(specs, tensors, strict=True)}
            for extra_spec, t in zip(m.extra_tensors, self._extra_tensors, strict=True):
                _copy_if_alike(t, own_extra.get(extra_spec.name))
        self._staging.to_host()  # a model on a device: its values into the host buffers
        ranges = chunk_ranges(self._sizes, m.chunk_bytes)
        for (off, length), mine, theirs in zip(
            ranges, self.chunk_addresses(), m.chunks, strict=True
        ):
            if mine == theirs:
                self._written.append((off, length))
                self.reused_bytes += length

    # -- construction helpers

    @staticmethod
    def _model_part(model: torch.nn.Module) -> tuple[list[TensorSpec], list[torch.Tensor]]:
        specs: list[TensorSpec] = []
        tensors: list[torch.Tensor] = []
        for name, t in model.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"model state {name!r} is a {type(t).__name__}, not a tensor")
            specs.append(tensor_spec(name, t))
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
        self._staging = HostStaging(tensors, names)
        self._blob = blob
        self._view_cache: list[memoryview] | None = None
        self._sizes = [t.numel() * t.element_size() for t in tensors] + [len(blob)]
        self._starts = [0]
        for size in self._sizes[:-1]:
            self._starts.append(self._starts[-1] + size)
        total = sum(self._sizes)
        if manifest.total_bytes not in (0, total):
            raise StateLayoutError(f"manifest says {manifest.total_bytes} bytes, layout {total}")
        if manifest.total_bytes == 0:
            manifest = msgspec.structs.replace(manifest, total_bytes=total)
        self._manifest = manifest
        self._manifest_bytes: bytes | None = None
        self._addressed = bool(manifest.chunks)  # a donor's chunk addresses come when asked
        self.reused_bytes = 0
        self._total = total

    # -- layout

    @property
    def manifest(self) -> Manifest:
        """The stream's header (send it to a joiner before any shard). A donor's chunk
        addresses are computed on first use (it reads the whole state once)."""
        if not self._addressed:
            self._manifest = msgspec.structs.replace(self._manifest, chunks=self.chunk_addresses())
            self._addressed = True
        return self._manifest

    @property
    def manifest_bytes(self) -> bytes:
        """The encoded manifest, as it travels on the wire."""
        if self._manifest_bytes is None:
            self._manifest_bytes = ENCODER.encode(self.manifest)
        return self._manifest_bytes

    def chunk_addresses(self) -> list[bytes]:
        """The content address of every chunk of the stream as its bytes are now
        (:func:`~chaos.replication.manifest.chunk_ranges`)."""
        views = [
            self.read(off, n) for off, n in chunk_ranges(self._sizes, self._manifest.chunk_bytes)
        ]
        workers = min(HASH_THREADS, os.cpu_count() or 1)
        if self._total < PARALLEL_HASH_BYTES or workers < 2:
            return [chunk_address(v) for v in views]
        with ThreadPoolExecutor(max_workers=workers) as pool:  # hashlib lets go of the GIL
            return list(pool.map(chunk_address, views))

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

    def freeze(self) -> None:
        """Copies a donor's stream into memory of its own (its chunk addresses first): from
        then on it no longer reads the live tensors, so the donor may step on while a joiner
        pulls it (a catch-up join's snapshot). Costs one copy of the state."""
        _ = self.manifest
        self._view_cache = [memoryview(bytearray(v)) for v in self._views]

    # -- stream access

    @property
    def _views(self) -> list[memoryview]:
        """A byte view per stream element, the runtime record last. Made on first use: a
        donor's tensors on an accelerator are copied to host memory then, once."""
        if self._view_cache is None:
            if self._donor:
                self._staging.to_host()
            self._view_cache = [*self._staging.views(), memoryview(self._blob)]
        return self._view_cache

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

        The model's CPU tensors already hold the received bytes; tensors on an accelerator get
        them from their host buffers here, and the optimizer's tensors go beside their
        parameters (torch's rule: a non-capturable ``step`` stays on the CPU). Everything is
        decoded and checked before anything is changed, so a refused stream leaves the
        optimizer and RNGs untouched (an extra object whose ``load_state_dict`` refuses its
        state leaves the objects before it loaded).

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
            runtime = RUNTIME_DECODER.decode(self._views[-1])
        except UNREADABLE as exc:
            raise StateLayoutError(f"malformed runtime record: {exc}") from exc
        states = [(e.name, decode_extra(e.state, self._extra_tensors, e.name))
                  for e in self._manifest.extra]  # fmt: skip
        self._staging.to_device()  # a model on an accelerator gets the received bytes now
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
            param = groups[spec.group]["params"][spec.index]
            hyper = self._manifest.param_groups[spec.group]
            opt.state[param][spec.key] = tensor.to(_optim_device(spec.key, param, hyper))
        for val in self._manifest.optim_values:
            opt.state[groups[val.group]["params"][val.index]][val.key] = to_tuples(val.value)
        for group, hyper in zip(groups, self._manifest.param_groups, strict=True):
            for key, value in hyper.items():
                group[key] = to_tuples(value)
        self._runtime = runtime
        return runtime


def _copy_if_alike(dst: torch.Tensor, src: object) -> None:
    """Copies ``src`` into ``dst`` when it is a tensor of the same dtype and shape."""
    if isinstance(src, torch.Tensor) and src.dtype == dst.dtype and src.shape == dst.shape:
        dst.copy_(src.detach())


def _optim_device(key: str, param: torch.Tensor, hyper: dict[str, Any]) -> torch.device:
    """Where a received optimizer tensor goes: beside its parameter, except the ``step``
    counter of a non-capturable, non-fused optimizer, which torch keeps on the CPU (the rule of
    ``torch.optim.Optimizer.load_state_dict``)."""
    if key == "step" and not (hyper.get("capturable") or hyper.get("fused")):
        return torch.device("cpu")
    return param.device


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
