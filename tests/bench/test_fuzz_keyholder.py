"""``chaos-bench fuzz --key-holder`` against a real keyed cluster: a key holder that never joined
forges scheduler, command, vote, counter and refusal messages; no daemon may follow it, no
member's key or address may change, and the cluster must keep (or regain) a scheduler."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from chaos.bench.cli import main
from chaos.bench.fuzz_keyholder import ALL_KINDS, ATTACKS, KeyHolderConfig
from chaos.bench.fuzz_keyholder_trainer import TRAINER_ATTACK
from chaos.errors import ConfigError

_ATTACK_KEYS = {
    "frames_sent", "rounds", "frames_by_type", "send_timeouts", "refusals", "replies",
    "accepted", "accepted_by", "wedged", "recovered_after_s", "events", "scene", "before",
    "after", "damaged", "cluster",
}  # fmt: skip
_BY_KEYS = {
    "followed_forger", "scheduler_or_term_changed", "bindings_changed", "members_changed",
    "not_answering", "exited",
}  # fmt: skip


def test_a_key_holder_is_refused_everything(tmp_path: Path) -> None:
    out = tmp_path / "keyholder.json"
    args = ["fuzz", "--key-holder", "--daemons", "3", "--attack-s", "1.5", "--json", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["mode"] == "key_holder" and data["daemons"] == 3
    assert data["reaped"] is True
    assert set(data["attacks"]) == set(ALL_KINDS)
    assert data["clusters_started"] >= 1
    # the status the bench recorded at the start: a scheduler, and every member bound to a key
    first = data["clusters"][0]["status"]
    assert set(first) == {"n1", "n2", "n3"}
    for seen in first.values():
        assert seen["answered"] and seen["scheduler"] in first
        assert all(len(m["public_key"]) == 40 for m in seen["members"].values())
    for name, rec in data["attacks"].items():
        assert _ATTACK_KEYS <= rec.keys(), name
        assert rec["frames_sent"] > 0 and rec["rounds"] > 0, name
        assert sum(rec["frames_by_type"].values()) == rec["frames_sent"], name
    for name in ATTACKS:
        rec = data["attacks"][name]
        assert _BY_KEYS == set(rec["accepted_by"]), name
        assert rec["scene"]["attacker_key"] not in {
            m["public_key"] for m in first["n1"]["members"].values()
        }  # a fresh keypair: a key holder that never joined
    # the trainer's attacker held the key: both its connections completed the CURVE handshake
    trainer = data["attacks"][TRAINER_ATTACK]
    assert trainer["scene"]["handshakes"] == 2
    assert trainer["trainer"]["rounds_during_attack"] > 0
    pid = trainer["trainer"]["pid"]  # reaped too
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    # forged senders bound to another key are refused as such, counters past the bound as such
    assert data["attacks"]["vote_forgery"]["refusals"].get("not_authenticated", 0) > 0
    assert data["attacks"]["boundary_counters"]["refusals"].get("bad_request", 0) > 0
    assert data["attacks"]["boundary_counters"]["refusals"].get("malformed", 0) > 0
    assert data["attacks"]["scheduler_member"]["refusals"].get("not_authenticated", 0) > 0
    assert data["control"]["frames_sent"] == 0
    assert data["control_clean"], data["control"]["accepted_by"]
    accepted = {k: r["accepted_by"] for k, r in data["attacks"].items() if r["accepted"]}
    assert data["accepted"] == 0, accepted
    assert data["wedged"] == 0, [k for k, r in data["attacks"].items() if r["wedged"]]
    for cluster in data["clusters"]:
        assert cluster["rss"]["before_bytes"] and cluster["rss"]["after_bytes"]
        assert set(cluster["pids"]) == {"n1", "n2", "n3"}
        for pid in cluster["pids"].values():  # every daemon it started is reaped
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    assert "accepted:" in res.output and "scheduler_ghost" in res.output


def test_frames_are_still_required_without_key_holder(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["fuzz", "--json", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and "--frames" in res.output


@pytest.mark.parametrize(
    "kwargs",
    [{"daemons": 2}, {"daemons": 8}, {"attack_s": 0.1}, {"round_s": 0.0},
     {"recover_timeout_s": 0.0}, {"attacks": ("nope",)}],
)  # fmt: skip
def test_bad_settings_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        KeyHolderConfig(**kwargs)  # type: ignore[arg-type]
