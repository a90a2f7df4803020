"""Soak (issue 11): many requests against a real ``tandem up``, mixing completions, client aborts,
cancels and bad requests; afterwards the agent's ledger must be all-free (no leaked block) and,
once the stack is stopped, no shared-memory file of it may be left.

    python -m bench.soak --requests 10000 --concurrency 32 --out bench/results/soak.json

Request kinds, drawn at random per request (``--seed``):
  http-stream   OpenAI chat completion, streamed, read to the end
  http          OpenAI completion, not streamed
  http-abort    streamed, the client closes the connection after 0-5 chunks
  grpc          router gRPC Generate, read to the end
  grpc-cancel   gRPC Generate cancelled after 0-5 responses or a random 0-200 ms
  bad           an invalid request (negative max_tokens, unknown model, empty messages): must be 4xx
  json          OpenAI chat completion with a JSON schema (structured output), not streamed: the
                answer must end by itself in JSON that has the schema's keys and types
Every outcome is counted; an unexpected one (a 5xx, a completed request with no tokens, a bad
request that was served) is a failure the JSON lists.

Faults (``--kill-every-s S``): meanwhile a random one of ``--kill`` (decode_svc, prefill_svc,
router, gpu_agent, redis-server) is killed with SIGKILL at random moments, S seconds apart on
average, and ``tandem up`` restarts it. A request may then fail, but only clearly: an HTTP status
or an SSE error event with a message, or a gRPC status with details ("failed clearly"); a
connection to a killed router may break ("broken by the router's kill"). A hang (the client's
--timeout-s), a stream that ends with neither [DONE] nor an error, or an error with no message is
unexpected. After the last kill the stack must serve again, then ``--after-requests`` more
requests are judged as without faults (nothing unexpected, at least one completed), and then the
ledger must be all-free. ``--signal TERM`` sends SIGTERM instead: each service's graceful shutdown
under load, which must end within its deadline (one that exits 75, past it, fails the run).
``--signal STOP`` freezes the process instead: `tandem up`'s liveness watch must kill and restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.peer import running, tandem_up
from bench.stack_cpu import ROLES, StackProcess, stack_processes
from tandem.bench.client import bounded_retry_after_s, retry_after_hint_s
from tandem.bench.report import write_json
from tandem.rpc.channels import RECONNECT_OPTIONS
from tandem.rpc.convert import retry_after_from
from tandem.rpc.v1 import agent_pb2, agent_pb2_grpc, common_pb2, router_pb2, router_pb2_grpc
from tandem.service.runtime import EXIT_SHUTDOWN_OVERDUE, free_port

KINDS = {"http-stream": 3, "http": 2, "http-abort": 2, "grpc": 2, "grpc-cancel": 2, "bad": 1, "json": 1}
# The structured output a "json" request asks for: every value bounded, so it ends within its budget.
JSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "ok"],
               "properties": {"name": {"type": "string", "maxLength": 24}, "ok": {"type": "boolean"},
                              "count": {"type": "integer", "minimum": 0, "maximum": 9999}}}
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly "
         "bank clerk in paris rome tokyo and lima because numbers like 42 and 1024 matter").split()


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.choice((1, 5, 20, 60, 200, 400))))


ROUTER_RESTART_S = 60.0  # a router killed this long ago may still be restarting
FAULT_ROLES = ROLES  # what --kill picks from: every process of the stack


class Faults:
    """The kills so far (monotonic time, role), for judging how a request ended; ``ended`` stops
    the killer (set once the faulted requests are done, before the ledger is read)."""

    def __init__(self) -> None:
        self.kills: list[tuple[float, str]] = []
        self.ended = asyncio.Event()

    def router_killed_since(self, start_s: float) -> bool:
        return any(role == "router" and at >= start_s for at, role in self.kills)


def _with_hint(outcome: str, retry_after_s: float | None) -> str:
    """A refusal's outcome with the server's retry hint after it ("http 429: retry after 0.25 s"):
    the worker waits that long before its next request, as a client that honours Retry-After
    does (it is counted by the part before the colon)."""
    return outcome if retry_after_s is None else f"{outcome}: retry after {retry_after_s:.3f} s"


def _refused(r: httpx.Response) -> str:
    """A 4xx answer's outcome; a 429's with its Retry-After (read as ``tandem bench`` reads it)."""
    return _with_hint("http 429", retry_after_hint_s(r)) if r.status_code == 429 else f"http {r.status_code}"


def _retry_hint_s(outcome: str) -> float | None:
    """The wait a refusal's outcome asks for (bounded as ``tandem bench`` bounds it), else None."""
    match = re.search(r": retry after ([0-9.]+) s$", outcome)
    return None if match is None else bounded_retry_after_s(float(match.group(1)))


def _clear_5xx(status: int, text: str) -> str:
    """Under faults a 5xx with a message is a clear failure; one without is not."""
    return f"failed clearly: http {status} {text[:160]}" if _has_message(text) else \
        f"UNEXPECTED http {status} with no message: {text!r}"


def _has_message(text: str) -> bool:
    """An OpenAI error body with a message (a plain-text body, such as a server's bare "Internal
    Server Error", says nothing a client can act on)."""
    try:
        body = json.loads(text)
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return bool(isinstance(error, dict) and str(error.get("message", "")).strip())


async def _http(client: httpx.AsyncClient, rng: random.Random, kind: str, faults: Faults | None = None,
                model: str = "default") -> str:
    max_tokens = rng.randint(1, 32)
    if kind == "bad":
        body: dict[str, Any] = rng.choice([
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
            {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
            {"model": model, "messages": []},
            {"model": model, "prompt": "hi", "temperature": -3},
        ])
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = await client.post(path, json=body)
        return f"http {r.status_code}" if 400 <= r.status_code < 500 else f"UNEXPECTED bad request got {r.status_code}"
    if kind == "json":
        r = await client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": f"As JSON: {_prompt(rng)}"}], "max_tokens": 160,
            "temperature": rng.choice((0, 0.7)), "seed": rng.randrange(1000),
            "response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": JSON_SCHEMA}}})
        if r.status_code != 200:
            if r.status_code >= 500 and faults is not None:
                return _clear_5xx(r.status_code, r.text)
            return _refused(r) if r.status_code < 500 else f"UNEXPECTED http {r.status_code}: {r.text[:200]}"
        choice = r.json()["choices"][0]
        try:
            value = json.loads(choice["message"]["content"])
        except ValueError:
            value = None
        shaped = (isinstance(value, dict) and set(value) == {"name", "count", "ok"} and isinstance(value["ok"], bool)
                  and isinstance(value["count"], int) and isinstance(value["name"], str))
        return "ok" if shaped and choice["finish_reason"] == "stop" else f"UNEXPECTED not the schema: {r.text[:200]}"
    if kind == "http":
        r = await client.post("/v1/completions", json={"model": model, "prompt": _prompt(rng),
                                                       "max_tokens": max_tokens, "temperature": 0})
        if r.status_code != 200:
            if r.status_code >= 500 and faults is not None:
                return _clear_5xx(r.status_code, r.text)
            return _refused(r) if r.status_code < 500 else f"UNEXPECTED http {r.status_code}: {r.text[:200]}"
        usage = r.json().get("usage", {})
        return "ok" if usage.get("completion_tokens", 0) >= 1 else f"UNEXPECTED no tokens: {r.text[:200]}"
    body = {"model": model, "messages": [{"role": "user", "content": _prompt(rng)}], "max_tokens": max_tokens,
            "stream": True, "temperature": rng.choice((0, 0.7))}
    stop_after = rng.randint(0, 5) if kind == "http-abort" else None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            if r.status_code >= 500 and faults is not None:
                return _clear_5xx(r.status_code, text)
            return _refused(r) if r.status_code < 500 else f"UNEXPECTED http {r.status_code}: {text[:200]}"
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                chunks += 1
                event = json.loads(line[6:]) if line != "data: [DONE]" else None
                if isinstance(event, dict) and "error" in event:
                    if faults is None:
                        return f"UNEXPECTED error event: {line[:200]}"
                    return (f"failed clearly: event {line[6:166]}" if _has_message(line[6:])
                            else f"UNEXPECTED error event with no message: {line}")
                if stop_after is not None and chunks > stop_after:
                    return "aborted"  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    return "ok"
        return "aborted" if stop_after is not None else "UNEXPECTED stream ended without [DONE]"


async def _grpc(stub: router_pb2_grpc.RouterStub, rng: random.Random, kind: str, faults: Faults | None = None,
                timeout_s: float = 300, model: str = "") -> str:
    start_s = time.monotonic()
    request = router_pb2.GenerateRequest(
        model=model, text=_prompt(rng),
        sampling=common_pb2.SamplingParams(max_tokens=rng.randint(1, 32), temperature=0.0))
    call = stub.Generate(request, timeout=timeout_s)
    stop_after = rng.randint(0, 5) if kind == "grpc-cancel" else None
    if stop_after is not None and rng.random() < 0.5:
        await asyncio.sleep(rng.uniform(0, 0.2))
        call.cancel()
        return "cancelled"
    tokens = 0
    try:
        async for response in call:
            tokens += len(response.tokens)
            if stop_after is not None and tokens >= stop_after:
                call.cancel()
                return "cancelled"
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return _with_hint(f"grpc {code.name}", retry_after_from(exc.trailing_metadata()))
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return f"grpc {code.name}"
        if faults is not None and code != grpc.StatusCode.DEADLINE_EXCEEDED:
            if code == grpc.StatusCode.UNAVAILABLE and faults.router_killed_since(start_s):
                return "broken by the router's kill"
            details = (exc.details() or "").strip()
            return f"failed clearly: grpc {code.name} {details[:160]}" if details else \
                f"UNEXPECTED grpc {code.name} with no details"
        return f"UNEXPECTED grpc {code.name}: {exc.details()}"
    except asyncio.CancelledError:
        return "cancelled"
    return "ok" if tokens >= 1 else "UNEXPECTED no tokens"


async def _agent_stats(address: str) -> agent_pb2.AgentStats:
    async with grpc.aio.insecure_channel(address) as channel:
        return await agent_pb2_grpc.GpuAgentStub(channel).GetStats(agent_pb2.GetStatsRequest(), timeout=10)


async def _settled_stats(address: str, deadline: float) -> agent_pb2.AgentStats | None:
    """The agent's stats once every block is free and no request is held, or at ``deadline``
    (an agent that is restarting after a kill is asked again); None if it never answered."""
    stats: agent_pb2.AgentStats | None = None
    while True:
        try:
            stats = await _agent_stats(address)
        except grpc.aio.AioRpcError:
            if time.monotonic() >= deadline:
                return stats
        if stats is not None:
            settled = stats.num_free_blocks == stats.num_blocks and not stats.num_requests \
                and stats.num_free_slabs == stats.num_slabs
            if settled or time.monotonic() >= deadline:
                return stats
        await asyncio.sleep(0.5)


async def _wait_serving(base_url: str, grpc_address: str, timeout_s: float, models: list[str]) -> float:
    """Seconds until the stack completes a request of every model again, over HTTP and over gRPC
    (a restarted router listens for HTTP first)."""
    start = time.monotonic()
    waiting = list(models)
    http_ok = False
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client, \
            grpc.aio.insecure_channel(grpc_address, options=RECONNECT_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        while True:
            model = waiting[0]
            body = {"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0}
            generate = router_pb2.GenerateRequest(model=model, text="hello",
                                                  sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0))
            try:
                http_ok = http_ok or (await client.post("/v1/completions", json=body)).status_code == 200
                if http_ok and [r async for r in stub.Generate(generate, timeout=30)]:
                    waiting.pop(0)
                    http_ok = False
                    if not waiting:
                        return time.monotonic() - start
                    continue
            except (httpx.HTTPError, grpc.aio.AioRpcError):
                pass
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"the stack did not serve again within {timeout_s:.0f} s of the last kill")
            await asyncio.sleep(0.5)


async def kill_at_random(root_pid: int, roles: list[str], every_s: float, faults: Faults,
                         rng: random.Random, sig: signal.Signals = signal.SIGKILL) -> None:
    """Send ``sig`` to a random one of ``roles`` every ``every_s`` seconds on average (0.5-1.5x)
    until ``faults.ended``: to one instance of it, where a cell of several models runs one per model."""
    while not faults.ended.is_set():
        try:
            await asyncio.wait_for(faults.ended.wait(), timeout=every_s * rng.uniform(0.5, 1.5))
            return
        except TimeoutError:
            pass
        role = rng.choice(roles)
        pids = one_instance(stack_processes(root_pid), role, rng)
        if not pids:
            print(f"soak: no live {role} to kill (restarting?)", flush=True)
            continue
        faults.kills.append((time.monotonic(), role))
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        print(f"soak: sent {sig.name} to {role} (pid {pids})", flush=True)


def one_instance(processes: list[StackProcess], role: str, rng: random.Random) -> list[int]:
    """The pids of one live instance of ``role``, chosen at random (each model of a cell has its
    own decode_svc and prefill_svc): a process of the role and the processes of the role below it."""
    live = [p for p in processes if p.role == role and not p.zombie]
    pids = {p.pid for p in live}
    tops = [p.pid for p in live if p.ppid not in pids]
    if not tops:
        return []
    chosen = {rng.choice(tops)}
    while grown := {p.pid for p in live if p.ppid in chosen} - chosen:
        chosen |= grown
    return sorted(chosen)


async def soak(base_url: str, grpc_address: str, agent_address: str, num_requests: int, concurrency: int,
               seed: int, faults: Faults | None = None, timeout_s: float = 300,
               models: list[str] | None = None) -> dict[str, Any]:
    """``num_requests`` requests of random kinds, each to a random one of ``models`` (the names
    `/v1/models` lists), ``concurrency`` at a time; then the agent's ledger once it settles."""
    models = models or ["default"]
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=num_requests)
    outcomes: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {k: Counter() for k in KINDS}
    by_model: dict[str, Counter[str]] = {m: Counter() for m in models}
    failures: list[str] = []
    clear_failures: set[str] = set()  # with faults: what the clear failures said (ids and numbers as #)
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in enumerate(kinds):
        queue.put_nowait(item)
    started = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client, \
            grpc.aio.insecure_channel(grpc_address, options=RECONNECT_OPTIONS) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def worker(wid: int) -> None:
            wrng = random.Random(seed * 1000 + wid)
            while not queue.empty():
                i, kind = queue.get_nowait()
                start_s = time.monotonic()
                model = wrng.choice(models) if len(models) > 1 else models[0]
                try:
                    outcome = await (_grpc(stub, wrng, kind, faults, timeout_s, model) if kind.startswith("grpc")
                                     else _http(client, wrng, kind, faults, model))
                except httpx.TimeoutException as exc:
                    outcome = f"UNEXPECTED hang: no answer within {timeout_s:.0f} s ({type(exc).__name__})"
                except httpx.HTTPError as exc:
                    # A request sent while a killed router restarts is refused at connect, and one
                    # sent on a kept-alive connection to the killed router finds it closed.
                    since_s = start_s - (ROUTER_RESTART_S if isinstance(exc, (httpx.ConnectError, httpx.ReadError,
                                                                                httpx.RemoteProtocolError)) else 0.0)
                    if faults is not None and faults.router_killed_since(since_s):
                        outcome = "broken by the router's kill"
                    else:
                        outcome = f"UNEXPECTED {type(exc).__name__}: {exc}"
                if outcome.startswith("failed clearly") and len(clear_failures) < 40:
                    clear_failures.add(re.sub(r"[0-9a-f]{8,}|\d+", "#", outcome.split(": ", 1)[1]))
                hint_s = _retry_hint_s(outcome)
                if hint_s is not None:
                    await asyncio.sleep(hint_s)  # a refusal: ask again when told, faults or not
                elif faults is not None and outcome.split(":")[0] in ("failed clearly", "broken by the router's kill",
                                                                      "http 429", "grpc RESOURCE_EXHAUSTED"):
                    await asyncio.sleep(1.0)  # as a client would, and so the load spans the kills
                outcomes[outcome.split(":")[0]] += 1
                by_kind[kind][outcome.split(":")[0]] += 1
                by_model[model][outcome.split(":")[0]] += 1
                if outcome.startswith("UNEXPECTED") and len(failures) < 50:
                    failures.append(f"#{i} {kind}: {outcome}")
                if (i + 1) % 500 == 0:
                    print(f"soak: {i + 1}/{num_requests} in {time.monotonic() - started:.0f} s; {dict(outcomes)}",
                          flush=True)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.monotonic() - started
    if faults is not None:
        faults.ended.set()  # no kill while the ledger settles (a killed agent restarts meanwhile)
    # Aborted and cancelled requests release their blocks asynchronously: give them a moment.
    deadline = time.monotonic() + 60
    stats = await _settled_stats(agent_address, deadline)
    return {
        "requests": num_requests, "concurrency": concurrency, "seed": seed, "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(num_requests / elapsed, 2), "outcomes": dict(outcomes),
        "by_kind": {k: dict(v) for k, v in by_kind.items()}, "unexpected": failures,
        **({"by_model": {m: dict(v) for m, v in by_model.items()}} if len(models) > 1 else {}),
        "failed_clearly_said": sorted(clear_failures),
        "num_unexpected": sum(n for o, n in outcomes.items() if o.startswith("UNEXPECTED")),
        "agent": _ledger(stats),
    }


def _ledger(stats: agent_pb2.AgentStats | None) -> dict[str, Any]:
    if stats is None:
        return {"unreachable": "the agent did not answer GetStats within 60 s after the requests"}
    return {"num_blocks": stats.num_blocks, "num_free_blocks": stats.num_free_blocks,
            "num_requests": stats.num_requests, "leaked_blocks": stats.num_blocks - stats.num_free_blocks,
            "num_reclaimed_requests": stats.num_reclaimed_requests,
            "num_slabs": stats.num_slabs, "leaked_slabs": stats.num_slabs - stats.num_free_slabs,
            "held_blocks_by_model": {m.model: m.num_held_blocks for m in stats.models}}


async def soak_with_faults(base_url: str, grpc_address: str, agent_address: str, root_pid: int,
                           args: argparse.Namespace, seed: int, models: list[str]) -> dict[str, Any]:
    """The soak while processes are killed at random, then ``args.after_requests`` requests after
    the last kill, judged as without faults."""
    faults = Faults()
    killer = asyncio.create_task(kill_at_random(root_pid, args.kill, args.kill_every_s, faults,
                                                random.Random(seed), signal.Signals[f"SIG{args.signal}"]))
    try:
        result = await soak(base_url, grpc_address, agent_address, args.requests, args.concurrency, seed, faults,
                            args.timeout_s, models)
    finally:
        faults.ended.set()
        await killer
    result["kills"] = dict(Counter(role for _, role in faults.kills))
    result["recovery_s"] = round(await _wait_serving(base_url, grpc_address, 180, models), 2)
    print(f"soak: {len(faults.kills)} kills {result['kills']}; serving again after {result['recovery_s']} s", flush=True)
    after = await soak(base_url, grpc_address, agent_address, args.after_requests, min(args.concurrency, 8),
                       seed + 1, None, args.timeout_s, models)
    after.pop("by_kind", None)
    result["after"] = after
    return result


def _shm_files(cell_id: str) -> list[str]:
    try:
        return sorted(name for name in os.listdir("/dev/shm") if cell_id in name)
    except FileNotFoundError:
        return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="0: a random seed (printed)")
    p.add_argument("--out", default="bench/results/soak.json")
    p.add_argument("--kill-every-s", type=float, default=0.0,
                   help="kill a random one of --kill with SIGKILL this often on average (0: no faults)")
    p.add_argument("--kill", nargs="+", choices=FAULT_ROLES, default=["decode_svc", "prefill_svc", "router"],
                   help="the processes --kill-every-s picks from")
    p.add_argument("--signal", choices=["KILL", "TERM", "STOP"], default="KILL",
                   help="what --kill-every-s sends: TERM tests each service's graceful shutdown under load "
                        "(one past its deadline exits 75, which fails the run); STOP freezes the process, "
                        "which `tandem up`'s liveness watch must find, kill and restart (give it a short "
                        "--liveness-timeout-s in --tandem-args)")
    p.add_argument("--after-requests", type=int, default=100,
                   help="with faults: requests sent after the last kill, judged as without faults")
    p.add_argument("--timeout-s", type=float, default=300.0, help="a request with no answer by then is a hang")
    p.add_argument("--tandem-args", nargs=argparse.REMAINDER, default=[], help="everything after it goes to `tandem up`")
    args = p.parse_args(argv)
    if args.kill_every_s > 0 and not any(a.startswith("--max-restarts") for a in args.tandem_args):
        args.tandem_args += ["--max-restarts", "1000"]  # the kills are the test, not a crash loop
    seed = args.seed or random.SystemRandom().randrange(1, 2**31)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    grpc_port = free_port()
    cell_id = f"soak-{os.getpid()}"
    log_path = Path(args.out).with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = tandem_up("tandem", cell_id, args.tandem_args, log_path, grpc_port=grpc_port)
    with running(server, timeout_s=600):
        match = re.search(r"gpu_agent ready at (\S+)", log_path.read_text(errors="replace"))
        if match is None:
            raise RuntimeError(f"no agent address in {log_path}")
        grpc_address, agent_address = f"127.0.0.1:{grpc_port}", match.group(1)
        served = [m["id"] for m in httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]]
        models = served if len(served) > 1 else ["default"]  # a cell of several models: each request picks one
        if args.kill_every_s > 0:
            assert server.proc is not None
            result = asyncio.run(soak_with_faults(server.base_url, grpc_address, agent_address, server.proc.pid, args,
                                                  seed, models))
        else:
            result = asyncio.run(soak(server.base_url, grpc_address, agent_address, args.requests, args.concurrency,
                                      seed, timeout_s=args.timeout_s, models=models))
        result["models"] = models
        result["shm_files_while_running"] = _shm_files(cell_id)
        result["stack_running"] = server.proc is not None and server.proc.poll() is None
    result["shm_files_after_stop"] = _shm_files(cell_id)
    # how the faulted processes ended, from `tandem up`'s restarts: 75 is a shutdown past its deadline
    codes = Counter(re.findall(r"exited with code (-?\d+); restarting", log_path.read_text(errors="replace")))
    result["exit_codes"] = dict(codes)
    last = result.get("after", result)  # with faults, the ledger that counts is the one after the last kill
    result["ok"] = (result["num_unexpected"] == 0 and not codes.get(str(EXIT_SHUTDOWN_OVERDUE))
                    and last["num_unexpected"] == 0 and last["outcomes"].get("ok", 0) >= 1
                    and last["agent"].get("leaked_blocks") == 0 and last["agent"].get("num_requests") == 0
                    and last["agent"].get("leaked_slabs") == 0
                    and result["stack_running"]
                    and not result["shm_files_after_stop"])
    write_json(result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k != "by_kind"}, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
