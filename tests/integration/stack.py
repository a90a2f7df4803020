"""A real Tandem mesh for tests: Redis, gpu_agent, prefill_svc, decode_svc and router as
separate processes on private ports, started and stopped by the test."""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.launcher import wait_channel_ready, wait_router_serving
from tandem.service.runtime import free_ports
from tandem.state.redis_server import RedisServer
from tests.tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def write_tiny_chat_model(out_dir: Path, smollm2_dir: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama with SmolLM2's vocabulary, tokenizer and chat template: fast to
    run, and every text path (chat template, detokenization) is the real one."""
    write_tiny_model(out_dir, "llama", seed=seed, vocab_size=49152, bos_token_id=1, eos_token_id=2,
                     max_position_embeddings=2048, rope_scaling=None)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out_dir / name)
    return out_dir


def write_stepping_chat_model(out_dir: Path, smollm2_dir: Path) -> Path:
    """A tiny chat model (see write_tiny_chat_model) wide and deep enough that a decode step
    takes milliseconds and a prefill of a long prompt tens of them: a fault injected at a random
    moment lands mid-stream or mid-prefill, and a test still runs in seconds."""
    write_tiny_chat_model(out_dir, smollm2_dir)
    write_tiny_model(out_dir, "llama", seed=1, vocab_size=49152, bos_token_id=1, eos_token_id=2,
                     max_position_embeddings=2048, rope_scaling=None, hidden_size=256, intermediate_size=768,
                     num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2)
    return out_dir


def fault_seed() -> int:
    """A random seed for a fault test, printed so that TANDEM_FAULT_SEED can replay it."""
    seed = int(os.environ.get("TANDEM_FAULT_SEED", "0")) or random.SystemRandom().randrange(1, 2**31)
    print(f"fault seed {seed} (TANDEM_FAULT_SEED={seed} replays it)")
    return seed


def metric_value(metrics: str, name: str) -> float:
    """The sum of every sample called ``name`` (all its label sets) on a Prometheus page; 0 if none."""
    return sum(sample.value for family in text_string_to_metric_families(metrics)
               for sample in family.samples if sample.name == name)


@dataclass
class Stack:
    model_dir: Path
    log_dir: Path
    num_blocks: int = 512
    block_size: int = 16
    redis: RedisServer | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # Off unless a test is about admission: the others send bursts (16 to 200 streams) that
    # the CPU cannot serve within the default 2 s TTFT SLO, and must see every one served.
    admission: str = "off"
    agent_args: list[str] = field(default_factory=list)  # more gpu_agent flags (``--device cuda``)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def http_address(self) -> str:
        """The router's OpenAI-compatible HTTP API, as a base URL (the router binds any free
        port, so another process cannot take it first; its log says which)."""
        matches = re.findall(r"HTTP at (http://\S+);", self.logs("router"))
        assert matches, self.logs("router")[-3000:]
        return str(matches[-1])

    def metrics(self) -> str:
        """The router's /metrics page (Prometheus text)."""
        return httpx.get(f"{self.http_address()}/metrics", timeout=30).text

    def start(self) -> Stack:
        self.redis = RedisServer().start()
        names = ("gpu_agent", "prefill_svc", "decode_svc", "router")
        self.ports.update(zip(names, free_ports(len(names), exclude={self.redis.port}), strict=True))
        # all at once, as tandem up starts them: the services register once the agent serves,
        # and the router is ready once its stream to decode is open (what its Health says)
        offsets = {name: self.spawn(name) for name in names}
        for name, offset in offsets.items():
            self.wait_ready(name, 120.0, offset)
        return self

    def __enter__(self) -> Stack:
        """``with Stack(...) as stack``: started, and stopped on leaving, or if starting fails."""
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _args(self, name: str) -> list[str]:
        agent = ["--agent-address", self.address("gpu_agent")]
        port = str(self.ports[name])
        return {
            "gpu_agent": ["--model", str(self.model_dir), "--port", port, "--num-blocks", str(self.num_blocks),
                          "--block-size", str(self.block_size), *self.agent_args],
            "decode_svc": [*agent, "--port", port],
            "prefill_svc": [*agent, "--port", port, "--decode-address", self.address("decode_svc")],
            "router": ["--model", str(self.model_dir), "--grpc-port", port, "--http-port", "0", "--admission", self.admission,
                       "--prefill-address", self.address("prefill_svc"), "--decode-address", self.address("decode_svc")],
        }[name]

    def start_process(self, name: str, timeout_s: float = 120.0) -> None:
        """Start ``name`` and wait until it serves."""
        self.wait_ready(name, timeout_s, self.spawn(name))

    def spawn(self, name: str) -> int:
        """Start ``name``; returns where its new lines begin in its log (for ``wait_ready``)."""
        assert self.redis is not None
        # extra_env may override the cell id (it names the shared-memory segments: one per stack)
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env = {**os.environ, "REDIS_URL": self.redis.url, "PYTHONPATH": path, "TANDEM_CELL_ID": "cell0",
               **self.extra_env}
        log = open(self.log_dir / f"{name}.log", "ab")
        offset = len(self.logs(name))
        self.procs[name] = subprocess.Popen([sys.executable, "-m", name, *self._args(name)], env=env, cwd=ROOT,
                                            stdout=log, stderr=subprocess.STDOUT)
        return offset

    def wait_ready(self, name: str, timeout_s: float, log_offset: int = 0) -> None:
        deadline = time.monotonic() + timeout_s
        def check() -> None:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited: {self.logs(name)[-3000:]}")
            agent = self.procs.get("gpu_agent")
            if name in ("prefill_svc", "decode_svc") and agent is not None and agent.poll() is not None:
                raise RuntimeError(f"{name} cannot register: gpu_agent exited: {self.logs('gpu_agent')[-3000:]}")

        if not wait_channel_ready(self.address(name), deadline, check):
            raise RuntimeError(f"{name} not ready: {self.logs(name)[-3000:]}")
        if name in ("prefill_svc", "decode_svc", "router"):
            self.wait_log(name, "ready at", timeout_s, log_offset)
        if name == "router":
            wait_router_serving(self.address(name), deadline, check)

    def wait_log(self, name: str, text: str, timeout_s: float, log_offset: int = 0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.logs(name)[log_offset:]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} never logged {text!r}: {self.logs(name)[-3000:]}")
            time.sleep(0.1)

    def logs(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        for name in ("router", "prefill_svc", "decode_svc", "gpu_agent"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.redis is not None:
            self.redis.stop()


def start_up(args: list[str], log_path: Path, timeout_s: float = 300) -> subprocess.Popen[bytes]:
    """`tandem up ARGS` (with a private Redis of its own, this checkout's code), once it says it
    serves; its output goes to ``log_path``. Stop it with :func:`stop_up`."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    # Admission starts uncalibrated in each test, not from what an earlier one measured.
    env.setdefault("TANDEM_ADMISSION_CACHE", str(log_path.parent / "admission-cache"))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", *args], env=env, cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while "tandem up: serving" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "stack did not come up"
            time.sleep(0.2)
    except BaseException:
        stop_up(proc, log_path, check=False)
        raise
    return proc


def up_pid(log: str, name: str) -> int:
    """The newest pid `tandem up` reported for ``name`` in its log ("NAME ready at ... (pid N)")."""
    return int(re.findall(rf"tandem up: {re.escape(name)} ready at \S+ \(pid (\d+)\)", log)[-1])


def wait_up_log(proc: subprocess.Popen[bytes], log_path: Path, pattern: str, timeout_s: float,
                start: int = 0) -> re.Match[str]:
    """The first match of ``pattern`` in `tandem up`'s log from offset ``start`` on, once it is
    there; fails when the stack exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        log = log_path.read_text(errors="replace")
        found = re.search(pattern, log[start:])
        if found:
            return found
        assert proc.poll() is None, f"exited {proc.returncode}: {log[-4000:]}"
        assert time.monotonic() < deadline, f"never logged {pattern!r}: {log[-4000:]}"
        time.sleep(0.1)


def stop_up(proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 90, check: bool = True) -> None:
    """SIGTERM, then wait for the whole stack to stop; with ``check``, it must exit 0."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=timeout_s)
        assert not check or code == 0, log_path.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def with_top2(params: Any) -> Any:
    """``params`` asking for the top two logprobs, which ``assert_greedy_output`` reads."""
    return dataclasses.replace(params, logprobs=2)


def assert_greedy_output(got: list[int], want: Any, tie: float, where: str = "") -> None:
    """``got`` is the engine's greedy output ``want`` (a Completion made with ``with_top2``),
    token for token, up to the first position where the engine's two most likely tokens are
    within ``tie`` in logprob, if any: from a near-tie on, which one greedy picks depends on
    rounding (batch shape, thread count, a bf16 KV cache), and both continuations are right."""
    assert len(got) == len(want.token_ids), (where, len(got), len(want.token_ids))
    parted = next((i for i, (a, b) in enumerate(zip(got, want.token_ids)) if a != b), None)
    if parted is not None:
        top = want.top_logprobs[parted]
        assert len(top) == 2 and top[0][1] - top[1][1] < tie and got[parted] in (top[0][0], top[1][0]), (
            f"{where}: token {parted} is {got[parted]}, the engine's {want.token_ids[parted]} (its top two {top})")
