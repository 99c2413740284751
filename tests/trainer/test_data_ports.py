"""``TrainerConfig.data_ports``: the data endpoints bind known ports, skip ports other sockets
hold, and report a range with no free port as a ConfigError naming the ports and the option.

Ports are held by real listening sockets; the trainers are real (with their embedded daemon).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import psutil
import pytest
import torch

from chaos.errors import ConfigError
from chaos.trainer import Trainer, TrainerConfig
from chaos.trainer.dataplane import DataPlane

HOST = "127.0.0.1"


def _listen(port: int) -> socket.socket:
    s = socket.socket()
    s.bind((HOST, port))
    s.listen()
    return s


@contextlib.contextmanager
def _free_run(n: int) -> Iterator[int]:
    """The first of ``n`` consecutive ports that were free a moment ago."""
    for _ in range(50):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(_listen(0)).getsockname()[1]
            if first + n > 65535:
                continue
            try:
                for port in range(first + 1, first + n):
                    stack.enter_context(_listen(port))
            except OSError:
                continue
        yield first
        return
    raise RuntimeError(f"no run of {n} free ports found")


def _plane(ports: tuple[int, int]) -> DataPlane:
    return DataPlane(
        "a",
        HOST,
        chunk_bytes=1 << 16,
        step_timeout_s=5.0,
        wire_dtype=None,
        lanes=False,
        poll_interval_s=0.02,
        interrupt=lambda: None,
        ports=ports,
    )


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.parametrize(
    "bad", [(5000, 5000), (0, 10), (6000, 5000), (1, 70000), ("a", 5), [1000, 1002], (True, 9)]
)
def test_a_bad_range_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="data_ports"):
        TrainerConfig(data_ports=bad)  # type: ignore[arg-type]


def test_the_endpoints_skip_a_port_another_socket_holds() -> None:
    with _free_run(3) as first, _listen(first):
        plane = _plane((first, first + 2))
        try:
            assert _port(plane.address) == first + 1
            assert _port(plane.shard_address) == first + 2
        finally:
            plane.close()


def test_a_range_with_no_free_port_names_the_ports_and_the_option() -> None:
    with _free_run(2) as first, _listen(first), _listen(first + 1):
        with pytest.raises(ConfigError) as caught:
            _plane((first, first + 1))
    message = str(caught.value)
    assert "data_ports" in message and "already in use" in message
    assert str(first) in message and str(first + 1) in message


def test_one_free_port_is_not_enough_and_the_first_endpoint_is_closed() -> None:
    with _free_run(2) as first, _listen(first + 1):
        with pytest.raises(ConfigError, match="shard server"):
            _plane((first, first + 1))
        probe = _listen(first)  # the communicator bound first and let it go again
        probe.close()


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_trainer_binds_its_data_endpoints_in_the_range() -> None:
    with _free_run(3) as first, _listen(first):
        with Trainer(*_model(), node_id="ports", data_ports=(first, first + 2)) as trainer:
            mine = {c.laddr.port for c in psutil.Process(os.getpid()).net_connections("tcp")}
            assert {first + 1, first + 2} <= mine
            trainer.update()  # a one-member step runs


def test_a_trainer_whose_data_ports_are_taken_raises_a_config_error() -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with _free_run(2) as first, _listen(first), _listen(first + 1):
        with pytest.raises(ConfigError, match=rf"data_ports=\({first}, {first + 1}\)"):
            Trainer(*_model(), node_id="taken", data_ports=(first, first + 1))
    after = {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()}
    assert {p for p in after - before if psutil.Process(p).status() != "zombie"} == set()
