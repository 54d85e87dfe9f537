"""C kernels shipped as source next to this module, compiled on first use by the system's C compiler (`cc`, or
$CC) into a per-user cache and loaded through ctypes, as gco's library is. The cache key is the source's hash,
so an edited kernel is rebuilt; the build goes to a temporary name and is renamed, so processes that start
together (a sweep's jobs) never load a half-written library. Where the cache cannot be written (a read-only
HOME or XDG_CACHE_HOME), they are built in a private temporary folder of the process, said in one line.
"""

from __future__ import annotations

import atexit
import ctypes as ct
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

_HERE = Path(__file__).parent
log = logging.getLogger(__name__)


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "runner" / "native"


@functools.cache
def _private_dir(unwritable: Path, why: str) -> Path:
    """This process's own build folder, removed at exit (a loaded library may be unlinked), for when the
    per-user cache cannot be written; made and said once per process."""
    folder = Path(tempfile.mkdtemp(prefix="runner-native-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    log.warning("the C kernel cache %s cannot be written (%s): building in %s for this run",
                unwritable, why, folder)  # fmt: skip
    return folder


def _partial_file(folder: Path) -> tuple[Path, str]:
    """A fresh temporary file in `folder` to build into, or in `_private_dir` when `folder` cannot be
    written; returns (the folder used, the file's path)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    except OSError as exc:
        folder = _private_dir(folder, exc.strerror or type(exc).__name__)
        fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    return folder, partial


class NativeBuildError(RuntimeError):
    """A kernel could not be built (no C compiler, or the build failed); the message is one line that says
    what to install or which exact solver in Python to choose instead."""


@functools.cache
def load(name: str, instead: str) -> ct.CDLL:
    """The compiled `runner/methods/<name>.c`; no compiler or a failed build is one NativeBuildError line
    that names `instead`, the setting that avoids this kernel."""
    source = _HERE / f"{name}.c"
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{digest}.so"
    if not target.exists():
        wanted = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc"]
        compiler = next((found for name in wanted if (found := shutil.which(name))), None)
        if compiler is None:
            raise NativeBuildError(
                f"{source.name}: no C compiler found ({' or '.join(wanted)}) to build it; install one "
                f"(apt install gcc) or choose {instead}"
            )
        folder, partial = _partial_file(target.parent)
        target = folder / target.name
        try:
            build = [compiler, "-O2", "-shared", "-fPIC", "-o", partial, str(source), "-lm"]
            done = subprocess.run(build, capture_output=True, text=True)
            if done.returncode:
                why = " ".join(done.stderr.split())[:300]
                raise NativeBuildError(f"{source.name}: `{' '.join(build)}` failed ({why}); choose {instead}")
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return ct.CDLL(str(target))


_EMPTY_VIEW = ct.c_char * 0  # a ctypes view of no bytes, so that it fits any buffer, an empty one too


def pointer(array):
    """A pointer argument to a contiguous, writable array's data (4x cheaper than `array.ctypes.data`)."""
    return _EMPTY_VIEW.from_buffer(array)
