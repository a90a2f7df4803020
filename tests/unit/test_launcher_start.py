"""``tandem up`` starts a stack all at once: every cell's agent, its prefill and decode services
and the router, and waits until each serves; a service whose agent dies is given up at once.
Real processes (``tests.unit.wave_child``: a gRPC server that starts after a random delay),
random delays, one member that dies in some runs."""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.launcher import CellProcs, Child, RestartBudget, Supervisor
from tandem.service.runtime import free_port

ROOT = Path(__file__).resolve().parents[2]


def _child(name: str, log: Path, delay_s: float, needs: list[Child], code: int = 0) -> Child:
    port = free_port()
    argv = ["tests.unit.wave_child", name, str(port), str(log), f"{delay_s:.3f}", str(code),
            *(c.address.rsplit(":", 1)[1] for c in needs)]
    return Child(name, lambda: argv, f"127.0.0.1:{port}", {"PYTHONPATH": str(ROOT)}, RestartBudget(3, 60.0))


def _supervisor(cells: list[CellProcs], router: Child) -> Supervisor:
    sup = Supervisor.__new__(Supervisor)  # the start-up logic alone: no args, plans or Redis
    sup.args = argparse.Namespace(ready_timeout_s=60.0, restart_ready_timeout_s=0.0)
    sup.stopping = False
    sup.liveness = None
    sup.redis_server = None
    sup.redis_url = ""
    sup.cells = cells
    sup.router = router
    sup.children = [*(c for cell in cells for c in cell.children), router]
    return sup


def _watch_rounds(watch: Any, children: list[Child], seconds: float, pause_s: Callable[[], float]) -> list[str]:
    """Rounds of a ``LivenessWatch`` for up to ``seconds``, until one kills: what it killed."""
    killed: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and not killed:
        killed = watch.check(children)
        time.sleep(pause_s())
    return killed


def _events(log: Path) -> list[tuple[float, str, str, str]]:
    rows = [line.split(" ") + [""] for line in log.read_text().splitlines()]
    return sorted((float(r[0]), r[1], r[2], r[3]) for r in rows)


@pytest.mark.parametrize("seed", range(3))
def test_every_process_starts_at_once_and_the_start_ends_when_each_serves(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    log = tmp_path / "events"
    cells = []
    for i in range(rng.randint(1, 2)):
        # an agent slower to serve than any process takes to start (as one loading weights)
        agent = _child(f"agent{i}", log, rng.uniform(1.5, 2.0), [])
        cell = CellProcs(SimpleNamespace(cell_id=f"c{i}"), agent.address, agent)  # type: ignore[arg-type]
        cell.workers = [_child(f"{role}{i}", log, rng.uniform(0.2, 0.8), [agent]) for role in ("decode", "prefill")]
        cells.append(cell)
    workers = [w for cell in cells for w in cell.workers]
    router = _child("router", log, rng.uniform(0.0, 0.3), workers)
    sup = _supervisor(cells, router)
    try:
        sup.start(sup.children)
        events = _events(log)
        starts = {name: (t, up) for t, what, name, up in events if what == "start"}
        readies = {name: t for t, what, name, _ in events if what == "ready"}
        assert set(readies) == {c.name for c in sup.children}  # it returned once every one served
        # together, not one after another: every process started before any agent served
        first_agent_ready = min(readies[cell.agent.name] for cell in cells if cell.agent is not None)
        assert max(t for t, _ in starts.values()) < first_agent_ready
        for w in workers:
            assert starts[w.name][1] == ""  # its agent was not serving yet
        assert all(c.alive() for c in sup.children)
    finally:
        for child in sup.children:
            child.stop(5)


def test_an_agent_that_dies_gives_up_its_services_at_once(tmp_path: Path) -> None:
    log = tmp_path / "events"
    agent = _child("agent", log, 0.3, [], code=5)
    cell = CellProcs(SimpleNamespace(cell_id="c"), agent.address, agent)  # type: ignore[arg-type]
    # services that would wait long for their agent (here: serve only after 60 s)
    cell.workers = [_child(role, log, 60.0, [agent]) for role in ("decode", "prefill")]
    router = _child("router", log, 0.0, [])
    sup = _supervisor([cell], router)
    try:
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="agent exited with code 5"):
            sup.start(sup.children)
        assert time.monotonic() - began < 20  # not the services' 60 s, nor the ready timeout
        assert not any(w.alive() for w in cell.workers)  # stopped: the next round restarts the cell
        assert router.alive()
    finally:
        for child in sup.children:
            child.stop(5)


def test_a_worker_that_dies_fails_the_start_once_the_others_serve(tmp_path: Path) -> None:
    log = tmp_path / "events"
    agent = _child("agent", log, 0.0, [])
    cell = CellProcs(SimpleNamespace(cell_id="c"), agent.address, agent)  # type: ignore[arg-type]
    dying = _child("decode", log, 0.1, [agent], code=5)
    healthy = _child("prefill", log, 0.6, [agent])
    cell.workers = [dying, healthy]
    router = _child("router", log, 0.3, [])
    sup = _supervisor([cell], router)
    try:
        with pytest.raises(RuntimeError, match="decode exited with code 5"):
            sup.start(sup.children)
        names = {(what, name) for _, what, name, _ in _events(log)}
        assert ("ready", "prefill") in names and ("ready", "router") in names  # waited for, left serving
        assert healthy.alive() and router.alive() and not dying.alive()
    finally:
        for child in sup.children:
            child.stop(5)


@pytest.mark.parametrize("seed", range(3))
def test_every_process_found_dead_restarts_in_one_round(seed: int, tmp_path: Path) -> None:
    """Several faults at once (a soak killed the router while the cell's agent was being
    restarted): one ``restart`` round brings back the dead agent's whole cell (its live
    services stopped first) and every other dead process with it, started together after the
    longest backoff, rather than the router after the cell's restart. A process out of restarts
    makes the round give up."""
    import os
    import signal

    rng = random.Random(seed)
    log = tmp_path / "events"
    agent = _child("agent", log, rng.uniform(0.3, 0.8), [])
    cell = CellProcs(SimpleNamespace(cell_id="c"), agent.address, agent)  # type: ignore[arg-type]
    cell.workers = [_child(role, log, rng.uniform(0.0, 0.3), [agent]) for role in ("decode", "prefill")]
    router = _child("router", log, rng.uniform(0.0, 0.3), [])
    sup = _supervisor([cell], router)
    sup.args.restart_window_s, sup.args.max_restarts = 60.0, 3
    try:
        sup.start(sup.children)
        killed = [agent, router, *rng.sample(cell.workers, rng.randint(0, 2))]
        rng.shuffle(killed)
        for child in killed:
            assert child.proc is not None
            os.kill(child.proc.pid, signal.SIGKILL)
            child.proc.wait(5)
        survivors = [w for w in cell.workers if w not in killed]
        mark = log.stat().st_size
        assert sup.restart([c for c in sup.children if not c.alive()])
        assert all(c.alive() for c in sup.children)
        with open(log) as f:
            f.seek(mark)
            started = {line.split(" ")[2] for line in f if line.split(" ")[1] == "start"}
        assert started == {c.name for c in sup.children}  # the cell whole (survivors too), the router
        assert all(c.num_restarts == 0 for c in cell.workers)  # restarted with their cell, not counted
        assert agent.num_restarts == router.num_restarts == 1
        assert all(s.proc is not None and s.proc.returncode is None for s in survivors)

        router.budget = RestartBudget(0, 60.0)  # out of restarts: the round gives up
        assert router.proc is not None
        os.kill(router.proc.pid, signal.SIGKILL)
        router.proc.wait(5)
        assert not sup.restart([router])
    finally:
        for child in sup.children:
            child.stop(5)


@pytest.mark.parametrize("seed", range(2))
def test_the_liveness_watch_kills_a_frozen_process_and_only_it(seed: int, tmp_path: Path) -> None:
    """``LivenessWatch`` on real processes answering the standard gRPC health check: none is
    killed while they answer; one frozen (SIGSTOP) is SIGKILLed once silent past the timeout,
    not before, and the other is left alone; a pause in the rounds (the supervisor's loop blocked
    by a restart) starts every silence again rather than killing at the first round after it."""
    import os
    import signal

    from tandem.launcher import LIVENESS_EVERY_S, LivenessWatch

    rng = random.Random(seed)
    log = tmp_path / "events"
    a, b = _child("a", log, rng.uniform(0.0, 0.3), []), _child("b", log, rng.uniform(0.0, 0.3), [])
    sup = _supervisor([], b)
    sup.children = [a, b]
    timeout_s = rng.uniform(1.5, 2.5)
    watch = LivenessWatch(timeout_s)

    def rounds(seconds: float) -> list[str]:
        return _watch_rounds(watch, [a, b], seconds, lambda: 0.2)

    try:
        sup.start([a, b])
        assert rounds(timeout_s + 1.5) == [] and a.alive() and b.alive()
        os.kill(a.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        frozen_at = time.monotonic()
        assert rounds(timeout_s + 8) == ["a"]
        # silent since its last answer, which may precede the freeze by a probe's period
        assert time.monotonic() - frozen_at >= timeout_s - LIVENESS_EVERY_S - 0.3
        assert not a.alive() and a.returncode == -signal.SIGKILL and b.alive()

        os.kill(b.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        time.sleep(timeout_s + 1)  # no rounds meanwhile
        resumed_at = time.monotonic()
        assert watch.check([a, b]) == []  # the pause does not count as silence
        assert rounds(timeout_s + 8) == ["b"]
        assert time.monotonic() - resumed_at >= timeout_s - 0.3
    finally:
        watch.close()
        for child in (a, b):
            if child.alive() and child.proc is not None:
                child.proc.kill()
                child.proc.wait()


def test_the_liveness_watch_kills_a_frozen_private_redis_which_then_restarts() -> None:
    """The private Redis is watched too (PING): frozen (SIGSTOP), it is SIGKILLed past the
    timeout, and restarts on its port (what the supervisor's next round does with a dead one);
    one that answers is left alone."""
    import os
    import signal

    from tandem.launcher import LivenessWatch
    from tandem.state.redis_server import RedisServer

    watch = LivenessWatch(1.5)
    with RedisServer() as redis:
        try:
            end = time.monotonic() + 3
            while time.monotonic() < end:
                assert watch.check([], redis) == []
                time.sleep(0.2)
            port = redis.port
            assert redis.pid is not None
            os.kill(redis.pid, signal.SIGSTOP)
            end, killed = time.monotonic() + 10, list[str]()
            while time.monotonic() < end and not killed:
                killed = watch.check([], redis)
                time.sleep(0.2)
            assert killed == ["redis-server"] and not redis.alive()
            redis.restart()
            assert redis.port == port and redis.answers_ping(2.0)
            assert watch.check([], redis) == []
        finally:
            watch.close()


@pytest.mark.parametrize("seed", range(2))
def test_the_liveness_watch_kills_a_process_stopped_while_starting(seed: int, tmp_path: Path) -> None:
    """A process still starting cannot answer a health check, but one stopped (SIGSTOP) past
    the timeout is killed too, not left to hold its start to --ready-timeout-s; one that starts
    slowly, or that was stopped and resumed within the timeout, is left alone."""
    import os
    import signal

    from tandem.launcher import LivenessWatch, process_stopped

    rng = random.Random(seed)
    log = tmp_path / "events"
    # both listen only after a minute: "starting" for the whole test
    stopped, slow = _child("stopped", log, 60.0, []), _child("slow", log, 60.0, [])
    timeout_s = rng.uniform(1.0, 2.0)
    watch = LivenessWatch(timeout_s)

    def rounds(seconds: float) -> list[str]:
        return _watch_rounds(watch, [stopped, slow], seconds, lambda: rng.uniform(0.05, 0.3))

    try:
        for child in (stopped, slow):
            child.start()
        pid = stopped.proc.pid  # type: ignore[union-attr]
        assert rounds(timeout_s + 1) == [] and not process_stopped(pid)
        os.kill(pid, signal.SIGSTOP)  # stopped, then resumed within the timeout: left alone
        assert rounds(timeout_s * rng.uniform(0.3, 0.7)) == [] and process_stopped(pid)
        os.kill(pid, signal.SIGCONT)
        assert rounds(timeout_s + 1) == []
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert rounds(timeout_s + 5) == ["stopped"]
        assert time.monotonic() - stopped_at >= timeout_s
        assert not stopped.alive() and stopped.returncode == -signal.SIGKILL and slow.alive()
        assert not process_stopped(pid) and not process_stopped(os.getpid())
    finally:
        watch.close()
        for child in (stopped, slow):
            if child.alive() and child.proc is not None:
                os.kill(child.proc.pid, signal.SIGCONT)
                child.proc.kill()
                child.proc.wait()


@pytest.mark.parametrize("seed", range(2))
def test_a_process_that_served_long_enough_restarts_as_if_for_the_first_time(
        seed: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--restart-stable-s``: deaths soon after coming up (a crash loop) double the backoff and
    count toward ``--max-restarts``; a process that served the stable time before it died is
    restarted after the first backoff, and its earlier restarts no longer count. Real processes
    killed with SIGKILL after random times."""
    import os
    import re
    import signal

    rng = random.Random(seed)
    log = tmp_path / "events"
    worker = _child("worker", log, 0.0, [])
    worker.budget.initial_backoff_s = backoff_s = rng.uniform(0.2, 0.4)
    sup = _supervisor([], _child("router", log, 0.0, []))
    sup.children = [worker]
    sup.args.max_restarts = max_restarts = worker.budget.max_restarts  # 3 within 60 s
    sup.args.restart_window_s = worker.budget.window_s
    worker.budget.stable_s = stable_s = rng.uniform(0.8, 1.5)

    def kill_after(served_s: float) -> float | None:
        """Kills the worker once it has served ``served_s`` and restarts it: the backoff said,
        or None when the restart gave up."""
        time.sleep(max(0.0, served_s - worker.served_s(time.monotonic())))
        assert worker.proc is not None
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(5)
        capsys.readouterr()
        restarted = sup.restart([worker])
        said = capsys.readouterr().err
        if not restarted:
            assert "giving up" in said
            return None
        return float(re.findall(r"restarting worker in ([0-9.]+) s", said)[0])

    def doubled(times: int) -> float:
        return round(backoff_s * 2 ** times, 1)

    try:
        sup.start([worker])
        quick = [kill_after(rng.uniform(0.0, stable_s / 3)) for _ in range(max_restarts - 1)]
        assert quick == [doubled(i) for i in range(max_restarts - 1)]
        for _ in range(rng.randint(2, 4)):  # served long enough: the first backoff, never giving up
            assert kill_after(stable_s + rng.uniform(0.1, 0.4)) == doubled(0)
        for i in range(1, max_restarts):  # a crash loop again: doubled, then out of restarts
            assert kill_after(rng.uniform(0.0, stable_s / 3)) == doubled(i)
        assert kill_after(0.0) is None
    finally:
        for child in (worker, sup.router):
            child.stop(5)


@pytest.mark.parametrize("seed,busy", [(0, False), (1, False), (2, True)])
def test_a_restart_that_hangs_before_serving_is_stopped_at_a_multiple_of_its_first_start(
        seed: int, busy: bool, tmp_path: Path) -> None:
    """``--restart-ready-timeout-s``: a process's first start has the whole ``--ready-timeout-s``
    (one slower than the restart bound still comes up); once it has served, a restart that hangs
    before serving (alive, computing nothing, no server yet: the liveness watch cannot ask it) is
    stopped once it has taken RESTART_START_FACTOR times its slowest start or the floor, whichever
    is longer, not ``--ready-timeout-s``; a service waiting for its agent has as long as the agent.
    The next round restarts it. A restart slower than the bound that computes all along (busy) is
    left to come up. Real processes, random start times, the agent or a worker slow to restart."""
    import os
    import signal

    from tandem.launcher import RESTART_START_FACTOR, START_IDLE_WINDOW_S

    rng = random.Random(seed)
    log = tmp_path / "events"
    floor_s = rng.uniform(1.0, 2.0)
    delays = {"agent": rng.uniform(floor_s, floor_s + 0.5), "decode": rng.uniform(0.0, 0.3)}  # agent over the floor

    def child(name: str, needs: list[Child]) -> Child:
        port = free_port()

        def argv() -> list[str]:
            return ["tests.unit.wave_child", name, str(port), str(log), f"{delays[name]:.3f}", "0",
                    *(c.address.rsplit(":", 1)[1] for c in needs)]
        return Child(name, argv, f"127.0.0.1:{port}", {"PYTHONPATH": str(ROOT)}, RestartBudget(3, 60.0, 0.0))

    agent = child("agent", [])
    cell = CellProcs(SimpleNamespace(cell_id="c"), agent.address, agent)  # type: ignore[arg-type]
    decode = child("decode", [agent])
    cell.workers = [decode]
    sup = _supervisor([cell], _child("router", log, 0.0, []))
    sup.children = [agent, decode]
    sup.args.restart_ready_timeout_s = floor_s
    sup.args.restart_window_s, sup.args.max_restarts = 60.0, 3
    try:
        sup.start(sup.children)  # the first start: the agent takes longer than the floor, and serves
        assert agent.slowest_start_s > floor_s and decode.slowest_start_s > 0
        slow = rng.choice([agent, decode])
        limit_s = max(floor_s, RESTART_START_FACTOR * slow.slowest_start_s)
        assert slow.start_timeout_s(60.0, floor_s) == pytest.approx(limit_s)
        if slow is decode:  # the agent's limit is its own too, when longer
            limit_s = max(limit_s, agent.start_timeout_s(60.0, floor_s))
        if busy:
            slow.env = {**slow.env, "WAVE_CHILD_BUSY": "1"}
        # its next start hangs, or computes, past the bound
        delays[slow.name] = limit_s + START_IDLE_WINDOW_S + 2.0 if busy else 600.0
        assert slow.proc is not None
        os.kill(slow.proc.pid, signal.SIGKILL)
        slow.proc.wait(5)
        began = time.monotonic()
        if busy:
            assert sup.restart([slow])
            assert time.monotonic() - began >= delays[slow.name]  # waited for it, past the bound
            assert all(c.alive() for c in sup.children) and slow.num_restarts == 1
            return
        with pytest.raises(RuntimeError, match=rf"{slow.name} did not come up at .* within {limit_s:.0f} s and "
                                               "computed nothing"):
            sup.restart([slow])
        took_s = time.monotonic() - began
        assert limit_s - 0.2 <= took_s < limit_s + START_IDLE_WINDOW_S + 8.0  # not --ready-timeout-s (60 s)
        assert not slow.alive()  # stopped: the next round restarts it
        delays[slow.name] = rng.uniform(0.0, 0.3)
        assert sup.restart([c for c in sup.children if not c.alive()])
        assert all(c.alive() for c in sup.children)
        assert slow.num_restarts == 2  # the hung start counted
    finally:
        for c in (*sup.children, sup.router):
            c.stop(5)


@pytest.mark.parametrize("seed", range(2))
def test_the_private_redis_dead_during_a_restart_is_restarted_within_the_wait(seed: int, tmp_path: Path) -> None:
    """The private Redis killed while a restart waits for its processes to serve (services that
    start again wait for Redis, and would hold the restart until their wait for it ends) is
    restarted within that wait, on its port; out of restarts, the wait ends at once in GivingUp
    (the stack stops with EXIT_GAVE_UP), not in a process's failure. A real redis-server and real
    processes, killed at random moments of the wait."""
    import os
    import signal
    import threading

    from tandem.launcher import GivingUp
    from tandem.state.redis_server import RedisServer

    rng = random.Random(seed)
    log = tmp_path / "events"
    with RedisServer() as redis:
        port = redis.port
        worker = _child("worker", log, rng.uniform(3.0, 4.0), [])  # slow to serve: the wait
        sup = _supervisor([], _child("router", log, 0.0, []))
        sup.children = [worker]
        sup.redis_server, sup.redis_url = redis, redis.url
        sup.redis_budget = RestartBudget(1, 60.0, 0.1)
        sup.args.max_restarts, sup.args.restart_window_s = 1, 60.0
        sup.redis_up_since_s = time.monotonic()
        sup.redis_restarts = 0
        sup._reviving_redis = False

        def kill_redis_soon() -> None:
            time.sleep(rng.uniform(0.3, 1.5))
            assert redis.pid is not None
            os.kill(redis.pid, signal.SIGKILL)

        try:
            old_pid = redis.pid
            killer = threading.Thread(target=kill_redis_soon)
            killer.start()
            sup.start([worker])  # returns once the worker serves: Redis is back by then
            killer.join()
            assert redis.alive() and redis.pid != old_pid and redis.port == port and redis.answers_ping(2.0)
            assert sup.redis_restarts == 1
            # out of restarts (1 within the window): the next death during a wait gives up
            assert worker.proc is not None
            os.kill(worker.proc.pid, signal.SIGKILL)
            worker.proc.wait(5)
            killer = threading.Thread(target=kill_redis_soon)
            killer.start()
            began = time.monotonic()
            with pytest.raises(GivingUp):
                sup.start([worker])
            killer.join()
            assert time.monotonic() - began < 3.0  # at the death, not when the worker serves
        finally:
            for child in (worker, sup.router):
                child.stop(5)


def test_a_restart_waiting_for_a_redis_that_does_not_answer_is_not_taken_as_wedged(tmp_path: Path) -> None:
    """A process starting again computes nothing while it waits for Redis; past the restart
    bound it is not stopped for that while Redis does not answer (here stopped with SIGSTOP),
    only once Redis has answered for a whole idle window and it still computes nothing. A real
    redis-server and real processes."""
    import os
    import signal

    from tandem.launcher import START_IDLE_WINDOW_S
    from tandem.state.redis_server import RedisServer

    log = tmp_path / "events"
    with RedisServer() as redis:
        worker = _child("worker", log, 0.0, [])
        sup = _supervisor([], _child("router", log, 0.0, []))
        sup.children = [worker]
        sup.redis_server, sup.redis_url = redis, redis.url
        sup._reviving_redis = False
        sup.args.restart_ready_timeout_s = 1.0
        stop_s = random.uniform(8.0, 10.0)
        try:
            sup.start([worker])
            limit_s = worker.start_timeout_s(60.0, 1.0)
            worker.make_args = lambda: ["tests.unit.wave_child", "worker", "0", str(log), "600", "0"]  # hangs
            assert redis.pid is not None and worker.proc is not None
            os.kill(worker.proc.pid, signal.SIGKILL)
            worker.proc.wait(5)
            os.kill(redis.pid, signal.SIGSTOP)
            resumed: list[float] = []

            def resume() -> None:
                time.sleep(limit_s + stop_s)
                assert redis.pid is not None
                os.kill(redis.pid, signal.SIGCONT)
                resumed.append(time.monotonic())

            import threading

            thread = threading.Thread(target=resume)
            thread.start()
            with pytest.raises(RuntimeError, match="computed nothing"):
                sup.start([worker])
            stopped_s = time.monotonic()
            thread.join()
            assert resumed and stopped_s - resumed[0] >= START_IDLE_WINDOW_S - 0.5  # not while Redis was away
        finally:
            if redis.pid is not None:
                os.kill(redis.pid, signal.SIGCONT)
            for child in (worker, sup.router):
                child.stop(5)


@pytest.mark.parametrize("held_s", [0.0, 0.3, 0.8])
def test_redis_counts_as_answering_from_when_its_answer_came(held_s: float) -> None:
    """A PING sent to a stopped Redis is answered once it resumes, up to the ask's timeout
    later: the idle window that lets a quiet start be taken for wedged counts from that answer,
    not from the ask (CI once stopped a start 4.3 s after Redis resumed, inside the 5 s window).
    A real sleeping process; the window on a given clock; the answer held by a real wait."""
    import subprocess

    from tandem.launcher import START_IDLE_WINDOW_S, StartIdleness

    proc = subprocess.Popen(["sleep", "60"])
    try:
        asks: list[bool] = []

        def redis_answers() -> bool:
            up = len(asks) >= 7  # stopped for the first seven asks, then answering
            if up and not any(asks):
                time.sleep(held_s)  # the first answer comes when Redis resumes
            asks.append(up)
            return up

        idle, now = StartIdleness(redis_answers), 1000.0
        while not any(asks):  # a second apart (Redis is asked once a whole window is sampled)
            now += 1.0
            assert not idle.idle(proc.pid, now)
        answered = now + held_s
        assert not idle.idle(proc.pid, answered + START_IDLE_WINDOW_S - 0.05)
        assert idle.idle(proc.pid, answered + START_IDLE_WINDOW_S + 0.5)
        assert asks[:7] == [False] * 7 and all(asks[7:])
    finally:
        proc.kill()
        proc.wait()
