"""``tandem up``: a whole cell and a router on this machine, as separate processes.

Starts (or uses ``REDIS_URL``) Redis, then gpu_agent, decode_svc, prefill_svc and the router,
each with ``python -m <package>``, waits until each answers, prints the addresses, and stays in
the foreground, supervising:

- a decode, prefill or router process that dies is restarted on its address (decode resumes
  its requests from Redis, the router's clients reconnect);
- a gpu_agent that dies takes the cell's KV pool with it, so the cell restarts whole: prefill
  and decode are stopped, the dead agent's shared-memory files removed, and a new agent (which
  fails the requests the old cell was serving), decode and prefill started; the router stays;
- restarts wait with exponential backoff, and a process that dies more than ``--max-restarts``
  times within ``--restart-window-s`` stops the whole stack with exit code
  :data:`EXIT_GAVE_UP` and a message naming it.

Every agent incarnation gets its own shared-memory prefix (``<cell id>-<instance id>``), so
stacks that share ``/dev/shm`` and a cell id never touch each other's files. Ctrl-C or SIGTERM
stops every process, newest first, with exit code 0; a stack that cannot start exits 1.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tandem.engine.shm_files import SHM_DIR, remove_if_dead
from tandem.engine.weight_format import FORMAT_NAMES
from tandem.service.flags import add_flag
from tandem.service.model_spec import ModelSpec, parse_models
from tandem.service.runtime import free_port

EXIT_START_FAILED = 1
EXIT_GAVE_UP = 3  # a process kept dying: more than --max-restarts within --restart-window-s
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL after this long
POLL_S = 0.2


class StackStopping(Exception):
    """A signal arrived while the launcher was waiting (for a backoff or a process to be ready)."""


@dataclass
class RestartBudget:
    """When to restart a process that keeps dying, and when to give up.

    ``next_delay_s(now)`` is called at each death: it returns the backoff before the restart —
    ``initial_backoff_s`` doubled for each restart still within the window, at most
    ``max_backoff_s`` — or None when ``max_restarts`` restarts already happened within
    ``window_s`` (give up). Deaths older than the window are forgotten.
    """

    max_restarts: int
    window_s: float
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    _restarts_s: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.initial_backoff_s < 0:
            raise ValueError("--max-restarts must be >= 0, --restart-window-s > 0, --restart-backoff-s >= 0")

    def next_delay_s(self, now_s: float) -> float | None:
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
    parser.add_argument("--model", action="append", default=None,
                        help="a model to serve: PATH[:name=NAME][:kv=DTYPE][:quant=FORMAT], PATH a model directory "
                        "or 'default'; repeat it to serve several models from one cell, sharing one KV slab pool "
                        "(e.g. --model default --model default:kv=bfloat16) [env TANDEM_MODEL, comma-separated; "
                        "default 'default']")
    add_flag(parser, "--host", "127.0.0.1", "address the router listens on")
    add_flag(parser, "--port", 8000, "router's OpenAI-compatible HTTP port", type=int)
    add_flag(parser, "--grpc-port", 50051, "router's public gRPC port", type=int)
    add_flag(parser, "--cell-id", "cell0", "id of the cell")
    add_flag(parser, "--kv-cache-gb", 1.0, "KV pool size in GiB", type=float)
    add_flag(parser, "--kv-split", "slab", "with several --model: share the KV pool by slabs (slab) or give each "
             "model an equal range (static)", choices=["slab", "static"])
    add_flag(parser, "--prefill-cores", "", "cores for prefill (default: first half)")
    add_flag(parser, "--decode-cores", "", "cores for decode (default: the rest)")
    add_flag(parser, "--ready-timeout-s", 300.0, "how long to wait for the stack to come up", type=float)
    add_flag(parser, "--policy", "dynamic", "partition policy: dynamic, adaptive, static or chunked")
    add_flag(parser, "--ttft-slo-ms", 2000.0, "time-to-first-token SLO (admission and policy)", type=float)
    add_flag(parser, "--tbt-slo-ms", 200.0, "time-between-tokens SLO (policy)", type=float)
    add_flag(parser, "--ttft-slo-ms-per-1k", 0.0, "the TTFT SLO grows by this per 1000 prompt tokens "
             "(deadlines, EDF order, early drop)", type=float)
    add_flag(parser, "--admission", "on", "router refuses early (429) what would miss the TTFT SLO",
             choices=["on", "off"])
    add_flag(parser, "--profile", "", "perf profile from `tandem profile` for the agent and the router")
    add_flag(parser, "--redis-password", "", "password the private Redis requires (ignored with REDIS_URL: put it "
             "in the URL)")
    add_flag(parser, "--redis-data-dir", "", "persist the private Redis there (append-only file), so request "
             "records survive a Redis restart")
    add_flag(parser, "--kv-dtype", "", "KV cache storage dtype (float16 or bfloat16 hold twice the tokens per GiB; "
             "default: the model's)", choices=["", "float32", "bfloat16", "float16"])
    add_flag(parser, "--quantization", "auto", f"weight format prefill and decode run ({FORMAT_NAMES}; "
             "auto: the fastest accurate one for this CPU; int8 is lossy)")
    add_flag(parser, "--max-restarts", 5, "restarts of one process (the cell, for the agent) within "
             "--restart-window-s before the stack gives up and stops", type=int)
    add_flag(parser, "--restart-window-s", 300.0, "window over which --max-restarts counts", type=float)
    add_flag(parser, "--restart-backoff-s", 1.0, "wait before the first restart; doubled for each further "
             "restart within the window, at most 30 s", type=float)
    parser.set_defaults(func=run)
    return parser


def _fixed(argv: list[str]) -> Callable[[], list[str]]:
    return lambda: list(argv)


def _spec_text(spec: ModelSpec, path: Path) -> str:
    """The agent's --model entry for ``spec``, with its directory resolved."""
    options = [f"name={spec.served_name(path)}"] + ([f"kv={spec.kv_dtype}"] if spec.kv_dtype else []) + (
        [f"quant={spec.quantization}"] if spec.quantization else [])
    return ":".join([str(path), *options])


def say(message: str, error: bool = False) -> None:
    print(f"tandem up: {message}", file=sys.stderr if error else sys.stdout, flush=True)


def wait_ready(child: Child, deadline: float, stopping: Callable[[], bool] = lambda: False) -> None:
    """Block until ``child`` accepts gRPC connections; raise if it dies or time runs out."""
    with grpc.insecure_channel(child.address) as channel:
        while True:
            if stopping():
                raise StackStopping
            if not child.alive():
                raise RuntimeError(f"{child.name} exited with code {child.returncode}")
            try:
                grpc.channel_ready_future(channel).result(timeout=0.5)
                return
            except grpc.FutureTimeoutError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{child.name} did not come up at {child.address} in time") from None


class Supervisor:
    """Starts the stack, restarts what dies, and stops it all; see the module docstring."""

    def __init__(self, args: argparse.Namespace, models: list[tuple[ModelSpec, Path]], redis_url: str) -> None:
        self.args = args
        self.cell_id: str = args.cell_id
        self.instance_id = ""  # the running agent's; its files are named <cell id>-<instance id>-*
        self.stopping = False
        agent_addr = f"127.0.0.1:{free_port()}"
        self.router_addr = f"{args.host}:{args.grpc_port}"
        # The SLOs, policy and profile reach every child through their TANDEM_* twins, so the
        # router's admission and the agent's policy work from the same numbers.
        env = {"REDIS_URL": redis_url, "TANDEM_CELL_ID": args.cell_id, "TANDEM_POLICY": args.policy,
               "TANDEM_TTFT_SLO_MS": str(args.ttft_slo_ms), "TANDEM_TBT_SLO_MS": str(args.tbt_slo_ms),
               "TANDEM_TTFT_SLO_MS_PER_1K": str(args.ttft_slo_ms_per_1k),
               "TANDEM_ADMISSION": args.admission, "TANDEM_PROFILE": args.profile}
        cores = []
        if args.prefill_cores:
            cores += ["--prefill-cores", args.prefill_cores]
        if args.decode_cores:
            cores += ["--decode-cores", args.decode_cores]

        def budget() -> RestartBudget:
            return RestartBudget(args.max_restarts, args.restart_window_s, args.restart_backoff_s)

        def port(address: str) -> str:
            return address.rsplit(":", 1)[1]

        self.agent = Child("gpu_agent", lambda: [
            "gpu_agent", "--model", ",".join(_spec_text(spec, path) for spec, path in models),
            "--port", port(agent_addr), "--instance-id", self.new_instance(),
            "--kv-cache-gb", str(args.kv_cache_gb), "--kv-split", args.kv_split, "--quantization", args.quantization,
            *(["--kv-dtype", args.kv_dtype] if args.kv_dtype else []), *cores,
        ], agent_addr, env, budget())
        # A decode_svc and a prefill_svc per model, each naming its model to the agent.
        self.workers: list[Child] = []
        served = [(spec.served_name(path), path) for spec, path in models]
        for index, (name, _) in enumerate(served):
            decode_addr, prefill_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
            suffix = f"-{index}" if len(served) > 1 else ""
            model = ["--model", name] if len(served) > 1 else []
            decode_argv = ["decode_svc", "--agent-address", agent_addr, "--port", port(decode_addr), *model]
            prefill_argv = ["prefill_svc", "--agent-address", agent_addr, "--decode-address", decode_addr,
                            "--port", port(prefill_addr), *model]
            self.workers.append(Child(f"decode_svc{suffix}", _fixed(decode_argv), decode_addr, env, budget()))
            self.workers.append(Child(f"prefill_svc{suffix}", _fixed(prefill_argv), prefill_addr, env, budget()))
        if len(served) == 1:
            # One model: the router is wired to its services by address.
            upstreams = ["--prefill-address", self.workers[1].address, "--decode-address", self.workers[0].address]
        else:
            # Several: each model's services are found in the registry by the name they announce.
            upstreams = ["--extra-model", ",".join(f"{name}={path}" for name, path in served[1:])]
        upstreams += ["--served-model-name", served[0][0]]
        self.router = Child("router", lambda: [
            "router", "--model", str(served[0][1]), "--host", args.host, "--grpc-port", str(args.grpc_port),
            "--http-port", str(args.port), *upstreams,
        ], self.router_addr, env, budget())
        self.served_names = [name for name, _ in served]
        self.cell = [self.agent, *self.workers]  # in start order
        self.children = [*self.cell, self.router]

    def new_instance(self) -> str:
        self.instance_id = secrets.token_hex(4)
        return self.instance_id

    @property
    def shm_prefix(self) -> str:
        return f"{self.cell_id}-{self.instance_id}"

    def start(self, children: list[Child]) -> None:
        deadline = time.monotonic() + self.args.ready_timeout_s
        for child in children:
            child.start()
            try:
                wait_ready(child, deadline, lambda: self.stopping)
            except RuntimeError:
                child.stop()  # dead already, or stuck: either way the next round restarts it
                raise
            pid = child.proc.pid if child.proc else "?"
            say(f"{child.name} ready at {child.address} (pid {pid})")
            if child is self.agent:
                say(f"gpu_agent's shared memory: {SHM_DIR}/tandem-{self.shm_prefix}-*")

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.stopping:
                raise StackStopping
            time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))

    def remove_agent_files(self) -> None:
        """Remove the (dead) agent's shared memory; never a live agent's (it holds its lock)."""
        if not self.instance_id:
            return
        removed = remove_if_dead(self.shm_prefix)
        if removed is None:
            say(f"the shared memory of {self.shm_prefix} is still held by a live process; left in place", error=True)
        elif removed:
            say(f"removed {len(removed)} shared-memory files of the dead gpu_agent ({self.shm_prefix})")

    def supervise(self) -> int:
        """Restart what dies until a signal (0) or a process out of restarts (EXIT_GAVE_UP)."""
        while not self.stopping:
            time.sleep(POLL_S)
            dead = next((c for c in self.children if not c.alive()), None)
            if dead is None:
                continue
            delay_s = dead.budget.next_delay_s(time.monotonic())
            what = "the cell" if dead is self.agent else dead.name
            if delay_s is None:
                say(f"{dead.name} exited with code {dead.returncode}, and {what} was already restarted "
                    f"{dead.budget.num_recent} times within {self.args.restart_window_s:g} s "
                    f"(--max-restarts {self.args.max_restarts}); giving up: stopping the stack", error=True)
                return EXIT_GAVE_UP
            dead.num_restarts += 1
            say(f"{dead.name} exited with code {dead.returncode}; restarting {what} in {delay_s:.1f} s "
                f"(restart #{dead.num_restarts})", error=True)
            try:
                if dead is self.agent:
                    self.restart_cell(delay_s)
                else:
                    self.sleep(delay_s)
                    self.start([dead])
            except RuntimeError as exc:  # it died again while starting: the next round counts it
                say(f"restart failed: {exc}", error=True)
            except StackStopping:
                break
        return 0

    def restart_cell(self, delay_s: float) -> None:
        """The agent died and its KV pool with it: stop prefill and decode (their requests'
        K/V is gone), remove the agent's files, and start the cell again on the same addresses.
        The new agent fails the old cell's requests before decode can resume any."""
        for child in self.workers:
            child.stop()
        self.remove_agent_files()
        self.sleep(delay_s)
        self.start(self.cell)
        say(f"cell {self.cell_id} is back (gpu_agent instance {self.instance_id})")

    def stop(self) -> None:
        """Stop every process, newest first, and remove what a dead agent left behind."""
        for child in reversed(self.children):
            if child.alive() and child.proc is not None:
                child.proc.terminate()
        for child in reversed(self.children):
            child.stop()
        self.remove_agent_files()


def run(args: argparse.Namespace) -> int:
    from tandem.engine.model_cache import resolve_model
    from tandem.state.redis_server import resolve_redis_url

    try:
        RestartBudget(args.max_restarts, args.restart_window_s, args.restart_backoff_s)
    except ValueError as exc:
        say(f"error: {exc}", error=True)
        return 2
    try:
        specs = [spec for text in (args.model or [os.environ.get("TANDEM_MODEL") or "default"])
                 for spec in parse_models(text)]
        models = [(spec, resolve_model(spec.path)) for spec in specs]
        names = [spec.served_name(path) for spec, path in models]
        if len(set(names)) != len(names):
            raise ValueError(f"two --model entries serve the name(s) {sorted({n for n in names if names.count(n) > 1})}; "
                             "give one of them :name=NAME")
    except ValueError as exc:
        say(f"error: {exc}", error=True)
        return 2
    redis_url, redis_server = resolve_redis_url({**os.environ, "TANDEM_REDIS_PASSWORD": args.redis_password,
                                                 "TANDEM_REDIS_DATA_DIR": args.redis_data_dir})
    shown = re.sub(r"//[^@/]*@", "//***@", redis_url)  # never print a password
    say(f"redis at {shown}{' (private)' if redis_server else ''}")
    supervisor = Supervisor(args, models, redis_url)

    def on_signal(signum: int, frame: object) -> None:
        supervisor.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        supervisor.start(supervisor.children)
        http_url = f"http://{args.host}:{args.port}"
        say(f"serving {', '.join(supervisor.served_names)}; HTTP at {http_url} (OpenAI-compatible, {http_url}/v1), "
            f"gRPC at {supervisor.router_addr}. Ctrl-C stops.")
        say(f"try  {sys.executable.rsplit('/', 1)[0]}/tandem ask --address {supervisor.router_addr} "
            f"'What is the capital of France?'")
        code = supervisor.supervise()
    except StackStopping:
        pass
    except RuntimeError as exc:
        say(f"error: {exc}", error=True)
        code = EXIT_START_FAILED
    finally:
        supervisor.stop()
        if redis_server is not None:
            redis_server.stop()
        say("stopped" if code == 0 else f"stopped (exit code {code})")
    return code
