"""A serving process whose event loop blocks for good exits (EXIT_LOOP_FAILED, every thread's
stack on stderr) once the loop has answered nothing for the watchdog's limit, so that a
supervisor that restarts what exits (docker's ``restart: unless-stopped``, ``tandem up``)
restarts it; a loop blocked for less than the limit at a time, or a process stopped (SIGSTOP)
past the limit and resumed, is left serving. Real processes (``tests.unit.loop_child``), random
limits and stop lengths."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.service.runtime import EXIT_LOOP_FAILED

ROOT = Path(__file__).resolve().parents[2]


def _start(mode: str, limit_s: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.unit.loop_child", mode, f"{limit_s:.3f}"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "serving"
    return proc


def _exit_of_blocked(mode: str, limit_s: float, wait_s: float) -> tuple[int, float, str]:
    """Start a child that blocks its loop (``mode``): its exit code, seconds it lived, stderr."""
    began = time.monotonic()
    proc = _start(mode, limit_s)
    try:
        code = proc.wait(wait_s)
    finally:
        proc.kill()
    took_s = time.monotonic() - began
    return code, took_s, proc.communicate()[1]


@pytest.mark.parametrize("seed", range(2))
def test_a_loop_blocked_for_good_exits_with_its_stacks(seed: int) -> None:
    limit_s = random.Random(seed).uniform(1.0, 2.5)
    code, took_s, err = _exit_of_blocked("block", limit_s, limit_s + 20)
    assert code == EXIT_LOOP_FAILED
    assert limit_s <= took_s < limit_s + 20
    assert "the event loop blocked for" in err
    assert "Stacks of every thread" in err and "in serve" in err  # where it was stuck


def test_a_loop_blocked_holding_the_log_lock_still_exits() -> None:
    """Exiting can block too (here the loop holds the log handler's lock, which flushing the logs
    takes): the
    process exits EXIT_LOOP_FAILED regardless, 10 s after the limit."""
    limit_s = random.uniform(1.0, 2.0)
    code, took_s, _ = _exit_of_blocked("block_log", limit_s, limit_s + 30)
    assert code == EXIT_LOOP_FAILED
    assert limit_s + 10 <= took_s < limit_s + 30


@pytest.mark.parametrize("seed", range(2))
def test_short_blocks_and_a_long_stop_are_left_serving(seed: int) -> None:
    rng = random.Random(seed)
    limit_s = rng.uniform(1.0, 2.0)
    short = _start("short", limit_s)
    idle = _start("idle", limit_s)
    try:
        time.sleep(rng.uniform(0.0, limit_s))
        os.kill(idle.pid, signal.SIGSTOP)  # stopped past the limit: not the loop's silence
        time.sleep(limit_s * rng.uniform(1.5, 2.5))
        os.kill(idle.pid, signal.SIGCONT)
        assert idle.wait(8 * limit_s + 20) == 0, idle.communicate()[1]
        assert short.wait(8 * limit_s + 20) == 0, short.communicate()[1]
    finally:
        for proc in (short, idle):
            proc.kill()
            proc.communicate()
