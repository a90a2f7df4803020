"""The load generator's client: streams requests to an OpenAI-compatible server on schedule and
records when every token arrived.

Each request is sent at its ``arrival_s`` (or, with fixed concurrency, as soon as one of the
``concurrency`` slots is free; a multi-turn request also waits for its session's previous turn)
with ``stream: true``, ``stream_options.include_usage``, ``max_tokens = output_len``,
``ignore_eos`` and temperature 0. The time of every SSE chunk that carries tokens is recorded once
per token it carries (counted from its logprobs when the server sends them; the final usage
count is authoritative). Nothing raises out of a request: an HTTP error (429 included), a broken
stream or a timeout becomes a failed ``RequestRecord`` with its error. With ``retries_429`` a 429
is retried after the server's ``Retry-After`` as the openai client does, the request keeping its
first send time (its TTFT counts the wait) and, in a fixed-concurrency run, its slot.

Prompts: against a Tandem server (``owned_by: tandem`` in ``/v1/models``) ``/v1/completions`` gets
token-id prompts of exactly ``input_len`` ordinary (non-special) ids of the server's tokenizer;
other servers and chat get text of ``input_len`` random common words (about one token each). The
content is a pure function of the seed and the request (a session's turns are prefixes of one
token stream), so two systems see the same prompts.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from tandem.bench.metrics import RequestRecord
from tandem.bench.workload import RequestSpec

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Ids assumed ordinary in any BPE vocabulary when a Tandem server's tokenizer cannot be found.
FALLBACK_TOKEN_IDS = range(1000, 3000)
SESSION_BLOCK = 256  # a session's token stream grows in blocks of this many
WORDS = ("the of and to in is you that it he was for on are as with his they at be this from have or "
         "by one had not but what all were when we there can an your which their said if do will each "
         "about how up out them then she many some so these would other into has more her two like him "
         "see time could no make than first been its who now people my made over did down only way find "
         "use may water long little very after words called just where most know get through back much "
         "before go good new write our used me man too any day same right look think also around another "
         "came come work three word must because does part even place well such here take why things help "
         "put years different away again off went old number great tell men say small every found still "
         "between name should home big give air line set own under read last never us left end along "
         "while might next sound below saw something thought both few those always looked show large often "
         "together asked house world going want school important until form food keep children feet land "
         "side without boy once animals life enough took sometimes four head above kind began almost live "
         "page got earth need far hand high year mother light parts country father let night following "
         "picture being study second eyes soon times story boys since white days ever paper hard near "
         "sentence better best across during today others however sure means knew its try told young miles "
         "sun ways thing whole hear example heard several change answer room sea against top turned learn "
         "point city play toward five using himself usually").split()


@dataclass(frozen=True)
class ServerInfo:
    """What ``/v1/models`` says about a server."""

    model: str
    is_tandem: bool
    max_model_len: int | None


@dataclass(frozen=True)
class Target:
    """One system under test."""

    label: str
    base_url: str               # without /v1
    endpoint: str = "completions"  # a key of ENDPOINTS
    api_key: str | None = None
    model: str | None = None    # None: the first model /v1/models lists
    timeout_s: float = 600.0    # per request, whole stream
    request_logprobs: bool = True  # exact token counts per chunk
    # 429s a request retries after the server's Retry-After (as the openai client does, max_retries
    # 2): its TTFT still counts from the first send. 0: a 429 fails the request.
    retries_429: int = 0
    # Sent as every request's response_format (structured output: json_object or json_schema);
    # None: plain text. With ignore_eos a request goes on past its JSON with EOS tokens.
    response_format: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if self.retries_429 < 0:
            raise ValueError(f"retries_429 must be >= 0, got {self.retries_429}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def fetch_server_info(target: Target) -> ServerInfo:
    """The served model (``target.model`` when set) and whether the server is Tandem."""
    async with httpx.AsyncClient(base_url=target.base_url, headers=target.headers, timeout=30.0) as http:
        response = await http.get("/v1/models")
        response.raise_for_status()
        models = response.json().get("data", [])
    entry = next((m for m in models if target.model is None or m.get("id") == target.model), None)
    if entry is None:
        if target.model is None:
            raise RuntimeError(f"{target.base_url}/v1/models lists no model")
        return ServerInfo(target.model, False, None)
    max_len = entry.get("max_model_len")
    return ServerInfo(str(entry["id"]), entry.get("owned_by") == "tandem",
                      int(max_len) if isinstance(max_len, int) else None)


def find_tokenizer(model: str, explicit: str | None = None) -> Path | None:
    """A tokenizer.json for ``model``: ``explicit`` (a file or a model directory), else the model
    id as a local directory, else Tandem's model cache (``$TANDEM_CACHE_DIR/models/<model>``)."""
    root = Path(os.environ.get("TANDEM_CACHE_DIR") or "~/.cache/tandem").expanduser()
    candidates = [Path(explicit).expanduser()] if explicit else [Path(model).expanduser(), root / "models" / model]
    for path in candidates:
        if path.is_file():
            return path
        if (path / "tokenizer.json").is_file():
            return path / "tokenizer.json"
    if explicit:
        raise FileNotFoundError(f"no tokenizer.json at {explicit}")
    return None


def ordinary_token_ids(tokenizer_json: Path) -> list[int]:
    """Every id of the tokenizer that is not an added (special or control) token."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    added = set(tokenizer.get_added_tokens_decoder())
    return [i for i in range(tokenizer.get_vocab_size()) if i not in added]


@dataclass
class PromptBuilder:
    """Deterministic prompt content: token ids (``token_ids`` set) or text of words."""

    seed: int
    token_ids: Sequence[int] | None = None
    salt: str = ""  # another salt, other content (one per rate: no run hits the prefix cache of another)
    _streams: dict[int, list[int]] = field(default_factory=dict)

    def salted(self, salt: str) -> PromptBuilder:
        """The same vocabulary and seed with fresh content."""
        return PromptBuilder(self.seed, self.token_ids, salt)

    def _draw(self, rng: random.Random, num: int) -> list[int]:
        size = len(self.token_ids) if self.token_ids is not None else len(WORDS)
        return [rng.randrange(size) for _ in range(num)]

    def _indices(self, spec: RequestSpec) -> list[int]:
        if spec.session_id is None:
            return self._draw(random.Random(f"{self.seed}/{self.salt}/{spec.request_id}"), spec.input_len)
        stream = self._streams.setdefault(spec.session_id, [])
        while len(stream) < spec.input_len:
            # Fixed-size blocks, each from its own generator: the stream does not depend on the
            # order in which turns ask for it.
            block = len(stream) // SESSION_BLOCK
            stream.extend(self._draw(random.Random(f"{self.seed}/{self.salt}/session{spec.session_id}/{block}"), SESSION_BLOCK))
        return stream[:spec.input_len]

    def prompt(self, spec: RequestSpec) -> list[int] | str:
        if spec.prompt_text is not None:  # a dataset's own text
            return spec.prompt_text
        indices = self._indices(spec)
        if self.token_ids is not None:
            return [self.token_ids[i] for i in indices]
        return " ".join(WORDS[i] for i in indices)


def request_body(target: Target, model: str, spec: RequestSpec, prompt: list[int] | str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": spec.output_len, "ignore_eos": True, "temperature": 0.0,
    }
    if target.response_format is not None:
        body["response_format"] = target.response_format
    if target.endpoint == "chat":
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        body["messages"] = [{"role": "user", "content": text}]
        if target.request_logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = 0
    else:
        body["prompt"] = prompt
        if target.request_logprobs:
            body["logprobs"] = 0
    return body


def _chunk_tokens(chunk: dict[str, Any], chat: bool) -> int:
    """Tokens one SSE chunk carries: its logprobs entries when present, else 1 if it has text."""
    total = 0
    for choice in chunk.get("choices") or []:
        logprobs = choice.get("logprobs")
        if chat:
            entries = logprobs.get("content") if isinstance(logprobs, dict) else None
            text = (choice.get("delta") or {}).get("content") or ""
        else:
            entries = logprobs.get("tokens") if isinstance(logprobs, dict) else None
            text = choice.get("text") or ""
        total += len(entries) if isinstance(entries, list) else (1 if text else 0)
    return total


def _error_message(response_body: bytes) -> str:
    try:
        error = json.loads(response_body).get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error)
    except (ValueError, AttributeError):
        return response_body.decode(errors="replace")[:200]


async def send_one(http: httpx.AsyncClient, target: Target, model: str, spec: RequestSpec,
                   prompt: list[int] | str, clock: Callable[[], float]) -> RequestRecord:
    """Send one request now and stream it to its end; never raises (except CancelledError). A
    429 is retried ``target.retries_429`` times after the server's Retry-After."""
    sent_s = clock()
    chat = target.endpoint == "chat"
    num_429 = 0
    last_sent_s: float | None = None  # a retry's send; the record keeps the first as its arrival
    try:
        body = request_body(target, model, spec, prompt)
        for retries_left in range(target.retries_429, -1, -1):
            # Each attempt counted as the openai client counts it (0 first): a router that refused
            # the request then knows a retry's first send (``router.retries``).
            async with http.stream("POST", ENDPOINTS[target.endpoint], json=body, timeout=target.timeout_s,
                                   headers={"x-stainless-retry-count": str(num_429)}) as response:
                if response.status_code != 429 or retries_left == 0:
                    return replace(await _read_stream(response, spec, sent_s, clock, chat), num_429=num_429,
                                   last_sent_s=last_sent_s)
                await response.aread()
            num_429 += 1
            await asyncio.sleep(_retry_after_s(response))  # refused for now: ask again when told
            last_sent_s = clock()
        raise AssertionError("the last attempt returns")
    except asyncio.CancelledError:
        raise
    except _StreamFailed as exc:
        return RequestRecord(spec.request_id, sent_s, spec.input_len, exc.times, None, exc.message, num_429,
                             last_sent_s)
    except Exception as exc:  # every failure is a result, not a crash
        return RequestRecord(spec.request_id, sent_s, spec.input_len, (), None, f"{type(exc).__name__}: {exc}",
                             num_429, last_sent_s)


# Bounds on a server's Retry-After that the client follows (seconds).
RETRY_AFTER_MIN_S = 0.05
RETRY_AFTER_MAX_S = 10.0


def retry_after_hint_s(response: httpx.Response) -> float | None:
    """The server's hint in seconds, as the openai client reads it: OpenAI's ``retry-after-ms``
    first, then ``Retry-After`` in seconds; None without a usable header."""
    for header, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        try:
            return float(response.headers[header]) / divisor
        except (KeyError, ValueError):
            continue
    return None


def bounded_retry_after_s(hint_s: float) -> float:
    """A server's retry hint within the bounds a client follows (RETRY_AFTER_MIN_S..MAX_S)."""
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, hint_s))


def _retry_after_s(response: httpx.Response) -> float:
    """The server's hint in seconds (bounded, ``retry_after_hint_s``); 1 s without a usable header."""
    hint_s = retry_after_hint_s(response)
    return 1.0 if hint_s is None else bounded_retry_after_s(hint_s)


class _StreamFailed(Exception):
    """A stream that broke after some tokens: they stay in the record."""

    def __init__(self, message: str, times: tuple[float, ...]) -> None:
        super().__init__(message)
        self.message, self.times = message, times


async def _read_stream(response: httpx.Response, spec: RequestSpec, sent_s: float, clock: Callable[[], float],
                       chat: bool) -> RequestRecord:
    """The record of one answered request: an error status, or its stream read to the end."""
    if response.status_code != 200:
        message = _error_message(await response.aread())
        return RequestRecord(spec.request_id, sent_s, spec.input_len, (), None, f"HTTP {response.status_code}: {message}")
    times: list[float] = []
    usage_tokens: int | None = None
    done = False
    try:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            now = clock()
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error in stream: {_error_message(data.encode())}")
            times.extend([now] * _chunk_tokens(chunk, chat))
            usage = chunk.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                usage_tokens = usage["completion_tokens"]
        if not done:
            raise RuntimeError("stream ended without [DONE]")
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise _StreamFailed(f"{type(exc).__name__}: {exc}", tuple(times)) from exc
    finish_s = clock()
    if usage_tokens is not None and times:
        # Usage is the server's own count: chunks without logprobs or text may hide tokens.
        if usage_tokens > len(times):
            times.extend([times[-1]] * (usage_tokens - len(times)))
        del times[usage_tokens:]
    return RequestRecord(spec.request_id, sent_s, spec.input_len, tuple(times), finish_s)


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]   # in the workload's order
    duration_s: float              # first send to last finish


async def run_workload(target: Target, model: str, requests: Sequence[RequestSpec],
                       prompts: Sequence[list[int] | str], *, concurrency: int | None = None,
                       on_done: Callable[[RequestRecord], None] | None = None,
                       transport: httpx.AsyncBaseTransport | None = None) -> RunResult:
    """Send ``requests`` on schedule (at ``arrival_s``; with ``concurrency`` at most that many in
    flight, in order) and return every record. A session's turn waits for its previous turn.
    ``transport`` replaces the network (tests)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    semaphore = asyncio.Semaphore(concurrency) if concurrency else None
    previous_turn: dict[int, asyncio.Event] = {}
    turn_waits: list[asyncio.Event | None] = []
    turn_done: list[asyncio.Event | None] = []
    for spec in requests:
        if spec.session_id is None:
            turn_waits.append(None)
            turn_done.append(None)
        else:
            event = asyncio.Event()
            turn_waits.append(previous_turn.get(spec.session_id))
            turn_done.append(event)
            previous_turn[spec.session_id] = event
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    async with httpx.AsyncClient(base_url=target.base_url, headers=target.headers, limits=limits,
                                 transport=transport) as http:
        async def one(index: int) -> RequestRecord:
            spec = requests[index]
            delay = spec.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            wait = turn_waits[index]
            if wait is not None:
                await wait.wait()
            try:
                if semaphore is None:
                    record = await send_one(http, target, model, spec, prompts[index], clock)
                else:
                    async with semaphore:
                        record = await send_one(http, target, model, spec, prompts[index], clock)
            finally:
                done = turn_done[index]
                if done is not None:
                    done.set()
            if on_done is not None:
                on_done(record)
            return record

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i)) for i in range(len(requests))]
    records = [t.result() for t in tasks]
    ends = [r.finish_s for r in records if r.finish_s is not None]
    ends += [r.token_times_s[-1] for r in records if r.token_times_s]
    first = min((r.arrival_s for r in records), default=0.0)
    duration = (max(ends) if ends else clock()) - first
    return RunResult(records, max(duration, 1e-9))
