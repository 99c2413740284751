"""The data-plane attack of ``chaos-bench fuzz --key-holder``: future-epoch frames at a trainer.

A keyed trainer target is started (``python -m chaos.bench.fuzz_children trainer
--cluster-key KEY``: two members ``a`` and ``b`` allreducing in a ring without pause, each id
bound to its member's key by the topology). A key holder with a fresh keypair connects to
member ``a``'s allreduce endpoint twice (:class:`~chaos.bench.forged_frames.KeyHolderSocket`),
once under ``b``'s id and once under ``mallory``'s (no member), and every ``round_s`` for
``attack_s`` sends each :data:`FRAMES_PER_ROUND` data frames
(:func:`~chaos.bench.forged_frames.data_frame`) of epochs ahead of the trainer's: + 1,
+ 2**20, 2**32 and 2**64 - 1.

**Accepted**: an allreduce round failed during the attack (a forged frame got into a round) or
the trainer exited. **Wedged**: no round completed within :data:`PROGRESS_TIMEOUT_S` after the
attack. Also reported: the trainer's RSS before and after (goal: within 10 %) and member
``a``'s data-plane counters over the attack (frames dropped as unauthenticated, kept early,
dropped for being too many or too far ahead).
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from chaos.bench.fuzz_children import ROUND_TIMEOUT_S
from chaos.errors import ChaosError, ChaosTimeout
from chaos.launch import kill_and_reap, spawn_worker, wait_until
from chaos.security import ClusterKey, Security

__all__ = ["FRAMES_PER_ROUND", "TRAINER_ATTACK", "run_trainer_attack"]

TRAINER_ATTACK = "trainer_future_epoch"
"""The attack kind's name."""
FRAMES_PER_ROUND = 32
"""Frames each of the two forging sockets sends per round."""
PAYLOAD_BYTES = 16 << 10
"""Payload of each forged frame (float32 zeros)."""
START_TIMEOUT_S = 120.0
"""Longest wait for the trainer target to serve and complete its first round."""
SEND_TIMEOUT_S = 2.0
"""Longest wait for one forged frame to be queued."""
PROGRESS_TIMEOUT_S = ROUND_TIMEOUT_S + 10.0
"""Longest wait after the attack for another round (a round a forged frame disturbed times
out after :data:`~chaos.bench.fuzz_children.ROUND_TIMEOUT_S`)."""
SETTLE_S = 2.0
"""Pause after the attack before the RSS is read."""
RSS_TOLERANCE = 0.10
"""An RSS after the attack within this fraction of the one before counts as back."""
_COUNTERS = (
    "frames_received", "dropped_unauthenticated", "dropped_stale", "dropped_malformed",
    "dropped_unknown_peer", "dropped_early_overflow", "dropped_early_bytes", "dropped_early_far",
    "early_buffered", "handshake_failures", "failures",
)  # fmt: skip


def _read(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return {}


def _rss(pid: int) -> int:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


def _epochs(current: int) -> tuple[int, ...]:
    return (current + 1, current + (1 << 20), 1 << 32, (1 << 64) - 1)


def _attack(
    address: str, key: ClusterKey, stats: Path, attack_s: float, round_s: float
) -> tuple[Counter[str], int, int, int]:
    """Sends the forged frames; returns (frames by claimed id, send timeouts, rounds,
    handshakes)."""
    from chaos.bench.forged_frames import KeyHolderSocket, data_frame  # torch: only when run

    sec = Security(key)  # the cluster key and a keypair no member has
    socks = {claim: KeyHolderSocket(address, sec, claim) for claim in ("b", "mallory")}
    sent: Counter[str] = Counter()
    timeouts = rounds = 0
    payload = bytes(PAYLOAD_BYTES)
    try:
        for s in socks.values():
            try:
                s.wait_for("handshakes", 1, SEND_TIMEOUT_S * 5)
            except ChaosTimeout:
                pass  # counted below: a refused handshake leaves handshakes at 0
        end = time.monotonic() + attack_s
        while (t0 := time.monotonic()) < end:
            epochs = _epochs(int(_read(stats).get("epoch", 1)))
            for claim, s in socks.items():
                for i in range(FRAMES_PER_ROUND):
                    frame = data_frame(epochs[i % len(epochs)], i, PAYLOAD_BYTES,
                                       chunk=i % 4, payload=payload)  # fmt: skip
                    try:
                        s.send(frame, timeout_s=SEND_TIMEOUT_S)
                        sent[claim] += 1
                    except ChaosTimeout:
                        timeouts += 1
            rounds += 1
            time.sleep(max(0.0, round_s - (time.monotonic() - t0)))
        return sent, timeouts, rounds, sum(s.handshakes for s in socks.values())
    finally:
        for s in socks.values():
            s.close()


def _started(proc: Any, ready: Path, stats: Path, log: Path) -> dict[str, Any]:
    """The trainer's ready record once it has completed a round (the log's tail in the error
    when it does not in time)."""
    try:
        info = wait_until(lambda: _read(ready), START_TIMEOUT_S, "the keyed trainer to serve",
                          watch={"trainer": proc})  # fmt: skip
        wait_until(lambda: _read(stats).get("rounds", 0) >= 1, START_TIMEOUT_S,
                   "the keyed trainer's first round", watch={"trainer": proc})  # fmt: skip
    except ChaosError as exc:  # a timeout, or the trainer exited
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        raise ChaosError(f"{exc}; trainer log: {tail!r}") from exc
    return info


def run_trainer_attack(
    root: Path, key_path: Path, attack_s: float, round_s: float
) -> dict[str, Any]:
    """Starts the keyed trainer target, sends it future-epoch frames, and checks it.

    Args:
        root: A directory of its own (ready, stats and log files).
        key_path: The cluster key file the trainer and the key holder use.
        attack_s: Seconds the attack lasts.
        round_s: Seconds between two rounds of frames.

    Returns:
        The attack's JSON record (the keys of the daemon attacks' records, and ``trainer``).

    Raises:
        ChaosError: the trainer did not serve and complete a round within
            :data:`START_TIMEOUT_S`, or it exited while it started (the message ends with its
            log's tail).
    """
    root.mkdir(parents=True, exist_ok=True)
    ready, stats = root / "trainer.ready.json", root / "trainer.stats.json"
    argv = [sys.executable, "-m", "chaos.bench.fuzz_children", "trainer", "--ready", str(ready),
            "--stats", str(stats), "--cluster-key", str(key_path)]  # fmt: skip
    proc = spawn_worker(argv, log_path=root / "trainer.log", term_on_parent_death=True)
    try:
        info = _started(proc, ready, stats, root / "trainer.log")
        before = _read(stats)
        rss_before = _rss(proc.pid)
        key = ClusterKey.load(key_path)
        sent, timeouts, rounds, handshakes = _attack(info["address"], key, stats, attack_s, round_s)
        during = _read(stats)
        start = time.monotonic()
        try:
            wait_until(lambda: _read(stats).get("rounds", 0) > during.get("rounds", 0),
                       PROGRESS_TIMEOUT_S, "another round", watch={"trainer": proc})  # fmt: skip
            recovered: float | None = round(time.monotonic() - start, 2)
        except ChaosError:
            recovered = None
        time.sleep(SETTLE_S)
        rss_after = _rss(proc.pid)
        after = _read(stats)
        exited = proc.poll() is not None
    finally:
        kill_and_reap([proc], group=True, timeout_s=10.0)
    rec = _record(before, during, after, sent, timeouts, rounds, handshakes, recovered,
                  exited, rss_before, rss_after)  # fmt: skip
    rec["trainer"]["pid"] = proc.pid
    return rec


def _record(
    before: dict[str, Any], during: dict[str, Any], after: dict[str, Any], sent: Counter[str],
    timeouts: int, rounds: int, handshakes: int, recovered: float | None, exited: bool,
    rss_before: int, rss_after: int,
) -> dict[str, Any]:  # fmt: skip
    failures = int(during.get("failures", 0)) - int(before.get("failures", 0))
    a0, a1 = before.get("a", {}), after.get("a", {})
    ratio = rss_after / rss_before if rss_before and rss_after else None
    return {
        "frames_sent": sum(sent.values()),
        "rounds": rounds,
        "frames_by_type": {f"data_frame_as_{k}": v for k, v in sorted(sent.items())},
        "send_timeouts": timeouts,
        "refusals": {},  # the data plane answers nothing: it drops
        "replies": {},
        "accepted": int(failures > 0) + int(exited),
        "accepted_by": {"round_failures": failures, "exited": exited},
        "wedged": recovered is None,
        "recovered_after_s": recovered,
        "events": {},
        "scene": {
            "claims": ["b", "mallory"],
            "epoch": int(before.get("epoch", 1)),
            "handshakes": handshakes,
        },  # fmt: skip
        "before": {"rounds": before.get("rounds"), "epoch": before.get("epoch")},
        "after": {"rounds": after.get("rounds"), "epoch": after.get("epoch")},
        "damaged": False,
        "cluster": None,
        "trainer": {
            "member_a": {k: int(a1.get(k, 0)) - int(a0.get(k, 0)) for k in _COUNTERS if k in a1},
            "rounds_during_attack": int(during.get("rounds", 0)) - int(before.get("rounds", 0)),
            "rss_before_bytes": rss_before,
            "rss_after_bytes": rss_after,
            "rss_ratio": round(ratio, 4) if ratio is not None else None,
            "rss_within_10pct": ratio is not None and abs(ratio - 1) <= RSS_TOLERANCE,
        },
    }
