"""The live progress line of long commands: a tqdm bar with notes above it on a terminal, plain
stamped lines elsewhere; and a real ``chaos-emulate run`` (loopback) that moves it along its
scenario's timeline."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

from chaos.progress import LiveProgress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_notes_go_above_a_bar_that_moves() -> None:
    term = _Terminal()
    with LiveProgress("join-load", 4, "runs", stream=term) as live:
        assert live.interactive
        live.done("run 1 pass")
        live.done("run 2 pass")
        live.at(3, "third")
    shown = term.getvalue()
    assert re.search(r"\[\s+\d+\.\ds\] run 1 pass\n", shown)
    assert "join-load:  50%" in shown and "2/4 runs" in shown and "3/4 runs" in shown
    assert "third" in shown


def test_without_a_terminal_there_are_only_the_notes() -> None:
    plain = io.StringIO()
    with LiveProgress("campaign", 60, stream=plain) as live:
        assert not live.interactive
        live.at(10, "6 running")
        live.note("kill n3")
        live.done("run 1")
    lines = plain.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].endswith("] kill n3") and lines[1].endswith("] run 1")
    assert "%" not in plain.getvalue()


def test_a_reset_starts_a_new_phase() -> None:
    term = _Terminal()
    with LiveProgress("run", None, stream=term) as live:
        live.note("start n1")
        live.reset(30.0, "scenario")
        live.at(15.0, "5 devices up")
    assert "scenario:  50%" in term.getvalue() and "5 devices up" in term.getvalue()


def test_an_emulated_run_writes_its_notes_to_a_log(tmp_path: Path) -> None:
    """``chaos-emulate run`` on loopback with stderr to a file: stamped notes, no bar."""
    scenario = tmp_path / "s.toml"
    scenario.write_text('name = "p"\nnodes = 2\nmodel = "synthetic:8"\nsettle_s = 1.0\n'
                        'step_time_s = 0.02\n')  # fmt: skip
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        res = subprocess.run([sys.executable, "-m", "chaos.emulate.cli", "run", str(scenario),
                              "--json", str(tmp_path / "out.json"), "--loopback"],
                             stdout=subprocess.PIPE, stderr=err, timeout=300)  # fmt: skip
    text = log.read_text()
    assert res.returncode == 0, text[-3000:]
    assert re.search(r"\[\s+\d+\.\ds\] start n1", text), text[-3000:]
    assert "%|" not in text  # no bar in a log


def test_an_emulated_run_on_a_terminal_shows_its_timeline(tmp_path: Path) -> None:
    """The same run with stderr on a pseudo-terminal: the bar moves along the timeline."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    scenario = tmp_path / "s.toml"
    scenario.write_text('name = "p"\nnodes = 2\nmodel = "synthetic:8"\nsettle_s = 3.0\n'
                        'step_time_s = 0.02\n')  # fmt: skip
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a real size
    try:
        proc = subprocess.Popen([sys.executable, "-m", "chaos.emulate.cli", "run", str(scenario),
                                 "--json", str(tmp_path / "out.json"), "--loopback"],
                                stdout=subprocess.DEVNULL, stderr=sub)  # fmt: skip
        os.close(sub)
        chunks = []
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:  # the child closed its end
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=300) == 0
    finally:
        os.close(main)
    shown = b"".join(chunks).decode(errors="replace")
    assert re.search(r"scenario:\s+\d+%\|", shown), shown[-3000:]
    assert "devices up" in shown and re.search(r"\[\s+\d+\.\ds\] start n1", shown)
