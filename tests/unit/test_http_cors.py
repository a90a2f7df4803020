"""Cross-origin calls from a browser (CORS) to the HTTP API, on the real Gateway app in process
(httpx's ASGI transport; the router core's upstream is ``FakeUpstream``, a test double, since
no prefill or decode service runs in a unit test)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

from router.config import RouterConfig, parse_args
from router.core import RouterCore
from router.http import Gateway
from router.metrics import RouterMetrics
from router.models import ServedModels
from tandem.engine.config import ModelConfig
from tandem.engine.tokenizer import Tokenizer
from tests.unit.test_router_stream_gaps import FakeUpstream

KEY = "sk-test"


def _gateway(smollm2_dir: Path, origins: tuple[str, ...]) -> Gateway:
    config = RouterConfig(model_dir=smollm2_dir, host="127.0.0.1", grpc_port=0, prefill_addresses=("h:1",),
                          decode_addresses=("h:2",), redis_url="", cell_id="c", router_id="r", stall_timeout_s=30,
                          request_timeout_s=60, api_key=KEY, allowed_origins=origins)
    metrics = RouterMetrics()
    core = RouterCore(config, Tokenizer.from_dir(smollm2_dir), ModelConfig.from_dir(smollm2_dir),  # type: ignore[arg-type]
                      FakeUpstream(), metrics.for_model("m"), None, model_id="m")
    return Gateway(ServedModels([core]), metrics, KEY, allowed_origins=origins)


async def _calls(gateway: Gateway, origin: str) -> tuple[httpx.Response, httpx.Response, httpx.Response]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app()), base_url="http://router") as http:
        preflight = await http.options("/v1/chat/completions", headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        keyed = await http.get("/v1/models", headers={"origin": origin, "authorization": f"Bearer {KEY}"})
        unkeyed = await http.get("/v1/models", headers={"origin": origin})
    return preflight, keyed, unkeyed


@pytest.mark.parametrize("seed", range(3))
def test_pages_of_allowed_origins_may_call_and_still_need_the_key(smollm2_dir: Path, seed: int) -> None:
    rng = random.Random(seed)
    allowed = tuple(f"https://app{i}.example:{rng.randint(1000, 9999)}" for i in range(rng.randint(1, 3)))
    other = "https://elsewhere.example"
    for origins in (("*",), allowed, ()):
        gateway = _gateway(smollm2_dir, origins)
        for origin in (rng.choice(allowed), other):
            preflight, keyed, unkeyed = asyncio.run(_calls(gateway, origin))
            let_in = "*" in origins or origin in origins
            allow = preflight.headers.get("access-control-allow-origin")
            if let_in:
                # the preflight carries no key and is answered before the key check
                assert preflight.status_code == 200 and allow in ("*", origin), (origins, origin)
                assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
                assert keyed.headers.get("access-control-allow-origin") in ("*", origin)
            else:
                assert allow is None and keyed.headers.get("access-control-allow-origin") is None
            assert keyed.status_code == 200 and keyed.json()["data"][0]["id"] == "m"
            assert unkeyed.status_code == 401  # CORS lets a page call; the key is still needed


def test_the_flag_takes_a_list_and_empty_means_none(smollm2_dir: Path) -> None:
    base = ["--model", str(smollm2_dir), "--prefill-address", "h:1", "--decode-address", "h:2"]
    assert parse_args(base).allowed_origins == ("*",)
    assert parse_args([*base, "--allowed-origins", "https://a.example, http://b:3000"]).allowed_origins == (
        "https://a.example", "http://b:3000")
    assert parse_args([*base, "--allowed-origins", ""]).allowed_origins == ()
