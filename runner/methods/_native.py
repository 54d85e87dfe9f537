"""C kernels shipped as source next to this module, compiled on first use by the system's C compiler (`cc`, or
$CC) into a per-user cache and loaded through ctypes, as gco's library is. The cache key is the source's hash,
so an edited kernel is rebuilt; the build goes to a temporary name and is renamed, so processes that start
together (a worker pool) never load a half-written library.
"""

from __future__ import annotations

import ctypes as ct
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

_HERE = Path(__file__).parent


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "runner" / "native"


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
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
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
