"""Every versioned format of :data:`chaos.wire.FORMATS` has fuzz tests here.

Adding a format to ``FORMATS`` without adding its fuzz tests to :data:`FUZZED` fails
:func:`test_every_format_is_fuzzed`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import test_fuzz_ckpt_store as ckpt
import test_fuzz_codec as codec
import test_fuzz_frames as frames
import test_fuzz_lanes as lanes
import test_fuzz_replication_wire as repl
import test_fuzz_state as state

from chaos.wire import FORMATS

FUZZED: dict[str, list[Callable[..., Any]]] = {
    "control-plane messages": [
        codec.test_random_bytes,
        codec.test_random_msgpack,
        codec.test_byte_mutations_of_every_type,
        codec.test_field_mutations_of_every_type,
        codec.test_deep_nesting,
        codec.test_huge_integers,
    ],
    "shard requests and replies": [
        repl.test_random_bytes,
        repl.test_random_msgpack,
        repl.test_byte_mutations,
        repl.test_field_mutations,
        repl.test_deep_nesting,
        repl.test_huge_integers,
    ],
    "training-state stream and manifest": [
        state.test_manifest_random_bytes,
        state.test_manifest_byte_mutations,
        state.test_manifest_field_mutations,
        state.test_runtime_byte_mutations,
        state.test_runtime_field_mutations,
    ],
    "allreduce frames": [frames.test_random_bytes, frames.test_mutations, frames.test_every_field],
    "payload-lane hello and offer": [
        lanes.test_offer_random_bytes,
        lanes.test_hello_mutations,
        lanes.test_hello_random_bytes,
        lanes.test_frame_mutations,
        lanes.test_sealed_offer_random_bytes,
        lanes.test_sealed_hello_mutations,
        lanes.test_sealed_frame_mutations,
    ],
    "checkpoint store": [ckpt.test_random_bytes, ckpt.test_mutations, ckpt.test_header_fields],
}
"""Format name (as in ``FORMATS``) to the fuzz tests of its decoder."""


def test_every_format_is_fuzzed() -> None:
    names = {f.name for f in FORMATS}
    assert names - FUZZED.keys() == set(), "formats without fuzz tests: add them to FUZZED"
    assert FUZZED.keys() - names == set(), "FUZZED names formats that FORMATS does not list"
    assert all(FUZZED.values())


def test_every_check_exists() -> None:
    """The check each format names is the function these tests fuzz; it must exist."""
    for fmt in FORMATS:
        module, _, rest = fmt.check.rpartition(".")
        obj: Any = None
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError:  # a method: module.Class.method
            module, _, cls = module.rpartition(".")
            obj = getattr(importlib.import_module(module), cls)
        assert callable(getattr(obj, rest)), fmt.check
