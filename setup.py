"""Package discovery for the layout's folder-to-import-name mapping.

``pyproject.toml`` maps each top folder onto its import name (``[tool.setuptools.package-dir]``);
this file finds every package under each of those folders, so that a new subpackage can never be
left out of a wheel (a hand-kept list once shipped without ``chaos.protocol``). A plain
``find_packages(".")`` cannot be used: it would install ``daemon`` and ``scheduling`` as top-level
names.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def _package_dir() -> dict[str, str]:
    with open(HERE / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["tool"]["setuptools"]["package-dir"])


def _packages(package_dir: dict[str, str]) -> list[str]:
    found: list[str] = []
    for name, folder in sorted(package_dir.items()):
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(str(HERE / folder))]
    # a folder mapped on its own (chaos/daemon -> daemon/) is not a subpackage of its parent
    # folder; find_packages of the parent never sees it, so each name appears once
    return sorted(set(found))


setup(packages=_packages(_package_dir()))
