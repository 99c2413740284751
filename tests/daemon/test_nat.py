"""Devices behind NAT, with real daemons in network namespaces (:mod:`chaos.emulate.nat`).

A public founder; a public joiner (the control: it joins); a device behind a home router that
masquerades and forwards only its own connections (it can reach the cluster, the cluster cannot
reach it), joining through the public member that is not the scheduler (which forwards the
join and hands the scheduler's refusal back); a device behind a router that lets nothing out.
Until dial-out members exist, the two devices behind NAT cannot take part: each must fail
within its join timeout with an error that names the cause, not a bare timeout. Needs root,
iproute2 and nftables (CI installs them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from chaos.daemon.events import read_events

from chaos.emulate.nat import NatHome, NatLayout, NatNetwork, nft_available
from chaos.launch import daemon_command, daemon_env, kill_and_reap
from chaos.security import ClusterKey

pytestmark = pytest.mark.skipif(
    (os.geteuid() != 0 or shutil.which("ip") is None or not nft_available())
    and not os.environ.get("CHAOS_REQUIRE_NFT"),
    reason="builds NAT routers in network namespaces: needs root, iproute2 and nftables "
    "(CI runs as root, installs nftables and sets CHAOS_REQUIRE_NFT)",
)

PORT = 7311
JOIN_TIMEOUT_S = 12.0


class _Lab:
    """The NAT network, the cluster key, and the daemons started in it (reaped at the end)."""

    def __init__(self, tmp: Path, net: NatNetwork) -> None:
        self.tmp = tmp
        self.net = net
        self.key = ClusterKey.generate().write(tmp / "cluster.key")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def endpoint(self, device: str) -> str:
        return f"tcp://{self.net.addresses[device]}:{PORT}"

    def start(self, node: str, device: str, join: str | None = None) -> subprocess.Popen[bytes]:
        run_dir = self.tmp / node
        run_dir.mkdir(mode=0o700)
        argv = daemon_command(node, self.endpoint(device), join=join, cluster_key=self.key,
                              extra_args=["--join-timeout", str(JOIN_TIMEOUT_S)])  # fmt: skip
        log = (self.tmp / f"{node}.log").open("wb")
        proc = subprocess.Popen(self.net.exec_argv(device, argv), env=daemon_env(run_dir),
                                stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        self.procs[node] = proc
        return proc

    def events(self, node: str) -> list[dict[str, object]]:
        path = self.tmp / node / f"events-{node}.jsonl"
        return read_events(path) if path.exists() else []

    def log(self, node: str) -> str:
        return (self.tmp / f"{node}.log").read_text(errors="replace")

    def wait(self, pred: object, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():  # type: ignore[operator]
                return
            time.sleep(0.1)
        pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[_Lab]:
    layout = NatLayout(public=("pub0", "pub1"),
                       homes=(NatHome(("home0",)), NatHome(("shut0",), blocked=True)))
    with NatNetwork(layout, f"nat{os.getpid()}") as net:
        lab = _Lab(tmp_path, net)
        try:
            yield lab
        finally:
            kill_and_reap(list(lab.procs.values()), group=True)


def _exit_within(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, float]:
    t0 = time.monotonic()
    code = proc.wait(timeout=timeout_s)
    return code, time.monotonic() - t0


def test_a_device_behind_nat_fails_its_join_naming_the_cause(lab: _Lab) -> None:
    lab.start("n0", "pub0")
    lab.wait(lambda: bool(lab.events("n0")), "n0 to start", 30.0)
    # the control: a public device joins
    lab.start("n1", "pub1", join=lab.endpoint("pub0"))
    lab.wait(lambda: any(e.get("event") == "joined" for e in lab.events("n1")), "n1 to join",
             JOIN_TIMEOUT_S + 10)  # fmt: skip
    # behind NAT: it reaches the cluster, the cluster cannot reach it. It joins through n1,
    # which forwards the join to the scheduler n0 and hands n0's refusal back to it over the
    # connection it opened
    natted = lab.start("n2", "home0", join=lab.endpoint("pub1"))
    code, took = _exit_within(natted, JOIN_TIMEOUT_S + 20)
    log = lab.log("n2")
    assert code == 4, log[-3000:]
    assert took < JOIN_TIMEOUT_S + 10, took
    assert f"could not connect to {lab.endpoint('home0')}" in log, log[-3000:]
    assert "Devices behind NAT" in log
    failed = [e for e in lab.events("n2") if e.get("event") == "join_failed"]
    assert failed and "the address this device advertises" in str(failed[-1]["detail"])
    refused = [e for e in lab.events("n0") if e.get("event") == "join_refused"]
    assert refused and refused[0]["reason"] == "joiner_unreachable"
    handed = [e for e in lab.events("n1") if e.get("event") == "join_refusal_handed_on"]
    assert handed and handed[0]["peer"] == "n2"
    # behind a router that lets nothing out: no contact ever answers, and it says so
    shut = lab.start("n3", "shut0", join=lab.endpoint("pub0"))
    code, took = _exit_within(shut, JOIN_TIMEOUT_S + 20)
    log = lab.log("n3")
    assert code == 4, log[-3000:]
    assert f"no contact ever answered ({lab.endpoint('pub0')})" in log, log[-3000:]
    assert "blocks its outbound connections" in log
    # the cluster is unharmed: n0 and n1 are still members, and only they
    assert lab.procs["n0"].poll() is None and lab.procs["n1"].poll() is None
