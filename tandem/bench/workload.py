"""Synthetic and trace workloads: what to send and when.

A workload is a list of ``RequestSpec`` (arrival offset, prompt and output lengths), built
deterministically from a ``WorkloadSpec`` and its seed. Lengths and arrivals come from two
independent random streams of the same seed, so one seed gives the same lengths at every rate of
a sweep and for every system being compared.

Length models are lognormal fits of log-token counts as published for each trace; sampled
lengths are rounded and clipped to ``[1, max_*_len]``. Plain Python + numpy; the only I/O is
reading a trace file.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NAMES = ("azure-code", "azure-conv", "mooncake-conv", "sharegpt", "fixed", "multiturn")
ARRIVALS = ("poisson", "gamma", "concurrency", "trace")
# The length model of a multi-turn session's new user text and answers.
MULTITURN_LENGTHS = "sharegpt"


@dataclass(frozen=True)
class LognormalLengths:
    """ln(tokens) ~ Normal(mu, sigma) for prompts and for outputs, as published for one trace.

    ``mean_input`` / ``mean_output`` are the trace's published mean lengths (for reference only:
    the real traces are not exactly lognormal, so they differ from exp(mu + sigma^2 / 2)).
    """

    input_mu: float
    input_sigma: float
    output_mu: float
    output_sigma: float
    mean_input: float | None = None
    mean_output: float | None = None

    def sample(self, rng: np.random.Generator, num: int, max_input_len: int,
               max_output_len: int) -> tuple[list[int], list[int]]:
        """``num`` (input, output) lengths, each rounded and clipped to [1, max]."""
        inputs = _lognormal_lengths(rng, self.input_mu, self.input_sigma, num, max_input_len)
        outputs = _lognormal_lengths(rng, self.output_mu, self.output_sigma, num, max_output_len)
        return inputs, outputs


def _lognormal_lengths(rng: np.random.Generator, mu: float, sigma: float, num: int, max_len: int) -> list[int]:
    raw = np.rint(np.exp(rng.normal(mu, sigma, size=num)))
    return [int(x) for x in np.clip(raw, 1, max_len)]


LENGTH_MODELS: dict[str, LognormalLengths] = {
    # Azure LLM inference trace 2023, code and conversation (Splitwise).
    "azure-code": LognormalLengths(7.00, 1.36, 2.79, 0.85, mean_input=2048, mean_output=28),
    "azure-conv": LognormalLengths(6.63, 0.99, 5.02, 0.86, mean_input=1155, mean_output=211),
    # Mooncake's conversation trace (Kimi).
    "mooncake-conv": LognormalLengths(8.74, 1.20, 5.34, 1.36, mean_input=12035, mean_output=343),
    # ShareGPT conversations.
    "sharegpt": LognormalLengths(3.93, 1.64, 5.28, 0.98),
}


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload."""

    request_id: str            # "r000042" style, unique in a workload
    arrival_s: float           # offset from the start of the run; 0.0 for every request with fixed concurrency
    input_len: int             # prompt tokens (>= 1)
    output_len: int            # tokens to generate (>= 1); sent as max_tokens with ignore_eos
    session_id: int | None = None   # multi-turn sessions: same id = same conversation
    shared_prefix_len: int = 0      # leading prompt tokens identical to the previous turn of the session
    prompt_text: str | None = None  # a dataset's real prompt (``input_len`` is its length), sent as is


@dataclass(frozen=True)
class WorkloadSpec:
    """What to build; validated on construction.

    With ``arrival="trace"`` the lengths and timestamps come from ``trace_path`` (the first
    ``num_requests`` rows; 0 or fewer means all); ``rate_rps``, when given, rescales the trace's
    timestamps to that mean rate. Multi-turn workloads have ``ceil(num_requests / num_turns)``
    sessions, each turn's prompt being the previous prompt + the previous answer + new user text;
    a session ends early when its next prompt would exceed ``max_input_len``, and further
    sessions are started until ``num_requests`` is reached.
    """

    name: str                  # one of NAMES
    num_requests: int
    rate_rps: float | None = None     # None with arrival="concurrency"; math.inf: all at once
    arrival: str = "poisson"          # one of ARRIVALS
    cv: float = 1.0                   # gamma coefficient of variation (cv=1 is Poisson)
    concurrency: int | None = None    # for arrival="concurrency"
    trace_path: str | None = None     # CSV/JSONL with timestamp_s,input_len,output_len
    max_input_len: int = 8192
    max_output_len: int = 2048
    input_len: int | None = None      # for name="fixed"
    output_len: int | None = None     # for name="fixed"
    num_turns: int = 4                # for name="multiturn"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.arrival != "trace" and self.name not in NAMES:
            raise ValueError(f"workload must be one of {NAMES}, got {self.name!r}")
        if self.arrival != "trace" and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.arrival in ("poisson", "gamma") and (self.rate_rps is None or not self.rate_rps > 0):
            raise ValueError(f"arrival={self.arrival} needs rate_rps > 0, got {self.rate_rps}")
        if self.arrival == "trace" and self.rate_rps is not None and not (0 < self.rate_rps < math.inf):
            raise ValueError(f"a trace's rate_rps must be finite and > 0, got {self.rate_rps}")
        if self.arrival == "gamma" and not self.cv > 0:
            raise ValueError(f"cv must be > 0, got {self.cv}")
        if self.arrival == "concurrency" and (self.concurrency is None or self.concurrency < 1):
            raise ValueError(f"arrival=concurrency needs concurrency >= 1, got {self.concurrency}")
        if self.arrival == "trace" and not self.trace_path:
            raise ValueError("arrival=trace needs trace_path")
        if self.max_input_len < 1 or self.max_output_len < 1:
            raise ValueError("max_input_len and max_output_len must be >= 1")
        if self.name == "fixed" and (self.input_len is None or self.output_len is None
                                     or self.input_len < 1 or self.output_len < 1):
            raise ValueError("workload fixed needs input_len >= 1 and output_len >= 1")
        if self.name == "multiturn" and self.num_turns < 1:
            raise ValueError(f"num_turns must be >= 1, got {self.num_turns}")


def build_requests(spec: WorkloadSpec) -> list[RequestSpec]:
    """The workload's requests, sorted by ``arrival_s`` (ties keep generation order); the same
    spec always gives the same list."""
    if spec.arrival == "trace":
        assert spec.trace_path is not None
        rows = read_trace(spec.trace_path)
        if spec.num_requests > 0:
            rows = rows[:spec.num_requests]
        return _from_trace(rows, spec)
    length_seed, arrival_seed = np.random.SeedSequence(spec.seed).spawn(2)
    length_rng = np.random.default_rng(length_seed)
    if spec.name == "multiturn":
        shapes = _multiturn(length_rng, spec)
    elif spec.name == "fixed":
        assert spec.input_len is not None and spec.output_len is not None
        shape = (min(spec.input_len, spec.max_input_len), min(spec.output_len, spec.max_output_len), None, 0)
        shapes = [shape] * spec.num_requests
    else:
        inputs, outputs = LENGTH_MODELS[spec.name].sample(length_rng, spec.num_requests, spec.max_input_len,
                                                          spec.max_output_len)
        shapes = [(i, o, None, 0) for i, o in zip(inputs, outputs)]
    arrivals = arrival_times(spec, len(shapes), np.random.default_rng(arrival_seed))
    return [RequestSpec(f"r{k:06d}", t, i, o, session, prefix)
            for k, (t, (i, o, session, prefix)) in enumerate(zip(arrivals, shapes))]


def dataset_requests(spec: WorkloadSpec, conversations: Sequence[tuple[str, int, int]]) -> list[RequestSpec]:
    """One request per (prompt text, input_len, output_len) of a dataset (``tandem.bench.dataset``),
    arriving as ``spec`` says (its lengths ignored; a trace's arrivals are not for a dataset)."""
    if spec.arrival == "trace":
        raise ValueError("a dataset brings its own prompts: give --rate or --concurrency, not --trace")
    _, arrival_seed = np.random.SeedSequence(spec.seed).spawn(2)
    arrivals = arrival_times(spec, len(conversations), np.random.default_rng(arrival_seed))
    return [RequestSpec(f"r{k:06d}", t, input_len, output_len, prompt_text=text)
            for k, (t, (text, input_len, output_len)) in enumerate(zip(arrivals, conversations))]


def arrival_times(spec: WorkloadSpec, num: int, rng: np.random.Generator) -> list[float]:
    """``num`` non-decreasing arrival offsets (seconds) for a poisson, gamma or concurrency spec;
    the first request arrives at 0."""
    if spec.arrival == "concurrency" or spec.rate_rps == math.inf:
        return [0.0] * num
    assert spec.rate_rps is not None
    if spec.arrival == "poisson":
        gaps = rng.exponential(1.0 / spec.rate_rps, size=num)
    elif spec.arrival == "gamma":
        # shape k, scale theta: mean k*theta = 1/rate, CV 1/sqrt(k) = cv.
        shape = 1.0 / (spec.cv * spec.cv)
        gaps = rng.gamma(shape, 1.0 / (spec.rate_rps * shape), size=num)
    else:
        raise ValueError(f"arrival_times does not build {spec.arrival!r} arrivals")
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


_Shape = tuple[int, int, "int | None", int]  # input_len, output_len, session_id, shared_prefix_len


def _multiturn(rng: np.random.Generator, spec: WorkloadSpec) -> list[_Shape]:
    """Turn-major order (every session's first turn, then every second turn, ...), so a session's
    next turn comes about one session-count of arrivals after its previous one."""
    model = LENGTH_MODELS[MULTITURN_LENGTHS]
    sessions: list[list[_Shape]] = []
    num_built = 0
    num_sessions = math.ceil(spec.num_requests / spec.num_turns)
    while num_built < spec.num_requests:
        session_id = len(sessions)
        new_texts, answers = model.sample(rng, spec.num_turns, spec.max_input_len, spec.max_output_len)
        turns: list[_Shape] = []
        prefix = 0
        for new_text, answer in zip(new_texts, answers):
            if prefix + new_text > spec.max_input_len or num_built == spec.num_requests:
                break
            turns.append((prefix + new_text, answer, session_id, prefix))
            num_built += 1
            prefix += new_text + answer
        sessions.append(turns)
        if len(sessions) >= num_sessions and num_built < spec.num_requests:
            num_sessions += 1  # a session ended early: start another
    out: list[_Shape] = []
    for turn in range(max(len(s) for s in sessions)):
        out.extend(s[turn] for s in sessions if turn < len(s))
    return out


@dataclass(frozen=True)
class TraceRow:
    timestamp_s: float
    input_len: int
    output_len: int


def read_trace(path: str | Path) -> list[TraceRow]:
    """Rows of a trace, sorted by timestamp: JSONL (one object per line) or CSV (with a header
    naming the columns, or three bare columns in the order timestamp_s, input_len, output_len).
    Also accepted as column names: ``timestamp``, ``input_tokens``/``output_tokens`` and Azure's
    ``ContextTokens``/``GeneratedTokens`` (with a numeric ``TIMESTAMP`` in seconds)."""
    text = Path(path).read_text()
    rows: list[TraceRow] = []
    if str(path).endswith((".jsonl", ".json")):
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                rows.append(_row(json.loads(line), f"{path}:{number}"))
    else:
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            return []
        first = next(csv.reader([lines[0]]))
        if _is_number(first[0]):
            for number, cells in enumerate(csv.reader(lines), 1):
                rows.append(_row(dict(zip(("timestamp_s", "input_len", "output_len"), cells)), f"{path}:{number}"))
        else:
            for number, record in enumerate(csv.DictReader(lines), 2):
                rows.append(_row(record, f"{path}:{number}"))
    rows.sort(key=lambda r: r.timestamp_s)
    return rows


_ALIASES = {
    "timestamp_s": ("timestamp_s", "timestamp", "TIMESTAMP", "arrival_s"),
    "input_len": ("input_len", "input_tokens", "ContextTokens", "prompt_tokens"),
    "output_len": ("output_len", "output_tokens", "GeneratedTokens", "completion_tokens"),
}


def _row(record: dict[str, object], where: str) -> TraceRow:
    values: dict[str, object] = {}
    for field, names in _ALIASES.items():
        found = next((record[n] for n in names if n in record and record[n] not in (None, "")), None)
        if found is None:
            raise ValueError(f"{where}: no {field} column (accepted: {', '.join(names)})")
        values[field] = found
    try:
        row = TraceRow(float(str(values["timestamp_s"])), int(float(str(values["input_len"]))),
                       int(float(str(values["output_len"]))))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if row.input_len < 1 or row.output_len < 1 or not math.isfinite(row.timestamp_s):
        raise ValueError(f"{where}: lengths must be >= 1 and the timestamp finite, got {row}")
    return row


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _from_trace(rows: list[TraceRow], spec: WorkloadSpec) -> list[RequestSpec]:
    if not rows:
        return []
    start = rows[0].timestamp_s
    offsets = [r.timestamp_s - start for r in rows]
    if spec.rate_rps is not None and len(rows) > 1 and offsets[-1] > 0:
        # Keep the trace's shape, change its mean rate: (n - 1) gaps over the span.
        scale = (len(rows) - 1) / spec.rate_rps / offsets[-1]
        offsets = [t * scale for t in offsets]
    return [RequestSpec(f"r{k:06d}", t, min(r.input_len, spec.max_input_len), min(r.output_len, spec.max_output_len))
            for k, (t, r) in enumerate(zip(offsets, rows))]
