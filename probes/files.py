"""Owner-only, atomic file writes: what probeguard writes to disk goes through here.

Hidden-state caches are what an LLM made of users' messages; checkpoints, reports and the
LLM cache describe them or their models. Files are written ``0600`` and the directories
probeguard creates ``0700`` whatever the umask (the mode is set explicitly, not left to
``umask``). A directory that already existed keeps its mode: it is the user's choice
(``--out .`` must not lock the user out of their working directory).

>>> import stat, tempfile
>>> root = Path(tempfile.mkdtemp())
>>> atomic_write(root / "a" / "b" / "f.json", b"{}")
>>> oct(stat.S_IMODE((root / "a" / "b" / "f.json").stat().st_mode))
'0o600'
>>> [oct(stat.S_IMODE(d.stat().st_mode)) for d in (root / "a", root / "a" / "b")]
['0o700', '0o700']
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO

__all__ = ["DIR_MODE", "FILE_MODE", "atomic_write", "make_private", "open_private", "private_dir"]

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and its missing parents as ``0700`` directories; returns it.

    Directories that already exist are left as they are.
    """
    path = Path(path)
    missing = []
    for p in (path, *path.parents):
        if p.exists():
            break
        missing.append(p)
    for p in reversed(missing):  # outermost first: each is private before its child exists
        try:
            p.mkdir(mode=DIR_MODE)
        except FileExistsError:  # created meanwhile by another process: not ours to chmod
            continue
        os.chmod(p, DIR_MODE)  # mkdir's mode is masked by the umask
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    return path


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` (``0600``) so that readers see the old file or the whole
    new one; missing parent directories are created ``0700``."""
    private_dir(path.parent)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, FILE_MODE)  # mkstemp's 0600 already; said here, not assumed
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_private(path: Path) -> IO[bytes]:
    """``path`` opened for writing (truncated), ``0600`` even if it existed before."""
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # an existing file keeps its old mode through O_CREAT
    return os.fdopen(fd, "wb")


def make_private(path: Path) -> None:
    """Make what a third-party writer left at ``path`` owner-only: a file ``0600``, a
    directory and everything under it ``0700`` / ``0600`` (symbolic links untouched)."""
    if path.is_symlink():
        return
    if not path.is_dir():
        os.chmod(path, FILE_MODE)
        return
    os.chmod(path, DIR_MODE)
    for root, dirs, files in os.walk(path):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), DIR_MODE)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), FILE_MODE)
