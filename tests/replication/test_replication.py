"""State replication between real processes on loopback: donors serve, a joiner pulls.

Every donor is a spawned process that builds the same model, trains it the same way and serves its
state with a :class:`ShardServer`. The joiner (this process) pulls into a model with other weights
and a fresh optimizer, then must be bitwise equal to the donors. Faults are injected by name
(:class:`ServerFaults`), never by sleeping.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import random
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq
from chaos.scheduling import Neighbor, Plan, plan_replication

from chaos.errors import ChaosTimeout, ReplicationError, StateLayoutError
from chaos.protocol import ReplicationWire
from chaos.replication.donor_requests import fetch_manifest, gather_manifests, latest_manifest
from chaos.replication.pull import PullConfig, plan_for_snapshot, pull_state
from chaos.replication.server import DIE_EXIT_CODE, ServerFaults, ShardServer
from chaos.replication.state import TrainingState, state_digest
from chaos.replication.wire import (
    MAX_REQUEST_BYTES,
    REPLICATION_VERSION,
    ManifestRequest,
    Refusal,
    ShardReply,
    ShardRequest,
    manifest_digest,
    shard_checksum,
)

EPOCH, STEP = 3, 4
SHARD = 2048
START_TIMEOUT_S = 60.0
PULL_TIMEOUT_S = 60.0


def _build(seed: int, hidden: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, hidden),
        torch.nn.BatchNorm1d(hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 4),
    )
    return model, torch.optim.Adam(model.parameters(), lr=3e-3)


def _donor_main(faults: dict[str, Any], hidden: int, rng_seed: int, conn: Connection) -> None:
    """A donor process: train STEP steps deterministically, publish, serve until told to stop."""
    torch.set_num_threads(1)
    model, opt = _build(0, hidden)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEP):
        x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    torch.manual_seed(rng_seed)
    random.seed(rng_seed)
    np.random.seed(rng_seed)
    state = TrainingState.capture(model, opt, step=STEP, epoch=EPOCH, hyperparameters={"bs": 32})
    info = {"digest": state_digest(state), "next_rand": torch.rand(4).tolist()}
    publish_after_s = float(faults.get("publish_after_s", 0.0))
    epoch = EPOCH + int(faults.get("later_epoch", 0))  # a donor that installed a newer policy
    mine = {k: v for k, v in faults.items() if k not in ("publish_after_s", "later_epoch")}
    fault_set = ServerFaults(**mine)
    with ShardServer(faults=fault_set) as server:
        if not publish_after_s:
            server.publish(state, epoch, STEP)
        conn.send({"address": server.address, **info})
        if publish_after_s:  # a donor still finishing its step: it publishes a little later
            if conn.poll(publish_after_s):
                return
            server.publish(state, EPOCH, STEP)
        conn.poll(300.0)  # until the test says stop or closes its end (EOF)


@dataclass
class Donor:
    id: str
    proc: Any
    address: str
    digest: str
    next_rand: list[float]


@contextlib.contextmanager
def _donor_pool() -> Iterator[Callable[..., dict[str, Donor]]]:
    """Starts donor processes; reaps every one of them, even when the test fails."""
    ctx = mp.get_context("spawn")
    procs: list[tuple[Any, Connection]] = []

    def start(
        faults: dict[str, dict[str, Any]], hidden: int = 64, rng_seeds: dict[str, int] | None = None
    ) -> dict[str, Donor]:
        pending = {}
        for nid, fault in faults.items():
            parent, child = ctx.Pipe()
            seed = (rng_seeds or {}).get(nid, 1234)
            args = (fault, hidden, seed, child)
            proc = ctx.Process(target=_donor_main, args=args, daemon=True)
            proc.start()
            child.close()
            procs.append((proc, parent))
            pending[nid] = (proc, parent)
        out = {}
        for nid, (proc, parent) in pending.items():
            if not parent.poll(START_TIMEOUT_S):
                raise ChaosTimeout(f"donor {nid} did not start within {START_TIMEOUT_S} s")
            info = parent.recv()
            out[nid] = Donor(nid, proc, info["address"], info["digest"], info["next_rand"])
        return out

    try:
        yield start
    finally:
        for _, parent in procs:
            parent.close()  # the donor sees EOF and exits
        for proc, _ in procs:
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(10.0)


@pytest.fixture
def spawn_donors() -> Iterator[Callable[..., dict[str, Donor]]]:
    """Donor processes of one test (for tests that inject faults or kill donors)."""
    with _donor_pool() as start:
        yield start


@pytest.fixture(scope="module")
def healthy_donors() -> Iterator[dict[str, Donor]]:
    """Three fault-free donors shared by the tests that leave them running and unharmed."""
    with _donor_pool() as start:
        yield start({"d0": {}, "d1": {}, "d2": {}})


def _neighbors(ids: list[str]) -> list[Neighbor]:
    return [Neighbor(id=i, prop_s=1e-4, trans_s_per_byte=1e-9) for i in ids]


def _joiner(donor: Donor, hidden: int = 64) -> tuple[TrainingState, Any, Any]:
    model, opt = _build(seed=77, hidden=hidden)
    manifest, step = fetch_manifest(donor.address, EPOCH, None, timeout_s=30.0)
    assert step == STEP
    # the whole state is planned: no chunk the joiner happens to hold is skipped
    return TrainingState.for_joiner(model, opt, manifest, reuse=False), model, opt


def _plan(state: TrainingState, ids: list[str]) -> Plan:
    plan = plan_replication(state.tensor_sizes(), _neighbors(ids), 1e-5, shard_size=SHARD)
    for nid in ids:
        assert len(plan.assignment[nid]) >= 3, "every donor must have shards to send"
    return plan


def _pull(
    donors: dict[str, Donor],
    state: TrainingState,
    plan: Plan,
    timeout_s: float = PULL_TIMEOUT_S,
    window: int = 4,
    on_progress: Any = None,
    **cfg: Any,
) -> Any:
    """Pulls ``state`` from ``donors`` along ``plan``; ``cfg``: more :class:`PullConfig`."""
    return pull_state(
        plan,
        {nid: d.address for nid, d in donors.items()},
        state,
        EPOCH,
        STEP,
        timeout_s,
        neighbors=_neighbors(list(donors)),
        config=PullConfig(window=window, **cfg),
        on_progress=on_progress,
    )


def _assert_equal_to_donors(
    state: TrainingState, model: Any, opt: Any, donors: dict[str, Donor]
) -> None:
    runtime = state.apply()
    assert (runtime.step, runtime.epoch) == (STEP, EPOCH)
    again = TrainingState.capture(
        model, opt, step=runtime.step, epoch=runtime.epoch, hyperparameters=runtime.hyperparameters
    )
    digests = {d.digest for d in donors.values()}
    assert len(digests) == 1, "the donors themselves must agree"
    assert state_digest(again) == digests.pop()
    # the torch RNG continues exactly where the donors' does
    assert torch.rand(4).tolist() == next(iter(donors.values())).next_rand
    steps = {float(s["step"]) for s in opt.state.values()}
    assert steps == {float(STEP)}


def _request(address: str, frames: list[bytes], timeout_s: float = 20.0) -> list[bytes]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            raise ChaosTimeout(f"no answer from {address} within {timeout_s} s")
        return sock.recv_multipart()
    finally:
        sock.close(linger=0)


def _decode(frame: bytes) -> Any:
    return msgspec.msgpack.decode(frame, type=ShardReply | Refusal)


# ----------------------------------------------------------------------------- tests


def test_pull_from_three_donors_is_bitwise_equal(healthy_donors: dict[str, Donor]) -> None:
    donors = healthy_donors
    state, model, opt = _joiner(donors["d0"])
    assert len(opt.state) == 0
    plan = _plan(state, list(donors))
    stats = _pull(donors, state, plan)
    assert stats.failed_donors == {} and stats.replans == 0 and stats.checksum_failures == 0
    for nid in donors:
        assert stats.bytes_per_donor[nid] == sum(n for _, n in plan.assignment[nid])
    assert sum(stats.bytes_per_donor.values()) == state.total_bytes
    _assert_equal_to_donors(state, model, opt, donors)


def test_large_planned_shards_are_split_into_requests(healthy_donors: dict[str, Donor]) -> None:
    donors = healthy_donors
    state, model, opt = _joiner(donors["d0"])
    ids = list(donors)
    plan = plan_replication(state.tensor_sizes(), _neighbors(ids), 1e-5, method="even")
    assert max(n for r in plan.assignment.values() for _, n in r) > 5000
    stats = _pull(donors, state, plan, max_request_bytes=5000)
    assert sum(stats.shards_per_donor.values()) > plan.num_shards
    _assert_equal_to_donors(state, model, opt, donors)


def test_donor_with_another_runtime_record_is_refused_and_replanned(spawn_donors: Any) -> None:
    donors = spawn_donors({"d0": {}, "d1": {}, "odd": {}}, rng_seeds={"odd": 99})
    assert donors["odd"].digest != donors["d0"].digest
    state, model, opt = _joiner(donors["d0"])
    stats = _pull(donors, state, _plan(state, list(donors)))
    assert stats.failed_donors == {"odd": "manifest_mismatch"} and stats.replans == 1
    assert stats.bytes_per_donor["odd"] == 0
    _assert_equal_to_donors(state, model, opt, {k: donors[k] for k in ("d0", "d1")})


def test_corrupted_shard_is_detected_and_refetched(spawn_donors: Any) -> None:
    once = {"corrupt_offsets": [0, SHARD * 5], "corrupt_times": 1}
    donors = spawn_donors({"d0": once, "d1": once, "d2": once})
    state, model, opt = _joiner(donors["d0"])
    stats = _pull(donors, state, _plan(state, list(donors)))
    assert stats.checksum_failures == 2
    assert stats.refetched_elsewhere == 0  # the second try from the same donor was good
    assert stats.failed_donors == {}
    _assert_equal_to_donors(state, model, opt, donors)


def test_shard_bad_twice_is_fetched_from_another_donor(spawn_donors: Any) -> None:
    always = {"corrupt_offsets": list(range(0, 1 << 20, SHARD)), "corrupt_times": None}
    donors = spawn_donors({"d0": always, "d1": {}, "d2": {}})
    state, model, opt = _joiner(donors["d1"])
    plan = _plan(state, list(donors))
    stats = _pull(donors, state, plan)
    n_bad = len(plan.assignment["d0"])
    assert stats.bytes_per_donor["d0"] == 0
    assert stats.refetched_elsewhere == n_bad
    assert stats.checksum_failures == 2 * n_bad
    _assert_equal_to_donors(state, model, opt, donors)


def test_every_donor_corrupt_fails_the_pull(spawn_donors: Any) -> None:
    always = {"corrupt_offsets": [0], "corrupt_times": None}
    donors = spawn_donors({"d0": always, "d1": always})
    state, _, _ = _joiner(donors["d0"])
    with pytest.raises(ReplicationError, match="checksum"):
        _pull(donors, state, _plan(state, list(donors)), max_shard_attempts=4)


def test_donor_dying_mid_transfer_is_replanned(spawn_donors: Any) -> None:
    donors = spawn_donors({"d0": {}, "d1": {"die_after_shards": 2}, "d2": {}})
    state, model, opt = _joiner(donors["d0"])
    stats = _pull(donors, state, _plan(state, list(donors)), request_timeout_s=5.0)
    assert set(stats.failed_donors) == {"d1"}
    assert stats.failed_donors["d1"] in {"disconnected", "timeout"}
    assert stats.replans == 1
    assert stats.bytes_per_donor["d1"] <= 2 * SHARD
    donors["d1"].proc.join(30.0)
    assert donors["d1"].proc.exitcode == DIE_EXIT_CODE
    _assert_equal_to_donors(state, model, opt, donors)


def test_donor_killed_with_sigkill_is_replanned(spawn_donors: Any) -> None:
    donors = spawn_donors({"d0": {}, "d1": {}, "d2": {}})
    state, model, opt = _joiner(donors["d0"])
    os.kill(donors["d2"].proc.pid, signal.SIGKILL)
    donors["d2"].proc.join(30.0)
    stats = _pull(donors, state, _plan(state, list(donors)), request_timeout_s=2.0)
    assert set(stats.failed_donors) == {"d2"} and stats.replans == 1
    assert stats.bytes_per_donor["d2"] == 0
    _assert_equal_to_donors(state, model, opt, donors)


def test_hung_donor_times_out_and_is_replanned(spawn_donors: Any) -> None:
    donors = spawn_donors({"d0": {"stall_after_shards": 1}, "d1": {}})
    state, model, opt = _joiner(donors["d1"])
    stats = _pull(donors, state, _plan(state, list(donors)), request_timeout_s=1.0)
    assert stats.failed_donors == {"d0": "timeout"}
    _assert_equal_to_donors(state, model, opt, donors)


def test_donor_that_publishes_late_is_waited_for(spawn_donors: Any) -> None:
    donors = spawn_donors({"d0": {}, "d1": {"publish_after_s": 1.0}})
    state, model, opt = _joiner(donors["d0"])
    stats = _pull(donors, state, _plan(state, ["d0", "d1"]))
    assert stats.failed_donors == {}
    assert stats.bytes_per_donor["d1"] > 0  # it served its share once it had published
    _assert_equal_to_donors(state, model, opt, donors)


def test_donor_that_never_publishes_is_dropped_after_the_grace(spawn_donors: Any) -> None:
    donors = spawn_donors({"d0": {}, "d1": {"publish_after_s": 120.0}})
    state, model, opt = _joiner(donors["d0"])
    stats = _pull(donors, state, _plan(state, ["d0", "d1"]), unpublished_grace_s=0.5)
    assert stats.failed_donors == {"d1": "not_published"}
    assert stats.bytes_per_donor["d1"] == 0 and stats.replans >= 1
    _assert_equal_to_donors(state, model, opt, donors)


def test_donors_that_published_under_different_epochs_serve_one_pull(spawn_donors: Any) -> None:
    donors = spawn_donors({"d0": {}, "d1": {"later_epoch": 2}})
    with pytest.raises(ReplicationError, match="stale_state"):
        fetch_manifest(donors["d1"].address, EPOCH, None, timeout_s=20.0)
    keys = {}
    for nid, d in donors.items():
        manifest, epoch, step = latest_manifest(d.address, EPOCH, timeout_s=20.0)
        keys[nid] = epoch
        assert step == STEP
    assert keys == {"d0": EPOCH, "d1": EPOCH + 2}
    with pytest.raises(ReplicationError, match="stale_state"):
        latest_manifest(donors["d0"].address, EPOCH + 1, timeout_s=20.0)  # never an older one
    state, model, opt = _joiner(donors["d0"])
    stats = pull_state(_plan(state, ["d0", "d1"]), {n: d.address for n, d in donors.items()},
                       state, keys, STEP, PULL_TIMEOUT_S, neighbors=_neighbors(["d0", "d1"]),
                       config=PullConfig(window=4))  # fmt: skip
    assert stats.failed_donors == {} and min(stats.bytes_per_donor.values()) > 0
    _assert_equal_to_donors(state, model, opt, donors)


def test_no_donor_left_raises(spawn_donors: Any) -> None:
    donors = spawn_donors({"d0": {"die_after_shards": 1}})
    state, _, _ = _joiner(donors["d0"])
    with pytest.raises(ReplicationError, match="no donor left") as info:
        _pull(donors, state, _plan(state, ["d0"]), request_timeout_s=2.0)
    assert set(info.value.failed_donors) == {"d0"}


def test_whole_pull_timeout_raises_chaos_timeout(spawn_donors: Any) -> None:
    donors = spawn_donors({"d0": {"stall_after_shards": 0}})
    state, _, _ = _joiner(donors["d0"])
    with pytest.raises(ChaosTimeout):
        pull_state(
            _plan(state, ["d0"]),
            {"d0": donors["d0"].address},
            state,
            EPOCH,
            STEP,
            1.0,
            neighbors=_neighbors(["d0"]),
            config=PullConfig(request_timeout_s=600.0),
        )


def test_stale_epoch_or_step_is_refused(healthy_donors: dict[str, Donor]) -> None:
    donors = healthy_donors
    state, _, _ = _joiner(donors["d0"])
    address = donors["d0"].address
    req = ShardRequest(
        req_id=7,
        epoch=EPOCH,
        step=STEP + 1,
        fingerprint=state.layout_fingerprint(),
        digest=manifest_digest(state.manifest_bytes),
        offset=0,
        length=16,
    )
    reply = _decode(_request(address, [msgspec.msgpack.encode(req)])[0])
    assert isinstance(reply, Refusal) and reply.reason == "stale_state" and reply.req_id == 7
    with pytest.raises(ReplicationError, match="stale_state"):
        fetch_manifest(address, EPOCH - 1, STEP, timeout_s=20.0)
    with pytest.raises(ReplicationError, match="stale_state"):
        fetch_manifest(address, EPOCH + 1, None, timeout_s=20.0)
    plan = _plan(state, list(donors))
    with pytest.raises(ReplicationError, match="no donor left") as info:
        pull_state(
            plan,
            {nid: d.address for nid, d in donors.items()},
            state,
            EPOCH,
            STEP - 1,
            PULL_TIMEOUT_S,
            neighbors=_neighbors(list(donors)),
        )
    assert info.value.failed_donors == {nid: "stale_state" for nid in donors}


def test_layout_mismatch_is_refused(healthy_donors: dict[str, Donor]) -> None:
    donors = healthy_donors
    manifest, _ = fetch_manifest(donors["d0"].address, EPOCH, STEP, timeout_s=20.0)
    model, opt = _build(seed=3, hidden=48)
    with pytest.raises(StateLayoutError, match="another layout"):
        TrainingState.for_joiner(model, opt, manifest)
    # A joiner of another layout asking anyway gets a typed refusal, not bytes.
    other_model, other_opt = _build(seed=3, hidden=48)
    other = TrainingState.capture(other_model, other_opt, step=STEP, epoch=EPOCH)
    req = ShardRequest(
        req_id=1,
        epoch=EPOCH,
        step=STEP,
        fingerprint=other.layout_fingerprint(),
        digest=manifest_digest(other.manifest_bytes),
        offset=0,
        length=16,
    )
    reply = _decode(_request(donors["d0"].address, [msgspec.msgpack.encode(req)])[0])
    assert isinstance(reply, Refusal) and reply.reason == "layout_mismatch"


def test_malformed_requests_are_refused_and_the_server_keeps_serving(
    healthy_donors: dict[str, Donor],
) -> None:
    donors = healthy_donors
    address = donors["d0"].address
    state, _, _ = _joiner(donors["d0"])
    good = {
        "type": "shard_req",
        "v": REPLICATION_VERSION,
        "req_id": 5,
        "epoch": EPOCH,
        "step": STEP,
        "fingerprint": state.layout_fingerprint(),
        "digest": manifest_digest(state.manifest_bytes),
        "offset": 0,
        "length": 64,
    }
    enc = msgspec.msgpack.encode
    cases: list[tuple[list[bytes], str]] = [
        ([b"\xc1garbage"], "malformed"),
        ([enc([1, 2, 3])], "malformed"),
        ([enc({**good, "v": 99})], "bad_version"),
        ([enc({**good, "type": "no_such_request"})], "malformed"),
        ([enc({k: v for k, v in good.items() if k != "length"})], "malformed"),
        ([enc({**good, "offset": -1})], "malformed"),
        ([enc({**good, "length": "64"})], "malformed"),
        ([enc(good), enc(good)], "malformed"),
        ([b"\x00" * (MAX_REQUEST_BYTES + 1)], "too_large"),
        ([enc({**good, "offset": state.total_bytes})], "out_of_range"),
        ([enc({**good, "length": 0})], "out_of_range"),
        ([enc({**good, "length": 1 << 40})], "too_large"),
        ([enc({**good, "digest": "00"})], "manifest_mismatch"),
    ]
    for frames, reason in cases:
        reply = _decode(_request(address, frames)[0])
        assert isinstance(reply, Refusal), frames
        assert reply.reason == reason, (frames, reply)
    frames = _request(address, [enc(good)])
    reply = _decode(frames[0])
    assert isinstance(reply, ShardReply) and reply.req_id == 5 and reply.length == 64
    assert len(frames[1]) == 64 and shard_checksum(frames[1]) == reply.checksum
    assert fetch_manifest(address, EPOCH, STEP, timeout_s=20.0) == (state.manifest_bytes, STEP)
    refused = _request(address, [enc(ManifestRequest(req_id=2, epoch=EPOCH, step=0))])
    assert _decode(refused[0]).reason == "stale_state"


def test_server_publish_and_retire_in_process() -> None:
    model, opt = _build(seed=0)
    state = TrainingState.capture(model, opt, step=1, epoch=1)
    with ShardServer() as server:
        with pytest.raises(ReplicationError, match="not_published"):
            fetch_manifest(server.address, 1, 1, timeout_s=20.0)
        server.publish(state, 1, 1)
        assert fetch_manifest(server.address, 1, None, timeout_s=20.0) == (state.manifest_bytes, 1)
        server.retire()
        with pytest.raises(ReplicationError, match="not_published"):
            fetch_manifest(server.address, 1, 1, timeout_s=20.0)
        stats = server.stats()
        assert stats.manifests_sent == 1 and stats.refusals == {"not_published": 2}


# ----------------------------------------------------------------------------- the joiner's steps


def test_gather_manifests_gets_every_donors_snapshot(healthy_donors: dict[str, Donor]) -> None:
    addresses = {n: d.address for n, d in healthy_donors.items()}
    manifest, keys = gather_manifests(addresses, EPOCH, timeout_s=30.0, poll_interval_s=0.02)
    assert keys == {n: (EPOCH, STEP) for n in healthy_donors}
    assert manifest == fetch_manifest(addresses["d0"], EPOCH, None, timeout_s=30.0)[0]


def test_gather_manifests_waits_the_grace_for_late_donors_and_no_longer(spawn_donors: Any) -> None:
    # d1 publishes 1 s late, within the 3 s grace; d2 only after 20 s, long after it
    donors = spawn_donors(
        {"d0": {}, "d1": {"publish_after_s": 1.0}, "d2": {"publish_after_s": 20.0}}
    )
    addresses = {n: d.address for n, d in donors.items()}
    _, keys = gather_manifests(addresses, EPOCH, 60.0, 0.02, grace_s=3.0)
    assert keys == {"d0": (EPOCH, STEP), "d1": (EPOCH, STEP)}


def test_gather_manifests_keeps_each_donors_epoch_and_drops_another_state(
    spawn_donors: Any,
) -> None:
    donors = spawn_donors({"d0": {}, "d1": {"later_epoch": 2}, "odd": {}}, rng_seeds={"odd": 99})
    addresses = {n: d.address for n, d in donors.items()}
    manifest, keys = gather_manifests(addresses, EPOCH, 30.0, 0.02, grace_s=1.0)
    assert keys == {"d0": (EPOCH, STEP), "d1": (EPOCH + 2, STEP)}  # "odd": another manifest
    assert manifest == fetch_manifest(addresses["d0"], EPOCH, None, timeout_s=30.0)[0]


def test_gather_manifests_without_any_snapshot_times_out(spawn_donors: Any) -> None:
    donors = spawn_donors({"d0": {"publish_after_s": 120.0}})
    with pytest.raises(ChaosTimeout, match="no donor published"):
        gather_manifests({"d0": donors["d0"].address}, EPOCH, 1.0, 0.02)
    with pytest.raises(ValueError, match="poll_interval_s"):
        gather_manifests({"d0": donors["d0"].address}, EPOCH, 1.0, 0.0)


def _local_state() -> TrainingState:
    model, opt = _build(seed=5)
    return TrainingState.capture(model, opt, step=STEP, epoch=EPOCH, hyperparameters={"bs": 32})


def _wire(plan: Plan, method: str = "chaos") -> ReplicationWire:
    return ReplicationWire(
        target="j",
        shard_size=plan.shard_size,
        assignment={k: [(a, n) for a, n in v] for k, v in plan.assignment.items()},
        makespan_s=plan.makespan_s,
        method=method,  # type: ignore[arg-type]
    )


def _covers(plan: Plan, total: int) -> bool:
    ranges = sorted(r for v in plan.assignment.values() for r in v if r[1] > 0)
    end = 0
    for offset, length in ranges:
        if offset != end:
            return False
        end += length
    return end == total


def test_plan_for_snapshot_keeps_the_schedulers_plan_when_it_fits() -> None:
    state = _local_state()
    planned = _plan(state, ["d0", "d1", "d2"])
    plan = plan_for_snapshot(state, _wire(planned), _neighbors(["d0", "d1", "d2"]))
    assert plan.assignment == planned.assignment and plan.shard_size == planned.shard_size


def test_plan_for_snapshot_replans_without_a_donor_that_did_not_answer() -> None:
    state = _local_state()
    planned = _plan(state, ["d0", "d1", "d2"])
    assert all(planned.assignment[d] for d in ("d0", "d1", "d2"))
    plan = plan_for_snapshot(state, _wire(planned), _neighbors(["d0", "d2"]))
    assert set(k for k, v in plan.assignment.items() if v) <= {"d0", "d2"}
    assert _covers(plan, state.total_bytes)


def test_plan_for_snapshot_replans_when_the_stream_changed_size() -> None:
    state = _local_state()
    planned = _plan(state, ["d0", "d1"])
    head, tail = planned.assignment["d1"][:-1], planned.assignment["d1"][-1]
    shrunk = dict(planned.assignment, d1=[*head, (tail[0], tail[1] - 8)])  # 8 bytes fewer
    stale = dataclasses.replace(planned, assignment=shrunk)
    plan = plan_for_snapshot(state, _wire(stale, "even"), _neighbors(["d0", "d1"]))
    assert plan.method == "even" and _covers(plan, state.total_bytes)


def test_plan_for_snapshot_replans_only_over_the_donors_that_had_work() -> None:
    state = _local_state()
    total = state.total_bytes
    planned = Plan(method="single-source", layout="flat", shard_size=total,
                   assignment={"d0": [(0, total - 8)], "d1": []}, makespan_s=1.0,
                   state_bytes=total - 8, per_shard_cost_s=0.0)  # fmt: skip
    fast = [Neighbor(id="d0", prop_s=1e-3, trans_s_per_byte=1e-8),
            Neighbor(id="d1", prop_s=1e-4, trans_s_per_byte=1e-9)]  # fmt: skip
    plan = plan_for_snapshot(state, _wire(planned, "single-source"), fast)
    # the stream grew by 8 bytes: re-planned single-source over d0, the one donor it used,
    # not over d1, which is faster but had no work
    assert [k for k, v in plan.assignment.items() if v] == ["d0"]
    assert _covers(plan, total)


def test_a_second_epoch_at_the_same_step_is_served_by_the_same_snapshot() -> None:
    """Two joiners admitted one after the other before anyone stepped: the donor serves its one
    snapshot as the state of both epochs (the second joiner used to get stale_state)."""
    model, opt = _build(seed=0)
    state = TrainingState.capture(model, opt, step=78, epoch=0)
    with ShardServer() as server:
        server.publish(state, 5, 78)
        with pytest.raises(ReplicationError, match="stale_state"):
            fetch_manifest(server.address, 6, None, timeout_s=20.0)
        assert server.also_serve(6, 78)
        for epoch in (5, 6):  # the first joiner's pull goes on; the second's starts
            assert fetch_manifest(server.address, epoch, None, timeout_s=20.0) == (
                state.manifest_bytes, 78)  # fmt: skip
            # and its shards arrive: a reply names the epoch asked for (it named the newest
            # one, and the first joiner rejected every shard as from another snapshot)
            j_model, j_opt = _build(seed=1)
            joiner = TrainingState.for_joiner(j_model, j_opt, state.manifest_bytes, reuse=False)
            plan = plan_replication(joiner.tensor_sizes(), _neighbors(["d0"]), 1e-5,
                                    shard_size=SHARD)  # fmt: skip
            stats = pull_state(plan, {"d0": server.address}, joiner, epoch, 78, PULL_TIMEOUT_S,
                               neighbors=_neighbors(["d0"]))  # fmt: skip
            assert stats.checksum_failures == 0 and stats.failed_donors == {}
            assert joiner.apply().step == 78
            assert state_digest(TrainingState.capture(j_model, j_opt, step=78, epoch=0)) == (
                state_digest(state))  # fmt: skip
        with pytest.raises(ReplicationError, match="stale_state"):
            fetch_manifest(server.address, 7, None, timeout_s=20.0)
        assert not server.also_serve(7, 79)  # another step: a new snapshot is needed
        with pytest.raises(ReplicationError, match="stale_state"):
            fetch_manifest(server.address, 7, None, timeout_s=20.0)
