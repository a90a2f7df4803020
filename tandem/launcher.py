"""``tandem up``: a whole cell and a router on this machine, as separate processes.

With ``--deployment FILE``, the cells placement starts (``tandem.deploy``), each on its share of
the cores, behind one router that finds every model's services in the registry.

Starts (or uses ``REDIS_URL``) Redis, then every process at once with ``python -m <package>``
(each cell's gpu_agent, decode_svc and prefill_svc, and the router: the services import torch
while their agent loads the weights, and register once it serves); waits until each answers,
prints the addresses, and stays in the foreground, supervising:

- a decode, prefill or router process that dies is restarted on its address (decode resumes
  its requests from Redis, the router's clients reconnect);
- a gpu_agent that dies takes the cell's KV pool with it, so the cell restarts whole: prefill
  and decode are stopped, the dead agent's shared-memory files removed, and a new agent (which
  fails the requests the old cell was serving), decode and prefill started; the router stays;
- the private Redis (no ``REDIS_URL``) that dies is restarted on its port, with its password and
  data directory (empty unless ``--redis-data-dir``): the services' heartbeats fill the registry
  again and decode records its requests whole once Redis answers;
- restarts wait with exponential backoff, and a process that dies more than ``--max-restarts``
  times within ``--restart-window-s`` stops the whole stack with exit code
  :data:`EXIT_GAVE_UP` and a message naming it; one that served ``--restart-stable-s`` before it
  died starts that count and its backoff afresh (a fault from outside, not a crash loop).

Every agent incarnation gets its own shared-memory prefix (``<cell id>-<instance id>``), so
stacks that share ``/dev/shm`` and a cell id never touch each other's files. Ctrl-C or SIGTERM
stops every process, newest first, with exit code 0; a stack that cannot start exits 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from tandem.deploy import CellPlan, plan_cells, read_file
from tandem.engine.shm_files import SHM_DIR, remove_if_dead
from tandem.place.placement import PlacementError
from tandem.rpc.channels import READY_PROBE_OPTIONS
from tandem.engine.weight_format import FORMAT_NAMES, default_kv_dtype
from tandem.engine.tool_calls import TOOL_FORMATS
from tandem.hostinfo import cpu_kernels_digest, cpu_name
from tandem.policy.admission import DEFAULT_MARGIN, DEFAULT_MISS_TARGET
from tandem.policy.policies import CPU_DEFAULT_POLICY
from tandem.service.flags import add_flag
from tandem.service.model_spec import ModelSpec, parse_models
from tandem.service.runtime import free_ports
from tandem.state.redis_server import RedisServer, RedisServerError

EXIT_START_FAILED = 1
EXIT_GAVE_UP = 3  # a process kept dying: more than --max-restarts within --restart-window-s
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL after this long
RESTART_START_FACTOR = 4.0  # a restart may take this many times its process's slowest start so far
# ... and is taken as wedged past that only while it computes nothing: less than this much CPU
# time over the last window (a process hung on a lock or a read uses none; one packing its
# weights on busy cores uses some every second)
START_IDLE_WINDOW_S = 5.0
START_IDLE_CPU_S = 0.05
POLL_S = 0.2


class StackStopping(Exception):
    """A signal arrived while the launcher was waiting (for a backoff or a process to be ready)."""


class GivingUp(Exception):
    """A process ran out of restarts (``--max-restarts``) while the launcher was waiting; said
    already. Not a RuntimeError: a start's wait must not take it for one process's failure."""


@dataclass
class RestartBudget:
    """When to restart a process that keeps dying, and when to give up.

    ``next_delay_s(now)`` is called at each death: it returns the backoff before the restart —
    ``initial_backoff_s`` doubled for each restart still within the window, at most
    ``max_backoff_s`` — or None when ``max_restarts`` restarts already happened within
    ``window_s`` (give up). Deaths older than the window are forgotten, and so are all of them
    when the process served ``stable_s`` (``--restart-stable-s``; 0: never) before it died: it
    is not crash-looping, so neither its backoff nor the give-up count should grow with faults
    that came from outside, minutes apart.
    """

    max_restarts: int
    window_s: float
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 0.0
    _restarts_s: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.initial_backoff_s < 0:
            raise ValueError("--max-restarts must be >= 0, --restart-window-s > 0, --restart-backoff-s >= 0")

    def next_delay_s(self, now_s: float, served_s: float = 0.0) -> float | None:
        if self.stable_s > 0 and served_s >= self.stable_s:
            self._restarts_s.clear()
        while self._restarts_s and self._restarts_s[0] <= now_s - self.window_s:
            self._restarts_s.popleft()
        if len(self._restarts_s) >= self.max_restarts:
            return None
        delay_s = min(self.initial_backoff_s * 2 ** len(self._restarts_s), self.max_backoff_s)
        self._restarts_s.append(now_s)
        return delay_s

    @property
    def num_recent(self) -> int:
        return len(self._restarts_s)


@dataclass
class Child:
    name: str
    make_args: Callable[[], list[str]]  # called at every start (the agent's instance id changes)
    address: str
    env: dict[str, str]
    budget: RestartBudget
    proc: subprocess.Popen[bytes] | None = None
    num_restarts: int = 0
    ready_pid: int = 0  # the incarnation that last came up (what the liveness watch probes)
    ready_at_s: float = 0.0  # when it came up (time.monotonic())
    slowest_start_s: float = 0.0  # the longest any of its starts took until it served; 0: none has yet

    def start_timeout_s(self, first_s: float, restart_floor_s: float) -> float:
        """How long a start of it may take before, computing nothing (``StartIdleness``), it is
        taken as wedged (stopped; the next round restarts it, and counts that): ``first_s``
        (--ready-timeout-s) until it has served once, then RESTART_START_FACTOR times its slowest
        start, at least ``restart_floor_s`` (--restart-ready-timeout-s; 0: ``first_s`` always), at
        most ``first_s``. A process that came up in 4 s is not held 300 s when its restart hangs
        before serving (a lock, a stuck read), where the liveness watch cannot see it (it has no
        health service yet, and is not stopped); one that is slow but computes (two models' decode
        services packing their weights on the same busy cores) is left to ``first_s``, and so is
        one while the stack's Redis does not answer (it waits for Redis, computing nothing)."""
        if self.slowest_start_s <= 0 or restart_floor_s <= 0:
            return first_s
        return min(first_s, max(restart_floor_s, RESTART_START_FACTOR * self.slowest_start_s))

    def served_s(self, now_s: float) -> float:
        """How long the current (or just dead) incarnation has served; 0 if it never came up."""
        up = self.proc is not None and self.ready_pid == self.proc.pid
        return now_s - self.ready_at_s if up else 0.0

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", *self.make_args()], env={**os.environ, **self.env})

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser("up", help="run a whole cell and a router on this machine")
    parser.add_argument("--deployment", default=None,
                        help="a deployment file: place its models on cells (FineServe's Algorithm 1, as `tandem "
                        "place`) and run every cell that gets one on this machine, behind one router; see "
                        "tandem/deploy.py")
    parser.add_argument("--model", action="append", default=None,
                        help="a model to serve: PATH[:name=NAME][:kv=DTYPE][:quant=FORMAT], PATH a model directory "
                        "or 'default'; repeat it to serve several models from one cell, sharing one KV slab pool "
                        "(e.g. --model default --model default:kv=bfloat16) [env TANDEM_MODEL, comma-separated; "
                        "default 'default']")
    add_flag(parser, "--host", "127.0.0.1", "address the router listens on")
    add_flag(parser, "--port", 8000, "router's OpenAI-compatible HTTP port", type=int)
    add_flag(parser, "--grpc-port", 50051, "router's public gRPC port", type=int)
    add_flag(parser, "--cell-id", "cell0", "id of the cell")
    add_flag(parser, "--device", "cpu", "where the cell's weights and KV pool live: cpu, or cuda (the GPU's memory, "
             "SM partitions for the phases; one model per cell)", choices=["cpu", "cuda"])
    add_flag(parser, "--dtype", "float32", "weight and KV dtype the agent loads (bfloat16 halves the bytes; "
             "a GPU's tensor cores want it)", choices=["float32", "bfloat16"])
    add_flag(parser, "--kv-cache-gb", 1.0, "KV pool size in GiB", type=float)
    add_flag(parser, "--kv-split", "slab", "with several --model: share the KV pool by slabs (slab) or give each "
             "model an equal range (static)", choices=["slab", "static"])
    add_flag(parser, "--prefill-cores", "", "cores for prefill (default: first half)")
    add_flag(parser, "--decode-cores", "", "cores for decode (default: the rest)")
    add_flag(parser, "--ready-timeout-s", 300.0, "how long to wait for the stack to come up", type=float)
    add_flag(parser, "--policy", CPU_DEFAULT_POLICY, "partition policy: chunked (a CPU cell's default: on few "
             "cores the split does not pay), dynamic (prefill and decode on their own cores), adaptive or static")
    add_flag(parser, "--ttft-slo-ms", 2000.0, "time-to-first-token SLO (admission and policy)", type=float)
    add_flag(parser, "--tbt-slo-ms", 200.0, "time-between-tokens SLO (policy)", type=float)
    add_flag(parser, "--ttft-slo-ms-per-1k", 0.0, "the TTFT SLO grows by this per 1000 prompt tokens "
             "(deadlines, EDF order, early drop)", type=float)
    add_flag(parser, "--admission", "on", "router refuses early (429) what would miss the TTFT SLO",
             choices=["on", "off"])
    add_flag(parser, "--admission-margin", DEFAULT_MARGIN, "the router refuses only a request predicted past its TTFT "
             "deadline by more than this fraction of the SLO", type=float)
    add_flag(parser, "--admission-miss-target", DEFAULT_MISS_TARGET, "the share of admitted requests allowed to "
             "miss the TTFT SLO: past it the router admits only predictions as low as those that met it (0: the "
             "margin alone)", type=float)
    add_flag(parser, "--stream-cap", "on", "with admission on, the router also caps the streams in flight "
             "where their token gaps approach the TBT SLO", choices=["on", "off"])
    add_flag(parser, "--profile", "", "perf profile from `tandem profile` for the agent and the router")
    add_flag(parser, "--admission-log", "", "the router appends one JSON line per admission decision and per "
             "admitted request's first token to this file (its prediction, limit and the measured TTFT: why a "
             "request was refused or missed; with several models, one file each, the served name added)")
    add_flag(parser, "--step-log", "", "every decode_svc appends one JSON line per step to this file (its time, "
             "rows, prompt tokens, the partition and the agent's reason for it; each line names its service)")
    add_flag(parser, "--tool-call-parser", "auto", "format of the tool calls in the answers of a model whose "
             "chat template renders tools: auto (the one the template teaches), hermes, llama3_json or mistral",
             choices=["auto", *TOOL_FORMATS])
    add_flag(parser, "--admission-cache", "auto", "where the router keeps admission's prefill calibration "
             "across restarts: auto (under the cache root, one directory per CPU, weight format and models), "
             "off, or a directory")
    add_flag(parser, "--redis-password", "", "password the private Redis requires (ignored with REDIS_URL: put it "
             "in the URL)")
    add_flag(parser, "--redis-data-dir", "", "persist the private Redis there (append-only file), so request "
             "records survive a Redis restart")
    add_flag(parser, "--kv-dtype", "", "KV cache storage dtype (float16 or bfloat16 hold twice the tokens per GiB; "
             "default: float16 for --quantization ggml on CPU, llama.cpp's own cache, else --dtype)",
             choices=["", "float32", "bfloat16", "float16"])
    add_flag(parser, "--quantization", "ggml", f"weight format prefill and decode run ({FORMAT_NAMES}; "
             "ggml: llama.cpp's kernels on a GGUF's own Q4/Q8 blocks, fp16 for layers of other weights and "
             "without `tandem models build-kernels`, greedy outputs depend on batching; auto: the fastest "
             "batch-invariant format (fp16 on an AVX2 CPU); int8 is lossy)")
    add_flag(parser, "--max-restarts", 5, "restarts of one process (the cell, for the agent) within "
             "--restart-window-s before the stack gives up and stops", type=int)
    add_flag(parser, "--restart-window-s", 300.0, "window over which --max-restarts counts", type=float)
    add_flag(parser, "--restart-backoff-s", 1.0, "wait before the first restart; doubled for each further "
             "restart within the window, at most 30 s", type=float)
    add_flag(parser, "--restart-stable-s", 60.0, "a process that served this long before it died is not "
             "crash-looping: its restart waits --restart-backoff-s again and its earlier restarts no longer "
             "count toward --max-restarts (0: they always count)", type=float)
    add_flag(parser, "--restart-ready-timeout-s", 30.0, "a restarted process that does not serve within this "
             f"long, or {RESTART_START_FACTOR:g} times its slowest start so far if that is longer (never longer "
             f"than --ready-timeout-s), and has used no CPU for {START_IDLE_WINDOW_S:g} s, is taken as wedged: "
             "stopped, and restarted as if it had died (0: only --ready-timeout-s)", type=float)
    add_flag(parser, "--liveness-timeout-s", 30.0, "a process that has served but has answered no gRPC health "
             "check (grpc.health.v1) for this long, frozen or wedged, is killed and restarted as if it had "
             "died (0: never)", type=float)
    parser.set_defaults(func=run)
    return parser


def _fixed(argv: list[str]) -> Callable[[], list[str]]:
    return lambda: list(argv)


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


def admission_cache_dir(root: Path, **key: Any) -> Path:
    """``root / <hash>``: one directory of admission calibrations per key (with the CPU and its
    cores added), which says what it is for in its ``key.json`` (router/calibration_cache.py)."""
    key = {"cpu": cpu_name(), "cpus": len(os.sched_getaffinity(0)), **key}
    text = json.dumps(key, sort_keys=True, default=str)
    directory = root / hashlib.sha256(text.encode()).hexdigest()[:16]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "key.json").write_text(json.dumps(key, sort_keys=True, indent=1, default=str) + "\n")
    except OSError as exc:
        say(f"cannot keep admission's calibration in {directory} ({exc}); the router starts uncalibrated", error=True)
    return directory


def _admission_cache(args: argparse.Namespace, plans: list[CellPlan]) -> str:
    """The router's --admission-cache for ``--admission-cache`` (auto, off or a directory)."""
    if args.admission_cache == "off":
        return ""
    if args.admission_cache != "auto":
        return args.admission_cache
    from tandem.engine.model_cache import cache_root  # numpy, for GGUF imports: not at start

    profile = ""  # the calibration corrects the perf model: another profile, another key
    if args.profile:
        try:
            profile = hashlib.sha256(Path(args.profile).read_bytes()).hexdigest()
        except OSError:
            profile = args.profile
    # the C kernels' source: a calibration measured slower (or faster) kernels than these
    kernels = cpu_kernels_digest(16)
    return str(admission_cache_dir(
        cache_root() / "admission", quantization=args.quantization, device=args.device, kernels=kernels,
        kv_dtype=args.kv_dtype or default_kv_dtype(args.quantization, args.dtype, args.device),
        dtype=args.dtype, profile=profile, models=[_spec_text(spec) for plan in plans for spec in plan.models]))


def _spec_text(spec: ModelSpec) -> str:
    """The agent's --model entry for ``spec`` (named, its path resolved)."""
    options = [f"name={spec.name}"] + ([f"kv={spec.kv_dtype}"] if spec.kv_dtype else []) + (
        [f"quant={spec.quantization}"] if spec.quantization else [])
    return ":".join([spec.path, *options])


def say(message: str, error: bool = False) -> None:
    print(f"tandem up: {message}", file=sys.stderr if error else sys.stdout, flush=True)


def child_check(child: Child, stopping: Callable[[], bool]) -> Callable[[], None]:
    """A wait's ``check`` for ``child``: StackStopping once ``stopping()``, RuntimeError once
    ``child`` has died."""
    def check() -> None:
        if stopping():
            raise StackStopping
        if not child.alive():
            raise RuntimeError(f"{child.name} exited with code {child.returncode}")

    return check


def wait_ready(child: Child, deadline: float, stopping: Callable[[], bool] = lambda: False) -> None:
    """Block until ``child`` accepts gRPC connections; raise if it dies or time runs out."""
    if not wait_channel_ready(child.address, deadline, child_check(child, stopping)):
        raise RuntimeError(f"{child.name} did not come up at {child.address} in time")


# A method no server has: its answer (UNIMPLEMENTED, or an auth error) says a server is there.
PROBE_METHOD = "/tandem.launcher.Probe/Ready"
_NOT_THERE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def wait_channel_ready(address: str, deadline: float, check: Callable[[], None], poll_s: float = 0.05) -> bool:
    """Whether a gRPC server at ``address`` answered before ``deadline`` (monotonic), calling
    ``check`` (which raises to give up) before each try. A try is one call of ``PROBE_METHOD``
    (the channel reconnects every 50-250 ms between them), so no thread is left watching the
    channel: ``grpc.channel_ready_future``'s did, and it failed with "Channel closed" in the
    background when a wait that gave up (``check`` raised) closed its channel."""
    with grpc.insecure_channel(address, options=READY_PROBE_OPTIONS) as channel:
        probe = channel.unary_unary(PROBE_METHOD)
        while True:
            check()
            try:
                probe(b"", timeout=1.0)
                return True
            except grpc.RpcError as exc:
                if exc.code() not in _NOT_THERE:  # type: ignore[attr-defined]
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)


def wait_router_serving(address: str, deadline: float, check: Callable[[], None], poll_s: float = 0.1) -> None:
    """Block until the router at ``address`` says it is ready (its gRPC Health: every model it
    serves has a prefill and a decode service it can reach); raise once ``deadline`` (monotonic)
    passes, with what it said last. ``check`` is called every poll and raises to give up."""
    from tandem.rpc.v1 import router_pb2, router_pb2_grpc

    detail = "no answer"
    with grpc.insecure_channel(address, options=READY_PROBE_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        while True:
            check()
            try:
                reply = stub.Health(router_pb2.HealthRequest(), timeout=5)
                if reply.ready:
                    return
                detail = reply.detail
            except grpc.RpcError as exc:
                detail = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router at {address} is not ready: {detail}")
            time.sleep(poll_s)


@dataclass
class CellProcs:
    """One cell's processes: its agent, and a decode_svc and a prefill_svc per model."""

    plan: CellPlan
    agent_address: str
    agent: Child | None = None
    workers: list[Child] = field(default_factory=list)
    instance_id: str = ""  # the running agent's; its files are named <cell id>-<instance id>-*

    @property
    def shm_prefix(self) -> str:
        return f"{self.plan.cell_id}-{self.instance_id}"

    @property
    def children(self) -> list[Child]:
        assert self.agent is not None
        return [self.agent, *self.workers]  # in start order


HEALTH_CHECK = "/grpc.health.v1.Health/Check"
LIVENESS_EVERY_S = 1.0  # a probe of each process this often
LIVENESS_PROBE_S = 5.0  # a probe with no answer by then has failed


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds process ``pid`` has used (user and system, all its threads; ``/proc/PID/stat``),
    or None where there is no such file (not Linux, or the process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class StartIdleness:
    """Whether a starting process looks wedged: it has computed nothing lately (less than
    START_IDLE_CPU_S of CPU over the last START_IDLE_WINDOW_S, from samples taken at each
    ``idle`` call) while the stack's Redis answered all along (``redis_answers``, asked at most
    once a second: a process starting again waits for Redis, up to TANDEM_REDIS_WAIT_S,
    computing nothing, and that wait is not a wedge). Never idle before a whole window is
    sampled, nor where its CPU time cannot be read."""

    def __init__(self, redis_answers: Callable[[], bool]) -> None:
        self._samples: deque[tuple[float, float]] = deque()
        self._redis_answers = redis_answers
        self._redis_asked_s = -math.inf
        self._redis_up_since_s: float | None = None  # Redis has answered at every ask since then

    def idle(self, pid: int, now_s: float) -> bool:
        cpu_s = process_cpu_s(pid)
        if cpu_s is None:
            return False
        self._samples.append((now_s, cpu_s))
        while len(self._samples) > 1 and self._samples[1][0] <= now_s - START_IDLE_WINDOW_S:
            self._samples.popleft()
        then_s, then_cpu_s = self._samples[0]
        if then_s > now_s - START_IDLE_WINDOW_S or cpu_s - then_cpu_s >= START_IDLE_CPU_S:
            return False
        if now_s - self._redis_asked_s >= 1.0:
            self._redis_asked_s = now_s
            asked_s = time.monotonic()
            answers = self._redis_answers()
            if not answers:
                self._redis_up_since_s = None
            elif self._redis_up_since_s is None:
                # from when the answer came: a PING sent to a stopped Redis waits in its socket
                # and is answered when it resumes, up to the ask's 1 s timeout after ``now_s``
                self._redis_up_since_s = now_s + (time.monotonic() - asked_s)
        return self._redis_up_since_s is not None and now_s - self._redis_up_since_s >= START_IDLE_WINDOW_S


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal or a tracer (state T or t in
    ``/proc/PID/stat``); False where there is no such file (not Linux, or the process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] in ("T", "t")


@dataclass
class _Probe:
    pid: int
    send: Callable[[], Any]  # starts one probe: a future whose result() raises when it got no answer
    close: Callable[[], None]
    last_ok: float
    pending: Any = None  # the probe in flight
    sent: float = 0.0


class LivenessWatch:
    """Probes every process that has come up, a probe in flight per process at a time (futures:
    the supervisor's loop never blocks on one), and SIGKILLs one that has answered none for
    ``timeout_s``: a frozen or wedged process (SIGSTOP, a deadlock, a loop blocked for good)
    still holds its port, is alive to ``poll()`` and would stand in its cell's way forever;
    killed, it is restarted as a dead one is, and a decode_svc's successor resumes its requests
    from Redis. The services answer the standard gRPC health check; the private Redis, PING. A
    process's liveness counts from when it came up (``Child.ready_pid``); one still starting
    cannot be asked (its server is not up yet) and is the ready wait's business, unless it is
    stopped (SIGSTOP, state T in ``/proc``): stopped past the timeout, it is killed as well,
    rather than holding its start, or its cell's restart, to ``--ready-timeout-s`` (300 s)."""

    def __init__(self, timeout_s: float) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from grpc_health.v1 import health_pb2

        self.timeout_s = timeout_s
        self._request = health_pb2.HealthCheckRequest().SerializeToString()
        self._probes: dict[str, _Probe] = {}
        self._stopped: dict[str, tuple[int, float]] = {}  # a starting process seen stopped: (pid, since)
        self._last_round = 0.0
        self._pings = ThreadPoolExecutor(1, thread_name_prefix="redis-ping")

    def check(self, children: list[Child], redis: RedisServer | None = None) -> list[str]:
        """One round: start the probes that are due, read those that answered, and kill every
        process silent past the timeout (their names are returned). Silence counts only while
        rounds run: after a pause (the supervisor restarting something, which blocks its loop)
        every process's silence starts again, as no probe was sent meanwhile."""
        now = time.monotonic()
        if now - self._last_round > 2 * LIVENESS_EVERY_S:
            for paused in self._probes.values():
                paused.last_ok = now
            self._stopped = {name: (pid, now) for name, (pid, _) in self._stopped.items()}
        self._last_round = now
        killed = []
        for child in children:
            up = child.alive() and child.proc is not None and child.proc.pid == child.ready_pid
            probe = self._probe(child.name, child.ready_pid if up else 0, now, functools.partial(self._grpc, child))
            starting = child.alive() and not up
            if (probe is not None and self._silent_past(child.name, probe, now)) or (
                    starting and self._stopped_past(child, now)):
                assert child.proc is not None
                child.proc.kill()
                child.proc.wait()
                killed.append(child.name)
            elif not starting:
                self._stopped.pop(child.name, None)
        if redis is not None:
            pid = redis.pid or 0
            probe = self._probe("redis-server", pid, now, functools.partial(self._redis, redis))
            if probe is not None and self._silent_past("redis-server", probe, now):
                redis.kill()
                killed.append("redis-server")
        return killed

    def _silent_past(self, name: str, probe: _Probe, now: float) -> bool:
        """Reads ``probe``'s answer, sends the next one when due; True (the probe dropped, the
        kill said) once the process has been silent past the timeout."""
        if probe.pending is not None and probe.pending.done():
            try:
                probe.pending.result()
                probe.last_ok = now
            except Exception:
                pass  # UNAVAILABLE, DEADLINE_EXCEEDED, no PONG: no answer, counted by the silence
            probe.pending = None
        if probe.pending is None and now - probe.sent >= LIVENESS_EVERY_S:
            probe.pending, probe.sent = probe.send(), now
        silent_s = now - probe.last_ok
        if silent_s <= self.timeout_s:
            return False
        say(f"{name} (pid {probe.pid}) answered no health check for {silent_s:.0f} s "
            f"(--liveness-timeout-s {self.timeout_s:g}): killing it, to restart it", error=True)
        self._drop(name)
        return True

    def _stopped_past(self, child: Child, now: float) -> bool:
        """Whether ``child``, still starting, has been stopped (SIGSTOP) past the timeout, seen
        by the rounds; a process that runs again starts its count again."""
        assert child.proc is not None
        pid = child.proc.pid
        if not process_stopped(pid):
            self._stopped.pop(child.name, None)
            return False
        seen_pid, since = self._stopped.setdefault(child.name, (pid, now))
        if seen_pid != pid:
            self._stopped[child.name] = (pid, since := now)
        if now - since <= self.timeout_s:
            return False
        say(f"{child.name} (pid {pid}) has been stopped while starting for {now - since:.0f} s "
            f"(--liveness-timeout-s {self.timeout_s:g}): killing it, to restart it", error=True)
        del self._stopped[child.name]
        return True

    def _probe(self, name: str, pid: int, now: float, make: Callable[[], _Probe]) -> _Probe | None:
        """``name``'s probe, new for a new incarnation; None while it is not up (pid 0)."""
        probe = self._probes.get(name)
        if probe is not None and probe.pid != pid:
            self._drop(name)
            probe = None
        if probe is None and pid:
            probe = self._probes[name] = make()
            probe.pid, probe.last_ok = pid, now
        return probe

    def _grpc(self, child: Child) -> _Probe:
        channel = grpc.insecure_channel(child.address, options=READY_PROBE_OPTIONS)
        call = channel.unary_unary(HEALTH_CHECK)
        timeout_s = min(LIVENESS_PROBE_S, self.timeout_s)
        return _Probe(0, lambda: call.future(self._request, timeout=timeout_s), channel.close, 0.0)

    def _redis(self, redis: RedisServer) -> _Probe:
        timeout_s = min(LIVENESS_PROBE_S, self.timeout_s)

        def ping() -> None:
            if not redis.answers_ping(timeout_s):
                raise ConnectionError("no PONG")

        return _Probe(0, lambda: self._pings.submit(ping), lambda: None, 0.0)

    def _drop(self, name: str) -> None:
        probe = self._probes.pop(name, None)
        if probe is not None:
            if probe.pending is not None:
                probe.pending.cancel()
            probe.close()

    def close(self) -> None:
        for name in list(self._probes):
            self._drop(name)
        self._pings.shutdown(wait=False, cancel_futures=True)


class Supervisor:
    """Starts the stack, restarts what dies, and stops it all; see the module docstring.

    ``plans`` are the cells to run (one for ``--model``, as many as placement starts for
    ``--deployment``); ``models`` the directory of every served model name, in serving order.
    """

    def __init__(self, args: argparse.Namespace, plans: list[CellPlan], models: dict[str, Path],
                 redis_url: str, redis_server: RedisServer | None = None) -> None:
        self.args = args
        self.stopping = False
        self.redis_server = redis_server  # the private one, which is restarted too; None: REDIS_URL's
        self.redis_url = redis_url
        self.redis_budget = self._budget()
        self.redis_up_since_s = time.monotonic()  # the private Redis's current incarnation came up
        self.redis_restarts = 0
        self._reviving_redis = False  # restart_redis is running (its backoff waits call watch_liveness)
        self.router_addr = f"{args.host}:{args.grpc_port}"
        # The SLOs, policy and profile reach every child through their TANDEM_* twins, so the
        # router's admission and the agent's policy work from the same numbers.
        env = {"REDIS_URL": redis_url, "TANDEM_POLICY": args.policy,
               "TANDEM_TTFT_SLO_MS": str(args.ttft_slo_ms), "TANDEM_TBT_SLO_MS": str(args.tbt_slo_ms),
               "TANDEM_TTFT_SLO_MS_PER_1K": str(args.ttft_slo_ms_per_1k),
               "TANDEM_ADMISSION": args.admission, "TANDEM_ADMISSION_MARGIN": str(args.admission_margin),
               "TANDEM_ADMISSION_MISS_TARGET": str(args.admission_miss_target),
               "TANDEM_STREAM_CAP": args.stream_cap, "TANDEM_TOOL_CALL_PARSER": args.tool_call_parser,
               "TANDEM_PROFILE": args.profile, "TANDEM_ADMISSION_CACHE": _admission_cache(args, plans)}
        many_cells = len(plans) > 1
        self.cells: list[CellProcs] = []
        # An agent per cell, a decode and a prefill per model: one distinct port each
        ports = iter(free_ports(sum(1 + 2 * len(plan.models) for plan in plans), exclude={args.grpc_port, args.port}))
        for plan in plans:
            cell = CellProcs(plan, f"127.0.0.1:{next(ports)}")
            cell_env = {**env, "TANDEM_CELL_ID": plan.cell_id}
            where = f"[{plan.cell_id}]" if many_cells else ""
            cell.agent = Child(f"gpu_agent{where}", functools.partial(self._agent_argv, cell), cell.agent_address,
                               cell_env, self._budget())
            for index, spec in enumerate(plan.models):
                decode_addr, prefill_addr = f"127.0.0.1:{next(ports)}", f"127.0.0.1:{next(ports)}"
                suffix = where + (f"-{index}" if len(plan.models) > 1 else "")
                model = ["--model", spec.name] if len(plan.models) > 1 or many_cells else []
                decode_argv = ["decode_svc", "--agent-address", cell.agent_address, "--port", _port(decode_addr),
                               *model, *(["--step-log", str(Path(args.step_log).absolute())] if args.step_log else [])]
                prefill_argv = ["prefill_svc", "--agent-address", cell.agent_address, "--decode-address",
                                decode_addr, "--port", _port(prefill_addr), *model]
                cell.workers.append(Child(f"decode_svc{suffix}", _fixed(decode_argv), decode_addr, cell_env,
                                          self._budget()))
                cell.workers.append(Child(f"prefill_svc{suffix}", _fixed(prefill_argv), prefill_addr, cell_env,
                                          self._budget()))
            self.cells.append(cell)
        self.served_names = list(models)
        (first, first_dir), *more = models.items()
        if not many_cells and len(models) == 1:
            # One model in one cell: the router is wired to its services by address.
            workers = self.cells[0].workers
            upstreams = ["--prefill-address", workers[1].address, "--decode-address", workers[0].address]
        else:
            # Several: each model's services are found in the registry by the name they announce,
            # in every cell.
            upstreams = ["--cell-id", plans[0].cell_id if not many_cells else ""]
            if more:
                upstreams += ["--extra-model", ",".join(f"{name}={path}" for name, path in more)]
        upstreams += ["--served-model-name", first]
        self.router = Child("router", _fixed([
            "router", "--model", str(first_dir), "--host", args.host, "--grpc-port", str(args.grpc_port),
            "--http-port", str(args.port), *upstreams,
            *(["--admission-log", str(Path(args.admission_log).absolute())] if args.admission_log else []),
        ]), self.router_addr, {**env, "TANDEM_CELL_ID": plans[0].cell_id}, self._budget())
        self.children = [*(c for cell in self.cells for c in cell.children), self.router]
        self.liveness = LivenessWatch(args.liveness_timeout_s) if args.liveness_timeout_s > 0 else None

    def _budget(self) -> RestartBudget:
        return RestartBudget(self.args.max_restarts, self.args.restart_window_s, self.args.restart_backoff_s,
                             stable_s=self.args.restart_stable_s)

    def _agent_argv(self, cell: CellProcs) -> list[str]:
        """The agent's command line; called at every start, each incarnation a new instance id."""
        cell.instance_id = secrets.token_hex(4)
        plan, args = cell.plan, self.args
        if plan.cores:
            cores = ",".join(map(str, plan.cores))
            core_flags = ["--prefill-cores", cores, "--decode-cores", cores]
        else:
            core_flags = ([*(["--prefill-cores", args.prefill_cores] if args.prefill_cores else []),
                           *(["--decode-cores", args.decode_cores] if args.decode_cores else [])])
        return ["gpu_agent", "--model", ",".join(map(_spec_text, plan.models)), "--cell-id", plan.cell_id,
                "--port", _port(cell.agent_address), "--instance-id", cell.instance_id,
                "--kv-cache-gb", str(plan.kv_cache_gb), "--kv-split", args.kv_split,
                "--quantization", args.quantization, *(["--kv-dtype", args.kv_dtype] if args.kv_dtype else []),
                "--device", args.device, "--dtype", args.dtype, *core_flags]

    def cell_of(self, child: Child) -> CellProcs | None:
        return next((cell for cell in self.cells if child in cell.children), None)

    def _needs(self, child: Child) -> Child | None:
        """The child ``child`` cannot serve without: a service's cell agent (it registers there)."""
        cell = self.cell_of(child)
        return cell.agent if cell is not None and child is not cell.agent else None

    def start(self, children: list[Child]) -> None:
        """Start ``children`` all at once and wait until each serves. On few cores that is the
        quickest start: a service imports torch while its agent loads the weights, and the
        router while the services pack their copies of them; a service registers once its agent
        serves (``CellMember.join`` retries until then). A child that dies or never serves is
        stopped (the next round restarts it), and so, at once, are the services whose agent died
        (they would wait for it in vain); the first error is raised once the others serve."""
        started_s = time.monotonic()
        limits_s = {child.name: child.start_timeout_s(self.args.ready_timeout_s, self.args.restart_ready_timeout_s)
                    for child in children}
        for child in children:
            child.start()
        failed: RuntimeError | None = None
        # agents first, then the services, then the router
        for child in sorted(children, key=lambda c: (c is self.router, self._needs(c) is not None)):
            needs = self._needs(child)

            # a service waits for its agent: it has as long as its agent has, if that is longer
            limit_s = max(limits_s[child.name], limits_s.get(needs.name, 0.0) if needs is not None else 0.0)
            idleness = StartIdleness(self._redis_answers)

            def stopping(needs: Child | None = needs, child: Child = child, limit_s: float = limit_s,
                         idleness: StartIdleness = idleness) -> bool:
                self.watch_liveness()  # a frozen agent (or Redis) must not hold the wait to its deadline
                if needs is not None and not needs.alive():
                    raise RuntimeError(f"{child.name} cannot register: {needs.name} exited with code "
                                       f"{needs.returncode}")
                now_s = time.monotonic()
                if (limit_s < self.args.ready_timeout_s and child.proc is not None and now_s - started_s >= limit_s
                        and idleness.idle(child.proc.pid, now_s)):
                    raise RuntimeError(f"{child.name} did not come up at {child.address} within {limit_s:.0f} s "
                                       f"and computed nothing for the last {START_IDLE_WINDOW_S:g} s: taken as "
                                       "wedged (--restart-ready-timeout-s)")
                return self.stopping

            try:
                wait_ready(child, started_s + self.args.ready_timeout_s, stopping)
            except RuntimeError as exc:
                child.stop()  # dead already, stuck, or without its agent: the next round restarts it
                failed = failed or exc
                continue
            pid = child.proc.pid if child.proc else "?"
            child.ready_pid = child.proc.pid if child.proc else 0
            child.ready_at_s = time.monotonic()
            child.slowest_start_s = max(child.slowest_start_s, child.ready_at_s - started_s)
            say(f"{child.name} ready at {child.address} (pid {pid})")
            cell = self.cell_of(child)
            if cell is not None and child is cell.agent:
                say(f"{child.name}'s shared memory: {SHM_DIR}/tandem-{cell.shm_prefix}-*")
        if failed is not None:
            raise failed

    def wait_serving(self) -> None:
        """Once every process serves: wait until the router has found the services of every
        model it serves (from the registry, for several models or cells), so that "serving"
        means a request is routed."""
        wait_router_serving(self.router_addr, time.monotonic() + self.args.ready_timeout_s,
                            child_check(self.router, lambda: self.stopping))

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.stopping:
                raise StackStopping
            self.watch_liveness()
            time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))

    def watch_liveness(self) -> None:
        """A round of the liveness watch (none with --liveness-timeout-s 0): from the supervisor's
        loop and from its waits within a restart, so that a process frozen meanwhile (the new
        agent a restarting cell's services wait for, Redis) is killed in time, not at the wait's
        deadline. What it kills is restarted by the supervisor's next round, except the private
        Redis, which ``revive_redis`` restarts here."""
        if self.liveness is not None:
            self.liveness.check(self.children, self.redis_server)
        self.revive_redis()

    def _redis_answers(self) -> bool:
        """Whether the stack's Redis (the private one, or REDIS_URL's) answers PING now."""
        if not self.redis_url:  # none to wait for
            return True
        if self.redis_server is not None:
            return self.redis_server.answers_ping(1.0)
        import redis

        try:
            client = redis.Redis.from_url(self.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except redis.RedisError:
            return False

    def revive_redis(self) -> None:
        """Restart the private Redis if it died: from the supervisor's loop, and from its waits
        within a restart too, where services starting again wait for Redis (up to
        TANDEM_REDIS_WAIT_S) and would hold the restart until then. Raises GivingUp when Redis is
        out of restarts."""
        server = self.redis_server
        if server is None or self._reviving_redis or server.alive():
            return
        self._reviving_redis = True
        try:
            if not self.restart_redis(server):
                raise GivingUp("redis-server")
        finally:
            self._reviving_redis = False

    def remove_agent_files(self, cell: CellProcs) -> None:
        """Remove the (dead) agent's shared memory; never a live agent's (it holds its lock)."""
        if not cell.instance_id:
            return
        removed = remove_if_dead(cell.shm_prefix)
        if removed is None:
            say(f"the shared memory of {cell.shm_prefix} is still held by a live process; left in place", error=True)
        elif removed:
            say(f"removed {len(removed)} shared-memory files of the dead gpu_agent ({cell.shm_prefix})")

    def supervise(self) -> int:
        """Restart what dies until a signal (0) or a process out of restarts (EXIT_GAVE_UP)."""
        while not self.stopping:
            time.sleep(POLL_S)
            try:
                self.watch_liveness()  # Redis first: the services that failed without it restart after it
                dead = [c for c in self.children if not c.alive()]
                if dead and not self.restart(dead):
                    return EXIT_GAVE_UP
            except RuntimeError as exc:  # one died again while starting: the next round counts it
                say(f"restart failed: {exc}", error=True)
            except GivingUp:
                return EXIT_GAVE_UP
            except StackStopping:
                break
        return 0

    def restart(self, dead: list[Child]) -> bool:
        """Restart every process of ``dead`` in one round: a dead agent's whole cell (``_stop_cell``
        first), any other alone, all started together after the longest of their backoffs, so that
        a router found dead beside a dead agent (several faults at once, as a soak sends them)
        starts with the cell rather than after its restart and backoff. False when one is out of
        restarts."""
        restarting: list[Child] = []
        cells: list[CellProcs] = []
        delay_s = 0.0
        for child in dead:
            cell = self.cell_of(child)
            if cell is not None and cell.agent is not None and child is not cell.agent and not cell.agent.alive():
                continue  # its agent is dead too: the cell's restart starts it
            now_s = time.monotonic()
            child_delay_s = child.budget.next_delay_s(now_s, child.served_s(now_s))
            agents_cell = cell if cell is not None and child is cell.agent else None
            what = f"the cell {agents_cell.plan.cell_id}" if agents_cell is not None else child.name
            if child_delay_s is None:
                self._say_giving_up(child.name, child.returncode, what, child.budget)
                return False
            child.num_restarts += 1
            say(f"{child.name} exited with code {child.returncode}; restarting {what} in {child_delay_s:.1f} s "
                f"(restart #{child.num_restarts})", error=True)
            delay_s = max(delay_s, child_delay_s)
            if agents_cell is not None:
                cells.append(agents_cell)
                self._stop_cell(agents_cell)
                restarting += agents_cell.children
            else:
                restarting.append(child)
        self.sleep(delay_s)
        self.start(restarting)
        for cell in cells:
            say(f"cell {cell.plan.cell_id} is back (gpu_agent instance {cell.instance_id})")
        return True

    def _say_giving_up(self, name: str, code: int | None, what: str, budget: RestartBudget) -> None:
        say(f"{name} exited with code {code}, and {what} was already restarted {budget.num_recent} times within "
            f"{self.args.restart_window_s:g} s (--max-restarts {self.args.max_restarts}); giving up: stopping the "
            "stack", error=True)

    def restart_redis(self, server: RedisServer) -> bool:
        """Restart the private Redis that died, on its port; False when it is out of restarts.
        A failed start is said and left to the next round (which counts it)."""
        code = server.returncode
        now_s = time.monotonic()
        delay_s = self.redis_budget.next_delay_s(now_s, now_s - self.redis_up_since_s)
        if delay_s is None:
            self._say_giving_up("redis-server", code, "redis-server", self.redis_budget)
            return False
        self.redis_restarts += 1
        say(f"redis-server exited with code {code}; restarting it on port {server.port} in {delay_s:.1f} s "
            f"(restart #{self.redis_restarts})", error=True)
        self.sleep(delay_s)
        try:
            server.restart()
        except RedisServerError as exc:
            say(f"restarting redis-server failed: {exc}", error=True)
            return True
        self.redis_up_since_s = time.monotonic()
        say(f"redis-server ready at 127.0.0.1:{server.port} (pid {server.pid})")
        return True

    def _stop_cell(self, cell: CellProcs) -> None:
        """The agent died and its KV pool with it: stop the cell's prefill and decode services
        (their requests' K/V is gone) and remove the agent's files; the cell then starts again on
        the same addresses. The new agent fails the old cell's requests before decode can resume any."""
        for child in cell.workers:
            child.stop()
        self.remove_agent_files(cell)

    def stop(self) -> None:
        """Stop every process, newest first, and remove what a dead agent left behind."""
        if self.liveness is not None:
            self.liveness.close()
        for child in reversed(self.children):
            if child.alive() and child.proc is not None:
                child.proc.terminate()
        for child in reversed(self.children):
            child.stop()
        for cell in self.cells:
            self.remove_agent_files(cell)


def _cells_to_run(args: argparse.Namespace) -> tuple[list[CellPlan], dict[str, Path]]:
    """The cells (one, or placement's for --deployment) and every served model's directory."""
    from tandem.engine.model_cache import resolve_model

    if args.deployment:
        if args.model:
            raise ValueError("give --model or --deployment, not both")
        plans, placement = plan_cells(read_file(args.deployment), sorted(os.sched_getaffinity(0)))
        for cell in placement.cells:
            say(f"placement: {cell.name}: {', '.join(placement.resident[cell.name]) or '(nothing: not started)'}")
    else:
        specs = [spec for text in (args.model or [os.environ.get("TANDEM_MODEL") or "default"])
                 for spec in parse_models(text)]
        plans = [CellPlan(args.cell_id, (), args.kv_cache_gb, tuple(specs))]
    models: dict[str, Path] = {}
    resolved = []
    for plan in plans:
        named: list[ModelSpec] = []
        for spec in plan.models:
            path = resolve_model(spec.path)
            name = spec.served_name(path)
            if name in models and models[name] != path or name in (s.name for s in named):
                raise ValueError(f"two --model entries serve the name {name!r}; give one of them :name=NAME")
            models[name] = path
            named.append(replace(spec, path=str(path), name=name))
        resolved.append(replace(plan, models=tuple(named)))
    return resolved, models


def run(args: argparse.Namespace) -> int:
    from tandem.state.redis_server import resolve_redis_url

    try:
        RestartBudget(args.max_restarts, args.restart_window_s, args.restart_backoff_s)
    except ValueError as exc:
        say(f"error: {exc}", error=True)
        return 2
    try:
        plans, models = _cells_to_run(args)
    except (ValueError, OSError, PlacementError) as exc:
        say(f"error: {exc}", error=True)
        return 2
    redis_url, redis_server = resolve_redis_url({**os.environ, "TANDEM_REDIS_PASSWORD": args.redis_password,
                                                 "TANDEM_REDIS_DATA_DIR": args.redis_data_dir})
    shown = re.sub(r"//[^@/]*@", "//***@", redis_url)  # never print a password
    say(f"redis at {shown}{' (private)' if redis_server else ''}")
    supervisor = Supervisor(args, plans, models, redis_url, redis_server)

    def on_signal(signum: int, frame: object) -> None:
        supervisor.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        supervisor.start(supervisor.children)
        supervisor.wait_serving()
        http_url = f"http://{args.host}:{args.port}"
        say(f"serving {', '.join(supervisor.served_names)}; HTTP at {http_url} (OpenAI-compatible, {http_url}/v1), "
            f"gRPC at {supervisor.router_addr}. Ctrl-C stops.")
        say(f"try  {sys.executable.rsplit('/', 1)[0]}/tandem ask --address {supervisor.router_addr} "
            f"'What is the capital of France?'")
        code = supervisor.supervise()
    except StackStopping:
        pass
    except GivingUp:
        code = EXIT_GAVE_UP
    except RuntimeError as exc:
        say(f"error: {exc}", error=True)
        code = EXIT_START_FAILED
    finally:
        supervisor.stop()
        if redis_server is not None:
            redis_server.stop()
        say("stopped" if code == 0 else f"stopped (exit code {code})")
    return code
