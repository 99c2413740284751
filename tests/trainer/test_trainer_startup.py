"""A ``Trainer`` that cannot start raises a clear error and leaves nothing behind: no embedded
daemon process, no open data-plane sockets."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

from chaos.errors import ChaosError, ConfigError
from chaos.launch import free_tcp_address
from chaos.trainer import Trainer


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _listening_ports() -> set[int]:
    conns = psutil.Process(os.getpid()).net_connections(kind="tcp")
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


def test_an_unknown_option_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown Trainer option"):
        Trainer(*_model(), daemon="ipc:///nonexistent", no_such_option=1)


def test_a_join_that_cannot_complete_stops_the_embedded_daemon(tmp_path: Path) -> None:
    """Nobody listens at the join address: the embedded daemon never becomes a member. The
    constructor raises, and the daemon it started is gone."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ChaosError):
        Trainer(*_model(), join=free_tcp_address(), node_id="lonely",
                join_timeout_s=3.0, daemon_dir=str(tmp_path))  # fmt: skip
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    alive = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], [p.cmdline() for p in alive]


def test_the_embedded_daemon_tries_its_contacts_as_long_as_the_trainer_waits() -> None:
    """Its own join timeout (30 s by default) gave a join up while the trainer still waited (a
    soak's joiner exited after 30 s against contacts cut off for a while). The flag itself:
    ``tests/daemon/test_join_contacts.py``."""

    from chaos.daemon.cli import start

    from chaos.trainer.config import TrainerConfig
    from chaos.trainer.wiring import embedded_args

    for extra, expected in (((), 300.0), (("--join-timeout", "7"), 7.0)):
        args = embedded_args(TrainerConfig(join_timeout_s=300.0, daemon_args=extra))
        ctx = start.make_context("start", ["--id", "n", *args])  # parsed as the daemon would
        assert ctx.params["join_timeout"] == expected


def test_a_daemon_that_does_not_answer_closes_the_data_plane() -> None:
    """The daemon address answers nothing: registration times out after the data plane was
    opened, and the constructor closes it again."""
    before = _listening_ports()
    with pytest.raises(ChaosError):
        Trainer(*_model(), daemon=free_tcp_address(), join_timeout_s=1.0)
    assert _listening_ports() - before == set()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"join": "garbage"}, "invalid join endpoint 'garbage'"),
        ({"join": "tcp://127.0.0.1:0"}, "invalid join endpoint"),
        ({"listen": "tcp://host"}, "invalid listen endpoint"),
        ({"node_id": "bad id!"}, "invalid node id"),
        ({"daemon": "nonsense"}, "invalid daemon endpoint"),
    ],
)
def test_a_malformed_endpoint_or_id_is_refused_before_anything_starts(
    kwargs: dict[str, str], needle: str
) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ports = _listening_ports()
    with pytest.raises(ConfigError, match=needle):
        Trainer(*_model(), **kwargs)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    assert _listening_ports() - ports == set()


def test_the_daemon_client_refuses_a_malformed_endpoint() -> None:
    from chaos.daemon.client import DaemonClient

    with pytest.raises(ConfigError, match="ipc://PATH or tcp://HOST:PORT"):
        DaemonClient("localhost:7000")


def test_the_default_node_id_is_valid_whatever_the_host_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from chaos.protocol.ids import check_node_id
    from chaos.trainer.config import default_node_id

    monkeypatch.setattr(socket, "gethostname", lambda: "x" * 70 + ".my host")
    node_id = default_node_id()
    assert check_node_id(node_id) == node_id and node_id.endswith(f"-{os.getpid()}")


def test_a_request_to_a_daemon_that_exits_fails_at_once(tmp_path: Path) -> None:
    """The daemon at the endpoint takes the request and never answers (it is gone): a request
    given ``gone`` raises DaemonGone instead of waiting out its (long) timeout."""
    import zmq
    from chaos.daemon.client import DaemonClient

    from chaos.errors import DaemonGone
    from chaos.protocol import StatusRequest

    endpoint = f"ipc://{tmp_path}/silent.ipc"
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(endpoint)
    checks: list[int] = []

    def gone() -> bool:
        checks.append(1)
        return len(checks) >= 3  # exits while the request waits

    try:
        with DaemonClient(endpoint, timeout_s=600.0) as client:
            with pytest.raises(DaemonGone, match="exited before it answered"):
                client.request(StatusRequest(), gone=gone)
        assert silent.poll(1000)  # the request did reach it
    finally:
        silent.close()
        ctx.term()


@pytest.fixture
def short_tempdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``tempfile``'s directory for this test: a short one (IPC socket paths are limited)."""
    root = Path(tempfile.mkdtemp(prefix="ct-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _daemon_children() -> list[psutil.Process]:
    kids = psutil.Process().children(recursive=True)
    return [p for p in kids if any("chaos" in part for part in p.cmdline())]


def test_the_temporary_run_directory_goes_after_a_clean_exit(short_tempdir: Path) -> None:
    """Without ``daemon_dir`` the embedded daemon runs in a temporary directory; a trainer that
    closes normally removes it, so repeated runs leave nothing behind."""
    trainer = Trainer(*_model(), node_id="solo", join_timeout_s=30.0)
    try:
        made = list(short_tempdir.glob("chaos-solo-*"))
        assert len(made) == 1 and (made[0] / "daemon.log").exists(), made
    finally:
        trainer.close()
    assert list(short_tempdir.glob("chaos-solo-*")) == []


def test_the_temporary_run_directory_stays_when_the_daemon_failed(short_tempdir: Path) -> None:
    """An embedded daemon that did not exit cleanly (here: killed) leaves its run directory,
    with its log, for the post-mortem."""
    trainer = Trainer(*_model(), node_id="solo", join_timeout_s=30.0)
    try:
        for proc in _daemon_children():
            proc.kill()
    finally:
        trainer.close()
    made = list(short_tempdir.glob("chaos-solo-*"))
    assert len(made) == 1 and (made[0] / "daemon.log").exists(), made


def test_a_join_that_cannot_complete_ends_in_the_daemons_own_error(tmp_path: Path) -> None:
    """The trainer's readiness wait and the daemon's join used to share one deadline counted
    from different moments: from the spawn for the wait, from the join's start (after the
    daemon's imports, slow on a busy device) for the daemon. So the wait always gave up first,
    with a bare "not ready" that hid why. Now the join phase counts from the daemon's first
    answer: the daemon gives its join up itself and the error carries its reason."""
    from chaos.trainer.config import TrainerConfig
    from chaos.trainer.embedded import DaemonStartError
    from chaos.trainer.wiring import start_embedded

    cfg = TrainerConfig(host="127.0.0.1", join_timeout_s=3.0, daemon_dir=str(tmp_path))
    with pytest.raises(DaemonStartError) as err:  # nobody listens at the join address
        start_embedded("lonely", cfg, free_tcp_address(), None)
    text = str(err.value)
    assert "exited with code 4" in text, text
    assert "join timed out" in text, text
    assert "joining through tcp://" in text, text  # where the wait last saw it
