"""Each emulated device's own CPU budget (:mod:`chaos.emulate.cpu_budget`): the limit's
arithmetic, finding the controller, and a real busy process held to its budget."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from chaos.emulate.cpu_budget import (
    PERIOD_US,
    CpuBudget,
    cleanup_stale_groups,
    find_cpu_controller,
    quota_us,
)
from chaos.emulate.fleet import EmulationError
from chaos.emulate.scenario import Scenario
from chaos.errors import ConfigError


def _has_cpu_controller() -> bool:
    try:
        find_cpu_controller()
    except EmulationError:
        return False
    return True


needs_cgroup = pytest.mark.skipif(os.geteuid() != 0 or not _has_cpu_controller(),
                                  reason="needs root and the cgroup cpu controller")  # fmt: skip


def test_the_quota_is_the_share_of_each_period() -> None:
    assert quota_us(0.25) == PERIOD_US // 4
    assert quota_us(2) == 2 * PERIOD_US
    for bad in (0, -1, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="cores"):
            quota_us(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="smallest quota"):
        quota_us(0.001)


def test_no_controller_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(EmulationError, match="cgroup cpu controller"):
        find_cpu_controller(tmp_path)
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert find_cpu_controller(tmp_path) == (tmp_path / "cpu", 1)
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    assert find_cpu_controller(tmp_path) == (tmp_path, 2)


def test_a_scenario_refuses_a_negative_budget() -> None:
    assert Scenario(cpu_per_device=0.2).cpu_per_device == 0.2
    with pytest.raises(ConfigError, match="cpu_per_device"):
        Scenario(cpu_per_device=-1.0)


@needs_cgroup
def test_a_busy_device_is_held_to_its_budget_and_its_group_goes_away() -> None:
    budget = CpuBudget(0.1)
    group = budget.group("n0")
    argv = [*budget.prefix("n0"), sys.executable, "-c", "while True: pass"]
    proc = subprocess.Popen(argv)
    try:
        p = psutil.Process(proc.pid)
        deadline = time.monotonic() + 30.0  # the first periods pass while it starts
        while (budget.throttled_s("n0") or 0.0) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert str(proc.pid) in (group / "cgroup.procs").read_text().split()
        cpu = p.cpu_times()
        used = cpu.user + cpu.system
        wall = time.time() - p.create_time()
        # a busy loop alone would use a whole core; held to 0.1 core (some slack for the
        # interpreter's start, counted before the first throttled period)
        assert used < 0.3 * wall, (used, wall)
        assert (budget.throttled_s("n0") or 0.0) >= 0.5
    finally:
        proc.kill()
        proc.wait(timeout=10)
        budget.close()
    assert not group.exists() and not group.parent.exists()


def test_cleanup_removes_only_the_groups_of_dead_runs(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    dead = cpu / "chaos-emulate-999999999"  # no such pid
    (dead / "n0").mkdir(parents=True)
    alive = cpu / f"chaos-emulate-{os.getpid()}"
    (alive / "n0").mkdir(parents=True)
    removed = cleanup_stale_groups(tmp_path)
    assert removed == [dead / "n0", dead] and not dead.exists() and (alive / "n0").exists()
