"""Data-plane collectives: real processes allreducing over ZeroMQ on loopback.

Each multi-process test starts a small cluster of spawned worker processes, each holding one
:class:`Communicator`; the test drives them through command queues and compares their results
with a single-process reference. Every child is reaped, even when a test fails.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq
from chaos.scheduling.sync_policy import LinkEstimate, build_sync_policy
from zmq.utils.monitor import recv_monitor_message

from chaos.collectives import (
    Communicator,
    CommunicatorConfig,
    PeerFailure,
    Topology,
    topology_from_sync_policy,
)
from chaos.collectives.frames import (
    FRAME_VERSION,
    HEADER_BYTES,
    Op,
    decode_header,
    encode_header,
)
from chaos.collectives.links import member_of
from chaos.errors import PeerTimeout, ProtocolError, RoundInterrupted

CHUNK_BYTES = 4096  # small chunks: many frames (deep pipelines) with small tensors
REPLY_TIMEOUT_S = 60.0
FAILED_EXIT = 70


# ---------------------------------------------------------------------------- worker process


def _input(name: str, numel: int, seed: int, dtype: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + int(name[1:]))
    return torch.randn(numel, generator=gen, dtype=torch.float32).to(getattr(torch, dtype))


def _worker(
    name: str, commands: Any, replies: Any, lanes: bool = True, quiet_probe_s: float = 2.0
) -> None:
    """A cluster member: runs the commands it is sent and replies with what happened.

    With ``lanes``, every tensor (however small) travels on payload lanes once they are up.
    """
    torch.set_num_threads(1)
    config = CommunicatorConfig(node_id=name, chunk_bytes=CHUNK_BYTES, timeout_s=30.0,
                                lanes=lanes, lane_min_bytes=0,
                                quiet_probe_s=quiet_probe_s)  # fmt: skip
    comm = Communicator(config)
    replies.put(("address", name, comm.address))
    while True:
        cmd, arg = commands.get(timeout=REPLY_TIMEOUT_S * 3)
        if cmd == "exit":
            break
        if cmd == "topology":
            comm.update_topology(Topology(**arg))
            replies.put(("ok", name, None))
        elif cmd == "fail_at":
            linger_s = arg.pop("linger_s", None)
            if linger_s is not None:  # let the frames sent so far leave before the exit
                arg["before_exit"] = lambda s=linger_s: time.sleep(s)
            comm.fail_at(**arg)
            replies.put(("ok", name, None))
        elif cmd == "lose_frames_to":
            comm.lose_frames_to(**arg)
            replies.put(("ok", name, None))
        elif cmd == "interrupt_on_newer_round":  # what the Trainer does while it waits
            comm.set_interrupt(lambda: "newer round" if comm.newer_round_seen() else None, 0.01)
            replies.put(("ok", name, None))
        elif cmd == "allreduce":
            replies.put(_allreduce(comm, name, arg))
    comm.close()


def _allreduce(comm: Communicator, name: str, spec: dict[str, Any]) -> tuple[str, str, Any]:
    x = _input(name, spec["numel"], spec["seed"], spec.get("dtype", "float32"))
    before = x.clone()
    try:
        out = comm.allreduce(x, spec["op"], wire_dtype=spec.get("wire"),
                             timeout_s=spec.get("timeout_s"),
                             keep_result=spec.get("keep", False))  # fmt: skip
    except RoundInterrupted:
        return ("interrupted", name, {"newer": comm.newer_round_seen(),
                                      "input_intact": torch.equal(x, before)})  # fmt: skip
    except PeerFailure as exc:
        info = {
            "peer": exc.peer,
            "timed_out": exc.timed_out,
            "input_intact": torch.equal(x, before),
            "stale": comm.stats.dropped_stale,
        }
        return ("failure", name, info)
    info = {
        "result": out.float().numpy().copy(),
        "dtype": str(out.dtype),
        "input_intact": torch.equal(x, before),
        "stale": comm.stats.dropped_stale,
        "caught_up": comm.stats.caught_up,
        "results_sent": comm.stats.results_sent,
    }
    return ("result", name, info)


# ---------------------------------------------------------------------------- cluster driver


class Cluster:
    """Drives spawned members ``n0 .. n{k-1}``; see :func:`cluster`."""

    def __init__(
        self, size: int, lanes: bool = True, quiet_probe_s: dict[str, float] | None = None
    ) -> None:
        ctx = mp.get_context("spawn")
        quiet = quiet_probe_s or {}
        self.names = [f"n{i}" for i in range(size)]
        # One reply queue per member: a member killed mid-write (fail_at) can leave a shared
        # queue's lock held, which would silence every other member.
        self.replies = {n: ctx.Queue() for n in self.names}
        self.commands = {n: ctx.Queue() for n in self.names}
        self.procs = {
            n: ctx.Process(target=_worker, daemon=True,
                           args=(n, self.commands[n], self.replies[n], lanes,
                                 quiet.get(n, 2.0)))
            for n in self.names
        }  # fmt: skip
        self.addresses: dict[str, str] = {}
        self.epoch = 0

    def start(self) -> None:
        for p in self.procs.values():
            p.start()
        for n in self.names:
            _kind, name, address = self._reply(n)
            self.addresses[name] = address

    def reap(self) -> None:
        for name, p in self.procs.items():
            if p.is_alive():
                try:
                    self.commands[name].put(("exit", None))
                except (OSError, ValueError):
                    pass
        for p in self.procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def _reply(self, name: str) -> tuple[str, str, Any]:
        try:
            reply: tuple[str, str, Any] = self.replies[name].get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            codes = {n: p.exitcode for n, p in self.procs.items()}
            raise AssertionError(f"no reply from the workers; exit codes {codes}") from None
        return reply

    def send(self, names: list[str], cmd: str, arg: Any) -> dict[str, tuple[str, Any]]:
        return self.send_each(cmd, {n: arg for n in names})

    def send_each(self, cmd: str, args: dict[str, Any]) -> dict[str, tuple[str, Any]]:
        """``cmd`` to each member with its own argument; their replies by member."""
        for n, arg in args.items():
            self.commands[n].put((cmd, arg))
        out: dict[str, tuple[str, Any]] = {}
        for n in args:
            kind, name, info = self._reply(n)
            out[name] = (kind, info)
        return out

    def topology(self, members: list[str], kind: str, **shape: Any) -> None:
        self.epoch += 1
        addrs = {m: self.addresses[m] for m in members}
        arg = {"kind": kind, "members": tuple(members), "addresses": addrs, "epoch": self.epoch,
               **shape}  # fmt: skip
        replies = self.send(members, "topology", arg)
        assert all(kind == "ok" for kind, _ in replies.values()), replies

    def allreduce(self, members: list[str], **spec: Any) -> dict[str, tuple[str, Any]]:
        return self.send(members, "allreduce", spec)


@contextmanager
def cluster(
    size: int, lanes: bool = True, quiet_probe_s: dict[str, float] | None = None
) -> Iterator[Cluster]:
    c = Cluster(size, lanes, quiet_probe_s)
    try:
        c.start()
        yield c
    finally:
        c.reap()


def _reference(members: list[str], numel: int, seed: int, op: str, dtype: str) -> np.ndarray:
    xs = [_input(m, numel, seed, dtype).double() for m in members]
    total = torch.stack(xs).sum(0)
    return (total / len(members) if op == "mean" else total).numpy()


def _check(replies: dict[str, tuple[str, Any]], ref: np.ndarray, atol: float, rtol: float) -> None:
    kinds = {n: k for n, (k, _) in replies.items()}
    assert set(kinds.values()) == {"result"}, replies
    results = [info["result"] for _, info in replies.values()]
    for info in (i for _, i in replies.values()):
        assert info["input_intact"]
    np.testing.assert_allclose(results[0], ref, atol=atol, rtol=rtol)
    for r in results[1:]:  # bitwise equal on every member
        assert r.tobytes() == results[0].tobytes()


TREE = {"parent": {"n0": None, "n1": "n0", "n2": "n0", "n3": "n1"}}  # depth 2, fan-out 2
RING = {"ring_order": ("n0", "n2", "n1", "n3")}


# ---------------------------------------------------------------------------- multi-process


def test_ring_and_tree_match_reference_and_are_bitwise_equal() -> None:
    members = ["n0", "n1", "n2", "n3"]
    with cluster(4) as c:
        for kind, shape in (("ring", RING), ("tree", TREE)):
            c.topology(members, kind, **shape)
            # odd sizes: not divisible by the members nor the chunk; fewer elements than members
            for seed, (numel, op) in enumerate([(10_007, "sum"), (3, "mean"), (1, "sum"),
                                                (40_961, "mean")]):  # fmt: skip
                replies = c.allreduce(members, numel=numel, seed=seed, op=op)
                _check(replies, _reference(members, numel, seed, op, "float32"), 1e-5, 1e-5)
        # low-precision wire formats accumulate in float32; half inputs come back as half
        for kind, shape in (("ring", RING), ("tree", TREE)):
            c.topology(members, kind, **shape)
            for wire in ("float16", "bfloat16"):
                replies = c.allreduce(members, numel=9_999, seed=7, op="mean", wire=wire)
                ref = _reference(members, 9_999, 7, "mean", "float32")
                _check(replies, ref, 5e-2, 2e-2)
            replies = c.allreduce(members, numel=5_001, seed=8, op="sum", dtype="float16")
            assert {i["dtype"] for _, i in replies.values()} == {"torch.float16"}
            _check(replies, _reference(members, 5_001, 8, "sum", "float16"), 2e-2, 2e-2)
        # a member leaves the structure: the others reduce among themselves
        c.topology(["n0", "n1", "n3"], "tree", parent={"n0": None, "n1": "n0", "n3": "n1"})
        replies = c.allreduce(["n0", "n1", "n3"], numel=777, seed=9, op="sum")
        _check(replies, _reference(["n0", "n1", "n3"], 777, 9, "sum", "float32"), 1e-5, 1e-5)


def test_stale_epoch_frames_are_dropped_and_the_step_reruns() -> None:
    members = ["n0", "n1", "n2"]
    with cluster(3) as c:
        c.topology(members, "ring", ring_order=("n0", "n1", "n2"))
        # n2 does not take part: n0 and n1 fail, leaving epoch-1 frames queued at n2. n0 times
        # out on n2 and aborts; n1, which waits on n0, has the longer timeout, so that it learns
        # the cause from n0's abort instead of timing out on n0 itself (a race on equal ones)
        spec = {"numel": 5_000, "seed": 1, "op": "sum"}
        failed = c.send_each("allreduce", {"n0": {**spec, "timeout_s": 1.0},
                                           "n1": {**spec, "timeout_s": 10.0}})  # fmt: skip
        for kind, info in failed.values():
            assert kind == "failure"
            assert info["peer"] == "n2"
            assert info["input_intact"]
        c.topology(members, "ring", ring_order=("n0", "n1", "n2"))  # epoch 2, same links
        replies = c.allreduce(members, numel=5_000, seed=1, op="sum")
        _check(replies, _reference(members, 5_000, 1, "sum", "float32"), 1e-5, 1e-5)
        assert replies["n2"][1]["stale"] >= 1  # n1's epoch-1 frames reached n2 and were dropped


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "zeromq"])
@pytest.mark.parametrize(("kind", "shape", "victim"), [("ring", RING, "n2"), ("tree", TREE, "n1")])
def test_member_killed_mid_allreduce(
    kind: str, shape: dict[str, Any], victim: str, lanes: bool
) -> None:
    members = ["n0", "n1", "n2", "n3"]
    survivors = [m for m in members if m != victim]
    with cluster(4, lanes) as c:
        c.topology(members, kind, **shape)
        _check(c.allreduce(members, numel=20_000, seed=1, op="mean"),
               _reference(members, 20_000, 1, "mean", "float32"), 1e-5, 1e-5)  # fmt: skip
        c.send([victim], "fail_at", {"step": 1, "after_frames": 2})
        for m in members:
            spec = {"numel": 20_000, "seed": 2, "op": "mean", "timeout_s": 10.0}
            c.commands[m].put(("allreduce", spec))
        replies = {}
        for survivor in survivors:
            kind_, name, info = c._reply(survivor)
            replies[name] = (kind_, info)
        c.procs[victim].join(timeout=REPLY_TIMEOUT_S)
        assert c.procs[victim].exitcode == FAILED_EXIT
        for name, (k, info) in replies.items():
            assert k == "failure", (name, info)
            assert info["peer"] == victim, (name, info)
            assert info["input_intact"], name
        # the survivors rerun the step under the new policy and agree bitwise
        c.topology(survivors, "ring", ring_order=tuple(survivors))
        _check(c.allreduce(survivors, numel=20_000, seed=2, op="mean"),
               _reference(survivors, 20_000, 2, "mean", "float32"), 1e-5, 1e-5)  # fmt: skip


def test_a_member_that_missed_the_result_catches_up_from_one_that_got_it() -> None:
    """The root dies while broadcasting the result: n1 (and its child n3) got all of it and
    completed the step, n2 did not. Under the next epoch n1 and n3 run the next step while n2
    reruns the missed one: n2 asks its neighbour a step ahead, completes the step with that
    neighbour's kept result (bitwise the same), and then all three run the next step together.
    Without this they waited on each other's different steps until the timeout."""
    members, survivors = ["n0", "n1", "n2", "n3"], ["n1", "n2", "n3"]
    numel = 20_000  # 20 chunks of CHUNK_BYTES; the root sends chunk j to n1, then to n2
    with cluster(4) as c:
        c.topology(members, "tree", **TREE)
        spec = {"numel": numel, "op": "mean", "timeout_s": 10.0, "keep": True}
        _check(c.allreduce(members, seed=1, **spec),
               _reference(members, numel, 1, "mean", "float32"), 1e-5, 1e-5)  # fmt: skip
        # the root's 39th send of step 1 is the last chunk to n1; it dies before the 40th (n2's)
        c.send(["n0"], "fail_at", {"step": 1, "after_frames": 38, "linger_s": 0.5})
        for m in members:
            c.commands[m].put(("allreduce", {**spec, "seed": 2}))
        step1 = {m: c._reply(m) for m in survivors}
        c.procs["n0"].join(timeout=REPLY_TIMEOUT_S)
        assert c.procs["n0"].exitcode == FAILED_EXIT
        assert {m: k for m, (k, _, _) in step1.items()} == {
            "n1": "result", "n2": "failure", "n3": "result"}, step1  # fmt: skip
        got = step1["n1"][2]["result"]
        assert got.tobytes() == step1["n3"][2]["result"].tobytes()
        np.testing.assert_allclose(got, _reference(members, numel, 2, "mean", "float32"),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
        # epoch 3: n2 is n1's child; n1 and n3 run step 2, n2 reruns step 1
        c.topology(survivors, "tree", parent={"n1": None, "n2": "n1", "n3": "n1"})
        for m in ("n1", "n3"):
            c.commands[m].put(("allreduce", {**spec, "seed": 3}))
        kind, info = c.send(["n2"], "allreduce", {**spec, "seed": 2})["n2"]
        assert kind == "result", info
        assert info["result"].tobytes() == got.tobytes()  # the step n1 and n3 applied
        assert info["caught_up"] == 1 and info["input_intact"]
        # then n2 runs step 2 with the others
        c.commands["n2"].put(("allreduce", {**spec, "seed": 3}))
        step2 = {m: c._reply(m) for m in survivors}
        _check({m: (k, i) for m, (k, _, i) in step2.items()},
               _reference(survivors, numel, 3, "mean", "float32"), 1e-5, 1e-5)  # fmt: skip
        assert step2["n1"][2]["results_sent"] == 1


def _step_one_lost_to_n2(c: Cluster, members: list[str], spec: dict[str, Any]) -> Any:
    """A tree rooted at n0 runs step 0; the root's broadcast of step 1 to n2 is lost; n0 and n1
    complete step 1 (n2 still waits in it). Returns the root's result of step 1."""
    c.topology(members, "tree", parent={"n0": None, "n1": "n0", "n2": "n0"})
    _check(c.allreduce(members, seed=1, **spec),
           _reference(members, spec["numel"], 1, "mean", "float32"), 1e-5, 1e-5)  # fmt: skip
    c.send(["n0"], "lose_frames_to", {"peer": "n2", "step": 1})
    for m in members:
        c.commands[m].put(("allreduce", {**spec, "seed": 2}))
    ahead = {m: c._reply(m) for m in ("n0", "n1")}
    assert {m: k for m, (k, _, _) in ahead.items()} == {"n0": "result", "n1": "result"}
    return ahead["n0"][2]["result"]


def test_a_member_whose_result_frames_were_lost_asks_the_neighbour_a_step_ahead() -> None:
    """The root's broadcast of step 1 to n2 is lost (a lossy link: the connection stays up, no
    one dies). The root and n1 complete step 1 and start step 2; n2 still waits for step 1's
    result, and nothing will come: the root waits for n2's step 2. n2's round, quiet for
    ``quiet_probe_s``, asks its parent (a BEHIND notice), which answers with its kept result: n2
    completes step 1 with the others' bits, then all three run step 2. Without the probe both
    sides waited on each other's different steps until the timeout."""
    members = ["n0", "n1", "n2"]
    numel = 20_000
    with cluster(3) as c:
        spec = {"numel": numel, "op": "mean", "timeout_s": 60.0, "keep": True}
        got = _step_one_lost_to_n2(c, members, spec)
        for m in ("n0", "n1"):
            c.commands[m].put(("allreduce", {**spec, "seed": 3}))
        kind, _, info = c._reply("n2")
        assert kind == "result", info
        assert info["result"].tobytes() == got.tobytes()  # the step the others applied
        assert info["caught_up"] == 1 and info["input_intact"]
        c.commands["n2"].put(("allreduce", {**spec, "seed": 3}))
        step2 = {m: c._reply(m) for m in members}
        _check({m: (k, i) for m, (k, _, i) in step2.items()},
               _reference(members, numel, 3, "mean", "float32"), 1e-5, 1e-5)  # fmt: skip


def test_a_member_that_caught_up_passes_the_result_on_to_its_child() -> None:
    """The root's broadcast of step 1 to n2 is lost; n3 hangs off n2. n2 and n3 stay in step 1
    while the root and n1 run step 2. n2's quiet probe gets it the root's kept result, and n2
    passes that on to n3, which had sent n2 its part and waits for the result from n2 (and
    n2, having caught up, sends nothing more in step 1). n3 never probes here (its quiet probe
    is longer than the round's timeout): without the pass-on it timed out."""
    members = ["n0", "n1", "n2", "n3"]
    numel = 20_000
    quiet = {"n2": 0.3, "n3": 600.0}
    with cluster(4, quiet_probe_s=quiet) as c:
        c.topology(members, "tree", parent={"n0": None, "n1": "n0", "n2": "n0", "n3": "n2"})
        spec = {"numel": numel, "op": "mean", "timeout_s": 30.0, "keep": True}
        _check(c.allreduce(members, seed=1, **spec),
               _reference(members, numel, 1, "mean", "float32"), 1e-5, 1e-5)  # fmt: skip
        c.send(["n0"], "lose_frames_to", {"peer": "n2", "step": 1})
        for m in members:
            c.commands[m].put(("allreduce", {**spec, "seed": 2}))
        ahead = {m: c._reply(m) for m in ("n0", "n1")}
        assert {m: k for m, (k, _, _) in ahead.items()} == {"n0": "result", "n1": "result"}
        got = ahead["n0"][2]["result"]
        for m in ("n0", "n1"):
            c.commands[m].put(("allreduce", {**spec, "seed": 3}))
        behind = {m: c._reply(m) for m in ("n2", "n3")}
        for m, (kind, _, info) in behind.items():
            assert kind == "result", (m, info)
            assert info["result"].tobytes() == got.tobytes(), m  # the step the others applied
            assert info["caught_up"] == 1 and info["input_intact"], (m, info)
        assert behind["n2"][2]["results_sent"] == 1  # passed on to n3 only
        for m in ("n2", "n3"):
            c.commands[m].put(("allreduce", {**spec, "seed": 3}))
        step2 = {m: c._reply(m) for m in members}
        _check({m: (k, i) for m, (k, _, i) in step2.items()},
               _reference(members, numel, 3, "mean", "float32"), 1e-5, 1e-5)  # fmt: skip


def test_a_former_neighbour_whose_result_was_lost_gets_it_after_the_topology_changed() -> None:
    """The root's broadcast of step 1 to n2 is lost, and the root and n1 move on to a new
    topology in which n2 hangs off n1: the root is no longer n2's neighbour. n2, still in step 1
    of the old epoch, asks its old parent (a BEHIND notice); the root answers through a
    notice-only socket with its kept result; n2 completes step 1, takes the new topology and all
    three run step 2. Before, the root had no link to answer on (and closing the removed link
    dropped what was still queued to n2): n2 stayed a step behind, every side waiting on
    another step until the timeout."""
    members = ["n0", "n1", "n2"]
    numel = 20_000
    with cluster(3) as c:
        spec = {"numel": numel, "op": "mean", "timeout_s": 60.0, "keep": True}
        got = _step_one_lost_to_n2(c, members, spec)
        c.epoch += 1
        arg = {"kind": "tree", "members": tuple(members), "epoch": c.epoch,
               "addresses": {m: c.addresses[m] for m in members},
               "parent": {"n0": None, "n1": "n0", "n2": "n1"}}  # fmt: skip
        assert all(k == "ok" for k, _ in c.send(["n0", "n1"], "topology", arg).values())
        for m in ("n0", "n1"):
            c.commands[m].put(("allreduce", {**spec, "seed": 3}))
        kind, _, info = c._reply("n2")  # n2 completes step 1 with the root's kept result
        assert kind == "result", info
        assert info["result"].tobytes() == got.tobytes()
        assert info["caught_up"] == 1
        assert c.send(["n2"], "topology", arg)["n2"][0] == "ok"
        c.commands["n2"].put(("allreduce", {**spec, "seed": 3}))
        step2 = {m: c._reply(m) for m in members}
        _check({m: (k, i) for m, (k, _, i) in step2.items()},
               _reference(members, numel, 3, "mean", "float32"), 1e-5, 1e-5)  # fmt: skip


# ---------------------------------------------------------------------------- in-process


def _addrs(names: str) -> dict[str, str]:
    return {n: f"tcp://127.0.0.1:{40000 + i}" for i, n in enumerate(names)}


def test_update_topology_edits_links_in_place() -> None:
    addrs = _addrs("abcd")
    with Communicator(CommunicatorConfig(node_id="a")) as comm:
        addrs["a"] = comm.address
        comm.update_topology(Topology("ring", tuple("abcd"), addrs, 1, ring_order=tuple("abcd")))
        sock_b, sock_d = comm.link_socket("b"), comm.link_socket("d")
        assert sock_b is not None and sock_d is not None and comm.link_socket("c") is None
        comm.update_topology(Topology("ring", tuple("abcd"), addrs, 2, ring_order=tuple("abdc")))
        assert comm.link_socket("b") is sock_b  # unchanged link: same socket object
        assert comm.link_socket("d") is None and sock_d.closed  # dead link closed
        assert comm.link_socket("c") is not None  # new link opened
        tree = Topology("tree", tuple("abcd"), addrs, 3, parent={"a": None, "b": "a", "c": "b",
                                                                 "d": "b"})  # fmt: skip
        comm.update_topology(tree)
        assert comm.link_socket("b") is sock_b and comm.link_socket("c") is None
        ring = tuple("abcd")
        with pytest.raises(ValueError, match="backwards"):
            comm.update_topology(Topology("ring", ring, addrs, 2, ring_order=ring))
        with pytest.raises(ValueError, match="different"):
            comm.update_topology(Topology("ring", ring, addrs, 3, ring_order=ring))
        with pytest.raises(ValueError, match="not a member"):
            comm.update_topology(Topology("ring", tuple("bcd"), addrs, 4, ring_order=tuple("bcd")))


def test_single_member_and_step_ordering() -> None:
    with Communicator(CommunicatorConfig(node_id="a")) as comm:
        with pytest.raises(ValueError, match="no topology"):
            comm.allreduce(torch.ones(3))
        comm.update_topology(Topology("ring", ("a",), {"a": comm.address}, 5, ring_order=("a",)))
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        assert torch.equal(comm.allreduce(x, "mean", step=10), x)
        with pytest.raises(ValueError, match="does not follow"):
            comm.allreduce(x, step=10)
        out = torch.empty_like(x)
        assert comm.allreduce(x, "sum", out=out) is out and torch.equal(out, x)
        with pytest.raises(ValueError, match="op must be"):
            comm.allreduce(x, "max")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            comm.allreduce(torch.ones(3, dtype=torch.int64))


def test_reported_dead_neighbour_fails_fast_with_input_intact() -> None:
    addrs = _addrs("ab")
    with Communicator(CommunicatorConfig(node_id="a")) as comm:
        addrs["a"] = comm.address
        comm.update_topology(Topology("ring", ("a", "b"), addrs, 1, ring_order=("a", "b")))
        comm.report_dead("b")
        x = torch.ones(100)
        with pytest.raises(PeerFailure) as info:
            comm.allreduce(x, timeout_s=30.0)
        assert info.value.peer == "b" and not info.value.timed_out
        assert torch.equal(x, torch.ones(100))
        comm.update_topology(Topology("ring", ("a", "b"), addrs, 2, ring_order=("a", "b")))
        with pytest.raises(PeerTimeout) as timeout:  # a PeerFailure and a ChaosTimeout
            comm.allreduce(x, timeout_s=0.2)
        assert timeout.value.peer == "b" and isinstance(timeout.value, TimeoutError)


def _connect_and_wait_for_handshake(sock: zmq.Socket[bytes], address: str) -> None:
    """Connects ``sock`` and returns once its ZMTP handshake succeeded, so that what it sends
    next is delivered during the next allreduce's short window, not after it."""
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(address)
        if not mon.poll(timeout=10_000):
            raise AssertionError(f"no handshake with {address} within 10 s")
        recv_monitor_message(mon)
    finally:
        sock.disable_monitor()
        mon.close(linger=0)


@contextmanager
def _ring_ab_with_raw_peer(routing_id: bytes) -> Iterator[tuple[Communicator, zmq.Socket]]:
    """Member ``a`` of the ring (a, b) at epoch 1, and a raw DEALER that sends to it as
    ``routing_id`` (``b`` to act as the neighbour, anything else as a stranger)."""
    addrs = _addrs("ab")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with Communicator(CommunicatorConfig(node_id="a")) as comm:
        addrs["a"] = comm.address
        comm.update_topology(Topology("ring", ("a", "b"), addrs, 1, ring_order=("a", "b")))
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.ROUTING_ID, routing_id)
        try:
            _connect_and_wait_for_handshake(raw, comm.address)
            yield comm, raw
        finally:
            raw.close(linger=0)


def test_malformed_and_unknown_frames_are_dropped() -> None:
    with _ring_ab_with_raw_peer(b"mallory") as (comm, stranger):
        good = encode_header(Op.RING_REDUCE_SCATTER, torch.float32, 0, 1, 0, 0, 1)
        stranger.send_multipart([b"\x09" * HEADER_BYTES, b"abcd"])  # bad version
        stranger.send_multipart([b"short"])  # wrong part count
        stranger.send_multipart([good, b"abcd"])  # right key, not a neighbour
        with pytest.raises(PeerTimeout):
            comm.allreduce(torch.ones(4), timeout_s=0.5, step=0)
        assert comm.stats.dropped_malformed == 2
        assert comm.stats.dropped_unknown_peer == 1


def test_an_abort_that_came_before_its_round_fails_the_round() -> None:
    """A neighbour's abort of a step this node has not started yet is kept with the early
    frames; when the step starts it fails it (PeerFailure), not as a protocol error."""
    with _ring_ab_with_raw_peer(b"b") as (comm, b):
        b.send_multipart([encode_header(Op.ABORT, torch.float32, 0, 1, 5, 0, 0), b"c"])
        with pytest.raises(PeerTimeout):  # step 4: b sends nothing; its abort of 5 is kept
            comm.allreduce(torch.ones(4), timeout_s=0.5, step=4)
        assert comm.stats.early_buffered == 1
        with pytest.raises(PeerFailure) as info:
            comm.allreduce(torch.ones(4), timeout_s=5.0, step=5)
        assert info.value.peer == "c" and not info.value.timed_out


def test_header_roundtrip_and_validation() -> None:
    raw = encode_header(Op.TREE_DOWN, torch.bfloat16, 3, 7, 11, 13, 17)
    h = decode_header(raw)
    assert (h.op, h.dtype, h.seg, h.key, h.chunk, h.nelem) == (
        Op.TREE_DOWN, torch.bfloat16, 3, (7, 11), 13, 17)  # fmt: skip
    with pytest.raises(ProtocolError, match="version"):
        decode_header(bytes([FRAME_VERSION + 1]) + raw[1:])
    with pytest.raises(ProtocolError, match="op"):
        decode_header(raw[:1] + b"\x63" + raw[2:])
    with pytest.raises(ProtocolError, match="bytes"):
        decode_header(raw[:-1])
    with pytest.raises(ValueError):
        encode_header(Op.TREE_UP, torch.int32, 0, 0, 0, 0, 0)


def test_topology_validation_and_sync_policy_conversion() -> None:
    addrs = _addrs("abcd")
    with pytest.raises(ValueError, match="ring_order"):
        Topology("ring", tuple("abc"), addrs, 1, ring_order=("a", "b"))
    with pytest.raises(ValueError, match="root"):
        Topology("tree", tuple("ab"), addrs, 1, parent={"a": "b", "b": "a"})
    with pytest.raises(ValueError, match="cycle"):
        Topology("tree", tuple("abcd"), addrs, 1, parent={"a": None, "b": "c", "c": "b", "d": "a"})
    with pytest.raises(ValueError, match="address"):
        Topology("ring", ("a", "z"), addrs, 1, ring_order=("a", "z"))
    links = [LinkEstimate(a, b, 1e9 if {a, b} != {"a", "c"} else 1e6)
             for a, b in [("a", "b"), ("b", "c"), ("c", "d"), ("d", "a"), ("a", "c")]]  # fmt: skip
    ring = topology_from_sync_policy(build_sync_policy("abcd", links), addrs, epoch=4)
    assert ring.kind == "ring" and ring.epoch == 4 and ring.neighbours("a") == {"b", "d"}
    star = [LinkEstimate("a", x, 1e9) for x in "bcd"]
    tree = topology_from_sync_policy(build_sync_policy("abcd", star), addrs, epoch=5)
    assert tree.kind == "tree" and tree.root == "a" and tree.neighbours("a") == {"b", "c", "d"}
    assert tree.neighbours("b") == {"a"}


def test_allreduce_bench_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "allreduce.json"
    proc = subprocess.run([sys.executable, "-m", "chaos.bench.cli", "allreduce", "--nodes", "2",
                           "--sizes", "64KB,1MB", "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert set(data["sizes"]) == {"64KB", "1MB"}
    for row in data["sizes"].values():
        assert row["chaos_s"] > 0 and row["gloo_s"] > 0
        assert row["ratio"] == pytest.approx(row["gloo_s"] / row["chaos_s"])
        assert row["chaos_s"] == min(row["ring_s"], row["tree_s"])
    assert "ratio" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "chaos.bench.cli", "allreduce", "--sizes", "3MiB"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode != 0 and "bad size" in bad.stderr


def _split_round(
    epoch1: dict[str, Any], epoch2: dict[str, Any], movers: list[str], spec: dict[str, Any]
) -> None:
    """Runs one step with ``movers`` under epoch 2 and the other members still under epoch 1.

    The members left behind must give up their round (``interrupted``, told of epoch 2, input
    intact) rather than wait for the step timeout; after they move on too, everyone completes
    the step and matches the single-process reference.
    """
    members = ["n0", "n1", "n2", "n3"]
    behind = [m for m in members if m not in movers]
    with cluster(4) as c:
        c.topology(members, **epoch1)  # epoch 1
        _check(c.allreduce(members, numel=1_000, seed=1, op="sum"),
               _reference(members, 1_000, 1, "sum", "float32"), 1e-5, 1e-5)  # fmt: skip
        c.send(members, "interrupt_on_newer_round", None)
        topo2 = {"members": tuple(members), "epoch": 2, **epoch2,
                 "addresses": {m: c.addresses[m] for m in members}}  # fmt: skip
        c.send(movers, "topology", topo2)
        for m in members:
            c.commands[m].put(("allreduce", spec))
        for m in behind:
            kind, _, info = c._reply(m)
            assert kind == "interrupted" and info["newer"] == 2, (m, kind, info)
            assert info["input_intact"], (m, info)
        c.send(behind, "topology", topo2)
        for m in behind:
            c.commands[m].put(("allreduce", spec))
        replies = {m: c._reply(m) for m in members}
        want = _reference(members, spec["numel"], spec["seed"], spec["op"], "float32")
        _check({m: (k, i) for m, (k, _, i) in replies.items()}, want, 1e-5, 1e-5)


def test_members_split_across_an_epoch_boundary_are_told_and_rerun() -> None:
    """The root runs a step under epoch 2 while the others still run it under epoch 1: the
    others learn of the newer round (NEWER frames, passed on down the tree) and abandon theirs
    instead of waiting for the step timeout; rerun under epoch 2, everyone completes."""
    tree = {"kind": "tree", **TREE}
    _split_round(tree, tree, ["n0"], {"numel": 20_000, "seed": 3, "op": "mean", "timeout_s": 60.0})


def test_a_split_where_no_frame_crosses_is_resolved_by_the_movers_notice() -> None:
    """n2 and n3 run a step under epoch 2 while n0 and n1 still run it under epoch 1. In the
    epoch-1 tree n1 waits for its children n2 and n3, and n0 for n1, so neither sends a frame;
    in the epoch-2 tree n3 sends only to n2, which waits for n0. No data frame ever crosses the
    two groups. The movers' first round in epoch 2 tells their epoch-1 neighbours, so the others
    give up their round instead of waiting for the step timeout; rerun under epoch 2, everyone
    completes."""
    chain = {"kind": "tree", "parent": {"n0": None, "n1": "n0", "n2": "n1", "n3": "n1"}}
    crossed = {"kind": "tree", "parent": {"n2": None, "n3": "n2", "n0": "n2", "n1": "n0"}}
    spec = {"numel": 12_000, "seed": 9, "op": "sum", "timeout_s": 60.0}
    _split_round(chain, crossed, ["n2", "n3"], spec)


def test_a_member_left_behind_is_told_even_when_no_longer_a_neighbour() -> None:
    """n3 still runs a ring step under epoch 1 and sends to n0; under epoch 2 (a chain tree)
    n0 has no link to n3, yet tells it (through a notice-only socket) to give up its round."""
    ring = {"kind": "ring", "ring_order": ("n0", "n1", "n2", "n3")}
    chain = {"kind": "tree", "parent": {"n0": None, "n1": "n0", "n2": "n1", "n3": "n2"}}
    spec = {"numel": 8_000, "seed": 5, "op": "sum", "timeout_s": 60.0}
    _split_round(ring, chain, ["n0", "n1", "n2"], spec)


def test_a_neighbour_that_reconnected_between_rounds_does_not_fail_the_next_one() -> None:
    """A connection dropped during one round and came back before the next: the next round
    must not fail at once on the stale drop (a soak saw a re-entering member fail every
    rerun within a millisecond, 'connection lost', on a neighbour that was up again)."""
    b = _StandIn()
    try:
        with Communicator(CommunicatorConfig(node_id="a")) as comm:
            addrs = {"a": comm.address, "b": b.address}
            comm.update_topology(Topology("ring", ("a", "b"), addrs, 1, ring_order=("a", "b")))
            b.wait_connected("a never connected to b")
            b.drop()  # b goes away mid-round: the round fails on the lost connection
            with pytest.raises(PeerFailure) as lost:
                comm.allreduce(torch.ones(4), timeout_s=10.0, step=0)
            assert lost.value.peer == "b" and not lost.value.timed_out
            b.come_back()  # at the same address, before the next round
            b.wait_connected("a never reconnected to b")
            # b is up but sends nothing: a round waits for it. One that starts while a's end
            # of the handshake is still under way may fail on the drop; a later one must not
            outcomes = []
            for epoch in range(2, 12):
                comm.update_topology(
                    Topology("ring", ("a", "b"), addrs, epoch, ring_order=("a", "b")))
                with pytest.raises(PeerFailure) as failed:
                    comm.allreduce(torch.ones(4), timeout_s=0.5, step=0)
                outcomes.append(failed.value.timed_out)
                if failed.value.timed_out:
                    break
            assert outcomes[-1], f"every round failed on the old drop: {outcomes}"
    finally:
        b.close()


class _StandIn:
    """Neighbour ``b`` played by a bare ROUTER on loopback, which can go away and come back at
    the same address; its monitor reports each completed handshake."""

    def __init__(self) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._open(None)

    def _open(self, address: str | None) -> None:
        self.sock = self._ctx.socket(zmq.ROUTER)
        self._mon = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        if address is None:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            self.address = f"tcp://127.0.0.1:{port}"
            return
        deadline = time.monotonic() + 10.0  # a socket just closed may hold it a moment longer
        while True:
            try:
                self.sock.bind(address)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def wait_connected(self, failure: str) -> None:
        """Waits (10 s at most) for a peer's handshake; raises ``AssertionError(failure)``."""
        if not self._mon.poll(timeout=10_000):
            raise AssertionError(failure)

    def ids_seen(self, wait_s: float) -> set[bytes]:
        """The routing ids of every message received within ``wait_s``."""
        ids: set[bytes] = set()
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(timeout=int(left * 1000)):
                ids.add(self.sock.recv_multipart()[0])
        return ids

    def drop(self) -> None:
        """Goes away: the connections to it drop."""
        self.sock.disable_monitor()
        self.close()

    def come_back(self) -> None:
        """Binds its address again, with a new socket."""
        self._open(self.address)

    def close(self) -> None:  # noqa: D102
        self._mon.close(linger=0)
        self.sock.close(linger=0)


def test_a_link_whose_connection_dropped_goes_out_under_a_new_id() -> None:
    """ZeroMQ connects a dropped DEALER again under the same routing id, which the neighbour's
    ROUTER may still hold for the old connection (half-open there; with a cluster key it never
    hands an id over, and drops the new connection's frames: a demo's members all waited on a
    round after a partition healed). So a lost link's socket is replaced before the next round,
    and the neighbour sees a new id."""
    b = _StandIn()
    try:
        with Communicator(CommunicatorConfig(node_id="a")) as comm:
            addrs = {"a": comm.address, "b": b.address}
            comm.update_topology(Topology("ring", ("a", "b"), addrs, 1, ring_order=("a", "b")))
            with pytest.raises(PeerTimeout):  # b never answers; a's frames reach it
                comm.allreduce(torch.ones(4), timeout_s=0.5, step=0)
            first = b.ids_seen(1.0)
            assert first and {member_of(i) for i in first} == {"a"}
            b.drop()  # the connection drops; b comes back at the same address
            b.come_back()
            b.wait_connected("a never reconnected to b")
            # a round may start before a's monitor has reported the drop and the reconnection:
            # it then fails on the lost connection, and the next one goes out on a new socket
            with pytest.raises(PeerFailure):
                comm.allreduce(torch.ones(4), timeout_s=0.5, step=1)
            b.ids_seen(0.5)
            with pytest.raises(PeerFailure):
                comm.allreduce(torch.ones(4), timeout_s=0.5, step=2)
            later = b.ids_seen(1.0)
            assert later and {member_of(i) for i in later} == {"a"}
            assert not later & first, "a's frames still go out under the id of the old connection"
            assert comm.stats.links_renewed == 1
    finally:
        b.close()


class _NoLinks:
    """No data links: every peer is told through a notice-only socket."""

    def socket(self, peer: str) -> zmq.Socket | None:
        return None

    def sockets(self) -> list[zmq.Socket]:
        return []


def test_notice_sockets_unused_for_two_topologies_are_closed() -> None:
    """A trainer told former neighbours of its moves through notice sockets it kept for
    every member: a soak saw its open files grow by a third at an unchanged cluster size."""
    from chaos.collectives.config import CollectiveStats
    from chaos.collectives.notices import PeerNotices

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    notices = PeerNotices(ctx, "a", CollectiveStats(), _NoLinks())
    addrs = _addrs("abc")
    try:
        notices.retain(addrs, 1)
        notices.tell_newer("b", (1, 5))
        notices.tell_newer("c", (1, 5))
        assert notices.notice_sockets == 2
        notices.retain(addrs, 2)  # used in the topology before: kept
        notices.new_round()
        notices.tell_newer("c", (2, 6))
        assert notices.notice_sockets == 2
        notices.retain(addrs, 2)  # the same topology again changes nothing
        assert notices.notice_sockets == 2
        notices.retain(addrs, 3)  # b unused since epoch 1: closed; c used in epoch 2: kept
        assert notices.notice_sockets == 1
        notices.retain({k: v for k, v in addrs.items() if k != "c"}, 4)  # c left: closed
        assert notices.notice_sockets == 0
    finally:
        notices.close()
