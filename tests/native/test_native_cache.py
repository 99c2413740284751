"""The native build cache: keyed by every build input, built once under an inter-process lock.

The key tests hash copies of the real sources. The lock tests run real processes that call
:func:`chaos._native.build` on one empty cache directory with a small stand-in builder (the
real compile takes ~30 s; what is tested is the lock and the reuse, not the compiler): it
records whether it compiled or reused the directory's library, as ninja would.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from chaos._native import (
    _CPU_SOURCES,
    _SRC_DIR,
    BuildLockTimeout,
    _BuildLock,
    _cpu_flags,
    build,
    build_key,
    default_build_dir,
)

from chaos.errors import ChaosTimeout


def _copy_sources(tmp: Path) -> list[Path]:
    copies = []
    for name in _CPU_SOURCES:
        dst = tmp / name
        dst.write_bytes((_SRC_DIR / name).read_bytes())
        copies.append(dst)
    return copies


def test_the_key_changes_with_a_source_byte_or_a_flag_and_not_otherwise(tmp_path: Path) -> None:
    sources = _copy_sources(tmp_path)
    flags = ["-O3", "-ffp-contract=off"]
    key = build_key(sources, flags)
    assert build_key(sources, flags) == key
    assert build_key(sources, list(flags)) == key  # same inputs, another list

    original = sources[0].read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    sources[0].write_bytes(bytes(flipped))
    assert build_key(sources, flags) != key
    sources[0].write_bytes(original)
    assert build_key(sources, flags) == key

    assert build_key(sources, [*flags, "-mavx2"]) != key
    assert build_key(sources, ["-O2", "-ffp-contract=off"]) != key


def test_the_default_cache_directory_is_named_by_the_key() -> None:
    key = build_key([_SRC_DIR / name for name in _CPU_SOURCES], _cpu_flags())
    directory = default_build_dir()
    assert directory.name.endswith(key[:16])
    assert default_build_dir() == directory


_BUILD_SCRIPT = textwrap.dedent("""
    import sys, time, types
    from pathlib import Path
    from chaos._native import build

    cache, log = Path(sys.argv[1]), Path(sys.argv[2])

    def builder(directory: Path, verbose: bool) -> types.ModuleType:
        lib = directory / "stand_in.so"
        if lib.exists():  # up to date, as ninja would find it
            outcome = "reused"
        else:
            time.sleep(0.5)  # a compile takes a while: another process may look meanwhile
            lib.write_bytes(b"library")
            outcome = "built"
        with log.open("a") as f:
            f.write(outcome + "\\n")
        return types.ModuleType("stand_in")

    build(cache, builder=builder, lock_timeout_s=60.0)
    print("done")
""")


def test_concurrent_first_builds_into_an_empty_cache_build_once(tmp_path: Path) -> None:
    cache, log = tmp_path / "cache", tmp_path / "outcomes.log"
    argv = [sys.executable, "-c", _BUILD_SCRIPT, str(cache), str(log)]
    procs: list[subprocess.Popen[str]] = []
    try:
        # Both start while the lock is held here, so both find an empty cache and contend.
        with _BuildLock(cache, 10.0):
            procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(2)]
            with pytest.raises(subprocess.TimeoutExpired):
                procs[0].wait(timeout=2.0)  # it waits on the lock, does not build
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sorted(log.read_text().split()) == ["built", "reused"]


def test_a_held_lock_times_out_with_a_timeout_error_naming_the_holder(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        from pathlib import Path
        from chaos._native import BuildLockTimeout, build
        try:
            build(Path({str(tmp_path)!r}), builder=lambda d, v: None, lock_timeout_s=0.3)
        except BuildLockTimeout as exc:
            print(exc)
    """)
    with _BuildLock(tmp_path, 1.0):
        held = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
    assert f"pid {__import__('os').getpid()}" in held.stdout, held.stderr
    assert "python -m chaos._native build" in held.stdout
    assert issubclass(BuildLockTimeout, ChaosTimeout)
    assert issubclass(BuildLockTimeout, TimeoutError)


def test_a_finished_build_is_imported_while_another_importer_holds_the_lock() -> None:
    """One process slowed down while it imports the finished build (on a busy device) holds
    the lock shared: another process's start imports the same build meanwhile instead of
    waiting behind it. A build (the lock exclusive) still waits for the importers."""
    directory = default_build_dir()
    build(directory)  # the real build, finished (CI builds it ahead)
    script = textwrap.dedent(f"""
        from pathlib import Path
        from chaos._native import build
        ops = build(Path({str(directory)!r}), lock_timeout_s=5.0)
        print(ops.__name__, callable(ops.checksum))
    """)
    with _BuildLock(directory, 1.0, shared=True):  # an importer, stopped halfway
        got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert got.returncode == 0, got.stderr
        assert got.stdout.split() == ["chaos_native_ops", "True"]
        with pytest.raises(BuildLockTimeout):  # a builder waits for the importer
            with _BuildLock(directory, 0.3):
                pass
