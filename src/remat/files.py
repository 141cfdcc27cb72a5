"""Writing a user's files: atomically, and never onto a file the same command reads.

# NOTE [ Atomic outputs ]
Every file remat writes (profiles, plans, training checkpoints, logs, plots) goes to a temporary
file in the same folder, is flushed to disk, and then replaces the target with ``os.replace``,
which is atomic on POSIX and Windows. A crash, a full disk, an exception or a signal while writing
leaves the previous file whole and no temporary file behind. Commands write their outputs only
after the work succeeded, and refuse an output path that is one of their inputs (``--out`` equal
to ``--profile``), before anything runs. No torch here: the records use it too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "same_file"]


def atomic_write(path: str | Path, data: bytes | str | Callable[[BinaryIO], None]) -> Path:
    """Write ``data`` (bytes, text as UTF-8, or a function that writes into a binary file) to
    ``path`` atomically (NOTE [ Atomic outputs ]); create its folder if needed. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp: str | None = None
    # Ctrl-C (or SIGTERM) held off while the temporary file is made: one arriving between its
    # creation and the ``try`` below would leave it behind. It lands inside the ``try`` instead.
    held = _hold_interrupts()
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        _release_interrupts(held)
        held = None
        # mkstemp makes the file private (0600); give it the mode the file had, or a plain 0644
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # KeyboardInterrupt included: the old file stands, no debris
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    finally:
        _release_interrupts(held)
    return path


_INTERRUPTS = {signal.SIGINT, signal.SIGTERM}


def _hold_interrupts() -> set[int] | None:
    """Block SIGINT and SIGTERM for this thread (where the OS allows it); the previous mask."""
    if not hasattr(signal, "pthread_sigmask"):
        return None
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, _INTERRUPTS))


def _release_interrupts(previous: set[int] | None) -> None:
    """Restore the mask ``_hold_interrupts`` returned; a held signal is delivered now."""
    if previous is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` name one file (links and relative paths resolved; a path that does
    not exist yet is compared by its resolved name)."""
    a, b = Path(a), Path(b)
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()
