"""`tandem up` supervises its stack (issue 11, item 6): a gpu_agent SIGKILLed at a random moment
under mixed-length streams restarts the cell whole (every client gets its whole output or a clear
error, in bounded time; the cell serves again; no file of the dead agent is left), two stacks
with the same cell id sharing /dev/shm never touch each other's files, and a process that keeps
dying is restarted with backoff until the stack gives up with a clear message and exit code.

Seeds are printed, so a failure can be replayed (TANDEM_FAULT_SEED).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tandem.engine.shm_files import SHM_DIR
from tandem.launcher import EXIT_GAVE_UP
from tandem.rpc.v1 import common_pb2, router_pb2, router_pb2_grpc
from tandem.service.runtime import free_ports
from tests.integration.stack import ROOT, fault_seed, up_pid, wait_up_log, write_stepping_chat_model

CELL_ID = f"sup-{uuid.uuid4().hex[:6]}"  # both stacks use it: their files must still not collide
STALL_TIMEOUT_S = 5.0  # the router's wait for a decode update: a lost request's error comes this fast
CLIENT_BOUND_S = 45.0  # no client waits longer than this for its output or its error


@dataclass
class Up:
    """One `tandem up` process and its combined log."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    grpc_port: int

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, timeout_s: float, start: int = 0) -> re.Match[str]:
        return wait_up_log(self.proc, self.log_path, pattern, timeout_s, start)

    def pid(self, name: str) -> int:
        """The newest pid the launcher reported for ``name``."""
        return up_pid(self.log(), name)

    def shm_prefix(self) -> str:
        """The running agent's shared-memory prefix, as the launcher printed it last."""
        return re.findall(r"gpu_agent's shared memory: \S+/tandem-(\S+)-\*", self.log())[-1]

    def files(self, prefix: str) -> list[Path]:
        return sorted(SHM_DIR.glob(f"tandem-{prefix}[-.]*"))

    def generate(self, text: str, max_tokens: int) -> list[int]:
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            request = router_pb2.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            responses = list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=CLIENT_BOUND_S))
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        return [t for r in responses for t in r.tokens]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


class Streams:
    """``count`` greedy streams of random lengths against ``up``, each in a thread from now on;
    ``judge`` waits for them: none hung, each whole (every token, nothing repeated) or failed
    with a clear error (a status that says why)."""

    def __init__(self, up: Up, rng: random.Random, count: int) -> None:
        self.jobs = [(" ".join(["Tell me a story."] * rng.randint(1, 30)), rng.randint(8, 300)) for _ in range(count)]
        self.outcomes: list[list[int] | grpc.RpcError | None] = [None] * count
        self.threads = [threading.Thread(target=self._client, args=(up, i)) for i in range(count)]
        for t in self.threads:
            t.start()

    def _client(self, up: Up, i: int) -> None:
        try:
            self.outcomes[i] = up.generate(*self.jobs[i])
        except grpc.RpcError as exc:
            self.outcomes[i] = exc

    def judge(self) -> None:
        for t in self.threads:
            t.join(CLIENT_BOUND_S + 5)
            assert not t.is_alive(), "a client hung"
        for (_, max_tokens), outcome in zip(self.jobs, self.outcomes):
            if isinstance(outcome, grpc.RpcError):
                assert outcome.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL), outcome
                assert outcome.details()
            else:
                assert outcome is not None and len(outcome) == max_tokens


def start_up(model_dir: Path, log_path: Path, *flags: str, env_extra: dict[str, str] | None = None) -> Up:
    grpc_port, http_port = free_ports(2)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # each stack its own Redis
    env.update(PYTHONPATH=str(ROOT), TANDEM_STALL_TIMEOUT_S=str(STALL_TIMEOUT_S))
    env.setdefault("TANDEM_ADMISSION_CACHE", str(log_path.parent / "admission-cache"))  # not the user's cache
    env.update(env_extra or {})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "up", "--model", str(model_dir), "--grpc-port", str(grpc_port),
             "--port", str(http_port), "--cell-id", CELL_ID, "--kv-cache-gb", "0.05", "--admission", "off",
             "--restart-backoff-s", "0.2", "--quantization", "auto", *flags],
            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )
    return Up(proc, log_path, grpc_port)


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_stepping_chat_model(tmp_path_factory.mktemp("sup-model"), smollm2_dir)


@pytest.fixture(scope="module")
def stacks(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, Up]]:
    """Two stacks at once, same cell id, same /dev/shm, different ports. B gives up early."""
    logs = tmp_path_factory.mktemp("sup-logs")
    a = start_up(model_dir, logs / "a.log")
    b = start_up(model_dir, logs / "b.log", "--max-restarts", "2", "--restart-window-s", "120")
    try:
        for up in (a, b):
            up.wait_log("tandem up: serving", 180)
        yield a, b
    finally:
        for up in (a, b):  # SIGTERM: a SIGKILLed launcher would leave its children running
            if up.proc.poll() is None:
                up.proc.send_signal(signal.SIGTERM)
        for up in (a, b):
            try:
                up.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.proc.kill()
                up.proc.wait()


def test_agent_sigkill_restarts_the_cell_and_spares_the_other_stack(stacks: tuple[Up, Up]) -> None:
    a, b = stacks
    rng = random.Random(fault_seed())
    a_prefix, b_prefix = a.shm_prefix(), b.shm_prefix()
    assert a_prefix != b_prefix and a_prefix.startswith(f"{CELL_ID}-") and b_prefix.startswith(f"{CELL_ID}-")
    a_files, b_files = a.files(a_prefix), b.files(b_prefix)
    assert len(a_files) == len(b_files) == 5  # weights and KV pool (data + manifest each), the owner lock

    jobs = [(" ".join(["Tell me a story."] * rng.randint(1, 40)), rng.randint(16, 800)) for _ in range(5)]
    outcomes: list[list[int] | grpc.RpcError | None] = [None] * len(jobs)
    elapsed_s = [0.0] * len(jobs)

    def client(i: int) -> None:
        start = time.monotonic()
        try:
            outcomes[i] = a.generate(*jobs[i])
        except grpc.RpcError as exc:
            outcomes[i] = exc
        elapsed_s[i] = time.monotonic() - start

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(0.2, 1.5))
    log_offset = len(a.log())
    os.kill(a.pid("gpu_agent"), signal.SIGKILL)
    for t in threads:
        t.join(CLIENT_BOUND_S + 5)
        assert not t.is_alive(), "a client hung"

    print("outcomes:", [f"{len(o)} tokens" if isinstance(o, list) else f"{o.code().name}: {o.details()[:60]}"
                        for o in outcomes if o is not None], [f"{t:.1f}s" for t in elapsed_s])
    for (text, max_tokens), outcome, took_s in zip(jobs, outcomes, elapsed_s):
        assert took_s < CLIENT_BOUND_S
        if isinstance(outcome, grpc.RpcError):  # a clear error: a status that says why, not a timeout
            assert outcome.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL), outcome
            assert outcome.details()
        else:
            assert outcome is not None and len(outcome) == max_tokens  # whole, nothing repeated

    a.wait_log(rf"cell {CELL_ID} is back", 120, log_offset)
    assert a.proc.poll() is None
    assert f"removed 4 shared-memory files of the dead gpu_agent ({a_prefix})" in a.log()
    assert not a.files(a_prefix), "the dead agent's files are left"
    new_prefix = a.shm_prefix()
    assert new_prefix != a_prefix and len(a.files(new_prefix)) == 5
    # The cell serves again; an output completed before the kill is the greedy one it computes now.
    assert len(a.generate("Hello", 4)) == 4
    done = [(job, out) for job, out in zip(jobs, outcomes) if isinstance(out, list)]
    for (text, max_tokens), out in done[:2]:
        assert a.generate(text, max_tokens) == out
    assert b.files(b_prefix) == b_files  # the other stack's files are untouched ...
    assert len(b.generate("Hello", 4)) == 4  # ... and it serves

    assert a.stop() == 0
    assert not a.files(new_prefix)
    assert b.files(b_prefix) == b_files  # a clean stop of A spares B too
    assert len(b.generate("Hello again", 4)) == 4


def test_a_process_that_keeps_dying_is_restarted_with_backoff_then_the_stack_gives_up(
        stacks: tuple[Up, Up]) -> None:
    _, b = stacks
    prefix = b.shm_prefix()
    for restart in (1, 2):
        offset = len(b.log())
        os.kill(b.pid("prefill_svc"), signal.SIGKILL)
        # --restart-backoff-s 0.2, doubled for the second restart within the window
        b.wait_log(rf"prefill_svc exited with code -9; restarting prefill_svc in {0.2 * 2 ** (restart - 1):.1f} s "
                   rf"\(restart #{restart}\)", 30, offset)
        b.wait_log(r"tandem up: prefill_svc ready at", 120, offset)
        assert len(b.generate("Still there?", 4)) == 4
    os.kill(b.pid("prefill_svc"), signal.SIGKILL)
    assert b.proc.wait(timeout=60) == EXIT_GAVE_UP
    log = b.log()
    assert "prefill_svc exited with code -9, and prefill_svc was already restarted 2 times within 120 s " \
           "(--max-restarts 2); giving up: stopping the stack" in log
    assert f"tandem up: stopped (exit code {EXIT_GAVE_UP})" in log
    assert not b.files(prefix)


def _redis_pid(port: int) -> int:
    """The pid of the live redis-server listening on ``port``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        # redis-server retitles itself "redis-server 127.0.0.1:PORT"
        if state != "Z" and "redis-server" in command and f":{port}" in command:
            return int(entry.name)
    raise AssertionError(f"no redis-server on port {port}")


def test_the_private_redis_killed_is_restarted_and_services_restart_after_it(
        model_dir: Path, tmp_path: Path) -> None:
    """`tandem up`'s own Redis SIGKILLed at a random moment under streams: the streams finish
    (decode keeps streaming through the outage) or fail clearly, the launcher restarts Redis on
    its port, and a decode_svc killed afterwards comes back (it needs Redis to start: before,
    it failed every restart until the stack gave up) and serves."""
    rng = random.Random(fault_seed())
    up = start_up(model_dir, tmp_path / "up.log")
    try:
        up.wait_log("tandem up: serving", 180)
        port = int(up.wait_log(r"redis at redis://127\.0\.0\.1:(\d+)/0 \(private\)", 5).group(1))
        streams = Streams(up, rng, 4)
        time.sleep(rng.uniform(0.0, 1.5))
        offset = len(up.log())
        os.kill(_redis_pid(port), signal.SIGKILL)
        streams.judge()
        up.wait_log(rf"redis-server exited with code -9; restarting it on port {port} in 0\.2 s \(restart #1\)",
                    30, offset)
        up.wait_log(rf"tandem up: redis-server ready at 127\.0\.0\.1:{port}", 30, offset)
        assert _redis_pid(port)

        offset = len(up.log())
        os.kill(up.pid("decode_svc"), signal.SIGKILL)
        up.wait_log(r"tandem up: decode_svc ready at", 120, offset)
        assert "restart failed" not in up.log()[offset:]
        assert len(up.generate("Hello", 4)) == 4
        assert up.stop() == 0
    finally:
        if up.proc.poll() is None:
            up.stop()


def _two_roles_in_turn(up: Up, rng: random.Random, fault: signal.Signals,
                       said: Callable[[str, int], list[str]]) -> None:
    """Two random roles in turn, each under three streams: send it ``fault``, wait for the log
    lines ``said(role, pid)`` names and for its successor (its cell's, for the agent); every
    stream whole or failed clearly within the client bound, the stack serving after each."""
    for role in rng.sample(["decode_svc", "prefill_svc", "router", "gpu_agent"], 2):
        streams = Streams(up, rng, 3)
        time.sleep(rng.uniform(0.0, 1.5))
        offset = len(up.log())
        pid = up.pid(role)
        print(f"sending {fault.name} to {role} (pid {pid})")
        os.kill(pid, fault)
        for pattern in said(role, pid):
            up.wait_log(pattern, 30, offset)
        up.wait_log(rf"cell {CELL_ID} is back" if role == "gpu_agent" else rf"tandem up: {role} ready at", 120, offset)
        streams.judge()
        assert len(up.generate("Hello", 4)) == 4
        assert up.pid(role) != pid
    assert up.proc.poll() is None


def test_a_frozen_process_is_killed_by_the_liveness_watch_and_restarted(model_dir: Path, tmp_path: Path) -> None:
    """A process that stops answering (SIGSTOP: alive to the supervisor, its port still open,
    nothing served) is found by `tandem up`'s liveness watch (the standard gRPC health check,
    here `--liveness-timeout-s 4`), killed and restarted as a dead one is: two random roles in turn
    under streams, each stream whole or failed clearly within the client bound, and the stack
    serves after each. Before, a frozen decode_svc or agent left its cell standing still for good."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    rng = random.Random(fault_seed())
    up = start_up(model_dir, tmp_path / "up.log", "--liveness-timeout-s", "4")
    try:
        up.wait_log("tandem up: serving", 180)
        with grpc.insecure_channel(f"127.0.0.1:{up.grpc_port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        _two_roles_in_turn(up, rng, signal.SIGSTOP, lambda role, pid: [
            rf"{role} \(pid {pid}\) answered no health check for \d+ s"])
    finally:
        assert up.stop() == 0


# Loaded by every process of the stack below (its directory first on PYTHONPATH): SIGUSR2 runs a
# Python signal handler, on the main thread, which is the event loop's, and never returns: a
# wedged event loop, injected from outside (nothing in Tandem can be made to block its loop for good).
WEDGE_ON_SIGUSR2 = """
import signal, time

def _wedge(signum, frame):
    while True:
        time.sleep(3600)

signal.signal(signal.SIGUSR2, _wedge)
"""


def test_a_process_whose_event_loop_blocks_exits_by_itself_and_is_restarted(model_dir: Path, tmp_path: Path) -> None:
    """A serving process whose event loop blocks for good (alive, not stopped, its port open)
    exits by itself (EXIT_LOOP_FAILED, its stacks logged) once the loop has answered nothing for
    TANDEM_LOOP_WATCHDOG_S, here with `tandem up`'s liveness watch off, as under docker compose,
    where only an exit gets a container restarted: two random roles in turn under streams, each
    stream whole or failed clearly within the client bound, and the stack serves after each."""
    rng = random.Random(fault_seed())
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(WEDGE_ON_SIGUSR2)
    up = start_up(model_dir, tmp_path / "up.log", "--liveness-timeout-s", "0",
                  env_extra={"PYTHONPATH": f"{hooks}{os.pathsep}{ROOT}", "TANDEM_LOOP_WATCHDOG_S": "3"})
    try:
        up.wait_log("tandem up: serving", 180)
        _two_roles_in_turn(up, rng, signal.SIGUSR2, lambda role, pid: [
            r"the event loop blocked for \d+ s; exiting 70", rf"tandem up: {role} exited with code 70"])
    finally:
        assert up.stop() == 0
