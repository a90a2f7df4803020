"""What every Tandem process shares about a request, in plain Python (no torch, no gRPC, no I/O).

- the sampling parameters, their limits and their defaults (``SAMPLING_LIMITS`` is the one place
  a range is written: ``SamplingParams`` validates with it, the router's OpenAI parser reads it
  and the OpenAPI schema is generated from it);
- ``SamplingDefaults``, what a request that leaves a value out gets (the model's
  ``generation_config.json`` and the server's overrides);
- the request-shape limits the router enforces (stop strings, messages, request ids);
- ``FinishReason``, the closed set of ways a generation ends;
- ``TandemError``, the base of Tandem's errors, and ``InvalidRequestError`` for bad input;
- ``RequestError``, the one error a request fails with: a ``Status`` (which maps to a gRPC status
  code and an HTTP status), a message, and the field at fault;
- ``LoadReport``, what each service publishes about its load on the board every scheduler reads.

The router process imports this and never the engine's torch modules; services convert it to
and from protos in ``tandem.rpc.convert``.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Final, Literal, Protocol, get_args


class TandemError(Exception):
    """Base of every error Tandem raises on purpose."""


class InvalidRequestError(TandemError):
    """A request is malformed: bad sampling parameters, a prompt longer than the context, ..."""


# --- limits ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """A closed interval ``[lo, hi]``, open at ``lo`` when ``lo_open``; ``hi`` None: unbounded."""

    lo: float
    hi: float | None
    lo_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        return above and (self.hi is None or value <= self.hi)

    def describe(self) -> str:
        left = "(" if self.lo_open else "["
        right = "inf)" if self.hi is None else f"{self.hi:g}]"
        return f"in {left}{self.lo:g}, {right}"


# Temperatures below this are greedy: dividing fp32 logits by a smaller number overflows to inf
# and the softmax turns into NaN, and the distribution is a point mass anyway.
GREEDY_TEMPERATURE_EPS: Final = 1e-5
MAX_NUM_LOGPROBS: Final = 20
# More would only cost memory and time per step; no tokenizer needs this many stop tokens.
MAX_STOP_TOKEN_IDS: Final = 256
# OpenAI's logit_bias: each bias in [-100, 100] is added to its token's logit before sampling (-100
# all but bans a token, +100 all but forces it). The count bound keeps one step's scatter cheap.
MAX_LOGIT_BIAS_TOKENS: Final = 1024
# A structured output's grammar (llguidance's JSON or Lark text) longer than this is refused: a
# schema of that size is a mistake, and each process a request reaches compiles it.
MAX_GRAMMAR_CHARS: Final = 1 << 17
LOGIT_BIAS_LIMIT: Final = 100.0
MIN_SEED: Final = -(2**63)  # torch.Generator.manual_seed accepts [-2**63, 2**64 - 1]
MAX_SEED: Final = 2**64 - 1
MAX_TOP_K: Final = 2**31 - 1  # the proto's int32
# What a request that names no max_tokens gets, as in OpenAI's completions and vLLM.
DEFAULT_MAX_TOKENS: Final = 16

# The ranges of the real-valued and bounded integer sampling parameters. OpenAI's ranges where it
# documents one (temperature, penalties); repetition_penalty as vLLM's UI bounds it.
SAMPLING_LIMITS: Final[dict[str, Range]] = {
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "min_p": Range(0.0, 1.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 2.0, lo_open=True),
    "top_k": Range(-1, MAX_TOP_K),
    "logprobs": Range(0, MAX_NUM_LOGPROBS),
}

# Stop strings are matched against every delta; bounds on their number and length keep that cheap.
MAX_STOP_STRINGS: Final = 16
MAX_STOP_STRING_CHARS: Final = 1024
MAX_MESSAGES: Final = 1024
MAX_REQUEST_ID_LENGTH: Final = 256


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but `top_k=True` is a client bug, not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(float(value))  # type: ignore[arg-type]


# --- sampling parameters -----------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens; immutable and validated on construction.

    Every field is a plain Python value, so the object pickles and round-trips through
    ``to_dict()`` / ``from_dict()`` (JSON-safe) when it crosses a process boundary.
    Invalid values raise ``InvalidRequestError`` whose message names the field and its range
    (``SAMPLING_LIMITS``).
    """

    temperature: float = 1.0  # below GREEDY_TEMPERATURE_EPS means greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose mass is >= top_p
    top_k: int = -1  # -1 or 0 = off, else keep the k most likely tokens
    min_p: float = 0.0  # drop tokens with prob < min_p * (prob of the likeliest token)
    seed: int | None = None  # per-request generator; None = shared default generator
    presence_penalty: float = 0.0  # subtracted once from every token already output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # HF style over prompt + output, 1 = off
    max_tokens: int = DEFAULT_MAX_TOKENS  # >= 1; the request finishes with "length" after this many
    min_tokens: int = 0  # [0, max_tokens]; stop tokens are masked out until this many are output
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that finish the request with "stop"
    ignore_eos: bool = False  # True: eos neither stops the request nor is masked by min_tokens
    logprobs: int | None = None  # top logprobs to return per token; None = no logprobs
    # (token id, bias) pairs in token order, each bias added to that token's logit before the
    # penalties (OpenAI's logit_bias; the raw logprobs returned do not see it)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # structured output: an llguidance grammar (``tandem.engine.grammar.grammar_for``) every token
    # must keep to; "" = none
    grammar: str = ""

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            limit = SAMPLING_LIMITS[name]
            self._check_real(name, limit.__contains__, limit.describe())
        top_k = SAMPLING_LIMITS["top_k"]
        self._check_int("top_k", top_k.__contains__, "-1 or 0 (off) or >= 1")
        self._check_int("max_tokens", lambda v: v >= 1, ">= 1")
        self._check_int("min_tokens", lambda v: 0 <= v <= self.max_tokens,
                        f"in [0, max_tokens={self.max_tokens}]")
        if self.seed is not None:
            self._check_int("seed", lambda v: MIN_SEED <= v <= MAX_SEED,
                            f"None or an int in [{MIN_SEED}, {MAX_SEED}]")
        if self.logprobs is not None:
            self._check_int("logprobs", SAMPLING_LIMITS["logprobs"].__contains__,
                            f"None or an int in [0, {MAX_NUM_LOGPROBS}]")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        # A JSON round trip turns the tuple into a list; accept any sequence, store a tuple so the
        # params stay hashable and immutable.
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not isinstance(stop, (tuple, list)):
            raise InvalidRequestError(
                f"stop_token_ids must be a list of token ids >= 0, got {stop!r}")
        if len(stop) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} token ids, got {len(stop)}")
        bad = [t for t in stop if not (_is_int(t) and t >= 0)]
        if bad:
            raise InvalidRequestError(f"stop_token_ids must be a list of token ids >= 0, got {bad[0]!r} in it")
        object.__setattr__(self, "stop_token_ids", tuple(stop))
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        if not isinstance(self.grammar, str):
            raise InvalidRequestError(f"grammar must be a string, got {type(self.grammar).__name__}")
        if len(self.grammar) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"grammar has {len(self.grammar)} characters; at most {MAX_GRAMMAR_CHARS}")

    def _check_real(self, name: str, ok: Callable[[float], bool], allowed: str) -> None:
        value = getattr(self, name)
        if not _is_real(value) or not ok(float(value)):
            raise InvalidRequestError(f"{name} must be a finite number {allowed}, got {value!r}")
        object.__setattr__(self, name, float(value))

    def _check_int(self, name: str, ok: Callable[[int], bool], allowed: str) -> None:
        value = getattr(self, name)
        if not _is_int(value) or not ok(value):
            raise InvalidRequestError(f"{name} must be an int {allowed}, got {value!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax of its penalized logits every step."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (``stop_token_ids`` as a list) that ``from_dict`` turns back."""
        out = asdict(self)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a dict; missing keys take their defaults, unknown keys are refused."""
        if not isinstance(data, dict):
            raise InvalidRequestError(f"sampling params must be a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(map(str, unknown))}")
        return cls(**data)


def _checked_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) tuples: from pairs (a JSON round trip gives
    lists) or a {token id: bias} mapping; ids >= 0 and each once, biases finite in
    [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]. Ids past the vocabulary are the caller's to check
    (it knows the model)."""
    items = list(value.items()) if isinstance(value, dict) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, (tuple, list)):
        raise InvalidRequestError(f"logit_bias must map token ids to biases, got {value!r}")
    if len(items) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(items)}")
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InvalidRequestError(f"logit_bias entries must be (token id, bias) pairs, got {item!r}")
        token_id, bias = item
        if not _is_int(token_id) or token_id < 0:
            raise InvalidRequestError(f"logit_bias keys must be token ids >= 0, got {token_id!r}")
        if not _is_real(bias) or abs(float(bias)) > LOGIT_BIAS_LIMIT:
            raise InvalidRequestError(f"logit_bias values must be finite numbers in [-{LOGIT_BIAS_LIMIT:g}, "
                                      f"{LOGIT_BIAS_LIMIT:g}], got {bias!r} for token {token_id}")
        if token_id in pairs:
            raise InvalidRequestError(f"logit_bias names token {token_id} twice")
        pairs[token_id] = float(bias)
    return tuple(sorted(pairs.items()))


# The generation_config.json keys that are sampling defaults (vLLM reads the same ones), and the
# SamplingParams field each one sets.
GENERATION_CONFIG_KEYS: Final[dict[str, str]] = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling value out gets, as vLLM does it: the model's
    ``generation_config.json`` values, then a server's overrides, over the built-in defaults.

    ``max_tokens`` None: the API's own default (16 for completions, the context for chat).
    Values out of their SAMPLING_LIMITS range raise InvalidRequestError on construction.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        # SamplingParams validates every value and its message names the field.
        SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                       repetition_penalty=self.repetition_penalty, max_tokens=self.max_tokens or 1)

    @classmethod
    def from_generation_config(cls, config: dict[str, Any], overrides: dict[str, Any] | None = None) -> SamplingDefaults:
        """The defaults from a ``generation_config.json`` object, then ``overrides`` (the same
        keys). Other keys (eos ids, ``do_sample``...) are ignored, unknown override keys refused."""
        unknown = sorted(set(overrides or {}) - set(GENERATION_CONFIG_KEYS))
        if unknown:
            raise InvalidRequestError(f"unknown generation config key(s) {', '.join(unknown)}; "
                                      f"known: {', '.join(GENERATION_CONFIG_KEYS)}")
        merged = {**config, **(overrides or {})}
        values = {field: merged[key] for key, field in GENERATION_CONFIG_KEYS.items() if merged.get(key) is not None}
        return cls(**values)

    def changed(self) -> dict[str, Any]:
        """The values that differ from the built-in defaults (for the startup log)."""
        base = SamplingDefaults()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)}


# --- finish reasons ----------------------------------------------------------------------------


class FinishReason(str, enum.Enum):
    """How a generation ended; the value is OpenAI's ``finish_reason`` string."""

    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the context is full
    ABORT = "abort"  # cancelled
    ERROR = "error"  # the service failed it


# --- errors ------------------------------------------------------------------------------------


class Status(enum.Enum):
    """Why a request failed; each member is ``(gRPC status name, HTTP status, OpenAI error type)``."""

    INVALID_ARGUMENT = ("INVALID_ARGUMENT", 400, "invalid_request_error")
    UNAUTHENTICATED = ("UNAUTHENTICATED", 401, "authentication_error")
    NOT_FOUND = ("NOT_FOUND", 404, "invalid_request_error")
    ALREADY_EXISTS = ("ALREADY_EXISTS", 409, "invalid_request_error")
    RESOURCE_EXHAUSTED = ("RESOURCE_EXHAUSTED", 429, "rate_limit_error")
    CANCELLED = ("CANCELLED", 499, "cancelled")
    INTERNAL = ("INTERNAL", 500, "internal_error")
    UNAVAILABLE = ("UNAVAILABLE", 503, "service_unavailable")
    DEADLINE_EXCEEDED = ("DEADLINE_EXCEEDED", 504, "timeout")

    @property
    def grpc_name(self) -> str:
        """The ``grpc.StatusCode`` member's name."""
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]

    @property
    def openai_type(self) -> str:
        return self.value[2]


class RequestError(TandemError):
    """A request failed with ``status``; ``message`` is for the client, ``field`` names the request
    field at fault (if one is), ``retry_after_s`` is admission's hint for RESOURCE_EXHAUSTED.
    Raised by the router's core; each adapter turns it into its transport's error."""

    def __init__(self, status: Status, message: str, retry_after_s: float | None = None,
                 field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        self.field = field


# --- load reports ------------------------------------------------------------------------------

Role = Literal["agent", "prefill", "decode", "router"]
ROLES: Final[frozenset[str]] = frozenset(get_args(Role))


class PartitionView(Protocol):
    """What a load report reads of a partition (``tandem.rpc.v1.common_pb2.Partition``)."""

    @property
    def epoch(self) -> int: ...

    @property
    def prefill_units(self) -> Sequence[int]: ...

    @property
    def decode_units(self) -> Sequence[int]: ...

    @property
    def aggregated(self) -> bool: ...


@dataclass(frozen=True)
class ModelKVLoad:
    """The agent's KV figures for one model's admission, in that model's blocks of ``block_size``
    tokens: ``free_blocks`` it could take now (with a slab pool, its own slabs' free blocks and
    every free slab's), ``held_back_blocks`` that preempted requests refused blocks wait for (they
    go ahead of new prompts; with a slab pool, the other models' holds on free slabs as well),
    and ``prompt_blocks_granted``, the blocks given to its new prompts since the agent started
    (its rate is how fast prompts get blocks when the pool is full). ``granted_prompts``: the
    ids of the new prompts given blocks lately that still hold them (the most recent first),
    whose blocks ``free_blocks`` already leaves out: a router counts them no more among the
    prompts ahead that still need blocks."""

    block_size: int
    free_blocks: int = 0
    held_back_blocks: int = 0
    prompt_blocks_granted: int = 0
    granted_prompts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "granted_prompts", tuple(self.granted_prompts))  # a list from JSON
        for name in ("block_size", "free_blocks", "held_back_blocks", "prompt_blocks_granted"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelKVLoad.{name} must be >= 0, got {getattr(self, name)}")


_MODEL_KV_FIELDS = frozenset(f.name for f in fields(ModelKVLoad))


@dataclass(frozen=True)
class LoadReport:
    """One service's live load, published every scheduling tick and read by every scheduler.

    ``prefill_units`` / ``decode_units`` are the unit ids (CPU cores or SMs) each phase holds
    under partition ``partition_epoch``. ``predicted_ttft_ms`` is prefill's estimate of how long
    its queue takes to drain; ``last_step_ms`` is decode's measured time of its last step.
    ``num_dropped`` and ``num_preemptions`` count, since this service process started, the
    requests it dropped as unable to meet their deadline (prefill's early drop) and its
    preemptions (prefill: a batch paused for a shorter prompt; decode: a request whose KV blocks
    were freed when the pool was full). A count a role does not keep is 0. ``num_given_back``
    (prefill) counts batches handed to decode's chunks at their first layer-group boundary, the
    cell having gone aggregated once they were launched.

    ``model`` is the served name of the model a prefill or decode service computes ("" for the
    agent, or a writer that predates it: the cell's first model). ``kv_used_by_model`` (the
    agent's) is the fraction of the cell's KV bytes each model's held blocks take; the fractions
    sum to the cell's use, whatever the split (one slab pool or a fixed share per model).
    ``aggregated``: the partition in force runs prompts in decode's steps, on decode's units.
    The agent's KV figures for admission, in its first model's blocks of ``kv_block_size``
    tokens: ``kv_held_back_blocks``, what preempted requests refused blocks wait for (they go
    ahead of new prompts), and ``kv_prompt_blocks_granted``, the blocks given to new prompts
    since it started (its rate is how fast prompts get blocks when the pool is full).
    ``kv_by_model`` (the agent's) has those figures for every model of the cell, by served name
    (``ModelKVLoad``; JSON objects are read back into it). ``prompt_rate_beside`` (the agent's):
    in aggregated mode with streams decoding, the prompt tokens per second a new prompt would
    get in hybrid steps beside them at the chunked budget's TBT bound (0.0: no chunk fits, prompts
    wait for streams to end); None otherwise, or from an agent that predates it.
    """

    service_id: str
    cell_id: str
    role: Role
    partition_epoch: int
    prefill_units: list[int]
    decode_units: list[int]
    kv_total_blocks: int
    updated_unix_ns: int
    kv_free_blocks: int = 0
    num_queued_requests: int = 0
    num_queued_tokens: int = 0
    num_running: int = 0
    batch_size: int = 0
    predicted_ttft_ms: float = 0.0
    last_step_ms: float = 0.0
    num_dropped: int = 0
    num_preemptions: int = 0
    num_given_back: int = 0
    model: str = ""
    kv_used_by_model: dict[str, float] = field(default_factory=dict)
    aggregated: bool = False
    kv_block_size: int = 0
    kv_held_back_blocks: int = 0
    kv_prompt_blocks_granted: int = 0
    kv_by_model: dict[str, ModelKVLoad] = field(default_factory=dict)
    prompt_rate_beside: float | None = None

    @classmethod
    def now(cls, service_id: str, cell_id: str, role: Role, partition: PartitionView, kv_total_blocks: int,
            **counts: Any) -> LoadReport:
        """A report stamped now under ``partition``; ``counts`` are the other fields by name."""
        return cls(service_id=service_id, cell_id=cell_id, role=role, partition_epoch=partition.epoch,
                   prefill_units=list(partition.prefill_units), decode_units=list(partition.decode_units),
                   kv_total_blocks=kv_total_blocks, updated_unix_ns=time.time_ns(),
                   aggregated=partition.aggregated, **counts)

    def __post_init__(self) -> None:
        if not self.service_id:
            raise ValueError("LoadReport.service_id must be non-empty")
        if self.role not in ROLES:
            raise ValueError(f"LoadReport.role must be one of {sorted(ROLES)}, got {self.role!r}")
        for name in ("num_queued_requests", "num_queued_tokens", "num_running", "batch_size",
                     "partition_epoch", "kv_free_blocks", "kv_total_blocks", "updated_unix_ns", "num_dropped",
                     "num_preemptions", "num_given_back", "kv_block_size", "kv_held_back_blocks",
                     "kv_prompt_blocks_granted"):
            if getattr(self, name) < 0:
                raise ValueError(f"LoadReport.{name} must be >= 0, got {getattr(self, name)}")
        # Read back from JSON, each model's figures are a plain object (keys a newer agent adds
        # are left out, as from_json_fields does at the top level).
        object.__setattr__(self, "kv_by_model", {
            name: kv if isinstance(kv, ModelKVLoad) else ModelKVLoad(**{k: v for k, v in kv.items()
                                                                        if k in _MODEL_KV_FIELDS})
            for name, kv in self.kv_by_model.items()})
        for name, used in self.kv_used_by_model.items():
            if not 0.0 <= used <= 1.0:
                raise ValueError(f"LoadReport.kv_used_by_model[{name!r}] must be in [0, 1], got {used}")
        if self.prompt_rate_beside is not None and not 0.0 <= self.prompt_rate_beside < math.inf:
            raise ValueError(f"LoadReport.prompt_rate_beside must be None or a rate >= 0, got {self.prompt_rate_beside}")
        if self.kv_free_blocks > self.kv_total_blocks:
            raise ValueError(f"LoadReport.kv_free_blocks ({self.kv_free_blocks}) > kv_total_blocks "
                             f"({self.kv_total_blocks})")
