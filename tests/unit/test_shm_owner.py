"""Shared-memory owners: a live owner's files are never removed, a dead owner's always can be;
and the launcher's restart budget (exponential backoff, then give up)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem import launcher
from tandem.engine import shm_files


@pytest.fixture
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setattr(shm_files, "SHM_DIR", tmp_path)
    yield tmp_path


def _stores(directory: Path, prefix: str) -> list[Path]:
    files = [directory / f"tandem-{prefix}-{part}{suffix}" for part in ("weights", "kv") for suffix in (".bin", ".json")]
    for path in files:
        path.write_bytes(b"x")
    return files


def _hold_lock(directory: Path, prefix: str) -> subprocess.Popen[str]:
    """Another process that takes the owner lock and keeps it until killed."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from tandem.engine import shm_files
        shm_files.SHM_DIR = Path({str(directory)!r})
        shm_files.OwnerLock.acquire({prefix!r})
        print("locked", flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
    return proc


def test_live_owner_is_left_alone_and_dead_owner_is_swept(shm_dir: Path) -> None:
    live = _stores(shm_dir, "cell0-aaaa")
    dead = _stores(shm_dir, "cell0-bbbb")
    other_cell = _stores(shm_dir, "cell0-aaaa-x")  # a cell named "cell0-aaaa": not prefix cell0-aaaa's
    unowned = _stores(shm_dir, "legacy")  # no lock file: nobody can prove its owner is dead
    holder = _hold_lock(shm_dir, "cell0-aaaa")
    dying = _hold_lock(shm_dir, "cell0-bbbb")
    try:
        assert shm_files.remove_if_dead("cell0-aaaa") is None
        assert shm_files.sweep_dead_owners("cell0-") == {}  # both alive
        dying.kill()  # SIGKILL: the kernel drops its lock
        dying.wait()
        swept = shm_files.sweep_dead_owners("cell0-")
        assert list(swept) == ["cell0-bbbb"] and sorted(swept["cell0-bbbb"]) == sorted(dead)
        assert not (shm_dir / "tandem-cell0-bbbb.lock").exists()
        assert all(p.exists() for p in live + other_cell + unowned)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(shm_files.remove_if_dead("cell0-aaaa") or []) == sorted(live)
    assert all(p.exists() for p in other_cell + unowned)


def test_release_removes_the_owners_files(shm_dir: Path) -> None:
    owner = shm_files.OwnerLock.acquire("cell1-cccc")
    files = _stores(shm_dir, "cell1-cccc")
    assert shm_files.remove_if_dead("cell1-cccc") is None  # our own lock: a live owner
    assert sorted(owner.release()) == sorted(files)
    assert not any(shm_dir.iterdir())
    assert owner.release() == []


def test_shm_module_reads_the_same_directory() -> None:
    shm = importlib.import_module("tandem.engine.shm")
    assert shm.SHM_DIR == shm_files.SHM_DIR


def test_restart_budget_backs_off_then_gives_up() -> None:
    budget = launcher.RestartBudget(max_restarts=3, window_s=60.0, initial_backoff_s=1.0, max_backoff_s=3.0)
    assert [budget.next_delay_s(t) for t in (0.0, 1.0, 2.0)] == [1.0, 2.0, 3.0]  # doubled, capped
    assert budget.next_delay_s(3.0) is None  # a fourth death within 60 s: give up
    assert budget.next_delay_s(60.5) == 3.0  # the first death left the window: two remain in it
    assert budget.next_delay_s(200.0) == 1.0  # all forgotten
    with pytest.raises(ValueError):
        launcher.RestartBudget(max_restarts=-1, window_s=1.0)
