"""The live web view in a real headless browser (Debian's Chromium, driven by Selenium through
Debian's chromedriver: nothing is downloaded). A keyed 4-device loopback cluster of real
trainers with their embedded daemons, the real ``chaos-daemon dashboard`` process; the page must
show a ``kill -9`` and a join within a few seconds of the cluster knowing them, and a screenshot
is taken (``CHAOS_DASHBOARD_SCREENSHOT=PATH`` keeps it there)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.launch import daemon_cli, free_port, kill_and_reap
from tests.trainer.trainer_cluster import KeyedCluster, Member, world

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
PAGE_S = 5.0  # what the page may lag the cluster by: a few seconds
CLUSTER_S = 120.0

needs_browser = pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER))
    and not os.environ.get("CHAOS_REQUIRE_BROWSER"),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium "
    "chromium-driver); CI installs them and sets CHAOS_REQUIRE_BROWSER",
)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[KeyedCluster]:
    with contextlib.closing(KeyedCluster(tmp_path)) as c:  # reaped even on failure
        yield c


@contextlib.contextmanager
def _dashboard(cluster: KeyedCluster, member: Member, tmp: Path) -> Iterator[str]:
    """The real ``chaos-daemon dashboard`` process; yields the URL it prints."""
    port = free_port()
    err = tmp / "dashboard.log"
    with open(err, "w") as log:
        proc = subprocess.Popen(
            daemon_cli("dashboard", "--connect", member.address, "--cluster-key",
                       str(cluster.key), "--port", str(port), "--interval", "0.5"),
            stdout=log, stderr=log, start_new_session=True)  # fmt: skip
    try:
        url = _wait(lambda: _url_in(err.read_text()), CLUSTER_S, "the dashboard's URL",
                    lambda: err.read_text())  # fmt: skip
        yield url
    finally:
        kill_and_reap([proc], group=True)


def _url_in(text: str) -> str | None:
    m = re.search(r"(http://127\.0\.0\.1:\d+/\?token=[0-9a-f]{64})", text)
    return m.group(1) if m else None


def _wait(pred: Callable[[], Any], limit_s: float, what: str,
          detail: Callable[[], str] = lambda: "") -> Any:  # fmt: skip
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {limit_s} s\n{detail()[-3000:]}")


@contextlib.contextmanager
def _browser(tmp: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1400,1000",
                 f"--user-data-dir={tmp / 'chromium'}"):  # fmt: skip
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()


def _read(driver: Any, script: str) -> Any:
    """Reads the page in one script run (it redraws every second: elements found in one call
    could be gone by the next)."""
    return driver.execute_script(script)


def _rows(driver: Any) -> dict[str, str]:
    """The members table: node id -> its state, as the page shows it now."""
    return dict(_read(driver, "return [...document.querySelectorAll('#members tbody tr')]"
                              ".map(r => [r.dataset.node, r.dataset.state]);"))  # fmt: skip


def _rates(driver: Any) -> list[str]:
    """The members table's steps per second column."""
    cells = "'#members tbody td:nth-child(5)'"
    return list(_read(driver, f"return [...document.querySelectorAll({cells})]"
                              ".map(c => c.textContent);"))  # fmt: skip


def _count(driver: Any, css: str) -> int:
    return int(_read(driver, f"return document.querySelectorAll('{css}').length;"))


def _cluster_members(member: Member, cluster: KeyedCluster) -> dict[str, str]:
    st = cluster.status(member.id)
    return {n.id: n.state.value for n in st.nodes}


@needs_browser
def test_the_page_shows_a_kill_and_a_join_within_seconds(cluster: KeyedCluster,
                                                         tmp_path: Path) -> None:  # fmt: skip
    a = cluster.start("a", None)
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    others = []
    for name in ("b", "c", "d"):
        others.append(cluster.start(name, a))
        n = len(others) + 1
        cluster.wait(lambda n=n: all(world(m, n) for m in [a, *others]), f"{name} to join")
    b, c, d = others
    with _dashboard(cluster, a, tmp_path) as url, _browser(tmp_path) as driver:
        driver.get(url)
        _wait(lambda: set(_rows(driver)) == {"a", "b", "c", "d"}, 20, "the page to list 4 members",
              lambda: driver.page_source)  # fmt: skip
        assert set(_rows(driver).values()) == {"active"}
        assert _count(driver, "#graph g.node") == 4 and _count(driver, "#graph line.link") >= 3
        # the scheduler's step and rate of every training member
        _wait(lambda: all(_rates(driver)), 20, "steps per second shown",
              lambda: driver.page_source)  # fmt: skip
        # and every trainer's lifecycle phase, as it reported it
        phases = ("return [...document.querySelectorAll('#members tbody tr')]"
                  ".map(r => r.dataset.phase);")
        _wait(lambda: set(_read(driver, phases)) == {"live"}, 20, "every trainer live",
              lambda: driver.page_source)  # fmt: skip

        os.killpg(d.proc.pid, signal.SIGKILL)  # kill -9 of d and its embedded daemon
        d.proc.wait(timeout=30)
        cluster.members.pop("d")
        _wait(lambda: _cluster_members(a, cluster).get("d", "gone") != "active", CLUSTER_S,
              "the cluster to notice d's death")  # fmt: skip
        _wait(lambda: _rows(driver).get("d", "gone") != "active", PAGE_S,
              "the page to show d's death", lambda: str(_rows(driver)))  # fmt: skip

        e = cluster.start("e", a)
        _wait(lambda: _cluster_members(a, cluster).get("e") == "active", CLUSTER_S,
              "the cluster to take e in", e.log)  # fmt: skip
        _wait(lambda: _rows(driver).get("e") == "active", PAGE_S, "the page to show e",
              lambda: str(_rows(driver)))  # fmt: skip
        events = set(_read(driver, "return [...document.querySelectorAll('#timeline tbody "
                                   "tr')].map(r => r.dataset.event);"))  # fmt: skip
        assert "member_failed" in events or "view_installed" in events, events
        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        keep = os.environ.get("CHAOS_DASHBOARD_SCREENSHOT")
        if keep:
            shutil.copy(shot, keep)
        source = driver.page_source
        key_text = cluster.key.read_text().strip()
        assert key_text not in source  # never key material
