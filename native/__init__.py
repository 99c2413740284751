"""Loader of the Chaos native ops (``chaos._native``): a torch C++ extension built on first use.

:func:`load` JIT-builds ``ops.cpp`` with :func:`torch.utils.cpp_extension.load` into a cache
directory (default ``~/.cache/chaos/native/<torch>-<python>-<build key>``, the key a digest of
every build input: sources, headers, flags, torch, Python, compiler), holding an
exclusive file lock so that concurrent processes neither corrupt nor duplicate the build.
Later calls (and later processes) reuse the cached library. Build ahead of time with
``python -m chaos._native build``.

When the compiler or ninja is missing, or the build fails, :func:`load` warns once and returns
``None``; :mod:`chaos.ops` then uses its pure-torch fallback.

The CUDA kernels in ``cuda/`` are loaded by :func:`load_cuda` only when torch has CUDA and a GPU
is present; see ``docs/native.md``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

from chaos.errors import ChaosTimeout

__all__ = [
    "BUILD_LOCK_TIMEOUT_S",
    "BuildLockTimeout",
    "Builder",
    "build",
    "build_key",
    "default_build_dir",
    "load",
    "load_cuda",
]

log = logging.getLogger("chaos.native")

#: How long a process waits for another process's build to finish. A cold build takes about
#: 30-60 s; raise this on very slow machines.
BUILD_LOCK_TIMEOUT_S = 600.0
_LOCK_POLL_S = 0.2

_SRC_DIR = Path(__file__).resolve().parent
_EXT_NAME = "chaos_native_ops"
_CUDA_EXT_NAME = "chaos_native_cuda"

_lock = threading.Lock()
_cache: dict[str, ModuleType | None] = {}


_CPU_SOURCES = ("ops.cpp",)
_CUDA_SOURCES = ("cuda_binding.cpp", "cuda/reduce_into.cu", "cuda/checksum.cu")
_CUDA_CFLAGS = ("-O3",)
_CUDA_NVCC_FLAGS = ("-O3", "--fmad=false")

#: Called as ``builder(directory, verbose)`` with the build lock held: compiles (or, when
#: ``directory`` holds an up-to-date build, only imports) the extension and returns its module.
Builder = Callable[[Path, bool], ModuleType]


class BuildLockTimeout(ChaosTimeout):
    """Another process held the native build lock for longer than the timeout."""


def _headers() -> list[Path]:
    """The C++/CUDA headers beside the sources (every one is a build input)."""
    return sorted(p for ext in ("*.h", "*.hpp", "*.cuh") for p in _SRC_DIR.rglob(ext))


def _compiler_identity() -> str:
    """The C++ compiler torch's builder uses: its resolved path, size and modification time
    (an upgraded compiler is another build input)."""
    from torch.utils.cpp_extension import get_cxx_compiler

    cxx = get_cxx_compiler()
    found = shutil.which(cxx)
    if found is None:
        return f"missing:{cxx}"
    real = Path(found).resolve()
    st = real.stat()
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


def build_key(sources: Sequence[Path], cflags: Sequence[str]) -> str:
    """A digest of everything a build depends on, so that a build is reused only by the same
    inputs (two checkouts or torch builds sharing a cache never rebuild over each other).

    The inputs: the names and bytes of ``sources`` and of the headers beside them, the
    compiler flags, the torch version, install path and C++ ABI flag, the Python version and
    implementation, and the C++ compiler.

    Args:
        sources: The source files (and any headers) compiled.
        cflags: The compiler flags.

    Returns:
        A hex SHA-256.

    Raises:
        OSError: a source cannot be read.
    """
    digest = hashlib.sha256()
    for path in [*sources, *_headers()]:
        digest.update(f"file:{path.name}:{path.stat().st_size}\n".encode())
        digest.update(path.read_bytes())
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    for part in (
        f"cflags:{' '.join(cflags)}",
        f"torch:{torch.__version__}:{Path(torch.__file__).resolve().parent}:abi={abi}",
        f"python:{sys.implementation.cache_tag}:{sys.version}:{getattr(sys, 'abiflags', '')}",
        f"cxx:{_compiler_identity()}",
    ):
        digest.update(part.encode() + b"\n")
    return digest.hexdigest()


def default_build_dir() -> Path:
    """The cache directory for these build inputs: ``~/.cache/chaos/native/<tag>``.

    The tag names the torch and Python versions and ends in the :func:`build_key` of the CPU
    extension's sources and flags, so each set of inputs (another checkout of the sources,
    another torch install, compiler or flag) gets its own directory and none rebuilds another's.
    """
    key = build_key([_SRC_DIR / name for name in _CPU_SOURCES], _cpu_flags())
    version = torch.__version__.replace("+", "_")
    tag = f"torch{version}-py{sys.version_info[0]}{sys.version_info[1]}-{key[:16]}"
    return Path.home() / ".cache" / "chaos" / "native" / tag


def _cpu_flags() -> list[str]:
    """Compiler flags for the ISA extensions this CPU has (the cache is per machine)."""
    flags = ["-O3", "-ffp-contract=off"]
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return flags
    words = set(cpuinfo.split())
    if {"avx2", "f16c"} <= words:
        flags += ["-mavx2", "-mf16c"]
    return flags


def _cuda_build_dir(build_dir: Path | None) -> Path:
    """The CUDA extension's cache directory, keyed by its own sources and flags."""
    root = build_dir if build_dir is not None else default_build_dir()
    sources = [_SRC_DIR / name for name in _CUDA_SOURCES]
    key = build_key(sources, [*_CUDA_CFLAGS, "nvcc", *_CUDA_NVCC_FLAGS])
    return root / f"cuda-{key[:16]}"


class _BuildLock:
    """A ``flock`` on ``<dir>/.chaos-build.lock``, acquired with a timeout: exclusive to build,
    shared to import a finished build (importers never wait for each other, so one process
    slowed down while it imports, on a busy device, holds up no other; a build waits for
    them)."""

    def __init__(self, directory: Path, timeout_s: float, *, shared: bool = False) -> None:
        self.path = directory / ".chaos-build.lock"
        self.timeout_s = timeout_s
        self.shared = shared
        self._fd = -1

    def __enter__(self) -> _BuildLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        waited = False
        while True:
            try:
                fcntl.flock(self._fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX)
                            | fcntl.LOCK_NB)  # fmt: skip
                if not self.shared:
                    os.ftruncate(self._fd, 0)
                    os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)  # who builds
                return self
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(self._fd)
                    raise
            if not waited:
                log.info("chaos native: waiting for another process's build (%s)", self.path)
                waited = True
            if time.monotonic() >= deadline:
                holder = self._holder()
                os.close(self._fd)
                raise BuildLockTimeout(
                    f"another process ({holder}) has held the chaos native build lock "
                    f"{self.path} for more than {self.timeout_s:g} s; let its build finish "
                    "(or stop it), build ahead with `python -m chaos._native build`, or raise "
                    "chaos._native.BUILD_LOCK_TIMEOUT_S on a slow machine"
                )
            time.sleep(_LOCK_POLL_S)  # polling a file lock held by another process

    def _holder(self) -> str:
        """``pid N`` of the lock's holder as it recorded itself, or ``pid unknown``."""
        try:
            pid = os.pread(self._fd, 32, 0).decode(errors="replace").strip()
        except OSError:
            pid = ""
        return f"pid {pid}" if pid.isdigit() else "pid unknown"

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def _missing_toolchain() -> str | None:
    """Why the extension cannot be built here, or None when the tools are present."""
    from torch.utils.cpp_extension import get_cxx_compiler, verify_ninja_availability

    cxx = get_cxx_compiler()  # the compiler torch's builder will use
    if shutil.which(cxx) is None:
        return f"C++ compiler {cxx!r} not found"
    try:
        verify_ninja_availability()
    except RuntimeError:
        return "ninja not found (pip install ninja)"
    return None


def build(
    build_dir: Path | None = None,
    *,
    verbose: bool = False,
    lock_timeout_s: float = BUILD_LOCK_TIMEOUT_S,
    builder: Builder | None = None,
) -> ModuleType:
    """Build (or reuse the cached build of) the CPU extension and import it.

    Concurrent calls, in any processes, with one ``build_dir`` build once: the others wait on
    the directory's lock and reuse the result. A finished build is imported as it is, under
    the lock shared: importers never wait for one another (one slowed down on a busy device
    holds up no other process's start), only for a build.

    Args:
        build_dir: Cache directory; defaults to :func:`default_build_dir`.
        verbose: Show the compiler's output.
        lock_timeout_s: How long to wait for a concurrent build by another process.
        builder: Compiles (or reuses) the extension in the directory; default: torch's JIT
            builder on ``ops.cpp``. Only the lock's tests pass another.

    Returns:
        The extension module, with ``reduce_into``, ``pack``, ``unpack`` and ``checksum``.

    Raises:
        RuntimeError: If the toolchain is missing or compilation fails.
        BuildLockTimeout: If another process holds the build lock for longer than the timeout
            (a :class:`ChaosTimeout`, so a :class:`TimeoutError`).
    """
    directory = build_dir if build_dir is not None else default_build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    if builder is None:
        with _BuildLock(directory, lock_timeout_s, shared=True):  # a finished build, as it is
            finished = _import_finished(directory)
        if finished is not None:
            return finished
        reason = _missing_toolchain()
        if reason is not None:
            raise RuntimeError(f"cannot build chaos native ops: {reason}")
        builder = _torch_build
    with _BuildLock(directory, lock_timeout_s):
        started = time.monotonic()
        log.info("chaos native: loading ops from %s (a first build compiles, ~30-60 s)", directory)
        if not _build_is_complete(directory):
            # A builder killed mid-link (a test's SIGKILL, a power cut) can leave a truncated
            # library that ninja takes as up to date, and importing it crashes the process.
            # Only a build that imported cleanly is trusted, so anything else starts afresh.
            _wipe_build_dir(directory)
        try:
            module = builder(directory, verbose)
        except (RuntimeError, ImportError, OSError) as exc:
            log.warning("chaos native: build in %s unusable (%s); rebuilding", directory, exc)
            _wipe_build_dir(directory)
            module = builder(directory, verbose)
        _mark_complete(directory)
        log.info("chaos native: ops ready in %.1f s", time.monotonic() - started)
    return module


def _torch_build(directory: Path, verbose: bool) -> ModuleType:
    """Run torch's JIT builder in ``directory``; the caller holds the build lock."""
    from torch.utils.cpp_extension import load as torch_load

    # torch's own FileBaton ("lock") is left behind when a builder is killed, and then makes
    # every later build wait forever. We hold the flock, so any baton present now is stale.
    (directory / "lock").unlink(missing_ok=True)
    module: ModuleType = torch_load(
        name=_EXT_NAME,
        sources=[str(_SRC_DIR / name) for name in _CPU_SOURCES],
        extra_cflags=_cpu_flags(),
        build_directory=str(directory),
        verbose=verbose,
    )
    return module


def _import_finished(directory: Path) -> ModuleType | None:
    """The library of a finished build in ``directory``, imported as it is: no compiler, no
    ninja, and nothing written, so any number of processes may do it at once (under the
    shared lock, which keeps a rebuild out meanwhile). ``None``: no finished build there, or
    it does not import (the exclusive path then rebuilds it)."""
    lib = directory / f"{_EXT_NAME}.so"
    if not lib.exists() or not _build_is_complete(directory):
        return None
    existing = sys.modules.get(_EXT_NAME)
    if existing is not None and getattr(existing, "__file__", None) == str(lib):
        return existing
    spec = importlib.util.spec_from_file_location(_EXT_NAME, lib)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        log.warning("chaos native: the finished build in %s does not import (%s)", directory, exc)
        return None
    sys.modules[_EXT_NAME] = module
    return module


_COMPLETE_MARKER = ".chaos-build-complete"


def _libraries_digest(directory: Path) -> str:
    """SHA-256 over the names and bytes of the built libraries in ``directory``."""
    digest = hashlib.sha256()
    for lib in sorted(directory.glob("*.so")):
        digest.update(lib.name.encode())
        digest.update(lib.read_bytes())
    return digest.hexdigest()


def _build_is_complete(directory: Path) -> bool:
    """Whether the libraries in ``directory`` are the ones a finished build imported."""
    marker = directory / _COMPLETE_MARKER
    try:
        return marker.read_text().strip() == _libraries_digest(directory)
    except OSError:
        return False


def _mark_complete(directory: Path) -> None:
    """Record, atomically, the digest of the libraries that just imported cleanly."""
    tmp = directory / f"{_COMPLETE_MARKER}.{os.getpid()}"
    tmp.write_text(_libraries_digest(directory) + "\n")
    os.replace(tmp, directory / _COMPLETE_MARKER)


def _wipe_build_dir(directory: Path) -> None:
    """Delete everything in a build directory except the build lock file."""
    for entry in directory.iterdir():
        if entry.name == ".chaos-build.lock":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def load(build_dir: Path | None = None) -> ModuleType | None:
    """The CPU extension, building it on first use; None (after one warning) if it cannot be built.

    Args:
        build_dir: Cache directory; defaults to :func:`default_build_dir`.

    Returns:
        The extension module, or None when the toolchain is missing or the build failed.
    """
    key = f"cpu:{build_dir}"
    with _lock:
        if key in _cache:
            return _cache[key]
        module: ModuleType | None
        try:
            module = build(build_dir)
        except (RuntimeError, OSError, ImportError, ChaosTimeout) as exc:
            warnings.warn(
                f"chaos native ops unavailable, using the torch fallback: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
            module = None
        _cache[key] = module
        return module


def load_cuda(build_dir: Path | None = None) -> ModuleType | None:
    """The CUDA extension (``cuda_binding.cpp`` + ``cuda/*.cu``), or None without CUDA.

    Used only when torch was built with CUDA and a GPU is visible; never on the CPU-only
    machines this project is tested on (there the ``.cu`` files are only compiled by ``nvcc``).

    Args:
        build_dir: Cache directory; defaults to :func:`default_build_dir`.

    Returns:
        The module with ``reduce_into`` and ``checksum`` for CUDA tensors, or None.
    """
    if torch.version.cuda is None or not torch.cuda.is_available():
        return None
    key = f"cuda:{build_dir}"
    with _lock:
        if key in _cache:
            return _cache[key]
        from torch.utils.cpp_extension import load as torch_load

        directory = _cuda_build_dir(build_dir)
        directory.mkdir(parents=True, exist_ok=True)
        module: ModuleType | None
        try:
            with _BuildLock(directory, BUILD_LOCK_TIMEOUT_S):
                (directory / "lock").unlink(missing_ok=True)  # a killed builder's stale baton
                module = torch_load(
                    name=_CUDA_EXT_NAME,
                    sources=[str(_SRC_DIR / name) for name in _CUDA_SOURCES],
                    extra_cflags=list(_CUDA_CFLAGS),
                    extra_cuda_cflags=list(_CUDA_NVCC_FLAGS),
                    build_directory=str(directory),
                )
        except (RuntimeError, OSError, ImportError, ChaosTimeout) as exc:
            warnings.warn(
                f"chaos CUDA ops unavailable, using torch on the GPU: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
            module = None
        _cache[key] = module
        return module
