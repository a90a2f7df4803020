"""A service whose vital loop raises shuts down as on SIGTERM (so it leaves the registry first),
then exits 70; a shutdown that hangs is cut short."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tandem.service.runtime import EXIT_LOOP_FAILED

SERVICE = textwrap.dedent("""
    import asyncio, logging, sys, time
    from tandem.service.runtime import VitalTasks, run_service

    async def serve(stop):
        tasks = VitalTasks(stop, logging.getLogger("svc"))

        async def loop():
            await asyncio.sleep(0.05)
            raise RuntimeError("boom")

        async def quiet():  # returning is not failing
            return None

        tasks.start(quiet(), "quiet loop")
        tasks.start(loop(), "batch loop")
        try:
            await stop.wait()
            print("left the registry", flush=True)  # where announce() unregisters
        finally:
            if sys.argv[1] == "hang":
                time.sleep(60)  # a stuck shutdown, blocking the event loop itself
            await tasks.cancel()
            tasks.exit_if_failed()
        print("unreachable", flush=True)

    logging.basicConfig()
    run_service(serve)
""")


@pytest.mark.parametrize("shutdown", ["clean", "hang"])
def test_a_failed_loop_stops_the_service_then_exits_70(shutdown: str) -> None:
    """A stuck shutdown after a failed loop is cut at the shutdown's deadline, still with 70."""
    import os
    import random

    deadline_s = random.uniform(0.5, 1.5)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", SERVICE, shutdown], capture_output=True, text=True, timeout=30,
                          cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "TANDEM_SHUTDOWN_DEADLINE_S": str(deadline_s)})
    assert done.returncode == EXIT_LOOP_FAILED, done.stderr
    assert done.stdout.splitlines() == ["left the registry"]
    assert "batch loop failed; stopping and exiting 70" in done.stderr and "RuntimeError: boom" in done.stderr
    overdue = f"batch loop failed and the shutdown not finished within {deadline_s:g} s; exiting 70"
    assert (overdue in done.stderr) == (shutdown == "hang"), done.stderr
    assert time.monotonic() - start < 15


DEADLINE_SERVICE = textwrap.dedent("""
    import asyncio, sys, threading, time
    from pathlib import Path
    from tandem.service.runtime import last_words, run_service

    marker = Path(sys.argv[2])

    def remove_shared_memory():
        with marker.open("a") as f:
            f.write(threading.current_thread().name + "\\n")

    def stuck_in_a_thread():
        time.sleep(60)

    async def serve(stop):
        with last_words(remove_shared_memory):
            print("serving", flush=True)
            await stop.wait()
            how = sys.argv[1]
            if how == "blocked_loop":
                time.sleep(60)
            elif how == "awaits_forever":
                await asyncio.Event().wait()
            elif how == "executor_thread":
                # main returns, but the event loop's teardown waits for its executor's thread
                asyncio.get_running_loop().run_in_executor(None, stuck_in_a_thread)
        remove_shared_memory()

    run_service(serve)
""")


@pytest.mark.parametrize("how", ["clean", "blocked_loop", "awaits_forever", "executor_thread"])
def test_a_shutdown_past_its_deadline_dumps_stacks_runs_last_words_and_exits_75(how: str, tmp_path: Path) -> None:
    import os
    import random
    import signal

    from tandem.service.runtime import EXIT_SHUTDOWN_OVERDUE

    marker = tmp_path / "last-words"
    deadline_s = random.uniform(0.5, 1.5)
    proc = subprocess.Popen([sys.executable, "-c", DEADLINE_SERVICE, how, str(marker)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
                            env={**os.environ, "TANDEM_SHUTDOWN_DEADLINE_S": str(deadline_s)})
    assert proc.stdout is not None and proc.stdout.readline() == "serving\n"
    time.sleep(random.uniform(0.0, 0.3))
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    took = time.monotonic() - start
    ran_on = marker.read_text().split()
    if how == "clean":
        assert proc.returncode == 0, stderr
        assert ran_on == ["MainThread"] and "shutdown not finished" not in stderr
        return
    assert proc.returncode == EXIT_SHUTDOWN_OVERDUE, stderr
    assert f"shutdown not finished within {deadline_s:g} s; exiting 75" in stderr
    # the stacks show what was stuck
    assert {"blocked_loop": "in serve", "awaits_forever": "in run_service",
            "executor_thread": "in stuck_in_a_thread"}[how] in stderr, stderr
    # The forced exit's thread said the last words; past serve (the executor's case), the normal
    # path had said them and they were no longer registered.
    assert ran_on == ["MainThread"] if how == "executor_thread" else ran_on[0] != "MainThread" and len(ran_on) == 1
    assert deadline_s <= took < deadline_s + 10


@pytest.mark.parametrize("stop_first", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_unless_stopped_returns_the_result_or_cancels_the_wait_once_told_to_stop(stop_first: bool, seed: int) -> None:
    """``unless_stopped``: the awaited result when it comes first (even with the stop set after),
    the awaited error as it is, and once the stop comes first the awaitable is cancelled (its
    cleanup has run) and :class:`StoppedWhileStarting` raised."""
    import asyncio
    import random

    from tandem.service.runtime import StoppedWhileStarting, unless_stopped

    rng = random.Random(seed)
    work_s, stop_s = sorted(rng.uniform(0.0, 0.05) for _ in range(2))
    if stop_first:
        work_s, stop_s = stop_s + 0.02, work_s
    cleaned: list[bool] = []

    async def work() -> int:
        try:
            await asyncio.sleep(work_s)
            return 7
        except asyncio.CancelledError:
            cleaned.append(True)
            raise

    async def failing() -> int:
        raise ValueError("no agent")

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(stop_s, stop.set)
        if stop_first:
            with pytest.raises(StoppedWhileStarting, match="joining"):
                await unless_stopped(work(), stop, "joining")
            assert cleaned == [True]
        else:
            assert await unless_stopped(work(), stop, "joining") == 7
            assert not cleaned
            with pytest.raises(ValueError, match="no agent"):
                await unless_stopped(failing(), asyncio.Event(), "joining")
        await asyncio.sleep(0.06)  # no task left behind raises later
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


def test_unless_counts_a_failed_watch_as_the_interrupt_and_leaves_no_task_behind() -> None:
    """``unless`` (unless_stopped's and the router's wait for a client's disconnect): a watch that
    fails (a client's receive raising) interrupts as a completed one does, and the work is
    cancelled and awaited (its cleanup has run) before the interrupt is raised."""
    import asyncio

    from tandem.service.runtime import unless

    class Interrupted(Exception):
        pass

    cleaned: list[bool] = []

    async def work() -> int:
        try:
            await asyncio.sleep(5)
            return 1
        except asyncio.CancelledError:
            cleaned.append(True)
            raise

    async def watch_fails() -> None:
        await asyncio.sleep(0.01)
        raise OSError("receive failed")

    async def main() -> None:
        with pytest.raises(Interrupted):
            await unless(work(), watch_fails(), Interrupted)
        assert cleaned == [True]
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())
