"""Writing a user's files: atomically, and never onto a file the same command reads.

# NOTE [ Atomic outputs ]
Every file remat writes (profiles, plans, training checkpoints, logs, plots) goes to a temporary
file in the same folder, is flushed to disk, and then replaces the target with ``os.replace``,
which is atomic on POSIX and Windows. A crash, a full disk, an exception or a signal while writing
leaves the previous file whole and no temporary file behind. Commands write their outputs only
after the work succeeded, and refuse an output path that is one of their inputs (``--out`` equal
to ``--profile``), before anything runs. No torch here: the records use it too.

# NOTE [ An interrupted write is an interrupt ]
A Ctrl-C while ``torch.save`` writes raises ``KeyboardInterrupt`` inside its zip writer, whose
clean-up then fails with an error of its own (``RuntimeError: [enforce fail at
inline_container.cc] unexpected pos``) that carries the interrupt as its context. What happened
is the Ctrl-C: the write is abandoned (the temporary file removed, the target as it was) and
``KeyboardInterrupt`` is raised, so a caller that handles Ctrl-C (``remat train``: exit 130 and
one line) handles this one too.

# NOTE [ Temporary files name their writer ]
Only a process that is killed (SIGKILL, a power cut) leaves its temporary file behind. So each
temporary file's name carries its writer, ``.<name>.w<host>-<pid>.<random>.tmp`` (``host``: 8
hex digits of a hash of the host name), and ``clear_dead_writers(path)`` removes the temporary
files of ``path`` whose writer ran on this host and is no longer alive. It never touches a file
of a live process, of another host (a shared folder), of another target, or a name it did not
make (temporary files of earlier versions included); a dead writer's pid taken by a new process
keeps its file until that process ends. POSIX only: elsewhere it removes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "clear_dead_writers", "same_file"]


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
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{_writer()}.", suffix=".tmp")
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
    except BaseException as e:  # KeyboardInterrupt included: the old file stands, no debris
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if not isinstance(e, KeyboardInterrupt) and _interrupted(e):
            raise KeyboardInterrupt from None  # NOTE [ An interrupted write is an interrupt ]
        raise
    finally:
        _release_interrupts(held)
    return path


def _interrupted(error: BaseException) -> bool:
    """Whether a ``KeyboardInterrupt`` is in ``error``'s chain of causes and contexts."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _writer() -> str:
    """This process, as temporary names carry it (NOTE [ Temporary files name their writer ])."""
    return f"w{_host()}-{os.getpid()}"


def clear_dead_writers(path: str | Path) -> list[Path]:
    """Remove the temporary files that writers of ``path`` on this host left when they were killed
    (NOTE [ Temporary files name their writer ]); the files removed."""
    path = Path(path)
    if os.name != "posix" or not path.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(path.name)}\.w{_host()}-([0-9]+)\.[^.]+\.tmp")
    removed = []
    for entry in path.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match is None or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            entry.unlink()
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists (POSIX)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; a pid beyond the OS's
        return True
    return True


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
