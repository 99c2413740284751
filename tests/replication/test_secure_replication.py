"""State replication with a cluster key: only key holders can read a donor's state.

Without a key, one manifest request and one shard request to a donor's shard server return the
whole training state. With one, the server is a CURVE server of the cluster: a stranger's
connection (no key, or another cluster's key) fails in the handshake before a request is read,
and a joiner with the key pulls as before. Donor and joiner run in this process (the server
serves on its own thread).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import zmq
from chaos.scheduling import Neighbor, plan_replication
from zmq.utils.monitor import recv_monitor_message

from chaos.errors import ReplicationError
from chaos.launch import wait_until
from chaos.replication.donor_requests import DonorUnreachable, fetch_manifest
from chaos.replication.pull import PullConfig, pull_state
from chaos.replication.server import ShardServer
from chaos.replication.state import TrainingState, state_digest
from chaos.replication.wire import WIRE_ENCODER, ManifestRequest, ShardRequest, manifest_digest
from chaos.security import ClusterKey, Security

EPOCH, STEP = 2, 5
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()  # the optimizer has its state
    return model, opt


@pytest.fixture
def key() -> ClusterKey:
    return ClusterKey.generate()


@pytest.fixture
def donor(key: ClusterKey) -> Iterator[tuple[ShardServer, TrainingState]]:
    model, opt = _build(seed=0)
    state = TrainingState.capture(model, opt, step=STEP, epoch=EPOCH)
    server = ShardServer(security=Security(key))
    server.publish(state, EPOCH, STEP)
    try:
        yield server, state
    finally:
        server.close()


def _stranger_request(address: str, frames: list[bytes], security: Security | None) -> int:
    """Sends a request as a client with ``security`` (``None``: a plain socket) and returns the
    first monitor event its connection ends with: a reply, or a failed handshake."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if security is not None:
        security.client(sock)
    mon = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        if not mon.poll(20_000):
            raise AssertionError("the connection neither completed nor failed its handshake")
        event = int(recv_monitor_message(mon)["event"])
        if event & HANDSHAKE_FAILED:
            assert not sock.poll(0), "a refused connection got a reply"
        return event
    finally:
        sock.disable_monitor()
        mon.close(linger=0)
        sock.close(linger=0)


@pytest.mark.parametrize("who", ["no key", "another key"])
def test_a_stranger_cannot_fetch_a_manifest_or_a_shard(
    donor: tuple[ShardServer, TrainingState], who: str
) -> None:
    server, state = donor
    security = None if who == "no key" else Security(ClusterKey.generate())
    manifest_req = WIRE_ENCODER.encode(ManifestRequest(req_id=1, epoch=EPOCH, step=None))
    shard_req = WIRE_ENCODER.encode(ShardRequest(
        req_id=2, epoch=EPOCH, step=STEP, offset=0, length=min(4096, state.total_bytes),
        fingerprint=state.layout_fingerprint(), digest=manifest_digest(state.manifest_bytes),
    ))  # fmt: skip
    for frames in ([manifest_req], [shard_req]):
        event = _stranger_request(server.address, frames, security)
        assert event & HANDSHAKE_FAILED
    # the library's own client says why, at once
    with pytest.raises(DonorUnreachable, match="cluster key"):
        fetch_manifest(server.address, EPOCH, None, timeout_s=20.0, security=security)
    wait_until(lambda: server.stats().handshake_failures >= 3, 20.0, "the refusals counted")
    stats = server.stats()
    assert stats.manifests_sent == 0 and stats.shards_sent == 0 and stats.bytes_sent == 0


def test_a_key_holder_fetches_the_manifest_and_pulls_the_state_bitwise(
    donor: tuple[ShardServer, TrainingState], key: ClusterKey
) -> None:
    server, state = donor
    joiner = Security(key)  # the same cluster key, a keypair of its own
    manifest, step = fetch_manifest(server.address, EPOCH, None, timeout_s=20.0, security=joiner)
    assert (manifest, step) == (state.manifest_bytes, STEP)
    model, opt = _build(seed=77)
    target = TrainingState.for_joiner(model, opt, manifest, reuse=False)
    neighbors = [Neighbor(id="d0", prop_s=1e-4, trans_s_per_byte=1e-9)]
    plan = plan_replication(target.tensor_sizes(), neighbors, 1e-5, shard_size=1024)
    stats = pull_state(plan, {"d0": server.address}, target, EPOCH, STEP, 30.0,
                       neighbors=neighbors, config=PullConfig(window=4),
                       security=joiner)  # fmt: skip
    assert stats.bytes_per_donor == {"d0": state.total_bytes}
    runtime = target.apply()
    again = TrainingState.capture(model, opt, step=runtime.step, epoch=runtime.epoch,
                                  hyperparameters=runtime.hyperparameters)  # fmt: skip
    assert state_digest(again) == state_digest(state)
    assert server.stats().handshake_failures == 0


def test_a_pull_with_another_key_drops_the_donor_and_fails(
    donor: tuple[ShardServer, TrainingState],
) -> None:
    server, state = donor
    model, opt = _build(seed=77)
    target = TrainingState.for_joiner(model, opt, state.manifest_bytes, reuse=False)
    neighbors = [Neighbor(id="d0", prop_s=1e-4, trans_s_per_byte=1e-9)]
    plan = plan_replication(target.tensor_sizes(), neighbors, 1e-5, shard_size=1024)
    with pytest.raises(ReplicationError) as info:
        pull_state(plan, {"d0": server.address}, target, EPOCH, STEP, 30.0, neighbors=neighbors,
                   security=Security(ClusterKey.generate()))  # fmt: skip
    assert info.value.failed_donors == {"d0": "handshake_failed"}
    assert server.stats().shards_sent == 0


def test_a_server_without_a_key_refuses_a_keyed_joiner_rather_than_serving_in_clear(
    key: ClusterKey,
) -> None:
    model, opt = _build(seed=0)
    state = TrainingState.capture(model, opt, step=STEP, epoch=EPOCH)
    with ShardServer() as plain:
        plain.publish(state, EPOCH, STEP)
        with pytest.raises(DonorUnreachable, match="cluster key"):
            fetch_manifest(plain.address, EPOCH, None, timeout_s=20.0, security=Security(key))
