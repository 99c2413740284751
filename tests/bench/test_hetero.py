"""``chaos-bench hetero``'s settings: the compute per sample is a duration in seconds, from the
config and the CLI to the argument each worker gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from chaos.bench import hetero
from chaos.bench.hetero import HeteroConfig, hetero_command
from chaos.errors import ConfigError


def test_the_config_takes_the_sample_time_in_seconds() -> None:
    assert HeteroConfig().sample_s == pytest.approx(0.001)
    assert HeteroConfig(sample_s=0.25).sample_s == 0.25
    for bad in (0.0, -0.001):
        with pytest.raises(ConfigError, match="sample_s"):
            HeteroConfig(sample_s=bad)


def test_the_cli_option_is_sample_time_in_seconds(tmp_path: Path) -> None:
    out = tmp_path / "hetero.json"
    shown = CliRunner().invoke(hetero_command, ["--help"])
    assert shown.exit_code == 0 and "--sample-time SECONDS" in shown.output
    assert "--sample-ms" not in shown.output
    for argv in (["--sample-time", "0"], ["--sample-time", "-1"], ["--sample-ms", "1"]):
        res = CliRunner().invoke(hetero_command, [*argv, "--json", str(out)])
        assert res.exit_code == 2, (argv, res.output)
        assert argv[0] in res.output
    assert not out.exists()


@pytest.mark.parametrize(("slow", "expected_s"), [(False, 0.002), (True, 0.008)])
def test_each_worker_gets_its_compute_per_sample_in_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow: bool, expected_s: float
) -> None:
    """No process is started: the worker's command line is what is checked."""
    started: list[list[str]] = []

    def record(argv: list[str], **_kw: Any) -> object:
        started.append(list(argv))
        return object()

    monkeypatch.setattr(hetero, "spawn_worker", record)
    cfg = HeteroConfig(nodes=3, global_batch=6, sample_s=0.002, slowdown=4.0)
    hetero._Cluster(tmp_path, cfg, "equal").start("n0", None, slow=slow)
    (argv,) = started
    assert float(argv[argv.index("--sample-time") + 1]) == pytest.approx(expected_s)
