"""Per-core compute locks (tandem.service.core_locks), across real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.service.core_locks import CoreLocks


def _hold_and_log(directory: str, cores: list[int], holds: int, seed: int, log: str) -> None:
    rng = random.Random(seed)
    locks = CoreLocks(Path(directory))
    with open(log, "a") as out:
        for _ in range(holds):
            with locks.hold(cores):
                start = time.monotonic()
                time.sleep(rng.uniform(0.0005, 0.004))
                end = time.monotonic()
            out.write(f"{start} {end}\n")
            time.sleep(rng.uniform(0, 0.002))


@settings(max_examples=8, deadline=None)
@given(st.lists(st.sets(st.integers(0, 3), min_size=1, max_size=3), min_size=2, max_size=4), st.integers(0, 2**31))
def test_holders_of_a_common_core_never_overlap(tmp_path_factory: pytest.TempPathFactory, core_sets: list[set[int]],
                                                seed: int) -> None:
    """Processes holding random core sets: two whose sets share a core never hold at once (their
    hold intervals are disjoint); holders of disjoint sets are not serialized by each other."""
    directory = tmp_path_factory.mktemp("locks")
    ctx = mp.get_context("spawn")
    logs = [str(directory / f"holder-{i}.log") for i in range(len(core_sets))]
    procs = [ctx.Process(target=_hold_and_log, args=(str(directory), sorted(cores), 12, seed + i, log))
             for i, (cores, log) in enumerate(zip(core_sets, logs, strict=True))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    intervals = [[tuple(map(float, line.split())) for line in open(log)] for log in logs]
    assert all(len(i) == 12 for i in intervals)
    for a in range(len(core_sets)):
        for b in range(a + 1, len(core_sets)):
            if not core_sets[a] & core_sets[b]:
                continue
            for s1, e1 in intervals[a]:
                for s2, e2 in intervals[b]:
                    assert e1 <= s2 or e2 <= s1, (core_sets[a], core_sets[b], (s1, e1), (s2, e2))


def _hold_forever(directory: str, ready: str) -> None:
    locks = CoreLocks(Path(directory))
    with locks.hold([0, 1]):
        Path(ready).touch()
        time.sleep(600)


def test_a_killed_holder_frees_its_cores(tmp_path: Path) -> None:
    """A member killed mid-step does not wedge the cores: the kernel drops its locks."""
    ctx = mp.get_context("spawn")
    ready = tmp_path / "ready"
    holder = ctx.Process(target=_hold_forever, args=(str(tmp_path), str(ready)))
    holder.start()
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline and holder.is_alive()
        time.sleep(0.01)
    assert holder.pid is not None
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    locks = CoreLocks(tmp_path)
    start = time.monotonic()
    with locks.hold([1, 0]):
        pass
    assert time.monotonic() - start < 5
    locks.close()


def test_the_lock_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``TANDEM_CORE_LOCK_DIR`` when set; else beside the cell's shared-memory files (which a
    compose stack's containers share), under a name no cell's file sweep matches."""
    from tandem.engine.shm_files import SHM_DIR
    from tandem.service import core_locks

    monkeypatch.setenv("TANDEM_CORE_LOCK_DIR", str(tmp_path))
    assert core_locks.lock_dir() == tmp_path
    monkeypatch.delenv("TANDEM_CORE_LOCK_DIR")
    default = core_locks.lock_dir()
    assert default.name == "tandem.core-locks"
    if SHM_DIR.is_dir():
        assert default.parent == SHM_DIR


def test_a_directory_it_cannot_write_leaves_the_cores_unlocked(tmp_path: Path) -> None:
    """A lock directory this process cannot use (here a path under a plain file) is warned
    about and the work runs unlocked: a lock is never worth failing a step for."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    locks = CoreLocks(blocker / "locks")
    ran = []
    with locks.hold([0, 1]):
        ran.append(True)
    with locks.hold([1]):
        ran.append(True)
    assert ran == [True, True]
    locks.close()


def _hold_cores(directory: str, cores: list[int], ready: str) -> None:
    locks = CoreLocks(Path(directory))
    with locks.hold(cores):
        Path(ready).touch()
        time.sleep(600)


@pytest.mark.parametrize("seed", range(3))
def test_holders_names_who_holds_and_who_waits(tmp_path: Path, seed: int) -> None:
    """``holders`` (what a stalled decode loop's report adds) names the process holding each
    asked core's lock, with its command line, and this process's thread waiting for it; cores
    nobody holds give no line."""
    import threading

    rng = random.Random(seed)
    held = sorted(rng.sample(range(6), rng.randint(1, 3)))
    free = sorted(set(range(6)) - set(held))[:2]
    ctx = mp.get_context("spawn")
    ready = tmp_path / "ready"
    holder = ctx.Process(target=_hold_cores, args=(str(tmp_path), held, str(ready)))
    holder.start()
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and holder.is_alive()
            time.sleep(0.01)
        locks = CoreLocks(tmp_path)
        waiter = threading.Thread(target=lambda: locks.hold(held).__enter__(), daemon=True)
        waiter.start()
        time.sleep(0.2)  # blocked in flock by now
        lines = locks.holders([*held, *free])
        for core in held:
            mine = [line for line in lines if line.startswith(f"core {core}'s lock held by pid {holder.pid} (")]
            assert len(mine) == 1 and "python" in mine[0], lines
        first = held[0]  # locked in ascending order: the waiter waits on the first
        assert any(line.startswith(f"core {first}'s lock waited for by pid {os.getpid()} ") for line in lines), lines
        assert not any(line.startswith(f"core {core}'s") for core in free for line in lines), lines
    finally:
        holder.kill()
        holder.join(10)
