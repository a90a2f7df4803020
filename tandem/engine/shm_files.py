"""Where shared-memory stores live, and which of them have a live owner (torch-free).

A store named ``N`` is two files, ``tandem-N.bin`` and ``tandem-N.json`` under :data:`SHM_DIR`
(see :mod:`tandem.engine.shm`). An owner that creates several stores names them all
``<prefix>-<part>`` with a prefix unique to its incarnation (``cell0-1a2b3c4d-weights``) and
holds an :class:`OwnerLock` on ``tandem-<prefix>.lock`` while it lives. The kernel drops that
lock when the owner dies, however it dies (SIGKILL included), so anyone sharing the directory —
the launcher, or the owner's successor — can tell a dead owner's files from a live one's and
remove only those: two stacks that share ``/dev/shm`` never delete each other's files.

The launcher imports this module, and the CLI imports no torch; so neither does this.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
from pathlib import Path

SHM_DIR = Path(os.environ.get("TANDEM_SHM_DIR", "/dev/shm"))
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
# A store's own part after its owner's prefix has no '-', so that the files of prefix
# ``a-b`` are never taken for those of prefix ``a``.
_PART_RE = r"[A-Za-z0-9_.]+"
_SUFFIXES = (".bin", ".json", ".tmp")


class InvalidNameError(ValueError):
    """A shared-memory name or prefix with characters other than letters, digits and '._-'."""


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise InvalidNameError(f"invalid shared-memory name {name!r} (letters, digits, '._-' only)")
    return name


def store_paths(name: str) -> tuple[Path, Path]:
    """The data file and the manifest of the store ``name``."""
    check_name(name)
    return SHM_DIR / f"tandem-{name}.bin", SHM_DIR / f"tandem-{name}.json"


def _lock_path(prefix: str) -> Path:
    return SHM_DIR / f"tandem-{check_name(prefix)}.lock"


def store_files(prefix: str) -> list[Path]:
    """Every file of the stores named ``<prefix>-<part>`` (data, manifest, half-written manifest)."""
    pattern = re.compile(rf"^tandem-{re.escape(check_name(prefix))}-{_PART_RE}$")
    if not SHM_DIR.is_dir():
        return []
    return sorted(p for p in SHM_DIR.iterdir()
                  if p.suffix in _SUFFIXES and pattern.match(p.name[: -len(p.suffix)]))


def remove_stores(prefix: str) -> list[Path]:
    """Unlink every file of the stores named ``<prefix>-<part>``; returns what it removed.

    Mappings already made stay valid until they are unmapped; only the names go.
    """
    removed = []
    for path in store_files(prefix):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


class OwnerLock:
    """An exclusive ``flock`` on ``tandem-<prefix>.lock``, held while the owner of the stores
    ``<prefix>-*`` lives.

    :meth:`acquire` before creating any store of the prefix; :meth:`release` removes the stores,
    then the lock file, then drops the lock (a clean exit). If the owner dies instead, the lock
    is free and :func:`remove_if_dead` (or :func:`sweep_dead_owners`) removes what it left.
    """

    def __init__(self, prefix: str, fd: int) -> None:
        self.prefix = prefix
        self._fd: int | None = fd
        self._releasing = threading.Lock()  # the shutdown and a forced exit's thread may both release

    @classmethod
    def acquire(cls, prefix: str) -> OwnerLock:
        """Take the lock; raises BlockingIOError if a live process already owns ``prefix``."""
        SHM_DIR.mkdir(parents=True, exist_ok=True)
        path = _lock_path(prefix)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # A sweeper may have unlinked the file between our open and our lock (it took
                # the lock first and saw no owner): then lock the file that is there now.
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    os.write(fd, f"{os.getpid()}\n".encode())
                    return cls(prefix, fd)
            except FileNotFoundError:
                pass
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def release(self) -> list[Path]:
        """Remove the prefix's stores and the lock file, then drop the lock (idempotent, and safe
        from two threads at once)."""
        with self._releasing:
            if self._fd is None:
                return []
            removed = remove_stores(self.prefix)
            _lock_path(self.prefix).unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None
            return removed


def remove_if_dead(prefix: str) -> list[Path] | None:
    """Remove the stores of ``prefix`` and its lock file if no live process holds the lock.

    Returns the files removed (the lock file not counted), or None when the owner is alive.
    Stores of a prefix without a lock file are removed too (their owner died before locking,
    which cannot happen, or someone removed the lock: either way nobody can prove they live).
    """
    path = _lock_path(prefix)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return remove_stores(prefix)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        removed = remove_stores(prefix)
        path.unlink(missing_ok=True)
        return removed
    finally:
        os.close(fd)


def sweep_dead_owners(prefix_start: str = "") -> dict[str, list[Path]]:
    """Remove the stores of every lock-holding prefix (starting with ``prefix_start``) whose
    owner is dead; returns the files removed by prefix. Live owners' files are never touched,
    and stores without a lock file (made by something other than an OwnerLock holder) are left.
    """
    if not SHM_DIR.is_dir():
        return {}
    swept: dict[str, list[Path]] = {}
    for lock in sorted(SHM_DIR.glob("tandem-*.lock")):
        prefix = lock.name[len("tandem-"): -len(".lock")]
        if not prefix.startswith(prefix_start) or not _NAME_RE.match(prefix):
            continue
        removed = remove_if_dead(prefix)
        if removed is not None:
            swept[prefix] = removed
    return swept
