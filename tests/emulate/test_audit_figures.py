"""The campaign's audit figure: the trainers' own state audit, from the devices' step records."""

from __future__ import annotations

from typing import Any

from chaos.emulate.campaign_metrics import audit_figures


def _step(step: int, audits: int, mismatches: int, healed: int, agreed: bool) -> dict[str, Any]:
    return {"kind": "step", "step": step, "digest": "d", "audit": {
        "every": 5, "last": step, "agreed": agreed, "audits": audits,
        "mismatches": mismatches, "healed": healed}}  # fmt: skip


def test_figures_come_from_each_devices_last_audit() -> None:
    devices = {
        "a": [_step(5, 1, 0, 0, True), _step(10, 2, 1, 0, False), _step(15, 3, 1, 0, True)],
        "b": [_step(10, 2, 1, 1, False), _step(15, 3, 1, 1, True)],
        "c": [_step(5, 1, 0, 0, True), _step(10, 2, 1, 0, False)],  # left after a mismatch
        "d": [{"kind": "step", "step": 3, "digest": "d"}],  # an older trainer: no audit record
    }
    got = audit_figures(devices)
    assert got == {"devices": 3, "audits": 3, "mismatches": 1, "healed": 1,
                   "disagreed_last": ["c"]}  # fmt: skip


def test_no_audit_records() -> None:
    assert audit_figures({"a": []}) == {"devices": 0, "audits": 0, "mismatches": 0, "healed": 0,
                                        "disagreed_last": []}  # fmt: skip
