"""Training with the model on a device: the state stream, the shard server and pull, and the
allreduce, in real processes over real sockets.

``staged`` runs everywhere: the model stays on the CPU, but every tensor goes through the host
buffers an accelerator uses. ``cuda`` needs a GPU and is skipped without one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from chaos.launch import free_tcp_address, kill_and_reap, spawn_worker, wait_until
from chaos.replication.state import TrainingState, state_diff, state_equal

WORKER = Path(__file__).with_name("device_worker.py")
DEVICES = [
    "staged",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("device", DEVICES)
def test_a_joiner_pulls_a_device_state_and_both_train_bitwise_equal(
    device: str, tmp_path: Path
) -> None:
    founder_out, joiner_out = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    listen = free_tcp_address()
    base = [sys.executable, str(WORKER), "--device", device, "--steps", "30"]
    procs = []
    try:
        procs.append(spawn_worker(
            [*base, "--id", "a", "--listen", listen, "--out", str(founder_out), "--wait-at", "5"],
            log_path=tmp_path / "a.log",
        ))  # fmt: skip
        wait_until(lambda: len(_records(founder_out)) >= 5, 120.0, "the founder's first steps",
                   watch={"a": procs[0]})  # fmt: skip
        procs.append(spawn_worker(
            [*base, "--id", "b", "--listen", free_tcp_address(), "--join", listen,
             "--out", str(joiner_out)],
            log_path=tmp_path / "b.log",
        ))  # fmt: skip
        for p in procs:
            p.wait(timeout=180)
        assert [p.returncode for p in procs] == [0, 0]
    finally:
        kill_and_reap(procs, group=True)
    a = {r["step"]: r["digest"] for r in _records(founder_out)}
    b = {r["step"]: r["digest"] for r in _records(joiner_out)}
    common = sorted(set(a) & set(b))
    assert common and common[-1] == 30
    assert all(a[s] == b[s] for s in common), [s for s in common if a[s] != b[s]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("donor_device,joiner_device", [("cuda", "cuda"), ("cuda", "cpu"),
                                                        ("cpu", "cuda")])  # fmt: skip
def test_the_state_stream_moves_between_devices_bitwise(
    donor_device: str, joiner_device: str
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8)).to(donor_device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 5, device=donor_device)).sum().backward()
        opt.step()
    donor = TrainingState.capture(model, opt, step=3, epoch=1)
    torch.manual_seed(1)
    j_model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8))
    j_model = j_model.to(joiner_device)
    j_opt = torch.optim.Adam(j_model.parameters(), lr=1e-2)
    joiner = TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes)
    joiner.write(0, donor.read(0, donor.total_bytes))
    joiner.apply()
    for p in j_model.parameters():
        assert p.device.type == joiner_device
        assert j_opt.state[p]["exp_avg"].device.type == joiner_device
        assert j_opt.state[p]["step"].device.type == "cpu"
    again = TrainingState.capture(j_model, j_opt, step=3, epoch=1)
    assert state_equal(donor, again), state_diff(donor, again)
