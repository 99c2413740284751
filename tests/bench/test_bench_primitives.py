"""``chaos-bench primitives`` runs real trainer processes and writes the JSON its docs promise.

One run with tiny settings: the bench starts its trainers (each with an embedded daemon) on
loopback, applies each primitive once and must exit 0 with a well-formed JSON file. No timing
is asserted. The bench reaps its workers itself; if it hangs or fails, the test stops it and
kills every process it left.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.bench.primitives import PrimitivesConfig
from chaos.bench.stall import NULL_DRAWS, Primitive, null_stall_s, span
from chaos.errors import ConfigError
from chaos.launch import stop_tree

TIMEOUT_S = 300.0


def test_primitives_bench_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "primitives.json"
    argv = [sys.executable, "-m", "chaos.bench.cli", "primitives", "--nodes", "3"]
    argv += ["--repeats", "1", "--settle-steps", "4", "--json", str(out)]
    argv += ["--logs", str(tmp_path / "logs")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        stop_tree(proc, signal.SIGKILL, grace_s=10.0)  # it and every worker it left
    assert proc.returncode == 0, stdout[-4000:]
    data = json.loads(out.read_text())
    for key in ("scale_in_ms", "connect_link_ms", "disconnect_link_ms"):
        figure = data[key]
        assert {"p50", "p99", "n", "samples"} <= set(figure), figure
        assert figure["n"] == len(figure["samples"]) >= 1
        assert all(math.isfinite(x) for x in figure["samples"])
        assert figure["p50"] <= figure["p99"]
    assert data["baseline_step_ms"] > 0
    assert data["baseline_steps"] > 0
    assert set(data["control_ms"]) == {"scale_in", "connect_link", "disconnect_link"}
    assert all(v["n"] >= 1 for v in data["control_ms"].values())
    assert isinstance(data["failures"], list) and data["attempts"] >= 1
    assert set(data["null_ms"]) == set(data["added_p50_ms"]) == set(data["control_ms"])
    for kind, null in data["null_ms"].items():
        assert null["n"] == len(null["samples"]) and all(math.isfinite(x) for x in null["samples"])
        # each sample draws NULL_DRAWS placebos, or none when no quiet stretch qualifies
        assert null["n"] % NULL_DRAWS == 0 and null["n"] <= NULL_DRAWS * data[f"{kind}_ms"]["n"]
        if null["n"]:
            want = data[f"{kind}_ms"]["p50"] - null["p50"]
            assert math.isclose(data["added_p50_ms"][kind], want, rel_tol=1e-9, abs_tol=1e-12)
    assert "stall p50" in stdout and "baseline step" in stdout and "null p50" in stdout
    # every connect-link's bandwidth probe was found in the daemons' event logs (the span of
    # its stall covers the steps the probe ran beside)
    assert data["probes_measured"] == data["connect_link_ms"]["n"]


def test_null_estimator_takes_the_worst_member_over_quiet_runs() -> None:
    """The placebo applies the stall estimator to steps every member ran undisturbed."""
    quiet = {
        "a": {10: 0.030, 11: 0.020, 12: 0.020, 20: 0.050},
        "b": {10: 0.020, 11: 0.025, 12: 0.020, 21: 0.050},
    }
    # a spans 2 steps, b spans 1: only step 10 (a: 10, 11; b: 10) and 11 (a: 11, 12; b: 11) fit
    first = null_stall_s(quiet, {"a": 2, "b": 1}, baseline_s=0.020, pick=0)
    assert first is not None and math.isclose(first, 0.010)  # a: 0.050 - 0.040
    second = null_stall_s(quiet, {"a": 2, "b": 1}, baseline_s=0.020, pick=1)
    assert second is not None and math.isclose(second, 0.005)  # b: 0.025 - 0.020
    assert null_stall_s(quiet, {"a": 4, "b": 1}, baseline_s=0.020, pick=0) is None
    assert null_stall_s(quiet, {"c": 1}, baseline_s=0.020, pick=0) is None


def test_a_connect_links_span_covers_the_steps_its_probe_ran_beside() -> None:
    """The request's step, the install step, and every later step that began before the new
    link's probe ended."""

    def step(k: int, epoch: int) -> dict[str, float]:
        return {"step": k, "epoch": epoch, "t0": 10.0 + k, "t1": 10.9 + k}

    steps = [step(0, 5), step(1, 5), step(2, 6), step(3, 6), step(4, 6), step(5, 6)]
    p = Primitive("connect_link", t_req=11.5, control_s=0.1, survivors=["a"], epoch_after=6)
    # no probe seen: the step the request came in (1) and the install (2)
    assert [r["step"] for r in span(steps, p, "a")] == [1, 2]
    p.t_probed = 13.5  # the probe ended during step 3
    assert [r["step"] for r in span(steps, p, "a")] == [1, 2, 3]
    p.t_probed = 12.5  # within the install step itself
    assert [r["step"] for r in span(steps, p, "a")] == [1, 2]
    # a request made between two steps: the install step is the first one it could slow
    p.t_req = 11.95
    assert [r["step"] for r in span(steps, p, "a")] == [2]


def test_the_bench_config_refuses_bad_values_and_passes_settings_to_the_workers(
    tmp_path: Path,
) -> None:
    for bad in (
        {"nodes": 2},
        {"repeats": 0},
        {"settle_steps": 1},
        {"compute_s": -0.1},
        {"compute_s": float("nan")},
        {"timeout_s": 0.0},
    ):
        with pytest.raises(ConfigError):
            PrimitivesConfig(**bad)  # type: ignore[arg-type]
    toml = tmp_path / "d.toml"
    toml.write_text("bandwidth_probe_bytes = 65536\n")
    args = PrimitivesConfig(compute_s=0.01, policy_notices=False, daemon_config=toml).worker_args()
    assert args[args.index("--compute-s") + 1] == "0.01"
    assert "--no-policy-notices" in args
    assert f"--daemon-arg=--config={toml.resolve()}" in args
    assert "--no-policy-notices" not in PrimitivesConfig().worker_args()


def test_the_cli_turns_a_bad_setting_into_a_usage_error(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from chaos.bench.primitives import primitives_command

    res = CliRunner().invoke(
        primitives_command, ["--compute-s", "nan", "--json", str(tmp_path / "x.json")]
    )
    assert res.exit_code == 2 and "compute_s" in res.output
    assert not (tmp_path / "x.json").exists()
