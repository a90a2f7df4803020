"""The router's HTTP server under each of uvicorn's parsers (``TANDEM_HTTP_PARSER``): a real
uvicorn on a real socket streams server-sent events the same way with h11, httptools and the
default. The gateway here only hands ``start_http`` a small Starlette app (an SSE stream and a
JSON echo): the router's own endpoints are tested on the whole stack elsewhere."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from router.config import HTTP_PARSERS, http_parser, parse_args
from router.http import start_http
from router.server import serve
from tandem.service.runtime import service_main


class _App:
    """A stand-in for ``Gateway``: ``start_http`` needs only its ``app()``."""

    def app(self) -> Starlette:
        async def stream(request: Request) -> StreamingResponse:
            body = await request.json()

            async def events() -> AsyncIterator[str]:
                for i in range(body["n"]):
                    yield f"data: {json.dumps({'i': i, 'text': body['text']})}\n\n"
                    await asyncio.sleep(0)
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        async def echo(request: Request) -> JSONResponse:
            return JSONResponse(await request.json())
        return Starlette(routes=[Route("/stream", stream, methods=["POST"]), Route("/echo", echo, methods=["POST"])])


@pytest.mark.parametrize("parser", HTTP_PARSERS)
def test_each_parser_streams_events_and_echoes_bodies(parser: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_HTTP_PARSER", parser)
    rng = random.Random(parser)

    async def run() -> None:
        server = await start_http(_App(), "127.0.0.1", 0)  # type: ignore[arg-type]
        try:
            assert server.server.config.http == parser
            async with httpx.AsyncClient(base_url=f"http://{server.address}") as client:
                for _ in range(5):
                    n = rng.randint(0, 200)
                    text = "".join(rng.choice("abc é😀\n\"") for _ in range(rng.randint(0, 300)))
                    async with client.stream("POST", "/stream", json={"n": n, "text": text}) as response:
                        assert response.status_code == 200
                        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
                    assert lines[-1] == "data: [DONE]"
                    assert [json.loads(line[6:]) for line in lines[:-1]] == [{"i": i, "text": text} for i in range(n)]
                    body = {"k": text, "n": n}
                    assert (await client.post("/echo", json=body)).json() == body
        finally:
            await server.stop()
    asyncio.run(run())


def test_the_parser_defaults_to_auto_and_another_name_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TANDEM_HTTP_PARSER", raising=False)
    assert http_parser() == "auto"
    monkeypatch.setenv("TANDEM_HTTP_PARSER", "fast")
    with pytest.raises(ValueError, match="TANDEM_HTTP_PARSER"):
        http_parser()
    # The router refuses it at its flags, exit 2 with one line, before it serves anything.
    with pytest.raises(SystemExit) as exited:
        for name in ("config.json", "tokenizer.json"):
            (tmp_path / name).write_text("{}")
        service_main("router", parse_args, serve, ["--model", str(tmp_path), "--prefill-address", "a:1",
                                                   "--decode-address", "c:3", "--http-port", "0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("router: error: TANDEM_HTTP_PARSER must be one of") and "\n" not in err
