"""One lock per CPU core, so that the compute processes of a machine never run on a core at once.

A CPU cell's member computes with as many OpenMP threads as it has cores, and those threads
spin at every barrier (hundreds per step) waiting for each other. Two processes whose threads
share a core — the decode services of two models in one cell, each given the cell's decode
cores, or a prefill layer group still running on a core a new partition just gave to decode —
stall each other at every barrier: on 2 cores, two models' decode steps of 1-2 rows took
200-400 ms each instead of ~35 ms. So a member holds the lock of every core it is pinned to
while it computes (``CellMember.run``), and whoever shares a core takes turns at step or layer
group boundaries instead of interleaving threads.

The locks are advisory ``flock`` locks on one file per core in a directory of this machine
(``TANDEM_CORE_LOCK_DIR``; default ``tandem.core-locks`` in the shared-memory directory the
cell's files live in, ``TANDEM_SHM_DIR`` or ``/dev/shm``, which containers sharing the agent's
IPC namespace see too; the temporary directory where there is none): the kernel drops a dead
holder's lock with its file descriptor, so a killed service never wedges the others. Cores are
locked in ascending order, so no two holders can deadlock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem.engine.shm_files import SHM_DIR

log = logging.getLogger("tandem.core_locks")


def lock_dir() -> Path:
    configured = os.environ.get("TANDEM_CORE_LOCK_DIR")
    if configured:
        return Path(configured)
    base = SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())
    return base / "tandem.core-locks"  # not "tandem-<cell>-…": no cell's file sweep matches it


class CoreLocks:
    """This process's handles on the per-core lock files (opened once, kept open)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or lock_dir()
        self._fds: dict[int, int | None] = {}  # None: the file could not be opened

    def _fd(self, core: int) -> int | None:
        if core not in self._fds:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._fds[core] = os.open(self.directory / f"core-{core}.lock", os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:  # another user's directory, a read-only one: compute unlocked
                log.warning("core %d computes without its lock (%s); set TANDEM_CORE_LOCK_DIR to a directory "
                            "every process of the machine can write", core, exc)
                self._fds[core] = None
        return self._fds[core]

    @contextmanager
    def hold(self, cores: Iterable[int]) -> Iterator[None]:
        """Hold the locks of ``cores`` (blocking until each is free) for the ``with`` body."""
        held: list[int] = []
        try:
            for core in sorted(set(cores)):
                fd = self._fd(core)
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    held.append(fd)
            yield
        finally:
            for fd in reversed(held):
                fcntl.flock(fd, fcntl.LOCK_UN)

    def holders(self, cores: Iterable[int]) -> list[str]:
        """Who holds each of ``cores``' locks and who waits for it, one line each, from Linux's
        ``/proc/locks`` (a pid outside this process's namespace shows as 0): for the report of a
        loop that stopped stepping (``watch_progress``)."""
        wanted: dict[tuple[int, int, int], int] = {}
        for core in sorted(set(cores)):
            try:
                st = os.stat(self.directory / f"core-{core}.lock")
            except OSError:
                continue
            wanted[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = core
        try:
            table = Path("/proc/locks").read_text()
        except OSError:
            return []
        lines = []
        for line in table.splitlines():
            fields = line.split()
            waiting = len(fields) > 1 and fields[1] == "->"  # "7: -> FLOCK ...": a waiter of lock 7
            if waiting:
                del fields[1]
            if len(fields) < 6 or fields[1] != "FLOCK":
                continue
            device_major, device_minor, inode = fields[5].split(":")
            locked = wanted.get((int(device_major, 16), int(device_minor, 16), int(inode)))
            if locked is not None:
                pid = int(fields[4])
                how = "waited for" if waiting else "held"
                lines.append(f"core {locked}'s lock {how} by pid {pid} ({_command(pid)})")
        return lines

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "not visible here"
