"""One trace per request across router → prefill → decode, exported by the real processes.

The stack runs with the standard ``OTEL_TRACES_EXPORTER=console``; each process writes its
spans as JSON to its log, and the test joins them by trace id.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest

from tandem.rpc.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.integration.stack import Stack, write_tiny_chat_model

_SPAN_RE = re.compile(r'"name": "([^"]+)",\s*"context": \{\s*"trace_id": "(0x[0-9a-f]+)"')


@pytest.mark.parametrize("policy", ["dynamic", "chunked"])
def test_one_trace_spans_every_process(smollm2_dir: Path, tmp_path: Path, policy: str) -> None:
    """Split mode (dynamic): prefill's queue, forward and layer-group spans. Aggregated mode
    (chunked): prefill forwards the prompt, and decode's span shows the chunks it computed."""
    model_dir = write_tiny_chat_model(tmp_path / "model", smollm2_dir)
    stack = Stack(model_dir, tmp_path, num_blocks=128, extra_env={"OTEL_TRACES_EXPORTER": "console",
                                                                   "TANDEM_POLICY": policy})
    try:
        stack.start()

        async def generate() -> None:
            async with grpc.aio.insecure_channel(stack.address("router")) as channel:
                request = router_pb2.GenerateRequest(
                    messages=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="Hi")]),
                    sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                )
                async for _ in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60):
                    pass

        asyncio.run(generate())
    finally:
        stack.stop()  # processes flush their spans on the way out
    spans = {name: [] for name in ("router", "prefill_svc", "decode_svc")}  # type: dict[str, list[tuple[str, str]]]
    for name in spans:
        spans[name] = _SPAN_RE.findall(stack.logs(name))
    generate_traces = {t for n, t in spans["router"] if n == "tandem.v1.Router/Generate"}
    assert len(generate_traces) == 1, spans["router"]
    (trace_id,) = generate_traces
    prefill_names = {n for n, t in spans["prefill_svc"] if t == trace_id}
    decode_names = {n for n, t in spans["decode_svc"] if t == trace_id}
    assert {"tandem.v1.Decode/Handoff", "decode"} <= decode_names
    if policy == "dynamic":
        assert {"tandem.v1.Prefill/Submit", "prefill.queue", "prefill.forward"} <= prefill_names
        assert any(n.startswith("prefill.layers[") for n in prefill_names)
    else:
        assert "tandem.v1.Prefill/Submit" in prefill_names
        assert not any(n.startswith("prefill.layers[") for n in prefill_names)
        assert '"name": "prefill.chunk"' in stack.logs("decode_svc")
