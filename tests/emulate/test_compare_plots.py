"""``compare``'s summary, strategy option and plots, as pure functions over compare JSON rows
(no cluster runs here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from chaos.emulate.cli import main
from chaos.emulate.commands import compare_summary, parse_strategies
from chaos.emulate.plots import plot_compare, plot_models, plot_replication, spread_by


def _row(strategy: str, size: int, repeat: int, repl: float, scale_out: float,
         model: str = "resnet101", state: int = 1000) -> dict[str, Any]:  # fmt: skip
    return {"strategy": strategy, "from_nodes": size, "to_nodes": size + 1, "model": model,
            "state_bytes": state, "scale_out_s": scale_out, "replication_s": repl,
            "lower_bound_s": repl * 0.9, "idle_s": scale_out * size, "repeat": repeat,
            "network": "tc-shaped"}  # fmt: skip


def _runs() -> list[dict[str, Any]]:
    runs = []
    for rep, jitter in enumerate((0.0, 1.0, -0.5)):
        for size in (6, 7):
            runs.append(_row("chaos", size, rep, 2.0 + jitter, 2.5 + jitter))
            runs.append(_row("even", size, rep, 3.0 + jitter, 3.5 + jitter))
            runs.append(_row("single-source", size, rep, 4.0 + jitter, 4.5 + jitter))
            runs.append(_row("multi-source", size, rep, 5.0 + jitter, 5.5 + jitter))
            runs.append(_row("stop-resume", size, rep, 9.0, 50.0 + jitter))
    return runs


def test_spread_by_gives_median_min_max_per_group_and_size() -> None:
    runs = _runs() + [{**_row("chaos", 8, 0, 1.0, 1.0), "replication_s": None}]
    got = spread_by(runs, "strategy", "replication_s")
    assert got["chaos"] == [(6, 2.0, 1.5, 3.0), (7, 2.0, 1.5, 3.0)]  # the None row has no point
    assert got["multi-source"][0] == (6, 5.0, 4.5, 6.0)
    assert list(got) == sorted(got)


def test_summary_has_even_and_the_replication_ratios() -> None:
    summary = compare_summary(_runs())
    assert summary["median"]["even"]["6->7"]["replication_s"] == 3.0
    assert summary["ratios"]["even/chaos"]["6->7"] == pytest.approx(3.5 / 2.5)
    repl = summary["ratios"]["replication"]
    assert set(repl) == {"single-source/chaos", "multi-source/chaos", "even/chaos"}
    assert repl["single-source/chaos"]["7->8"] == pytest.approx(2.0)
    assert repl["even/chaos"]["6->7"] == pytest.approx(1.5)
    # each row's lower bound is 0.9 x its replication delay
    assert summary["ratios"]["chaos_replication_over_lower_bound_median"] == pytest.approx(1 / 0.9)


def test_strategies_option_accepts_even_and_refuses_unknown_names() -> None:
    assert parse_strategies("even,single-source, multi-source,chaos") == [
        "even", "single-source", "multi-source", "chaos"]  # fmt: skip
    assert parse_strategies(None) == ["stop-resume", "single-source", "multi-source", "chaos"]
    assert parse_strategies(None, rejoin=True) == ["chaos"]
    with pytest.raises(click.BadParameter, match="bogus"):
        parse_strategies("even,bogus")
    with pytest.raises(click.BadParameter, match="stop-resume has none"):
        parse_strategies("stop-resume", rejoin=True)


def test_compare_refuses_an_unknown_strategy_and_lists_even() -> None:
    res = CliRunner().invoke(main, ["compare", "--strategies", "bogus", "--json", "/dev/null"])
    assert res.exit_code == 2 and "'even'" in res.output


def test_replication_plot_has_the_fig15_strategies_only(tmp_path: Path) -> None:
    path = plot_replication(_runs(), tmp_path / "r.png")
    assert path.stat().st_size > 0
    paths = plot_compare(_runs(), tmp_path / "all")
    assert [p.name for p in paths] == ["compare_scale_out.png", "compare_replication.png",
                                       "compare_lower_bound.png"]  # fmt: skip
    # stop-resume alone: no replication (Fig. 15) plot and no lower-bound plot
    only_sr = [r for r in _runs() if r["strategy"] == "stop-resume"]
    assert [p.name for p in plot_compare(only_sr, tmp_path / "sr")] == ["compare_scale_out.png"]


def test_models_plot_and_the_compare_plot_command(tmp_path: Path) -> None:
    docs = []
    for model, state, delay in (("gpt2-small", 10, 5.0), ("gpt2-large", 60, 30.0)):
        runs = [_row("chaos", size, rep, delay - 1, delay + rep, model, state)
                for rep in range(3) for size in (6, 7, 8)]  # fmt: skip
        docs.append({"runs": runs})
    assert spread_by(docs[1]["runs"], "model", "scale_out_s")["gpt2-large"][0] == (
        6, 31.0, 30.0, 32.0)  # fmt: skip
    assert plot_models(docs, tmp_path / "m.png").stat().st_size > 0
    files = []
    for i, d in enumerate(docs):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(d))
    res = CliRunner().invoke(main, ["compare-plot", *map(str, files), "--out", str(tmp_path / "o"),
                                    "--name", "compare_gpt2.png"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o" / "compare_gpt2.png").stat().st_size > 0
    res = CliRunner().invoke(main, ["compare-plot", str(files[0]), "--out", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "p" / "compare_replication.png").exists()


def test_a_failed_run_is_recorded_and_the_others_go_on(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import chaos.emulate.commands as commands
    from chaos.emulate.fleet import EmulationError

    def fake_runs(strategy: str, lo: int, hi: int, *_: Any) -> list[dict[str, Any]]:
        if strategy == "even":
            raise EmulationError("device n7 not ready after 300.0 s")
        return [_row(strategy, lo, 0, 2.0, 2.5)]

    monkeypatch.setattr(commands, "compare_runs", fake_runs)
    out = tmp_path / "c.json"
    res = CliRunner().invoke(main, ["compare", "--loopback", "--sizes", "6-7", "--strategies",
                                    "even,chaos", "--json", str(out), "--plot", str(tmp_path)])
    assert res.exit_code == 1 and "even repeat 1" in res.output
    doc = json.loads(out.read_text())
    assert doc["failed"] == [{"strategy": "even", "repeat": 0,
                              "error": "device n7 not ready after 300.0 s"}]  # fmt: skip
    assert [r["strategy"] for r in doc["runs"]] == ["chaos"]
    assert (tmp_path / "compare_replication.png").exists()
