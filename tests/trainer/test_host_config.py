"""The data plane's host: derived from ``listen`` in one place (:func:`resolve_host`), a
loopback host refused where peers are on a network (trainer and scheduler side), and the join
retries that end, naming the address, when the same donor addresses refuse every attempt."""

from __future__ import annotations

import math

import pytest
from chaos.daemon.scheduler.registry import loopback_advertised

from chaos.errors import ConfigError, ReplicationError
from chaos.trainer.config import TrainerConfig, resolve_host
from chaos.trainer.join_retry import DonorAddressUnreachable, UnreachableWatch, join_until

NET = "tcp://10.1.2.3:27000"
LOOP = "tcp://127.0.0.1:27000"


def test_the_host_is_taken_from_listen_and_defaults_to_loopback() -> None:
    assert TrainerConfig().host is None
    assert resolve_host(TrainerConfig(), NET, "tcp://10.1.2.4:27000").data_host == "10.1.2.3"
    assert resolve_host(TrainerConfig(), None, None).data_host == "127.0.0.1"
    assert resolve_host(TrainerConfig(), LOOP, "tcp://127.0.0.1:27001").data_host == "127.0.0.1"
    given = TrainerConfig(host="10.9.9.9")
    assert resolve_host(given, NET, None) is given  # a host the script set stays
    with pytest.raises(ConfigError, match="resolve_host"):
        _ = TrainerConfig().data_host


@pytest.mark.parametrize(
    ("host", "listen", "join", "match"),
    [
        ("127.0.0.1", NET, None, "loopback 127.0.0.1 while listen="),
        (None, None, "tcp://10.1.2.4:27000", "loopback 127.0.0.1 while join="),
        ("localhost", LOOP, "tcp://peer.example:27000", "while join="),
        (None, "tcp://0.0.0.0:27000", None, "every interface"),
        ("0.0.0.0", None, None, "wildcard"),
        ("", None, None, "host must be"),
    ],
)
def test_a_host_the_peers_cannot_reach_is_refused(
    host: str | None, listen: str | None, join: str | None, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve_host(TrainerConfig(host=host), listen, join)


def _refused(*addresses: str) -> ReplicationError:
    return ReplicationError("no donor left", {"a": "unreachable"}, unreachable=addresses)


def test_the_same_unreachable_addresses_end_the_retries_naming_them() -> None:
    w = UnreachableWatch(limit=3, span_s=10.0)
    w.failed(_refused("tcp://127.0.0.1:4000"), 0.0)
    w.failed(_refused("tcp://127.0.0.1:4000"), 4.0)
    w.failed(_refused("tcp://127.0.0.1:4000"), 8.0)  # three in a row, but within 10 s
    with pytest.raises(DonorAddressUnreachable) as err:
        w.failed(_refused("tcp://127.0.0.1:4000"), 12.0)
    msg = str(err.value)
    assert "tcp://127.0.0.1:4000" in msg and "loopback" in msg and "host=" in msg
    assert err.value.unreachable == ("tcp://127.0.0.1:4000",)


def test_other_addresses_other_errors_or_a_success_start_the_count_again() -> None:
    w = UnreachableWatch(limit=2, span_s=0.0)
    w.failed(_refused("tcp://10.0.0.1:4000"), 0.0)
    w.failed(_refused("tcp://10.0.0.2:4000"), 1.0)  # another donor: the plan moved on
    w.failed(ReplicationError("a shard failed its checksum"), 2.0)
    w.failed(_refused("tcp://10.0.0.2:4000"), 3.0)
    w.reset()
    w.failed(_refused("tcp://10.0.0.2:4000"), 4.0)
    with pytest.raises(DonorAddressUnreachable, match="no shard server listens there"):
        w.failed(_refused("tcp://10.0.0.2:4000"), 5.0)


def test_join_until_stops_retrying_an_address_that_always_refuses() -> None:
    tries: list[int] = []
    events: list[str] = []

    def attempt() -> None:
        tries.append(1)
        raise _refused("tcp://127.0.0.1:4000")

    with pytest.raises(DonorAddressUnreachable):
        join_until(attempt, math.inf, "b", lambda kind, **_: events.append(kind),
                   UnreachableWatch(limit=2, span_s=0.0))  # fmt: skip
    assert len(tries) == 2 and events == ["join_again_failed"]


def test_the_scheduler_refuses_loopback_data_addresses_among_networked_members() -> None:
    data = ("tcp://127.0.0.1:4000", "tcp://127.0.0.1:4001")
    why = loopback_advertised("b", data, {"a": NET, "b": "tcp://10.1.2.4:27000"})
    assert why is not None and "127.0.0.1:4000" in why and "host" in why
    assert loopback_advertised("a", data, {"a": LOOP, "b": "tcp://127.0.0.1:27001"}) is None
    assert loopback_advertised("a", ("tcp://10.1.2.3:4000",), {"a": NET}) is None
    assert loopback_advertised("a", data, {"a": "tcp://0.0.0.0:27000"}) is None
