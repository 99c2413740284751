"""A join is not stuck with one contact.

A joiner given several contacts (``--join A,B``) moves on from one that stays silent; a contact
that cannot admit it (paused, cut off from the scheduler) answers with the members it knows
(``Refusal.members``), which the joiner tries next. Real daemons on loopback; the faults are
the daemons' named ones. No timing is asserted. Also the pieces: the endpoints' parsing and
checks, and the refusal field's validation.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from chaos.daemon.client import DaemonClient
from chaos.daemon.config import DaemonConfig, load_config, parse_join_endpoints

from chaos.errors import ConfigError
from chaos.launch import free_port
from chaos.protocol import Reason, Refusal, codec
from chaos.protocol.messages import MAX_JOIN_CONTACTS
from tests.daemon.daemon_helpers import Cluster, Node, wait_until

LISTEN = "tcp://127.0.0.1:5000"


def _dead_endpoint() -> str:
    """An endpoint where nothing listens."""
    return f"tcp://127.0.0.1:{free_port()}"


def _names(node: Node) -> list[str]:
    return [e["event"] for e in node.events()]


def test_a_joiner_moves_on_from_a_silent_contact(cluster: Cluster) -> None:
    n1, n2 = cluster.start(2)
    dead = _dead_endpoint()
    j = cluster.spawn("j", extra=("--join", f"{dead},{n2.address}"), neighbors=("n2",))
    wait_until(lambda: "j" in cluster.members(n1), "j admitted")
    tried = [e for e in j.events() if e["event"] == "join_contact"]
    assert tried and tried[0]["contact"] == n2.address and tried[0]["why"] == "silent"
    started = next(e for e in j.events() if e["event"] == "started")
    assert started["join"] == f"{dead},{n2.address}"


def _isolate(side: Node, others: list[Node]) -> None:
    """Cuts ``side`` off from ``others`` (both directions), while anyone else reaches both."""
    with DaemonClient(side.ipc, timeout_s=5.0) as c:
        c.fault("cut_link", [n.id for n in others])
    for n in others:
        with DaemonClient(n.ipc, timeout_s=5.0) as c:
            c.fault("cut_link", [side.id])


def test_a_paused_contact_names_the_members_the_joiner_then_tries(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.start(3)
    _isolate(n3, [n1, n2])
    wait_until(lambda: n3.status().paused or n3.status().scheduler is None, "n3 pauses")
    wait_until(lambda: cluster.members(n1) == {"n1", "n2"}, "the majority goes on")
    j = cluster.spawn("j", join=n3)  # its one contact is paused; no neighbours named
    wait_until(lambda: "j" in cluster.members(n1), "j admitted by the majority")
    learned = [e for e in j.events() if e["event"] == "join_contacts_learned"]
    assert learned and set(learned[0]["contacts"]) >= {n1.address, n2.address}
    assert learned[0]["peer"] == "n3"
    switched = [e for e in j.events() if e["event"] == "join_contact"]
    assert switched and switched[0]["why"].split()[0] in ("paused", "not_scheduler")
    assert "join_failed" not in _names(j)


def test_a_single_unanswered_contact_still_times_out(cluster: Cluster) -> None:
    cluster.config.write_text(cluster.config.read_text() + "join_timeout_s = 1.5\n")
    j = cluster.spawn("j", extra=("--join", _dead_endpoint()), wait=False)
    assert j.proc.wait(timeout=60) == 4
    assert "join_contact" not in _names(j)  # one contact: nothing to move on to
    assert "join_failed" in _names(j)


def test_a_joiner_waits_for_a_wanted_neighbour_that_is_not_a_member_yet(
    cluster: Cluster,
) -> None:
    """The neighbour asked for joins a moment later (it was cut off, or is joining again): the
    joiner is admitted then, with that link (a campaign joiner exited at once instead)."""
    n1, n2 = cluster.start(2)
    j = cluster.spawn("j", join=n2, neighbors=("n3",), wait=False)
    wait_until(lambda: "join_neighbors_unknown" in _names(j), "j refused for want of n3")
    assert j.proc.poll() is None  # still joining
    cluster.spawn("n3", join=n1, neighbors=("n1",))
    wait_until(lambda: "j" in cluster.members(n1), "j admitted once n3 is a member")
    assert j.proc.poll() is None


def test_a_wanted_neighbour_that_never_comes_fails_the_join_at_its_timeout(
    cluster: Cluster,
) -> None:
    n1, _n2 = cluster.start(2)
    j = cluster.spawn("j", join=n1, neighbors=("ghost",), extra=("--join-timeout", "3"),
                      wait=False)  # fmt: skip
    assert j.proc.wait(timeout=60) == 4  # the join timeout, not a refusal at once (3)
    failed = next(e for e in j.events() if e["event"] == "join_failed")
    assert "ghost" in (failed.get("detail") or "")


def test_the_join_timeout_flag_overrides_the_config_file(cluster: Cluster) -> None:
    cluster.config.write_text(cluster.config.read_text() + "join_timeout_s = 600.0\n")
    j = cluster.spawn("j", extra=("--join", _dead_endpoint(), "--join-timeout", "1.5"),
                      wait=False)  # fmt: skip
    assert j.proc.wait(timeout=60) == 4
    assert "join_failed" in _names(j)


# -------------------------------------------------------------------- the endpoints


def test_join_endpoints_parse_from_commas_repeats_and_toml(tmp_path: Path) -> None:
    a, b, c = (f"tcp://127.0.0.1:{p}" for p in (7001, 7002, 7003))
    assert parse_join_endpoints(None) == ()
    assert parse_join_endpoints(f"{a}, {b},") == (a, b)
    assert parse_join_endpoints((f"{a},{b}", c)) == (a, b, c)
    toml = tmp_path / "d.toml"
    toml.write_text(f'join = ["{a}", "{b},{c}"]\n')
    cfg = load_config({"node_id": "x", "listen": LISTEN}, toml)
    assert cfg.join == (a, b, c)
    toml.write_text(f'join = "{a}"\n')
    assert load_config({"node_id": "x", "listen": LISTEN}, toml).join == (a,)
    cli = load_config({"node_id": "x", "listen": LISTEN, "join": (b,)}, toml)
    assert cli.join == (b,)  # the command line over the file


@pytest.mark.parametrize(
    "join",
    [
        "tcp://127.0.0.1:7001",  # a string, not a tuple
        ("tcp://127.0.0.1:7001", "tcp://127.0.0.1:7001"),
        ("tcp://127.0.0.1:7001", LISTEN),
        ("tcp://127.0.0.1:7001", "udp://x:1"),
    ],
)
def test_bad_join_endpoints_are_refused(join: object) -> None:
    with pytest.raises(ConfigError):
        DaemonConfig(node_id="x", listen=LISTEN, join=join)  # type: ignore[arg-type]


def test_join_endpoints_must_be_strings() -> None:
    with pytest.raises(ConfigError, match="strings"):
        parse_join_endpoints(["tcp://127.0.0.1:7001", 7002])  # type: ignore[list-item]


# -------------------------------------------------------------------- the refusal's field

CTX = codec.ValidationContext(
    max_frame_bytes=1 << 20,
    epoch=0,
    term=0,
    members=frozenset(),
    is_scheduler=False,
    paused=False,
    joining=True,
)


def _refusal(**fields: object) -> bytes:
    base = Refusal(sender="n3", reason=Reason.PAUSED, ref_type="join_request")
    return codec.encode(msgspec.structs.replace(base, **fields))


def test_a_join_refusal_carries_members() -> None:
    members = ["tcp://10.255.0.1:7000", "tcp://10.255.0.2:7000"]
    got = codec.validate(_refusal(members=members), CTX)
    assert isinstance(got, Refusal) and got.members == members
    plain = codec.validate(_refusal(), CTX)
    assert isinstance(plain, Refusal) and plain.members == []


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"members": ["tcp://a:1", "tcp://a:1"]}, Reason.BAD_REQUEST),
        ({"members": ["tcp://a:1"], "ref_type": "ping"}, Reason.BAD_REQUEST),
        ({"members": ["udp://a:1"]}, Reason.MALFORMED),
        ({"members": [f"tcp://a:{i}" for i in range(MAX_JOIN_CONTACTS + 1)]}, Reason.MALFORMED),
    ],
)
def test_bad_members_are_refused(fields: dict[str, object], reason: Reason) -> None:
    frame = msgspec.msgpack.encode({**msgspec.msgpack.decode(_refusal()), **fields})
    got = codec.validate(frame, CTX)
    assert isinstance(got, codec.Rejected) and got.refusal.reason == reason
