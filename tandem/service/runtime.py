"""Running a service process: uvloop, logging, graceful shutdown on SIGINT/SIGTERM, and a
deadline for that shutdown."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from tandem.ports import free_port, free_ports  # noqa: F401  (re-exported for the launcher and tests)

C = TypeVar("C")
T = TypeVar("T")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s"

# Exit status of a service whose background loop failed (EX_SOFTWARE); its supervisor restarts it.
EXIT_LOOP_FAILED = 70
# Exit status of a service whose shutdown did not finish within its deadline (EX_TEMPFAIL).
EXIT_SHUTDOWN_OVERDUE = 75
# How long a service may take to shut down once told to stop, below the launcher's 10 s before
# SIGKILL (a SIGKILLed gpu_agent could not remove its shared memory itself).
SHUTDOWN_DEADLINE_S = 8.0
# How long a loop with work may go without progress before ``watch_progress`` says where it waits.
STALL_REPORT_S = 20.0
# How long a serving process's event loop may answer nothing before the process exits
# (``watch_event_loop``; ``TANDEM_LOOP_WATCHDOG_S``, 0: never).
LOOP_WATCHDOG_S = 60.0

# What must run even when the shutdown is stuck (see ``last_words``).
_last_words: list[Callable[[], object]] = []
_exiting = threading.Lock()


def setup_logging(name: str) -> logging.Logger:
    level = os.environ.get("TANDEM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    return logging.getLogger(name)


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (modules, the model, torch's and grpc's
    state: about 200k objects in decode_svc) out of the garbage collector's sight for good
    (``gc.freeze``), when a service is ready to serve. Its full collections then walk only what
    serving allocated: a full collection of decode_svc took 110 ms, a pause between two decode
    steps that every stream felt (seen as 114-124 ms gaps among 810 steps of 1 ms median), and
    1.5 ms after the freeze. Nothing frozen is ever freed, so only what lives for the process."""
    gc.collect()
    gc.freeze()


def serving() -> None:
    """What every service does once it is ready to serve, just before it says so: freeze its
    start-up heap (``freeze_startup_heap``) and start the watchdog of its event loop
    (``watch_event_loop``)."""
    freeze_startup_heap()
    watch_event_loop()


def watch_event_loop(limit_s: float | None = None, ping_s: float = 1.0) -> threading.Thread | None:
    """A daemon thread that pings the calling event loop every ``ping_s`` (``call_soon_threadsafe``)
    and, once the loop has answered none for ``limit_s`` (``TANDEM_LOOP_WATCHDOG_S``,
    :data:`LOOP_WATCHDOG_S`; 0: no watchdog), exits the process with :data:`EXIT_LOOP_FAILED` and
    every thread's and task's stack (``exit_now``). A loop that blocked that long (a synchronous
    call that never returns, a lock a thread holds for good) serves nothing, and its health
    service answers nothing: ``tandem up``'s liveness watch would kill it, but under docker
    compose a healthcheck only marks it unhealthy, and Docker restarts a container that exits
    (``restart: unless-stopped``), not an unhealthy one. Run it once serving: start-up may block
    the loop (loading, packing weights). Time the thread itself did not run (the process stopped
    with SIGSTOP, or starved of CPU for longer than a ping) restarts the count, so a process
    resumed after a long stop does not exit for it; a stopped process stays the liveness watch's."""
    if limit_s is None:
        limit_s = float(os.environ.get("TANDEM_LOOP_WATCHDOG_S", LOOP_WATCHDOG_S))
    if limit_s <= 0:
        return None
    loop = asyncio.get_running_loop()
    answered = [time.monotonic()]

    def answer() -> None:
        answered[0] = time.monotonic()

    def watch() -> None:
        silent_since = time.monotonic()
        last = silent_since
        while not loop.is_closed():
            time.sleep(ping_s)
            now = time.monotonic()
            if now - last > 2 * ping_s + 1.0:  # this thread did not run: not the loop's silence
                silent_since = now
            last = now
            if answered[0] >= silent_since:
                silent_since = now
            elif now - silent_since >= limit_s:
                # writing the stacks and flushing the logs could block too (the loop may hold a
                # log handler's lock, or stderr be a full pipe): exit regardless a little later
                backstop = threading.Timer(10.0, os._exit, args=(EXIT_LOOP_FAILED,))
                backstop.daemon = True
                backstop.start()
                exit_now(EXIT_LOOP_FAILED, f"the event loop blocked for {now - silent_since:.0f} s", loop)
            try:
                loop.call_soon_threadsafe(answer)
            except RuntimeError:  # the loop closed: the process is ending
                return

    thread = threading.Thread(target=watch, name="loop-watchdog", daemon=True)
    thread.start()
    return thread


def run_service(main: Callable[[asyncio.Event], Awaitable[None]], deadline_s: float | None = None) -> None:
    """Run ``main(stop_event)`` on uvloop; SIGINT/SIGTERM set the event and main returns.

    Once the event is set (by a signal or a failed vital loop), the process has ``deadline_s``
    (``TANDEM_SHUTDOWN_DEADLINE_S``, default :data:`SHUTDOWN_DEADLINE_S`) to end, the event
    loop's own teardown included: past it, a thread writes every thread's stack to stderr (what
    was stuck), runs the ``last_words`` and exits :data:`EXIT_SHUTDOWN_OVERDUE`.
    """
    import uvloop

    if deadline_s is None:
        deadline_s = float(os.environ.get("TANDEM_SHUTDOWN_DEADLINE_S", SHUTDOWN_DEADLINE_S))

    async def runner() -> None:
        loop = asyncio.get_running_loop()
        stop = _StopEvent(deadline_s, loop)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await main(stop)
        except StoppedWhileStarting as exc:
            logging.getLogger("tandem.runtime").info("stopped while starting (%s); nothing to drain", exc)

    uvloop.run(runner())


class _StopEvent(asyncio.Event):
    """The service's stop event: setting it also starts the shutdown's deadline, at once (a task
    woken by it could be what blocks the event loop)."""

    def __init__(self, deadline_s: float, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._deadline_s = deadline_s
        self._loop = loop
        self._timer: threading.Timer | None = None
        self._code = EXIT_SHUTDOWN_OVERDUE
        self._cause = "shutdown"

    def set(self) -> None:
        super().set()
        if self._timer is None:
            self._timer = threading.Timer(self._deadline_s, self._overdue)
            self._timer.daemon = True
            self._timer.start()

    def fail(self, cause: str) -> None:
        """Stop because ``cause`` failed: a shutdown past its deadline then exits
        :data:`EXIT_LOOP_FAILED`, as the finished one does, not :data:`EXIT_SHUTDOWN_OVERDUE`."""
        self._code, self._cause = EXIT_LOOP_FAILED, f"{cause} failed and the shutdown"
        self.set()

    def _overdue(self) -> None:
        exit_now(self._code, f"{self._cause} not finished within {self._deadline_s:g} s", self._loop)


@contextmanager
def last_words(action: Callable[[], object]) -> Iterator[None]:
    """Within the body, ``action`` runs before a forced exit (a shutdown past its deadline, or a
    failed vital loop whose shutdown hangs), from the thread that forces it. The normal shutdown
    should run it too; it must be safe to run twice and from another thread (the gpu_agent
    removes its shared memory)."""
    _last_words.append(action)
    try:
        yield
    finally:
        _last_words.remove(action)


def exit_now(code: int, reason: str, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Exit at once with ``code``, from any thread: write ``reason``, every thread's stack and
    (given the service's event ``loop``) every task's to stderr, run the ``last_words``, flush
    the logs. Only the first caller gets through."""
    if not _exiting.acquire(blocking=False):
        return
    try:
        print(f"{reason}; exiting {code}. Stacks of every thread:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if loop is not None:
            try:  # read from another thread than the loop's: a best effort, for the reader
                print("\n".join(_task_lines(loop)), file=sys.stderr)
            except Exception as exc:
                print(f"(could not list the event loop's tasks: {exc!r})", file=sys.stderr)
        for action in list(_last_words):
            try:
                action()
            except Exception:
                logging.getLogger("tandem.runtime").exception("last words %r failed", action)
        logging.shutdown()
    finally:
        os._exit(code)


def service_main(
    prog: str,
    parse_args: Callable[[list[str] | None], C],
    serve: Callable[[C, asyncio.Event], Awaitable[None]],
    argv: list[str] | None = None,
) -> None:
    """The ``python -m <service>`` entry point: a bad flag exits 2 with ``prog: error: ...``."""
    from tandem.engine.errors import TandemError

    try:
        config = parse_args(argv)
    except (ValueError, TandemError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    run_service(lambda stop: serve(config, stop))


class StoppedWhileStarting(Exception):
    """The stop event was set while the service still waited to start (for its agent): it ends
    at once, exit 0, with nothing to drain."""


async def unless(awaitable: Awaitable[T], interrupt: Awaitable[Any], interrupted: Callable[[], BaseException]) -> T:
    """``awaitable``'s result, or ``interrupted()`` raised once ``interrupt`` completes first: the
    awaitable is then cancelled and awaited, so its cleanup has run before this returns."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(interrupt)
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
    if watch.done() and not watch.cancelled():
        watch.exception()  # retrieved: a watch that failed counts as the interrupt
    if task.cancelled():
        raise interrupted()
    return task.result()


async def unless_stopped(awaitable: Awaitable[T], stop: asyncio.Event, what: str) -> T:
    """``awaitable``'s result, or :class:`StoppedWhileStarting` (it cancelled) once ``stop`` is set
    first. A service waiting to join an agent that is not there (restarting, or killed again) must
    still end on SIGTERM: before, it waited on until its shutdown deadline and exited
    :data:`EXIT_SHUTDOWN_OVERDUE` (8 s per service of a cell the launcher restarts)."""
    return await unless(awaitable, stop.wait(), lambda: StoppedWhileStarting(f"told to stop while {what}"))


class AgentGoneError(RuntimeError):
    """The cell's gpu_agent that this process joined is gone (its shared memory was removed)."""


async def watch_agent(store_name: str, stop: asyncio.Event, interval_s: float = 1.0) -> None:
    """Raise :class:`AgentGoneError` once the agent's store ``store_name`` is removed.

    An agent removes its stores when it stops, and its successor or the launcher removes them
    when it dies; a service still mapping them computes on a pool no agent owns any more, so it
    must exit and join the new agent (its supervisor restarts it). Ends quietly once ``stop`` is
    set: during a shutdown the agent may well go first.
    """
    from tandem.engine.shm_files import store_paths

    manifest = store_paths(store_name)[1]
    while not stop.is_set():
        if not manifest.exists():
            if stop.is_set():
                return
            raise AgentGoneError(f"the gpu_agent's shared memory {manifest} was removed: its agent is gone")
        try:
            async with asyncio.timeout(interval_s):
                await stop.wait()
        except TimeoutError:
            pass


def _task_lines(loop: asyncio.AbstractEventLoop) -> list[str]:
    """Every task of ``loop`` and the await chain it waits in."""
    tasks = asyncio.all_tasks(loop)
    lines = [f"Tasks of the event loop ({len(tasks)}):"]
    for task in tasks:
        lines.append(f"  {task.get_name()}:")
        lines += [f"    {line}" for line in _awaiting(task)]
    return lines


def _thread_lines() -> list[str]:
    """Every other thread's Python stack, innermost call last (the torch thread's step, a
    thread blocked on a lock)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        lines.append(f"Thread {names.get(ident, ident)}:")
        lines += [f"  {line.rstrip()}" for entry in traceback.format_stack(frame) for line in entry.splitlines()]
    return lines


async def watch_progress(what: str, progress: Callable[[], int], busy: Callable[[], str], log: logging.Logger,
                         stall_s: float | None = None, more: Callable[[], list[str]] | None = None) -> None:
    """Say where this process waits when a loop with work makes no progress: once ``busy()``
    (what the loop has to do, "" when nothing) has been non-empty for ``stall_s``
    (``TANDEM_STALL_REPORT_S``, :data:`STALL_REPORT_S`) with ``progress()`` unchanged, log a
    warning with every task's await chain, every other thread's stack and the lines ``more``
    gives (the partition in force, who holds the core locks), once per stall, and an info line
    when it moves again. A diagnosis for a wedge (a lock held across an await, a wait no event
    ends), not a cure: nothing is cancelled."""
    if stall_s is None:
        stall_s = float(os.environ.get("TANDEM_STALL_REPORT_S", STALL_REPORT_S))
    loop = asyncio.get_running_loop()
    seen, since, reported = progress(), time.monotonic(), False
    while True:
        await asyncio.sleep(min(5.0, stall_s / 4))
        now, count, work = time.monotonic(), progress(), busy()
        if count != seen or not work:
            if reported:
                log.info("%s %s after %.0f s", what, "moves again" if count != seen else "has no work left",
                         now - since)
            seen, since, reported = count, now, False
        elif not reported and now - since >= stall_s:
            reported = True
            lines = [f"{what} has made no progress for {now - since:.0f} s with work to do ({work}); where it waits:",
                     *_task_lines(loop), *_thread_lines(), *(more() if more is not None else [])]
            log.warning("%s", "\n".join(lines))


def _awaiting(task: asyncio.Task[Any]) -> list[str]:
    """Where ``task`` waits: each coroutine of its await chain, outermost first (a task's own
    ``get_stack`` shows only the outermost)."""
    lines = []
    coro: Any = task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            lines.append(f"{frame.f_code.co_filename}, line {frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines


class VitalTasks:
    """Background loops a service cannot serve without: the first that raises stops the process.

    The failure sets ``stop``, so the service shuts down as on SIGTERM — it leaves the registry
    (routers and prefill stop picking it) and stops its gRPC server — and then
    :meth:`exit_if_failed`, called last in the service's shutdown, exits with
    :data:`EXIT_LOOP_FAILED`. Under :func:`run_service` a shutdown stuck past its deadline (a loop
    or thread stuck) exits with that code too. A loop that returns normally is not a failure.
    """

    def __init__(self, stop: asyncio.Event, log: logging.Logger) -> None:
        self._stop = stop
        self._log = log
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failed: str | None = None  # the name of the first loop that raised

    def start(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is None or self.failed is not None:
            return
        self.failed = task.get_name()
        self._log.critical("%s failed; stopping and exiting %d", self.failed, EXIT_LOOP_FAILED,
                           exc_info=task.exception())
        if isinstance(self._stop, _StopEvent):
            self._stop.fail(self.failed)
        else:  # outside run_service: no deadline
            self._stop.set()

    async def cancel(self) -> None:
        """Cancel every loop and wait for them to end."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def exit_if_failed(self) -> None:
        if self.failed is not None:
            logging.shutdown()
            os._exit(EXIT_LOOP_FAILED)
