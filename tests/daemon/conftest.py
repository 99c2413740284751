"""Fixtures for the daemon tests (helpers live in ``daemon_helpers``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_helpers import Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A cluster whose processes are killed and reaped even when the test fails."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
