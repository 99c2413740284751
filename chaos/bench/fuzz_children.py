"""The target processes of ``chaos-bench fuzz``: ``python -m chaos.bench.fuzz_children ROLE``.

* ``shard``: a donor's :class:`~chaos.replication.server.ShardServer` serving a small published
  training state;
* ``trainer``: two :class:`~chaos.collectives.Communicator` members in one process allreducing
  in a ring without pause, with payload lanes.

Each writes its endpoints to a ready file once it serves (the bench then fuzzes it) and runs
until it is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ROUND_TIMEOUT_S", "main"]

ROUND_TIMEOUT_S = 10.0
"""The trainer target's allreduce timeout. Without a key a stranger can send frames under a
member's id (an abort, a newer epoch): the round fails after at most this long and the members
start the next one, so the bench waits longer than this for a round after the run."""


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _serve_shards(ready: Path, stop: threading.Event) -> None:
    """The shard-server target: serves a small published state until ``stop``."""
    import torch

    from chaos.replication.server import ShardServer
    from chaos.replication.state import TrainingState

    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    with ShardServer() as server:
        server.publish(TrainingState.capture(model, opt, step=0, epoch=1), epoch=1, step=0)
        _write_json(ready, {"address": server.address, "epoch": 1, "pid": os.getpid()})
        while not stop.wait(0.5):
            pass


def _train(ready: Path, stats: Path, stop: threading.Event, key: Path | None = None) -> None:
    """The trainer target: two members allreduce in a ring until ``stop``; member ``a``'s stats
    go to ``stats`` twice a second. With ``key`` (a cluster key file) both members are keyed,
    each with a keypair of its own, and the topology binds each id to its member's key."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from chaos.collectives import Communicator, CommunicatorConfig, Topology
    from chaos.security import ClusterKey, Security

    cluster = ClusterKey.load(key) if key is not None else None

    def member(node_id: str) -> Communicator:
        cfg = CommunicatorConfig(
            node_id=node_id, chunk_bytes=1 << 16, timeout_s=ROUND_TIMEOUT_S, lane_min_bytes=0
        )
        return Communicator(cfg, security=Security(cluster))

    a, b = member("a"), member("b")
    epoch, rounds, failures, last_error = 1, 0, 0, None
    x = torch.ones(1 << 16)

    def install() -> None:
        keys = {"a": a.security.public_key, "b": b.security.public_key} if cluster else None
        topo = Topology(
            "ring",
            ("a", "b"),
            {"a": a.address, "b": b.address},
            epoch,
            ring_order=("a", "b"),
            keys=keys,
        )
        a.update_topology(topo)
        b.update_topology(topo)

    install()
    next_write = 0.0
    with ThreadPoolExecutor(2) as pool:
        try:
            while not stop.is_set():
                futs = [pool.submit(c.allreduce, x, "sum") for c in (a, b)]
                errors = [f.exception(timeout=60.0) for f in futs]
                if any(errors):
                    failures += 1
                    last_error = repr(next(e for e in errors if e))[:300]
                    epoch += 1
                    install()
                else:
                    rounds += 1
                now = time.monotonic()
                if now >= next_write or rounds == 1:
                    next_write = now + 0.5
                    st = a.stats
                    figures = {k: v for k, v in vars(st).items() if isinstance(v, int)}
                    _write_json(
                        stats,
                        {
                            "rounds": rounds,
                            "failures": failures,
                            "epoch": epoch,
                            "last_error": last_error,
                            "a": figures,
                        },
                    )
                    if not ready.exists():
                        # the lane listener opens at the first round; the switch exposes it
                        # for inspection (the bench fuzzes member a's port)
                        lanes = getattr(getattr(a, "_lanes", None), "lanes", None)
                        port = getattr(lanes, "port", None)
                        if port is not None:
                            _write_json(
                                ready,
                                {
                                    "address": a.address,
                                    "lane_port": port,
                                    "pid": os.getpid(),
                                    "epoch": epoch,
                                },
                            )
        finally:
            a.close()
            b.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m chaos.bench.fuzz_children {shard,trainer}``: runs one target process until it is
    killed (the bench reaps it; it gets SIGTERM when the bench dies)."""
    ap = argparse.ArgumentParser(prog="python -m chaos.bench.fuzz_children")
    ap.add_argument("role", choices=["shard", "trainer"])
    ap.add_argument("--ready", type=Path, required=True)
    ap.add_argument("--stats", type=Path, required=True)
    ap.add_argument("--cluster-key", type=Path, default=None, help="trainer: a keyed data plane")
    args = ap.parse_args(argv)
    stop = threading.Event()
    if args.role == "shard":
        _serve_shards(args.ready, stop)
    else:
        _train(args.ready, args.stats, stop, args.cluster_key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
