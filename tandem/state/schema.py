"""The Redis schema every Tandem process shares: key layout, record types and their encodings.

Key layout (``N`` is the namespace, ``"tandem"`` unless a test or a second deployment picks
another; ids come last in every key and each kind has its own word, so no id can collide with
another kind's key)::

    key                  type    holds                                         expires
    N:svc:{service_id}   string  JSON ServiceInfo                              registry TTL (5 s)
    N:index:svc          set     ids that may be registered (pruned on read)   never
    N:req:{request_id}   hash    RequestRecord minus outputs (fields below)    60 s after done/failed
    N:out:{request_id}   string  output ids, packed uint32 LE; one APPEND      with its N:req key
                                 per decode step
    N:active:{cell_id}   set     ids of the cell's requests in prefill/decode  never
    N:load:{service_id}  string  JSON LoadReport                               board TTL (3 s)
    N:index:load         set     ids that may have a report (pruned on read)   never

``N:req:{request_id}`` fields: ``request_id``, ``cell_id``, ``router_id``, ``state``,
``decode_service_id`` (UTF-8; empty = none), ``prompt_token_ids`` and ``block_ids`` (packed uint32
little-endian), ``num_computed_tokens``, ``arrival_unix_ns``, ``updated_unix_ns`` (decimal),
``sampling`` (JSON object), ``generator_state`` (raw bytes, may be empty).

Writes that touch more than one key run as one Lua script or one MULTI/EXEC, so readers never see
half of an update. The scripts build some key names from stored fields (the cell's active set),
which standalone Redis allows and Redis Cluster does not: Tandem targets a single Redis.

Clients must be created with ``decode_responses=False`` (redis-py's default): token lists and
generator state are binary.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

import redis.asyncio as aredis

from tandem.engine.errors import TandemError
from tandem.protocol import ROLES, LoadReport, Role  # noqa: F401  (part of the schema)

DEFAULT_NAMESPACE: Final = "tandem"


RequestState = Literal["prefill", "decode", "done", "failed"]
ACTIVE_STATES: Final[frozenset[str]] = frozenset({"prefill", "decode"})
FINISHED_STATES: Final[frozenset[str]] = frozenset({"done", "failed"})

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# 'I' is 4 bytes on every platform CPython supports today; fall back to 'L' where it is not.
_U32_CODE: Final = "I" if array("I").itemsize == 4 else "L"
assert array(_U32_CODE).itemsize == 4


class StateError(TandemError):
    """A shared-state operation was refused (duplicate request id, misconfigured client, ...)."""


# --------------------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class Keys:
    """Builds every key of one namespace; see the module docstring for what each holds."""

    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        # ':' would let one namespace's keys alias another's ("a:req" + "x" vs "a" + "req:x").
        if not _NAMESPACE_RE.match(self.namespace):
            raise ValueError(f"namespace must match {_NAMESPACE_RE.pattern}, got {self.namespace!r}")

    def service(self, service_id: str) -> str:
        return f"{self.namespace}:svc:{service_id}"

    @property
    def service_index(self) -> str:
        return f"{self.namespace}:index:svc"

    def request(self, request_id: str) -> str:
        return f"{self.namespace}:req:{request_id}"

    def outputs(self, request_id: str) -> str:
        return f"{self.namespace}:out:{request_id}"

    def active(self, cell_id: str) -> str:
        return f"{self.namespace}:active:{cell_id}"

    def load(self, service_id: str) -> str:
        return f"{self.namespace}:load:{service_id}"

    @property
    def load_index(self) -> str:
        return f"{self.namespace}:index:load"


def check_client(client: aredis.Redis) -> None:
    """Refuse a client that decodes replies to ``str``: the schema stores binary fields."""
    if client.connection_pool.connection_kwargs.get("decode_responses"):
        raise StateError("the Redis client must be created with decode_responses=False")


def ttl_ms(ttl_s: float, what: str) -> int:
    """``ttl_s`` as whole milliseconds (at least 1); raises ValueError unless it is > 0."""
    if not ttl_s > 0:
        raise ValueError(f"{what} must be > 0 seconds, got {ttl_s}")
    return max(1, round(ttl_s * 1000))


# ----------------------------------------------------------------------------------- codecs


def pack_u32(values: Iterable[int]) -> bytes:
    """Token or block ids → packed little-endian uint32 (4 bytes each)."""
    try:
        packed = array(_U32_CODE, values)
    except OverflowError as exc:
        raise ValueError(f"ids must be in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_u32(data: bytes) -> list[int]:
    """Inverse of :func:`pack_u32`."""
    if len(data) % 4:
        raise StateError(f"packed id list has {len(data)} bytes, not a multiple of 4")
    unpacked = array(_U32_CODE)
    unpacked.frombytes(data)
    if sys.byteorder == "big":
        unpacked.byteswap()
    return unpacked.tolist()


def dumps(obj: Any) -> bytes:
    """Compact JSON as UTF-8 bytes."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


_D = TypeVar("_D")


def from_json_fields(cls: type[_D], data: bytes | str) -> _D:
    """Build dataclass ``cls`` from a JSON object, ignoring keys it does not know.

    Unknown keys are what a newer writer adds during a rolling upgrade; a missing key raises.
    """
    obj = json.loads(data)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in obj.items() if k in names})


def _non_negative(obj: object, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be >= 0, got {getattr(obj, name)}")


# ---------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ServiceInfo:
    """One live process in the registry.

    ``address`` is where its gRPC server listens (``host:port``); ``extra`` carries role-specific
    facts (device, model, unit count) as strings.
    """

    service_id: str
    role: Role
    cell_id: str
    address: str
    pid: int
    started_unix_s: float
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.service_id:
            raise ValueError("ServiceInfo.service_id must be non-empty")
        if self.role not in ROLES:
            raise ValueError(f"ServiceInfo.role must be one of {sorted(ROLES)}, got {self.role!r}")
        _non_negative(self, "pid", "started_unix_s")


@dataclass(frozen=True)
class RequestRecord:
    """Everything needed to resume one request after a service restarts; ids and lengths only.

    ``num_computed_tokens`` counts tokens whose K/V is in ``block_ids``. ``generator_state`` is
    the sampler's RNG state so a resumed request samples what it would have. ``updated_unix_ns``
    is stamped by the store on every write (the value given to ``create`` is replaced).
    """

    request_id: str
    cell_id: str
    router_id: str
    state: RequestState
    prompt_token_ids: list[int]
    arrival_unix_ns: int
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    sampling: dict[str, Any] = field(default_factory=dict)
    generator_state: bytes = b""
    decode_service_id: str | None = None
    updated_unix_ns: int = 0
    model: str = ""  # the served name of the cell's model that decodes it (a cell may serve several)

    def __post_init__(self) -> None:
        if not self.request_id or not self.cell_id:
            raise ValueError("RequestRecord.request_id and cell_id must be non-empty")
        check_request_state(self.state)
        _non_negative(self, "num_computed_tokens", "arrival_unix_ns", "updated_unix_ns")

    @property
    def is_active(self) -> bool:
        """Whether the request is still in prefill or decode."""
        return self.state in ACTIVE_STATES


def check_request_state(state: str) -> None:
    if state not in ACTIVE_STATES | FINISHED_STATES:
        raise ValueError(f"request state must be one of prefill/decode/done/failed, got {state!r}")


# ---------------------------------------------------------------------- record <-> hash fields


def request_to_fields(record: RequestRecord) -> dict[str, bytes]:
    """The ``N:req:{id}`` hash fields of ``record`` (its outputs live in ``N:out:{id}``)."""
    return {
        "request_id": record.request_id.encode(),
        "cell_id": record.cell_id.encode(),
        "router_id": record.router_id.encode(),
        "state": record.state.encode(),
        "prompt_token_ids": pack_u32(record.prompt_token_ids),
        "block_ids": pack_u32(record.block_ids),
        "num_computed_tokens": str(record.num_computed_tokens).encode(),
        "sampling": dumps(record.sampling),
        "generator_state": bytes(record.generator_state),
        "decode_service_id": (record.decode_service_id or "").encode(),
        "arrival_unix_ns": str(record.arrival_unix_ns).encode(),
        "updated_unix_ns": str(record.updated_unix_ns).encode(),
        "model": record.model.encode(),
    }


def request_from_fields(fields: Mapping[bytes, bytes], outputs: bytes | None) -> RequestRecord:
    """Inverse of :func:`request_to_fields` plus the packed outputs (None = no outputs yet)."""
    f = {k.decode(): v for k, v in fields.items()}
    state = f["state"].decode()
    check_request_state(state)
    return RequestRecord(
        request_id=f["request_id"].decode(),
        cell_id=f["cell_id"].decode(),
        router_id=f["router_id"].decode(),
        state=state,  # type: ignore[arg-type]  # checked just above
        prompt_token_ids=unpack_u32(f["prompt_token_ids"]),
        arrival_unix_ns=int(f["arrival_unix_ns"]),
        output_token_ids=unpack_u32(outputs or b""),
        block_ids=unpack_u32(f["block_ids"]),
        num_computed_tokens=int(f["num_computed_tokens"]),
        sampling=json.loads(f["sampling"]),
        generator_state=f["generator_state"],
        decode_service_id=f["decode_service_id"].decode() or None,
        updated_unix_ns=int(f["updated_unix_ns"]),
        model=f.get("model", b"").decode(),
    )


def pairs_from_flat(flat: list[bytes]) -> dict[bytes, bytes]:
    """``[k1, v1, k2, v2, ...]`` (an HGETALL reply inside a Lua script) → dict."""
    return dict(zip(flat[0::2], flat[1::2]))


# Returns the values of the index's members whose keys still exist and prunes the rest, in one
# atomic step: pruning outside a script could remove a member that re-registered in between.
LIVE_MEMBERS_LUA: Final = """
local values = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local value = redis.call('GET', ARGV[1] .. id)
  if value then values[#values + 1] = value else redis.call('SREM', KEYS[1], id) end
end
return values
"""
