"""Request records: enough of every in-flight request to resume it after a service restarts.

The router creates a record on admission, prefill and decode move it through
``prefill → decode → done | failed`` with :meth:`RequestStore.set_state`, and decode appends each
step's tokens with :meth:`RequestStore.append_outputs`. A per-cell set of active ids makes
:meth:`RequestStore.list_active` a single round trip without scanning the keyspace.

Every write is one Lua script or one MULTI/EXEC. Redis runs a script to the end without running
any other client's command in between, so a reader sees a decode step entirely or not at all, and
a writer that crashes mid-call leaves either the whole step or none of it. Scripts (rather than a
bare MULTI) let a write skip a record that is gone or finished without first reading it under
WATCH — a write never resurrects half a record that was deleted meanwhile.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final, NamedTuple

import redis.asyncio as aredis

from tandem.state.schema import (
    ACTIVE_STATES,
    DEFAULT_NAMESPACE,
    FINISHED_STATES,
    Keys,
    RequestRecord,
    RequestState,
    StateError,
    check_client,
    check_request_state,
    dumps,
    pack_u32,
    pairs_from_flat,
    request_from_fields,
    request_to_fields,
    ttl_ms,
)


class RequestExistsError(StateError):
    """``create`` was called with the id of a request that is still active."""


class OutputUpdate(NamedTuple):
    """One request's share of a decode step, as given to :meth:`RequestStore.append_outputs`.

    Plain tuples in this field order are accepted too. ``block_ids`` None leaves the stored
    block table unchanged (most steps do not grow it).
    """

    request_id: str
    new_token_ids: Sequence[int]
    num_computed_tokens: int
    generator_state: bytes
    block_ids: Sequence[int] | None = None


# KEYS: the record's hash, its outputs string, its cell's active set.
# ARGV: request id, TTL in ms ("0": active, no TTL), packed outputs, "replace" or "create",
# then field/value pairs. A finished (done/failed) record is always replaced: a finished
# request's id is free for a new one; an active one only in "replace" mode.
_CREATE_LUA: Final = """
local state = redis.call('HGET', KEYS[1], 'state')
if ARGV[4] ~= 'replace' and state and state ~= 'done' and state ~= 'failed' then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
if #ARGV[3] > 0 then redis.call('SET', KEYS[2], ARGV[3]) end
if ARGV[2] == '0' then
  redis.call('SADD', KEYS[3], ARGV[1])
else
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return 1
"""

# KEYS: per record i, its hash (2i-1) and outputs string (2i).
# ARGV[1]: active-set key prefix ("N:active:"); ARGV[2]: now in unix ns; then per record:
#   mode ("append" | "active" | "finished"), TTL in ms, bytes to append, number of field/value
#   pairs, the pairs.
# "append" skips finished records: tokens that arrive after a cancel must not change a record the
# router may already have read. Returns the 1-based positions of the records it skipped.
_UPDATE_LUA: Final = """
local skipped = {}
local a = 3
for i = 1, #KEYS / 2 do
  local h, o = KEYS[2 * i - 1], KEYS[2 * i]
  local mode, ttl, app, nf = ARGV[a], ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3])
  local first, last = a + 4, a + 3 + 2 * nf
  a = last + 1
  local state = redis.call('HGET', h, 'state')
  if (not state) or (mode == 'append' and (state == 'done' or state == 'failed')) then
    skipped[#skipped + 1] = i
  else
    redis.call('HSET', h, 'updated_unix_ns', ARGV[2])
    if nf > 0 then redis.call('HSET', h, unpack(ARGV, first, last)) end
    if #app > 0 then redis.call('APPEND', o, app) end
    if mode ~= 'append' then
      local active = ARGV[1] .. redis.call('HGET', h, 'cell_id')
      local id = redis.call('HGET', h, 'request_id')
      if mode == 'active' then
        redis.call('SADD', active, id)
        redis.call('PERSIST', h)
        redis.call('PERSIST', o)
      else
        redis.call('SREM', active, id)
        redis.call('PEXPIRE', h, ttl)
        redis.call('PEXPIRE', o, ttl)
      end
    end
  end
end
return skipped
"""

# KEYS: the record's hash and outputs string. ARGV[1]: active-set key prefix.
_DELETE_LUA: Final = """
local cell = redis.call('HGET', KEYS[1], 'cell_id')
if cell then redis.call('SREM', ARGV[1] .. cell, redis.call('HGET', KEYS[1], 'request_id')) end
redis.call('DEL', KEYS[2])
return redis.call('DEL', KEYS[1])
"""

# KEYS[1]: a cell's active set. ARGV: hash key prefix, outputs key prefix.
# Returns [fields_1, outputs_1, fields_2, outputs_2, ...]; drops ids whose record is gone.
_LIST_ACTIVE_LUA: Final = """
local reply = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local fields = redis.call('HGETALL', ARGV[1] .. id)
  if #fields == 0 then
    redis.call('SREM', KEYS[1], id)
  else
    reply[#reply + 1] = fields
    reply[#reply + 1] = redis.call('GET', ARGV[2] .. id)
  end
end
return reply
"""

# Fields set_state may change; the rest are fixed at create (ids, arrival), append-only
# (outputs) or the store's own (updated_unix_ns).
_SETTABLE_FIELDS: Final = frozenset({"router_id", "prompt_token_ids", "block_ids",
                                     "num_computed_tokens", "sampling", "generator_state",
                                     "decode_service_id"})


class RequestStore:
    """Request records of one namespace.

    Invariants: a record is in its cell's active set exactly while its state is prefill or decode;
    an active record never expires; a done/failed record (and its outputs) expires
    ``finished_ttl_s`` after it finished. Output token ids only grow.
    """

    def __init__(self, client: aredis.Redis, *, namespace: str = DEFAULT_NAMESPACE,
                 finished_ttl_s: float = 60.0) -> None:
        check_client(client)
        self._client = client
        self._keys = Keys(namespace)
        self._finished_ttl_ms = ttl_ms(finished_ttl_s, "RequestStore finished_ttl_s")
        self._create = client.register_script(_CREATE_LUA)
        self._update = client.register_script(_UPDATE_LUA)
        self._delete = client.register_script(_DELETE_LUA)
        self._list_active = client.register_script(_LIST_ACTIVE_LUA)

    async def create(self, record: RequestRecord, *, replace: bool = False) -> None:
        """Store a new record (``updated_unix_ns`` stamped now) and index it if active.

        A finished record of the same id is replaced (a client may reuse a finished request's
        id); raises :class:`RequestExistsError` if the id's request is still active, unless
        ``replace`` (a service rewriting its own request whole, e.g. after Redis lost it).
        """
        fields = request_to_fields(record)
        fields["updated_unix_ns"] = str(time.time_ns()).encode()
        ttl = 0 if record.is_active else self._finished_ttl_ms
        args: list[bytes | str | int] = [record.request_id, ttl, pack_u32(record.output_token_ids),
                                         "replace" if replace else "create"]
        for name, value in fields.items():
            args += [name, value]
        keys = [self._keys.request(record.request_id), self._keys.outputs(record.request_id),
                self._keys.active(record.cell_id)]
        if not await self._create(keys=keys, args=args):
            raise RequestExistsError(f"request {record.request_id!r} already has a record")

    async def get(self, request_id: str) -> RequestRecord | None:
        """The record of ``request_id`` as of one instant, or None if there is none."""
        return (await self.get_many([request_id]))[0]

    async def get_many(self, request_ids: Sequence[str]) -> builtins.list[RequestRecord | None]:
        """The records of ``request_ids`` (None where there is none), in one round trip."""
        if not request_ids:
            return []
        async with self._client.pipeline(transaction=True) as pipe:  # one instant for all
            for request_id in request_ids:
                pipe.hgetall(self._keys.request(request_id))
                pipe.get(self._keys.outputs(request_id))
            replies = await pipe.execute()
        return [request_from_fields(fields, outputs) if fields else None
                for fields, outputs in zip(replies[::2], replies[1::2], strict=True)]

    async def append_outputs(
        self, updates: Iterable[tuple[str, Sequence[int], int, bytes, Sequence[int] | None]],
    ) -> builtins.list[str]:
        """Apply one decode step to many requests atomically (one script, one round trip).

        Each update appends ``new_token_ids`` to the request's outputs and sets
        ``num_computed_tokens``, ``generator_state`` and, unless None, ``block_ids``. Returns the
        ids it skipped — no record, or already done/failed — so the caller can drop them.
        """
        step = builtins.list(updates)
        if not step:
            return []
        keys: list[str] = []
        args: list[bytes | str | int] = [self._keys.active(""), time.time_ns()]
        for request_id, new_token_ids, num_computed_tokens, generator_state, block_ids in step:
            if num_computed_tokens < 0:
                raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
            keys += [self._keys.request(request_id), self._keys.outputs(request_id)]
            pairs: list[bytes | str | int] = ["num_computed_tokens", num_computed_tokens,
                                              "generator_state", bytes(generator_state)]
            if block_ids is not None:
                pairs += ["block_ids", pack_u32(block_ids)]
            args += ["append", 0, pack_u32(new_token_ids), len(pairs) // 2, *pairs]
        skipped = await self._update(keys=keys, args=args)
        return [step[int(i) - 1][0] for i in skipped]

    async def set_state(self, request_id: str, state: RequestState, **fields: Any) -> bool:
        """Move a request to ``state`` and set any of ``fields`` in the same atomic step.

        ``fields`` may name router_id, prompt_token_ids, block_ids, num_computed_tokens,
        sampling, generator_state and decode_service_id (TypeError otherwise). Entering
        done/failed drops the id from the cell's active set and starts the record's expiry;
        entering prefill/decode (re)indexes it and cancels any expiry. Returns False, changing
        nothing, if the request has no record.
        """
        check_request_state(state)
        unknown = set(fields) - _SETTABLE_FIELDS
        if unknown:
            raise TypeError(f"set_state cannot set {sorted(unknown)}; settable: {sorted(_SETTABLE_FIELDS)}")
        pairs: list[bytes | str | int] = ["state", state]
        for name, value in fields.items():
            pairs += [name, _encode_field(name, value)]
        mode = "active" if state in ACTIVE_STATES else "finished"
        assert mode == "active" or state in FINISHED_STATES
        args: list[bytes | str | int] = [self._keys.active(""), time.time_ns(),
                                         mode, self._finished_ttl_ms, b"", len(pairs) // 2, *pairs]
        keys = [self._keys.request(request_id), self._keys.outputs(request_id)]
        return not await self._update(keys=keys, args=args)

    async def delete(self, request_id: str) -> bool:
        """Remove the record, its outputs and its index entry now; False if there was none."""
        keys = [self._keys.request(request_id), self._keys.outputs(request_id)]
        return bool(await self._delete(keys=keys, args=[self._keys.active("")]))

    async def list_active(self, cell_id: str,
                          state: RequestState | None = None) -> builtins.list[RequestRecord]:
        """The cell's requests in prefill or decode (only ``state`` if given), by arrival.

        One consistent snapshot: no step is half-visible across the records returned.
        """
        if state is not None and state not in ACTIVE_STATES:
            raise ValueError(f"list_active lists prefill/decode requests, not {state!r}")
        reply = await self._list_active(keys=[self._keys.active(cell_id)],
                                        args=[self._keys.request(""), self._keys.outputs("")])
        records = [request_from_fields(pairs_from_flat(reply[i]), reply[i + 1])
                   for i in range(0, len(reply), 2)]
        return sorted((r for r in records if r.is_active and (state is None or r.state == state)),
                      key=lambda r: (r.arrival_unix_ns, r.request_id))


def _encode_field(name: str, value: Any) -> bytes:
    """One settable field's hash encoding (see the schema module docstring)."""
    if name in ("prompt_token_ids", "block_ids"):
        return pack_u32(value)
    if name == "num_computed_tokens":
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"num_computed_tokens must be an int >= 0, got {value!r}")
        return str(value).encode()
    if name == "sampling":
        return dumps(dict(value))
    if name == "generator_state":
        return bytes(value)
    if name == "decode_service_id":
        return (value or "").encode()
    return str(value).encode()  # router_id
