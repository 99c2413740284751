"""The docs name only files that exist.

Every relative markdown link ``[text](path)`` and every repository path (``chaos/...py``,
``daemon/...py``, ``scheduling/...py``, ``tests/...py``, ``docs/...md``, ``docs/figures/...``,
...) written in ``README.md`` or ``docs/**/*.md`` must name a file or folder of this checkout.
``docs/journal/`` is a log of past work and may name files that have since moved or gone.
Paths written with shell braces or globs (``prim_s20_{1..13}.json``, ``ctl_s11_*.json``) must
each match at least one file.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP_DIRS = ("chaos", "daemon", "scheduling", "native", "tests", "docs", "examples")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
# A repository path: a top folder, then path characters (braces and globs included), not part
# of a longer path (``/tmp/chaos/a``) or word (``my-chaos/...``).
REPO_PATH = re.compile(
    r"(?<![\w./$~-])((?:" + "|".join(TOP_DIRS) + r")/[\w./*{},-]*)",
)
# What a path token must end with to be checked: a file with an extension, or a folder.
CHECKED = re.compile(r"(\.\w+|/)$")
BRACES = re.compile(r"\{([^{}]*)\}")


def _doc_files() -> list[Path]:
    docs = sorted(
        p for p in (ROOT / "docs").rglob("*.md") if "journal" not in p.relative_to(ROOT).parts
    )
    return [ROOT / "README.md", *docs]


def _expand_braces(path: str) -> list[str]:
    """Shell brace expansion: ``a_{1,2}`` and ``a_{1..3}``, nested left to right."""
    match = BRACES.search(path)
    if match is None:
        return [path]
    body = match.group(1)
    range_match = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if range_match:
        lo, hi = int(range_match.group(1)), int(range_match.group(2))
        options = [str(i) for i in range(lo, hi + 1)]
    else:
        options = body.split(",")
    head, tail = path[: match.start()], path[match.end() :]
    return [out for option in options for out in _expand_braces(head + option + tail)]


def _exists(path: Path) -> bool:
    if any(ch in str(path) for ch in "*?["):
        return bool(glob.glob(str(path)))
    return path.exists()


def _missing_in(doc: Path) -> list[str]:
    text = doc.read_text(encoding="utf-8")
    missing: list[str] = []
    for target in LINK.findall(text):
        if URL.match(target) or target.startswith(("#", "mailto:")):
            continue
        target = target.split("#", 1)[0]
        if target and not (doc.parent / target).exists():
            missing.append(f"link ({target})")
    for token in REPO_PATH.findall(URL.sub(" ", text)):
        token = token.rstrip(".,")
        if not CHECKED.search(token):
            continue
        for path in _expand_braces(token):
            if not _exists(ROOT / path):
                missing.append(f"path {path}")
    return missing


@pytest.mark.parametrize("doc", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_the_docs_name_exists(doc: Path) -> None:
    assert _missing_in(doc) == []


def test_the_path_reader_sees_links_paths_braces_and_globs(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text(
        "See [the daemon](daemon.md), [a site](https://example.org/x.md), [here](#top),\n"
        "`chaos/nowhere.py`, `tests/trainer/test_trainer.py::test_x`, /tmp/chaos/a.py,\n"
        "`docs/figures/bench/prim_s20_{1..2}.json`, `docs/figures/bench/nothing_*.json`.\n",
        encoding="utf-8",
    )
    (tmp_path / "daemon.md").write_text("", encoding="utf-8")
    assert _expand_braces("a_{1..3}_{x,y}") == [
        "a_1_x",
        "a_1_y",
        "a_2_x",
        "a_2_y",
        "a_3_x",
        "a_3_y",
    ]
    assert _missing_in(doc) == ["path chaos/nowhere.py", "path docs/figures/bench/nothing_*.json"]
