"""The wire registry (:mod:`chaos.wire`) tells the truth about every format it lists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from chaos import wire

ROOT = Path(__file__).resolve().parents[1]


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise LookupError(dotted)


@pytest.mark.parametrize("fmt", wire.FORMATS, ids=lambda f: f.name)
def test_each_format_names_its_module_and_its_one_check(fmt: wire.WireFormat) -> None:
    module = importlib.import_module(fmt.module)
    assert callable(_resolve(fmt.check))
    assert fmt.check.startswith(fmt.module + ".")
    # the module speaks the registry's version: no second constant of its own
    source = Path(module.__file__ or "").read_text()
    assert not re.search(r"^[A-Z_]*VERSION\s*=\s*\d", source, re.M), fmt.module
    assert fmt.encoding in ("msgpack", "struct")
    assert (fmt.encoding == "struct") == bool(fmt.layouts)


def test_every_fixed_layout_is_little_endian() -> None:
    layouts = [layout for fmt in wire.FORMATS for layout in fmt.layouts]
    assert layouts and all(layout.format.startswith(wire.BYTE_ORDER) for layout in layouts)
    assert wire.BYTE_ORDER == "<"


def test_no_version_constant_or_struct_layout_is_defined_outside_the_registry() -> None:
    offenders = []
    for top in ("chaos", "daemon", "scheduling", "native"):
        for path in (ROOT / top).rglob("*.py"):
            if path == ROOT / "chaos" / "wire.py":
                continue
            text = path.read_text()
            if re.search(r"^[A-Z_]*VERSION\s*=\s*\d", text, re.M):
                offenders.append(f"{path.relative_to(ROOT)}: a version constant")
            for m in re.finditer(r"struct\.Struct\(\s*[\"']([<>!=@]?)", text):
                offenders.append(f"{path.relative_to(ROOT)}: a struct layout {m.group(0)!r}")
    assert not offenders, offenders


def test_the_versions_the_modules_use_are_the_registry_s() -> None:
    from chaos.collectives import frames, lanes
    from chaos.emulate import ckpt_store
    from chaos.protocol import messages
    from chaos.replication import state
    from chaos.replication import wire as replication_wire

    assert frames.FRAME_VERSION is wire.FRAME_VERSION and frames._HEADER is wire.FRAME_HEADER
    assert lanes.LANE_VERSION is wire.LANE_VERSION
    assert ckpt_store.VERSION is wire.CHECKPOINT_VERSION
    assert messages.PROTOCOL_VERSION is wire.PROTOCOL_VERSION
    assert state.STATE_FORMAT_VERSION is wire.STATE_FORMAT_VERSION
    assert replication_wire.REPLICATION_VERSION is wire.REPLICATION_VERSION


def test_one_refusal_schema_serves_the_control_plane_and_the_shard_server() -> None:
    from chaos.protocol import Reason, Refusal
    from chaos.replication.wire import REPLY_DECODER, WIRE_ENCODER, refusal

    r = refusal(7, Reason.NOT_PUBLISHED, "nothing yet")
    assert type(r) is Refusal and r.v == wire.REPLICATION_VERSION
    back = REPLY_DECODER.decode(WIRE_ENCODER.encode(r))
    assert back == r and back.reason is Reason.NOT_PUBLISHED and back.req_id == 7
