"""The package as a user installs it: a wheel built from this tree, installed (not editable) into
a fresh virtual environment outside the checkout.

An editable install (as CI's own) maps the source folders straight onto the import names, so a
subpackage missing from the wheel goes unnoticed there; a wheel once shipped without
``chaos.protocol``, and every daemon installed from it failed on its first import. These tests
build the wheel, check that it holds every package of the tree, install it into a new venv whose
only other path is this environment's site-packages (for the dependencies, torch included, so
nothing is downloaded), and run ``chaos-daemon --help`` and a two-member cluster of installed
Trainers from a directory outside the checkout.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer.trainer_cluster import Cluster, Member, assert_equal_from, world

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"chaos": "chaos", "chaos.daemon": "daemon", "chaos.scheduling": "scheduling",
           "chaos._native": "native"}  # fmt: skip
BUILD_TIMEOUT_S = 300.0


def _tree_packages() -> set[str]:
    """Every package of the checkout under its import name (each folder with an __init__.py)."""
    found: set[str] = set()
    for name, folder in FOLDERS.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            found.add(".".join((name, *rel)))
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(ROOT)],
        check=True, timeout=BUILD_TIMEOUT_S, cwd=out,
    )  # fmt: skip
    wheels = list(out.glob("chaos_edge-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv (outside the checkout) with the wheel installed; returns its python."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(env_dir)  # ensurepip: offline
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=30,
    ).stdout.strip()  # fmt: skip
    # the dependencies come from this environment: a plain path entry, so its .pth files (this
    # checkout's editable finder among them) are not run, and the new venv's own site-packages,
    # holding the wheel, comes first
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "_chaos_test_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, timeout=BUILD_TIMEOUT_S, cwd=env_dir,
    )  # fmt: skip
    yield python


def test_wheel_holds_every_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    shipped = {n[: -len("/__init__.py")].replace("/", ".") for n in names
               if n.endswith("/__init__.py")}  # fmt: skip
    missing = _tree_packages() - shipped
    assert not missing, f"the wheel leaves out {sorted(missing)}"
    assert "chaos/_native/ops.cpp" in names  # the native sources travel with it
    assert {"chaos/daemon/static/index.html", "chaos/daemon/static/app.js"} <= set(names)
    assert not [n for n in names if n.split("/")[0] in ("daemon", "scheduling", "tests")]


def test_installed_daemon_runs_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    where = subprocess.run(
        [str(installed), "-c", "import chaos, chaos.protocol, chaos.daemon.node, "
         "chaos.daemon.dashboard; print(chaos.__file__)"],
        check=True, capture_output=True, text=True, timeout=60, cwd=tmp_path,
    ).stdout.strip()  # fmt: skip
    assert Path(where).is_relative_to(installed.parents[1]), where
    assert not Path(where).is_relative_to(ROOT), where
    out = subprocess.run(
        [str(installed.parent / "chaos-daemon"), "--help"],
        check=True, capture_output=True, text=True, timeout=60, cwd=tmp_path,
    ).stdout  # fmt: skip
    assert "start" in out and "status" in out


class _InstalledCluster(Cluster):
    """Workers (and their embedded daemons) run by the installed venv's python."""

    def __init__(self, tmp: Path, python: Path) -> None:
        super().__init__(tmp)
        self.python = python

    def start(self, node_id: str, join: Member | None = None, *extra: str) -> Member:
        real = sys.executable
        sys.executable = str(self.python)  # the argv Cluster.start builds
        try:
            return super().start(node_id, join, *extra)
        finally:
            sys.executable = real


def test_installed_trainers_form_a_cluster(installed: Path, tmp_path: Path) -> None:
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the workers start here, outside the checkout
    cluster = _InstalledCluster(tmp_path, installed)
    try:
        a = cluster.start("a")
        cluster.wait(lambda: a.last().get("step", 0) >= 3, "a's first steps")
        b = cluster.start("b", a)
        cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join a")
        first = b.records()[0]["step"]
        cluster.wait(lambda: b.last()["step"] >= first + 5, "5 steps of the two")
        for m in (b, a):
            m.leave()
        cluster.wait(lambda: a.proc.poll() is not None and b.proc.poll() is not None,
                     "both to leave")  # fmt: skip
        assert a.proc.returncode == 0 and b.proc.returncode == 0, b.log()
        assert assert_equal_from([a, b], first) >= 3
    finally:
        cluster.close()
        os.chdir(cwd)
